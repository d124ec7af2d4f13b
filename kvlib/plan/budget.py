"""The planner's byte arithmetic: one device's memory budget, and how many sequences fit in it.

Rules 1 and 3 of :mod:`kvlib.plan.rule`: :func:`memory_budget` is what one device (one GPU under
tensor parallelism) has left for the KV cache once headroom, its share of the weights and
runtime + activations are subtracted; :func:`kv_sequence_bytes` is one sequence's cache on one
GPU (:func:`gpu_share`), and :func:`sequences_that_fit`, :func:`paged_sequences` and
:func:`context_that_fits` count what fits the budget. The byte math is :mod:`kvlib.memory`'s;
this module only scales, shards and counts. Pure functions of numbers, no prose.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from kvlib import memory
from kvlib.memory import GIB
from kvlib.specs import ModelSpec

__all__ = [
    "ACTIVATION_VALUES_PER_HIDDEN",
    "HEADROOM_FRACTION",
    "PREFILL_CHUNK_TOKENS",
    "QUANTIZED_WEIGHT_BITS",
    "RUNTIME_OVERHEAD_BYTES",
    "VLLM_BLOCK_SIZE",
    "MemoryBudget",
    "Storage",
    "context_that_fits",
    "engine_sequences",
    "gpu_share",
    "kv_sequence_bytes",
    "memory_budget",
    "paged_sequences",
    "sequences_that_fit",
    "valid_tp",
]

#: Fraction of memory never planned for. (vLLM 0.32's default ``gpu_memory_utilization`` is
#: 0.92; the plan hands vLLM its own KV budget, ``kv_cache_memory_bytes``, instead.)
HEADROOM_FRACTION = {"gpu": 0.10, "cpu": 0.25}
#: Fixed runtime allowance per device: CUDA context, kernel workspaces, allocator slack.
RUNTIME_OVERHEAD_BYTES = {"gpu": 1 * GIB, "cpu": GIB // 2}
#: Activations: one prefill chunk of this many tokens ...
PREFILL_CHUNK_TOKENS = 2048
#: ... times hidden size times this many live fp16 values per token (residual, norm, q/k/v,
#: attention output, and the MLP's gate/up/activation at ~3.5× hidden — one layer at a time).
ACTIVATION_VALUES_PER_HIDDEN = 16
#: vLLM's default block size on CUDA (tokens per KV block).
VLLM_BLOCK_SIZE = 16


#: How a cache is stored: ``(bits, group_size, group_meta_bits, window_bits)``, as
#: :func:`kvlib.memory.kv_cache_bytes` takes them (:attr:`kvlib.plan.engines.EngineKV.storage`).
Storage = tuple[int, int | None, int, int | None]


# --------------------------------------------------------------------------------------------
# 1. the budget


@dataclass(frozen=True)
class MemoryBudget:
    """Where one device's memory goes (bytes, per GPU under tensor parallelism).

    ``kv_budget_bytes`` may be negative: the weights and overhead alone do not fit.
    ``compute_capability``: the GPU's, where the request names it (``(7, 5)`` for a T4), which
    decides the KV types and weights an engine runs there; None: not known.
    """

    device_bytes: int
    headroom_bytes: int
    weights_bytes: int
    overhead_bytes: int
    kv_budget_bytes: int
    tensor_parallel_size: int = 1
    device: str = "gpu"
    compute_capability: tuple[int, int] | None = None

    @property
    def usable_bytes(self) -> int:
        return self.device_bytes - self.headroom_bytes

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) rows in the order they are subtracted, for tables."""
        return [
            ("device memory", self.device_bytes),
            ("headroom", self.headroom_bytes),
            ("weights", self.weights_bytes),
            ("runtime + activations", self.overhead_bytes),
            ("left for the KV cache", self.kv_budget_bytes),
        ]


