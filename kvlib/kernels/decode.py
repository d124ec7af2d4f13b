"""One decode step's attention straight from the packed quantized cache (notebook 10).

At a decode step (one new query token), attention reads every cached key and value once and
does two small matrix-vector products with them: on a GPU it is limited by memory bandwidth,
not arithmetic. :class:`kvlib.caches.quantized.QuantizedKVCache` stores 8/4/3/2-bit codes, so a step
could read 2-8x fewer bytes than an fp16 cache, but only if the codes are dequantized *in
registers*, inside the attention kernel. Dequantizing the whole past into a float tensor first
(what the torch path of the cache, and transformers' ``QuantizedCache``, do) reads the codes,
writes a full fp16 copy and reads it again: slower than fp16.

:func:`decode_attention` computes ``softmax(q K^T * scaling) V`` for one query token over a
layer's :class:`~kvlib.kernels.packed.PackedKV` (tensors in the transformers convention ``(batch, kv_heads, seq_len,
head_dim)``; tokens in order ``[sinks | quantized blocks | window]``):

* ``backend="triton"``: the fused kernel (source in ``kvlib.kernels._triton``). Each program
  takes one (batch row, KV head, slice of the quantized tokens), unpacks codes in registers,
  applies per-channel key scales (``key_group`` tokens each) and per-token value scales
  (``value_group`` channels each), and keeps an online softmax (running max, sum and output,
  float32) for all query heads of its GQA group; the full-precision sinks and window go through
  the same online softmax in one more slot, and a last small kernel merges the slots
  (split-K, as in flash-decoding). The dequantized cache is never written to memory. Keys that
  were Hadamard-rotated before quantizing are read as they are and the *query* is rotated
  instead: ``q . (k_hat H^T) = (q H) . k_hat``.
* ``backend="torch"``: the reference — dequantize everything (as the cache's torch path does),
  then scaled-dot-product attention. :func:`decode_attention_reference` is the same.
* ``backend="auto"``: triton on CUDA tensors when triton is installed, else torch.

The Triton kernels run compiled on CUDA; on CPU tensors they run only in Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported; slow, for tests and notebook 10's toy
sizes). :func:`step_bytes` counts what one step reads.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import sys
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from kvlib.kernels.packed import PackedKV
from kvlib.validate import check_int

__all__ = [
    "BACKENDS",
    "PackedKV",
    "decode_attention",
    "decode_attention_reference",
    "interpreter_mode",
    "step_bytes",
    "triton_available",
]

#: Accepted values of ``backend``.
BACKENDS = ("auto", "triton", "torch")
_KERNEL_BITS = (2, 3, 4, 8)


def triton_available() -> bool:
    """Whether triton can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a blocked or half-imported triton
        return False


def interpreter_mode() -> bool:
    """Whether Triton kernels run in its interpreter, on CPU tensors: ``TRITON_INTERPRET=1``
    set before triton was first imported (anywhere in the process: ``torch.compile`` imports
    it, and transformers does when hqq is installed). Fixed once the kernels are loaded."""
    loaded = sys.modules.get("kvlib.kernels._triton")
    if loaded is not None:
        return bool(loaded.INTERPRET and loaded.LIBRARY_INTERPRETED)
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    tl = sys.modules.get("triton.language")
    return tl is None or type(tl.max).__name__ == "InterpretedFunction"


def _kernels() -> ModuleType:
    if not triton_available():
        raise ImportError(
            "the fused decode kernel needs triton (pip install 'triton>=3.0' on Linux); "
            "backend='torch' runs without it"
        )
    return importlib.import_module("kvlib.kernels._triton")


def step_bytes(kv: PackedKV, query_heads: int | None = None) -> int:
    """Bytes one fused decode step reads: packed codes, every scale and zero point, the
    full-precision sinks and window, the query and the output (the query and output in the
    window's dtype, ``query_heads`` of them; default: one per KV head)."""
    if not isinstance(kv, PackedKV):
        raise TypeError(f"kv must be a PackedKV (got {type(kv).__name__})")
    total = 0
    for t in (kv.sink_keys, kv.sink_values, kv.window_keys, kv.window_values):
        total += t.numel() * t.element_size()
    if kv.key_blocks is not None:
        total += kv.key_blocks.nbytes + kv.value_blocks.nbytes
    heads = kv.kv_heads if query_heads is None else check_int(query_heads, "query_heads", minimum=1)
    total += 2 * kv.batch_size * heads * kv.head_dim * kv.window_keys.element_size()
    return total


