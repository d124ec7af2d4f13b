"""Rotary position embeddings (RoPE) of cached keys: apply, undo, read from a model (notebook 06).

The keys a KV cache holds are *post-rotary*: channel pairs ``(i, i + rot_dim/2)`` of every head
are rotated by the angle ``position · inv_freq[i]``. The rotation depends on the token's position,
which spreads a key's energy over each rotated pair and hides the correlation across tokens that
a transform such as PCA (:mod:`kvlib.kvtc.pca`) needs. :func:`undo_rope` rotates each token back by its
own angle; :func:`apply_rope` re-applies the model's rotation bit for bit (same float32 angle
arithmetic as transformers' ``LlamaRotaryEmbedding``); :func:`rope_parameters` reads
``(inv_freq, attention_scaling)`` from a transformers model, :func:`rope_from_config` computes
them from its config (for a cache, which sees the config only).

Shapes follow transformers: keys are ``(batch, kv_heads, seq_len, head_dim)``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "apply_rope",
    "rope_from_config",
    "rope_parameters",
    "rotate_by",
    "rotation_table",
    "undo_rope",
]


def rotation_table(
    inv_freq: torch.Tensor, positions: torch.Tensor, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(seq_len, rot_dim)`` float32, of the angles ``positions × inv_freq``
    (``positions`` ``(seq_len,)``, ``inv_freq`` ``(rot_dim // 2,)``): a table a caller that
    rotates the same positions again and again can keep (:func:`rotate_by`)."""
    device = positions.device if device is None else device
    # Same arithmetic as transformers' LlamaRotaryEmbedding.forward (float32 angles), so that
    # re-applying reproduces the model's own rotation bit for bit.
    freqs = positions.to(device=device, dtype=torch.float32)[:, None] * inv_freq.to(
        device=device, dtype=torch.float32
    )
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_by(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention_scaling: float = 1.0,
    *,
    inverse: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keys ``(batch, kv_heads, seq_len, head_dim)`` rotated by a :func:`rotation_table` of their
    positions (``cos``/``sin`` ``(seq_len, rot_dim)``): :func:`apply_rope` (or, with
    ``inverse``, :func:`undo_rope`) without recomputing the angles.

    The model's ``k·cos + rotate_half(k)·sin`` is computed half by half (``rotate_half(k)`` is
    ``[-k2, k1]``): the same floats, without building ``rotate_half(k)``. A cache that
    re-applies RoPE to its whole past at every step (:mod:`kvlib.caches.kvquant`) writes the
    result straight into the tensor attention reads, through ``out``.

    Args:
        out: where to write the result, of the keys' shape (any strides, e.g. a slice of a
            larger buffer); a new tensor of the keys' dtype when ``None``.

    Returns:
        The rotated keys (``out`` when given), the keys' shape.
    """
    rot = cos.shape[-1]
    half = rot // 2
    if out is None:
        out = torch.empty_like(keys)
    elif out.shape != keys.shape:
        raise ValueError(
            f"out must have the keys' shape {tuple(keys.shape)} (got {tuple(out.shape)})"
        )
    k = keys[..., :rot].to(torch.float32)
    k1, k2 = k[..., :half], k[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    direct = out.dtype == torch.float32
    first = out[..., :half] if direct else torch.empty_like(k1)
    second = out[..., half:rot] if direct else torch.empty_like(k2)
    torch.mul(k1, c1, out=first)
    torch.mul(k2, c2, out=second)
    if inverse:  # k·cos - rotate_half(k)·sin, then / scaling
        first.add_(k2 * s1)
        second.sub_(k1 * s2)
        if attention_scaling != 1.0:
            first.div_(attention_scaling)
            second.div_(attention_scaling)
    else:  # k·cos + rotate_half(k)·sin, then · scaling
        first.sub_(k2 * s1)
        second.add_(k1 * s2)
        if attention_scaling != 1.0:
            first.mul_(attention_scaling)
            second.mul_(attention_scaling)
    if not direct:
        out[..., :half].copy_(first)
        out[..., half:rot].copy_(second)
    if rot < keys.shape[-1]:
        out[..., rot:].copy_(keys[..., rot:])
    return out


def _check_rope_args(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    if not isinstance(keys, torch.Tensor) or keys.ndim != 4:
        raise ValueError(
            "keys must be a 4-D tensor (batch, kv_heads, seq_len, head_dim) "
            f"(got {getattr(keys, 'shape', type(keys).__name__)})"
        )
    if not isinstance(positions, torch.Tensor) or positions.ndim != 1:
        raise ValueError("positions must be a 1-D tensor of token positions, one per seq_len entry")
    if positions.numel() != keys.shape[2]:
        raise ValueError(
            f"positions has {positions.numel()} entries but keys have seq_len {keys.shape[2]}"
        )
    rot = 2 * inv_freq.numel()
    if inv_freq.ndim != 1 or rot == 0 or rot > keys.shape[-1]:
        raise ValueError(
            f"inv_freq must be 1-D with 2 * len <= head_dim {keys.shape[-1]} (got {tuple(inv_freq.shape)})"
        )


def apply_rope(
    keys: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
) -> torch.Tensor:
    """Rotate keys as the model does (``k·cos + rotate_half(k)·sin``, scaled).

    Args:
        keys: ``(batch, kv_heads, seq_len, head_dim)``.
        positions: ``(seq_len,)`` absolute position of each token.
        inv_freq: ``(rot_dim // 2,)`` rotary inverse frequencies; only the first ``rot_dim``
            channels of each head are rotated (partial rotary models), the rest pass through.
        attention_scaling: the rotary ``attention_scaling`` (1.0 for default RoPE).

    Returns:
        Rotated keys, same shape and dtype.
    """
    _check_rope_args(keys, positions, inv_freq)
    cos, sin = rotation_table(inv_freq, positions, keys.device)
    return rotate_by(keys, cos, sin, attention_scaling)


def undo_rope(
    keys: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
) -> torch.Tensor:
    """Inverse of :func:`apply_rope`: rotate each token back by its own angle.

    ``apply_rope`` rotates channel pairs ``(i, i + rot_dim/2)`` by ``position · inv_freq[i]``;
    the inverse rotation uses ``-sin``. Same arguments and shapes as :func:`apply_rope`
    (``keys`` ``(batch, kv_heads, seq_len, head_dim)``, ``positions`` ``(seq_len,)``).
    """
    _check_rope_args(keys, positions, inv_freq)
    if not attention_scaling:
        raise ValueError("attention_scaling must be non-zero")
    cos, sin = rotation_table(inv_freq, positions, keys.device)
    return rotate_by(keys, cos, sin, attention_scaling, inverse=True)


def rope_parameters(model: Any) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of a transformers model's rotary embedding.

    ``inv_freq`` is ``(rot_dim // 2,)`` float32 on the CPU (the unscaled ``original_inv_freq``
    where the model keeps one).

    Raises:
        ValueError: the model has no rotary embedding module with an ``inv_freq`` buffer.
    """
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        rotary = next((m for m in model.modules() if hasattr(m, "inv_freq")), None)
    if rotary is None:
        raise ValueError(
            "the model has no rotary embedding (no module with an inv_freq buffer); "
            "pass undo_rope=False for models without RoPE"
        )
    inv = getattr(rotary, "original_inv_freq", None)
    if inv is None:
        inv = rotary.inv_freq
    return inv.detach().float().cpu().clone(), float(getattr(rotary, "attention_scaling", 1.0))


def rope_from_config(config: Any, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of a model's RoPE, computed from its transformers config
    as its rotary embedding module computes them at load time.

    Args:
        config: a transformers config (its text config is read).
        layer_type: for a model whose ``rope_parameters`` differ by layer type (Gemma 3:
            ``"sliding_attention"``, ``"full_attention"``), which to read; ignored otherwise.

    Returns:
        ``inv_freq`` ``(rot_dim // 2,)`` float32 on the CPU, and the float ``attention_scaling``.

    Raises:
        TypeError: not a transformers config.
        ValueError: no RoPE parameters, a layer type the config does not have, or a ``dynamic``
            RoPE (its angles change with the sequence length, so stored keys cannot be re-rotated).
    """
    if not hasattr(config, "get_text_config"):
        raise TypeError(
            f"config must be a transformers PretrainedConfig (got {type(config).__name__})"
        )
    text = config.get_text_config(decoder=True)
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        raise ValueError(f"{type(text).__name__} has no rope_parameters: the model has no RoPE")
    per_type = "rope_theta" not in params and all(isinstance(v, dict) for v in params.values())
    if per_type:
        if layer_type not in params:
            raise ValueError(
                f"the config's RoPE differs by layer type {sorted(params)}: pass layer_type "
                f"(got {layer_type!r})"
            )
        params = params[layer_type]
    else:
        layer_type = None
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise ValueError("dynamic RoPE changes its angles with the sequence length")
    if rope_type == "default":
        rotary = _rotary_class(text)
        if rotary is None:
            raise ValueError(
                f"no rotary embedding class found for model type {text.model_type!r}: kvlib "
                "reads the default RoPE from the model's own code"
            )
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        inv, scaling = rotary.compute_default_rope_parameters(text, **kwargs)
        return inv.detach().float().cpu(), float(scaling)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](text, "cpu", layer_type=layer_type)
    return inv.detach().float().cpu(), float(scaling)


def _rotary_class(text_config: Any) -> Any:
    """The transformers class that computes the RoPE of ``text_config``'s model (its
    ``*RotaryEmbedding``, which knows the model's own reading of the default RoPE, such as a
    partial rotary factor), or ``None``."""
    import sys

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(getattr(text_config, "model_type", None) or "")
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if model_class is None:
        return None
    module = sys.modules[model_class.__module__]
    for attr in dir(module):
        cls = getattr(module, attr)
        if attr.endswith("RotaryEmbedding") and hasattr(cls, "compute_default_rope_parameters"):
            return cls
    return None
