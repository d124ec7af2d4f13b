"""The machine a benchmark ran on, as the results file records it.

One helper, so every run in ``kvlib/results.json`` names its machine the same way: the CPU
model (``lscpu``'s "Model name", which ``platform.processor()`` leaves empty on Linux), the
CPU count, the GPU or "no GPU", the torch thread count and the library versions.

Imported by the scripts in ``benchmarks/`` (run as ``python benchmarks/bench_x.py``, which puts
this folder on ``sys.path``).
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata

import torch


def cpu_model() -> str:
    """The CPU's model name, e.g. ``"AMD EPYC 7B13"``; the architecture where none is known."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def machine(threads: int | None = None) -> str:
    """CPU, CPU count, GPU, torch threads (``threads``, else torch's current count), versions."""
    threads = torch.get_num_threads() if threads is None else threads
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    try:
        tf = f", transformers {metadata.version('transformers')}"
    except metadata.PackageNotFoundError:
        tf = ""
    return (
        f"{cpu_model()}, {os.cpu_count()} CPUs, {gpu}, {threads} torch "
        f"thread{'s' if threads != 1 else ''}; torch {torch.__version__}{tf}"
    )