#: Bits per weight of a pre-quantized checkpoint's linear layers, scales included: 8-bit is
#: FP8 (vLLM ``--quantization fp8``; one scale per output channel, negligible) or GGUF Q8_0
#: (8.5 bits: a 16-bit scale per 32 weights); 4-bit is int4 in groups of 128 with a 16-bit scale
#: and a 4-bit zero point each (AWQ, GPTQ: 4 + 20/128), the most compact of the 4-bit formats
#: the engines load (GGUF's Q4_K_M averages about 4.9 bits). The embedding and the output head
#: stay at 16 bits in all of them.
QUANTIZED_WEIGHT_BITS: dict[int, float] = {8: 8.0, 4: 4 + 20 / 128}


def _weights_bytes(spec: ModelSpec, weight_bits: int) -> int:
    """The checkpoint's bytes at ``weight_bits``: every parameter at 16 bits, or, for 8- and
    4-bit weights, the embedding and output head (:attr:`ModelSpec.embedding_params`) at 16 bits
    and the rest at :data:`QUANTIZED_WEIGHT_BITS`."""
    if spec.num_params is None:
        raise ValueError(
            f"{spec.name or 'custom model'} has no parameter count: the weights' size is needed "
            "to plan memory — pass spec_from_config(config, num_params=...) or a ModelSpec with "
            "num_params"
        )
    if weight_bits >= 16:
        return spec.weights_bytes(weight_bits)
    embed = min(spec.embedding_params, spec.num_params)
    body = spec.num_params - embed
    return math.ceil(body * QUANTIZED_WEIGHT_BITS[weight_bits] / 8) + 2 * embed


def memory_budget(
    spec: ModelSpec,
    device: str,
    gpu_memory_gib: float,
    weight_bits: int,
    tp: int = 1,
    compute_capability: tuple[int, int] | None = None,
) -> MemoryBudget:
    """Rule 1: one device's memory (``gpu_memory_gib`` GiB) less headroom, this device's share of
    the weights (``1 / tp`` of them) and runtime + activations; the rest is the KV budget.

    Raises:
        ValueError: ``spec`` has no ``num_params``.
    """
    device_bytes = int(gpu_memory_gib * GIB)
    headroom = int(device_bytes * HEADROOM_FRACTION[device])
    weights = math.ceil(_weights_bytes(spec, weight_bits) / tp)
    hidden = int(spec.hidden_size or spec.num_heads * spec.head_dim)
    activations = PREFILL_CHUNK_TOKENS * hidden * ACTIVATION_VALUES_PER_HIDDEN * 2
    overhead = RUNTIME_OVERHEAD_BYTES[device] + activations
    return MemoryBudget(
        device_bytes=device_bytes,
        headroom_bytes=headroom,
        weights_bytes=weights,
        overhead_bytes=overhead,
        kv_budget_bytes=device_bytes - headroom - weights - overhead,
        tensor_parallel_size=tp,
        device=device,
        compute_capability=compute_capability,
    )


# --------------------------------------------------------------------------------------------
# 2. the cache of one sequence, and what fits (kvlib.memory's byte math on one GPU's share)


def valid_tp(spec: ModelSpec, tp: int) -> bool:
    """Tensor parallelism splits the attention heads evenly: ``tp`` must divide them."""
    return spec.num_heads % tp == 0


