"""A cache layer for a key/value codec: ``[sinks | encoded tokens | window]`` along the sequence.

TurboQuant's cache (:mod:`kvlib.caches.turboquant`) and KVQuant's (:mod:`kvlib.caches.kvquant`)
store their tokens the same way and differ only in the codec and in what they do to keys just
before encoding and just after decoding (centring them per block; undoing and re-applying RoPE).
:class:`CodedLayer` holds that shared layout; a codec is any object with the four methods of
:class:`Codec`, and a subclass fills in the two key hooks.

As in kvlib's other caches, the tokens passed to ``update`` are returned as given for their own
step (a prefill attends to itself in full precision) and read back decoded from then on.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from transformers.cache_utils import CacheLayerMixin

from kvlib.caches.base import BatchRows, WholeSequence, check_states, fill_sinks, row_indices
from kvlib.validate import check_int

__all__ = ["Codec", "CodedLayer"]


@runtime_checkable
class Codec(Protocol):
    """What :class:`CodedLayer` needs of a codec: encode ``(batch, kv_heads, m, head_dim)``
    keys or values into an object with ``cat(other, dim)``, ``index_select(dim, index)``,
    ``to(device)`` and ``nbytes``, and decode it back, into a new tensor or into ``out`` (a
    slice of the tensor attention reads, whose dtype wins)."""

    head_dim: int

    def encode_keys(self, keys: torch.Tensor) -> Any: ...

    def decode_keys(
        self, enc: Any, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def encode_values(self, values: torch.Tensor) -> Any: ...

    def decode_values(
        self, enc: Any, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...


class CodedLayer(WholeSequence, BatchRows, CacheLayerMixin):
    """One decoder layer, ``[sinks | encoded tokens | window]`` along the sequence:

    * ``sink_keys`` / ``sink_values``: the first ``sink_tokens`` tokens, ``(batch, kv_heads, s,
      head_dim)`` in the storage dtype (the model's; float16 for a float32/float64 model);
    * ``codes`` and ``quantized_values``: the codec's encoded keys and values of
      ``(batch, kv_heads, n, head_dim)`` tokens;
    * ``window_keys`` / ``window_values``: the newest tokens not yet encoded (fewer than
      ``residual_length``) in the storage dtype.

    ``residual_length=0`` encodes every token as it arrives; otherwise tokens wait in the window
    until ``residual_length`` of them are encoded together (one block). ``quantizer=None`` keeps
    every token in the storage dtype.

    Subclasses may transform keys around the codec: :meth:`_prepare_keys` before encoding a
    block, :meth:`_decode_keys_into` to decode and undo it; tensors they keep go in
    :attr:`extra_tensors` (moved, selected and counted with the rest).

    A read allocates the tensor attention reads once and writes every part into its slice
    (sinks, decoded tokens, window, new states), as kvlib's KIVI cache does: no part is built
    and then copied again.

    Args:
        quantizer: the codec (:class:`Codec`), or ``None``.
        sink_tokens: first tokens kept in the storage dtype, >= 0.
        residual_length: the window, >= 0.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False
    #: Names of the subclass's own tensors (``None`` until set).
    extra_tensors: tuple[str, ...] = ()

    def __init__(
        self, quantizer: Codec | None, sink_tokens: int = 0, residual_length: int = 0
    ) -> None:
        super().__init__()
        if quantizer is not None and not isinstance(quantizer, Codec):
            raise TypeError(f"quantizer must be a codec or None (got {type(quantizer).__name__})")
        self.quantizer = quantizer
        self.sink_tokens = check_int(sink_tokens, "sink_tokens", minimum=0)
        self.residual_length = check_int(residual_length, "residual_length", minimum=0)
        self._clear()

    def _clear(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length = 0
        self.encoded_tokens = 0
        self.sink_keys = self.sink_values = None
        self.window_keys = self.window_values = None
        self.codes: Any = None
        self.quantized_values: Any = None
        for name in self.extra_tensors:
            setattr(self, name, None)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Fix device, dtypes and (batch, kv_heads, head_dim) from the first states seen."""
        check_states(key_states, value_states)
        b, h, _, d = key_states.shape
        if self.quantizer is not None and d != self.quantizer.head_dim:
            raise ValueError(
                f"states have head_dim {d}; the quantizer was built for {self.quantizer.head_dim}"
            )
        self.batch_size, self.num_heads, self.head_dim = b, h, d
        self.device, self.dtype = key_states.device, key_states.dtype
        wide = self.dtype in (torch.float32, torch.float64)
        self.store_dtype = torch.float16 if wide else self.dtype
        empty = key_states.new_zeros((b, h, 0, d), dtype=self.store_dtype)
        self.sink_keys, self.sink_values = empty, empty.clone()
        self.window_keys, self.window_values = empty.clone(), empty.clone()
        self.is_initialized = True

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_states(key_states, value_states)
        expect = (self.batch_size, self.num_heads, self.head_dim)
        got = (key_states.shape[0], key_states.shape[1], key_states.shape[3])
        if got != expect:
            raise ValueError(
                f"states must have shape (batch={expect[0]}, kv_heads={expect[1]}, seq_len, "
                f"head_dim={expect[2]}) like those already cached (got "
                f"{tuple(key_states.shape)}); call reset() before changing shapes"
            )

    # ------------------------------------------------------------------ hooks

    def _prepare_keys(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        """Keys ``(batch, kv_heads, m, head_dim)`` of sequence positions ``start ..
        start + m - 1`` as the codec should see them (default: unchanged)."""
        return keys

    def _decode_keys_into(self, dst: torch.Tensor) -> None:
        """Write the encoded tokens' keys as attention reads them into ``dst`` ``(batch,
        kv_heads, n, head_dim)`` (a slice of the output): the codec's decode, then the inverse
        of :meth:`_prepare_keys` (default: the decode alone)."""
        self.quantizer.decode_keys(self.codes, out=dst)

    # ------------------------------------------------------------------ write

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(self.store_dtype)
        if not bool(torch.isfinite(y).all()) and bool(torch.isfinite(x).all()):
            raise ValueError(
                "cached states exceed the float16 range of the layer's full-precision tokens"
            )
        return y

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode ``(batch, kv_heads, m, head_dim)`` tokens (one block with a window)."""
        k = self._prepare_keys(k, self.sink_tokens + self.encoded_tokens)
        ck, qv = self.quantizer.encode_keys(k), self.quantizer.encode_values(v)
        if self.codes is None:
            self.codes, self.quantized_values = ck, qv
        else:
            self.codes = self.codes.cat(ck, dim=2)
            self.quantized_values = self.quantized_values.cat(qv, dim=2)
        self.encoded_tokens += k.shape[2]

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        k, v = self._store(key_states), self._store(value_states)
        if self.quantizer is None:
            self.window_keys = torch.cat([self.window_keys, k], dim=2)
            self.window_values = torch.cat([self.window_values, v], dim=2)
            return
        k, v = fill_sinks(self, k, v)
        if k.shape[2] == 0:
            return
        r = self.residual_length
        if r == 0:
            self._encode(k, v)
            return
        wk = torch.cat([self.window_keys, k], dim=2)
        wv = torch.cat([self.window_values, v], dim=2)
        full = wk.shape[2] // r
        for i in range(full):
            self._encode(wk[:, :, i * r : (i + 1) * r], wv[:, :, i * r : (i + 1) * r])
        self.window_keys = wk[:, :, full * r :].contiguous()
        self.window_values = wv[:, :, full * r :].contiguous()

    # ------------------------------------------------------------------ read

    def _read(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached past followed by the new states ``(batch, kv_heads, q, head_dim)``, each
        ``(batch, kv_heads, T + q, head_dim)`` in the new states' dtype, written part by part
        into one tensor."""
        s, n, r = self.sink_keys.shape[2], self.encoded_tokens, self.window_keys.shape[2]
        q = key_states.shape[2]
        shape = (self.batch_size, self.num_heads, s + n + r + q, self.head_dim)
        keys, values = key_states.new_empty(shape), value_states.new_empty(shape)
        keys[:, :, :s].copy_(self.sink_keys)
        values[:, :, :s].copy_(self.sink_values)
        if self.codes is not None:
            self._decode_keys_into(keys[:, :, s : s + n])
            self.quantizer.decode_values(self.quantized_values, out=values[:, :, s : s + n])
        keys[:, :, s + n : s + n + r].copy_(self.window_keys)
        values[:, :, s + n : s + n + r].copy_(self.window_values)
        keys[:, :, s + n + r :].copy_(key_states)
        values[:, :, s + n + r :].copy_(value_states)
        return keys, values

    def dequantized(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached tokens as attention reads them, keys and values ``(batch, kv_heads, T,
        head_dim)`` in ``dtype`` (default: the model's)."""
        if not self.is_initialized:
            raise ValueError("the layer holds no tokens yet")
        dtype = self.dtype if dtype is None else dtype
        empty = self.sink_keys.new_zeros(
            (self.batch_size, self.num_heads, 0, self.head_dim), dtype=dtype
        )
        return self._read(empty, empty)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the past (decoded) followed by the new states ``(batch, kv_heads, q,
        head_dim)`` as given, then store the new states.

        Returns:
            keys, values: ``(batch, kv_heads, T + q, head_dim)`` in the new states' dtype.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_states(key_states, value_states)
        if self.cumulative_length == 0:
            keys, values = key_states, value_states
        else:
            keys, values = self._read(key_states, value_states)
        self._append(key_states, value_states)
        self.cumulative_length += key_states.shape[2]
        return keys, values

    def reset(self) -> None:
        """Drop every stored token."""
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot crop (use a DynamicCache)")

    def _plain_tensors(self) -> tuple[str, ...]:
        return ("sink_keys", "sink_values", "window_keys", "window_values", *self.extra_tensors)

    def _select_rows(self, rows: Any) -> None:
        if not self.is_initialized:
            return
        rows = row_indices(rows, self.sink_keys.device)
        for name in self._plain_tensors():
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows).contiguous())
        if self.codes is not None:
            self.codes = self.codes.index_select(0, rows)
            self.quantized_values = self.quantized_values.index_select(0, rows)
        self.batch_size = rows.numel()

    def _map_device(self, device: Any) -> None:
        if not self.is_initialized:
            return
        for name in self._plain_tensors():
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        if self.codes is not None:
            self.codes = self.codes.to(device)
            self.quantized_values = self.quantized_values.to(device)

    # ------------------------------------------------------------------ bytes

    def nbytes(self) -> int:
        """Exact bytes held: sinks and window, the codec's keys and values, and the subclass's
        own tensors."""
        if not self.is_initialized:
            return 0
        total = 0
        for name in self._plain_tensors():
            t = getattr(self, name)
            if t is not None:
                total += t.nbytes
        if self.codes is not None:
            total += self.codes.nbytes + self.quantized_values.nbytes
        return total
