"""One decode step's attention straight from the packed quantized cache (notebook 10).

At a decode step (one new query token), attention reads every cached key and value once and
does two small matrix-vector products with them: on a GPU it is limited by memory bandwidth,
not arithmetic. :class:`kvlib.caches.quantized.QuantizedKVCache` stores 8/4/3/2-bit codes, so a step
could read 2-8x fewer bytes than an fp16 cache, but only if the codes are dequantized *in
registers*, inside the attention kernel. Dequantizing the whole past into a float tensor first
(what the torch path of the cache, and transformers' ``QuantizedCache``, do) reads the codes,
writes a full fp16 copy and reads it again: slower than fp16.

:func:`decode_attention` computes ``softmax(q K^T * scaling) V`` for one query token over a
layer's :class:`PackedKV` (tensors in the transformers convention ``(batch, kv_heads, seq_len,
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
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from kvlib.quant.rotation import unrotate
from kvlib.quant.tensor import QuantizedTensor
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


@dataclass(frozen=True)
class PackedKV:
    """One layer's cache as the kernel reads it (the state of a :class:`kvlib.caches.quantized.
    QuantizedKVLayer`, plus the tokens of the current step).

    Tokens are in order ``[sinks | quantized blocks | window]``, ``T = s + n * R + w``.

    Attributes:
        sink_keys, sink_values: ``(batch, kv_heads, s, head_dim)`` full precision (``s >= 0``).
        key_blocks: ``None`` (no block yet) or a :class:`~kvlib.quant.tensor.QuantizedTensor` of shape
            ``(n, batch, kv_heads, R, head_dim)``, asymmetric, quantized over axis 3 (tokens:
            per channel) in groups of ``key_group`` tokens, codes laid out in rows
            ``(n, batch, kv_heads, bytes)`` (``with_rows(3)``).
        value_blocks: same shape, quantized over axis 4 (head_dim: per token) in groups of
            ``value_group`` channels; ``None`` exactly when ``key_blocks`` is.
        window_keys, window_values: ``(batch, kv_heads, w, head_dim)`` full precision: the
            residual window followed by the step's new token(s).
        rotation: ``None``, or the orthonormal ``(head_dim, head_dim)`` matrix ``H`` the keys
            were multiplied by before quantizing (blocks only; sinks and window are not rotated).
    """

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    key_blocks: QuantizedTensor | None
    value_blocks: QuantizedTensor | None
    window_keys: torch.Tensor
    window_values: torch.Tensor
    rotation: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("sink_keys", "sink_values", "window_keys", "window_values"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.dtype.is_floating_point:
                raise ValueError(
                    f"{name} must be a 4-d floating tensor (batch, kv_heads, seq_len, head_dim) "
                    f"(got {getattr(t, 'shape', type(t).__name__)})"
                )
        b, h, _, d = self.window_keys.shape
        for name in ("sink_keys", "sink_values", "window_values"):
            t = getattr(self, name)
            if (t.shape[0], t.shape[1], t.shape[3]) != (b, h, d):
                raise ValueError(
                    f"{name} must have shape (batch={b}, kv_heads={h}, seq_len, head_dim={d}) "
                    f"like window_keys (got {tuple(t.shape)})"
                )
        if self.sink_keys.shape[2] != self.sink_values.shape[2]:
            raise ValueError("sink_keys and sink_values must hold the same number of tokens")
        if self.window_keys.shape[2] != self.window_values.shape[2]:
            raise ValueError("window_keys and window_values must hold the same number of tokens")
        if (self.key_blocks is None) != (self.value_blocks is None):
            raise ValueError("key_blocks and value_blocks must both be given or both be None")
        if self.key_blocks is not None:
            for name, blocks, axis in (
                ("key_blocks", self.key_blocks, 3),
                ("value_blocks", self.value_blocks, 4),
            ):
                if not isinstance(blocks, QuantizedTensor):
                    raise TypeError(
                        f"{name} must be a kvlib.quant.tensor.QuantizedTensor (got {type(blocks).__name__})"
                    )
                if len(blocks.shape) != 5 or (
                    blocks.shape[1],
                    blocks.shape[2],
                    blocks.shape[4],
                ) != (b, h, d):
                    raise ValueError(
                        f"{name} must have shape (n, batch={b}, kv_heads={h}, R, head_dim={d}) "
                        f"(got {tuple(blocks.shape)})"
                    )
                if blocks.axis != axis or blocks.symmetric or blocks.packed.dim() != 4:
                    raise ValueError(
                        f"{name} must be asymmetric, quantized over axis {axis}, with codes laid "
                        f"out in rows (n, batch, kv_heads, bytes) (QuantizedTensor.with_rows(3))"
                    )
            if self.value_blocks.shape[:4] != self.key_blocks.shape[:4]:
                raise ValueError(
                    f"key_blocks and value_blocks must have the same shape "
                    f"(got {tuple(self.key_blocks.shape)} and {tuple(self.value_blocks.shape)})"
                )
        if self.rotation is not None and tuple(self.rotation.shape) != (d, d):
            raise ValueError(
                f"rotation must be ({d}, {d}) for head_dim {d} (got {tuple(self.rotation.shape)})"
            )

    # -- sizes
    @property
    def batch_size(self) -> int:
        return self.window_keys.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.window_keys.shape[1]

    @property
    def head_dim(self) -> int:
        return self.window_keys.shape[3]

    @property
    def num_quantized(self) -> int:
        """Tokens in the quantized blocks, ``n * R``."""
        if self.key_blocks is None:
            return 0
        return self.key_blocks.shape[0] * self.key_blocks.shape[3]

    @property
    def num_tokens(self) -> int:
        """All tokens attended to, ``T = s + n * R + w``."""
        return self.sink_keys.shape[2] + self.num_quantized + self.window_keys.shape[2]

    # -- reference read
    def dequantize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(batch, kv_heads, T, head_dim)`` in ``dtype``, blocks dequantized
        and rotated back (exactly what the cache's torch path attends to)."""
        parts_k = [self.sink_keys.to(dtype)]
        parts_v = [self.sink_values.to(dtype)]
        if self.key_blocks is not None:
            n, b, h, r, d = self.key_blocks.shape
            kb = self.key_blocks.dequantize(dtype)  # (n, b, h, R, d), block-major
            if self.rotation is not None:
                kb = unrotate(kb, self.rotation)
            vb = self.value_blocks.dequantize(dtype)
            parts_k.append(kb.permute(1, 2, 0, 3, 4).reshape(b, h, n * r, d))
            parts_v.append(vb.permute(1, 2, 0, 3, 4).reshape(b, h, n * r, d))
        parts_k.append(self.window_keys.to(dtype))
        parts_v.append(self.window_values.to(dtype))
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)


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


def _triton_decode(
    query: torch.Tensor,
    kv: PackedKV,
    scale: float,
    mask: torch.Tensor | None,
    num_splits: int | None,
    block_tokens: int,
) -> torch.Tensor:
    k = _kernels()
    dev = query.device
    if dev.type == "cpu" and not (k.INTERPRET and k.LIBRARY_INTERPRETED):
        raise ValueError(
            "the Triton kernel runs on CPU tensors only in the interpreter: set "
            "TRITON_INTERPRET=1 before triton is first imported (before torch.compile or "
            "transformers import it), or use backend='torch'"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"the Triton kernel runs on cuda (or cpu, interpreted), not {dev.type}")
    b, hq, _, d = query.shape
    h = kv.kv_heads
    gqa = hq // h
    # dot products in the query's 16-bit dtype (the reference dequantizes into it too),
    # float32 (IEEE) for a float32/float64 query; accumulation is float32 either way
    compute = query.dtype if query.dtype in (torch.float16, torch.bfloat16) else torch.float32
    if k.INTERPRET and compute == torch.bfloat16:  # the interpreter's bfloat16 dot is wrong
        compute = torch.float32
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
    if mask is not None:
        mq = mask[:, s_tok : s_tok + nq].to(torch.int8).contiguous()
        mf = torch.cat([mask[:, :s_tok], mask[:, s_tok + nq :]], dim=1).to(torch.int8).contiguous()
    else:
        mq = mf = torch.empty(1, dtype=torch.int8, device=dev)
    if nq:
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
            GQA=gqa,
            BLOCK_G=block_g,
            D=d,
            BLOCK_D=block_d,
            BLOCK_N=block_tokens,
            R=r,
            KG=kb.group_size,
            VG=vb.group_size,
            KBITS=kb.bits,
            VBITS=vb.bits,
            HAS_MASK=mask is not None,
            F32_DOT=f32_dot,
        )
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
        GQA=gqa,
        BLOCK_G=block_g,
        D=d,
        BLOCK_D=block_d,
        BLOCK_N=min(block_tokens, _pow2(m_tok)),
        HAS_MASK=mask is not None,
        F32_DOT=f32_dot,
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
