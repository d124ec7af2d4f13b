"""What every kvlib cache layer shares: the check of the states it is given, and batch operations.

kvlib's three cache layers (:class:`kvlib.caches.quantized.QuantizedKVLayer`,
:class:`kvlib.caches.eviction.cache.EvictionLayer`, :class:`kvlib.caches.sliding.SlidingWindowLayer`) store their
tokens differently, but take the same ``(batch, kv_heads, seq_len, head_dim)`` states from the
model and serve the same batch operations of transformers' ``CacheLayerMixin`` (beam search's
reorder, contrastive search's repeat, batch selection). Each layer writes only how it keeps
some batch rows (``_select_rows``); :class:`BatchRows` derives the three operations from it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BatchRows", "check_states", "row_indices"]


def check_states(key_states: Any, value_states: Any) -> None:
    """Refuse states a cache layer cannot store.

    Raises:
        ValueError: either is not a 4-d floating tensor ``(batch, kv_heads, seq_len,
            head_dim)``, or their shapes differ.
    """
    for name, t in (("key_states", key_states), ("value_states", value_states)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-d floating tensor (batch, kv_heads, seq_len, head_dim) "
                f"(got {getattr(t, 'shape', type(t).__name__)})"
            )
    if key_states.shape != value_states.shape:
        raise ValueError(
            f"key_states and value_states must have the same shape "
            f"(got {tuple(key_states.shape)} and {tuple(value_states.shape)})"
        )


def row_indices(rows: Any, device: torch.device) -> torch.Tensor:
    """Batch rows as a ``(n,)`` int64 tensor on ``device``: indices (repeats allowed) as given,
    a boolean mask as the indices of its true entries."""
    rows = torch.as_tensor(rows, device=device)
    if rows.dtype == torch.bool:
        rows = rows.nonzero().flatten()
    return rows.long()


class BatchRows:
    """Batch operations of a cache layer, from its ``_select_rows(rows)`` (keep batch rows
    ``rows``: indices, repeats allowed, or a boolean mask; a no-op before the first update).
    The layer keeps ``is_initialized`` and ``batch_size``."""

    is_initialized: bool
    batch_size: int

    def _select_rows(self, rows: Any) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search): stored codes and metadata move, nothing is
        re-quantized."""
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices``."""
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times."""
        if self.is_initialized:
            self._select_rows(torch.arange(self.batch_size).repeat_interleave(repeats))
