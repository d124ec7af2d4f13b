"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): attention sinks plus the most recent tokens.

The first few tokens draw attention whatever they say (the "attention sinks"); keeping them and
a window of recent tokens keeps a model fluent past its cache budget. A token's score is its
position, so the newest win; the window is everything the sinks leave.
"""

from __future__ import annotations

import torch

from kvlib.caches.eviction.policy import Observation, Policy
from kvlib.caches.eviction_settings import POLICY_LINES

__all__ = ["StreamingLLM", "streaming_scores"]


def streaming_scores(positions: torch.Tensor) -> torch.Tensor:
    """StreamingLLM: a token's score is its position, so the most recent tokens win."""
    return positions.float()


class StreamingLLM(Policy):
    """Keep ``sinks`` first tokens (default 4) and the most recent ones; no queries needed."""

    name = "streaming"
    description = POLICY_LINES[name]
    default_sinks = 4

    def window(self, budget: int, sinks: int, requested: int | None) -> int:
        """Everything the sinks leave: ``budget - sinks`` (a requested window is ignored)."""
        return budget - sinks

    def score(self, seen: Observation) -> torch.Tensor:
        return streaming_scores(seen.positions)
