"""benchmarks/_machine.py: how every benchmark names its machine in kvlib/results.json."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import pytest
import torch
from _scripts import load_script

MODULE = Path(__file__).resolve().parents[1] / "benchmarks" / "_machine.py"


@pytest.fixture
def m():
    return load_script("benchmarks/_machine.py")


def _lscpu(text: str):
    def run(*args, **kwargs):
        return subprocess.CompletedProcess(args, 0, stdout=text, stderr="")

    return run


def test_cpu_model_reads_lscpu_model_name(m, monkeypatch):
    monkeypatch.setattr(
        m.subprocess, "run", _lscpu("Architecture: x86_64\nModel name:   Some CPU 9000\n")
    )
    assert m.cpu_model() == "Some CPU 9000"


def test_cpu_model_falls_back_without_lscpu(m, monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("lscpu")

    monkeypatch.setattr(m.subprocess, "run", missing)
    assert m.cpu_model() == (platform.processor() or platform.machine() or "unknown CPU")
    monkeypatch.setattr(m.subprocess, "run", _lscpu("Architecture: x86_64\n"))  # no model line
    assert m.cpu_model() == (platform.processor() or platform.machine() or "unknown CPU")


def test_machine_names_cpu_threads_and_versions(m, monkeypatch):
    monkeypatch.setattr(m, "cpu_model", lambda: "Some CPU 9000")
    one, two = m.machine(1), m.machine(2)
    assert one.startswith("Some CPU 9000, ") and " 1 torch thread;" in one
    assert " 2 torch threads;" in two and f"torch {torch.__version__}" in two
    assert m.machine() == m.machine(torch.get_num_threads())
    assert " ," not in one and ("no GPU" in one) != torch.cuda.is_available()
