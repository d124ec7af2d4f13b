"""KV-cache quantization *recipes*: how one layer's keys and values are stored (notebook 03).

A :class:`KVRecipe` names the choices the literature converged on: bits, the axis each of keys
and values is quantized over (per-channel keys and per-token values is KIVI's recipe), group
sizes, a Hadamard rotation of head_dim (:func:`kvlib.quant.tensor.hadamard`), and float16 windows for
the first tokens ("attention sinks") and the newest ones (the residual window).
:func:`quantize_kv` applies a recipe to one layer's keys and values
``(batch, kv_heads, seq_len, head_dim)`` and returns a :class:`QuantizedKV`: the
reconstructions and the real bytes kept. :func:`kvlib.eval.capture.evaluate_recipes` judges recipes
by attention-output error; :class:`kvlib.caches.quantized.QuantizedKVCache` is the KIVI recipe as a cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlib.quant.rotation import hadamard, rotate, unrotate
from kvlib.quant.tensor import StorageCost, quantize
from kvlib.validate import CODE_BITS, check_bits

__all__ = ["KVRecipe", "QuantizedKV", "quantize_kv"]

_RECIPE_AXES = (None, -1, -2)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class KVRecipe:
    """How one layer's keys and values are stored: a quantization *recipe* (notebook 03).

    Tokens are split along ``seq_len`` into three windows: the first ``sinks`` tokens
    ("attention sinks") and the last ``residual`` tokens are kept in float16; the tokens between
    them are quantized to ``bits`` bits. ``key_axis`` / ``value_axis`` name the axis the
    statistics are reduced over, as in :func:`kvlib.quant.tensor.quantize` for a ``(batch, kv_heads,
    seq_len, head_dim)`` tensor: ``-2`` per-channel (over tokens), ``-1`` per-token (over head_dim),
    ``None`` per-tensor (one scale for the layer's whole tensor, all heads mixed).
    ``key_group_size`` / ``value_group_size`` split the reduced axis into groups. Where a
    per-channel group runs along the tokens, the quantized window is trimmed to a whole number
    of groups and the leftover tokens join the float16 residual window — as KIVI keeps the
    not-yet-full group in full precision. ``rotate`` multiplies head_dim by an orthonormal
    Hadamard matrix (:func:`kvlib.quant.tensor.hadamard`) before quantizing and rotates back after;
    ``rotate_values=False`` rotates the keys only, as kvlib's eviction caches do.
    ``bits=16`` stores everything in float16 (the baseline).

    The KIVI recipe (Liu et al., 2024) is ``KVRecipe(bits, key_axis=-2, value_axis=-1,
    key_group_size=32, residual=128)``; naive per-token is ``KVRecipe(bits, key_axis=-1,
    value_axis=-1)``.
    """

    bits: int = 4
    key_axis: int | None = -2
    value_axis: int | None = -1
    key_group_size: int | None = None
    value_group_size: int | None = None
    symmetric: bool = False
    residual: int = 0
    sinks: int = 0
    rotate: bool = False
    rotate_values: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        check_bits(self.bits, "bits", (*CODE_BITS, 16))
        for field in ("key_axis", "value_axis"):
            axis = getattr(self, field)
            if isinstance(axis, bool) or axis not in _RECIPE_AXES:
                raise ValueError(
                    f"{field} must be -2 (per-channel), -1 (per-token) or None (per-tensor) "
                    f"(got {axis!r})"
                )
        for field in ("key_group_size", "value_group_size"):
            g = getattr(self, field)
            if g is None:
                continue
            if isinstance(g, bool) or not isinstance(g, int) or g <= 0:
                raise ValueError(f"{field} must be a positive int or None (got {g!r})")
            if getattr(self, field.replace("group_size", "axis")) is None:
                raise ValueError(f"{field} needs a key/value axis (per-tensor has no groups)")
        for field in ("rotate", "rotate_values"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be True or False (got {getattr(self, field)!r})")
        for field in ("residual", "sinks"):
            n = getattr(self, field)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{field} must be a non-negative int (got {n!r})")

    @property
    def label(self) -> str:
        """``name`` if given, else a short description such as ``"K/ch V/tok 4b r128"``."""
        if self.name:
            return self.name
        if self.bits == 16:
            return "fp16"
        axes = {None: "tensor", -1: "tok", -2: "ch"}
        parts = [f"K/{axes[self.key_axis]}", f"V/{axes[self.value_axis]}", f"{self.bits}b"]
        if self.rotate:
            parts.append("H" if self.rotate_values else "HK")
        if self.sinks:
            parts.append(f"s{self.sinks}")
        if self.residual:
            parts.append(f"r{self.residual}")
        return " ".join(parts)


@dataclass(frozen=True)
class QuantizedKV(StorageCost):
    """One layer's keys and values after a :class:`KVRecipe`: reconstructions and real bytes.

    ``keys`` / ``values`` have the input shape ``(batch, kv_heads, seq_len, head_dim)`` and
    dtype; ``nbytes`` counts packed codes, every scale and zero point, and the float16 windows.
    """

    keys: torch.Tensor
    values: torch.Tensor
    nbytes: int
    numel: int
    fp16_tokens: int


def _token_group(recipe: KVRecipe) -> int:
    """The number of tokens the quantized window must be a multiple of."""
    g = 1
    for axis, gs in (
        (recipe.key_axis, recipe.key_group_size),
        (recipe.value_axis, recipe.value_group_size),
    ):
        if axis == -2 and gs is not None:
            g = math.lcm(g, gs)
    return g


def _quantize_window(
    x: torch.Tensor, recipe: KVRecipe, axis: int | None, group_size: int | None, turn: bool
) -> tuple[torch.Tensor, int]:
    """Quantize + dequantize ``x`` (b, h, n, d) per the recipe, Hadamard-rotated when ``turn``;
    (reconstruction, bytes)."""
    h = hadamard(x.shape[-1], dtype=torch.float32, device=x.device) if turn else None
    work = rotate(x, h) if h is not None else x
    if axis is None:
        q = quantize(work.reshape(-1), recipe.bits, axis=0, symmetric=recipe.symmetric)
    else:
        q = quantize(
            work, recipe.bits, axis=axis, group_size=group_size, symmetric=recipe.symmetric
        )
    y = q.dequantize(torch.float32 if h is not None else None).view(x.shape)
    if h is not None:
        y = unrotate(y, h).to(x.dtype)
    return y, q.nbytes


def quantize_kv(keys: torch.Tensor, values: torch.Tensor, recipe: KVRecipe) -> QuantizedKV:
    """Store one layer's ``keys`` and ``values`` ``(batch, kv_heads, seq_len, head_dim)`` per
    ``recipe`` and return their reconstructions and the real bytes kept (see :class:`KVRecipe`).

    Introduced in notebook 03. The float16 windows are reconstructed as the float16 values
    (what a float16 cache holds); everything is computed with :func:`kvlib.quant.tensor.quantize`.
    """
    if not isinstance(recipe, KVRecipe):
        raise TypeError(f"recipe must be a KVRecipe (got {type(recipe).__name__})")
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4-d tensor (batch, kv_heads, seq_len, head_dim)")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{name} must be a floating-point tensor (float32, float16, bfloat16 or float64), "
                f"got {t.dtype}"
            )
        if t.numel() == 0:
            raise ValueError(f"{name} must not be empty (got shape {tuple(t.shape)})")
    if keys.shape != values.shape:
        raise ValueError(
            f"keys and values must have the same shape (got {tuple(keys.shape)} and "
            f"{tuple(values.shape)})"
        )
    if recipe.rotate and keys.shape[-1] & (keys.shape[-1] - 1):
        raise ValueError(f"rotate needs a power-of-two head_dim (got {keys.shape[-1]})")
    seq = keys.shape[2]
    start = min(recipe.sinks, seq)
    end = max(start, seq - recipe.residual)
    if recipe.bits == 16:
        end = start
    end -= (end - start) % _token_group(recipe)
    numel = 2 * keys.numel()
    fp16_tokens = seq - (end - start)
    per_token_fp16 = keys.shape[0] * keys.shape[1] * keys.shape[3] * 2  # bytes, one tensor

    nbytes = 2 * fp16_tokens * per_token_fp16
    outs = []
    for x, axis, gs, turn in (
        (keys, recipe.key_axis, recipe.key_group_size, recipe.rotate),
        (
            values,
            recipe.value_axis,
            recipe.value_group_size,
            recipe.rotate and recipe.rotate_values,
        ),
    ):
        y = x.to(torch.float16, copy=True).to(x.dtype)  # the float16 windows (a copy)
        if end > start:
            mid, n = _quantize_window(x[:, :, start:end], recipe, axis, gs, turn)
            y[:, :, start:end] = mid
            nbytes += n
        outs.append(y)
    return QuantizedKV(outs[0], outs[1], nbytes, numel, fp16_tokens)
