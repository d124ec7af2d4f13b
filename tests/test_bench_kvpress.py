"""benchmarks/bench_kvpress.py: the kept-set overlap it reports, its peer side's independence
from kvlib (it runs under transformers < 5.3), and a clear exit without the peer environment."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from _scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_kvpress.py"


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_kvpress.py")


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


def test_rows_compare_the_two_sides_press_by_press(bench):
    from types import SimpleNamespace

    tok = SimpleNamespace(decode=lambda tokens, skip_special_tokens: " ".join(map(str, tokens)))
    prompts = [SimpleNamespace(answer="42"), SimpleNamespace(answer="7")]
    kept = [[[0, 1, 2, 3]]]

    def runs(tokens_of_second: list[int]) -> list[dict]:
        return [
            {"policy": p, "ratio": r, "prompt": i, "kept": kept, "tokens": t}
            for p in bench.PRESSES
            for r in bench.RATIOS
            for i, t in enumerate(([42], tokens_of_second))
        ]

    rows = bench.compare_rows(runs([7]), runs([8]), prompts, tok)
    assert list(rows)[:3] == ["streaming@0.5", "streaming@0.25", "streaming@0.125"]
    assert len(rows) == len(bench.PRESSES) * len(bench.RATIOS)
    row = rows["snapkv@0.25"]
    assert (row["kvlib_correct"], row["kvpress_correct"], row["same_answer_tokens"]) == (2, 1, 1)
    assert row["kept_overlap"] == 1.0 and row["prompts"] == 2
    assert "| snapkv@0.25 | 1.000 | 1.00 | 2/2 | 1/2 | 1/2 |" in bench.table(rows).splitlines()
