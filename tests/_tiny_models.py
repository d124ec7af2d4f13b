"""Tiny randomly initialised model configs for the cache tests (no weights downloaded)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

#: A tiny Llama's shape: 2 layers, 4 query heads sharing 2 KV heads of 16 channels.
LLAMA_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "vocab_size": 97,
}


def llama_config(**overrides: Any) -> LlamaConfig:
    """A tiny ``LlamaConfig`` (:data:`LLAMA_SHAPE`, any field overridden)."""
    return LlamaConfig(**(LLAMA_SHAPE | overrides))


def tiny_llama(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """A tiny Llama with random weights drawn from ``seed`` (:func:`llama_config`), in eval mode."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**overrides)).eval()


def gemma3_config(window: int = 16, head_dim: int = 64) -> Gemma3TextConfig:
    """Gemma 3 270M's shape, shrunk: 6 layers (5 sliding with a ``window``-token window, 1
    global), 2 query heads and one KV head of ``head_dim`` channels, eager attention."""
    cfg = Gemma3TextConfig(
        num_hidden_layers=6,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        sliding_window=window,
        vocab_size=128,
        max_position_embeddings=512,
        query_pre_attn_scalar=head_dim,
    )
    cfg._attn_implementation = "eager"
    return cfg
