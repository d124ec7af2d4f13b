"""benchmarks/bench_eviction.py: the Markdown tables it prints from a recorded run (the ones
RESULTS.md quotes), with and without several perplexity segments."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_eviction.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))  # the script imports its neighbour ``_machine``
    try:
        spec = importlib.util.spec_from_file_location("bench_eviction", BENCH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH.parent))
    return module


def _row(delta, acc, fraction, segments=None):
    row = {
        "perplexity": 10.0,
        "perplexity_delta_pct": delta,
        "fp16_fraction": fraction,
        "retrieval_1024": acc,
        "retrieval_1024_ci": [acc / 2, 1.0],
        "retrieval_multi_1024": acc / 2,
        "retrieval_multi_1024_ci": [0.0, acc],
    }
    if segments:
        row["perplexity_delta_pct_segments"] = segments
        row["perplexity_delta_pct_mean"] = sum(segments) / len(segments)
    return row


def _run(segments: int) -> dict:
    seg = segments > 1
    rows = {
        "dynamic-fp32": _row(0.0, 1.0, 2.0, [0.0] * segments if seg else None),
        "evict-h2o-int4@1/4": _row(0.5, 0.95, 0.25, [0.5, 0.25, 0.75] if seg else None),
        "kvtc@1/4": {
            "retrieval_1024": 0.9,
            "retrieval_1024_ci": [0.7, 0.97],
            "retrieval_1024_fp16_fraction": 0.224,
            "retrieval_multi_1024": 0.6,
            "retrieval_multi_1024_ci": [0.4, 0.8],
        },
    }
    best = {"1/4 eviction+int4": "evict-h2o-int4@1/4", "1/4 transform coding": "kvtc@1/4"}
    return {"rows": rows, "best": best, "settings": {"segments": segments}}


def test_tables_quote_the_mean_and_every_segment(bench):
    text = bench.markdown_tables(_run(3))
    lines = text.splitlines()
    assert lines[0] == (
        "| budget | family | best row | Δ perplexity, mean (%) | per segment (%) | "
        "retrieval @1024 [95 % CI] | retrieval multi @1024 [95 % CI] | bytes / fp16 |"
    )
    assert (
        "| 1/4 | eviction+int4 | evict-h2o-int4@1/4 | +0.500 | +0.50 / +0.25 / +0.75 | "
        "0.95 [0.47, 1.00] | 0.47 [0.00, 0.95] | 0.250 |"
    ) in lines
    assert "| 1/4 | transform coding | kvtc@1/4 | n/a | n/a | 0.90 [0.70, 0.97] | " in text
    assert "| kvtc@1/4 | n/a | n/a | 0.90 | 0.60 | 0.224 |" in lines
    # every table row has as many cells as its header
    tables = [[ln for ln in b.splitlines() if ln.startswith("|")] for b in text.split("\n\n")]
    assert [len(t) for t in tables if t] == [5, 5]  # header, rule, reference + 2 best; 3 rows
    for table in filter(None, tables):
        assert {ln.count("|") for ln in table} == {table[0].count("|")}


def test_one_segment_prints_the_single_cost(bench):
    text = bench.markdown_tables(_run(1))
    assert "| evict-h2o-int4@1/4 | +0.500 | 0.95 | 0.47 | 0.250 |" in text.splitlines()
    assert "per segment" not in text
