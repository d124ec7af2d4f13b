"""The queries of a forward pass, for caches that score tokens by attention (notebook 11).

A transformers cache sees keys and values, never queries; SnapKV, H2O and TOVA
(:mod:`kvlib.caches.eviction.cache`) need them. A forward pre-hook on every attention module recomputes
the layer's queries from its inputs (``q_proj``, a Qwen3-style ``q_norm``, RoPE: what
transformers' ``LlamaAttention`` does, as kvpress's hooks do) and hands them on:

* :func:`capture_queries` gives them to the cache layer the module is called with, when that
  layer asks for them (``needs_queries``, :meth:`kvlib.caches.eviction.cache.EvictionLayer.set_queries`);
* :func:`recorded_queries` keeps the last pass's, per layer, for filling caches later
  (:func:`kvlib.eval.retrieval.compare_retrieval`).

Llama-style attention modules only (``q_proj``, ``head_dim``, ``layer_idx``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

__all__ = ["capture_queries", "recorded_queries"]


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    mods = [
        m
        for m in model.modules()
        if hasattr(m, "q_proj") and hasattr(m, "head_dim") and hasattr(m, "layer_idx")
    ]
    if not mods:
        raise TypeError(
            f"{type(model).__name__} has no Llama-style attention modules (q_proj, layer_idx)"
        )
    return mods


def _queries(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, float]:
    """The queries ``(batch, heads, q_len, head_dim)`` (after RoPE) an attention module is
    about to compute, and its softmax scale, from its forward arguments."""
    h = kwargs.get("hidden_states", args[0] if args else None)
    cos, sin = kwargs["position_embeddings"]
    q = module.q_proj(h).view(*h.shape[:-1], -1, module.head_dim)
    if hasattr(module, "q_norm"):  # Qwen3-style query norm, before RoPE
        q = module.q_norm(q)
    q = q.transpose(1, 2)
    rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
    q, _ = rope(q, q, cos, sin)
    return q, float(getattr(module, "scaling", module.head_dim**-0.5))


def _query_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layers = getattr(cache, "layers", None)
    if not layers or module.layer_idx >= len(layers):
        return
    layer = layers[module.layer_idx]
    if getattr(layer, "needs_queries", False):
        layer.set_queries(*_queries(module, args, kwargs))


@contextlib.contextmanager
def recorded_queries(model: torch.nn.Module) -> Iterator[dict[int, tuple[torch.Tensor, float]]]:
    """Within this block, every forward pass of ``model`` records each layer's queries and
    softmax scale in the yielded dict ``{layer_idx: (queries, scaling)}`` (the last pass's),
    whatever the cache, so that an :class:`EvictionLayer` can be filled later
    (:meth:`kvlib.caches.eviction.cache.EvictionLayer.set_queries`, then ``update``)."""
    seen: dict[int, tuple[torch.Tensor, float]] = {}

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen[module.layer_idx] = _queries(module, args, kwargs)

    handles = [
        m.register_forward_pre_hook(hook, with_kwargs=True) for m in _attention_modules(model)
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def capture_queries(model: torch.nn.Module) -> Iterator[None]:
    """Within this block, every attention module of ``model`` hands its queries to the cache
    layer it is called with when the layer asks for them (an :class:`~kvlib.caches.eviction.cache.EvictionCache`
    whose policy scores by attention; other caches are left alone). Nested use is harmless; the
    hooks are removed on exit."""
    handles = [
        m.register_forward_pre_hook(_query_hook, with_kwargs=True)
        for m in _attention_modules(model)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
