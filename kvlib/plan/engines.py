"""What each engine can keep in its KV cache, as data (notebook 09).

The planner (:mod:`kvlib.plan.rule`) chooses an engine first, then the highest precision level
that the engine can run and that fits, so a plan never names a cache type its engine lacks, and
every count it prints is the bytes of the type its flags set. A level is the planner's quality
ladder (``fp16``, ``int8``, ``int4``, ``int2``); each engine spells it its own way:

================  ===========================  ================  ===============================
level             transformers (kvlib's cache)  vLLM              llama.cpp
================  ===========================  ================  ===============================
fp16              ``dynamic-fp16``             ``auto``          ``f16``
int8              ``kvlib-int8``               ``fp8``           ``q8_0``
int4              ``kvlib-int4``               —                 ``q4_0``
int2              ``kvlib-int2``               —                 —
================  ===========================  ================  ===============================

**Bytes.** Each type is priced by :func:`kvlib.memory.kv_cache_bytes` with its ``(bits,
group_size, group_meta_bits)``:

* kvlib's caches (:mod:`kvlib.caches.registry`): one fp16 scale and one fp16 zero point per group,
  at the registry's group size (the finer of the key and value groups, so an upper bound);
* vLLM's ``fp8`` (``fp8_e4m3``, ``fp8_e5m2``): 8 bits per value, scales per tensor (no per-group
  metadata);
* llama.cpp (ggml's block formats): ``q8_0``, ``q4_0``, ``iq4_nl``, ``q5_0`` keep one fp16 scale
  per block of 32 values; ``q4_1``, ``q5_1`` add a per-block fp16 minimum. A quantized V cache
  needs flash attention (``-fa on``).

The planner offers vLLM no 4- or 2-bit level and llama.cpp no 2-bit one, and skips those levels
for those engines. (vLLM 0.32 does accept 4- and 3-bit dtypes, TurboQuant's and
``int4_per_token_head``, on GPUs only; kvlib measures TurboQuant's layout in its own
re-implementation, notebook 05, but not vLLM running it, so the planner does not choose them.) Sources: vLLM's ``--kv-cache-dtype`` choices, llama.cpp's
``--cache-type-k/-v`` list and ggml's block layouts (``ggml-common.h``).

**Mixed K/V types.** llama.cpp sets the key and value caches apart (``-ctk q8_0 -ctv q4_0``).
Such a pair is named ``"q8_0/q4_0"`` (keys/values) and priced at the mean of its two types, which
is exact wherever keys and values have the same width (every model but MLA ones, for which the
planner does not offer pairs).

**Chosen from measurements.** Where a results file holds llama.cpp's measured types
(``benchmarks/bench_engines.py``, run ``"llama.cpp"``), :func:`candidates` offers at the int4
level every measured type below q8_0's bytes, best measured quality first, and the planner takes
the first that holds the request (``K q8_0, V q4_0`` before ``q4_0``); without measurements the
level is ``q4_0`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvlib import results as kvresults
from kvlib.caches import layout as cache_layout
from kvlib.memory import GROUP_META_BITS
from kvlib.plan import engine_support

__all__ = [
    "ENGINES",
    "KV_TYPES",
    "LEVELS",
    "TOKEN_EVICTION",
    "GGML_CUDA_VEC_HEAD_SIZES",
    "EngineKV",
    "accepts",
    "candidates",
    "kv_type",
    "measured_cost",
    "measured_llama_cpp",
    "measured_vllm",
    "planned",
    "runs_well",
]

#: The engines a plan gives settings for, in the order plans list them.
ENGINES: tuple[str, ...] = ("transformers", "vllm", "llama.cpp")
#: The planner's precision levels, highest first.
LEVELS: tuple[str, ...] = ("fp16", "int8", "int4", "int2")

#: What each engine offers for token eviction (keeping fewer tokens rather than fewer bits),
#: for the planner's eviction line (:mod:`kvlib.plan.text`). Sources, checked for this table:
#: llama.cpp's ``tools/server/README.md`` (ggml-org/llama.cpp at 00dc805): ``--keep N`` "number
#: of tokens to keep from the initial prompt (default: 0, -1 = all)", ``--context-shift,
#: --no-context-shift`` "whether to use context shift on infinite text generation (default:
#: disabled)" (it was on by default when ``--no-context-shift`` came in, PR #9544, 2024); vLLM:
#: no eviction API in its releases (StreamingLLM request vllm-project/vllm#1253 closed without
#: it; session eviction, #43374, an open experimental PR), sliding windows are the model's own;
#: kvpress 0.5.5's requirements pin transformers<5.3 (``benchmarks/bench_kvpress.py`` runs it in
#: an environment of its own).
TOKEN_EVICTION: dict[str, str] = {
    "transformers": "kvlib's eviction caches (evict-<policy>, evict-<policy>-int4) and NVIDIA's "
    "kvpress presses (SnapKV, StreamingLLM, KNorm, …; kvpress 0.5.5 pins transformers<5.3)",
    "vllm": "no general token eviction (only a model's own sliding-window attention)",
    "llama.cpp": "--context-shift (off by default in llama-server): when the context fills, it "
    "keeps the first --keep N tokens and shifts the oldest of the rest out, StreamingLLM-like",
}

_GGML_BLOCK = 32  # values per ggml quantization block
_FP16 = 16


@dataclass(frozen=True)
class EngineKV:
    """One KV-cache type an engine accepts.

    Attributes:
        engine: one of :data:`ENGINES`.
        name: the engine's own spelling (a registry name for transformers, vLLM's
            ``kv_cache_dtype``, llama.cpp's ``--cache-type-k/-v``).
        level: the planner level it serves (one of :data:`LEVELS`), or None for a type the
            engine accepts but the planner does not choose (llama.cpp's q5_0, …).
        bits: bits per stored code.
        group_size: values per scale group, or None (per-tensor scale, or no quantization).
        group_meta_bits: metadata bits per group (16: an fp16 scale; 32: scale and zero point).
        needs_flash_attention: llama.cpp's quantized V cache runs only with ``-fa on``.
        measured_as: the :mod:`kvlib.caches.registry` cache whose measured quality a plan cites
            for it, when one is the same format; None when it is not measured.
        window_bits: bits per value of sliding-window layers, where the type keeps them otherwise
            than the rest: kvlib's quantized caches keep the windows in fp16 and quantize the
            global layers only. None: stored as the rest (llama.cpp, vLLM).
    """

    engine: str
    name: str
    level: str | None
    bits: int
    group_size: int | None = None
    group_meta_bits: int = 0
    needs_flash_attention: bool = False
    measured_as: str | None = None
    window_bits: int | None = None

    @property
    def effective_bits(self) -> float:
        """Bits per cached value, metadata included: ``q4_0`` 4.5, ``fp8`` 8."""
        if self.group_size is None:
            return float(self.bits)
        return self.bits + self.group_meta_bits / self.group_size

    @property
    def cache_types(self) -> tuple[str, str]:
        """``(key type, value type)``: ``("q8_0", "q4_0")`` for ``"q8_0/q4_0"``, else the name
        twice."""
        k, _, v = self.name.partition("/")
        return (k, v or k)

    @property
    def mixed(self) -> bool:
        """Keys and values in different types (priced at their mean, see the module doc)."""
        return "/" in self.name

    @property
    def storage(self) -> tuple[int, int | None, int, int | None]:
        """``(bits, group_size, group_meta_bits, window_bits)`` as
        :func:`kvlib.memory.kv_cache_bytes` takes them."""
        return (self.bits, self.group_size, self.group_meta_bits, self.window_bits)


def _kvlib(level: str, bits: int) -> EngineKV:
    """kvlib's cache at ``bits`` (``dynamic-fp16`` at 16), priced as :mod:`kvlib.caches.registry`
    prices it: one fp16 scale and zero point per :func:`kvlib.caches.layout.predicted_group_size`
    values, sliding-window layers in fp16."""
    if bits >= 16:
        return EngineKV("transformers", "dynamic-fp16", level, 16, measured_as="dynamic-fp16")
    name = f"kvlib-int{bits}"
    group = cache_layout.predicted_group_size(bits)
    return EngineKV(
        "transformers", name, level, bits, group, GROUP_META_BITS, measured_as=name, window_bits=16
    )


def _ggml(name: str, level: str | None, bits: int, meta_bits: int) -> EngineKV:
    return EngineKV("llama.cpp", name, level, bits, _GGML_BLOCK, meta_bits, True)


def _ggml_pair(key: EngineKV, value: EngineKV) -> EngineKV:
    """Keys in one ggml type and values in another, priced at their mean bits and metadata."""
    return EngineKV(
        "llama.cpp", f"{key.name}/{value.name}", None, (key.bits + value.bits) // 2,
        _GGML_BLOCK, (key.group_meta_bits + value.group_meta_bits) // 2, True,
    )  # fmt: skip


_Q8_0 = _ggml("q8_0", "int8", 8, _FP16)
_Q4_0 = _ggml("q4_0", "int4", 4, _FP16)
_IQ4_NL = _ggml("iq4_nl", None, 4, _FP16)
_Q4_1 = _ggml("q4_1", None, 4, 2 * _FP16)


#: Every KV type each engine accepts.
KV_TYPES: tuple[EngineKV, ...] = (
    _kvlib("fp16", 16),
    _kvlib("int8", 8),
    _kvlib("int4", 4),
    _kvlib("int2", 2),
    EngineKV("vllm", "auto", "fp16", 16, measured_as="dynamic-fp16"),
    EngineKV("vllm", "fp8", "int8", 8, measured_as="hf-fp8"),
    EngineKV("vllm", "fp8_e4m3", None, 8, measured_as="hf-fp8"),
    EngineKV("vllm", "fp8_e5m2", None, 8),
    EngineKV("llama.cpp", "f16", "fp16", 16, measured_as="dynamic-fp16"),
    _Q8_0,
    _Q4_0,
    _IQ4_NL,
    _Q4_1,
    _ggml("q5_0", None, 5, _FP16),
    _ggml("q5_1", None, 5, 2 * _FP16),
    # 8-bit keys (the side with outlier channels) next to 4-bit values: pairs whose mean width
    # is whole, so that they are priced exactly
    _ggml_pair(_Q8_0, _Q4_0),
    _ggml_pair(_Q8_0, _IQ4_NL),
    _ggml_pair(_Q8_0, _Q4_1),
)


def _check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)} (got {engine!r})")
    return engine


def accepts(engine: str, name: str) -> bool:
    """Whether ``engine`` runs a KV cache of type ``name``."""
    _check_engine(engine)
    return any(t.engine == engine and t.name == name for t in KV_TYPES)


def kv_type(engine: str, name: str) -> EngineKV:
    """The :class:`EngineKV` ``engine`` calls ``name``.

    Raises:
        ValueError: an unknown engine, or a type the engine does not accept.
    """
    _check_engine(engine)
    for t in KV_TYPES:
        if t.engine == engine and t.name == name:
            return t
    accepted = ", ".join(t.name for t in KV_TYPES if t.engine == engine)
    raise ValueError(f"{engine} has no KV cache type {name!r} (it accepts {accepted})")


def planned(engine: str) -> dict[str, EngineKV]:
    """The type the planner uses at each level ``engine`` can run, highest precision first:
    ``planned("vllm") == {"fp16": <auto>, "int8": <fp8>}``."""
    _check_engine(engine)
    by_level = {t.level: t for t in KV_TYPES if t.engine == engine and t.level is not None}
    return {level: by_level[level] for level in LEVELS if level in by_level}


def measured_llama_cpp(results: Mapping[str, Any] | None = None) -> dict[str, float]:
    """llama.cpp types measured by ``benchmarks/bench_engines.py`` (run ``"llama.cpp"``) → mean
    perplexity delta (%) against llama.cpp's own f16 cache, keyed by the names of
    :data:`KV_TYPES` (the run's ``"k-q8_0/v-q4_0"`` rows become ``"q8_0/q4_0"``). Empty when the
    results hold no such run."""
    rows = kvresults.run("llama.cpp", results).get("rows", {})
    out: dict[str, float] = {}
    for row in rows.values() if isinstance(rows, Mapping) else ():
        if not isinstance(row, Mapping) or "perplexity_delta_pct_mean" not in row:
            continue
        k, v = row.get("type_k"), row.get("type_v")
        name = k if k == v else f"{k}/{v}"
        if accepts("llama.cpp", name):
            out[name] = float(row["perplexity_delta_pct_mean"])
    return out


def measured_vllm(results: Mapping[str, Any] | None = None) -> dict[str, float]:
    """vLLM KV dtypes measured by ``benchmarks/bench_vllm.py`` (run ``"vllm"``) → mean
    perplexity delta (%) against vLLM's own ``auto`` cache, keyed by vLLM's dtype names. Rows
    the run marks as not computed correctly (``"computed_correctly_on_cpu": false``: dtypes
    the CPU build accepts but does not compute) are left out. Empty without such a run."""
    rows = kvresults.run("vllm", results).get("rows", {})
    out: dict[str, float] = {}
    for name, row in rows.items() if isinstance(rows, Mapping) else ():
        if not isinstance(row, Mapping) or row.get("computed_correctly_on_cpu") is False:
            continue
        delta = row.get("perplexity_delta_pct_mean")
        if isinstance(delta, (int, float)) and accepts("vllm", name):
            out[name] = float(delta)
    return out


def measured_cost(t: EngineKV, results: Mapping[str, Any] | None = None) -> float | None:
    """The measured perplexity cost (%) of ``t`` on its own engine, against that engine's own
    full-precision cache: 0 for the full-precision types themselves; llama.cpp's and vLLM's
    types from their runs (:func:`measured_llama_cpp`, :func:`measured_vllm`); kvlib's caches
    from the cache benchmark (mean over segments where measured). None where not measured."""
    if t.level == "fp16":
        return 0.0
    if t.engine == "llama.cpp":
        return measured_llama_cpp(results).get(t.name)
    if t.engine == "vllm":
        return measured_vllm(results).get(t.name)
    cost = kvresults.cache_cost(t.name, results)
    value = cost.get("perplexity_delta_pct_mean", cost.get("perplexity_delta_pct"))
    return float(value) if isinstance(value, (int, float)) else None


#: Head sizes whose decode kernel in llama.cpp's CUDA build reads quantized K/V as they are
#: (ggml-cuda's vector flash-attention kernel); other head sizes, and prompt processing, convert
#: quantized K/V to f16 first (:mod:`kvlib.plan.engine_support`'s ``cuda_notes``, from fattn.cu).
GGML_CUDA_VEC_HEAD_SIZES: tuple[int, ...] = (64, 128, 256)


#: The lowest compute capability at which vLLM runs 8-bit weights (``--quantization fp8``):
#: W8A8 from 8.9 (Ada, Hopper), weight-only through its Marlin kernels on 8.0-8.6 (Ampere), and
#: not at all below (a T4 is 7.5): vLLM's ``fp8`` quantization method's ``get_min_capability``.
VLLM_FP8_WEIGHTS_MIN_CC = (8, 0)


def runs_well(
    t: EngineKV,
    device: str = "gpu",
    head_dim: int | None = None,
    cc: tuple[int, int] | None = None,
) -> bool:
    """Whether ``t`` runs at full speed on ``device`` in the engine's default build
    (:mod:`kvlib.plan.engine_support`, read from the engines' sources): on a GPU, llama.cpp's
    flash-attention kernels of its default CUDA build (``f16``, ``bf16``, ``q8_0`` and ``q4_0``,
    keys and values of one type: other pairs are converted to f16 at every step unless built with
    ``GGML_CUDA_FA_QUANTS``, and ``iq4_nl`` runs attention on the CPU) and vLLM's CUDA
    backends; on a CPU, every llama.cpp type. transformers runs kvlib's caches anywhere.
    ``head_dim``: the model's head size, where known: llama.cpp's CUDA decode reads quantized
    K/V natively only at :data:`GGML_CUDA_VEC_HEAD_SIZES`. ``cc``: the GPU's compute capability,
    where known: a vLLM type needs a CUDA backend that runs it there (fp8 needs 8.0)."""
    if t.engine == "llama.cpp" and device == "gpu":
        if t.bits < 16 and head_dim is not None and head_dim not in GGML_CUDA_VEC_HEAD_SIZES:
            return False
        return engine_support.llama_cpp_cuda_path(*t.cache_types) == "native"
    if t.engine == "vllm" and device == "gpu":
        dtype = engine_support.vllm_dtype(t.name)
        return dtype.runs_on_cuda and (cc is None or dtype.runs_on(cc))
    return True


def candidates(
    engine: str,
    level: str,
    results: Mapping[str, Any] | None = None,
    device: str = "gpu",
    head_dim: int | None = None,
    cc: tuple[int, int] | None = None,
) -> list[EngineKV]:
    """The types the planner may use for ``engine`` at ``level`` on ``device``, preferred first.

    One type (:func:`planned`) everywhere but llama.cpp's int4 level: with llama.cpp's
    measurements in ``results``, every measured type that stores less than q8_0 and no less than
    q4_0 and that :func:`runs_well` on ``device``, best measured quality first (smaller first on
    a tie), and q4_0 last if it was not measured; without them, q4_0 alone. A level the engine
    does not run well on ``device`` (for a model of ``head_dim``) gives ``[]``.
    """
    base = planned(engine).get(level)
    if base is None or not runs_well(base, device, head_dim, cc):
        return []
    if engine != "llama.cpp" or level != "int4":
        return [base]
    measured = measured_llama_cpp(results)
    top = kv_type("llama.cpp", "q8_0").effective_bits
    pool = [
        t
        for t in KV_TYPES
        if t.engine == "llama.cpp" and t.name in measured and runs_well(t, device, head_dim, cc)
        and base.effective_bits <= t.effective_bits < top
    ]  # fmt: skip
    if base not in pool:  # the level's smallest type stays offered, measured or not
        pool.append(base)
    return sorted(pool, key=lambda t: (measured.get(t.name, math.inf), t.effective_bits))
