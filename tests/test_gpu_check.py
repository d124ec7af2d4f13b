"""scripts/gpu_check.py: its dry run takes the GPU check's code path on CPU at tiny sizes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _load_gpu_check():
    path = ROOT / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_gpu_check_dry_run(capsys):
    gpu_check = _load_gpu_check()
    threads = torch.get_num_threads()
    try:
        rc = gpu_check.main(["--dry-run"])
    finally:
        torch.set_num_threads(threads)  # the dry run pins one thread
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| cache |" in out and "FAIL" not in out and "Traceback" not in out
    for title in ("Correctness against DynamicCache", "Memory and speed", "What fits"):
        assert f"### {title}" in out
    assert out.count("| PASS |") >= 3  # kvlib int8 / int4 / int2 against DynamicCache
    # the reference is named for the model's dtype and always runs first
    assert "| dynamic-fp32 | 32 | 0.0000 | 0.0000 | 1.000 | - | reference |" in out
    assert "| cache | bits | cache bytes | vs dynamic-fp32 |" in out
