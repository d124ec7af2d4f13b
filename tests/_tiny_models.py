"""Tiny randomly initialised model configs for the cache tests (no weights downloaded)."""

from __future__ import annotations

from transformers import Gemma3TextConfig


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
