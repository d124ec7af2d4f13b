"""A TurboQuant KV cache for transformers' ``generate()``: vLLM 0.32's layout, and kvlib's.

Keys are encoded by :class:`kvlib.quant.turboquant.TurboQuantizer` (a norm and the codebook
indices of the rotated direction; or float8), values with one scale and zero point per token.
As in kvlib's other caches, the tokens passed to ``update`` are returned as given for their own
step (a prefill attends to itself in full precision, as vLLM's prefill does) and read back
decoded from then on.

**vLLM's layout** (the defaults): every token is encoded as it arrives, with no
full-precision window; the first and last two layers of a dense model stay in the model's
dtype (``boundary_layers=2``; float16 here when the model computes in float32), and every
layer of a hybrid model is quantized.

**kvlib's layout** (``sink_tokens=4, residual_length=128``, the KIVI caches' defaults): the
first tokens and the newest (fewer than ``residual_length``) stay in float16, and tokens are
encoded a block at a time; ``center_keys=True`` subtracts each block's per-channel key mean
before encoding (kept in float16, ``head_dim`` values per block): a model whose keys sit off
zero in some channels (SmolLM2's do) otherwise spends the codebook, built for zero-mean
coordinates, on that offset.

A hybrid model's sliding-window layers keep their window in float16
(:class:`kvlib.caches.sliding.SlidingWindowLayer`), as kvlib's quantized caches do.

``nbytes()`` counts every tensor held: codes, norms, block means, value scales and zero points,
sinks, windows and the boundary layers' keys and values (the rotation and the codebook are
constants of the method, shared by every sequence, and not counted: vLLM holds them once per
device).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlib import compat
from kvlib.caches.base import BatchRows, check_states, row_indices
from kvlib.caches.sliding import SlidingWindowLayer
from kvlib.quant.tensor import QuantizedTensor
from kvlib.quant.turboquant import EncodedKeys, TurboQuantizer
from kvlib.specs import kv_geometry
from kvlib.validate import check_int

__all__ = ["BOUNDARY_LAYERS", "TurboQuantCache", "TurboQuantLayer"]

#: Layers at each end of a dense model that vLLM keeps in the model's dtype.
BOUNDARY_LAYERS = 2


class TurboQuantLayer(BatchRows, CacheLayerMixin):
    """One decoder layer, ``[sinks | encoded tokens | window]`` along the sequence:

    * ``sink_keys`` / ``sink_values``: the first ``sink_tokens`` tokens, ``(batch, kv_heads, s,
      head_dim)`` in the storage dtype (the model's; float16 for a float32/float64 model);
    * ``codes`` (:class:`~kvlib.quant.turboquant.EncodedKeys`) and ``quantized_values`` (a
      :class:`~kvlib.quant.tensor.QuantizedTensor`, one scale and zero point per token and
      head, rows ``(batch, kv_heads, n)``), both for ``(batch, kv_heads, n, head_dim)``;
      ``key_means`` ``(batch, kv_heads, n // residual_length, head_dim)`` float16 with
      ``center_keys``: each block's per-channel key mean, subtracted before encoding;
    * ``window_keys`` / ``window_values``: the newest tokens not yet encoded (fewer than
      ``residual_length``) in the storage dtype.

    ``residual_length=0`` encodes every token as it arrives (vLLM); otherwise tokens wait in the
    window until ``residual_length`` of them are encoded together (kvlib's KIVI layout).
    ``quantizer=None`` keeps every token in the storage dtype (vLLM's boundary layers).

    Args:
        quantizer: the codec, or ``None``.
        sink_tokens: first tokens kept in the storage dtype, >= 0.
        residual_length: the window, >= 0.
        center_keys: subtract each block's per-channel key mean (needs ``residual_length`` >= 1).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        quantizer: TurboQuantizer | None,
        sink_tokens: int = 0,
        residual_length: int = 0,
        center_keys: bool = False,
    ) -> None:
        super().__init__()
        if quantizer is not None and not isinstance(quantizer, TurboQuantizer):
            raise TypeError(
                f"quantizer must be a TurboQuantizer or None (got {type(quantizer).__name__})"
            )
        self.quantizer = quantizer
        self.sink_tokens = check_int(sink_tokens, "sink_tokens", minimum=0)
        self.residual_length = check_int(residual_length, "residual_length", minimum=0)
        if not isinstance(center_keys, bool):
            raise TypeError(f"center_keys must be a bool (got {center_keys!r})")
        if center_keys and self.residual_length == 0:
            raise ValueError(
                "center_keys subtracts each block's key mean: it needs residual_length >= 1"
            )
        self.center_keys = center_keys
        self._clear()

    def _clear(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length = 0
        self.sink_keys = self.sink_values = None
        self.window_keys = self.window_values = None
        self.codes: EncodedKeys | None = None
        self.quantized_values: QuantizedTensor | None = None
        self.key_means: torch.Tensor | None = None

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

    # ------------------------------------------------------------------ write

    def _store(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(self.store_dtype)
        if not bool(torch.isfinite(y).all()) and bool(torch.isfinite(x).all()):
            raise ValueError(
                "cached states exceed the float16 range of the layer's full-precision tokens"
            )
        return y

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode ``(batch, kv_heads, m, head_dim)`` tokens (one block when centring)."""
        if self.center_keys:
            mean = k.float().mean(dim=2, keepdim=True).half()
            k = k.float() - mean.float()
            self.key_means = (
                mean if self.key_means is None else torch.cat([self.key_means, mean], 2)
            )
        ck, qv = self.quantizer.encode_keys(k), self.quantizer.encode_values(v)
        if self.codes is None:
            self.codes, self.quantized_values = ck, qv
        else:
            self.codes = self.codes.cat(ck, dim=2)
            self.quantized_values = self.quantized_values.cat(qv, dim=2)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        k, v = self._store(key_states), self._store(value_states)
        if self.quantizer is None:
            self.window_keys = torch.cat([self.window_keys, k], dim=2)
            self.window_values = torch.cat([self.window_values, v], dim=2)
            return
        have = self.sink_keys.shape[2]
        if have < self.sink_tokens:
            take = min(self.sink_tokens - have, k.shape[2])
            self.sink_keys = torch.cat([self.sink_keys, k[:, :, :take]], dim=2)
            self.sink_values = torch.cat([self.sink_values, v[:, :, :take]], dim=2)
            k, v = k[:, :, take:], v[:, :, take:]
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

    def dequantized(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached tokens as attention reads them, keys and values ``(batch, kv_heads, T,
        head_dim)`` in ``dtype`` (default: the model's)."""
        if not self.is_initialized:
            raise ValueError("the layer holds no tokens yet")
        dtype = self.dtype if dtype is None else dtype
        keys, values = [self.sink_keys.to(dtype)], [self.sink_values.to(dtype)]
        if self.codes is not None:
            k = self.quantizer.decode_keys(self.codes, torch.float32)
            if self.key_means is not None:
                k = k + self.key_means.float().repeat_interleave(self.residual_length, dim=2)
            keys.append(k.to(dtype))
            values.append(self.quantizer.decode_values(self.quantized_values, dtype))
        keys.append(self.window_keys.to(dtype))
        values.append(self.window_values.to(dtype))
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

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
            past_k, past_v = self.dequantized(key_states.dtype)
            keys = torch.cat([past_k, key_states], dim=2)
            values = torch.cat([past_v, value_states], dim=2)
        self._append(key_states, value_states)
        self.cumulative_length += key_states.shape[2]
        return keys, values

    def get_seq_length(self) -> int:
        """Number of tokens cached."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: every cached token is returned."""
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        """No maximum (-1)."""
        return -1

    def reset(self) -> None:
        """Drop every stored token."""
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("TurboQuantCache cannot crop (use a DynamicCache)")

    def _select_rows(self, rows: Any) -> None:
        if not self.is_initialized:
            return
        rows = row_indices(rows, self.sink_keys.device)
        for name in ("sink_keys", "sink_values", "window_keys", "window_values", "key_means"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows).contiguous())
        if self.codes is not None:
            self.codes = self.codes.index_select(0, rows)
            self.quantized_values = self.quantized_values.index_select(0, rows)
        self.batch_size = rows.numel()

    def offload(self) -> None:
        """Move the stored tokens to the CPU."""
        self._map_device("cpu")

    def prefetch(self) -> None:
        """Move the stored tokens back to the layer's device."""
        if self.is_initialized:
            self._map_device(self.device)

    def _map_device(self, device: Any) -> None:
        if not self.is_initialized:
            return
        for name in ("sink_keys", "sink_values", "window_keys", "window_values", "key_means"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        if self.codes is not None:
            self.codes = self.codes.to(device)
            self.quantized_values = self.quantized_values.to(device)

    # ------------------------------------------------------------------ bytes

    def nbytes(self) -> int:
        """Exact bytes held: sinks and window, key codes and norms, block key means, value
        codes, scales and zero points."""
        if not self.is_initialized:
            return 0
        plain = (self.sink_keys, self.sink_values, self.window_keys, self.window_values)
        total = sum(t.nbytes for t in plain)
        if self.key_means is not None:
            total += self.key_means.nbytes
        if self.codes is not None:
            total += self.codes.nbytes + self.quantized_values.nbytes
        return total

    def fp16_nbytes(self) -> int:
        """Bytes an fp16 DynamicCache layer would hold for the same tokens."""
        if not self.is_initialized:
            return 0
        return 2 * self.batch_size * self.num_heads * self.cumulative_length * self.head_dim * 2


class TurboQuantCache(Cache):
    """A TurboQuant cache for every layer of ``config``'s model (see the module docstring).

    Args:
        config: the model's transformers config.
        key_bits: 2, 3, 4 (codebook) or 8 (float8 keys).
        value_bits: 2, 3, 4 or 8.
        boundary_layers: layers at each end kept in the model's dtype; ``None`` (default):
            vLLM's choice, :data:`BOUNDARY_LAYERS` on a dense model (so a model of four layers
            or fewer keeps every layer in its dtype, as vLLM does) and 0 on a hybrid one; a
            number given explicitly must leave at least one layer to quantize.
        sink_tokens, residual_length, center_keys: :class:`TurboQuantLayer`'s (vLLM: 0, 0,
            ``False``; kvlib's KIVI caches keep 4 sinks and a 128-token window).
        rotation, codebook, norm_correction, seed: :class:`~kvlib.quant.turboquant.
            TurboQuantizer`'s (vLLM: ``"hadamard"``, ``"gaussian"``, ``True`` below 8 bits).

    Raises:
        TypeError / ValueError: not a transformers config, unsupported layer types, bad bits or
            options, or more boundary layers than the model has.
    """

    def __init__(
        self,
        config: Any,
        key_bits: int = 4,
        value_bits: int = 4,
        *,
        boundary_layers: int | None = None,
        sink_tokens: int = 0,
        residual_length: int = 0,
        center_keys: bool = False,
        rotation: str = "hadamard",
        codebook: str = "gaussian",
        norm_correction: bool | None = None,
        seed: int = 0,
    ) -> None:
        if not hasattr(config, "get_text_config"):
            raise TypeError(
                f"config must be a transformers PretrainedConfig (got {type(config).__name__})"
            )
        text = config.get_text_config(decoder=True)
        head_dim = kv_geometry(text).head_dim
        if norm_correction is None:
            norm_correction = key_bits != 8
        self.quantizer = TurboQuantizer(
            head_dim,
            key_bits,
            value_bits,
            rotation=rotation,
            codebook=codebook,
            norm_correction=norm_correction,
            seed=seed,
        )
        windows = compat.layer_windows(config, "TurboQuantCache")
        hybrid = any(w is not None for w in windows)
        if boundary_layers is None:  # vLLM's rule: on a model of 4 layers or fewer, all of them
            boundary_layers = 0 if hybrid else BOUNDARY_LAYERS
        elif 2 * check_int(boundary_layers, "boundary_layers", minimum=0) >= len(windows):
            raise ValueError(
                f"boundary_layers={boundary_layers} at each end leaves none of the "
                f"{len(windows)} layers to quantize"
            )
        self.boundary_layers = boundary_layers
        self.sink_tokens, self.residual_length = sink_tokens, residual_length
        self.center_keys = center_keys
        TurboQuantLayer(self.quantizer, sink_tokens, residual_length, center_keys)  # checks
        n = len(windows)
        layers: list[CacheLayerMixin] = []
        for i, window in enumerate(windows):
            if window is not None:
                layers.append(SlidingWindowLayer(window, None, fp16_if_wider=True))
            elif i < boundary_layers or i >= n - boundary_layers:
                layers.append(TurboQuantLayer(None))
            else:
                layers.append(
                    TurboQuantLayer(self.quantizer, sink_tokens, residual_length, center_keys)
                )
        super().__init__(layers=layers)

    def __repr__(self) -> str:
        q = self.quantizer
        return (
            f"TurboQuantCache(key_bits={q.key_bits}, value_bits={q.value_bits}, rotation="
            f"{q.rotation_kind!r}, codebook={q.codebook_kind!r}, norm_correction="
            f"{q.norm_correction}, boundary_layers={self.boundary_layers}, sink_tokens="
            f"{self.sink_tokens}, residual_length={self.residual_length}, center_keys="
            f"{self.center_keys}, layers="
            f"{len(self.layers)}, tokens={self.get_seq_length()})"
        )

    def nbytes(self) -> int:
        """Exact bytes held by all layers (:func:`kvlib.compat.layer_nbytes`)."""
        return sum(compat.layer_nbytes(layer) for layer in self.layers)

    def fp16_nbytes(self) -> int:
        """Bytes an fp16 DynamicCache would hold for the same tokens."""
        return sum(layer.fp16_nbytes() for layer in self.layers)

    def compression_ratio(self) -> float:
        """``fp16_nbytes() / nbytes()`` (``nan`` while empty)."""
        n = self.nbytes()
        return self.fp16_nbytes() / n if n else math.nan
