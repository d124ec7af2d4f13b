"""kvlib.bitalloc and kvlib.pca (fast checks without the model)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvlib import pca
from kvlib.bitalloc import GAUSSIAN_UNIFORM_DISTORTION, allocate_bits, allocate_bits_dp


def _brute(table: torch.Tensor, budget: int) -> float:
    n, nb = table.shape
    best = float("inf")
    for bits in itertools.product(range(nb), repeat=n):
        if sum(bits) <= budget:
            best = min(best, float(sum(table[j, b] for j, b in enumerate(bits))))
    return best


@pytest.mark.parametrize("seed", range(5))
def test_greedy_and_dp_match_brute_force(seed) -> None:
    g = torch.Generator().manual_seed(seed)
    var = torch.rand(4, generator=g, dtype=torch.float64) * 3
    c = torch.tensor(GAUSSIAN_UNIFORM_DISTORTION[:5], dtype=torch.float64)
    table = var[:, None] * c[None]
    for budget in (0, 3, 7, 16):
        bits = allocate_bits(var, budget, max_bits=4, unit_distortion=c)
        assert int(bits.sum()) <= budget
        got = float(table[torch.arange(4), bits].sum())
        assert got == pytest.approx(_brute(table, budget), rel=1e-9)
        rand = torch.rand(4, 5, generator=g, dtype=torch.float64)
        dp = allocate_bits_dp(rand, budget)
        assert float(rand[torch.arange(4), dp].sum()) == pytest.approx(
            _brute(rand, budget), rel=1e-9
        )


def test_rope_undo_redo_exact_inverse() -> None:
    k = torch.randn(1, 3, 50, 64)
    inv = 1.0 / (100000.0 ** (torch.arange(0, 64, 2).float() / 64))
    pos = torch.arange(100, 150)
    back = pca.undo_rope(pca.apply_rope(k, pos, inv), pos, inv)
    assert torch.allclose(back, k, atol=1e-5)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="budget_bits"):
        allocate_bits(torch.ones(3), -1)
    with pytest.raises(ValueError, match="positions"):
        pca.undo_rope(torch.randn(1, 1, 4, 8), torch.arange(3), torch.ones(4))
