"""A KVQuant cache for transformers' ``generate()``: pre-RoPE per-channel keys, per-token values,
non-uniform levels and a sparse table of outliers (:mod:`kvlib.quant.kvquant`), in kvlib's KIVI
layout.

Keys reach a cache after the model's rotary embedding. :class:`KVQuantLayer` turns each block of
keys back by its tokens' angles (:func:`kvlib.rope.undo_rope`, the model's RoPE computed from its
config by :func:`kvlib.rope.rope_from_config`), encodes the block per channel, and re-applies the
rotation after decoding; the tokens' positions are their places in the sequence (the cache is
filled from position 0, as ``generate()`` and :mod:`kvlib.eval.quality` fill it).

The layout is kvlib's KIVI caches' (``sink_tokens=4, residual_length=128``): the first tokens and
the newest (fewer than ``residual_length``) stay in float16 and tokens are encoded a block at a
time, so that a block's per-channel ranges, levels and outliers come from the block itself.
KVQuant proper calibrates its per-channel ranges and levels offline and encodes every token on
arrival; kvlib needs no calibration data and pays for it with the window and per-block metadata,
all counted by ``nbytes()``.

A hybrid model's sliding-window layers keep their window in float16
(:class:`kvlib.caches.sliding.SlidingWindowLayer`), as kvlib's other quantized caches do.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlib import compat
from kvlib.caches.base import ByteCounts
from kvlib.caches.coded import CodedLayer
from kvlib.caches.layout import RESIDUAL_LENGTH, SINK_TOKENS
from kvlib.caches.sliding import SlidingWindowLayer
from kvlib.quant.kvquant import KVQuantizer
from kvlib.quant.presets import OUTLIER_FRACTION
from kvlib.rope import rope_from_config, rotate_by, rotation_table
from kvlib.specs import kv_geometry
from kvlib.validate import check_int

__all__ = ["KVQuantCache", "KVQuantLayer"]


class KVQuantLayer(CodedLayer):
    """One decoder layer (:class:`~kvlib.caches.coded.CodedLayer`'s ``[sinks | encoded blocks |
    window]``) whose ``codes`` and ``quantized_values`` are
    :class:`~kvlib.quant.kvquant.SparseBlocks`, keys encoded with RoPE undone.

    Args:
        quantizer: the codec.
        inv_freq: ``(rot_dim // 2,)`` the model's rotary inverse frequencies, or ``None`` to
            encode post-RoPE keys as they come (an ablation).
        attention_scaling: the rotary embedding's scaling (1.0 for default RoPE).
        sink_tokens: first tokens kept in the storage dtype, >= 0.
        residual_length: tokens per encoded block and the float16 window, >= 1.
    """

    def __init__(
        self,
        quantizer: KVQuantizer,
        inv_freq: torch.Tensor | None,
        attention_scaling: float = 1.0,
        sink_tokens: int = SINK_TOKENS,
        residual_length: int = RESIDUAL_LENGTH,
    ) -> None:
        if not isinstance(quantizer, KVQuantizer):
            raise TypeError(f"quantizer must be a KVQuantizer (got {type(quantizer).__name__})")
        if inv_freq is not None and (
            not isinstance(inv_freq, torch.Tensor)
            or inv_freq.ndim != 1
            or not 0 < 2 * inv_freq.numel() <= quantizer.head_dim
        ):
            raise ValueError(
                f"inv_freq must be a 1-d tensor of at most head_dim/2 = "
                f"{quantizer.head_dim // 2} frequencies, or None"
            )
        super().__init__(quantizer, sink_tokens, residual_length)
        if self.residual_length == 0:
            raise ValueError("KVQuantLayer encodes whole blocks: residual_length must be >= 1")
        self.inv_freq = inv_freq
        self.attention_scaling = float(attention_scaling)

    def _table(self, start: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``(n, rot_dim)`` of positions ``start .. start + n - 1``, from a table
        the layer extends as the sequence grows (a constant of the model, like the rotation
        vLLM keeps per device; not counted in ``nbytes()``)."""
        have = 0 if self._cos is None else self._cos.shape[0]
        if start + n > have:
            pos = torch.arange(have, max(start + n, 2 * have), device=device)
            cos, sin = rotation_table(self.inv_freq, pos, device)
            self._cos = cos if self._cos is None else torch.cat([self._cos.to(device), cos])
            self._sin = sin if self._sin is None else torch.cat([self._sin.to(device), sin])
        return self._cos[start : start + n], self._sin[start : start + n]

    def _clear(self) -> None:
        super()._clear()
        self._cos = self._sin = None

    def _prepare_keys(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        if self.inv_freq is None:
            return keys
        cos, sin = self._table(start, keys.shape[2], keys.device)
        return rotate_by(keys.float(), cos, sin, self.attention_scaling, inverse=True)

    def _decode_keys_into(self, dst: torch.Tensor) -> None:
        if self.inv_freq is None:
            super()._decode_keys_into(dst)
            return
        keys = self.quantizer.decode_keys(self.codes, torch.float32)
        cos, sin = self._table(self.sink_tokens, keys.shape[2], keys.device)
        rotate_by(keys, cos, sin, self.attention_scaling, out=dst)


class KVQuantCache(ByteCounts, Cache):
    """A KVQuant cache for every layer of ``config``'s model (see the module docstring).

    Args:
        config: the model's transformers config.
        key_bits, value_bits: 2, 3 or 4.
        outlier_fraction: share of each block's keys and values kept exactly (KVQuant: 0.01).
        nuq: non-uniform levels fitted per block (else uniform).
        pre_rope: encode keys with RoPE undone (KVQuant); ``False`` encodes them as the model
            gives them.
        sink_tokens, residual_length: :class:`KVQuantLayer`'s (kvlib's KIVI defaults, 4 and 128).

    Raises:
        TypeError / ValueError: not a transformers config, unsupported layer types or RoPE, bad
            bits or options.
    """

    def __init__(
        self,
        config: Any,
        key_bits: int = 3,
        value_bits: int = 3,
        *,
        outlier_fraction: float = OUTLIER_FRACTION,
        nuq: bool = True,
        pre_rope: bool = True,
        sink_tokens: int = SINK_TOKENS,
        residual_length: int = RESIDUAL_LENGTH,
    ) -> None:
        if not hasattr(config, "get_text_config"):
            raise TypeError(
                f"config must be a transformers PretrainedConfig (got {type(config).__name__})"
            )
        if not isinstance(pre_rope, bool):
            raise TypeError(f"pre_rope must be a bool (got {pre_rope!r})")
        text = config.get_text_config(decoder=True)
        head_dim = kv_geometry(text).head_dim
        self.quantizer = KVQuantizer(
            head_dim, key_bits, value_bits, outlier_fraction=outlier_fraction, nuq=nuq
        )
        residual_length = check_int(residual_length, "residual_length", minimum=1)
        inv_freq, scaling = rope_from_config(text, "full_attention") if pre_rope else (None, 1.0)
        self.pre_rope = pre_rope
        self.sink_tokens, self.residual_length = sink_tokens, residual_length
        windows = compat.layer_windows(config, "KVQuantCache")
        layers: list[CacheLayerMixin] = []
        for window in windows:
            if window is not None:
                layers.append(SlidingWindowLayer(window, None, fp16_if_wider=True))
            else:
                layers.append(
                    KVQuantLayer(self.quantizer, inv_freq, scaling, sink_tokens, residual_length)
                )
        super().__init__(layers=layers)

    def __repr__(self) -> str:
        q = self.quantizer
        return (
            f"KVQuantCache(key_bits={q.key_bits}, value_bits={q.value_bits}, outlier_fraction="
            f"{q.outlier_fraction}, nuq={q.nuq}, pre_rope={self.pre_rope}, sink_tokens="
            f"{self.sink_tokens}, residual_length={self.residual_length}, layers="
            f"{len(self.layers)}, tokens={self.get_seq_length()})"
        )
