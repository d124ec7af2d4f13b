"""What an eviction policy is: a class that scores the cached tokens (notebook 11).

Each policy lives in its own module (:mod:`~kvlib.caches.eviction.streaming`,
:mod:`~kvlib.caches.eviction.snapkv`, :mod:`~kvlib.caches.eviction.h2o`,
:mod:`~kvlib.caches.eviction.tova`, :mod:`~kvlib.caches.eviction.knorm`) as a subclass of
:class:`Policy`, as kvpress's scorer presses are: it says whether it needs the attention
queries, whether its scores accumulate across steps, its attention sinks and recent window, and
how it scores the tokens a layer holds (:meth:`Policy.score`). What to do with the scores (keep
the sinks and the window, then the best, and gather them) is written once, in
:func:`kvlib.caches.eviction.scores.keep_indices` and the cache layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = ["Observation", "Policy"]


@dataclass(frozen=True)
class Observation:
    """What a policy sees when a forward pass updates one cache layer.

    Attributes:
        keys: ``(batch, kv_heads, n, head_dim)``, every token held after this pass (the kept
            ones, then the pass's own), after RoPE.
        positions: ``(batch, kv_heads, n)`` their absolute positions.
        q_len: tokens this pass added (the last ``q_len`` of ``n``).
        seen: tokens seen so far, this pass's included.
        window: the layer's protected recent tokens.
        previous: ``(batch, kv_heads, n - q_len)`` the running scores of the kept tokens, for a
            policy that keeps them (:attr:`Policy.keeps_scores`), else ``None``.
        queries: ``(batch, heads, q_len, head_dim)``, this pass's queries after RoPE, for a
            policy that needs them (:attr:`Policy.needs_queries`), else ``None``.
        scaling: the model's softmax scale (with ``queries``).
    """

    keys: torch.Tensor
    positions: torch.Tensor
    q_len: int
    seen: int
    window: int
    previous: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    scaling: float | None = None

    def query_positions(self) -> torch.Tensor:
        """``(q_len,)`` the absolute positions of this pass's queries."""
        return torch.arange(self.seen - self.q_len, self.seen, device=self.keys.device)


class Policy:
    """A token-eviction policy: how to score the tokens a layer holds (higher = keep).

    Subclasses set :attr:`name`, :attr:`description` and the flags, and implement
    :meth:`score`; they hold no state (the layer keeps the running scores).
    """

    #: The policy's name in :data:`kvlib.caches.eviction.cache.POLICIES` and the registry.
    name: ClassVar[str]
    #: One line for tables: the method and what it keeps (each policy's line is
    #: ``kvlib.caches.eviction_settings.POLICY_LINES[name]``, where the registry reads it too).
    description: ClassVar[str]
    #: Whether :meth:`score` reads the attention queries (run the model inside
    #: :func:`kvlib.caches.eviction.queries.capture_queries`).
    needs_queries: ClassVar[bool] = False
    #: Whether the layer keeps the scores between steps (:attr:`Observation.previous`).
    keeps_scores: ClassVar[bool] = False
    #: First tokens always kept (attention sinks) unless the cache is given ``sinks``.
    default_sinks: ClassVar[int] = 0

    def default_window(self, budget: int) -> int:
        """Recent tokens always kept at ``budget`` tokens, unless the cache is given
        ``window`` (default: none)."""
        return 0

    def window(self, budget: int, sinks: int, requested: int | None) -> int:
        """The layer's protected recent window: ``requested``, else :meth:`default_window`,
        at most ``budget - sinks``.

        Raises:
            ValueError: a requested window larger than ``budget - sinks``.
        """
        room = budget - sinks
        if requested is None:
            return min(self.default_window(budget), room)
        if requested > room:
            raise ValueError(f"window must be <= budget - sinks = {room} (got {requested})")
        return requested

    def score(self, seen: Observation) -> torch.Tensor | None:
        """Scores ``(batch, kv_heads, n)`` of every token in ``seen.keys``, higher = keep; or
        ``None`` to keep the previous scores and protect the new tokens (SnapKV decoding)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
