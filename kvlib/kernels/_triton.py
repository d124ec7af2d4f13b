"""The Triton source of :mod:`kvlib.kernels.decode` (imported lazily: kvlib runs without triton).

Three kernels compute one decode step's attention (query length 1) over kvlib's packed cache:

* :func:`quant_split_kernel` — one program per (batch row, KV head, split of the quantized
  tokens): it loads the packed codes of a tile of tokens, unpacks them in registers (any of 8,
  4, 3, 2 bits), applies the group's scale and zero point, and runs an online softmax for all
  the query heads that share the KV head (GQA). It writes the split's unnormalised output and
  its running max and sum;
* :func:`full_split_kernel` — the same over the full-precision tokens (sinks, residual window,
  the new token), into the last split slot;
* :func:`merge_kernel` — combines the splits (split-K / flash-decoding merge) into the output.

Whether the kernels run compiled (CUDA) or in Triton's interpreter (CPU tensors) is decided when
this module is imported: ``TRITON_INTERPRET=1`` must be set before (see
:func:`kvlib.kernels.decode.interpreter_mode`). Scores are kept in log2 units (``exp2``), the scale
``1/sqrt(head_dim) * log2(e)`` folded into the query side.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: True when this module's kernels run in Triton's interpreter (on CPU tensors).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: Whether triton's own library (``tl.max``, ``tl.sum``, ...) is interpreted too: only when
#: ``TRITON_INTERPRET=1`` was set before triton was *first* imported (which torch.compile, and
#: so transformers with hqq installed, may do early).
LIBRARY_INTERPRETED = type(tl.max).__name__ == "InterpretedFunction"


@triton.jit
def _codes(row_ptr, idx, mask, BITS: tl.constexpr):
    """Codes number ``idx`` of a packed row starting at ``row_ptr`` (kvlib.quant.packing's layout:
    code ``i`` in bits ``i*BITS .. i*BITS+BITS-1``, little-endian; 3-bit codes may straddle
    two bytes)."""
    if BITS == 8:
        code = tl.load(row_ptr + idx, mask=mask, other=0).to(tl.int32)
    else:
        bit = idx * BITS
        byte = bit >> 3
        shift = bit & 7
        word = tl.load(row_ptr + byte, mask=mask, other=0).to(tl.int32)
        if BITS == 3:  # a code may straddle two bytes: read the next one where it does
            hi = tl.load(row_ptr + byte + 1, mask=mask & (shift > 5), other=0).to(tl.int32)
            word = word | (hi << 8)
        code = (word >> shift) & ((1 << BITS) - 1)
    return code


@triton.jit
def _online_step(q, k, v, valid, m_i, l_i, acc, qk_scale, F32_DOT: tl.constexpr):
    """One tile of an online softmax: ``q`` (G, D), ``k``/``v`` (N, D) float32, ``valid`` (N,);
    returns the updated running max ``m_i`` (G,), sum ``l_i`` (G,) and output ``acc`` (G, D)."""
    if F32_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if F32_DOT:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def quant_split_kernel(
    Q,  # (batch, q_heads, D) query, rotated when the keys are
    KC,  # (n, batch, kv_heads, R * D * KBITS // 8) uint8 key codes
    KS,  # (n, batch, kv_heads, R // KG, 1, D) key scales
    KO,  # key zero points, same shape
    VC,  # (n, batch, kv_heads, R * D * VBITS // 8) uint8 value codes
    VS,  # (n, batch, kv_heads, R, D // VG, 1) value scales
    VO,  # value zero points, same shape
    MASK,  # (batch, n * R) int8, 1 = attend (read only when HAS_MASK)
    ACC,  # (batch, q_heads, SPLITS, D) float32 out: unnormalised outputs
    M,  # (batch, q_heads, SPLITS) float32 out: running max (log2 units)
    L,  # (batch, q_heads, SPLITS) float32 out: running sum
    qk_scale,
    n_tok,
    tok_per_split,
    B,
    H,
    SPLITS,
    GQA: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    R: tl.constexpr,
    KG: tl.constexpr,
    VG: tl.constexpr,
    KBITS: tl.constexpr,
    VBITS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // H
    h = pid % H
    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_D)
    nn = tl.arange(0, BLOCK_N)
    g_ok = g < GQA
    c_ok = c < D
    head = (b * H + h) * GQA + g  # query heads h*GQA .. h*GQA+GQA-1 of batch row b
    q = tl.load(Q + head[:, None] * D + c[None, :], mask=g_ok[:, None] & c_ok[None, :], other=0.0)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    start = split * tok_per_split
    end = tl.minimum(start + tok_per_split, n_tok)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + nn
        ok = j < end
        t = j % R  # token inside its block
        row = ((j // R).to(tl.int64) * B + b) * H + h  # (block, batch, head) row
        tile_ok = ok[:, None] & c_ok[None, :]
        code = t[:, None] * D + c[None, :]  # code index inside the row (token-major)
        # keys: per channel, one scale per KG tokens
        kc = _codes(KC + row[:, None] * (R * D * KBITS // 8), code, tile_ok, KBITS)
        ks_at = (row[:, None] * (R // KG) + t[:, None] // KG) * D + c[None, :]
        ks = tl.load(KS + ks_at, mask=tile_ok, other=0.0).to(tl.float32)
        ko = tl.load(KO + ks_at, mask=tile_ok, other=0.0).to(tl.float32)
        k = kc.to(tl.float32) * ks + ko
        # values: per token, one scale per VG channels
        vc = _codes(VC + row[:, None] * (R * D * VBITS // 8), code, tile_ok, VBITS)
        vs_at = (row[:, None] * R + t[:, None]) * (D // VG) + c[None, :] // VG
        vs = tl.load(VS + vs_at, mask=tile_ok, other=0.0).to(tl.float32)
        vo = tl.load(VO + vs_at, mask=tile_ok, other=0.0).to(tl.float32)
        v = vc.to(tl.float32) * vs + vo
        valid = ok
        if HAS_MASK:
            valid = valid & (tl.load(MASK + b * n_tok + j, mask=ok, other=0) != 0)
        m_i, l_i, acc = _online_step(q, k, v, valid, m_i, l_i, acc, qk_scale, F32_DOT)
    slot = head * SPLITS + split
    tl.store(ACC + slot[:, None] * D + c[None, :], acc, mask=g_ok[:, None] & c_ok[None, :])
    tl.store(M + slot, m_i, mask=g_ok)
    tl.store(L + slot, l_i, mask=g_ok)


@triton.jit
def full_split_kernel(
    Q,  # (batch, q_heads, D) query (not rotated)
    FK,  # (batch, kv_heads, m, D) full-precision keys: sinks, window, new token
    FV,  # (batch, kv_heads, m, D) full-precision values
    MASK,  # (batch, m) int8, 1 = attend (read only when HAS_MASK)
    ACC,
    M,
    L,
    qk_scale,
    m_tok,
    H,
    SPLITS,
    GQA: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_D)
    nn = tl.arange(0, BLOCK_N)
    g_ok = g < GQA
    c_ok = c < D
    head = (b * H + h) * GQA + g
    q = tl.load(Q + head[:, None] * D + c[None, :], mask=g_ok[:, None] & c_ok[None, :], other=0.0)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    base = pid.to(tl.int64) * m_tok * D
    for j0 in range(0, m_tok, BLOCK_N):
        j = j0 + nn
        ok = j < m_tok
        tile_ok = ok[:, None] & c_ok[None, :]
        at = base + j[:, None] * D + c[None, :]
        k = tl.load(FK + at, mask=tile_ok, other=0.0).to(tl.float32)
        v = tl.load(FV + at, mask=tile_ok, other=0.0).to(tl.float32)
        valid = ok
        if HAS_MASK:
            valid = valid & (tl.load(MASK + b * m_tok + j, mask=ok, other=0) != 0)
        m_i, l_i, acc = _online_step(q, k, v, valid, m_i, l_i, acc, qk_scale, F32_DOT)
    slot = head * SPLITS + (SPLITS - 1)
    tl.store(ACC + slot[:, None] * D + c[None, :], acc, mask=g_ok[:, None] & c_ok[None, :])
    tl.store(M + slot, m_i, mask=g_ok)
    tl.store(L + slot, l_i, mask=g_ok)


@triton.jit
def merge_kernel(
    ACC,  # (batch * q_heads, SPLITS, D) float32
    M,  # (batch * q_heads, SPLITS) float32
    L,  # (batch * q_heads, SPLITS) float32
    OUT,  # (batch * q_heads, D) in the query's dtype
    SPLITS,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_D)
    s_ok = s < SPLITS
    c_ok = c < D
    m = tl.load(M + pid * SPLITS + s, mask=s_ok, other=float("-inf"))
    l_s = tl.load(L + pid * SPLITS + s, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # 0 for empty splits (m = -inf)
    denom = tl.sum(l_s * w, 0)
    acc = tl.load(
        ACC + (pid * SPLITS + s[:, None]) * D + c[None, :],
        mask=s_ok[:, None] & c_ok[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], 0)
    out = tl.where(denom > 0, out / denom, 0.0)  # a row that sees no token: 0
    tl.store(OUT + pid * D + c, out.to(OUT.dtype.element_ty), mask=c_ok)
