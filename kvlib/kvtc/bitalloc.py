"""Bit allocation for transform coding (introduced in notebook 06).

After a PCA transform, component ``j`` of a token's key/value vector has variance ``σ_j²``.
Quantizing it with ``b`` bits costs ``b`` bits per token and leaves an expected squared error
``D_j(b) = σ_j² · c(b)``, where ``c`` is the normalised distortion of the scalar quantizer
(``c(0) = 1``: a dropped component loses all its variance; for a Gaussian source and an ideal
quantizer ``c(b) ≈ 2^(-2b)``). Given a total budget of ``R`` bits per token, which ``b_j``
minimise ``Σ_j D_j(b_j)`` subject to ``Σ_j b_j ≤ R``?

* :func:`allocate_bits` — greedy by marginal gain. Exact whenever every ``D_j`` is convex in
  ``b`` (each extra bit helps less than the one before), which holds for ``σ_j² · c(b)`` with a
  convex ``c``. It is the integer version of *reverse water-filling*: keep buying the bit with
  the largest error reduction.
* :func:`allocate_bits_dp` — dynamic programme over the budget; exact for any distortion table
  (convex or not), ``O(n · R · B)`` time.
* :func:`convexify` — turns a measured distortion curve into a convex, decreasing one (by
  capping each marginal gain at the previous one), so that the greedy method is exact for it.

The scalar quantizer whose ``c(b)`` the allocation trades off lives here too:

* :func:`uniform_quantize` / :func:`uniform_dequantize` — uniform midrise quantizer with ``2^b``
  levels on ``[-clip_b, clip_b]``, for coefficients normalised by their component's std.
* :func:`calibrate_uniform_quantizer` — the clip range per bit width that minimises the error on
  sample coefficients, and the measured (convexified) ``c(b)`` that goes with it.
"""

from __future__ import annotations

import torch

from kvlib.validate import check_int

__all__ = [
    "GAUSSIAN_UNIFORM_DISTORTION",
    "MAX_BITS",
    "allocate_bits",
    "allocate_bits_dp",
    "allocation_distortion",
    "calibrate_uniform_quantizer",
    "convexify",
    "uniform_dequantize",
    "uniform_quantize",
]

#: The widest code of the per-component quantizer (codes are stored one per byte).
MAX_BITS = 8

# Normalised MSE of the optimal *uniform* quantizer with 2^b levels for a unit Gaussian
# (Max 1960, Table 1 / Jayant & Noll), b = 0..8; b = 0 means "dropped".
GAUSSIAN_UNIFORM_DISTORTION: tuple[float, ...] = (
    1.0,
    0.3634,
    0.1188,
    0.03744,
    0.01154,
    0.003490,
    0.001035,
    0.0003000,
    0.00008700,
)


def _check_variances(variances: torch.Tensor) -> torch.Tensor:
    if not isinstance(variances, torch.Tensor):
        raise TypeError(f"variances must be a torch.Tensor (got {type(variances).__name__})")
    if variances.ndim != 1 or variances.numel() == 0:
        raise ValueError(
            f"variances must be a non-empty 1-D tensor, one per component (got shape {tuple(variances.shape)})"
        )
    v = variances.detach().to(torch.float64)
    if not torch.isfinite(v).all() or (v < 0).any():
        raise ValueError("variances must be finite and non-negative")
    return v


def convexify(distortion: torch.Tensor) -> torch.Tensor:
    """Make a distortion curve decreasing and convex in the number of bits.

    Args:
        distortion: ``(..., B + 1)`` distortion for ``b = 0..B`` bits.

    Returns:
        Same shape, float64: marginal gains ``D(b-1) - D(b)`` are clipped at 0 and capped at the
        previous gain (a running minimum), so the result is ``≥`` the input beyond ``b = 0``
        (pessimistic) and the greedy allocation is exact for it.
    """
    d = torch.as_tensor(distortion, dtype=torch.float64)
    if d.ndim == 0 or d.shape[-1] < 1:
        raise ValueError("distortion must have a last axis of length B + 1 >= 1")
    if d.shape[-1] == 1:
        return d.clone()
    gains = (d[..., :-1] - d[..., 1:]).clamp_min(0.0)
    gains = torch.cummin(gains, dim=-1).values
    return torch.cat([d[..., :1], d[..., :1] - torch.cumsum(gains, dim=-1)], dim=-1)


