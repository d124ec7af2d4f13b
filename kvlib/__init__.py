"""kvlib — the library behind the KV Cache Lab notebooks.

Packages that show the design, over small foundation modules; everything is imported lazily, so
``import kvlib`` stays cheap (no torch). Layers (checked by import-linter): foundations, then the
techniques, then the registry and results, then the tools.

================  ==================================================================  ==========
module/package    what it holds                                                       notebook
================  ==================================================================  ==========
*foundations*
``validate``      argument checks shared by every public function                     all
``device``        device selection, seeding, quiet transformers output                00
``data``          offline evaluation text, perplexity segments                        00
``models``        loading the bundled offline models (or any hub model)               00
``specs``         model specs, the published models' registry, KV geometry            01
``memory``        KV-cache byte math, what fits in a GPU (GiB)                        01
``keys``          names with a budget (``evict-h2o@1/4``), parsed once: result rows   09, 11
``attention``     dense reference attention (causal, GQA, ragged lengths)             02, 07
``rope``          RoPE: apply, undo, read from a model or its config                  05, 06
``compat``        one adapter over transformers' cache API                            04, 06
``plot``          the notebooks' shared plots; ``interactive()`` for widgets          all
*techniques* (packages)
``quant``         packing, group quantization, rotations, codebooks, TurboQuant       02, 03, 05
``caches``        caches on one base layer: quantized, TurboQuant, eviction, paged    04, 05, 07, 11
``kvtc``          transform coding: PCA, bit allocation, the codec                    06
``kernels``       a fused Triton decode-attention kernel over packed codes            10
``eval``          capture, perplexity, retrieval, serving, comparisons, capacity      02–08, 11
*registry and results*
``caches.registry``  one name and one factory per cache the project compares      04, 05, 08, 11
``results``       the measured results file (``kvlib/results.json``)                  04, 09
*tools*
``plan``          the planner (no torch): engines, the rule, ``recommend()``          09
``summary``       the series in one table, from the measured results                  09
``cli``           the ``kvlib`` command line (memory, plan, models)                   09
================  ==================================================================  ==========
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = (
    "attention",
    "caches",
    "cli",
    "compat",
    "data",
    "device",
    "eval",
    "kernels",
    "keys",
    "kvtc",
    "memory",
    "models",
    "plan",
    "plot",
    "quant",
    "results",
    "rope",
    "specs",
    "summary",
    "validate",
)

__all__ = ["get_device", "seed_everything", "__version__", *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"kvlib.{name}")
    if name in ("get_device", "seed_everything"):  # kvlib.device imports torch: only on use
        return getattr(importlib.import_module("kvlib.device"), name)
    raise AttributeError(f"module 'kvlib' has no attribute {name!r}")
