"""benchmarks/bench_kernel.py runs: one line and status 0 without a GPU, and every table at toy
sizes with ``--cpu-check`` (the kernel in Triton's interpreter, checked against the torch path,
nothing written to kvlib/results.json)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import torch
from _scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_kernel.py"


def test_without_a_gpu_it_says_so_in_one_line() -> None:
    if torch.cuda.is_available():  # pragma: no cover - CPU CI
        return
    module = load_script("benchmarks/bench_kernel.py")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert module.main([]) == 0
    assert out.getvalue() == module.NO_GPU + "\n"
    assert "no CUDA GPU" in module.NO_GPU


def test_cpu_check_runs_every_table() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(BENCH), "--cpu-check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for title in ("Decode-step attention", "Memory-bound decode steps", "Whole-model decode"):
        assert title in out
    assert "kvlib-int4 fused" in out and "cpu-check passed" in out
    assert "wrote run" not in done.stderr  # nothing recorded from a CPU check
