"""The fused decode-attention kernel over packed codes (notebook 10).

====================  ===========================================================
module                what it holds
====================  ===========================================================
``packed``            ``PackedKV``: one layer's cache as the kernel reads it
``decode``            the kernel's entry point and its reference
``fused_attention``   routing transformers' attention to the kernel
``_triton``           the Triton source (imported only where Triton is installed)
====================  ===========================================================
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["decode", "fused_attention", "packed"]


def __getattr__(name: str) -> ModuleType:
    """``kvlib.kernels.<module>`` imports the module on first use (its own imports stay where they are)."""
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
