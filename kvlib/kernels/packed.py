"""One layer's packed cache as the fused decode kernel reads it (notebook 10).

:class:`PackedKV` holds a :class:`kvlib.caches.quantized.QuantizedKVLayer`'s state plus the tokens
of the current step, in token order ``[sinks | quantized blocks | window]``: full-precision sinks
and window around blocks of bit-packed codes (:class:`~kvlib.quant.tensor.QuantizedTensor`). It
checks that the parts fit together, and :meth:`PackedKV.dequantize` gives the keys and values the
torch reference attends to. :mod:`kvlib.kernels.decode` runs attention over it.

Tensors follow the transformers convention ``(batch, kv_heads, seq_len, head_dim)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.quant.rotation import unrotate
from kvlib.quant.tensor import QuantizedTensor

__all__ = ["PackedKV"]


@dataclass(frozen=True)
class PackedKV:
    """One layer's cache as the kernel reads it (the state of a :class:`kvlib.caches.quantized.
    QuantizedKVLayer`, plus the tokens of the current step).

    Tokens are in order ``[sinks | quantized blocks | window]``, ``T = s + n * R + w``.

    Attributes:
        sink_keys, sink_values: ``(batch, kv_heads, s, head_dim)`` full precision (``s >= 0``).
        key_blocks: ``None`` (no block yet) or a :class:`~kvlib.quant.tensor.QuantizedTensor` of shape
            ``(n, batch, kv_heads, R, head_dim)``, asymmetric, quantized over axis 3 (tokens:
            per channel) in groups of ``key_group`` tokens, codes laid out in rows
            ``(n, batch, kv_heads, bytes)`` (``with_rows(3)``).
        value_blocks: same shape, quantized over axis 4 (head_dim: per token) in groups of
            ``value_group`` channels; ``None`` exactly when ``key_blocks`` is.
        window_keys, window_values: ``(batch, kv_heads, w, head_dim)`` full precision: the
            residual window followed by the step's new token(s).
        rotation: ``None``, or the orthonormal ``(head_dim, head_dim)`` matrix ``H`` the keys
            were multiplied by before quantizing (blocks only; sinks and window are not rotated).
    """

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    key_blocks: QuantizedTensor | None
    value_blocks: QuantizedTensor | None
    window_keys: torch.Tensor
    window_values: torch.Tensor
    rotation: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("sink_keys", "sink_values", "window_keys", "window_values"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.dtype.is_floating_point:
                raise ValueError(
                    f"{name} must be a 4-d floating tensor (batch, kv_heads, seq_len, head_dim) "
                    f"(got {getattr(t, 'shape', type(t).__name__)})"
                )
        b, h, _, d = self.window_keys.shape
        for name in ("sink_keys", "sink_values", "window_values"):
            t = getattr(self, name)
            if (t.shape[0], t.shape[1], t.shape[3]) != (b, h, d):
                raise ValueError(
                    f"{name} must have shape (batch={b}, kv_heads={h}, seq_len, head_dim={d}) "
                    f"like window_keys (got {tuple(t.shape)})"
                )
        if self.sink_keys.shape[2] != self.sink_values.shape[2]:
            raise ValueError("sink_keys and sink_values must hold the same number of tokens")
        if self.window_keys.shape[2] != self.window_values.shape[2]:
            raise ValueError("window_keys and window_values must hold the same number of tokens")
        if (self.key_blocks is None) != (self.value_blocks is None):
            raise ValueError("key_blocks and value_blocks must both be given or both be None")
        if self.key_blocks is not None:
            for name, blocks, axis in (
                ("key_blocks", self.key_blocks, 3),
                ("value_blocks", self.value_blocks, 4),
            ):
                if not isinstance(blocks, QuantizedTensor):
                    raise TypeError(
                        f"{name} must be a kvlib.quant.tensor.QuantizedTensor (got {type(blocks).__name__})"
                    )
                if len(blocks.shape) != 5 or (
                    blocks.shape[1],
                    blocks.shape[2],
                    blocks.shape[4],
                ) != (b, h, d):
                    raise ValueError(
                        f"{name} must have shape (n, batch={b}, kv_heads={h}, R, head_dim={d}) "
                        f"(got {tuple(blocks.shape)})"
                    )
                if blocks.axis != axis or blocks.symmetric or blocks.packed.dim() != 4:
                    raise ValueError(
                        f"{name} must be asymmetric, quantized over axis {axis}, with codes laid "
                        f"out in rows (n, batch, kv_heads, bytes) (QuantizedTensor.with_rows(3))"
                    )
            if self.value_blocks.shape[:4] != self.key_blocks.shape[:4]:
                raise ValueError(
                    f"key_blocks and value_blocks must have the same shape "
                    f"(got {tuple(self.key_blocks.shape)} and {tuple(self.value_blocks.shape)})"
                )
        if self.rotation is not None and tuple(self.rotation.shape) != (d, d):
            raise ValueError(
                f"rotation must be ({d}, {d}) for head_dim {d} (got {tuple(self.rotation.shape)})"
            )

    # -- sizes
    @property
    def batch_size(self) -> int:
        return self.window_keys.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.window_keys.shape[1]

    @property
    def head_dim(self) -> int:
        return self.window_keys.shape[3]

    @property
    def num_quantized(self) -> int:
        """Tokens in the quantized blocks, ``n * R``."""
        if self.key_blocks is None:
            return 0
        return self.key_blocks.shape[0] * self.key_blocks.shape[3]

    @property
    def num_tokens(self) -> int:
        """All tokens attended to, ``T = s + n * R + w``."""
        return self.sink_keys.shape[2] + self.num_quantized + self.window_keys.shape[2]

    # -- reference read
    def dequantize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(batch, kv_heads, T, head_dim)`` in ``dtype``, blocks dequantized
        and rotated back (exactly what the cache's torch path attends to)."""
        parts_k = [self.sink_keys.to(dtype)]
        parts_v = [self.sink_values.to(dtype)]
        if self.key_blocks is not None:
            n, b, h, r, d = self.key_blocks.shape
            kb = self.key_blocks.dequantize(dtype)  # (n, b, h, R, d), block-major
            if self.rotation is not None:
                kb = unrotate(kb, self.rotation)
            vb = self.value_blocks.dequantize(dtype)
            parts_k.append(kb.permute(1, 2, 0, 3, 4).reshape(b, h, n * r, d))
            parts_v.append(vb.permute(1, 2, 0, 3, 4).reshape(b, h, n * r, d))
        parts_k.append(self.window_keys.to(dtype))
        parts_v.append(self.window_values.to(dtype))
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)
