"""The sliding-window layer kvlib's caches use for a hybrid model's sliding layers.

Gemma 2/3 (and others) mix ``"sliding_attention"`` layers, whose queries see only the last
``sliding_window`` tokens, with ``"full_attention"`` layers. :class:`kvlib.caches.quantized.QuantizedKVCache`
and :class:`kvlib.caches.eviction.cache.EvictionCache` quantize or evict on the full layers and give every
sliding layer one :class:`SlidingWindowLayer`: the most recent ``sliding_window`` tokens in
full precision, nothing else. A window is small (512 tokens on Gemma 3 270M, 1024 on Gemma 3
27B) and its tokens are always read, so there is little to gain from quantizing or evicting
inside it.

**What a layer holds**, after ``T`` tokens: ``keys`` / ``values`` ``(batch, kv_heads,
min(T, sliding_window), head_dim)`` in the storage dtype. That is one token more than
transformers' ``DynamicSlidingWindowLayer`` keeps between steps (``sliding_window - 1``: the
oldest of the window is seen by no later query), and exactly what :mod:`kvlib.memory` prices a
sliding layer at (:meth:`kvlib.specs.ModelSpec.tokens_cached`: ``min(T, sliding_window)``, the
window attention reads at one step), so that a cache's ``nbytes()`` and the byte math agree
byte for byte. The extra token costs ``1 / sliding_window`` of the layer (0.2 % at 512).

**What ``update`` returns**: every held token followed by the new ones, as transformers' layer
does; :meth:`SlidingWindowLayer.get_mask_sizes` places them (``kv_offset = T - held``) so that
the model's sliding-window mask hides those outside each query's window.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvlib.caches.base import BatchRows, check_states, row_indices
from kvlib.validate import check_int

__all__ = ["SlidingWindowLayer"]


class SlidingWindowLayer(BatchRows, CacheLayerMixin):
    """One sliding-window decoder layer: the last ``sliding_window`` tokens, in full precision.

    Args:
        sliding_window: the layer's window (transformers' ``config.sliding_window``), >= 1.
        dtype: storage dtype; ``None``: the model's.
        fp16_if_wider: with ``dtype=None``, store float16 when the model computes in float32 or
            float64 (what an fp16 deployment holds; :class:`kvlib.caches.quantized.QuantizedKVCache`'s
            window rule).

    State after ``T`` tokens: ``keys`` / ``values`` ``(batch, kv_heads, min(T,
    sliding_window), head_dim)`` in the storage dtype, the newest last.
    """

    is_sliding = True
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        sliding_window: int,
        dtype: torch.dtype | None = None,
        *,
        fp16_if_wider: bool = False,
    ) -> None:
        super().__init__()
        self.sliding_window = check_int(sliding_window, "sliding_window", minimum=1)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype or None (got {dtype!r})")
        self.dtype_option, self.fp16_if_wider = dtype, fp16_if_wider
        self._clear()

    def _clear(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Fix device, dtypes and (batch, kv_heads, head_dim) from the first states seen."""
        check_states(key_states, value_states)
        b, h, _, d = key_states.shape
        self.device, self.model_dtype = key_states.device, key_states.dtype
        if self.dtype_option is not None:
            self.dtype = self.dtype_option
        elif self.fp16_if_wider and key_states.dtype in (torch.float32, torch.float64):
            self.dtype = torch.float16
        else:
            self.dtype = key_states.dtype
        self.batch_size, self.num_heads, self.head_dim = b, h, d
        self.keys = key_states.new_zeros((b, h, 0, d), dtype=self.dtype)
        self.values = self.keys.clone()
        self.is_initialized = True

    def kept(self) -> int:
        """Tokens held per KV head: ``min(T, sliding_window)``."""
        return 0 if self.keys is None else self.keys.shape[2]

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(self.dtype)
        if y.dtype == torch.float16 and x.dtype != torch.float16:
            if not bool(torch.isfinite(y).all()) and bool(torch.isfinite(x).all()):
                raise ValueError(
                    "cached states exceed the float16 range of the sliding window; "
                    "pass a wider window dtype (the model's)"
                )
        return y

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the held tokens followed by ``key_states`` / ``value_states`` ``(batch,
        kv_heads, q, head_dim)``, then keep the last ``sliding_window`` of them.

        Returns:
            keys, values: ``(batch, kv_heads, held + q, head_dim)`` in the new states' dtype.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, d = key_states.shape
        if (b, h, d) != (self.batch_size, self.num_heads, self.head_dim) or (
            value_states.shape != key_states.shape
        ):
            raise ValueError(
                f"key_states and value_states must be (batch={self.batch_size}, kv_heads="
                f"{self.num_heads}, seq_len, head_dim={self.head_dim}) (got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}); call reset() "
                "before changing shapes"
            )
        keys = torch.cat([self.keys.to(key_states.dtype), key_states], dim=2)
        values = torch.cat([self.values.to(value_states.dtype), value_states], dim=2)
        w = self.sliding_window
        self.keys = torch.cat([self.keys, self._store(key_states[:, :, -w:])], dim=2)
        self.values = torch.cat([self.values, self._store(value_states[:, :, -w:])], dim=2)
        self.keys = self.keys[:, :, -w:].contiguous()
        self.values = self.values[:, :, -w:].contiguous()
        self.cumulative_length += q
        return keys, values

    def get_seq_length(self) -> int:
        """Tokens seen (the next token's position), not held."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the held tokens plus the query, placed at their
        positions (``kv_offset = seen - held``) so the sliding mask applies to them."""
        held = self.kept()
        return held + query_length, self.cumulative_length - held

    def get_max_length(self) -> int:
        """The window: the most tokens held."""
        return self.sliding_window

    def reset(self) -> None:
        """Drop every held token."""
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "kvlib's sliding-window layer cannot crop (assisted decoding needs a DynamicCache)"
        )

    def _select_rows(self, rows: Any) -> None:
        if not self.is_initialized:
            return
        rows = row_indices(rows, self.keys.device)
        self.keys = self.keys.index_select(0, rows).contiguous()
        self.values = self.values.index_select(0, rows).contiguous()
        self.batch_size = self.keys.shape[0]

    def offload(self) -> None:  # a window is small: it stays where it is
        pass

    def prefetch(self) -> None:
        pass

    def nbytes(self) -> int:
        """Exact bytes held: the window's keys and values."""
        if not self.is_initialized:
            return 0
        return 2 * self.keys.numel() * self.keys.element_size()

    def fp16_nbytes(self) -> int:
        """Bytes the same window holds in float16 (keys + values): ``min(T, sliding_window)``
        tokens, as :mod:`kvlib.memory` prices a sliding layer."""
        if not self.is_initialized:
            return 0
        return 2 * self.batch_size * self.num_heads * self.kept() * self.head_dim * 2