def gpu_share(spec: ModelSpec, tp: int) -> ModelSpec:
    """The part of the cache one of ``tp`` GPUs holds, as a spec of its own.

    ``ceil(num_kv_heads / tp)`` KV heads (at least one: heads are replicated when
    ``tp > num_kv_heads``); an MLA latent is not split (every GPU holds all of it). Only the
    cache's shape changes; ``num_params`` is the whole model's.
    """
    if tp <= 1 or spec.is_mla:
        return spec
    kv_heads = -(-spec.num_kv_heads // tp)
    return dataclasses.replace(
        spec,
        name=f"{spec.name} (1/{tp} of the KV heads)",
        num_heads=kv_heads * (spec.num_heads // spec.num_kv_heads),
        num_kv_heads=kv_heads,
    )


def kv_sequence_bytes(spec: ModelSpec, context_len: int, store: Storage, tp: int = 1) -> int:
    """Rule 3: bytes one sequence of ``context_len`` tokens keeps on each GPU, stored as
    ``store = (bits, group_size, group_meta_bits)``."""
    bits, group, meta, window = store
    return memory.kv_cache_bytes(
        gpu_share(spec, tp),
        context_len,
        1,
        bits,
        group_size=group,
        group_meta_bits=meta,
        window_bits=window,
    )


def _as_memory(share: ModelSpec, kv_budget: int) -> int:
    """Memory that leaves exactly ``kv_budget`` bytes for the cache next to 16-bit weights.

    :func:`kvlib.memory.max_batch` / :func:`~kvlib.memory.max_context` size a cache next to the
    weights; the plan's budget has its weights (this GPU's share) subtracted already, so they
    are added back here and subtracted there.
    """
    return kv_budget + _weights_bytes(share, 16)


def _fit_on_gpu(
    fit: Callable[..., int], spec: ModelSpec, kv_budget: int, n: int, store: Storage, tp: int
) -> int:
    """``fit`` (:func:`kvlib.memory.max_batch` for sequences of ``n`` tokens,
    :func:`~kvlib.memory.max_context` for ``n`` sequences) on one of ``tp`` GPUs' share of the
    cache with ``kv_budget`` bytes for it, stored as ``store``; 0 when the budget is not positive."""
    if kv_budget <= 0:
        return 0
    share = gpu_share(spec, tp)
    bits, group, meta, window = store
    return fit(
        share,
        _as_memory(share, kv_budget),
        n,
        bits,
        16,
        group_size=group,
        group_meta_bits=meta,
        window_bits=window,
    )


def sequences_that_fit(
    spec: ModelSpec, kv_budget: int, context_len: int, store: Storage, tp: int = 1
) -> int:
    """Sequences of ``context_len`` tokens whose caches fit ``kv_budget`` bytes on each GPU
    (:func:`kvlib.memory.max_batch`); 0 when the budget is not positive."""
    return _fit_on_gpu(memory.max_batch, spec, kv_budget, context_len, store, tp)


def paged_sequences(
    spec: ModelSpec,
    kv_budget: int,
    tokens: int,
    store: Storage,
    tp: int = 1,
    block_size: int = VLLM_BLOCK_SIZE,
) -> int:
    """Sequences of ``tokens`` tokens a paged engine (vLLM) keeps at once in ``kv_budget`` bytes
    on each GPU: the budget is cut into whole blocks of ``block_size`` tokens, one of which
    (vLLM's null block) is never handed to a request, and each sequence holds
    ``ceil(tokens / block_size)`` blocks (notebook 07). Nothing else is reserved, so shorter
    conversations admit more sequences than the full-context count. (The block count is exact
    for full-attention and MLA models, checked against vLLM's reported capacity by
    ``benchmarks/bench_vllm.py``; sliding-window layers are priced at their window.)"""
    if kv_budget <= 0:
        return 0
    null_block = kv_sequence_bytes(spec, block_size, store, tp)
    blocks = -(-tokens // block_size)
    return sequences_that_fit(spec, kv_budget - null_block, blocks * block_size, store, tp)


def engine_sequences(
    engine: str, spec: ModelSpec, kv_budget: int, tokens: int, store: Storage, tp: int = 1
) -> int:
    """Sequences of ``tokens`` tokens ``engine`` keeps at once: whole blocks less the null
    block on vLLM (:func:`paged_sequences`), whole sequences on llama.cpp and transformers
    (:func:`sequences_that_fit`)."""
    if engine == "vllm":
        return paged_sequences(spec, kv_budget, tokens, store, tp)
    return sequences_that_fit(spec, kv_budget, tokens, store, tp)


def context_that_fits(
    spec: ModelSpec, kv_budget: int, concurrency: int, store: Storage, tp: int = 1
) -> int:
    """Longest context (tokens) at which ``concurrency`` sequences fit ``kv_budget`` bytes on
    each GPU (:func:`kvlib.memory.max_context`): 0 when not one token fits,
    :data:`kvlib.memory.UNBOUNDED` when every layer slides and the full windows fit."""
    return _fit_on_gpu(memory.max_context, spec, kv_budget, concurrency, store, tp)
