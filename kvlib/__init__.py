"""kvlib — the library behind the KV Cache Lab notebooks.

One concept per module, imported lazily so that ``import kvlib`` stays cheap. Layers (checked by
import-linter): foundations, then techniques, then the registry and results, then tools.

====================  ==============================================================  ==========
module                what it holds                                                   notebook
====================  ==============================================================  ==========
*foundations*
``validate``          argument checks shared by every public function                 all
``device``            device selection, seeding, quiet transformers output            00
``data``              offline evaluation text                                         00
``models``            loading the bundled offline model (or any hub model)            00
``specs``             model specs, the published models' registry, KV geometry        01
``memory``            KV-cache byte math, what fits in a GPU (GiB)                    01
``packing``           bit-packing integer codes into bytes                            03
``quant``             int8/4/3/2 group quantization (``QuantizedTensor``)             02, 03
``cache_layout``      the quantized cache's defaults, as numbers (no torch)            03, 04
``cache_layer``       the state check and batch operations every cache layer shares   04, 10
``attention``         dense reference attention (causal, GQA, ragged lengths)         02, 06
``compat``            one adapter over transformers' cache API                        04, 05
``rope``              rotary position embeddings: apply, undo, read from a model      05
``bitalloc``          bit allocation and uniform quantizers per component             05
``blocks``            the block allocator behind paged caches                         06
``kernels``           a fused Triton decode-attention kernel over packed codes        09
``fused_attention``   routing transformers' attention to that kernel                  09
``queries``           the attention queries a forward pass computes (eviction hooks)  10
``sliding``           a sliding-window layer for hybrid models' sliding layers        04, 10
``engine_support``    which KV types vLLM and llama.cpp run where, read from sources  08
*techniques*
``recipes``           KV quantization recipes (KIVI layout, rotation, windows)        02, 03
``capture``           capturing a real model's Q/K/V, attention-output error          02, 03
``cache``             a quantized KV cache that plugs into transformers               04
``hf_probe``          transformers quantized layers, probed (private quantizer)       04
``quality``           perplexity with the cache really read, generation speed         04, 05
``pca``               PCA basis of the cache: calibration and fitting                 05
``kvtc``              KV-cache transform coding: the codec and its byte format        05
``paged``             paged attention, the paged transformers cache                   06
``serving``           trace-driven serving simulation (waste, concurrency)            06
``eviction_scores``   token-eviction scores: StreamingLLM, SnapKV, H2O, TOVA, KNorm   10
``eviction``          a cache keeping a budget of tokens per layer (float or int4)    10
``retrieval``         a seeded pass-key task, accuracy with a Wilson interval         10
*registry and results*
``cache_registry``    one name and one factory per cache the project compares         04, 07, 08
``results``           the measured results file (``kvlib/results.json``)              04, 08
*tools*
``model_choice``      which model to run on this device; random real architectures    07
``compare``           caches side by side: memory, speed, quality, agreement          07
``capacity``          what fits: predicted and searched max context and batch         07
``engines``           the KV-cache types each engine runs (vLLM, llama.cpp, …)        08
``plan_rule``         the planner's decision rule, in numbers                         08
``plan_fallbacks``    what would fit a request that does not                          08
``plan_eviction``     whether token eviction would hold it (offered, never chosen)    08
``plan_text``         the planner's reasons, watch-outs and summary                   08
``plan_engines``      engine settings for transformers, vLLM and llama.cpp            08
``plan``              ``recommend()``: a deployable plan for a scenario               08
``summary``           the series in one table, from the measured results              08
``plot``              the notebooks' shared plots; ``interactive()`` for widgets      all
``cli``               the ``kvlib`` command line (memory, plan, models)               08
====================  ==============================================================  ==========
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = (
    "attention",
    "bitalloc",
    "blocks",
    "cache",
    "cache_layer",
    "cache_layout",
    "cache_registry",
    "capacity",
    "capture",
    "cli",
    "compare",
    "compat",
    "data",
    "device",
    "engine_support",
    "engines",
    "eviction",
    "eviction_scores",
    "fused_attention",
    "hf_probe",
    "kernels",
    "kvtc",
    "memory",
    "model_choice",
    "models",
    "packing",
    "paged",
    "pca",
    "plan",
    "plan_engines",
    "plan_eviction",
    "plan_fallbacks",
    "plan_rule",
    "plan_text",
    "plot",
    "quality",
    "quant",
    "queries",
    "recipes",
    "results",
    "retrieval",
    "rope",
    "serving",
    "sliding",
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
