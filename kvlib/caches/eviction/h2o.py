"""H2O (Zhang et al., 2023, arXiv 2306.14048): heavy hitters plus recent tokens.

A token's score is the attention it has received from every query so far, accumulated over the
steps; half the budget goes to the recent tokens, the rest to the heaviest hitters.
"""

from __future__ import annotations

import torch

from kvlib.caches.eviction.policy import Observation, Policy
from kvlib.caches.eviction.scores import attention_weights
from kvlib.caches.eviction_settings import POLICY_LINES

__all__ = ["H2O", "h2o_scores"]

#: Queries scored at once: the weights of a long prefill are computed in slices of this many.
QUERY_SLICE = 256


def h2o_scores(weights: torch.Tensor) -> torch.Tensor:
    """H2O: attention each token received from these queries, summed over queries and over
    the group's query heads, ``(batch, kv_heads, n)``; the cache accumulates it over steps."""
    return weights.sum(dim=(2, 3))


class H2O(Policy):
    """Accumulated attention per KV head, with half the budget kept for recent tokens."""

    name = "h2o"
    description = POLICY_LINES[name]
    needs_queries = True
    keeps_scores = True

    def default_window(self, budget: int) -> int:
        """Half the budget: H2O's split between heavy hitters and recent tokens."""
        return budget // 2

    def score(self, seen: Observation) -> torch.Tensor:
        pos, qpos = seen.positions, seen.query_positions()
        total = torch.zeros(pos.shape, dtype=torch.float32, device=seen.keys.device)
        for s in range(0, seen.q_len, QUERY_SLICE):  # slices of queries bound the memory
            weights = attention_weights(
                seen.queries[:, :, s : s + QUERY_SLICE],
                seen.keys,
                pos,
                qpos[s : s + QUERY_SLICE],
                seen.scaling,
            )
            total += h2o_scores(weights)
        old = seen.previous.shape[2] if seen.previous is not None else 0
        if old:
            total[:, :, :old] += seen.previous
        return total
