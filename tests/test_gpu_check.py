"""scripts/gpu_check.py: its dry run takes the GPU check's code path on CPU at tiny sizes."""

from __future__ import annotations

from pathlib import Path

import torch
from _scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _load_gpu_check():
    return load_script("scripts/gpu_check.py")


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
    # the attention path is recorded: on a CPU the quantized caches take their torch path
    line = next(ln for ln in out.splitlines() if ln.startswith("Attention: "))
    assert line.endswith("kvlib's quantized caches decode through their torch path.")
    run = gpu_check.run_from_log(out)
    assert run["settings"]["kvlib_decode_path"] == "their torch path"
    assert run["settings"]["attention"] in ("sdpa", "eager")


H200_LOG = ROOT / "benchmarks" / "gpu_h200_2026-12-04" / "gpu_check.log"


def test_run_from_log_reads_every_cell_of_the_h200_log():
    """Every number of the log's two tables lands in the run, under its cache."""
    gpu_check = _load_gpu_check()
    text = H200_LOG.read_text(encoding="utf-8")
    run = gpu_check.run_from_log(text)
    assert run["date"] == "2026-12-04" and run["machine"].startswith("NVIDIA H200;")
    assert run["model"] == "smollm2-1.7b architecture, random weights, bfloat16"
    assert run["settings"] == {"context": 32768, "new_tokens": 32, "repeats": 2}
    assert list(run["rows"]) == ["dynamic-bf16", "kvlib-int8", "kvlib-int4", "kvlib-int2"]
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not line.startswith("| ") or cells[0] not in run["rows"]:
            continue
        row = run["rows"][cells[0]]
        for cell in cells[1:]:
            word = cell.split()[0].rstrip("x")
            if word in ("-", "PASS", "FAIL", "reference"):
                continue
            assert any(v == float(word) for v in row.values() if isinstance(v, (int, float))), (
                cells[0],
                cell,
            )
    assert "What fits skipped" in run["note"]


def test_the_results_file_holds_the_h200_log_as_it_is():
    """kvlib/results.json's run "gpu_check" is the committed log, parsed (not retyped)."""
    from kvlib import results

    gpu_check = _load_gpu_check()
    assert results.run("gpu_check") == gpu_check.run_from_log(H200_LOG.read_text(encoding="utf-8"))
    assert "GPU (NVIDIA H200)" in results.citation(results.run("gpu_check"))


def test_run_from_log_refuses_other_text():
    gpu_check = _load_gpu_check()
    import pytest

    with pytest.raises(ValueError, match="header"):
        gpu_check.run_from_log("## Something else\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    header = (
        "## GPU check · 2026-12-04 17:58 UTC · NVIDIA H200\n\n"
        "Command: `python scripts/gpu_check.py` · torch 2.11.0 · transformers 5.17.0\n"
        "Model: random weights of `x` (1 layers, bfloat16); context 8 random tokens, 1 new tokens, median of 1.\n"
    )
    with pytest.raises(ValueError, match="no result table"):
        gpu_check.run_from_log(header)
