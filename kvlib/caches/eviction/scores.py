"""What every token-eviction policy shares: attention weights, and which tokens to keep (notebook 11).

Pure tensor functions, no cache and no model: the policies (one module each, a
:class:`~kvlib.caches.eviction.policy.Policy` apiece) score tokens with :func:`attention_weights`,
and :mod:`kvlib.caches.eviction.cache` turns any policy's scores into the kept set with
:func:`keep_indices`; notebook 11 checks its from-scratch versions against them.

Shapes follow transformers: queries ``(batch, heads, q_len, head_dim)``, keys
``(batch, kv_heads, n, head_dim)`` (after RoPE, as cached), attention weights
``(batch, kv_heads, group, q_len, n)`` with ``group = heads // kv_heads`` query heads sharing
each KV head, scores ``(batch, kv_heads, n)``: one per cached token and KV head, higher = keep.

=============  ==================================================================  ===========
policy         score of a cached token (its module)                                kept set
=============  ==================================================================  ===========
``streaming``  its position (StreamingLLM: the first ``sinks`` tokens plus the     per layer
               most recent ones)
``snapkv``     attention from the last ``window`` queries of a prefill, averaged   per KV head
               over them, smoothed along the tokens (average pooling, kernel 5)
               and over the query heads of a group (SnapKV, as kvpress does)
``h2o``        attention received, accumulated over every query so far            per KV head
               (H2O's heavy hitters), plus a window of recent tokens
``tova``       attention from the last query, averaged over all query heads        per layer
               (TOVA)
``knorm``      minus the L2 norm of its key (low-norm keys draw attention)         per KV head
=============  ==================================================================  ===========

:func:`keep_indices` turns scores into the kept set: the first ``sinks`` positions and the most
recent ``window`` positions are always kept, the rest by score, ties going to the more recent
token; the result is sorted by position.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention_weights", "keep_indices"]


def attention_weights(
    queries: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float | None = None,
) -> torch.Tensor:
    """Causal softmax attention weights, float32, grouped by KV head.

    Args:
        queries: ``(batch, heads, q_len, head_dim)``, after RoPE.
        keys: ``(batch, kv_heads, n, head_dim)``, after RoPE; ``heads`` must be a multiple of
            ``kv_heads`` (grouped-query attention).
        key_positions: ``(batch, kv_heads, n)`` absolute position of every key.
        query_positions: ``(q_len,)`` absolute position of every query.
        scaling: the softmax scale (default ``head_dim ** -0.5``).

    Returns:
        ``(batch, kv_heads, group, q_len, n)``: query ``i`` attends to key ``j`` only when
        ``key_positions[j] <= query_positions[i]``; each row sums to 1 over ``n``.
    """
    b, heads, q_len, d = queries.shape
    kv_heads = keys.shape[1]
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    scale = d**-0.5 if scaling is None else scaling
    q = queries.float().view(b, kv_heads, heads // kv_heads, q_len, d)
    logits = torch.matmul(q, keys.float().unsqueeze(2).transpose(-1, -2)) * scale
    visible = key_positions[:, :, None, None, :] <= query_positions.view(1, 1, 1, q_len, 1)
    logits = logits.masked_fill(~visible, -math.inf)
    return torch.softmax(logits, dim=-1)


def keep_indices(
    scores: torch.Tensor,
    positions: torch.Tensor,
    budget: int,
    sinks: int = 0,
    window: int = 0,
) -> torch.Tensor:
    """Indices of the ``budget`` tokens to keep, per batch row and KV head, sorted by position.

    Args:
        scores: ``(batch, kv_heads, n)``, higher = keep (NaN is treated as the lowest).
        positions: ``(batch, kv_heads, n)`` absolute positions, increasing along ``n``.
        budget: tokens to keep (``>= 1``); every token is kept when ``n <= budget``.
        sinks: tokens at positions ``< sinks`` are always kept (attention sinks).
        window: the ``window`` most recent tokens are always kept.

    Returns:
        ``(batch, kv_heads, min(n, budget))`` long indices into ``n``, increasing. Protected
        tokens (sinks, then the window) come first; the rest go by score, ties to the more
        recent token. ``sinks + window`` must not exceed ``budget``.
    """
    n = scores.shape[-1]
    if sinks + window > budget:
        raise ValueError(f"sinks + window ({sinks} + {window}) must not exceed budget ({budget})")
    if n <= budget:
        return torch.arange(n, device=scores.device).expand(scores.shape).clone()
    key = torch.nan_to_num(scores.float(), nan=-math.inf).clamp(min=-3e38, max=3e38)
    recent = torch.zeros_like(key, dtype=torch.bool)
    if window:
        recent[..., n - window :] = True
    key = torch.where((positions < sinks) | recent, torch.full_like(key, math.inf), key)
    # newest first, then a stable sort by score: equal scores keep the newer token
    flipped = key.flip(-1)
    order = torch.sort(flipped, dim=-1, descending=True, stable=True).indices[..., :budget]
    return torch.sort(n - 1 - order, dim=-1).values
