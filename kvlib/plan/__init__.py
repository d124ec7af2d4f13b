"""The configuration guide's planner (notebook 09): pure arithmetic, no torch.

``kvlib plan`` answers at once because nothing here imports torch, transformers, the caches or
the kernels (an import-linter ``forbidden`` contract and a run-time test keep it so).

==================  ==============================================================
module              what it holds
==================  ==============================================================
``engine_support``  which KV types vLLM and llama.cpp run where, read from sources
``engines``         the KV-cache types each engine runs (vLLM, llama.cpp, …)
``eviction``        whether token eviction would hold a request (offered, never chosen)
``budget``          one device's memory budget, and the sequences and tokens that fit it
``rule``            the decision rule, in numbers: the level, the engine, the decision
``fallbacks``       what would fit a request that does not
``measured``        the measured cost of a KV setting or type, as a plan cites it
``text``            the reasons and watch-outs
``suggestions``     what would fit, in words, and whether token eviction would hold it
``summary``         the plan in a few lines: what it buys, the other engines
``settings``        engine settings for transformers, vLLM and llama.cpp
``planner``         ``recommend()``: a deployable plan for a scenario
==================  ==============================================================
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = [
    "budget",
    "engine_support",
    "engines",
    "eviction",
    "fallbacks",
    "measured",
    "planner",
    "rule",
    "settings",
    "suggestions",
    "summary",
    "text",
]


def __getattr__(name: str) -> ModuleType:
    """``kvlib.plan.<module>`` imports the module on first use (its own imports stay where they are)."""
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
