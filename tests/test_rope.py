"""kvlib.rope: the model's own rotation, its exact inverse, and reading a model's parameters."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvlib.rope import apply_rope, rope_parameters, rotate_by, rotation_table, undo_rope


def _tiny_llama_config(**kw) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
        intermediate_size=64, vocab_size=100, **kw,
    )  # fmt: skip


def test_apply_rope_is_the_models_rotation_bit_for_bit() -> None:
    rotary = LlamaRotaryEmbedding(_tiny_llama_config())
    keys = torch.randn(2, 1, 20, 32)
    positions = torch.arange(7, 27)
    cos, sin = rotary(keys, positions[None].expand(2, -1))
    _, expected = apply_rotary_pos_emb(keys, keys, cos, sin)
    got = apply_rope(keys, positions, rotary.inv_freq, rotary.attention_scaling)
    assert torch.equal(got, expected)


def test_rope_undo_redo_exact_inverse() -> None:
    k = torch.randn(1, 3, 50, 64)
    inv = 1.0 / (100000.0 ** (torch.arange(0, 64, 2).float() / 64))
    pos = torch.arange(100, 150)
    back = undo_rope(apply_rope(k, pos, inv), pos, inv)
    assert torch.allclose(back, k, atol=1e-5)
    scaled = undo_rope(apply_rope(k, pos, inv, 1.5), pos, inv, 1.5)
    assert torch.allclose(scaled, k, atol=1e-5)
    # the rotation really moves the keys (a no-op would pass the inverse checks too)
    assert not torch.allclose(apply_rope(k, pos, inv), k, atol=1e-2)


def test_partial_rotary_leaves_the_other_channels_alone() -> None:
    k = torch.randn(1, 2, 10, 16)
    inv = torch.rand(4)  # rot_dim 8 of head_dim 16
    out = apply_rope(k, torch.arange(10), inv)
    assert torch.equal(out[..., 8:], k[..., 8:])
    assert not torch.allclose(out[..., :8], k[..., :8])


def test_rope_parameters_read_from_a_model() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_llama_config())
    inv, scaling = rope_parameters(model)
    assert torch.equal(inv, model.model.rotary_emb.inv_freq.float())
    assert inv.device.type == "cpu" and scaling == 1.0
    with pytest.raises(ValueError, match="rotary"):
        rope_parameters(torch.nn.Linear(4, 4))


def test_bad_rope_arguments() -> None:
    with pytest.raises(ValueError, match="positions"):
        undo_rope(torch.randn(1, 1, 4, 8), torch.arange(3), torch.ones(4))
    with pytest.raises(ValueError, match="4-D"):
        apply_rope(torch.randn(4, 8), torch.arange(4), torch.ones(4))
    with pytest.raises(ValueError, match="inv_freq"):
        apply_rope(torch.randn(1, 1, 4, 8), torch.arange(4), torch.ones(5))
    with pytest.raises(ValueError, match="attention_scaling"):
        undo_rope(torch.randn(1, 1, 4, 8), torch.arange(4), torch.ones(4), 0.0)


def _textbook(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, s: float, inverse: bool):
    """``k·cos ± rotate_half(k)·sin`` with ``rotate_half`` built by ``torch.cat``, as
    transformers writes it, on the first ``rot`` channels; the rest pass through."""
    rot = cos.shape[-1]
    k = keys[..., :rot].float()
    half = torch.cat((-k[..., rot // 2 :], k[..., : rot // 2]), dim=-1)
    out = (k * cos - half * sin) / s if inverse else (k * cos + half * sin) * s
    return torch.cat([out.to(keys.dtype), keys[..., rot:]], dim=-1)


@pytest.mark.parametrize("rot", [64, 32])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("scaling", [1.0, 1.25])
def test_rotate_by_gives_the_textbook_floats_into_any_output(rot, inverse, scaling) -> None:
    g = torch.Generator().manual_seed(rot + 7 * inverse)
    keys = torch.randn(2, 3, 40, 64, generator=g) * 4
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = rotation_table(inv, torch.arange(100, 140))
    want = _textbook(keys, cos, sin, scaling, inverse)
    assert torch.equal(rotate_by(keys, cos, sin, scaling, inverse=inverse), want)
    big = torch.full((2, 3, 50, 64), float("nan"))  # a slice of a larger buffer
    rotate_by(keys, cos, sin, scaling, inverse=inverse, out=big[:, :, 5:45])
    assert torch.equal(big[:, :, 5:45], want)
    assert big[:, :, :5].isnan().all() and big[:, :, 45:].isnan().all()
    half = torch.empty(2, 3, 40, 64, dtype=torch.float16)
    rotate_by(keys, cos, sin, scaling, inverse=inverse, out=half)
    assert torch.equal(half, want.half())


def test_rotate_by_refuses_an_output_of_another_shape() -> None:
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    cos, sin = rotation_table(inv, torch.arange(10))
    with pytest.raises(ValueError, match="out must have the keys' shape"):
        rotate_by(torch.randn(1, 1, 10, 64), cos, sin, out=torch.empty(1, 1, 9, 64))
