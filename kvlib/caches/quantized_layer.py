"""One decoder layer of kvlib's KIVI-style quantized cache: sinks, quantized blocks, window.

:class:`QuantizedKVLayer` is the ``CacheLayerMixin`` that
:class:`kvlib.caches.quantized.QuantizedKVCache` builds for every ``"full_attention"`` layer
(notebook 04); the layout, the defaults, rotation and fused decoding are described in
:mod:`kvlib.caches.quantized`. The option checks the cache and its layers share live here too.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvlib.caches.base import (
    BatchRows,
    WholeSequence,
    check_states,
    fill_sinks,
    held_nbytes,
    row_indices,
    select_rows,
)
from kvlib.caches.layout import (
    RESIDUAL_LENGTH,
    SINK_TOKENS,
    default_group_size,
    default_key_group_size,
)
from kvlib.kernels import fused_attention
from kvlib.kernels.decode import PackedKV, interpreter_mode, triton_available
from kvlib.kernels.fused_attention import FusedStep
from kvlib.quant.rotation import rotate, unrotate
from kvlib.quant.tensor import QuantizedTensor, quantize
from kvlib.validate import check_bits, check_divisor, check_int

__all__ = [
    "QuantizedKVLayer",
    "check_fused_decode",
    "check_group_size",
    "check_key_group_size",
    "check_window_dtype",
]

_WINDOW_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: What a layer stores in full precision, ``(batch, kv_heads, tokens, head_dim)`` each.
_WINDOWS = ("sink_keys", "sink_values", "residual_keys", "residual_values")
#: Its quantized blocks, ``(n, batch, kv_heads, residual_length, head_dim)`` each.
_BLOCKS = ("key_blocks", "value_blocks")


def check_group_size(group_size: Any, head_dim: int) -> int:
    """Channels per value group: an int that divides ``head_dim``."""
    group_size = check_int(group_size, "group_size")
    if group_size <= 0 or head_dim % group_size:
        divisors = [d for d in range(1, head_dim + 1) if head_dim % d == 0]
        raise ValueError(
            f"group_size must divide head_dim {head_dim} (got {group_size}; accepted: "
            f"{', '.join(map(str, divisors))})"
        )
    return group_size


def check_fused_decode(fused_decode: Any) -> bool | None:
    """The ``fused_decode`` option: True, False or None (auto)."""
    if fused_decode is not None and not isinstance(fused_decode, bool):
        raise TypeError(f"fused_decode must be True, False or None (auto) (got {fused_decode!r})")
    return fused_decode


def check_key_group_size(key_group_size: Any, residual_length: int, key_bits: int) -> int:
    """Tokens per key scale group; ``None``: :func:`default_key_group_size`."""
    if key_group_size is None:
        return default_key_group_size(key_bits, residual_length)
    return check_divisor(
        key_group_size, "key_group_size", residual_length, f"residual_length {residual_length}"
    )


def check_window_dtype(window_dtype: Any) -> None:
    """The ``window_dtype`` option: None or one of float16, bfloat16, float32, float64."""
    if window_dtype is not None and window_dtype not in _WINDOW_DTYPES:
        raise ValueError(
            f"window_dtype must be None or one of float16, bfloat16, float32, float64 "
            f"(got {window_dtype})"
        )


class QuantizedKVLayer(WholeSequence, BatchRows, CacheLayerMixin):
    """One decoder layer of :class:`~kvlib.caches.quantized.QuantizedKVCache` (see
    :mod:`kvlib.caches.quantized` for the layout).

    State after ``update`` calls totalling ``T`` tokens, with ``s = min(T, sink_tokens)``,
    ``n = (T - s) // residual_length`` blocks and ``r = T - s - n * residual_length``:

    * ``sink_keys`` / ``sink_values``: ``(batch, kv_heads, s, head_dim)`` in ``window_dtype``;
    * ``key_blocks``: a :class:`~kvlib.quant.tensor.QuantizedTensor` of shape
      ``(n, batch, kv_heads, residual_length, head_dim)`` quantized over axis 3 (tokens of a
      block: per-channel) in groups of ``key_group_size`` tokens; packed codes
      ``(n, batch, kv_heads, bytes)``, scales and zero points
      ``(n, batch, kv_heads, residual_length // key_group_size, 1, head_dim)``;
    * ``value_blocks``: same shape, quantized over axis 4 (head_dim) in groups of
      ``group_size`` (per-token); scales ``(n, batch, kv_heads, residual_length, G, 1)``;
    * ``residual_keys`` / ``residual_values``: ``(batch, kv_heads, r, head_dim)``.

    ``fused_decode`` (``None``: auto, on CUDA; ``True``: always, CPU tensors in Triton's
    interpreter included; ``False``: never) sends single-token steps to the fused kernel
    (:mod:`kvlib.caches.quantized`); it needs ``config``, the model's text config, set by the cache.

    Blocks are stored block-major so that appending one never touches the codes already held.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        key_bits: int = 4,
        value_bits: int = 4,
        group_size: int | None = None,
        residual_length: int = RESIDUAL_LENGTH,
        sink_tokens: int = SINK_TOKENS,
        rotation: torch.Tensor | None = None,
        window_dtype: torch.dtype | None = None,
        key_group_size: int | None = None,
        fused_decode: bool | None = None,
    ) -> None:
        super().__init__()
        self.key_bits = check_bits(key_bits, "key_bits")
        self.value_bits = check_bits(value_bits, "value_bits")
        self.group_size_option = (
            None if group_size is None else check_int(group_size, "group_size", minimum=1)
        )
        self.group_size = self.group_size_option  # resolved from head_dim on the first update
        self.residual_length = check_int(residual_length, "residual_length", minimum=1)
        self.key_group_size = check_key_group_size(
            key_group_size, self.residual_length, self.key_bits
        )
        self.sink_tokens = check_int(sink_tokens, "sink_tokens", minimum=0)
        check_window_dtype(window_dtype)
        self.window_dtype_option = window_dtype
        self.rotation = rotation  # (head_dim, head_dim) orthonormal, shared by all layers
        self.fused_decode = check_fused_decode(fused_decode)
        self.config: Any = None  # the model's text config (fused decoding), set by the cache
        # the last fused step, shared by all layers of a cache: an unread one is an error
        self._last_step: list[FusedStep | None] = [None]
        self._clear()

    # ------------------------------------------------------------------ state

    def _clear(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length = 0
        self.sink_keys: torch.Tensor | None = None
        self.sink_values: torch.Tensor | None = None
        self.residual_keys: torch.Tensor | None = None
        self.residual_values: torch.Tensor | None = None
        self.key_blocks: QuantizedTensor | None = None
        self.value_blocks: QuantizedTensor | None = None
        self.n_blocks = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Fix device, dtypes and (batch, kv_heads, head_dim) from the first states seen."""
        check_states(key_states, value_states)
        b, h, _, d = key_states.shape
        gs = self.group_size_option
        self.group_size = check_group_size(default_group_size(d) if gs is None else gs, d)
        if (self.residual_length * d) % 8:
            raise ValueError(
                f"residual_length * head_dim must be a multiple of 8 so that a block's packed "
                f"codes fill whole bytes (got {self.residual_length} * {d})"
            )
        if self.rotation is not None and self.rotation.shape != (d, d):
            raise ValueError(
                f"the rotation must be ({d}, {d}) for head_dim {d} "
                f"(got {tuple(self.rotation.shape)})"
            )
        self.device = key_states.device
        self.dtype = key_states.dtype
        if self.window_dtype_option is not None:
            self.window_dtype = self.window_dtype_option
        elif self.dtype in (torch.float16, torch.bfloat16):
            self.window_dtype = self.dtype
        else:
            self.window_dtype = torch.float16
        self.batch_size, self.num_heads, self.head_dim = b, h, d
        empty = key_states.new_zeros((b, h, 0, d), dtype=self.window_dtype)
        self.sink_keys, self.sink_values = empty, empty.clone()
        self.residual_keys, self.residual_values = empty.clone(), empty.clone()
        self.is_initialized = True

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        expect = (self.batch_size, self.num_heads, self.head_dim)
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != expect:
                raise ValueError(
                    f"{name} must have shape (batch={expect[0]}, kv_heads={expect[1]}, seq_len, "
                    f"head_dim={expect[2]}) like the states already cached "
                    f"(got {tuple(t.shape)}); call reset() before changing shapes"
                )
        if key_states.shape[2] != value_states.shape[2]:
            raise ValueError("key_states and value_states must hold the same number of tokens")

    # ------------------------------------------------------------------ write

    def _to_window(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.window_dtype:
            return x
        y = x.to(self.window_dtype)
        if self.window_dtype == torch.float16 and not bool(torch.isfinite(y).all()):
            if bool(torch.isfinite(x).all()):
                raise ValueError(
                    "cached states exceed the float16 range of the full-precision window; "
                    "pass window_dtype=torch.float32 (or the model's dtype)"
                )
            raise ValueError("cached states contain NaN or Inf")
        return y

    def _quantize_blocks(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize ``n`` whole blocks ``(batch, kv_heads, n * residual_length, head_dim)``,
        one block at a time (so the result does not depend on how tokens were chunked)."""
        r = self.residual_length
        for i in range(k.shape[2] // r):
            kb = k[:, :, i * r : (i + 1) * r].unsqueeze(0)  # (1, b, h, r, d)
            vb = v[:, :, i * r : (i + 1) * r].unsqueeze(0)
            if self.rotation is not None:  # keys only (see kvlib.caches.quantized)
                kb = rotate(kb, self.rotation)
            qk = quantize(kb.contiguous(), self.key_bits, axis=3, group_size=self.key_group_size)
            qv = quantize(vb.contiguous(), self.value_bits, axis=4, group_size=self.group_size)
            # rows (block, batch, head): appended and batch-selected without unpacking
            qk, qv = qk.with_rows(3), qv.with_rows(3)
            self.key_blocks = qk if self.key_blocks is None else self.key_blocks.cat(qk)
            self.value_blocks = qv if self.value_blocks is None else self.value_blocks.cat(qv)
            self.n_blocks += 1

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        k, v = self._to_window(key_states), self._to_window(value_states)
        k, v = fill_sinks(self, k, v)
        if k.shape[2] == 0:
            return
        rk = torch.cat([self.residual_keys, k], dim=2)
        rv = torch.cat([self.residual_values, v], dim=2)
        full = (rk.shape[2] // self.residual_length) * self.residual_length
        if full:
            self._quantize_blocks(rk[:, :, :full], rv[:, :, :full])
            rk, rv = rk[:, :, full:].clone(), rv[:, :, full:].clone()
        self.residual_keys, self.residual_values = rk, rv

    # ------------------------------------------------------------------ read

    def _dequantize_into(self, q: QuantizedTensor, dst: torch.Tensor, rotated: bool) -> None:
        """Dequantize all blocks ``q`` ``(n, batch, kv_heads, R, head_dim)`` into ``dst``
        ``(batch, kv_heads, n * R, head_dim)`` (a view of the output), in one vectorised pass;
        ``rotated`` keys are rotated back with the transposed Hadamard matrix."""
        n, b, h, r, d = q.shape
        if rotated:  # dequantize block-major, then rotate back into the output
            block_major = q.dequantize_into(
                torch.empty(q.shape, dtype=dst.dtype, device=dst.device)
            )
            back = unrotate(block_major, self.rotation)
            dst.view(b, h, n, r, d).copy_(back.permute(1, 2, 0, 3, 4))
        else:  # write straight into the output, seen block-major
            q.dequantize_into(dst.view(b, h, n, r, d).permute(2, 0, 1, 3, 4))

    def _read(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """The cached past followed by the new states, each (batch, kv_heads, T + q, head_dim)."""
        s = self.sink_keys.shape[2]
        nr = self.n_blocks * self.residual_length
        r = self.residual_keys.shape[2]
        q = key_states.shape[2]
        outs = []
        for sink, blocks, res, new, rotated in (
            (
                self.sink_keys,
                self.key_blocks,
                self.residual_keys,
                key_states,
                self.rotation is not None,
            ),
            (self.sink_values, self.value_blocks, self.residual_values, value_states, False),
        ):
            out = torch.empty(
                (self.batch_size, self.num_heads, s + nr + r + q, self.head_dim),
                dtype=new.dtype,
                device=new.device,
            )
            if s:
                out[:, :, :s].copy_(sink)
            if nr:
                self._dequantize_into(blocks, out[:, :, s : s + nr], rotated)
            if r:
                out[:, :, s + nr : s + nr + r].copy_(res)
            out[:, :, s + nr + r :].copy_(new)
            outs.append(out)
        return outs[0], outs[1]

    def packed(
        self, key_states: torch.Tensor | None = None, value_states: torch.Tensor | None = None
    ) -> PackedKV:
        """The layer's state as the fused kernel reads it (:class:`kvlib.kernels.decode.PackedKV`),
        nothing copied but the window: ``key_states`` / ``value_states``
        ``(batch, kv_heads, q, head_dim)``, when given, follow the window in their own dtype
        (the window is cast to it), as the torch path attends to them."""
        if not self.is_initialized:
            raise ValueError("the layer holds no tokens yet")
        wk, wv = self.residual_keys, self.residual_values
        if key_states is not None:
            wk = torch.cat([wk.to(key_states.dtype), key_states], dim=2)
            wv = torch.cat([wv.to(value_states.dtype), value_states], dim=2)
        return PackedKV(
            self.sink_keys,
            self.sink_values,
            self.key_blocks,
            self.value_blocks,
            wk,
            wv,
            self.rotation,
        )

    def _fused_step(self, key_states: torch.Tensor) -> bool:
        """Whether this ``update`` is a fused decode step (see ``fused_decode``)."""
        option = self.fused_decode
        if option is False or key_states.shape[2] != 1 or self.cumulative_length == 0:
            return False
        if key_states.is_cuda:
            runs = triton_available()
        else:  # CPU: only when forced, in Triton's interpreter
            runs = option is True and key_states.device.type == "cpu" and interpreter_mode()
            runs = runs and triton_available()
        runs = runs and self.config is not None and fused_attention.use_fused_attention(self.config)
        if not runs and option is True:
            raise ValueError(
                "fused_decode=True needs triton, CUDA tensors (or CPU tensors with "
                "TRITON_INTERPRET=1 set before triton is imported), a layer built by "
                "QuantizedKVCache and a model on 'sdpa' or 'kvlib_fused' attention (got "
                f"{key_states.device.type} tensors, attention "
                f"{getattr(self.config, '_attn_implementation', None)!r})"
            )
        return runs

    # ------------------------------------------------------------------ CacheLayerMixin API

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the past (dequantized) followed by ``key_states`` / ``value_states``
        ``(batch, kv_heads, q, head_dim)``, then store the new states. A fused decode step
        returns the new states alone, tagged for :mod:`kvlib.kernels.fused_attention`.

        Returns:
            keys, values: ``(batch, kv_heads, T + q, head_dim)`` in the dtype of the new states.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_states(key_states, value_states)
        if self._fused_step(key_states):
            last = self._last_step[0]
            if last is not None:
                last.check_consumed()
            step = FusedStep(self.packed(key_states, value_states))
            self._last_step[0] = step
            keys, values = fused_attention.tag(key_states, step), value_states
        elif self.cumulative_length == 0:
            keys, values = key_states, value_states
        else:
            keys, values = self._read(key_states, value_states)
        self._append(key_states, value_states)
        self.cumulative_length += key_states.shape[2]
        return keys, values

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention reads for the cached tokens: keys, values
        ``(batch, kv_heads, T, head_dim)`` in the model's dtype (a fresh copy)."""
        if not self.is_initialized:
            raise ValueError("the layer holds no tokens yet")
        empty = self.sink_keys.new_zeros(
            (self.batch_size, self.num_heads, 0, self.head_dim), dtype=self.dtype
        )
        return self._read(empty, empty)

    def reset(self) -> None:
        """Drop every stored token; the next ``update`` starts from scratch."""
        self._clear()
        self._last_step[0] = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "QuantizedKVCache cannot crop: its blocks are quantized once and not re-cut "
            "(assisted/speculative decoding needs a DynamicCache)"
        )

    def _select_rows(self, rows: Any) -> None:
        """Keep batch rows ``rows`` (indices, repeats allowed, or a boolean mask) of every
        window and block: codes and metadata move together, nothing is re-quantized."""
        if not self.is_initialized:
            return
        rows = row_indices(rows, self.sink_keys.device)
        select_rows(self, _WINDOWS, rows)
        select_rows(self, _BLOCKS, rows, dim=1)  # blocks are stored block-major
        self.batch_size = self.sink_keys.shape[0]

    def _map_device(self, device: Any) -> None:
        if not self.is_initialized:
            return
        for name in (*_WINDOWS, *_BLOCKS):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))

    # ------------------------------------------------------------------ bytes

    def nbytes(self) -> int:
        """Exact bytes held: packed codes + scales + zero points + sinks + window."""
        if not self.is_initialized:
            return 0
        return held_nbytes(*(getattr(self, name) for name in (*_WINDOWS, *_BLOCKS)))
