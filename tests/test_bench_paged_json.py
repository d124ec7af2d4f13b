"""benchmarks/bench_paged.py returns what it prints in the layout of run "paged" of
kvlib/results.json, so that a re-run replaces the committed run like for like."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from types import ModuleType

import pytest
import torch
from _scripts import load_script

from kvlib import results

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("benchmarks/bench_paged.py")


@pytest.fixture(scope="module")
def committed() -> dict:
    entry = results.run("paged", results.load_results(results.results_path()))
    assert entry, "kvlib/results.json has no run 'paged'"
    return dict(entry)


def _quiet(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def _fields(group: dict) -> dict[str, list[str]]:
    return {key: sorted(row) for key, row in group.items()}


def committed_field(committed: dict, field: str):
    """The committed value of ``field`` in the first row (of any group) that has it."""
    for name in ("serving", "parallel_sampling"):
        for row in committed[name].values():
            if field in row:
                return row[field]
    raise AssertionError(f"{field} is in no committed row")


def test_simulation_rows_have_the_committed_keys_and_fields(bench, committed) -> None:
    groups = _quiet(bench.bench_simulation, 60)
    assert set(groups) == {"serving", "parallel_sampling"}
    for name, group in groups.items():
        assert _fields(group) == _fields(committed[name]), name
    serving = groups["serving"]
    for key, row in serving.items():
        assert ("block" in row) == key.startswith("paged-")
        if "block" in row:
            assert key == f"paged-{row['block']}"
    for group in groups.values():
        for row in group.values():
            for field, value in row.items():
                assert type(value) is type(committed_field(committed, field)), field


def test_simulation_is_deterministic(bench) -> None:
    assert _quiet(bench.bench_simulation, 60) == _quiet(bench.bench_simulation, 60)


def test_sharing_rows_match_the_committed_run(bench, committed) -> None:
    # independent of the request count and of timing: the committed figures themselves
    assert _quiet(bench.bench_sharing) == committed["prefix_sharing"]


def test_attention_row_has_the_committed_fields(bench, committed) -> None:
    g = torch.Generator().manual_seed(0)
    row = _quiet(bench._attention_case, 8, 512, g, 0.01, 9, 3, 64, 16)
    assert f"8-{row['context_lens']}" in committed["attention"]
    assert sorted(row) == sorted(committed["attention"]["8-128-512"])
    assert row["max_abs_diff"] < 1e-4


def test_settings_and_run_fields_match_the_committed_run(bench, committed, tmp_path) -> None:
    settings = {
        "requests": 60,
        "seed": bench.SEED,
        "kv_budget_gib": bench.CAPACITY // 2**30,
        "max_len": bench.MAX_LEN,
        "fp16_bytes_per_token": bench.SMOLLM2_FP16_BYTES_PER_TOKEN,
    }
    assert {k: v for k, v in settings.items() if k != "requests"} == {
        k: v for k, v in committed["settings"].items() if k != "requests"
    }
    assert sorted(settings) == sorted(committed["settings"])
    groups = _quiet(bench.bench_simulation, 60)
    groups["prefix_sharing"] = _quiet(bench.bench_sharing)
    entry = {
        "source": "benchmarks/bench_paged.py",
        "command": "python benchmarks/bench_paged.py --quick",
        "machine": bench.machine(1),
        "model": "SmolLM2-135M",
        "settings": settings,
        **groups,
    }
    path = results.record_run("paged", entry, tmp_path / "results.json")
    written = results.run("paged", results.load_results(path))
    assert written["source"] == committed["source"]
    assert written["model"] == committed["model"]
    assert set(written) - {"attention", "generation"} <= set(committed)
