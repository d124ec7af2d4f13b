"""Lloyd–Max codebooks: the best ``2**bits`` reconstruction levels for a known distribution.

Integer quantization (:mod:`kvlib.quant.tensor`) spaces its levels evenly between a group's
minimum and maximum and stores that range per group. If the distribution of the values is
known in advance, neither is needed: the levels can be placed where the values are dense, once,
and shared by every vector. The mean-squared-error-optimal scalar quantizer of a density
``f`` satisfies two conditions (Lloyd 1957/1982, Max 1960):

* each boundary lies half way between its two neighbouring levels (nearest level wins);
* each level is the mean of ``f`` over its cell (the centroid).

:func:`lloyd_max` alternates the two until the levels stop moving. It integrates ``f`` on a
fine grid in float64, so it serves any density; :func:`gaussian_codebook` (the standard normal,
whose optimal levels Max tabulated) and :func:`sphere_codebook` (one coordinate of a uniformly
random unit vector in ``dim`` dimensions, the Beta-type density
``∝ (1 - x**2) ** ((dim - 3) / 2)`` on ``[-1, 1]``) are the two the series uses. After a random
rotation (:func:`kvlib.quant.rotation.random_orthogonal`) every coordinate of a unit vector
follows the second, whatever the vector was: that is why one fixed codebook can quantize every
key (TurboQuant, as vLLM ships it).

A :class:`Codebook` encodes with the boundaries (``torch.bucketize``) and decodes by looking
up the level; its ``mse`` is the expected squared error per value under its density.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvlib.validate import check_int

__all__ = [
    "CODEBOOK_BITS",
    "Codebook",
    "gaussian_codebook",
    "lloyd_max",
    "sphere_codebook",
]

#: Bit widths a codebook is built for (2 to 16 levels).
CODEBOOK_BITS: tuple[int, ...] = (1, 2, 3, 4)

_GRID = 1 << 16  # integration points (trapezoid rule; levels accurate to ~1e-8)


@dataclass(frozen=True)
class Codebook:
    """A scalar quantizer with ``2**bits`` levels.

    Attributes:
        bits: bits per code.
        levels: ``(2**bits,)`` float64 reconstruction levels, increasing.
        boundaries: ``(2**bits - 1,)`` float64 cell boundaries, the midpoints of neighbouring
            levels.
        mse: expected squared error per value under ``distribution``.
        distribution: what the levels were fitted to (for tables and errors).
    """

    bits: int
    levels: torch.Tensor
    boundaries: torch.Tensor
    mse: float
    distribution: str

    @property
    def size(self) -> int:
        """Number of levels, ``2**bits``."""
        return 1 << self.bits

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Index of the nearest level for every element of ``x`` (any shape), as uint8 codes of
        the same shape (ties go to the upper level).

        Raises:
            TypeError: ``x`` is not a floating tensor.
            ValueError: ``x`` holds NaN or Inf.
        """
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise TypeError(f"x must be a floating torch.Tensor (got {getattr(x, 'dtype', x)!r})")
        if x.numel() and not bool(torch.isfinite(x).all()):
            raise ValueError("x contains NaN or Inf")
        b = self.boundaries.to(device=x.device, dtype=torch.float32)
        return torch.bucketize(x.float(), b, right=True).to(torch.uint8)

    def decode(
        self, codes: torch.Tensor, dtype: torch.dtype = torch.float32, scale: float = 1.0
    ) -> torch.Tensor:
        """The levels of ``codes`` (any shape, integers ``0 .. 2**bits - 1``) in ``dtype``, each
        times ``scale`` (the levels are scaled once, before the lookup: the same floats)."""
        levels = self.levels.to(device=codes.device, dtype=dtype)
        if scale != 1.0:
            levels = levels * scale
        # index_select on the flat codes: measured 4x faster on CPU than levels[codes]
        return levels.index_select(0, codes.reshape(-1).to(torch.int32)).view(codes.shape)


def _check_codebook_bits(bits: Any) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in CODEBOOK_BITS:
        raise ValueError(f"bits must be one of {CODEBOOK_BITS} (got {bits!r})")
    return bits


def _check_support(support: Any) -> tuple[float, float]:
    """``(lo, hi)`` as floats, finite, ``lo < hi``."""
    try:
        lo, hi = (float(v) for v in support)
    except (TypeError, ValueError):
        raise ValueError(f"support must be a pair of numbers (got {support!r})") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"support must be finite with lo < hi (got {support!r})")
    return lo, hi


def _grid_moments(
    density: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, lo: float, hi: float
) -> torch.Tensor:
    """``(3, grid)`` cumulative integrals of ``f``, ``x f`` and ``x² f`` at the grid points ``x``
    ``(grid,)``, normalised by the integral of ``f`` (trapezoid rule, float64)."""
    f = torch.as_tensor(density(x), dtype=torch.float64)
    if f.shape != x.shape or not bool(torch.isfinite(f).all()) or bool((f < 0).any()):
        raise ValueError("density must return one finite, non-negative value per point")
    # cumulative integrals of f, x f and x^2 f at the grid points (trapezoid rule), read
    # between grid points by linear interpolation, so that a cell's moments move smoothly with
    # its boundaries (the iteration then converges instead of hopping between grid points)
    dx = (hi - lo) / (_GRID - 1)

    def cumulative(g: torch.Tensor) -> torch.Tensor:
        return torch.cat([g.new_zeros(1), torch.cumsum((g[1:] + g[:-1]) * (dx / 2), 0)])

    total = float(cumulative(f)[-1])
    if total <= 0:
        raise ValueError("density is zero everywhere on the support")
    return torch.stack([cumulative(f * x**k) / total for k in range(3)])  # (3, grid)


