"""Progress output shared by the benchmarks: one-line results on stdout, bars on stderr.

The long runs (tens of minutes) show tqdm bars on stderr, which are off when stderr is not a
terminal (``disable=None``), and print each result as a line on stdout above the bars, so a
log redirected to a file keeps the results and drops the bars.

Imported by the scripts in ``benchmarks/`` (run as ``python benchmarks/bench_x.py``, which puts
this folder on ``sys.path``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def log(line: str) -> None:
    """Print a progress line to stdout at once, above the progress bars (which are on stderr)."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def bar(iterable: Iterable[T] | None = None, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr, off when stderr is not a terminal (``kwargs`` go to tqdm)."""
    return tqdm(iterable, file=sys.stderr, disable=None, **kwargs)
