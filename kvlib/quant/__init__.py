"""Quantization of keys and values: codes, their packing, and the recipes that store a layer.

============  ==============================================================  ==========
module        what it holds                                                   notebook
============  ==============================================================  ==========
``packing``   bit-packing integer codes into bytes                            03
``tensor``    int8/4/3/2 group quantization (``QuantizedTensor``)             02, 03
``rotation``  orthonormal rotations of head_dim: Hadamard, Haar-random,      03, 05
              randomized Hadamard; the one ``rotate``/``unrotate`` pair
``codebook``  Lloyd-Max codebooks for a known distribution (Gaussian, a       05
              coordinate of a random unit vector)
``recipes``   KV quantization recipes (KIVI layout, rotation, windows)        02, 03
``turboquant``  TurboQuant's codec: rotated keys on one fixed codebook and a    05
              norm (or float8), per-token values; vLLM's presets; QJL
``kvquant``   KVQuant's codec: per-channel or per-token codes with Lloyd      05
              levels and a sparse table of outliers
``presets``   vLLM's TurboQuant dtypes and boundary layers, KVQuant's         05
              outlier share, as plain numbers (no torch)
============  ==============================================================  ==========
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = [
    "codebook",
    "kvquant",
    "packing",
    "presets",
    "recipes",
    "rotation",
    "tensor",
    "turboquant",
]


def __getattr__(name: str) -> ModuleType:
    """``kvlib.quant.<module>`` imports the module on first use (its own imports stay where they are)."""
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
