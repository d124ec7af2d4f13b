"""Tests for kvlib.quant.recipes: KV recipes (windows, axes, groups, rotation) and their byte accounting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.quant.recipes import KVRecipe, quantize_kv
from kvlib.quant.rotation import hadamard
from kvlib.quant.tensor import quantize


def _kv(seq=100, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 3, seq, 64, generator=g)
    k[..., 7] += 20  # an outlier channel
    v = torch.randn(2, 3, seq, 64, generator=g)
    return k.to(dtype), v.to(dtype)


def test_quantize_kv_windows_and_bytes():
    k, v = _kv()
    r = KVRecipe(4, key_axis=-2, value_axis=-1, key_group_size=32, residual=16, sinks=4)
    out = quantize_kv(k, v, r)
    # 100 tokens: 4 sinks, 16 residual, 80 in between trimmed to 64 (two key groups of 32);
    # the 16 leftover tokens join the float16 residual
    assert out.fp16_tokens == 36
    for x, y in ((k, out.keys), (v, out.values)):
        assert y.shape == x.shape and y.dtype == x.dtype
        fp16 = x.half().float()
        assert torch.equal(y[:, :, :4], fp16[:, :, :4])
        assert torch.equal(y[:, :, 68:], fp16[:, :, 68:])
    qk = quantize(k[:, :, 4:68], 4, axis=-2, group_size=32)
    qv = quantize(v[:, :, 4:68], 4, axis=-1)
    assert torch.equal(out.keys[:, :, 4:68], qk.dequantize())
    assert torch.equal(out.values[:, :, 4:68], qv.dequantize())
    fp16_bytes = 2 * (2 * 3 * 36 * 64) * 2
    assert out.nbytes == qk.nbytes + qv.nbytes + fp16_bytes
    assert out.numel == 2 * k.numel()
    assert out.bits_per_element == pytest.approx(8 * out.nbytes / out.numel)
    assert out.compression_ratio() == pytest.approx(16 / out.bits_per_element)


def test_quantize_kv_fp16_per_tensor_and_rotation():
    k, v = _kv(64)
    base = quantize_kv(k, v, KVRecipe(16))
    assert base.nbytes == 2 * k.numel() * 2 and base.bits_per_element == 16
    assert torch.equal(base.keys, k.half().float())
    pt = quantize_kv(k, v, KVRecipe(8, key_axis=None, value_axis=None))
    assert pt.nbytes == 2 * (k.numel() + 2 * 2)  # one scale + one zero point per tensor
    assert torch.equal(pt.keys, quantize(k.reshape(-1), 8, axis=0).dequantize().view_as(k))
    h = hadamard(64)
    rot = quantize_kv(k, v, KVRecipe(4, key_axis=-1, value_axis=-1, rotate=True))
    expected = quantize(k @ h, 4, axis=-1).dequantize() @ h.T
    assert torch.allclose(rot.keys, expected, atol=1e-5)
    plain = quantize_kv(k, v, KVRecipe(4, key_axis=-1, value_axis=-1))
    # the outlier channel is spread by the rotation: per-token key error drops
    assert (rot.keys - k).pow(2).mean() < 0.5 * (plain.keys - k).pow(2).mean()


def test_quantize_kv_leaves_input_alone_and_handles_short_sequences():
    k, v = _kv(8, dtype=torch.float16)
    k0, v0 = k.clone(), v.clone()
    out = quantize_kv(k, v, KVRecipe(2, key_axis=-1, value_axis=-1))
    assert torch.equal(k, k0) and torch.equal(v, v0)
    assert out.keys.dtype == torch.float16
    # a window longer than the sequence: everything stays float16
    short = quantize_kv(k, v, KVRecipe(2, residual=128, sinks=4))
    assert short.fp16_tokens == 8 and torch.equal(short.keys, k)


@settings(max_examples=40, deadline=None)
@given(
    seq=st.integers(1, 80),
    bits=st.sampled_from((2, 3, 4, 8)),
    key_axis=st.sampled_from((None, -1, -2)),
    value_axis=st.sampled_from((None, -1, -2)),
    gk=st.sampled_from((None, 8, 16)),
    sinks=st.integers(0, 6),
    residual=st.integers(0, 40),
    rotate=st.booleans(),
)
def test_quantize_kv_accounting_property(
    seq, bits, key_axis, value_axis, gk, sinks, residual, rotate
):
    k, v = _kv(seq, seed=seq)
    gk = None if key_axis is None else gk
    r = KVRecipe(
        bits, key_axis, value_axis, key_group_size=gk, sinks=sinks, residual=residual, rotate=rotate
    )
    out = quantize_kv(k, v, r)
    n_q = seq - out.fp16_tokens
    assert out.fp16_tokens >= min(seq, sinks + residual)
    if key_axis == -2 and gk:
        assert n_q % gk == 0
    fp16_bytes = 2 * 2 * 3 * 64 * 2 * out.fp16_tokens
    if n_q == 0:
        assert out.nbytes == fp16_bytes
    else:
        assert out.nbytes > fp16_bytes
    if n_q >= 16:  # then every group has at least 8 elements: cheaper than float16
        assert out.nbytes < fp16_bytes + 2 * k[:, :, :n_q].numel() * 2
    for x, y in ((k, out.keys), (v, out.values)):
        assert y.shape == x.shape and bool(torch.isfinite(y).all())
        assert (y - x).abs().max() <= (x.amax() - x.amin()) * (1.0 if rotate else 0.5 / 3 + 1e-3)


@pytest.mark.parametrize(
    "kwargs, exc, msg",
    [
        (dict(bits=5), ValueError, r"one of 2, 3, 4, 8, 16 \(got 5\)"),
        (dict(bits=4.0), TypeError, "bits must be an int"),
        (dict(key_axis=0), ValueError, "key_axis must be -2"),
        (dict(value_axis=1), ValueError, "value_axis must be -2"),
        (dict(key_group_size=0), ValueError, "key_group_size must be a positive int"),
        (dict(key_axis=None, key_group_size=32), ValueError, "per-tensor has no groups"),
        (dict(residual=-1), ValueError, "residual must be a non-negative int"),
        (dict(sinks=1.5), ValueError, "sinks must be a non-negative int"),
    ],
)
def test_kv_recipe_rejects_bad_fields(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        KVRecipe(**kwargs)


def test_quantize_kv_rejects_bad_input():
    k, v = _kv(16)
    with pytest.raises(TypeError, match="KVRecipe"):
        quantize_kv(k, v, "kivi")
    with pytest.raises(ValueError, match="same shape"):
        quantize_kv(k, v[:, :, :8], KVRecipe())
    with pytest.raises(ValueError, match="4-d"):
        quantize_kv(k[0], v[0], KVRecipe())
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        quantize_kv(k[..., :48], v[..., :48], KVRecipe(rotate=True))
    with pytest.raises(ValueError, match="group_size must divide axis"):
        quantize_kv(k, v, KVRecipe(value_group_size=48))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_kv(k.masked_fill(k > 2, float("nan")), v, KVRecipe())
    with pytest.raises(TypeError, match="keys must be a floating-point tensor"):
        quantize_kv(k.long(), v, KVRecipe())
    with pytest.raises(ValueError, match="values must not be empty"):
        quantize_kv(k, v[:, :, :0], KVRecipe())


def test_recipe_labels():
    assert KVRecipe(16).label == "fp16"
    assert KVRecipe(4, -2, -1, key_group_size=32, residual=128).label == "K/ch V/tok 4b r128"
    assert KVRecipe(2, -1, -1, rotate=True, sinks=4).label == "K/tok V/tok 2b H s4"
    assert KVRecipe(4, name="KIVI").label == "KIVI"


def test_rotate_values_false_rotates_the_keys_only():
    """Eviction's layout: keys rotated, values not. Each half equals the recipe that treats it
    the same way, and the bytes do not change."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 64, 32, generator=g) * torch.linspace(0.1, 6, 32)
    v = torch.randn(1, 2, 64, 32, generator=g)
    base = {"key_axis": -1, "value_axis": -1, "key_group_size": 8, "value_group_size": 8}
    both = quantize_kv(k, v, KVRecipe(4, rotate=True, **base))
    plain = quantize_kv(k, v, KVRecipe(4, **base))
    keys_only = quantize_kv(k, v, KVRecipe(4, rotate=True, rotate_values=False, **base))
    assert torch.equal(keys_only.keys, both.keys) and torch.equal(keys_only.values, plain.values)
    assert not torch.equal(keys_only.values, both.values)
    assert keys_only.nbytes == both.nbytes == plain.nbytes
    assert KVRecipe(4, rotate=True, rotate_values=False, **base).label.endswith("HK")
    with pytest.raises(ValueError, match="rotate_values"):
        KVRecipe(4, rotate=True, rotate_values="no")  # type: ignore[arg-type]
