"""Capturing a model's queries, keys and values, and measuring attention-output error.

Introduced in notebook 02; reused wherever a compression of the cache is judged by what attention
actually computes from it.

Shapes follow transformers: queries ``(batch, heads, seq_len, head_dim)``, keys and values
``(batch, kv_heads, seq_len, head_dim)``; with grouped-query attention each KV head serves
``heads // kv_heads`` consecutive query heads. Keys and queries are captured *after* RoPE,
exactly what the KV cache stores and what attention multiplies. Attention outputs are computed
by the dense reference :func:`kvlib.attention.dense_attention` (causal).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlib.attention import dense_attention
from kvlib.quant.recipes import KVRecipe, quantize_kv

__all__ = [
    "LayerQKV",
    "capture_qkv",
    "capture_kv",
    "attention_output_error",
    "RecipeResult",
    "evaluate_recipes",
    "evaluate_recipe",
    "channel_spread",
]


@dataclass(frozen=True)
class LayerQKV:
    """One layer's post-RoPE queries ``(b, heads, s, d)``, keys and values ``(b, kv_heads, s, d)``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    mods = [
        m
        for m in model.modules()
        if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "head_dim"))
    ]
    if not mods:
        raise TypeError(
            f"{type(model).__name__} has no Llama-style attention modules (q_proj/k_proj/v_proj); "
            "capture supports Llama-style attention (Llama, SmolLM, Qwen2, Mistral, Gemma 3, ...)"
        )
    return mods


