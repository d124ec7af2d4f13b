"""Load the project's scripts (``benchmarks/*.py``, ``scripts/*.py``) as modules for tests.

They are run as ``python benchmarks/bench_x.py``, which puts their folder on ``sys.path`` so
that they import their neighbours (``_machine``, ``_progress``, ``_timing``, …); loading one
here does the same for the time of the import.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str | None = None) -> ModuleType:
    """The script at ``relative`` (to the repository root) as a module named ``name`` (its
    file's stem by default), with its folder on ``sys.path`` while it imports."""
    path = ROOT / relative
    name = name or path.stem
    folder = str(path.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look their module up by name
    try:
        spec.loader.exec_module(module)
    finally:
        if added:
            sys.path.remove(folder)
    return module
