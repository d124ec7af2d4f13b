"""KV-cache transform coding (KVTC-style): PCA, bit allocation, and the codec (notebook 06).

=============  ============================================================
module         what it holds
=============  ============================================================
``basis``      ``KVPCABasis``, the learned transform: features, saving and loading
``bitalloc``   bit allocation and uniform quantizers per component
``pca``        the PCA basis of the cache: calibration and fitting
``codec``      the codec and its byte format
=============  ============================================================
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["basis", "bitalloc", "codec", "pca"]


def __getattr__(name: str) -> ModuleType:
    """``kvlib.kvtc.<module>`` imports the module on first use (its own imports stay where they are)."""
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
