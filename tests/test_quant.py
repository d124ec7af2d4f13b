"""Tests for kvlib.quant: bit-packing, the half-step guarantee, metadata accounting, bad input."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.quant import (
    KVRecipe,
    QuantizedTensor,
    hadamard,
    pack,
    packed_nbytes,
    quantize,
    quantize_kv,
    unpack,
)

BITS = (2, 3, 4, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ------------------------------------------------------------------ packing


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_every_byte_exhaustive(bits):
    per = 8 // bits
    tuples = list(itertools.product(range(1 << bits), repeat=per))  # 256 tuples
    codes = torch.tensor(tuples, dtype=torch.uint8)
    # little-end first: code j of a byte sits at bits j*bits ..
    expected = sum(codes[:, j].int() << (bits * j) for j in range(per)).to(torch.uint8)
    packed = pack(codes, bits)
    assert torch.equal(packed, expected)
    assert sorted(packed.tolist()) == list(range(256))
    assert torch.equal(unpack(packed, bits, codes.numel()), codes.reshape(-1))


def test_pack_3bit_every_value_at_every_position():
    # 8 positions x 8 values: row r holds value (r + j) % 8 at position j, so each value appears
    # at each position of the 3-byte word.
    r = torch.arange(64)[:, None]
    j = torch.arange(8)[None, :]
    codes = ((r // 8 + r * j + j) % 8).to(torch.uint8)
    for v, p in itertools.product(range(8), range(8)):
        assert bool((codes[:, p] == v).any())
    packed = pack(codes, 3)
    assert packed.numel() == 64 * 3
    assert torch.equal(unpack(packed, 3, codes.numel()), codes.reshape(-1))
    # reference bit layout for the first word
    word = sum(int(codes[0, k]) << (3 * k) for k in range(8))
    assert packed[:3].tolist() == [word & 255, (word >> 8) & 255, word >> 16]


def test_unpack_3bit_every_byte_at_every_position():
    g = torch.Generator().manual_seed(0)
    cols = [torch.randperm(256, generator=g) for _ in range(3)]
    packed = torch.stack(cols, 1).to(torch.uint8).reshape(-1)
    codes = unpack(packed, 3, 256 * 8)
    assert int(codes.max()) <= 7
    assert torch.equal(pack(codes, 3), packed)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_unpack_every_byte(bits):
    packed = torch.arange(256, dtype=torch.uint8)
    codes = unpack(packed, bits, 256 * 8 // bits)
    assert torch.equal(pack(codes, bits), packed)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from(BITS), n=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_pack_roundtrip_any_length(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int64)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(n, bits)
    assert torch.equal(unpack(packed, bits, n).long(), codes)


def test_pack_rejects_bad_codes():
    with pytest.raises(ValueError, match=r"codes must lie in 0\.\.15"):
        pack(torch.tensor([0, 16]), 4)
    with pytest.raises(ValueError, match="0..3"):
        pack(torch.tensor([-1]), 2)
    with pytest.raises(TypeError, match="integer"):
        pack(torch.tensor([0.5]), 4)
    with pytest.raises(ValueError, match=r"bits must be one of 2, 3, 4, 8 \(got 5\)"):
        pack(torch.tensor([1]), 5)


def test_unpack_rejects_bad_input():
    with pytest.raises(ValueError, match="need 3 bytes"):
        unpack(torch.zeros(2, dtype=torch.uint8), 3, 8)
    with pytest.raises(TypeError, match="uint8"):
        unpack(torch.zeros(2, dtype=torch.int32), 4, 4)
    with pytest.raises(ValueError, match="non-negative"):
        unpack(torch.zeros(2, dtype=torch.uint8), 4, -1)


# ------------------------------------------------------------------ the half-step guarantee


def _grouped(x: torch.Tensor, axis: int, gs: int) -> torch.Tensor:
    """Reference grouping: (..., groups, gs) with the reduced axis moved last."""
    xm = x.movedim(axis, -1)
    return xm.reshape(*xm.shape[:-1], xm.shape[-1] // gs, gs)


@st.composite
def quant_cases(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    axis = draw(st.integers(-ndim, ndim - 1))
    length = shape[axis]
    length = draw(st.sampled_from([length, 8, 12, 16]))
    shape = shape[: axis % ndim] + (length,) + shape[axis % ndim + 1 :]
    divisors = [d for d in range(1, length + 1) if length % d == 0]
    group = draw(st.sampled_from([None, *divisors]))
    return dict(
        shape=shape,
        axis=axis,
        group_size=group,
        bits=draw(st.sampled_from(BITS)),
        symmetric=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
        magnitude=draw(st.sampled_from([1e-4, 1e-2, 1.0, 30.0, 1e3, 6e4, 1e6])),
        shift=draw(st.sampled_from([0.0, 1.0, -5.0, 100.0])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=250, deadline=None)
@given(case=quant_cases())
def test_dequantize_within_half_step(case):
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["shape"], generator=g) * case["magnitude"] + case["shift"]
    if case["dtype"] == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(case["dtype"])
    q = quantize(x, case["bits"], case["axis"], case["group_size"], case["symmetric"])
    y = q.dequantize()
    assert y.shape == x.shape and y.dtype == x.dtype and bool(torch.isfinite(y).all())

    gs = case["group_size"] or x.shape[case["axis"]]
    xg = _grouped(x.float(), case["axis"], gs)
    yg = _grouped(y.float(), case["axis"], gs)
    bits = case["bits"]
    if case["symmetric"]:
        ideal = xg.abs().amax(-1, keepdim=True) / ((1 << (bits - 1)) - 1)
    else:
        ideal = (xg.amax(-1, keepdim=True) - xg.amin(-1, keepdim=True)) / ((1 << bits) - 1)
    amax = xg.abs().amax(-1, keepdim=True)
    # half a step (the stored step may exceed the ideal one by 2**-6), plus output-dtype rounding
    # and float32 arithmetic slack
    tol = 0.5 * ideal * (1 + 2**-6) + amax * (torch.finfo(x.dtype).eps + 8 * 2**-24)
    err = (yg - xg).abs()
    assert bool((err <= tol).all()), f"max excess {(err - tol).max().item():.3g}"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_groups_reconstruct_exactly(bits, symmetric, dtype):
    # (batch, heads, seq, head_dim): channel c constant over the tokens; values that fp16 can
    # hold, ones it cannot (0.1 in fp32, 1e5), zero and negatives
    vals = torch.tensor([0.0, 0.1, -3.0, 1e5, 2.5, -7e-3, 1.0, -1e-5])
    if dtype == torch.float16:
        vals = vals.clamp(max=6e4)
    x = vals.repeat(8)[None, None, None, :].expand(2, 3, 16, 64).to(dtype)
    for axis, gs in [(-2, None), (-2, 4), (-1, 1)]:
        y = quantize(x, bits, axis=axis, group_size=gs, symmetric=symmetric).dequantize()
        assert torch.equal(y, x), (axis, gs)
    assert torch.equal(
        quantize(torch.zeros(4, 8), bits, symmetric=symmetric).dequantize(), torch.zeros(4, 8)
    )


def test_per_channel_statistics_do_not_mix_heads():
    x = torch.randn(1, 3, 32, 8)
    x[:, 1] *= 1000  # a loud head must not coarsen the others
    q = quantize(x, 4, axis=-2)
    assert q.scale.shape == (1, 3, 1, 1, 8)
    err = (q.dequantize() - x).abs()
    assert err[:, 0].max() < 0.5 * (x[:, 0].amax(-2) - x[:, 0].amin(-2)).max() / 15 * 1.02


# ------------------------------------------------------------------ accounting


def test_nbytes_counts_codes_and_metadata():
    x = torch.randn(1, 3, 16, 64)
    q = quantize(x, 4, axis=-1)  # per-token: 48 tokens x (scale + offset) in fp16
    assert q.scale_dtype == torch.float16
    assert q.code_nbytes == 3 * 16 * 64 // 2
    assert q.metadata_nbytes == 48 * 2 * 2
    assert q.nbytes == 1536 + 192
    assert q.compression_ratio() == pytest.approx(3 * 16 * 64 * 2 / 1728)
    assert q.compression_ratio(32) == pytest.approx(2 * q.compression_ratio())
    assert q.bits_per_element == pytest.approx(8 * 1728 / 3072)
    qs = quantize(x, 4, axis=-1, symmetric=True)  # symmetric: no offsets
    assert qs.metadata_nbytes == 48 * 2
    q3 = quantize(x, 3, axis=-2, group_size=8)  # 3 bits: 3 bytes per 8 codes
    assert q3.code_nbytes == 3 * 16 * 64 * 3 // 8
    assert q3.metadata_nbytes == 3 * 2 * 64 * 2 * 2
    q8 = quantize(x, 8, axis=-1, scale_dtype=torch.float32)
    assert q8.metadata_nbytes == 48 * 2 * 4


def test_fp32_fallback_is_counted():
    x = torch.randn(4, 64) * 1e6  # beyond fp16 range
    q = quantize(x, 8)
    assert q.scale_dtype == torch.float32
    assert q.metadata_nbytes == 4 * 2 * 4
    assert (q.dequantize() - x).abs().max() <= 0.5 * (x.amax() - x.amin()) / 255 * 1.001


def test_to_and_codes():
    x = torch.randn(2, 5, 8)
    q = quantize(x, 2, axis=1)
    assert isinstance(q, QuantizedTensor)
    q2 = q.to("cpu")
    assert q2.device.type == "cpu" and torch.equal(q2.dequantize(), q.dequantize())
    assert q.codes().shape == x.shape and int(q.codes().max()) <= 3
    assert q.dequantize(torch.float64).dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_matches_cpu():
    x = torch.randn(2, 3, 64, 64)
    for bits in BITS:
        qc = quantize(x.cuda(), bits, axis=-2, group_size=16)
        assert qc.device.type == "cuda"
        assert torch.allclose(
            qc.dequantize().cpu(), quantize(x, bits, -2, 16).dequantize(), atol=1e-5
        )


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs, exc, msg",
    [
        (dict(bits=5), ValueError, r"bits must be one of 2, 3, 4, 8 \(got 5\)"),
        (dict(bits=16), ValueError, r"got 16"),
        (dict(bits="4"), TypeError, "bits must be an int"),
        (dict(bits=4, axis=4), ValueError, r"axis 4 is out of range .* -4\.\.3"),
        (dict(bits=4, axis=-5), ValueError, "out of range"),
        (
            dict(bits=4, group_size=48),
            ValueError,
            r"group_size 48 does not divide axis -1 of length 64",
        ),
        (dict(bits=4, group_size=0), ValueError, "does not divide"),
        (dict(bits=4, group_size=2.0), TypeError, "group_size must be an int"),
        (dict(bits=4, scale_dtype=torch.bfloat16), ValueError, "scale_dtype"),
    ],
)
def test_bad_arguments(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        quantize(torch.randn(1, 3, 8, 64), **kwargs)


@pytest.mark.parametrize(
    "x, exc, msg",
    [
        (torch.arange(8), TypeError, "floating-point"),
        (torch.ones(8, dtype=torch.complex64), TypeError, "floating-point"),
        (torch.tensor([1.0, float("nan")]), ValueError, "NaN or Inf"),
        (torch.tensor([1.0, float("inf")]), ValueError, "NaN or Inf"),
        (torch.empty(0, 4), ValueError, "empty"),
        (torch.tensor(1.0), ValueError, "at least one dimension"),
        ([1.0, 2.0], TypeError, "torch.Tensor"),
    ],
)
def test_bad_tensors(x, exc, msg):
    with pytest.raises(exc, match=msg):
        quantize(x, 4)


def test_range_overflow_is_an_error():
    with pytest.raises(ValueError, match="overflows"):
        quantize(torch.tensor([-3e38, 3e38]), 8)


# ------------------------------------------------------------------ hadamard


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 128])
def test_hadamard_orthonormal(n):
    h = hadamard(n, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(h.abs(), torch.full((n, n), 1 / math.sqrt(n), dtype=torch.float64))
    assert hadamard(n).dtype == torch.float32


@pytest.mark.parametrize("n", [0, 3, 48, 96])
def test_hadamard_rejects_non_power_of_two(n):
    with pytest.raises(ValueError, match=f"power of two \\(got {n}\\)"):
        hadamard(n)


def test_hadamard_spreads_an_outlier_channel():
    x = torch.randn(1, 1, 256, 64)
    x[..., 5] *= 50  # one outlier channel, as in real keys
    h = hadamard(64)
    plain = (quantize(x, 4, axis=-1).dequantize() - x).pow(2).mean()
    rotated = (quantize(x @ h, 4, axis=-1).dequantize() @ h.T - x).pow(2).mean()
    assert rotated < 0.5 * plain


def test_fp16_metadata_kept_for_ordinary_data():
    # regression: the float32 quotient (max - offset) / qmax can round down onto a float16 value,
    # leaving offset + qmax * scale a hair below max in about one group in thousands; that must
    # not send the whole tensor to float32 metadata
    x = torch.randn(8, 3, 1024, 64, generator=torch.Generator().manual_seed(0)) * 3
    for bits, axis in itertools.product(BITS, (-1, -2)):
        q = quantize(x, bits, axis=axis)
        assert q.scale_dtype == torch.float16, (bits, axis)
        assert q.bits_per_element == pytest.approx(bits + 2 * 16 / x.shape[axis])


# ------------------------------------------------------------------ KV recipes


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
    with pytest.raises(ValueError, match="does not divide"):
        quantize_kv(k, v, KVRecipe(value_group_size=48))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_kv(k.masked_fill(k > 2, float("nan")), v, KVRecipe())


def test_recipe_labels():
    assert KVRecipe(16).label == "fp16"
    assert KVRecipe(4, -2, -1, key_group_size=32, residual=128).label == "K/ch V/tok 4b r128"
    assert KVRecipe(2, -1, -1, rotate=True, sinks=4).label == "K/tok V/tok 2b H s4"
    assert KVRecipe(4, name="KIVI").label == "KIVI"


# --- whole-row block operations (what kvlib.cache builds its blocks with) ---------------------


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    symmetric=st.booleans(),
    n1=st.integers(1, 3),
    n2=st.integers(1, 3),
    rows=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_cat_equals_quantizing_the_concatenation(bits, symmetric, n1, n2, rows, seed):
    """Rows never share a scale, so concatenating quantized rows is exact."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n1, rows, 16, 8, generator=g)
    b = torch.randn(n2, rows, 16, 8, generator=g) * 3
    qa = quantize(a, bits, axis=2, group_size=8, symmetric=symmetric).with_rows(2)
    qb = quantize(b, bits, axis=2, group_size=8, symmetric=symmetric).with_rows(2)
    whole = quantize(torch.cat([a, b]), bits, axis=2, group_size=8, symmetric=symmetric)
    joined = qa.cat(qb, dim=0)
    assert joined.shape == whole.shape and joined.nbytes == qa.nbytes + qb.nbytes
    assert torch.equal(joined.codes(), whole.codes())
    assert torch.equal(joined.dequantize(), whole.dequantize())


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    symmetric=st.booleans(),
    index=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_index_select_moves_codes_and_metadata_together(bits, symmetric, index, seed):
    x = torch.randn(2, 4, 32, 8, generator=torch.Generator().manual_seed(seed))
    q = quantize(x, bits, axis=3, group_size=4, symmetric=symmetric).with_rows(2)
    idx = torch.tensor(index)
    picked = q.index_select(1, idx)
    assert picked.shape == (2, len(index), 32, 8)
    assert torch.equal(picked.dequantize(), q.dequantize().index_select(1, idx))
    mask = torch.tensor([True, False, True, True])
    assert torch.equal(q.index_select(1, mask).dequantize(), q.dequantize()[:, mask])


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("symmetric", [False, True])
def test_dequantize_into_a_strided_view(bits, symmetric):
    x = torch.randn(3, 2, 16, 8, generator=torch.Generator().manual_seed(bits))
    q = quantize(x, bits, axis=2, group_size=8, symmetric=symmetric)
    buffer = torch.zeros(2, 8, 3, 16)  # the view below is (3, 2, 16, 8) and not contiguous
    view = buffer.permute(2, 0, 3, 1)
    assert q.dequantize_into(view) is view
    assert torch.equal(view, q.dequantize())


def test_block_operations_reject_bad_input():
    x = torch.randn(2, 3, 16, 8)
    q = quantize(x, 4, axis=2, group_size=8)
    with pytest.raises(ValueError, match="ndim must be an int in 0..2"):
        q.with_rows(3)
    with pytest.raises(ValueError, match="packing words"):
        quantize(torch.randn(2, 3, 3), 3, axis=2, group_size=3).with_rows(2)
    rows = q.with_rows(2)
    with pytest.raises(ValueError, match="row axes"):
        rows.cat(rows, dim=2)
    with pytest.raises(ValueError, match="different bits"):
        rows.cat(quantize(x, 8, axis=2, group_size=8).with_rows(2))
    with pytest.raises(ValueError, match="differ outside dim"):
        rows.cat(quantize(torch.randn(2, 4, 16, 8), 4, axis=2, group_size=8).with_rows(2))
    with pytest.raises(TypeError):
        rows.cat(x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shape"):
        q.dequantize_into(torch.empty(2, 3, 16, 4))
    with pytest.raises(TypeError):
        q.dequantize_into(torch.empty(2, 3, 16, 8, dtype=torch.int32))
