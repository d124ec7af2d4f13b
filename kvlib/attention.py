"""Dense reference attention: the one ``softmax(q kᵀ / √d) v`` that kvlib checks itself against.

Introduced in notebook 02, where the error of a quantized cache is measured on what attention
computes from it (:func:`kvlib.eval.capture.attention_output_error`), and used again in notebook 07,
where paged attention (:func:`kvlib.caches.paged.paged_attention`) must equal it.

Shapes follow transformers: queries ``(batch, heads, q_len, head_dim)``, keys and values
``(batch, kv_heads, kv_len, head_dim)``. With grouped-query attention each KV head serves
``heads // kv_heads`` consecutive query heads. Queries are the *last* ``q_len`` positions of
their row's keys (``q_len == kv_len`` for a prefill, ``q_len == 1`` for one decode step), and
rows of different lengths are padded on the right, their lengths given by ``lengths``
(:func:`pad_sequences` builds both from per-sequence tensors).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["dense_attention", "pad_sequences"]


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Validate the shapes; return the GQA group (query heads per KV head)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4-d tensor (batch, heads, seq_len, head_dim)")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor (got {t.dtype})")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape (got {tuple(k.shape)} and {tuple(v.shape)})"
        )
    b, h, _, d = q.shape
    if (k.shape[0], k.shape[3]) != (b, d) or h % k.shape[1]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match: batch and head_dim must agree "
            "and query heads must be a multiple of kv heads"
        )
    return h // k.shape[1]


def _length_mask(
    lengths: torch.Tensor | Sequence[int],
    batch: int,
    q_len: int,
    kv_len: int,
    causal: bool,
    device: torch.device,
) -> torch.Tensor:
    """Boolean ``(batch, 1, q_len, kv_len)`` mask: row ``b`` sees its first ``lengths[b]`` keys
    (and, when ``causal``, only keys up to each query's own position)."""
    n = torch.as_tensor(lengths, device=device)
    if n.dtype.is_floating_point or n.dtype == torch.bool or n.shape != (batch,):
        raise ValueError(f"lengths must be {batch} integers, one per row (got {n.tolist()})")
    n = n.long()
    low = q_len if causal else 1
    if bool(((n < low) | (n > kv_len)).any()):
        why = f"q_len = {q_len} when causal" if causal else "1"
        raise ValueError(
            f"lengths must be in [{low}, kv_len = {kv_len}] (at least {why}; got {n.tolist()})"
        )
    key_pos = torch.arange(kv_len, device=device)
    mask = key_pos[None, None, :] < n[:, None, None]  # (b, 1, kv_len)
    if causal:
        q_pos = n[:, None] - q_len + torch.arange(q_len, device=device)[None, :]  # (b, q_len)
        mask = mask & (key_pos[None, None, :] <= q_pos[:, :, None])
    else:
        mask = mask.expand(batch, q_len, kv_len)
    return mask[:, None]


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    lengths: torch.Tensor | Sequence[int] | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``softmax(q kᵀ · scale) v`` with grouped-query head repetition, the dense reference.

    Args:
        q: ``(batch, heads, q_len, head_dim)``; the queries of the last ``q_len`` positions.
        k, v: ``(batch, kv_heads, kv_len, head_dim)``; ``heads`` a multiple of ``kv_heads``
            (query head ``h`` reads KV head ``h // (heads // kv_heads)``).
        causal: each query sees the keys up to its own position (query ``i`` of a row of ``n``
            keys sits at position ``n - q_len + i``); ``False``: every key of its row.
        lengths: ``(batch,)`` keys each row really holds (the rest is right padding, ignored);
            ``None``: all ``kv_len``. Must be ``>= q_len`` when ``causal``.
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``(batch, heads, q_len, head_dim)`` in float32 (float64 if an input is float64),
        whatever the input dtype, so that it can serve as a reference.
    """
    rep = _check_qkv(q, k, v)
    b, _, sq, _ = q.shape
    sk = k.shape[2]
    if lengths is None and sq > sk:
        raise ValueError(f"more queries ({sq}) than keys ({sk})")
    work = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    work = torch.promote_types(work, torch.float32)
    k = k.to(work).repeat_interleave(rep, dim=1)
    v = v.to(work).repeat_interleave(rep, dim=1)
    if lengths is not None:
        mask = _length_mask(lengths, b, sq, sk, causal, q.device)
    elif causal:
        mask = (
            torch.arange(sk, device=q.device)[None, :]
            <= torch.arange(sk - sq, sk, device=q.device)[:, None]
        )
    else:
        mask = None
    return torch.nn.functional.scaled_dot_product_attention(
        q.to(work), k, v, attn_mask=mask, scale=scale
    )


def pad_sequences(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack per-sequence ``(kv_heads, seq_len_i, head_dim)`` tensors into one right-padded
    ``(num_seqs, kv_heads, max_len, head_dim)`` batch (zeros) and its ``lengths`` ``(num_seqs,)``
    int64, the form :func:`dense_attention` takes for rows of different lengths."""
    seqs = list(seqs)
    if not seqs:
        raise ValueError("seqs must hold at least one tensor")
    first = seqs[0]
    for i, t in enumerate(seqs):
        if (
            not isinstance(t, torch.Tensor)
            or t.ndim != 3
            or (t.shape[0], t.shape[2]) != (first.shape[0], first.shape[2])
        ):
            raise ValueError(
                f"seqs must be (kv_heads, seq_len, head_dim) tensors with one kv_heads and "
                f"head_dim (got {tuple(getattr(t, 'shape', ()))} at {i}, "
                f"{tuple(first.shape)} at 0)"
            )
    lengths = [t.shape[1] for t in seqs]
    out = first.new_zeros((len(seqs), first.shape[0], max(lengths), first.shape[2]))
    for i, t in enumerate(seqs):
        out[i, :, : t.shape[1]] = t
    return out, torch.tensor(lengths, dtype=torch.long, device=first.device)