@torch.no_grad()
def capture_qkv(model: torch.nn.Module, input_ids: torch.Tensor) -> list[LayerQKV]:
    """Run ``model`` on ``input_ids`` ``(batch, seq_len)`` once and return every layer's q, k, v.

    Forward pre-hooks on the attention modules recompute the projections, the per-head query
    and key norms where the model has them (Gemma 3's QK-norm) and RoPE from the module's own
    inputs (the same code path as transformers' ``LlamaAttention.forward`` and
    ``Gemma3Attention.forward``), so nothing in the model is changed. Tensors are returned in
    float32 on the model's device.
    """
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.ndim != 2
        or input_ids.dtype.is_floating_point
    ):
        raise ValueError("input_ids must be an integer tensor of shape (batch, seq_len)")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids must hold at least one token")
    mods = _attention_modules(model)
    out: dict[int, LayerQKV] = {}

    def make_hook(idx: int):
        def hook(module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            shape = (*h.shape[:-1], -1, module.head_dim)
            q = module.q_proj(h).view(shape).transpose(1, 2)
            k = module.k_proj(h).view(shape).transpose(1, 2)
            v = module.v_proj(h).view(shape).transpose(1, 2)
            if hasattr(module, "q_norm") and hasattr(module, "k_norm"):  # QK-norm (Gemma 3)
                q, k = module.q_norm(q), module.k_norm(k)
            rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
            q, k = rope(q, k, cos, sin)
            out[idx] = LayerQKV(
                q.float().contiguous(), k.float().contiguous(), v.float().contiguous()
            )

        return hook

    handles = [
        m.register_forward_pre_hook(make_hook(i), with_kwargs=True) for i, m in enumerate(mods)
    ]
    # run the decoder without its LM head where there is one (the logits are not needed, and
    # the vocabulary projection is a fifth of the model's FLOPs for a small model)
    body = getattr(model, "model", None)
    runner = body if isinstance(body, torch.nn.Module) else model
    try:
        runner(input_ids=input_ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [out[i] for i in range(len(mods))]


def capture_kv(
    model: torch.nn.Module, input_ids: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's ``(keys, values)``, each ``(batch, kv_heads, seq_len, head_dim)`` float32."""
    return [(layer.k, layer.v) for layer in capture_qkv(model, input_ids)]


def attention_output_error(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor
) -> float:
    """Relative error ``‖O(q, k̂, v̂) − O(q, k, v)‖ / ‖O(q, k, v)‖`` (Frobenius, all heads and positions).

    ``O`` is the causal :func:`kvlib.attention.dense_attention` (``q`` ``(b, heads, s_q, d)``
    the last ``s_q`` positions of ``k``/``v`` ``(b, kv_heads, s_k, d)``); ``k_hat``/``v_hat``
    are the reconstructed keys/values, same shape as ``k``/``v``.
    """
    if k_hat.shape != k.shape or v_hat.shape != v.shape:
        raise ValueError(
            f"k_hat/v_hat must have the shapes of k/v (got {tuple(k_hat.shape)}, {tuple(v_hat.shape)} "
            f"for {tuple(k.shape)})"
        )
    ref = dense_attention(q, k, v)
    approx = dense_attention(q, k_hat, v_hat)
    denom = torch.linalg.vector_norm(ref)
    if denom == 0:
        return float(torch.linalg.vector_norm(approx - ref))
    return float(torch.linalg.vector_norm(approx - ref) / denom)


def channel_spread(k: torch.Tensor) -> float:
    """How far a tensor's strongest channel stands out: per KV head, the largest channel RMS
    over the median channel RMS (RMS over batch and tokens), averaged over heads. Per-token
    quantization groups share one scale across channels, so a large spread wastes their
    levels on the weak channels; per-channel groups do not mind it.

    Args:
        k: ``(batch, kv_heads, seq_len, head_dim)`` keys (or values).

    Raises:
        ValueError: not a 4-D tensor, or every channel of a head zero.
    """
    if not isinstance(k, torch.Tensor) or k.ndim != 4 or k.numel() == 0:
        raise ValueError("k must be a non-empty (batch, kv_heads, seq_len, head_dim) tensor")
    rms = k.double().pow(2).mean(dim=(0, 2)).sqrt()  # (kv_heads, head_dim)
    median = rms.median(dim=-1).values
    if (median == 0).any():
        raise ValueError("a head's median channel is zero: its spread is undefined")
    return float((rms.amax(dim=-1) / median).mean())


@dataclass(frozen=True)
class RecipeResult:
    """A :class:`kvlib.quant.recipes.KVRecipe` judged on captured layers.

    ``error`` is the mean over layers of :func:`attention_output_error`; ``bits_per_element``
    counts every byte kept (packed codes, scales, zero points, float16 windows) over all layers'
    keys and values.
    """

    recipe: KVRecipe
    error: float
    layer_errors: tuple[float, ...]
    bits_per_element: float
    nbytes: int

    @property
    def label(self) -> str:
        return self.recipe.label


def evaluate_recipes(
    layers: Sequence[LayerQKV], recipes: Sequence[KVRecipe], n_queries: int | None = None
) -> list[RecipeResult]:
    """Apply each recipe to every layer's keys/values and measure attention-output error.

    Args:
        layers: from :func:`capture_qkv`; q ``(b, heads, s, d)``, k/v ``(b, kv_heads, s, d)``.
        recipes: the :class:`~kvlib.quant.recipes.KVRecipe` s to compare.
        n_queries: use only the last ``n_queries`` queries (decode-style: the newest tokens
            reading the whole cache); ``None`` uses every position. Fewer queries is faster.

    Returns:
        One :class:`RecipeResult` per recipe, in order. The full-precision attention output of
        each layer is computed once and shared by all recipes.
    """
    if not layers:
        raise ValueError("layers must hold at least one LayerQKV")
    if n_queries is not None and (
        isinstance(n_queries, bool) or not isinstance(n_queries, int) or n_queries < 1
    ):
        raise ValueError(f"n_queries must be a positive int or None (got {n_queries!r})")
    for r in recipes:
        if not isinstance(r, KVRecipe):
            raise TypeError(f"recipes must be KVRecipe objects (got {type(r).__name__})")
    qs = [layer.q if n_queries is None else layer.q[:, :, -n_queries:] for layer in layers]
    refs = [dense_attention(q, layer.k, layer.v) for q, layer in zip(qs, layers, strict=True)]
    norms = [torch.linalg.vector_norm(ref) for ref in refs]
    results = []
    for recipe in recipes:
        errors, nbytes, numel = [], 0, 0
        for q, ref, norm, layer in zip(qs, refs, norms, layers, strict=True):
            qkv = quantize_kv(layer.k, layer.v, recipe)
            diff = torch.linalg.vector_norm(dense_attention(q, qkv.keys, qkv.values) - ref)
            errors.append(float(diff / norm) if norm > 0 else float(diff))
            nbytes += qkv.nbytes
            numel += qkv.numel
        results.append(
            RecipeResult(
                recipe, sum(errors) / len(errors), tuple(errors), 8 * nbytes / numel, nbytes
            )
        )
    return results


def evaluate_recipe(
    layers: Sequence[LayerQKV], recipe: KVRecipe, n_queries: int | None = None
) -> RecipeResult:
    """:func:`evaluate_recipes` for one recipe."""
    return evaluate_recipes(layers, [recipe], n_queries)[0]
