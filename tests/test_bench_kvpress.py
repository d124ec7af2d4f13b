"""benchmarks/bench_kvpress.py: the kept-set overlap it reports, its peer side's independence
from kvlib (it runs under transformers < 5.3), and a clear exit without the peer environment."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_kvpress.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kvpress", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overlap_counts_shared_positions_per_layer_and_head(bench):
    same = [[[0, 1, 2, 3], [0, 5, 6, 7]]]
    assert bench.overlap(same, same) == (1.0, 1.0)
    other = [[[0, 1, 2, 9], [0, 5, 6, 7]]]  # one of four differs in one head of two
    mean, identical = bench.overlap(same, other)
    assert mean == pytest.approx((3 / 4 + 1) / 2) and identical == 0.5
    with pytest.raises(ValueError):  # layers or heads that do not pair up
        bench.overlap(same, [[[0, 1, 2, 3]]])


def test_the_peer_side_imports_no_kvlib():
    tree = ast.parse(BENCH.read_text(encoding="utf-8"))
    peer = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "peer")
    names = {
        alias.name.split(".")[0]
        for node in ast.walk(peer)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(peer)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "kvpress" in names and "kvlib" not in names


def test_without_the_peer_environment_it_says_how_to_build_it(tmp_path):
    out = subprocess.run(
        [sys.executable, str(BENCH), "--peer-python", str(tmp_path / "none" / "python")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode != 0 and "make kvpress-peer" in out.stderr
