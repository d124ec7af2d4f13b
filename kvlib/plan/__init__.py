"""The configuration guide's planner (notebook 09): pure arithmetic, no torch.

``kvlib plan`` answers at once because nothing here imports torch, transformers, the caches or
the kernels (an import-linter ``forbidden`` contract and a run-time test keep it so).

==================  ==============================================================
module              what it holds
==================  ==============================================================
``engine_support``  which KV types vLLM and llama.cpp run where, read from sources
``engines``         the KV-cache types each engine runs (vLLM, llama.cpp, …)
``eviction``        whether token eviction would hold a request (offered, never chosen)
``rule``            the decision rule, in numbers
``fallbacks``       what would fit a request that does not
``text``            the reasons, watch-outs and summary
``settings``        engine settings for transformers, vLLM and llama.cpp
``planner``         ``recommend()``: a deployable plan for a scenario
==================  ==============================================================
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = [
    "engine_support",
    "engines",
    "eviction",
    "fallbacks",
    "planner",
    "rule",
    "settings",
    "text",
]


def __getattr__(name: str) -> ModuleType:
    """``kvlib.plan.<module>`` imports the module on first use (its own imports stay where they are)."""
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