def _cell_sums(
    moments: torch.Tensor, edges: torch.Tensor, lo: float, hi: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mass, first and second moment of each of the ``len(edges) + 1`` cells, each ``(n,)``,
    from the ``(3, grid)`` cumulative ``moments`` on ``[lo, hi]``."""
    dx = (hi - lo) / (_GRID - 1)
    # the three cumulative moments at the edges (inside the support), (3, n - 1)
    pos = ((edges - lo) / dx).clamp(0, _GRID - 1)
    i = pos.floor().long().clamp(max=_GRID - 2)
    frac = pos - i
    at = moments[:, i] * (1 - frac) + moments[:, i + 1] * frac
    c = torch.cat([moments[:, :1], at, moments[:, -1:]], dim=1)
    d = c[:, 1:] - c[:, :-1]
    return d[0], d[1], d[2]


def lloyd_max(
    density: Callable[[torch.Tensor], torch.Tensor],
    bits: int,
    support: tuple[float, float],
    *,
    name: str = "custom",
    tol: float = 1e-13,
    max_iter: int = 10_000,
) -> Codebook:
    """The MSE-optimal ``bits``-bit scalar quantizer of ``density`` on ``support``.

    Args:
        density: ``f(x)`` for a float64 tensor of points, non-negative (it need not integrate
            to one: it is normalised on the grid).
        bits: one of :data:`CODEBOOK_BITS`.
        support: ``(lo, hi)``, finite, ``lo < hi``; the density is taken as 0 outside.
        name: what the codebook is for (kept in :attr:`Codebook.distribution`).
        tol: stop once no level moves by more than ``tol`` times the support's width.
        max_iter: give up (``RuntimeError``) after this many iterations.

    Starts from the density's quantiles at ``(i + 1/2) / 2**bits`` and alternates the nearest-
    level and centroid conditions (each step lowers the MSE, so the levels converge).

    Raises:
        ValueError: bad ``bits`` or ``support``, or a density that is negative, not finite or
            zero everywhere on the support.
        RuntimeError: no convergence in ``max_iter`` iterations.
    """
    bits = _check_codebook_bits(bits)
    lo, hi = _check_support(support)
    x = torch.linspace(lo, hi, _GRID, dtype=torch.float64)
    moments = _grid_moments(density, x, lo, hi)
    n = 1 << bits
    q = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    idx = torch.searchsorted(moments[0].contiguous(), q).clamp(max=_GRID - 1)
    levels = x[idx]

    for _ in range(max_iter):
        edges = (levels[1:] + levels[:-1]) / 2
        mass, m1, _m2 = _cell_sums(moments, edges, lo, hi)
        new = torch.where(mass > 0, m1 / mass.clamp(min=1e-300), levels)
        moved = float((new - levels).abs().max())
        levels = new
        if moved <= tol * (hi - lo):
            break
    else:
        raise RuntimeError(f"lloyd_max did not converge in {max_iter} iterations")
    edges = (levels[1:] + levels[:-1]) / 2
    mass, m1, m2 = _cell_sums(moments, edges, lo, hi)
    mse = float((m2 - 2 * levels * m1 + levels * levels * mass).sum())
    return Codebook(bits, levels, edges, mse, name)


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x)


@functools.cache
def gaussian_codebook(bits: int) -> Codebook:
    """Lloyd–Max levels of the standard normal distribution (Max 1960's table: 1 bit
    ``±0.7979`` with MSE 0.3634, 2 bits ``±0.4528, ±1.510`` with MSE 0.1175).

    Raises:
        ValueError: ``bits`` not in :data:`CODEBOOK_BITS`.
    """
    return lloyd_max(_normal_pdf, bits, (-12.0, 12.0), name="normal(0, 1)")


@functools.cache
def sphere_codebook(bits: int, dim: int) -> Codebook:
    """Lloyd–Max levels of one coordinate of a uniformly random unit vector in ``dim``
    dimensions: density ``∝ (1 - x**2) ** ((dim - 3) / 2)`` on ``[-1, 1]``, variance
    ``1 / dim``; as ``dim`` grows, ``sqrt(dim)`` times these levels tend to
    :func:`gaussian_codebook`'s.

    Raises:
        ValueError: ``bits`` not in :data:`CODEBOOK_BITS`, or ``dim`` < 3.
    """
    dim = check_int(dim, "dim", minimum=3)
    bits = _check_codebook_bits(bits)
    half = (dim - 3) / 2

    def density(x: torch.Tensor) -> torch.Tensor:
        return (1 - x * x).clamp(min=0) ** half

    # the mass beyond 12 standard deviations is negligible (below 1e-30): integrate there only
    edge = min(1.0, 12 / math.sqrt(dim))
    return lloyd_max(density, bits, (-edge, edge), name=f"unit sphere coordinate, dim {dim}")
