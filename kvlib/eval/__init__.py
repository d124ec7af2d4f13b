"""Measuring caches: capture, perplexity, retrieval, comparisons, capacity and serving.

=================  ==============================================================  ==========
module             what it holds                                                   notebook
=================  ==============================================================  ==========
``capture``        capturing a real model's Q/K/V, attention-output error          02, 03, 05
``quality``        perplexity with the cache really read, generation speed         04, 06
``passkey``        the pass-key prompt: a key hidden in filler at a chosen depth   11
``retrieval``      a seeded pass-key task, accuracy with a Wilson interval         11
``serving``        trace-driven serving simulation (waste, concurrency)            07
``model_choice``   which model to run on this device; random real architectures    08
``compare``        caches side by side: memory, speed, quality, agreement          08
``capacity``       what fits: predicted and searched max context and batch         08
=================  ==============================================================  ==========
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = [
    "capacity",
    "capture",
    "compare",
    "model_choice",
    "passkey",
    "quality",
    "retrieval",
    "serving",
]


def __getattr__(name: str) -> ModuleType:
    """``kvlib.eval.<module>`` imports the module on first use (its own imports stay where they are)."""
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
