"""SnapKV (Li et al., 2024, arXiv 2404.14469): the prompt's last queries pick what to keep.

At the end of a prefill, the last ``window`` queries (the observation window: in a chat, the
question) say which earlier tokens matter: their attention, averaged over them, smoothed along
the tokens and over the query heads of a group, scores each token once. While decoding the
scores stay, and each new token joins the protected window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlib.caches.eviction.policy import Observation, Policy
from kvlib.caches.eviction.scores import attention_weights
from kvlib.caches.eviction_settings import POLICY_LINES

__all__ = ["SNAPKV_KERNEL", "SNAPKV_WINDOW", "SnapKV", "snapkv_scores"]

#: SnapKV's observation window and pooling kernel (kvpress uses 64 and 5; the paper 32).
SNAPKV_WINDOW = 32
SNAPKV_KERNEL = 5


def snapkv_scores(weights: torch.Tensor, window: int, kernel_size: int = 5) -> torch.Tensor:
    """SnapKV: how much the last ``window`` queries attend to each token before the window.

    Args:
        weights: ``(batch, kv_heads, group, q_len, n)`` from
            :func:`kvlib.caches.eviction.scores.attention_weights`, the last ``q_len`` keys
            being the queries' own tokens.
        window: observation window (the last ``window`` queries; <= q_len, < n).
        kernel_size: average pooling along the tokens (odd), as kvpress's ``SnapKVPress``.

    Returns:
        ``(batch, kv_heads, n)``: the weights of the window's queries, averaged over them,
        pooled over ``kernel_size`` neighbouring tokens (zero-padded, counted in the mean),
        averaged over the group's query heads; the window's own ``window`` tokens get the
        maximum score (they are kept).
    """
    b, h, g, q_len, n = weights.shape
    if not 1 <= window <= q_len or window >= n:
        raise ValueError(f"window must be in 1..min(q_len={q_len}, n - 1={n - 1}) (got {window})")
    w = weights[..., -window:, : n - window].mean(dim=-2)  # (b, h, g, n - window)
    pooled = F.avg_pool1d(
        w.reshape(-1, 1, n - window), kernel_size, stride=1, padding=kernel_size // 2
    ).view(b, h, g, n - window)
    scores = pooled.mean(dim=2)
    top = scores.amax(dim=-1, keepdim=True).expand(b, h, window)
    return torch.cat([scores, top], dim=-1)


class SnapKV(Policy):
    """Scored once per prefill by its last queries; decoding adds to the protected window."""

    name = "snapkv"
    description = POLICY_LINES[name]
    needs_queries = True
    keeps_scores = True

    def default_window(self, budget: int) -> int:
        """The observation window, :data:`SNAPKV_WINDOW`, at most half the budget."""
        return max(1, min(SNAPKV_WINDOW, budget // 2))

    def score(self, seen: Observation) -> torch.Tensor | None:
        if seen.q_len == 1:
            return None  # decoding: the new token joins the protected window
        n = seen.keys.shape[2]
        w = min(seen.window, seen.q_len, n - 1)  # only the observation window's queries
        qpos = seen.query_positions()
        weights = attention_weights(
            seen.queries[:, :, -w:], seen.keys, seen.positions, qpos[-w:], seen.scaling
        )
        return snapkv_scores(weights, w, SNAPKV_KERNEL)