# ---------------------------------------------------------------- argument checks


def _check_query(query: Any, kv: PackedKV) -> torch.Tensor:
    if not isinstance(query, torch.Tensor) or not query.dtype.is_floating_point:
        raise TypeError(
            f"query must be a floating torch.Tensor (got {getattr(query, 'dtype', type(query).__name__)})"
        )
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(
            f"query must have shape (batch, q_heads, 1, head_dim): one decode step "
            f"(got {tuple(query.shape)})"
        )
    b, hq, _, d = query.shape
    if (b, d) != (kv.batch_size, kv.head_dim):
        raise ValueError(
            f"query (batch={b}, head_dim={d}) does not match the cache "
            f"(batch={kv.batch_size}, head_dim={kv.head_dim})"
        )
    if hq % kv.kv_heads:
        raise ValueError(
            f"q_heads ({hq}) must be a multiple of kv_heads ({kv.kv_heads}) (grouped-query attention)"
        )
    return query


def _check_mask(kv_mask: Any, kv: PackedKV, device: torch.device) -> torch.Tensor | None:
    if kv_mask is None:
        return None
    if not isinstance(kv_mask, torch.Tensor) or kv_mask.dtype != torch.bool:
        raise TypeError(
            f"kv_mask must be None or a bool tensor (batch, T), True = attend "
            f"(got {getattr(kv_mask, 'dtype', type(kv_mask).__name__)})"
        )
    want = (kv.batch_size, kv.num_tokens)
    if tuple(kv_mask.shape) != want:
        raise ValueError(
            f"kv_mask must have shape (batch, T) = {want} (got {tuple(kv_mask.shape)})"
        )
    return kv_mask.to(device)


def _check_scaling(scaling: Any, head_dim: int) -> float:
    if scaling is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
        raise ValueError(f"scaling must be a positive number or None (got {scaling!r})")
    return float(scaling)


# ---------------------------------------------------------------- the two paths


