"""KV caches that plug into transformers' ``generate()``, each a ``Cache`` of per-layer objects.

Every layer class here builds on :class:`kvlib.caches.base.BatchRows` (the state check and the
batch operations) and follows transformers' ``CacheLayerMixin``. Importing this package imports
no torch: :mod:`kvlib.caches.layout` is plain numbers, read by the planner; so are
:mod:`kvlib.caches.hf_layout` and :mod:`kvlib.caches.eviction_settings`, and the registry's table
:mod:`kvlib.caches.entries` that reads them.

=====================  ==============================================================  ==========
module                 what it holds                                                   notebook
=====================  ==============================================================  ==========
``base``               the state check and batch operations every cache layer shares   04, 11
``layout``             the quantized cache's defaults, as numbers (no torch)            03, 04
``hf_layout``          transformers' QuantizedLayer defaults, as numbers (no torch)    04
``eviction_settings``  the eviction policies' names and lines, int4 group (no torch)   11
``quantized``          a quantized KV cache (KIVI layout, rotation, windows)            04
``quantized_layer``    its layer: sinks, quantized blocks, window, fused decoding      04, 10
``sliding``            a sliding-window layer for hybrid models' sliding layers        04, 11
``coded``              the layer a key/value codec fills: sinks, encoded blocks, window 05
``turboquant``         TurboQuant's cache: vLLM's layout, or kvlib's (sinks, window)   05
``kvquant``            KVQuant's cache: pre-RoPE keys, nuq levels, sparse outliers      05
``eviction``           caches that keep a budget of tokens per layer (a package)       11
``blocks``             the block allocator behind paged caches                         07
``paged``              paged attention, the paged transformers cache                   07
``hf_probe``           transformers' quantized layers, probed (private quantizer)      04
``entries``            what each cache name means: family, bits, groups (no torch)     04, 05, 08, 11
``registry``           one name and one factory per cache the project compares         04, 05, 08, 11
=====================  ==============================================================  ==========
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = [
    "base",
    "blocks",
    "coded",
    "entries",
    "eviction",
    "eviction_settings",
    "hf_layout",
    "hf_probe",
    "kvquant",
    "layout",
    "paged",
    "quantized",
    "quantized_layer",
    "registry",
    "sliding",
    "turboquant",
]


def __getattr__(name: str) -> ModuleType:
    """``kvlib.caches.<module>`` imports the module on first use (its own imports stay where they are)."""
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
