"""TOVA (Oren et al., 2024, arXiv 2401.06104): the last query's attention, at every step.

Transformers as multi-state RNNs: at each step the token the newest query attends to least goes,
one set for the whole layer (the attention averaged over every query head).
"""

from __future__ import annotations

import torch

from kvlib.caches.eviction.policy import Observation, Policy
from kvlib.caches.eviction.scores import attention_weights
from kvlib.caches.eviction_settings import POLICY_LINES

__all__ = ["TOVA", "tova_scores"]


def tova_scores(weights: torch.Tensor) -> torch.Tensor:
    """TOVA: the last query's attention averaged over ALL query heads, the same for every KV
    head (so the whole layer keeps one set), ``(batch, kv_heads, n)``."""
    last = weights[..., -1, :].mean(dim=(1, 2), keepdim=True)  # (b, 1, 1, n)
    return last[:, :, 0].expand(-1, weights.shape[1], -1)


class TOVA(Policy):
    """The last query's attention, every step; the last token is always kept."""

    name = "tova"
    description = POLICY_LINES[name]
    needs_queries = True

    def default_window(self, budget: int) -> int:
        """The last token."""
        return 1

    def score(self, seen: Observation) -> torch.Tensor:
        qpos = seen.query_positions()
        weights = attention_weights(
            seen.queries[:, :, -1:], seen.keys, seen.positions, qpos[-1:], seen.scaling
        )
        return tova_scores(weights)
