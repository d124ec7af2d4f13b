"""Rotary position embeddings (RoPE) of cached keys: apply, undo, read from a model (notebook 06).

The keys a KV cache holds are *post-rotary*: channel pairs ``(i, i + rot_dim/2)`` of every head
are rotated by the angle ``position · inv_freq[i]``. The rotation depends on the token's position,
which spreads a key's energy over each rotated pair and hides the correlation across tokens that
a transform such as PCA (:mod:`kvlib.kvtc.pca`) needs. :func:`undo_rope` rotates each token back by its
own angle; :func:`apply_rope` re-applies the model's rotation bit for bit (same float32 angle
arithmetic as transformers' ``LlamaRotaryEmbedding``); :func:`rope_parameters` reads
``(inv_freq, attention_scaling)`` from a transformers model.

Shapes follow transformers: keys are ``(batch, kv_heads, seq_len, head_dim)``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["apply_rope", "undo_rope", "rope_parameters"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(..., d)`` → ``(..., d)``: ``[-x2, x1]`` for halves ``x1, x2`` of the last axis."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(seq_len, rot_dim)`` float32, of the angles ``positions × inv_freq``."""
    # Same arithmetic as transformers' LlamaRotaryEmbedding.forward (float32 angles), so that
    # re-applying reproduces the model's own rotation bit for bit.
    freqs = positions.to(device=device, dtype=torch.float32)[:, None] * inv_freq.to(
        device=device, dtype=torch.float32
    )
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


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
    rot = 2 * inv_freq.numel()
    cos, sin = _cos_sin(inv_freq, positions, keys.device)
    k = keys[..., :rot].to(torch.float32)
    out = (k * cos + _rotate_half(k) * sin) * attention_scaling
    return torch.cat([out.to(keys.dtype), keys[..., rot:]], dim=-1)


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
    rot = 2 * inv_freq.numel()
    cos, sin = _cos_sin(inv_freq, positions, keys.device)
    k = keys[..., :rot].to(torch.float32)
    out = (k * cos - _rotate_half(k) * sin) / attention_scaling
    return torch.cat([out.to(keys.dtype), keys[..., rot:]], dim=-1)


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
