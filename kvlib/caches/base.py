"""What every kvlib cache layer shares: the check of the states it is given, and batch operations.

kvlib's three cache layers (:class:`kvlib.caches.quantized.QuantizedKVLayer`,
:class:`kvlib.caches.eviction.cache.EvictionLayer`, :class:`kvlib.caches.sliding.SlidingWindowLayer`) store their
tokens differently, but take the same ``(batch, kv_heads, seq_len, head_dim)`` states from the
model and serve the same batch operations of transformers' ``CacheLayerMixin`` (beam search's
reorder, contrastive search's repeat, batch selection). Each layer writes only how it keeps
some batch rows (``_select_rows``); :class:`BatchRows` derives the three operations from it.
A layer that returns every token it holds (no window) gets its lengths, mask sizes and
offloading from :class:`WholeSequence`; a cache gets its byte counts from :class:`ByteCounts`.
A layer names the tensors it stores to :func:`select_rows` (batch selection) and
:func:`held_nbytes` (its exact bytes); :func:`fp16_layer_nbytes` prices its tokens in float16.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from kvlib import compat

__all__ = [
    "BatchRows",
    "ByteCounts",
    "WholeSequence",
    "check_states",
    "fill_sinks",
    "fp16_layer_nbytes",
    "held_nbytes",
    "row_indices",
    "select_rows",
]


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


def select_rows(layer: Any, names: Iterable[str], rows: torch.Tensor, dim: int = 0) -> None:
    """Keep batch rows ``rows`` ``(n,)`` (from :func:`row_indices`) of the layer's stored
    tensors ``names``: tensors or row-laid QuantizedTensors with the batch along axis ``dim``,
    ``None`` skipped; codes and metadata move together, nothing is re-quantized."""
    for name in names:
        t = getattr(layer, name)
        if t is not None:
            setattr(layer, name, t.index_select(dim, rows))


def held_nbytes(*held: Any) -> int:
    """Exact bytes of a layer's stored tensors and QuantizedTensors (``None`` skipped)."""
    return sum(t.nbytes for t in held if t is not None)


def fp16_layer_nbytes(layer: Any, tokens: int) -> int:
    """Bytes an fp16 DynamicCache layer holds for ``tokens`` tokens of the layer's ``batch_size``
    rows, ``num_heads`` KV heads and ``head_dim`` channels (keys and values)."""
    return 2 * layer.batch_size * layer.num_heads * tokens * layer.head_dim * 2


def fill_sinks(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> tuple[Any, Any]:
    """Move the first of ``keys``/``values`` ``(batch, kv_heads, n, head_dim)`` into the layer's
    ``sink_keys``/``sink_values`` until it holds ``sink_tokens`` of them; returns the rest."""
    take = min(max(layer.sink_tokens - layer.sink_keys.shape[2], 0), keys.shape[2])
    if take:
        layer.sink_keys = torch.cat([layer.sink_keys, keys[:, :, :take]], dim=2)
        layer.sink_values = torch.cat([layer.sink_values, values[:, :, :take]], dim=2)
    return keys[:, :, take:], values[:, :, take:]


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


class WholeSequence:
    """Lengths, mask sizes, offloading and the fp16 byte count of a layer that returns every
    token it holds (no window, no maximum), from its ``cumulative_length``, its shape
    (``batch_size``, ``num_heads``, ``head_dim``) and its ``_map_device(device)`` (move every
    stored tensor; a no-op before the first update)."""

    cumulative_length: int
    is_initialized: bool
    device: Any
    batch_size: int
    num_heads: int
    head_dim: int

    def _map_device(self, device: Any) -> None:
        raise NotImplementedError

    def get_seq_length(self) -> int:
        """Number of tokens cached."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the attention mask: every cached token is returned."""
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        """No maximum (-1): the layer grows with the sequence."""
        return -1

    def offload(self) -> None:
        """Move the stored tokens to the CPU."""
        self._map_device("cpu")

    def prefetch(self) -> None:
        """Move the stored tokens back to the layer's device."""
        if self.is_initialized:
            self._map_device(self.device)

    def fp16_nbytes(self) -> int:
        """Bytes an fp16 DynamicCache layer would hold for the same tokens (keys and values)."""
        if not self.is_initialized:
            return 0
        return fp16_layer_nbytes(self, self.cumulative_length)


class ByteCounts:
    """A cache's byte counts from its ``layers``: each layer's exact ``nbytes``
    (:func:`kvlib.compat.layer_nbytes`) and the bytes an fp16 ``DynamicCache`` would hold for
    the same tokens (each layer's ``fp16_nbytes()``; a sliding layer counts its window)."""

    layers: list[Any]

    def nbytes(self) -> int:
        """Exact bytes held by all layers."""
        return sum(compat.layer_nbytes(layer) for layer in self.layers)

    def fp16_nbytes(self) -> int:
        """Bytes an fp16 DynamicCache would hold for the same tokens."""
        return sum(layer.fp16_nbytes() for layer in self.layers)

    def compression_ratio(self) -> float:
        """``fp16_nbytes() / nbytes()`` (``nan`` while empty)."""
        n = self.nbytes()
        return self.fp16_nbytes() / n if n else math.nan
