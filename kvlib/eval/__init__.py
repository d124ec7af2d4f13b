"""Measuring caches: capture, perplexity, retrieval, comparisons, capacity and serving.

=================  ==============================================================  ==========
module             what it holds                                                   notebook
=================  ==============================================================  ==========
``capture``        capturing a real model's Q/K/V, attention-output error          02, 03
``quality``        perplexity with the cache really read, generation speed         04, 05
``retrieval``      a seeded pass-key task, accuracy with a Wilson interval         10
``serving``        trace-driven serving simulation (waste, concurrency)            06
``model_choice``   which model to run on this device; random real architectures    07
``compare``        caches side by side: memory, speed, quality, agreement          07
``capacity``       what fits: predicted and searched max context and batch         07
=================  ==============================================================  ==========
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["capacity", "capture", "compare", "model_choice", "quality", "retrieval", "serving"]


def __getattr__(name: str) -> ModuleType:
    """``kvlib.eval.<module>`` imports the module on first use (its own imports stay where they are)."""
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