def decode_attention_reference(
    query: torch.Tensor,
    kv: PackedKV,
    *,
    scaling: float | None = None,
    kv_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch path: dequantize the whole layer (:meth:`PackedKV.dequantize`, in the query's
    dtype), then scaled-dot-product attention with GQA.

    Args:
        query: ``(batch, q_heads, 1, head_dim)``; ``q_heads`` a multiple of ``kv_heads``.
        kv: the layer's packed cache, window including this step's token.
        scaling: score scale; ``None``: ``1 / sqrt(head_dim)``.
        kv_mask: ``None`` or bool ``(batch, T)``, True where the query may attend (padding).

    Returns:
        ``(batch, q_heads, 1, head_dim)`` in the query's dtype.
    """
    if not isinstance(kv, PackedKV):
        raise TypeError(f"kv must be a PackedKV (got {type(kv).__name__})")
    query = _check_query(query, kv)
    scale = _check_scaling(scaling, kv.head_dim)
    mask = _check_mask(kv_mask, kv, query.device)
    keys, values = kv.dequantize(query.dtype)
    rep = query.shape[1] // kv.kv_heads
    if rep > 1:
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
    attn_mask = None if mask is None else mask[:, None, None, :]
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=attn_mask, scale=scale)


def _pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_splits(kv: PackedKV, device: torch.device, block_tokens: int) -> int:
    """Slices of the quantized tokens: enough programs to fill a GPU (about 2 per SM), none
    shorter than one tile; 1 in the interpreter."""
    tiles = -(-kv.num_quantized // block_tokens)
    if device.type != "cuda" or tiles <= 1:
        return 1
    sms = _multiprocessors(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    want = -(-2 * sms // (kv.batch_size * kv.kv_heads))
    return max(1, min(want, tiles, 256))


def _check_device(k: ModuleType, dev: torch.device) -> None:
    """Raise unless the kernels can run on ``dev``: CUDA, or CPU in Triton's interpreter."""
    if dev.type == "cpu" and not (k.INTERPRET and k.LIBRARY_INTERPRETED):
        raise ValueError(
            "the Triton kernel runs on CPU tensors only in the interpreter: set "
            "TRITON_INTERPRET=1 before triton is first imported (before torch.compile or "
            "transformers import it), or use backend='torch'"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"the Triton kernel runs on cuda (or cpu, interpreted), not {dev.type}")


def _compute_dtype(k: ModuleType, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the kernels' dot products for a query in ``dtype``."""
    # dot products in the query's 16-bit dtype (the reference dequantizes into it too),
    # float32 (IEEE) for a float32/float64 query; accumulation is float32 either way
    compute = dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32
    if k.INTERPRET and compute == torch.bfloat16:  # the interpreter's bfloat16 dot is wrong
        compute = torch.float32
    return compute


def _split_mask(
    mask: torch.Tensor | None, s_tok: int, nq: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask`` ``(batch, T)`` as int8 ``(batch, nq)`` for the quantized tokens and ``(batch,
    T - nq)`` for the sinks and window; two 1-element placeholders without a mask."""
    if mask is not None:
        mq = mask[:, s_tok : s_tok + nq].to(torch.int8).contiguous()
        mf = torch.cat([mask[:, :s_tok], mask[:, s_tok + nq :]], dim=1).to(torch.int8).contiguous()
    else:
        mq = mf = torch.empty(1, dtype=torch.int8, device=dev)
    return mq, mf


def _launch_quantized(
    k: ModuleType,
    q: torch.Tensor,
    kv: PackedKV,
    mq: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    qk_scale: float,
    splits: int,
    block_tokens: int,
    compute: torch.dtype,
    meta: dict[str, Any],
) -> None:
    """Run the quantized tokens through ``quant_split_kernel``, one program per (row, KV head,
    split), into slots ``0..splits-1`` of ``state`` = (acc ``(batch, q_heads, slots, head_dim)``,
    running max and sum ``(batch, q_heads, slots)``). ``q``: ``(batch, q_heads, head_dim)``."""
    acc, m_run, l_run = state
    dev = q.device
    b, h, slots = q.shape[0], kv.kv_heads, acc.shape[2]
    nq = kv.num_quantized
    kb, vb = kv.key_blocks, kv.value_blocks
    r = kb.shape[3]
    qr = q
    if kv.rotation is not None:  # rotate the query, not the keys
        qr = (q.float() @ kv.rotation.to(device=dev, dtype=torch.float32)).to(compute)
    per_split = -(-nq // splits)
    per_split = -(-per_split // block_tokens) * block_tokens
    k.quant_split_kernel[(b * h, splits)](
        qr.contiguous(),
        kb.packed.contiguous(),
        kb.scale.contiguous(),
        kb.offset.contiguous(),
        vb.packed.contiguous(),
        vb.scale.contiguous(),
        vb.offset.contiguous(),
        mq,
        acc,
        m_run,
        l_run,
        qk_scale,
        nq,
        per_split,
        b,
        h,
        slots,
        BLOCK_N=block_tokens,
        R=r,
        KG=kb.group_size,
        VG=vb.group_size,
        KBITS=kb.bits,
        VBITS=vb.bits,
        **meta,
    )


def _triton_decode(
    query: torch.Tensor,
    kv: PackedKV,
    scale: float,
    mask: torch.Tensor | None,
    num_splits: int | None,
    block_tokens: int,
) -> torch.Tensor:
    """The fused path: ``query`` ``(batch, q_heads, 1, head_dim)`` over ``kv``, checked by
    :func:`decode_attention`; returns ``(batch, q_heads, 1, head_dim)`` in the query's dtype."""
    k = _kernels()
    dev = query.device
    _check_device(k, dev)
    b, hq, _, d = query.shape
    h = kv.kv_heads
    gqa = hq // h
    compute = _compute_dtype(k, query.dtype)
    f32_dot = compute == torch.float32
    q = query[:, :, 0, :].to(compute)
    s_tok = kv.sink_keys.shape[2]
    nq = kv.num_quantized
    fk = torch.cat([kv.sink_keys, kv.window_keys], dim=2).contiguous()
    fv = torch.cat([kv.sink_values, kv.window_values], dim=2).contiguous()
    m_tok = fk.shape[2]
    splits = (_num_splits(kv, dev, block_tokens) if num_splits is None else num_splits) if nq else 0
    slots = splits + 1
    acc = torch.empty((b, hq, slots, d), dtype=torch.float32, device=dev)
    m_run = torch.empty((b, hq, slots), dtype=torch.float32, device=dev)
    l_run = torch.empty((b, hq, slots), dtype=torch.float32, device=dev)
    qk_scale = scale * math.log2(math.e)
    block_g, block_d = _pow2(gqa), _pow2(d)
    mq, mf = _split_mask(mask, s_tok, nq, dev)
    # compile-time constants both split kernels share
    meta: dict[str, Any] = {
        "GQA": gqa,
        "BLOCK_G": block_g,
        "D": d,
        "BLOCK_D": block_d,
        "HAS_MASK": mask is not None,
        "F32_DOT": f32_dot,
    }
    if nq:
        state = (acc, m_run, l_run)
        _launch_quantized(k, q, kv, mq, state, qk_scale, splits, block_tokens, compute, meta)
    k.full_split_kernel[(b * h,)](
        q.contiguous(),
        fk,
        fv,
        mf,
        acc,
        m_run,
        l_run,
        qk_scale,
        m_tok,
        h,
        slots,
        BLOCK_N=min(block_tokens, _pow2(m_tok)),
        **meta,
    )
    out = torch.empty((b, hq, 1, d), dtype=query.dtype, device=dev)
    k.merge_kernel[(b * hq,)](
        acc, m_run, l_run, out, slots, D=d, BLOCK_S=_pow2(slots, 2), BLOCK_D=block_d
    )
    return out


def decode_attention(
    query: torch.Tensor,
    kv: PackedKV,
    *,
    scaling: float | None = None,
    kv_mask: torch.Tensor | None = None,
    backend: str = "auto",
    num_splits: int | None = None,
    block_tokens: int = 64,
) -> torch.Tensor:
    """One decode step's attention over a packed layer (see the module docstring).

    Args:
        query: ``(batch, q_heads, 1, head_dim)`` (not rotated); ``q_heads`` a multiple of
            ``kv_heads`` (GQA: query head ``i`` reads KV head ``i // (q_heads // kv_heads)``).
        kv: the layer's :class:`PackedKV`, window including this step's token.
        scaling: score scale; ``None``: ``1 / sqrt(head_dim)``.
        kv_mask: ``None`` or bool ``(batch, T)``, True where a row may attend (left padding:
            rows of different lengths). A row that may attend to nothing gets zeros from the
            kernel (NaN from the reference).
        backend: ``"auto"`` (triton on CUDA when installed, else torch), ``"triton"`` or
            ``"torch"`` (:func:`decode_attention_reference`).
        num_splits: slices of the quantized tokens, one program each per (row, KV head);
            ``None``: about two programs per GPU multiprocessor (1 on CPU).
        block_tokens: tokens per tile (a power of two >= 16).

    Returns:
        ``(batch, q_heads, 1, head_dim)`` in the query's dtype; float32 accumulation.

    Raises:
        ValueError / TypeError: mismatched shapes, a bad mask, an unknown backend; ImportError
        for ``backend="triton"`` without triton.
    """
    if not isinstance(kv, PackedKV):
        raise TypeError(f"kv must be a PackedKV (got {type(kv).__name__})")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (got {backend!r})")
    query = _check_query(query, kv)
    scale = _check_scaling(scaling, kv.head_dim)
    mask = _check_mask(kv_mask, kv, query.device)
    if backend == "auto":
        backend = "triton" if query.is_cuda and triton_available() else "torch"
    if backend == "torch":
        return decode_attention_reference(query, kv, scaling=scale, kv_mask=kv_mask)
    block_tokens = check_int(block_tokens, "block_tokens", minimum=16)
    if block_tokens & (block_tokens - 1):
        raise ValueError(f"block_tokens must be a power of two >= 16 (got {block_tokens})")
    if num_splits is not None:
        num_splits = check_int(num_splits, "num_splits", minimum=1)
    if kv.key_blocks is not None:
        for name, blocks in (("key", kv.key_blocks), ("value", kv.value_blocks)):
            if blocks.bits not in _KERNEL_BITS:  # pragma: no cover - QuantizedTensor checks
                raise ValueError(f"{name} bits must be one of 2, 3, 4, 8 (got {blocks.bits})")
            if blocks.device != query.device:
                raise ValueError(
                    f"{name} blocks are on {blocks.device}, the query on {query.device}"
                )
    return _triton_decode(query, kv, scale, mask, num_splits, block_tokens)
