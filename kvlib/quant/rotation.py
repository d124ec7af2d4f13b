"""Orthonormal rotations of head_dim, applied to keys (and values) before quantizing.

A rotation ``R`` (``R @ R.T == I``) changes no inner product, ``(q @ R) · (k @ R) == q · k``, so
attention can read rotated keys once they are rotated back (``k_hat @ R.T``) or the query is
rotated alike. What it changes is how the values spread over channels:

* :func:`hadamard` (notebook 03, kvlib's KIVI caches) spreads an outlier channel over all
  channels, so one group's scale no longer has to cover it;
* :func:`random_orthogonal` (a Haar-random rotation) makes every coordinate of a rotated unit
  vector follow one known distribution whatever the vector was
  (:func:`kvlib.quant.codebook.sphere_codebook`): what lets a fixed, data-oblivious codebook
  quantize it (TurboQuant's paper);
* :func:`randomized_hadamard` (random signs, then a Hadamard matrix) is the cheap stand-in
  (QuaRot): ``O(d log d)`` with a fast transform and ``d`` bits of seed instead of ``d**2``
  floats. vLLM's TurboQuant cache uses the plain :func:`hadamard` (its codebook is symmetric,
  so the signs change nothing on average).

:func:`rotate` and :func:`unrotate` are the one place kvlib multiplies by a rotation.
Matrices are built in float64 and returned in the requested dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvlib.validate import check_int

__all__ = [
    "hadamard",
    "random_orthogonal",
    "randomized_hadamard",
    "rotate",
    "unrotate",
]


def _check_dtype(dtype: Any) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype (got {dtype})")
    return dtype


def _hadamard64(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def _check_pow2(n: Any) -> int:
    n = check_int(n, "n")
    if n < 1 or n & (n - 1):
        raise ValueError(f"n must be a power of two (got {n})")
    return n


def hadamard(
    n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """Orthonormal ``(n, n)`` Hadamard matrix (Sylvester construction), ``H @ H.T == I``.

    Rotating head_dim with it (``x @ H``) before quantizing spreads an outlier channel over all
    channels; ``x_hat @ H.T`` rotates back.

    Raises:
        ValueError: ``n`` is not a power of two.
        TypeError: ``dtype`` is not a floating-point dtype.
    """
    n = _check_pow2(n)
    dtype = _check_dtype(dtype)
    return _hadamard64(n).to(dtype=dtype, device=device)


def _generator(seed: Any) -> torch.Generator:
    seed = check_int(seed, "seed", minimum=0)
    return torch.Generator().manual_seed(seed)


def random_orthogonal(
    n: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A Haar-random orthonormal ``(n, n)`` matrix, the same for the same ``seed`` on every
    machine (drawn on the CPU in float64).

    It is the QR factor ``Q`` of a standard Gaussian matrix with the signs of ``R``'s diagonal
    moved into ``Q`` (without that step ``Q`` is not uniformly distributed; Mezzadri 2007).

    Raises:
        ValueError: ``n`` < 1 or ``seed`` < 0.
        TypeError: ``dtype`` is not a floating-point dtype.
    """
    n = check_int(n, "n", minimum=1)
    dtype = _check_dtype(dtype)
    g = torch.randn(n, n, generator=_generator(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.to(dtype=dtype, device=device)


def randomized_hadamard(
    n: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``diag(s) @ H``: random signs ``s`` (from ``seed``), then the orthonormal Hadamard
    matrix. Orthonormal; ``x @ R`` flips the signs of ``x``'s channels, then mixes them.

    Raises:
        ValueError: ``n`` is not a power of two, or ``seed`` < 0.
        TypeError: ``dtype`` is not a floating-point dtype.
    """
    n = _check_pow2(n)
    dtype = _check_dtype(dtype)
    signs = torch.randint(0, 2, (n,), generator=_generator(seed), dtype=torch.int64) * 2 - 1
    return (signs.to(torch.float64).unsqueeze(1) * _hadamard64(n)).to(dtype=dtype, device=device)


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x @ rotation`` in float32: ``x`` ``(..., d)``, ``rotation`` ``(d, d)`` (moved to
    ``x``'s device). Returns ``(..., d)`` float32."""
    return x.float() @ rotation.to(device=x.device)


def unrotate(y: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``y @ rotation.T`` in ``y``'s dtype (the inverse of :func:`rotate`): ``y`` ``(..., d)``.
    Returns ``(..., d)``."""
    return y @ rotation.T.to(device=y.device, dtype=y.dtype)
