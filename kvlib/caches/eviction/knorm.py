"""KNorm (Devoto et al., 2024, arXiv 2406.11430): keep the keys of lowest L2 norm.

Keys with a low norm tend to draw high attention, so a key's norm scores its token without the
queries: the cheapest policy, and the one kvpress calls ``KnormPress``.
"""

from __future__ import annotations

import torch

from kvlib.caches.eviction.policy import Observation, Policy
from kvlib.caches.eviction_settings import POLICY_LINES

__all__ = ["KNorm", "knorm_scores"]


def knorm_scores(keys: torch.Tensor) -> torch.Tensor:
    """KNorm: ``-||key||_2`` over head_dim, ``(batch, kv_heads, n)``; low-norm keys are kept."""
    return -keys.float().norm(dim=-1)


class KNorm(Policy):
    """Keep the lowest-norm keys, per KV head; no queries needed."""

    name = "knorm"
    description = POLICY_LINES[name]

    def score(self, seen: Observation) -> torch.Tensor:
        return knorm_scores(seen.keys)
