"""Looking inside transformers' ``QuantizedLayer``: its grouping, and its re-quantization.

Introduced in notebook 04. transformers' quantized cache layers (``QuantoQuantizedLayer``,
``HQQQuantizedLayer``) keep their quantizer in *private* methods, ``_quantize(tensor, axis)``
and ``_dequantize(q)``, and the quantized history in the private attribute
``_quantized_keys``. There is no public way to ask which elements share a scale, or how often
the history is quantized, so this module calls those private names, here and nowhere else.
They were checked on transformers 5.24 and 5.25 (tests/test_hf_probe.py runs them on the installed
one); if a release renames them, :func:`check_private_api` names what is missing instead of failing
deep inside a probe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PRIVATE_API",
    "check_private_api",
    "roundtrip",
    "scale_shape",
    "OutlierSpread",
    "outlier_spread",
    "Requantization",
    "replay_requantization",
]

PRIVATE_API = ("_quantize", "_dequantize")  # methods every probe below calls


def check_private_api(layer: Any) -> None:
    """Raise ``TypeError`` naming the private methods ``layer`` lacks (see the module doc)."""
    missing = [name for name in PRIVATE_API if not callable(getattr(layer, name, None))]
    if missing:
        raise TypeError(
            f"{type(layer).__name__} has no {', '.join(missing)}: kvlib.caches.hf_probe needs the private "
            "quantizer of transformers' QuantizedLayer (transformers 5.x)"
        )


def roundtrip(layer: Any, x: torch.Tensor, axis: int) -> torch.Tensor:
    """``x`` quantized and de-quantized by ``layer``'s own quantizer along ``axis``.

    Args:
        layer: a transformers quantized cache layer (lazily initialised on ``x``'s device).
        x: ``(batch, kv_heads, seq_len, head_dim)``.
        axis: the backend's ``axis_key``/``axis_value`` meaning (it differs by backend).

    Returns:
        A tensor of ``x``'s shape.
    """
    check_private_api(layer)
    return layer._dequantize(layer._quantize(x, axis=axis))


def scale_shape(layer: Any, x: torch.Tensor, axis: int) -> tuple[int, ...]:
    """Shape of the scales ``layer`` stores for ``x``: one entry per quantization group."""
    check_private_api(layer)
    q = layer._quantize(x, axis=axis)
    scale = (
        q[1]["scale"] if isinstance(q, tuple) else q._scale
    )  # HQQ: (codes, meta); quanto: QTensor
    return tuple(scale.shape)


@dataclass(frozen=True)
class OutlierSpread:
    """How far one outlier spreads its error (1.0: not at all).

    ``token``: mean |error| on the other tokens when token 5 is scaled ×100, over the same
    mean without the outlier. ``channel``: the same for channel 7 and the other channels.
    """

    token: float
    channel: float

    @property
    def grouping(self) -> str:
        """``"per-token"`` (a token outlier stays in its token), ``"per-channel"``, or ``"mixed"``."""
        if self.token < 1.5:
            return "per-token"
        return "per-channel" if self.channel < 1.5 else "mixed"


def outlier_spread(layer: Any, x: torch.Tensor, axis: int, factor: float = 100.0) -> OutlierSpread:
    """Which elements share a scale with an outlier, measured through ``layer``'s quantizer.

    Args:
        layer: a transformers quantized cache layer.
        x: ``(batch, kv_heads, seq_len, head_dim)`` with ``seq_len >= 7`` and ``head_dim >= 9``.
        axis: the quantization axis passed to the backend.
        factor: how much the outlier token / channel is scaled.
    """
    if x.dim() != 4 or x.shape[2] < 7 or x.shape[3] < 9:
        raise ValueError(
            f"x must be (batch, kv_heads, >=7 tokens, >=9 channels) (got {tuple(x.shape)})"
        )
    base = (roundtrip(layer, x, axis) - x).abs()
    out = {}
    for kind, idx, rest in (
        ("token", (Ellipsis, 5, slice(None)), (Ellipsis, slice(6, None), slice(None))),
        ("channel", (Ellipsis, 7), (Ellipsis, slice(8, None))),
    ):
        y = x.clone()
        y[idx] *= factor
        err = (roundtrip(layer, y, axis) - y).abs()
        out[kind] = float(err[rest].mean() / base[rest].mean())
    return OutlierSpread(**out)


@dataclass(frozen=True)
class Requantization:
    """What :func:`replay_requantization` saw.

    ``prompt_errors[i]``: relative error ``‖stored − original‖ / ‖original‖`` of the prompt's
    keys after the i-th flush (0: right after the prefill). ``tokens_quantized``: key and value
    token vectors sent through the quantizer in all.
    """

    prompt_errors: tuple[float, ...]
    tokens_quantized: int


def replay_requantization(
    layer: Any, keys: torch.Tensor, values: torch.Tensor, prompt: int = 64
) -> Requantization:
    """Feed ``layer`` a ``prompt``-token prefill, then one token at a time, as ``generate`` does.

    Counts every token vector the layer sends through ``_quantize`` and, after each flush of
    its residual window, measures how the prompt's stored keys (``_quantized_keys``,
    de-quantized) differ from the originals.

    Args:
        layer: a fresh transformers ``QuantizedLayer`` (quanto or HQQ).
        keys, values: ``(batch, kv_heads, seq_len, head_dim)``, ``seq_len > prompt``.
        prompt: tokens in the prefill.
    """
    check_private_api(layer)
    if keys.shape != values.shape or keys.dim() != 4:
        raise ValueError(
            f"keys and values must be the same 4-d shape (got {tuple(keys.shape)}, {tuple(values.shape)})"
        )
    if not 0 < prompt < keys.shape[2]:
        raise ValueError(f"prompt must be in 1..{keys.shape[2] - 1} (got {prompt})")
    counted = {"tokens": 0}
    original = layer._quantize

    def counting(tensor: torch.Tensor, axis: int) -> Any:
        counted["tokens"] += tensor.shape[-2]
        return original(tensor, axis)

    layer._quantize = counting  # on this instance only
    ref = keys[:, :, :prompt]

    def prompt_error() -> float:
        stored = layer._dequantize(layer._quantized_keys)[:, :, :prompt]
        return float((stored - ref).norm() / ref.norm())

    try:
        layer.update(keys[:, :, :prompt], values[:, :, :prompt])
        errors = [prompt_error()]
        for t in range(prompt, keys.shape[2]):
            layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
            if layer.keys.numel() == 0:  # the residual was just flushed into the quantized store
                errors.append(prompt_error())
    finally:
        del layer._quantize
    return Requantization(tuple(errors), counted["tokens"])
