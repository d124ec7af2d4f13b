"""kvlib.kvtc.bitalloc: allocations against brute force, and the per-component uniform quantizer."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.kvtc.bitalloc import (
    GAUSSIAN_UNIFORM_DISTORTION,
    MAX_BITS,
    allocate_bits,
    allocate_bits_dp,
    calibrate_uniform_quantizer,
    uniform_dequantize,
    uniform_quantize,
)


def _brute(table: torch.Tensor, budget: int) -> float:
    n, nb = table.shape
    best = float("inf")
    for bits in itertools.product(range(nb), repeat=n):
        if sum(bits) <= budget:
            best = min(best, float(sum(table[j, b] for j, b in enumerate(bits))))
    return best


@settings(max_examples=40, deadline=None)
@given(
    var=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=4),
    budget=st.integers(0, 14),
    max_bits=st.integers(1, 4),
)
def test_greedy_matches_brute_force(var, budget, max_bits) -> None:
    v = torch.tensor(var, dtype=torch.float64)
    c = torch.tensor(GAUSSIAN_UNIFORM_DISTORTION[: max_bits + 1], dtype=torch.float64)
    table = v[:, None] * c[None]
    bits = allocate_bits(v, budget, max_bits=max_bits, unit_distortion=c)
    assert int(bits.sum()) <= budget and int(bits.max()) <= max_bits
    got = float(table[torch.arange(len(var)), bits].sum())
    assert got == pytest.approx(_brute(table, budget), rel=1e-9, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 4),
    nb=st.integers(1, 4),
    budget=st.integers(0, 12),
)
def test_dp_matches_brute_force_on_any_table(seed, n, nb, budget) -> None:
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(n, nb, generator=g, dtype=torch.float64)
    bits = allocate_bits_dp(table, budget)
    assert int(bits.sum()) <= budget
    assert float(table[torch.arange(n), bits].sum()) == pytest.approx(
        _brute(table, budget), rel=1e-9
    )


def test_bad_budgets_and_widths() -> None:
    with pytest.raises(ValueError, match="budget_bits"):
        allocate_bits(torch.ones(3), -1)
    with pytest.raises(TypeError, match="budget_bits"):
        allocate_bits(torch.ones(3), 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget_bits"):
        allocate_bits_dp(torch.ones(2, 3), -4)
    with pytest.raises(ValueError, match="max_bits"):
        allocate_bits(torch.ones(3), 4, max_bits=17)
    with pytest.raises(ValueError, match="max_bits"):
        allocate_bits(torch.ones(3), 4, max_bits=0)


def test_uniform_quantizer_codes_and_error_bound() -> None:
    z = torch.linspace(-4, 4, 401)[:, None].expand(-1, 3)
    bits = torch.tensor([1, 3, MAX_BITS])
    clip = torch.tensor([1.5, 2.0, 3.0])
    codes = uniform_quantize(z, bits, clip)
    assert codes.dtype == torch.int64 and int(codes.min()) == 0
    assert torch.equal(codes.amax(dim=0), 2**bits - 1)  # the range ends map to the end codes
    back = uniform_dequantize(codes, bits, clip)
    inside = z.abs() <= clip
    step = 2 * clip / 2**bits
    assert ((back - z).abs() <= step / 2 + 1e-6)[inside].all()  # midrise: half a step at most


def test_calibrated_quantizer_matches_max_table_on_gaussian() -> None:
    z = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    clip, c = calibrate_uniform_quantizer(z)
    assert clip.shape == c.shape == (MAX_BITS + 1,)
    assert c[0] == 1.0 and (c[1:] < c[:-1]).all()
    ref = torch.tensor(GAUSSIAN_UNIFORM_DISTORTION, dtype=torch.float64)
    # Max (1960): the optimal uniform quantizer of a unit Gaussian; ours searches the clip on a
    # 0.1σ grid over a finite sample, so it sits a few percent above the table.
    assert torch.allclose(c, ref, rtol=0.1), c
    assert clip[1] == pytest.approx(1.596, abs=0.1)  # 1 bit: levels at ±0.798σ
