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

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlib import compat
from kvlib.caches.base import ByteCounts
from kvlib.caches.coded import CodedLayer
from kvlib.caches.sliding import SlidingWindowLayer
from kvlib.quant.presets import BOUNDARY_LAYERS  # vLLM's, with its presets (no torch there)
from kvlib.quant.turboquant import TurboQuantizer
from kvlib.specs import kv_geometry
from kvlib.validate import check_int

__all__ = ["BOUNDARY_LAYERS", "TurboQuantCache", "TurboQuantLayer"]


class TurboQuantLayer(CodedLayer):
    """One decoder layer of a TurboQuant cache (:class:`~kvlib.caches.coded.CodedLayer`'s
    ``[sinks | encoded tokens | window]``): ``codes`` are
    :class:`~kvlib.quant.turboquant.EncodedKeys`, ``quantized_values`` a
    :class:`~kvlib.quant.tensor.QuantizedTensor` (one scale and zero point per token and head,
    rows ``(batch, kv_heads, n)``); with ``center_keys``, ``key_means`` ``(batch, kv_heads,
    n // residual_length, head_dim)`` float16 holds each block's per-channel key mean,
    subtracted before encoding.

    ``residual_length=0`` encodes every token as it arrives (vLLM); otherwise tokens wait in the
    window until ``residual_length`` of them are encoded together (kvlib's KIVI layout).
    ``quantizer=None`` keeps every token in the storage dtype (vLLM's boundary layers).

    Args:
        quantizer: the codec, or ``None``.
        sink_tokens: first tokens kept in the storage dtype, >= 0.
        residual_length: the window, >= 0.
        center_keys: subtract each block's per-channel key mean (needs ``residual_length`` >= 1).
    """

    extra_tensors = ("key_means",)

    def __init__(
        self,
        quantizer: TurboQuantizer | None,
        sink_tokens: int = 0,
        residual_length: int = 0,
        center_keys: bool = False,
    ) -> None:
        if quantizer is not None and not isinstance(quantizer, TurboQuantizer):
            raise TypeError(
                f"quantizer must be a TurboQuantizer or None (got {type(quantizer).__name__})"
            )
        super().__init__(quantizer, sink_tokens, residual_length)
        if not isinstance(center_keys, bool):
            raise TypeError(f"center_keys must be a bool (got {center_keys!r})")
        if center_keys and self.residual_length == 0:
            raise ValueError(
                "center_keys subtracts each block's key mean: it needs residual_length >= 1"
            )
        self.center_keys = center_keys

    def _prepare_keys(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        if not self.center_keys:
            return keys
        mean = keys.float().mean(dim=2, keepdim=True).half()
        self.key_means = mean if self.key_means is None else torch.cat([self.key_means, mean], 2)
        return keys.float() - mean.float()

    def _decode_keys_into(self, dst: torch.Tensor) -> None:
        if self.key_means is None:
            super()._decode_keys_into(dst)
            return
        keys = self.quantizer.decode_keys(self.codes, torch.float32)
        b, h, n, d = keys.shape
        r = self.residual_length
        blocks = keys.view(b, h, n // r, r, d)
        means = self.key_means.float().unsqueeze(3)  # (batch, kv_heads, n // r, 1, head_dim)
        if dst.dtype == torch.float32:
            torch.add(blocks, means, out=dst.view(b, h, n // r, r, d))
        else:
            dst.copy_((blocks + means).view(b, h, n, d))


class TurboQuantCache(ByteCounts, Cache):
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
