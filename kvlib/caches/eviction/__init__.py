"""Token eviction: a cache that keeps a budget of tokens per layer (notebook 10).

============  ===================================================================
module        what it holds
============  ===================================================================
``scores``    the policies' token scores: StreamingLLM, SnapKV, H2O, TOVA, KNorm
``queries``   the attention queries a forward pass computes (the scores' input)
``cache``     :class:`~kvlib.caches.eviction.cache.EvictionCache`, float16 or int4
============  ===================================================================
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["cache", "queries", "scores"]


def __getattr__(name: str) -> ModuleType:
    """``kvlib.caches.eviction.<module>`` imports the module on first use (its own imports stay where they are)."""
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
