"""kvlib.quant.rotation: orthonormal rotations, their seeds, and the one rotate/unrotate pair."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.quant.rotation import (
    hadamard,
    random_orthogonal,
    randomized_hadamard,
    rotate,
    unrotate,
)

BUILDERS = {
    "hadamard": lambda n, seed: hadamard(n, dtype=torch.float64),
    "random_orthogonal": lambda n, seed: random_orthogonal(n, seed, dtype=torch.float64),
    "randomized_hadamard": lambda n, seed: randomized_hadamard(n, seed, dtype=torch.float64),
}


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@given(log_n=st.integers(0, 8), seed=st.integers(0, 2**31))
@settings(max_examples=20, deadline=None)
def test_every_rotation_is_orthonormal(kind: str, log_n: int, seed: int) -> None:
    r = BUILDERS[kind](1 << log_n, seed)
    eye = torch.eye(1 << log_n, dtype=torch.float64)
    torch.testing.assert_close(r @ r.T, eye, atol=1e-12, rtol=0)
    torch.testing.assert_close(r.T @ r, eye, atol=1e-12, rtol=0)


def test_seeds_give_the_same_matrix_and_different_seeds_differ() -> None:
    for build in (random_orthogonal, randomized_hadamard):
        assert torch.equal(build(64, 7), build(64, 7))
        assert not torch.equal(build(64, 7), build(64, 8))
    # the seed draws only signs: rows of the randomized Hadamard are +-rows of H
    r, h = randomized_hadamard(64, 3, dtype=torch.float64), hadamard(64, dtype=torch.float64)
    ratio = (r / h)[:, 0]
    assert set(ratio.tolist()) == {-1.0, 1.0}
    torch.testing.assert_close(r, ratio.unsqueeze(1) * h, atol=0, rtol=0)


def test_haar_rotation_spreads_a_basis_vector_evenly() -> None:
    """Uniform rotations take e_1 to a uniformly random unit vector: over many seeds, each
    coordinate has mean 0 and variance 1/d (the sign fix of the QR factor matters here: without
    it the diagonal of Q is biased positive)."""
    d, n = 16, 2000
    first = torch.stack([random_orthogonal(d, s, dtype=torch.float64)[0] for s in range(n)])
    assert abs(float(first[:, 0].mean())) < 4 / (d * n) ** 0.5
    var = first.pow(2).mean(0)
    assert float((var * d - 1).abs().max()) < 0.2


def test_rotate_then_unrotate_is_the_identity_and_keeps_inner_products() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 32, generator=g)
    q = torch.randn(2, 3, 1, 32, generator=g)
    for r in (hadamard(32), random_orthogonal(32, 1), randomized_hadamard(32, 2)):
        y = rotate(x, r)
        assert y.dtype == torch.float32 and y.shape == x.shape
        torch.testing.assert_close(unrotate(y, r), x, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            rotate(q, r) @ y.transpose(-1, -2), q @ x.transpose(-1, -2), atol=1e-4, rtol=0
        )


def test_hadamard_is_sylvesters_matrix() -> None:
    h = hadamard(4, dtype=torch.float64) * 2
    expected = torch.tensor(
        [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float64
    )
    assert torch.equal(h, expected)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: hadamard(48), ValueError, "power of two"),
        (lambda: randomized_hadamard(0), ValueError, "power of two"),
        (lambda: random_orthogonal(0), ValueError, "n must be"),
        (lambda: random_orthogonal(8, -1), ValueError, "seed"),
        (lambda: random_orthogonal(8, 1.5), TypeError, "seed"),
        (lambda: hadamard(8, dtype=torch.int32), TypeError, "dtype"),
        (lambda: random_orthogonal(8, dtype="float32"), TypeError, "dtype"),
    ],
)
def test_bad_arguments_are_refused(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()
