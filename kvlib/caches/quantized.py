"""A KIVI-style quantized KV cache that plugs into transformers' ``generate()`` (notebook 04).

:class:`QuantizedKVCache` is a transformers ``Cache`` made of one :class:`QuantizedKVLayer`
(a ``CacheLayerMixin``) per decoder layer, so ``kvlib.compat.generate(model, ids,
cache=QuantizedKVCache(model.config))`` and a plain forward loop (``kvlib.compat.forward``,
``kvlib.eval.quality.perplexity``) both use it unchanged.

Layout of one layer, tensors in the transformers convention ``(batch, kv_heads, seq_len,
head_dim)``, tokens in order::

    [ sinks | block 0 | block 1 | ... | residual window ]
      full    quantized, residual_length tokens each     full precision, < residual_length

* **sinks** — the first ``sink_tokens`` tokens, kept in full precision (attention sinks: the
  first tokens draw a large share of attention and are cheap to keep exact).
* **blocks** — every ``residual_length`` tokens after the sinks form a block that is quantized
  ONCE, from the full-precision window, the moment it fills; it is never re-quantized (unlike
  transformers' ``QuantizedCache``, which re-quantizes its dequantized states at every flush).
  Keys are quantized **per channel** (KIVI's recipe for keys, whose outliers live in fixed
  channels): one scale and zero point per (batch, head, channel) for every ``key_group_size``
  tokens of the block; values **per token** in groups of ``group_size`` channels along
  head_dim. Storage is real: bit-packed codes plus float16 scales
  and zero points (:class:`kvlib.quant.tensor.QuantizedTensor`).
* **residual window** — the most recent tokens (fewer than ``residual_length``), full
  precision, waiting for their block to fill.

"Full precision" (sinks and window) is held in ``window_dtype``: by default the model's dtype
when it is a 16-bit float, and float16 when the model runs in float32/float64 (the bundled
model on CPU). That is what an fp16 deployment would hold, and what the byte ratios against an
fp16 DynamicCache assume; the float16 rounding (relative 2**-11) is 1/8 of an int8 step.
Pass ``window_dtype=torch.float32`` to keep a float32 model's window exact (at twice its bytes).

Reading (every ``update``) dequantizes all blocks of a layer in one vectorised pass, straight
into the output tensor in the model's dtype; no dequantized copy is kept between steps, so
``nbytes()`` is exactly the packed codes + scales + zero points + sinks + window (+ the one
shared Hadamard matrix when ``rotate=True``). The tokens passed to ``update`` are returned
as given (they are attended to in full precision in the step that produces them, as in KIVI
and transformers' QuantizedCache) and stored afterwards.

Defaults, chosen from measurements on the bundled model (benchmarks/RESULTS.md, "Choosing the
defaults"; the error is almost all in the keys: int4 values with int8 keys cost nothing):

* ``key_group_size``: 32 tokens at 2-4 bits (halves the int4 key error of one group per
  128-token block), the whole block at 8 bits (where finer groups would cost more metadata than
  the int8 byte target allows);
* ``group_size``: the largest divisor of head_dim up to 64 (one value group per token here);
* ``rotate``: on at 2 and 3 bits, off at 4 and 8 (at 4 bits it did not change the mean
  perplexity over four 2048-token segments, and it slows decoding).

Rotation (``rotate=True``): the keys of a block are multiplied by an orthonormal Hadamard
matrix ``H`` along head_dim before quantizing (an outlier channel is spread over all channels),
and the dequantized block is rotated back (``@ H.T``) on read. Values are not rotated: their
per-token groups do not suffer from channel outliers, and rotating them measured worse (int4:
+0.32 % perplexity with values rotated too vs +0.10 % keys only). We rotate back rather than
rotating the queries because a cache cannot reach the queries; the price is one
(head_dim x head_dim) matmul over the quantized keys per read, which makes rotated decoding
slower (see benchmarks/RESULTS.md).

Fused decoding (``fused_decode``, notebook 10): on CUDA, a single-token decode step does not
dequantize at all. ``update`` returns the new token's states tagged with the layer's packed
state, and the attention function :mod:`kvlib.kernels.fused_attention` registers (``"kvlib_fused"``,
sdpa for everything else; a model on ``"sdpa"`` is switched to it on the first fused step)
runs the Triton kernel of :mod:`kvlib.kernels.decode` over the codes, unpacking them in registers and
rotating the query instead of the keys. Prefill, CPU tensors, models on eager/flash/flex
attention and ``fused_decode=False`` take the torch path above.

Hybrid models (Gemma 2/3: sliding-window layers between global ones): only the
``"full_attention"`` layers are quantized as above. A ``"sliding_attention"`` layer is a
:class:`kvlib.caches.sliding.SlidingWindowLayer`: its last ``sliding_window`` tokens in
``window_dtype``, nothing quantized (a window of a few hundred tokens is small, and all of it is
read at every step), so ``nbytes()`` counts ``min(T, sliding_window)`` full-precision tokens
there, as :mod:`kvlib.memory` does (:func:`kvlib.memory.quantized_cache_bytes` predicts the
whole cache byte for byte).

Limits: ``"full_attention"`` and ``"sliding_attention"`` layers only (chunked,
linear-attention or shared layers raise ``ValueError``); no ``crop`` (assisted decoding);
float16 scales fall back to float32 per quantized block where float16 cannot hold them (see
:mod:`kvlib.quant.tensor`; the byte prediction then falls short by their extra bytes).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlib import compat
from kvlib.caches.base import ByteCounts
from kvlib.caches.layout import (
    RESIDUAL_LENGTH,
    SINK_TOKENS,
    default_group_size,
    default_key_group_size,
    default_rotate,
)
from kvlib.caches.quantized_layer import (
    QuantizedKVLayer,
    check_fused_decode,
    check_group_size,
    check_key_group_size,
    check_window_dtype,
)
from kvlib.caches.sliding import SlidingWindowLayer
from kvlib.kernels.fused_attention import FusedStep
from kvlib.quant.rotation import hadamard
from kvlib.specs import kv_geometry
from kvlib.validate import check_bits, check_int

__all__ = [
    "QuantizedKVCache",
    "QuantizedKVLayer",
    "default_group_size",
    "default_key_group_size",
    "default_rotate",
]

# The defaults live in kvlib.caches.layout (no torch there: the planner reads them too).


class QuantizedKVCache(ByteCounts, Cache):
    """KIVI-style quantized KV cache for transformers models (see the module docstring).

    Args:
        config: the model's config (a transformers ``PretrainedConfig``); every decoder layer
            must be ``"full_attention"`` (quantized) or ``"sliding_attention"`` (its window
            kept in ``window_dtype``, see the module docstring).
        bits: bits per key and value code, one of 2, 3, 4, 8.
        key_bits, value_bits: override ``bits`` for keys or values.
        group_size: channels per value group (per-token quantization); must divide head_dim.
            ``None``: the largest divisor of head_dim up to 64.
        residual_length: tokens per quantized block, and the most tokens kept in the
            full-precision window (>= 1).
        sink_tokens: first tokens kept in full precision (>= 0).
        rotate: Hadamard-rotate head_dim of the keys before quantizing (head_dim must be a
            power of two); undone on read. ``None``: on at 2 and 3 key bits when head_dim is a
            power of two, off otherwise.
        window_dtype: dtype of the sinks and window; ``None``: the model's dtype if 16-bit,
            else float16.
        key_group_size: tokens per key scale group inside a block; must divide
            ``residual_length``. ``None``: ``gcd(32, residual_length)`` at 2-4 key bits, the
            whole block at 8.
        fused_decode: single-token decode steps attend with the fused Triton kernel
            (:mod:`kvlib.kernels.decode`) instead of dequantizing: ``None`` (auto) on CUDA when triton
            is installed and the model runs sdpa (switched to ``"kvlib_fused"``) or
            ``"kvlib_fused"`` attention; ``True`` also on CPU tensors in Triton's interpreter
            (tests), raising where it cannot run; ``False``: never.

    Raises:
        ValueError / TypeError: unsupported layer types, bits, group sizes or lengths.
    """

    def __init__(
        self,
        config: Any,
        bits: int = 4,
        *,
        key_bits: int | None = None,
        value_bits: int | None = None,
        group_size: int | None = None,
        residual_length: int = RESIDUAL_LENGTH,
        sink_tokens: int = SINK_TOKENS,
        rotate: bool | None = None,
        window_dtype: torch.dtype | None = None,
        key_group_size: int | None = None,
        fused_decode: bool | None = None,
    ) -> None:
        if not hasattr(config, "get_text_config"):
            raise TypeError(
                f"config must be a transformers PretrainedConfig (got {type(config).__name__})"
            )
        check_bits(bits, "bits")
        key_bits = bits if key_bits is None else check_bits(key_bits, "key_bits")
        value_bits = bits if value_bits is None else check_bits(value_bits, "value_bits")
        text = config.get_text_config(decoder=True)
        head_dim = kv_geometry(text).head_dim
        group_size = check_group_size(
            default_group_size(head_dim) if group_size is None else group_size, head_dim
        )
        check_int(residual_length, "residual_length", minimum=1)
        check_int(sink_tokens, "sink_tokens", minimum=0)
        key_group_size = check_key_group_size(key_group_size, residual_length, key_bits)
        if (residual_length * head_dim) % 8:
            raise ValueError(
                f"residual_length * head_dim must be a multiple of 8 so that a block's packed "
                f"codes fill whole bytes (got {residual_length} * {head_dim})"
            )
        if rotate is None:
            rotate = default_rotate(key_bits, head_dim)
        if not isinstance(rotate, bool):
            raise TypeError(f"rotate must be a bool or None (got {rotate!r})")
        if rotate and (head_dim & (head_dim - 1)):
            raise ValueError(
                f"rotate=True needs head_dim to be a power of two (got head_dim {head_dim})"
            )
        windows = compat.layer_windows(config, "QuantizedKVCache")
        self.bits, self.key_bits, self.value_bits = bits, key_bits, value_bits
        self.group_size, self.residual_length = group_size, residual_length
        self.key_group_size = key_group_size
        self.sink_tokens, self.rotate, self.head_dim = sink_tokens, rotate, head_dim
        self.rotation = hadamard(head_dim) if rotate else None
        check_window_dtype(window_dtype)
        layers: list[CacheLayerMixin] = [
            QuantizedKVLayer(
                key_bits,
                value_bits,
                group_size,
                residual_length,
                sink_tokens,
                rotation=self.rotation,
                window_dtype=window_dtype,
                key_group_size=key_group_size,
                fused_decode=check_fused_decode(fused_decode),
            )
            if window is None
            else SlidingWindowLayer(window, window_dtype, fp16_if_wider=True)
            for window in windows
        ]
        self.fused_decode = fused_decode
        last_step: list[FusedStep | None] = [None]
        for layer in layers:
            if isinstance(layer, QuantizedKVLayer):
                layer.config, layer._last_step = text, last_step
        super().__init__(layers=layers)

    def __repr__(self) -> str:
        bits = (
            f"bits={self.bits}"
            if self.key_bits == self.value_bits
            else f"key_bits={self.key_bits}, value_bits={self.value_bits}"
        )
        return (
            f"QuantizedKVCache({bits}, group_size={self.group_size}, key_group_size="
            f"{self.key_group_size}, residual_length={self.residual_length}, sink_tokens={self.sink_tokens}, rotate={self.rotate}, "
            f"layers={len(self.layers)}, tokens={self.get_seq_length()})"
        )

    def nbytes(self) -> int:
        """Exact bytes held by all layers (codes, scales, zero points, sinks, windows), plus
        the shared Hadamard matrix when ``rotate=True``."""
        total = super().nbytes()
        if self.rotation is not None:
            total += self.rotation.numel() * self.rotation.element_size()
        return total
