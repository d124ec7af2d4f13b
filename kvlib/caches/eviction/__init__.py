"""Token eviction: a cache that keeps a budget of tokens per layer (notebook 11).

=============  ==================================================================
module         what it holds
=============  ==================================================================
``policy``     what a policy is: :class:`~kvlib.caches.eviction.policy.Policy`
``scores``     what the policies share: attention weights, the kept set
``streaming``  StreamingLLM: attention sinks plus the most recent tokens
``snapkv``     SnapKV: the prompt's last queries pick the tokens, once
``h2o``        H2O: accumulated attention (heavy hitters) plus recent tokens
``tova``       TOVA: the last query's attention, every step
``knorm``      KNorm: the lowest key norms
``queries``    the attention queries a forward pass computes (the scores' input)
``layer``      one layer's kept tokens, positions and scores; the policies by name
``cache``      :class:`~kvlib.caches.eviction.cache.EvictionCache`, float16 or int4
=============  ==================================================================
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = [
    "cache",
    "h2o",
    "knorm",
    "layer",
    "policy",
    "queries",
    "scores",
    "snapkv",
    "streaming",
    "tova",
]


def __getattr__(name: str) -> ModuleType:
    """``kvlib.caches.eviction.<module>`` imports the module on first use (its own imports stay where they are)."""
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
