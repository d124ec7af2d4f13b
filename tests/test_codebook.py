"""kvlib.quant.codebook: Lloyd-Max levels against Max's table, brute force and sampling."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.quant.codebook import (
    CODEBOOK_BITS,
    gaussian_codebook,
    lloyd_max,
    sphere_codebook,
)
from kvlib.quant.rotation import random_orthogonal

# Max (1960), Table I: the positive levels and the MSE of the optimal quantizer of N(0, 1)
MAX_1960 = {
    1: ([0.7979], 0.3634),
    2: ([0.4528, 1.510], 0.1175),
    3: ([0.2451, 0.7560, 1.344, 2.152], 0.03454),
    4: ([0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733], 0.009497),
}


@pytest.mark.parametrize("bits", CODEBOOK_BITS)
def test_gaussian_levels_are_maxs_table(bits: int) -> None:
    cb = gaussian_codebook(bits)
    positive, mse = MAX_1960[bits]
    assert cb.size == 2**bits and cb.levels.shape == (2**bits,)
    torch.testing.assert_close(
        cb.levels[2 ** (bits - 1) :], torch.tensor(positive, dtype=torch.float64), atol=6e-4, rtol=0
    )
    torch.testing.assert_close(cb.levels, -cb.levels.flip(0), atol=1e-8, rtol=0)  # symmetric
    assert cb.mse == pytest.approx(mse, rel=1e-3)
    torch.testing.assert_close(cb.boundaries, (cb.levels[1:] + cb.levels[:-1]) / 2)


def _kmeans_1d(samples: torch.Tensor, levels: torch.Tensor, steps: int = 200) -> torch.Tensor:
    """Lloyd's algorithm on samples (the brute-force reference)."""
    for _ in range(steps):
        cell = torch.bucketize(samples, (levels[1:] + levels[:-1]) / 2)
        levels = torch.stack([samples[cell == i].mean() for i in range(levels.numel())])
    return levels


@pytest.mark.parametrize("bits", [2, 3])
def test_levels_match_kmeans_on_samples(bits: int) -> None:
    """An asymmetric density (an exponential): the grid solution and k-means on 400k draws of
    it agree to the sampling error."""
    cb = lloyd_max(lambda x: torch.exp(-x), bits, (0.0, 30.0), name="exp(1)")
    g = torch.Generator().manual_seed(0)
    samples = torch.empty(400_000, dtype=torch.float64).exponential_(generator=g)
    ref = _kmeans_1d(samples, cb.levels.clone())
    torch.testing.assert_close(cb.levels, ref, atol=0.02, rtol=0.01)
    err = (cb.decode(cb.encode(samples), torch.float64) - samples).pow(2).mean()
    assert float(err) == pytest.approx(cb.mse, rel=0.02)


def test_sphere_codebook_tends_to_the_gaussian_one() -> None:
    for bits in (2, 4):
        gauss = gaussian_codebook(bits)
        gaps = [
            float((sphere_codebook(bits, d).levels * math.sqrt(d) - gauss.levels).abs().max())
            for d in (16, 64, 256)
        ]
        assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 0.03
        # in few dimensions the coordinate has lighter tails: outer levels sit further in
        assert float(sphere_codebook(bits, 16).levels[-1]) * 4 < float(gauss.levels[-1])


@pytest.mark.parametrize("bits", [2, 3])
def test_sphere_mse_is_what_rotated_unit_vectors_get(bits: int) -> None:
    """Any fixed unit vector, rotated by Haar-random matrices, has coordinates of exactly the
    sphere density: the codebook's predicted error is the measured one."""
    d = 32
    cb = sphere_codebook(bits, d)
    x = torch.zeros(d, dtype=torch.float64)
    x[0] = 1.0  # the worst case for a uniform quantizer: all energy in one channel
    y = torch.stack([x @ random_orthogonal(d, s, dtype=torch.float64) for s in range(600)])
    err = (cb.decode(cb.encode(y), torch.float64) - y).pow(2).mean()
    assert float(err) == pytest.approx(cb.mse, rel=0.08)
    # a coordinate of a 32-d unit vector has lighter tails than a Gaussian: a little less error
    assert 0.9 * gaussian_codebook(bits).mse < cb.mse * d < gaussian_codebook(bits).mse


@given(
    bits=st.sampled_from(CODEBOOK_BITS),
    values=st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=1, max_size=50),
)
@settings(max_examples=60, deadline=None)
def test_encode_picks_the_nearest_level(bits: int, values: list[float]) -> None:
    cb = gaussian_codebook(bits)
    x = torch.tensor(values, dtype=torch.float32)
    codes = cb.encode(x)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    got = (cb.decode(codes, torch.float64) - x.double()).abs()
    best = (cb.levels.unsqueeze(0) - x.double().unsqueeze(1)).abs().min(1).values
    assert bool((got <= best + 1e-6).all())


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: gaussian_codebook(5), ValueError, "bits must be one of"),
        (lambda: gaussian_codebook(True), ValueError, "bits must be one of"),
        (lambda: sphere_codebook(2, 2), ValueError, "dim"),
        (lambda: lloyd_max(lambda x: x * 0, 2, (0, 1)), ValueError, "zero everywhere"),
        (lambda: lloyd_max(lambda x: -x, 2, (0, 1)), ValueError, "non-negative"),
        (lambda: lloyd_max(lambda x: torch.ones(3), 2, (0, 1)), ValueError, "one finite"),
        (lambda: lloyd_max(lambda x: x, 2, (1, 0)), ValueError, "lo < hi"),
        (lambda: lloyd_max(lambda x: x, 2, "ab"), ValueError, "pair of numbers"),
        (lambda: gaussian_codebook(2).encode(torch.tensor([1, 2])), TypeError, "floating"),
        (
            lambda: gaussian_codebook(2).encode(torch.tensor([math.nan])),
            ValueError,
            "NaN",
        ),
    ],
)
def test_bad_arguments_are_refused(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()
