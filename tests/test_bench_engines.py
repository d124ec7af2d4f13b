"""benchmarks/bench_engines.py's rows and table from given perplexities and speeds (llama.cpp
itself is a peer built by ``make peers``: its runs are not repeated here)."""

from __future__ import annotations

from types import ModuleType

import pytest
from _scripts import load_script

from kvlib.eval.model_choice import random_config
from kvlib.memory import kv_bytes_per_token
from kvlib.specs import spec_from_config


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks/bench_engines.py")


def test_rows_cost_each_pair_against_f16_on_each_segment(bench: ModuleType) -> None:
    config = random_config("smollm2-135m", num_layers=2, vocab_size=64, intermediate_size=64)
    names = [bench.pair_name(k, v) for k, v in bench.PAIRS]
    ref = bench.pair_name("f16", "f16")
    ppl = {n: [10.0 + i / 10, 20.0] for i, n in enumerate(names)}
    speed = {n: 100.0 / (1 + i) for i, n in enumerate(names)}
    rows = bench.type_rows(config, ppl, speed, ref)
    assert list(rows) == names
    assert rows[ref]["perplexity_delta_pct_segments"] == [0.0, 0.0]
    assert rows[ref]["x_smaller_than_fp16"] == 1.0
    assert rows[ref]["bytes_per_token"] == kv_bytes_per_token(spec_from_config(config))
    q8 = rows[bench.pair_name("q8_0", "q8_0")]
    assert q8["perplexity_delta_pct_segments"] == [1.0, 0.0]
    assert q8["slowdown_vs_reference"] == 2.0
    assert q8["bits_per_element"] == [8.5, 8.5]
    assert q8["x_smaller_than_fp16"] == pytest.approx(16 / 8.5, abs=1e-3)
    lines = bench.table(rows).splitlines()
    assert len(lines) == 2 + len(names)
    assert {line.count("|") for line in lines} == {9}
