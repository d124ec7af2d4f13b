"""How the benchmarks time a call: ``torch.utils.benchmark.Timer(...).blocked_autorange()``.

One helper, so every benchmark reports the same statistic (the median time of one call) and
none keeps a hand-written ``perf_counter`` loop. Timer does what such loops forget:

- warm-up: its block-size estimate runs the call before anything is recorded;
- threads: it sets the torch thread count for the measurement (Timer's own default is 1; we
  pass the count the benchmark runs with, ``torch.get_num_threads()``, unless told otherwise);
- synchronisation: its default clock calls ``torch.accelerator.synchronize()`` when an
  accelerator is present, so asynchronous CUDA work is counted.

``blocked_autorange`` repeats the call in blocks until ``min_run_time`` seconds have been
measured (at least one block): a 1 ms kernel is timed hundreds of times, a 10 s optimizer once
after its warm-up run. Calls that build their own state (a fresh cache per generation) are
fine; calls that mutate shared state between runs are not.

Imported by the scripts in ``benchmarks/`` (run as ``python benchmarks/bench_x.py``, which puts
this folder on ``sys.path``); kvlib itself does not time anything this way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils.benchmark import Measurement, Timer

T = TypeVar("T")


def measure(
    fn: Callable[[], object],
    *,
    min_run_time: float = 0.2,
    num_threads: int | None = None,
    label: str = "",
    description: str = "",
) -> Measurement:
    """Time ``fn()`` with ``Timer.blocked_autorange``; the Measurement's ``median`` is seconds.

    Args:
        fn: the call to time, taking no arguments.
        min_run_time: seconds of measured calls to collect (after the warm-up).
        num_threads: torch threads during the measurement; ``None`` keeps the current count.
        label, description: shown when the Measurement is printed.
    """
    if min_run_time <= 0:
        raise ValueError(f"min_run_time must be > 0 seconds (got {min_run_time})")
    timer = Timer(
        stmt="fn()",
        globals={"fn": fn},
        num_threads=torch.get_num_threads() if num_threads is None else num_threads,
        label=label,
        description=description,
    )
    return timer.blocked_autorange(min_run_time=min_run_time)


def median_seconds(fn: Callable[[], T], *, min_run_time: float = 0.2) -> tuple[float, T]:
    """``(median seconds per call, what the last call returned)``: time a call and keep its result.

    The result comes from the timed calls themselves, so a slow call (an encoder, an optimizer)
    is not run once more just to get its output.
    """
    out: list[T] = []

    def call() -> None:
        out[:] = [fn()]

    m = measure(call, min_run_time=min_run_time)
    return m.median, out[0]
