"""benchmarks/bench_vllm.py without vLLM: its rows, deltas, capacity rows and the Markdown
tables it prints from a recorded run (the ones RESULTS.md quotes); its worker's independence
from kvlib (it runs in .venv-vllm); a clear exit without the peer environment."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest
from _scripts import load_script

from kvlib import specs
from kvlib.memory import GIB

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_vllm.py"
WORKER = ROOT / "benchmarks" / "_vllm_worker.py"
SPEC = specs.get_spec("smollm2-135m")


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_vllm.py")


def test_perplexity_and_deltas(bench):
    assert bench.perplexity([math.log(0.5)] * 4) == pytest.approx(2.0)
    assert bench.deltas_pct([10.5, 9.0], [10.0, 10.0]) == pytest.approx([5.0, -10.0])
    with pytest.raises(ValueError):
        bench.deltas_pct([1.0], [1.0, 2.0])


def test_rows_are_keyed_by_vllms_dtype_names_with_deltas_against_auto(bench):
    ppl = {"auto": [10.0, 20.0], "fp8": [10.5, 20.2], "fp8_e5m2": [11.0, 22.0]}
    rows = bench.perplexity_rows(ppl, SPEC)
    assert list(rows) == ["auto", "fp8", "fp8_e5m2"]
    assert rows["auto"]["perplexity_delta_pct_segments"] == [0.0, 0.0]
    assert rows["fp8"]["perplexity_delta_pct_segments"] == [5.0, 1.0]
    assert rows["fp8"]["perplexity_delta_pct_mean"] == 3.0
    assert rows["fp8_e5m2"]["perplexity_delta_pct_mean"] == 10.0
    assert rows["auto"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 2 == 23040
    assert rows["fp8"]["bytes_per_token"] == 11520
    assert rows["fp8"]["x_smaller_than_fp16"] == 2.0
    assert all(r["computed_correctly_on_cpu"] for r in rows.values())


def test_a_broken_dtype_gets_no_quality_figure(bench):
    row = bench.broken_row("int8_per_token_head", [123456.78])
    assert not row["computed_correctly_on_cpu"]
    assert "perplexity_delta_pct_mean" not in row and "perplexity_segments" not in row
    assert bench.bits_of("int8_per_token_head") is None
    assert bench.bits_of("auto") == 16 and bench.bits_of("fp8_e5m2") == 8


def test_capacity_row_compares_the_report_with_kvlibs_prediction(bench):
    run = {"engine_args": {"kv_cache_dtype": "fp8"}, "max_model_len": 2048,
           "block_size": 128, "num_blocks": 182, "kv_cache_size_tokens": 23296}  # fmt: skip
    row = bench.capacity_row(SPEC, run, 0.25)
    assert row["kv_space_bytes"] == GIB // 4
    assert row["predicted_tokens"] == row["reported_tokens"] == 23296
    assert row["error_pct"] == 0
    assert row["usable_tokens"] == 181 * 128  # one block is vLLM's null block
    run["kv_cache_size_tokens"] = 23296 * 2
    assert bench.capacity_row(SPEC, run, 0.25)["error_pct"] == -50


def _entry(bench):
    ppl = {"auto": [10.0, 20.0], "fp8": [10.5, 20.2]}
    cap = {"engine_args": {"kv_cache_dtype": "auto"}, "max_model_len": 2048,
           "block_size": 128, "num_blocks": 91, "kv_cache_size_tokens": 11648}  # fmt: skip
    return {
        "command": "python benchmarks/bench_vllm.py",
        "machine": "test CPU",
        "date": "2026-12-04",
        "rows": {
            **bench.perplexity_rows(ppl, SPEC),
            "int8_per_token_head": bench.broken_row("int8_per_token_head", [98765.4]),
        },
        "capacity": {"auto@0.25GiB": bench.capacity_row(SPEC, cap, 0.25)},
    }


def test_markdown_tables_quote_the_recorded_figures(bench):
    text = bench.markdown_tables(_entry(bench))
    assert "Command: `python benchmarks/bench_vllm.py`; test CPU; 2026-12-04." in text
    assert "| fp8 | 8 | 11520 | 2.0 | +3.0000 | +5.0000, +1.0000 | 15.3500 |" in text
    assert (
        "| int8_per_token_head | - | - | - | not computed correctly on CPU | - | 98765.4 |" in text
    )
    assert "| auto@0.25GiB | 128 | 91 | 11648 | 11648 | +0 |" in text


def test_worker_runs_cover_the_dtypes_and_capacity(bench):
    segments = [[1] * 16, [2] * 16]
    quick = bench.worker_runs(segments, quick=True)
    assert [r["name"] for r in quick] == ["auto", "fp8"]
    args = quick[0]["engine_args"]
    assert args["max_num_batched_tokens"] == bench.CHUNK == 64 and args["enable_chunked_prefill"]
    assert args["max_model_len"] >= 16 and not args["enable_prefix_caching"]
    full = bench.worker_runs(segments, quick=False)
    names = [r["name"] for r in full]
    assert names[:4] == list(bench.DTYPES) and "int8_per_token_head" in names
    broken = next(r for r in full if r["name"] == "int8_per_token_head")
    assert broken["segments"] == segments[:1]
    env_run = full[-1]
    assert env_run["env"] == {"VLLM_CPU_KVCACHE_SPACE": bench.ENV_SPACE_GIB}
    assert "kv_cache_memory_bytes" not in env_run["engine_args"]


def test_the_worker_imports_no_kvlib():
    tree = ast.parse(WORKER.read_text())
    imported = {
        (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not any(name.split(".")[0] in ("kvlib", "bench_engines") for name in imported)


def test_without_the_peer_environment_it_says_how_to_build_it(tmp_path):
    out = subprocess.run(
        [sys.executable, str(BENCH), "--peer-python", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode != 0 and "make vllm-peer" in out.stderr
