"""The published settings of the codecs kvlib reimplements, as plain numbers (no torch).

:mod:`kvlib.quant.turboquant`, :mod:`kvlib.quant.kvquant` and their caches
(:mod:`kvlib.caches.turboquant`, :mod:`kvlib.caches.kvquant`) take their defaults from here, and
so does the registry's table (:mod:`kvlib.caches.entries`), which imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["BOUNDARY_LAYERS", "OUTLIER_FRACTION", "VLLM_PRESETS"]

#: vLLM 0.32's TurboQuant KV-cache dtypes as ``(key_bits, value_bits)`` (8: float8 keys); all
#: but ``turboquant_k8v4`` use norm correction.
VLLM_PRESETS: Mapping[str, tuple[int, int]] = MappingProxyType(
    {
        "turboquant_k8v4": (8, 4),
        "turboquant_4bit_nc": (4, 4),
        "turboquant_k3v4_nc": (3, 4),
        "turboquant_3bit_nc": (3, 3),
    }
)

#: Layers at each end of a dense model that vLLM keeps in the model's dtype.
BOUNDARY_LAYERS = 2

#: KVQuant's share of each block's keys and values kept exactly (its 1 % of sparse outliers).
OUTLIER_FRACTION = 0.01
