"""Tests for kvlib.quant.tensor: the half-step guarantee, metadata accounting, bad input, rotation and
whole-row block operations (bit-packing itself: tests/test_packing.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlib.quant.rotation import hadamard
from kvlib.quant.tensor import QuantizedTensor, quantize

BITS = (2, 3, 4, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
@example(  # fp16 values of ~1e-4 are subnormal: their rounding is absolute, not relative
    case=dict(shape=(8, 4, 6), axis=0, group_size=4, bits=8, symmetric=False,
              dtype=torch.float16, magnitude=1e-4, shift=0.0, seed=3677)
)  # fmt: skip
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
    # (relative for normal numbers, one subnormal spacing near zero: fp16 values of ~1e-4 are
    # subnormal) and float32 arithmetic slack
    fi = torch.finfo(x.dtype)
    tol = 0.5 * ideal * (1 + 2**-6) + amax * (fi.eps + 8 * 2**-24) + fi.tiny * fi.eps
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
            r"group_size must divide axis -1 of length 64 \(got 48; accepted: 1, 2, 4, 8, 16, 32, 64\)",
        ),
        (dict(bits=4, group_size=0), ValueError, "must divide axis"),
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


# --- whole-row block operations (what kvlib.caches.quantized builds its blocks with) ---------------------


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
