"""benchmarks/bench_cache.py's steps on a tiny randomly initialised Llama (no weights, nothing
written to kvlib/results.json): the rows, the segments, the decode timings, the tables with
their targets, and the results file's rows."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from _scripts import load_script
from transformers import LlamaConfig, LlamaForCausalLM

CACHES = ["kvlib-int8", "kvlib-int4", "kvlib-int2"]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks/bench_cache.py")


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=96,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def measured(bench: ModuleType, model: LlamaForCausalLM) -> tuple[dict, dict, dict]:
    ids = torch.randint(0, 96, (1, 3 * 160), generator=torch.Generator().manual_seed(1))
    facs = bench.factories(model, CACHES)
    rows = bench.quality_rows(model, ids[:, :160], facs)
    segs = [ids[:, 160:320], ids[:, 320:]]
    deltas = bench.segment_deltas(model, segs, facs, {n: r["delta_pct"] for n, r in rows.items()})
    speed = bench.decode_speeds(model, facs, ids[:, :64], new_tokens=3, repeats=1)
    return rows, deltas, speed


def test_rows_put_the_reference_first_at_no_cost(measured: tuple[dict, dict, dict]) -> None:
    rows, deltas, _ = measured
    assert list(rows) == ["dynamic-fp32", *CACHES]
    assert rows["dynamic-fp32"]["delta_pct"] == 0.0
    assert deltas["dynamic-fp32"] == [0.0, 0.0, 0.0]
    for name in CACHES:
        assert len(deltas[name]) == 3 and deltas[name][0] == rows[name]["delta_pct"]
    # fewer bits hold fewer bytes at 4,096 tokens
    held = [rows[n]["bytes_per_token_4096"] for n in CACHES]
    assert held == sorted(held, reverse=True) and rows["kvlib-int2"]["ratio_4096"] > 4


def test_skipped_caches_are_not_timed_and_the_reference_is(
    measured: tuple[dict, dict, dict],
) -> None:
    _, _, speed = measured
    assert list(speed) == ["dynamic-fp32", "kvlib-int4", "kvlib-int2"]
    assert all(s.decode_tokens_per_s > 0 for s in speed.values())


def test_tables_apply_the_targets_by_name(bench: ModuleType, measured: tuple) -> None:
    rows, deltas, speed = measured
    fake = {**rows, "kvlib-int4": {**rows["kvlib-int4"], "delta_pct": 0.05, "ratio_4096": 3.5}}
    lines = {
        line.split(" | ")[0][2:]: line for line in bench.quality_table(fake, deltas).split("\n")
    }
    assert lines["kvlib-int4"].endswith("| Δ ≤ 0.1 %, ≥ 3.0× @4096 | PASS |")
    fake["kvlib-int4"]["ratio_4096"] = 2.9
    lines = {
        line.split(" | ")[0][2:]: line for line in bench.quality_table(fake, deltas).split("\n")
    }
    assert lines["kvlib-int4"].endswith("| FAIL |")
    assert lines["dynamic-fp32"].endswith("|  |  |")
    seg = bench.segments_table({**deltas, "kvlib-int2": [1.0, 11.0, 2.0]}).split("\n")
    assert "dynamic-fp32" not in "\n".join(seg)
    int2 = next(line for line in seg if line.startswith("| kvlib-int2 "))
    assert "| +4.667 | +11.000 | Δ ≤ 10.0 % | no |" in int2
    assert "≤ 1.5× Dynamic" not in bench.decode_table(speed)  # no quanto-int4 row to compare


def test_run_rows_carry_segments_only_when_there_are_several(bench: ModuleType, measured) -> None:
    rows, deltas, speed = measured
    full = bench.run_rows(rows, deltas)
    assert full["kvlib-int4"]["perplexity_delta_pct_segments"] == [
        round(x, 4) for x in deltas["kvlib-int4"]
    ]
    one = bench.run_rows(rows, {n: d[:1] for n, d in deltas.items()})
    assert "perplexity_delta_pct_mean" not in one["kvlib-int4"]
    decode = bench.decode_rows(speed)
    assert decode["dynamic-fp32"]["slowdown_vs_reference"] == 1.0


def test_bad_arguments_are_refused(bench: ModuleType) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--segments", "0"])
    args = bench.parse_args(["--quick"])
    assert (args.tokens, args.new_tokens) == (1024, 64)
