"""The planner's decision rule, in numbers: which KV-cache setting, engine and extras fit a request.

Introduced in notebook 08. :func:`kvlib.plan.planner.recommend` validates a request, calls :func:`decide`
here and has :mod:`kvlib.plan.text` put the decision into words and :mod:`kvlib.plan.settings`
into engine settings. Nothing here writes prose; every function is a pure function of numbers.
The byte math is :mod:`kvlib.memory`'s; :mod:`kvlib.plan.budget` only scales, shards and counts
(rules 1 and 3). The rules, in order:

1. **Budget per device** (per GPU under tensor parallelism),
   :func:`~kvlib.plan.budget.memory_budget`. Memory is counted in GiB (2³⁰ bytes), the unit an
   "80 GB" GPU, nvidia-smi and vLLM mean::

       usable   = memory × (1 − headroom)          headroom: 10 % on a GPU (vLLM gets the
                                                    KV budget below as kv_cache_memory_bytes),
                                                    25 % of RAM on CPU
       weights  = checkpoint bytes / tensor_parallel_size   16-bit; or, for 8-/4-bit
                                                    weights, embedding and head at 16 bits and
                                                    the rest at 8 / 4.16 bits (FP8; AWQ/GPTQ
                                                    int4, group 128), budget.QUANTIZED_WEIGHT_BITS
       overhead = runtime + activations            runtime: 1 GiB per GPU (CUDA context, kernel
                                                    workspaces, allocator slack), 0.5 GiB on CPU;
                                                    activations: one 2048-token prefill chunk ×
                                                    hidden size × 16 live fp16 values per token
       KV budget = usable − weights − overhead

2. **Engine**, :func:`choose_engine`: the engines that suit the traffic, in order
   (:func:`engine_candidates`): several GPUs → vLLM (tensor parallelism), then llama.cpp (layer
   split); several sequences on
   one GPU → vLLM (paged blocks, continuous batching), then llama.cpp (``-np`` slots); one
   sequence on one GPU → vLLM, then llama.cpp, then transformers with kvlib's cache (a library
   call, not a server: only where neither serving engine holds the sequence, which kvlib's int2
   can); CPU → llama.cpp. A request may name the engines it runs (``allowed``), which keeps
   their order. Each engine runs only its own KV types (:mod:`kvlib.plan.engines`): vLLM fp16 or fp8,
   llama.cpp f16, q8_0 or q4_0, transformers with kvlib's cache fp16 to int2 (full-attention
   models only). The plan takes the first engine whose types hold the whole request (rule 4 run
   for each), else the one that holds the most sequences.

3. **KV per sequence** at the requested context, :func:`~kvlib.plan.budget.kv_sequence_bytes`:
   the cache one GPU holds (:func:`~kvlib.plan.budget.gpu_share`: each of ``tp`` GPUs holds
   ``ceil(kv_heads / tp)`` of the KV heads, at least one, so heads are replicated when
   tp > kv_heads; an MLA latent is replicated on every GPU), sized by :func:`kvlib.memory.kv_cache_bytes` (sliding windows and MLA included) at the
   engine type's bits *and metadata*: vLLM's fp8 8 bits; llama.cpp's q8_0 / q4_0 8.5 / 4.5 (one
   fp16 scale per block of 32 values); kvlib's caches one fp16 scale and zero point per group.

4. **Setting**, :func:`choose_setting`: the highest-precision level, among those the ``quality``
   level allows *and the engine runs*, whose cache for ``concurrency`` sequences at the full
   context fits the KV budget: ``"max"`` fp16 only; ``"balanced"`` fp16 → int8 → int4;
   ``"aggressive"`` … → int2. If none fits all sequences, the lowest such level and the number
   of sequences it does fit (status ``"reduced"``); if not even one sequence fits, or the
   weights alone do not, status ``"impossible"``, and :func:`kvlib.plan.fallbacks.fallbacks` finds what would fit
   (fewer tokens, the next quality level, lower weight bits, more GPUs, or both, or how much
   memory). The same rule, run for every engine, gives the plan's alternatives
   (:attr:`Decision.options`). Eight or more concurrent conversations → also say how the engine
   keeps idle conversations between turns (:func:`idle_storage`): PCA-coded by kvlib's codec
   (:mod:`kvlib.kvtc.codec`) on transformers, the engine's own prefix reuse on vLLM and llama.cpp,
   which cannot load a PCA-coded cache.

5. **Token eviction, never chosen**: when the request does not fit, whether keeping 1/k of each
   sequence's fp16 bytes would hold it, on transformers with kvlib's cache
   (:func:`kvlib.plan.eviction.eviction_option`, :attr:`Decision.eviction`). It is an option to
   weigh, not the plan: eviction drops tokens, and what was dropped cannot be retrieved.

The plan is worst-case: every sequence at the full context at once. Real traffic is shorter, and
a paged engine admits more sequences than this count; the count is what is *guaranteed*.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlib.memory import window_bytes
from kvlib.plan import engines
from kvlib.plan.budget import (
    MemoryBudget,
    context_that_fits,
    engine_sequences,
    gpu_share,
    kv_sequence_bytes,
    memory_budget,
    paged_sequences,
)
from kvlib.plan.engines import EngineKV
from kvlib.plan.eviction import EvictionOption, eviction_option
from kvlib.specs import ModelSpec

__all__ = [
    "DEVICES",
    "IDLE_STORAGE",
    "IDLE_STORAGE_MIN_SESSIONS",
    "KV_SETTINGS",
    "QUALITIES",
    "QUALITY_LADDER",
    "TP_CANDIDATES",
    "WEIGHT_BITS",
    "Decision",
    "EngineOption",
    "KVSetting",
    "choose_engine",
    "engine_candidates",
    "choose_setting",
    "decide",
    "idle_storage",
    "kv_types",
    "sequences_by_level",
    "types_by_level",
]

QUALITIES = ("max", "balanced", "aggressive")
WEIGHT_BITS = (16, 8, 4)
DEVICES = ("gpu", "cpu")

#: Conversations at or above this count get the idle-storage (PCA) recommendation.
IDLE_STORAGE_MIN_SESSIONS = 8
#: How each engine keeps an idle conversation's cache between turns. Only where kvlib holds the
#: cache (transformers) can it be stored PCA-coded (:mod:`kvlib.kvtc.codec`); vLLM and
#: llama.cpp cannot load such a cache, and reuse their own: vLLM's prefix caching keeps a
#: finished turn's blocks until their memory is needed, llama-server keeps each slot's cache and
#: reuses the longest matching prefix of the next request.
IDLE_STORAGE = {"transformers": "pca", "vllm": "prefix-caching", "llama.cpp": "slot-reuse"}
#: Candidate tensor-parallel sizes when a plan looks for "how many GPUs would fit".
TP_CANDIDATES = (2, 4, 8)


@dataclass(frozen=True)
class KVSetting:
    """One precision level of the quality ladder.

    What each engine stores at this level, and how many bytes that takes, is in
    :mod:`kvlib.plan.engines`; ``cache_name`` is the :mod:`kvlib.caches.registry` cache that measures
    the level in ``kvlib/results.json``.
    """

    name: str
    bits: int
    cache_name: str


KV_SETTINGS: dict[str, KVSetting] = {
    "fp16": KVSetting("fp16", 16, "dynamic-fp16"),
    "int8": KVSetting("int8", 8, "kvlib-int8"),
    "int4": KVSetting("int4", 4, "kvlib-int4"),
    "int2": KVSetting("int2", 2, "kvlib-int2"),
}

#: Which settings each quality level may use, highest precision first.
QUALITY_LADDER: dict[str, tuple[str, ...]] = {
    "max": ("fp16",),
    "balanced": ("fp16", "int8", "int4"),
    "aggressive": ("fp16", "int8", "int4", "int2"),
}


def kv_types(
    engine: str, spec: ModelSpec, device: str = "gpu", cc: tuple[int, int] | None = None
) -> dict[str, EngineKV]:
    """The KV type ``engine`` uses at each level it can run for ``spec`` on ``device``, highest
    first (:func:`kvlib.plan.engines.planned`, less what its default build does not run well there,
    :func:`kvlib.plan.engines.runs_well`: on a GPU llama.cpp's quantized types need a head size its
    CUDA decode kernel reads natively). kvlib's caches keep sliding-window layers in fp16 and
    quantize only the global ones, and are priced so (:attr:`~kvlib.plan.engines.EngineKV.window_bits`)."""
    types = engines.planned(engine)
    return {
        level: t for level, t in types.items() if engines.runs_well(t, device, spec.head_dim, cc)
    }


# --------------------------------------------------------------------------------------------
# 2. and 4. the engine, the setting, idle storage


def choose_setting(
    fits: Mapping[str, int], quality: str, concurrency: int
) -> tuple[str | None, str]:
    """Rule 4: ``(setting, status)`` from the sequences each level fits at the full context
    (``fits`` holds the levels the engine runs).

    The highest precision the ``quality`` level allows that fits ``concurrency`` sequences →
    ``"ok"``; else the lowest allowed if it fits one → ``"reduced"``; else ``(None,
    "impossible")``.
    """
    ladder = [name for name in QUALITY_LADDER[quality] if name in fits]
    for name in ladder:
        if fits[name] >= concurrency:
            return name, "ok"
    if fits[ladder[-1]] >= 1:
        return ladder[-1], "reduced"
    return None, "impossible"


def engine_candidates(
    device: str, concurrency: int, tp: int, allowed: Sequence[str] | None = None
) -> tuple[str, ...]:
    """The engines that can serve a request, in the order the traffic prefers them: on a CPU
    llama.cpp; on several GPUs vLLM (tensor parallelism), then llama.cpp (which splits the
    layers over the GPUs, its default ``--split-mode layer``); several sequences on one GPU vLLM (paged
    blocks, continuous batching), then llama.cpp (``-np`` slots); one sequence on one GPU the
    same two serving engines, then transformers (kvlib's cache in ``generate()``), whose caches go
    down to int2 but which serves no one: it is chosen only where neither engine holds the
    sequence (on an H200, kvlib-int4 in transformers decoded at 16.5 tokens/s with its fused kernel
    against the bf16 cache's 28.8 and took 15.4 s to the first token against 1.4: notebook 10). ``allowed``: the
    engines the request allows (None: all), in this order."""
    if device == "cpu":
        order: tuple[str, ...] = ("llama.cpp",)
    elif tp > 1 or concurrency > 1:
        order = ("vllm", "llama.cpp")
    else:
        order = ("vllm", "llama.cpp", "transformers")
    return order if allowed is None else tuple(e for e in order if e in allowed)


def choose_engine(
    device: str,
    concurrency: int,
    tp: int,
    options: Mapping[str, EngineOption] | None = None,
    allowed: Sequence[str] | None = None,
) -> str:
    """Rule 2: the first of :func:`engine_candidates` whose KV types hold the whole request
    (:attr:`EngineOption.holds`: every sequence at the full context, or at the request's typical
    length on a paged engine); if none does, the one that fits the most sequences at the full
    context (the earlier on a tie). Without ``options``, the first candidate."""
    candidates = engine_candidates(device, concurrency, tp, allowed)
    if options:  # an engine that cannot run the request's weights on this GPU has no option
        candidates = tuple(e for e in candidates if e in options)
    if not candidates:
        raise ValueError(
            f"none of the engines {list(allowed or engines.ENGINES)} serves this request here"
        )
    if not options:
        return candidates[0]
    for engine in candidates:
        if options[engine].holds:
            return engine
    return max(candidates, key=lambda e: (options[e].sequences, -candidates.index(e)))


def idle_storage(concurrency: int, kv: str | None, engine: str) -> str | None:
    """Rule 4 (extras): how ``engine`` keeps idle conversations' caches between turns
    (:data:`IDLE_STORAGE`), from :data:`IDLE_STORAGE_MIN_SESSIONS` conversations on, when the
    request fits at all; else None.

    Raises:
        ValueError: an engine the plan does not know.
    """
    if engine not in IDLE_STORAGE:
        raise ValueError(f"engine must be one of {', '.join(IDLE_STORAGE)} (got {engine!r})")
    return IDLE_STORAGE[engine] if concurrency >= IDLE_STORAGE_MIN_SESSIONS and kv else None


# --------------------------------------------------------------------------------------------
# the decision


def _available(
    device: str, tp: int, weight_bits: int = 16, cc: tuple[int, int] | None = None
) -> tuple[str, ...]:
    """Engines a plan gives settings for: llama.cpp on a CPU, vLLM and llama.cpp across GPUs,
    all three on one GPU; not vLLM for 8-bit weights on a GPU below
    :data:`~kvlib.plan.engines.VLLM_FP8_WEIGHTS_MIN_CC` (it has no fp8 kernels there).

    Across GPUs llama.cpp's layer split puts ``1/tp`` of the layers, with their whole cache, on
    each GPU; the plan prices it as vLLM's head split (:func:`~kvlib.plan.budget.gpu_share`), which holds the same
    bytes per GPU wherever ``tp`` divides the KV heads and the layers, and more (replicated
    heads) where ``tp`` exceeds the KV heads: conservative for llama.cpp."""
    if device == "cpu":
        return ("llama.cpp",)
    out = ("vllm", "llama.cpp") if tp > 1 else engines.ENGINES
    if weight_bits == 8 and cc is not None and cc < engines.VLLM_FP8_WEIGHTS_MIN_CC:
        out = tuple(e for e in out if e != "vllm")
    return out


def sequences_by_level(
    spec: ModelSpec, budget: MemoryBudget, context_len: int, tp: int, engine: str
) -> dict[str, int]:
    """Sequences of ``context_len`` tokens that each level ``engine`` runs fits in ``budget``
    (at that engine's type), highest level first."""
    kv_budget = budget.kv_budget_bytes
    return {
        name: engine_sequences(engine, spec, kv_budget, context_len, t.storage, tp)
        for name, t in kv_types(engine, spec, budget.device, budget.compute_capability).items()
    }


def _priced_exactly(t: EngineKV, spec: ModelSpec) -> bool:
    """A mixed K/V type is priced at its mean width: exact only where keys and values have the
    same width (not MLA)."""
    return not t.mixed or (not spec.is_mla and spec.head_dim == spec.v_head_dim)


def types_by_level(
    spec: ModelSpec,
    budget: MemoryBudget,
    context_len: int,
    concurrency: int,
    tp: int,
    engine: str,
    results: Mapping[str, Any] | None = None,
) -> dict[str, tuple[EngineKV, int]]:
    """For each level ``engine`` runs: the type it uses there and the sequences that type fits.

    Where a level has several candidates (:func:`kvlib.plan.engines.candidates`: llama.cpp's measured
    types at int4), the first, best-measured one that fits ``concurrency`` sequences; if none
    does, the one that fits the most, the smallest on a tie, the better measured among equals.
    """
    kv_budget = budget.kv_budget_bytes
    out: dict[str, tuple[EngineKV, int]] = {}
    for level, default in kv_types(engine, spec, budget.device, budget.compute_capability).items():
        pool = [
            t
            for t in engines.candidates(
                engine, level, results, budget.device, spec.head_dim, budget.compute_capability
            )
            if _priced_exactly(t, spec)
        ]
        fits = [
            (t, engine_sequences(engine, spec, kv_budget, context_len, t.storage, tp))
            for t in pool or [default]
        ]
        # none holds them all: the type that fits the most, the smallest on a tie (so that a
        # shorter context fits too), the better measured among equals
        most = max(fits, key=lambda tn: (tn[1], -tn[0].effective_bits))
        out[level] = next(((t, n) for t, n in fits if n >= concurrency), most)
    return out


@dataclass(frozen=True)
class EngineOption:
    """What one engine can do for a request: the rule of :func:`choose_setting` run on the KV
    types it has (:func:`kv_types`).

    Attributes:
        engine: one of :data:`kvlib.plan.engines.ENGINES`.
        kv: the level chosen, or None when not one sequence fits at any level it runs.
        kv_type: the engine's KV type at that level (``"fp8"``, ``"q4_0"``, ``"kvlib-int4"``).
        status: ``"ok"``, ``"reduced"`` or ``"impossible"``, as for the plan.
        sequences: sequences of the full context that type fits (0 when impossible).
        max_context: longest context at which all requested sequences fit at that type.
        effective_bits: bits per cached value of that type, metadata included.
        admitted: sequences of the request's typical length the engine keeps at once, at most
            the concurrency: a paged engine (vLLM) admits by the whole blocks a sequence holds
            (:func:`~kvlib.plan.budget.paged_sequences`); llama.cpp and transformers reserve the
            full context for each sequence and admit ``sequences``. Equal to ``sequences`` when
            the request gives no typical length.
        holds: every requested sequence is kept at once: all at the full context (``"ok"``),
            or all at the typical length on a paged engine.
    """

    engine: str
    kv: str | None
    kv_type: str | None
    status: str
    sequences: int
    max_context: int
    effective_bits: float | None
    admitted: int = 0
    holds: bool = False


def _option(
    spec: ModelSpec,
    budget: MemoryBudget,
    context_len: int,
    concurrency: int,
    quality: str,
    tp: int,
    engine: str,
    results: Mapping[str, Any] | None = None,
    typical_context: int | None = None,
) -> EngineOption:
    chosen = types_by_level(spec, budget, context_len, concurrency, tp, engine, results)
    fits = {level: n for level, (_, n) in chosen.items()}
    kv, status = choose_setting(fits, quality, concurrency)
    if kv is None:
        return EngineOption(engine, None, None, status, 0, 0, None)
    t = chosen[kv][0]
    sequences = min(concurrency, fits[kv])
    admitted = sequences
    if engine == "vllm" and typical_context is not None:
        at_typical = paged_sequences(spec, budget.kv_budget_bytes, typical_context, t.storage, tp)
        admitted = max(sequences, min(concurrency, at_typical))
    return EngineOption(
        engine=engine,
        kv=kv,
        kv_type=t.name,
        status=status,
        sequences=sequences,
        max_context=context_that_fits(spec, budget.kv_budget_bytes, concurrency, t.storage, tp),
        effective_bits=t.effective_bits,
        admitted=admitted,
        holds=status == "ok" or admitted >= concurrency,
    )


@dataclass(frozen=True)
class Decision:
    """What the rule decided for one request, in numbers (words: :mod:`kvlib.plan.text`).

    The request (``model`` … ``weight_bits``) and the decision: ``status`` is ``"ok"`` (all
    ``concurrency`` sequences fit at the full context), ``"reduced"`` (fewer fit:
    ``max_concurrency``) or ``"impossible"`` (not one sequence fits; ``kv`` is None). Byte
    figures are per device (per GPU under tensor parallelism); ``max_*`` figures are at the
    chosen setting (at the lowest allowed one for ``kv_bytes_per_sequence`` when none is chosen),
    ``*_fp16`` at fp16 for comparison. ``gpu_memory_gb`` is in GiB, as the driver reports it (an
    "80 GB" H100 79.6 GiB). ``kv`` is the level, ``kv_type`` the engine's own type at that
    level (``"fp8"`` on vLLM, ``"q4_0"`` on llama.cpp, ``"kvlib-int4"`` on transformers); every
    count is at that type's bytes. ``sequences_by_setting``: sequences each level the engine runs
    fits at the full context. ``options``: the same rule for every engine
    (:class:`EngineOption`), so each engine's settings carry their own counts.
    ``typical_context``: the length most conversations reach, when the request says it (a paged
    engine admits sequences by what they hold, :func:`~kvlib.plan.budget.paged_sequences`).
    ``eviction``: the token-eviction budget that would hold the whole request when it does not fit (rule 5),
    else None — never the plan's setting. ``engines``: the engines the request allowed the plan to
    choose (None: every one).
    """

    model: str
    spec: ModelSpec
    device: str
    gpu_memory_gb: float
    num_gpus: int
    context_len: int
    concurrency: int
    quality: str
    weight_bits: int
    status: str
    kv: str | None
    kv_type: str | None
    engine: str
    paging: bool
    idle_storage: str | None
    tensor_parallel_size: int
    budget: MemoryBudget
    kv_bytes_per_sequence: int
    kv_bytes_per_sequence_fp16: int
    max_concurrency: int
    max_concurrency_fp16: int
    max_context: int
    max_context_fp16: int
    sequences_by_setting: Mapping[str, int] = field(default_factory=dict, repr=False, compare=False)
    options: Mapping[str, EngineOption] = field(default_factory=dict, repr=False, compare=False)
    types_by_setting: Mapping[str, EngineKV] = field(
        default_factory=dict, repr=False, compare=False
    )
    eviction: EvictionOption | None = field(default=None, repr=False, compare=False)
    typical_context: int | None = None
    engines: tuple[str, ...] | None = None

    @property
    def fits(self) -> bool:
        """True when every requested sequence fits at the full context."""
        return self.status == "ok"

    @property
    def setting(self) -> KVSetting | None:
        return KV_SETTINGS[self.kv] if self.kv else None

    @property
    def num_sequences(self) -> int:
        """Sequences the plan provisions for: the request, or what fits when reduced."""
        return min(self.concurrency, self.max_concurrency)

    @property
    def lowest_setting(self) -> str:
        """The lowest-precision level the quality level allows and the engine runs."""
        return [n for n in QUALITY_LADDER[self.quality] if n in self.sequences_by_setting][-1]

    @property
    def kv_storage(self) -> EngineKV | None:
        """The engine's KV type the plan uses (None when nothing fits)."""
        return self.types_by_setting[self.kv] if self.kv else None


def decide(
    spec: ModelSpec,
    gpu_memory_gb: float,
    context_len: int,
    concurrency: int = 1,
    quality: str = "balanced",
    weight_bits: int = 16,
    num_gpus: int = 1,
    *,
    device: str = "gpu",
    model: str | None = None,
    results: Mapping[str, Any] | None = None,
    typical_context: int | None = None,
    allowed: Sequence[str] | None = None,
    compute_capability: tuple[int, int] | None = None,
) -> Decision:
    """Rules 1–4 for a request that is already valid (:func:`kvlib.plan.planner.recommend` checks it).

    ``gpu_memory_gb`` is GiB per device; ``num_gpus`` is the tensor-parallel size; ``model`` is
    the name to show (default: the spec's); ``results`` holds the measurements that choose
    among an engine's types at one level (:func:`types_by_level`; ``None``: none, so each level
    has its one default type — :func:`kvlib.plan.planner.recommend` passes the results it cites);
    ``typical_context`` (tokens, at most ``context_len``) sizes a paged engine's admission
    (:func:`kvlib.plan.settings.vllm_max_num_seqs`), not the guarantee; ``allowed`` the engines
    the request allows to be chosen (None: every one; the others still get their options);
    ``compute_capability`` the GPU's, where known (it decides the vLLM types and weights that run).
    """
    results = {} if results is None else results
    tp = num_gpus
    budget = memory_budget(spec, device, gpu_memory_gb, weight_bits, tp, compute_capability)
    options = {
        e: _option(spec, budget, context_len, concurrency, quality, tp, e, results, typical_context)
        for e in engines.ENGINES
        if e in _available(device, tp, weight_bits, compute_capability)
    }
    allowed = None if allowed is None else tuple(allowed)
    engine = choose_engine(device, concurrency, tp, options, allowed)
    chosen = types_by_level(spec, budget, context_len, concurrency, tp, engine, results)
    types = {level: t for level, (t, _) in chosen.items()}
    fits = {level: n for level, (_, n) in chosen.items()}
    kv, status = choose_setting(fits, quality, concurrency)
    shown = kv or [n for n in QUALITY_LADDER[quality] if n in fits][-1]
    store, fp16 = types[shown].storage, types["fp16"].storage
    kv_budget = budget.kv_budget_bytes
    fp16_bytes = kv_sequence_bytes(spec, context_len, fp16, tp)
    return Decision(
        model=model if model is not None else (spec.name or "custom model"),
        spec=spec,
        device=device,
        gpu_memory_gb=gpu_memory_gb,
        num_gpus=num_gpus,
        context_len=context_len,
        concurrency=concurrency,
        quality=quality,
        weight_bits=weight_bits,
        status=status,
        kv=kv,
        kv_type=types[kv].name if kv else None,
        engine=engine,
        paging=engine == "vllm" and kv is not None,
        idle_storage=idle_storage(concurrency, kv, engine),
        tensor_parallel_size=tp,
        budget=budget,
        kv_bytes_per_sequence=kv_sequence_bytes(spec, context_len, store, tp),
        kv_bytes_per_sequence_fp16=fp16_bytes,
        max_concurrency=fits[shown] if kv else 0,
        max_concurrency_fp16=fits["fp16"],
        max_context=context_that_fits(spec, kv_budget, concurrency, store, tp) if kv else 0,
        max_context_fp16=context_that_fits(spec, kv_budget, concurrency, fp16, tp),
        sequences_by_setting=fits,
        options=options,
        types_by_setting=types,
        eviction=eviction_option(
            spec,
            kv_budget,
            fp16_bytes,
            concurrency,
            status,
            tp,
            window_bytes(gpu_share(spec, tp), context_len),
        ),
        typical_context=typical_context,
        engines=allowed,
    )