def allocate_bits(
    variances: torch.Tensor,
    budget_bits: int,
    max_bits: int = MAX_BITS,
    unit_distortion: torch.Tensor | tuple[float, ...] | None = None,
) -> torch.Tensor:
    """Greedy (marginal-gain) bit allocation; exact for a convex ``unit_distortion``.

    Args:
        variances: ``(n,)`` variance of each component (the axis reduced over is the tokens of
            the calibration set).
        budget_bits: total bits per token to spend (``Σ b_j ≤ budget_bits``).
        max_bits: the most bits one component may get (1..16).
        unit_distortion: ``(max_bits + 1,)`` normalised distortion ``c(b)`` with ``c(0)`` the
            loss of a dropped component (normally 1); default: the Gaussian uniform quantizer
            table :data:`GAUSSIAN_UNIFORM_DISTORTION`. It is made convex with :func:`convexify`.

    Returns:
        ``(n,)`` int64 bits per component, ``0`` meaning dropped. Bits are only spent where they
        reduce the distortion, so the budget may be left partly unused.
    """
    v = _check_variances(variances)
    budget = check_int(budget_bits, "budget_bits", minimum=0)
    if check_int(max_bits, "max_bits", minimum=1) > 16:
        raise ValueError(f"max_bits must be an int in 1..16 (got {max_bits!r})")
    if unit_distortion is None:
        if max_bits > len(GAUSSIAN_UNIFORM_DISTORTION) - 1:
            raise ValueError(
                f"the default distortion table covers up to 8 bits; pass unit_distortion for max_bits={max_bits}"
            )
        unit_distortion = GAUSSIAN_UNIFORM_DISTORTION[: max_bits + 1]
    c = torch.as_tensor(unit_distortion, dtype=torch.float64).flatten()
    if c.numel() != max_bits + 1:
        raise ValueError(
            f"unit_distortion must have max_bits + 1 = {max_bits + 1} entries (got {c.numel()})"
        )
    if not torch.isfinite(c).all():
        raise ValueError("unit_distortion must be finite")
    c = convexify(c)
    n = v.numel()
    # gains[j, b-1]: error removed by the b-th bit of component j; non-increasing in b.
    gains = v[:, None] * (c[:-1] - c[1:])[None, :]
    flat = gains.flatten()
    take = min(budget, int((flat > 0).sum()))
    bits = torch.zeros(n, dtype=torch.int64)
    if take == 0:
        return bits.to(variances.device)
    # Stable sort on -gain: among equal gains the lower (component, bit) index comes first, so a
    # component's bits are always taken in order 1, 2, ...
    order = torch.sort(-flat, stable=True).indices[:take]
    bits.index_add_(0, order // max_bits, torch.ones(take, dtype=torch.int64))
    return bits.to(variances.device)


def allocate_bits_dp(distortion: torch.Tensor, budget_bits: int) -> torch.Tensor:
    """Exact bit allocation for any distortion table, by dynamic programming over the budget.

    Args:
        distortion: ``(n, B + 1)`` expected error of component ``j`` with ``b = 0..B`` bits.
        budget_bits: total bits per token (``Σ b_j ≤ budget_bits``).

    Returns:
        ``(n,)`` int64 bits per component minimising ``Σ_j distortion[j, b_j]``.
    """
    if not isinstance(distortion, torch.Tensor):
        raise TypeError(f"distortion must be a torch.Tensor (got {type(distortion).__name__})")
    if distortion.ndim != 2 or distortion.shape[0] == 0 or distortion.shape[1] == 0:
        raise ValueError(
            f"distortion must have shape (n, B + 1) with n, B + 1 >= 1 (got {tuple(distortion.shape)})"
        )
    d = distortion.detach().to(torch.float64).cpu()
    if not torch.isfinite(d).all():
        raise ValueError("distortion must be finite")
    budget = min(check_int(budget_bits, "budget_bits", minimum=0), d.shape[0] * (d.shape[1] - 1))
    n, nb = d.shape
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    best = torch.zeros(budget + 1, dtype=torch.float64)  # best[c]: min error using <= c bits
    choice = torch.zeros(n, budget + 1, dtype=torch.int64)
    for j in range(n):
        cand = torch.full((nb, budget + 1), float("inf"), dtype=torch.float64)
        for b in range(nb):
            if b <= budget:
                cand[b, b:] = best[: budget + 1 - b] + d[j, b]
        cand = torch.where(torch.isnan(cand), inf, cand)
        best, choice[j] = cand.min(dim=0)
    bits = torch.zeros(n, dtype=torch.int64)
    c = budget
    for j in range(n - 1, -1, -1):
        bits[j] = choice[j, c]
        c -= int(bits[j])
    return bits.to(distortion.device)


def allocation_distortion(
    variances: torch.Tensor,
    bits: torch.Tensor,
    unit_distortion: torch.Tensor | tuple[float, ...] = GAUSSIAN_UNIFORM_DISTORTION,
) -> float:
    """Expected total squared error ``Σ_j σ_j² · c(b_j)`` of an allocation (per token)."""
    v = _check_variances(variances)
    if not isinstance(bits, torch.Tensor) or bits.shape != v.shape:
        raise ValueError(f"bits must be a tensor of shape {tuple(v.shape)}")
    c = torch.as_tensor(unit_distortion, dtype=torch.float64).flatten()
    b = bits.detach().cpu().long()
    if (b < 0).any() or (b >= c.numel()).any():
        raise ValueError(f"bits must be in 0..{c.numel() - 1}")
    return float((v.cpu() * c[b]).sum())


def uniform_quantize(z: torch.Tensor, bits: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
    """Uniform midrise quantizer on ``[-clip_b, clip_b]`` with ``2^b`` levels; ``z`` normalised by σ.

    Args:
        z: ``(n, r)`` coefficients, each divided by its component's std.
        bits: ``(r,)`` int64 bits per component (1..:data:`MAX_BITS`).
        clip: ``(r,)`` clipping range per component, in units of its std (broadcasts like
            ``bits``; a ``(g, 1)`` column quantizes ``z`` ``(1, n)`` with ``g`` clips at once).

    Returns:
        ``(n, r)`` int64 codes in ``0 .. 2^b - 1``.
    """
    levels = (2**bits).to(z.dtype)
    step = 2 * clip / levels
    return torch.clamp(
        torch.floor((z + clip) / step), min=torch.zeros_like(levels), max=levels - 1
    ).long()


def uniform_dequantize(codes: torch.Tensor, bits: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`uniform_quantize`: the midpoint of each code's cell.

    ``codes`` ``(n, r)``; ``bits``/``clip`` ``(r,)``. Returns ``(n, r)`` in ``clip``'s dtype.
    """
    levels = (2**bits).to(clip.dtype)
    step = 2 * clip / levels
    return (codes.to(clip.dtype) + 0.5) * step - clip


def calibrate_uniform_quantizer(
    z: torch.Tensor, max_bits: int = MAX_BITS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip range (in σ) and normalised MSE ``c(b)`` of :func:`uniform_quantize`, b = 0..max_bits.

    For every bit width the clip is chosen on a grid of 0.5σ..10σ to minimise the mean squared
    error over the sample; ``c`` is normalised so that ``c(0) = 1`` exactly (a dropped
    coefficient loses its whole variance) and made convex with :func:`convexify`.

    Args:
        z: ``(n,)`` sample of coefficients, each divided by its component's std.
        max_bits: the widest bit width calibrated.

    Returns:
        ``(clip (max_bits + 1,) float32, c (max_bits + 1,) float64)``; ``clip[0]`` is 0.
    """
    max_bits = check_int(max_bits, "max_bits", minimum=1)
    z = z.flatten().float()
    grid = torch.linspace(0.5, 10.0, 96)
    clip = torch.zeros(max_bits + 1)
    dist = torch.zeros(max_bits + 1, dtype=torch.float64)
    dist[0] = float((z.double() ** 2).mean())
    for b in range(1, max_bits + 1):
        bb = torch.full((1,), b, dtype=torch.int64)
        a = grid[:, None]  # every clip candidate at once: (grid, n)
        q = uniform_dequantize(uniform_quantize(z[None, :], bb, a), bb, a)
        errs = ((q - z[None, :]) ** 2).double().mean(dim=1)
        i = int(errs.argmin())
        clip[b], dist[b] = grid[i], errs[i]
    return clip, convexify(dist / dist[0])
