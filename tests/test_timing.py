"""Tests for benchmarks/_timing.py, the one way the benchmarks time a call."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from _scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _timing():
    return load_script("benchmarks/_timing.py", "kvlab_timing")


def test_median_seconds_times_the_call_and_keeps_its_last_result() -> None:
    calls: list[int] = []

    def fn() -> int:
        calls.append(len(calls))
        time.sleep(0.02)
        return calls[-1]

    seconds, last = _timing().median_seconds(fn, min_run_time=0.1)
    assert 0.02 <= seconds < 0.5  # a sleep is a floor; the ceiling only catches unit mistakes
    assert last == calls[-1] and len(calls) >= 2  # a warm-up call, then at least one timed


def test_measure_warms_up_and_collects_min_run_time() -> None:
    calls = 0

    def fn() -> None:
        nonlocal calls
        calls += 1
        time.sleep(0.005)

    m = _timing().measure(fn, min_run_time=0.05)
    timed = len(m.times) * m.number_per_run
    assert calls > timed  # the block-size estimate ran the call before recording
    assert sum(m.times) * m.number_per_run >= 0.05
    assert m.median >= 0.005


@pytest.mark.parametrize("threads", [None, 1])
def test_measure_runs_under_the_requested_thread_count(threads: int | None) -> None:
    before = torch.get_num_threads()
    seen: set[int] = set()
    _timing().measure(lambda: seen.add(torch.get_num_threads()), num_threads=threads)
    assert seen == {before if threads is None else threads}
    assert torch.get_num_threads() == before


def test_measure_rejects_a_non_positive_run_time() -> None:
    with pytest.raises(ValueError, match="min_run_time must be > 0"):
        _timing().measure(lambda: None, min_run_time=0)
