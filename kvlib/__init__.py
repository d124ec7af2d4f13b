"""kvlib — the library behind the KV Cache Lab notebooks.

One concept per module, imported lazily so that ``import kvlib`` stays cheap:

=============  ==========================================================  ========
module         what it holds                                               notebook
=============  ==========================================================  ========
``memory``     model specs, KV-cache byte math, what fits in a GPU         01
``quant``      int8/4/3/2 quantization with real bit-packing              02, 03
``capture``    capturing a real model's Q/K/V, attention-output error      02, 03
``cache``      a quantized KV cache that plugs into transformers           04
``eval``       perplexity with the cache really read, generation speed     04
``compat``     one adapter over transformers' cache keyword churn          04
``pca``        PCA transform coding of the cache (KVTC-style)             05
``bitalloc``   bit allocation per PCA component under a budget             05
``paged``      block allocator, paged attention, paged transformers cache  06
``serving``    trace-driven serving simulation (waste, concurrency)        06
``harness``    the full-model run: memory, speed, quality, what fits       07
``plan``       scenario-based recommendations and engine flags             08
``plot``       the notebooks' shared plots; ``interactive()`` for widgets  all
``cli``        the ``kvlib`` command line (memory, plan, models)           08
``models``     loading the bundled offline model (or any hub model)        00
``device``     device selection and seeding                                00
``data``       offline evaluation text                                     00
=============  ==========================================================  ========
"""

from __future__ import annotations

import importlib
from typing import Any

from kvlib.device import get_device, seed_everything

__version__ = "0.1.0"

_SUBMODULES = (
    "bitalloc",
    "cache",
    "capture",
    "cli",
    "compat",
    "data",
    "device",
    "eval",
    "harness",
    "memory",
    "models",
    "paged",
    "pca",
    "plan",
    "plot",
    "quant",
    "serving",
)

__all__ = ["get_device", "seed_everything", "__version__", *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"kvlib.{name}")
    raise AttributeError(f"module 'kvlib' has no attribute {name!r}")
