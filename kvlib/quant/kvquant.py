"""KVQuant's codec: per-channel keys, non-uniform levels and a sparse table of outliers.

KVQuant (Hooper et al. 2024, arXiv 2401.18079) combines three ideas; kvlib builds each on a
block of ``T`` tokens of one KV head, ``x`` of shape ``(T, head_dim)``:

1. **Per-channel keys before RoPE.** Keys are quantized per channel, and before the rotary
   embedding: RoPE turns each channel pair by a position-dependent angle, which mixes a large
   channel into its partner and widens both ranges. The cache undoes RoPE before encoding and
   re-applies it after decoding (:mod:`kvlib.rope`; :mod:`kvlib.caches.kvquant`). Values are
   quantized per token.
2. **Dense-and-sparse.** The ``outlier_fraction`` of the block's entries that lie furthest from
   their channel's (keys) or token's (values) mean, in standard deviations, are kept exactly in a
   sparse table (a float16 value and an int16 position each); the others set the min/max of the
   dense codes, whose range therefore no longer stretches to reach the outliers.
3. **Non-uniform levels (nuq).** Instead of ``2**bits`` evenly spaced levels between min and max,
   ``nuq=True`` places them by Lloyd's algorithm (1-D k-means) on the block's own normalised
   entries: a codebook of ``2**bits`` float16 levels per block and head, stored with it. KVQuant
   fits its levels offline on calibration data, weighted by each entry's sensitivity (a Fisher
   estimate); kvlib fits them online, on the data they code, without weights, so its codebook is
   the MSE-optimal one for that block and costs ``16 · 2**bits`` bits per block.

Everything a block holds is counted in :attr:`SparseBlocks.nbytes`: packed codes, each
channel's (token's) float16 minimum and maximum, the codebook, and the outliers' values and
positions.

Shapes: blocks are kept along axis 2 of ``(batch, kv_heads, tokens, head_dim)`` states, so that
:class:`SparseBlocks` of one block each concatenate along it like the caches' other codes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvlib.quant.packing import pack_uint8, packed_nbytes, unpack
from kvlib.quant.presets import OUTLIER_FRACTION
from kvlib.validate import check_int

__all__ = ["AXES", "BITS", "KVQuantizer", "SparseBlocks", "decode_block", "encode_block"]

#: Bits per dense code.
BITS: tuple[int, ...] = (2, 3, 4)
#: ``"channel"``: one min/max per channel over the block's tokens (keys); ``"token"``: one per
#: token over its channels (values).
AXES: tuple[str, ...] = ("channel", "token")
#: Lloyd iterations of the non-uniform codebook (it starts from the uniform levels, and every
#: iteration lowers the squared error or leaves it unchanged).
LLOYD_ITERATIONS = 12
_TINY = 1e-12


@dataclass(frozen=True)
class SparseBlocks:
    """``n`` blocks of ``block`` tokens of ``(batch, kv_heads)`` heads, dense codes plus outliers.

    Attributes:
        codes: ``(batch, kv_heads, n, packed bytes per block)`` uint8.
        low, high: ``(batch, kv_heads, n, L)`` float16: the dense entries' minimum and maximum per
            channel (``L = head_dim``, axis ``"channel"``) or per token (``L = block``).
        levels: ``(batch, kv_heads, n, 2**bits)`` float16 sorted levels in ``[0, 1]`` (nuq), or
            ``None`` for the uniform ones ``j / (2**bits - 1)``.
        outlier_values: ``(batch, kv_heads, n, k)`` float16, kept exactly.
        outlier_index: ``(batch, kv_heads, n, k)`` int16 positions ``token * head_dim + channel``
            within the block.
        bits, axis, block, head_dim: how the codes were made.
    """

    codes: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    levels: torch.Tensor | None
    outlier_values: torch.Tensor
    outlier_index: torch.Tensor
    bits: int
    axis: str
    block: int
    head_dim: int

    _TENSORS = ("codes", "low", "high", "levels", "outlier_values", "outlier_index")

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in self._TENSORS if getattr(self, n) is not None}

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, minima and maxima, levels, outlier values and positions."""
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    @property
    def blocks(self) -> int:
        """Blocks held (``n``)."""
        return self.codes.shape[2]

    @property
    def shape(self) -> torch.Size:
        """The decoded states' shape ``(batch, kv_heads, n * block, head_dim)``."""
        b, h, n, _ = self.codes.shape
        return torch.Size((b, h, n * self.block, self.head_dim))

    def _check_dim(self, dim: Any) -> int:
        if isinstance(dim, bool) or dim not in (0, 1, 2):
            raise ValueError(f"dim must be 0 (batch), 1 (heads) or 2 (blocks) (got {dim!r})")
        return dim

    def cat(self, other: SparseBlocks, dim: int = 2) -> SparseBlocks:
        """``other``'s blocks after these along ``dim`` (2: the sequence), nothing re-encoded.

        Raises:
            TypeError / ValueError: not :class:`SparseBlocks` coded the same way.
        """
        if not isinstance(other, SparseBlocks):
            raise TypeError(f"other must be SparseBlocks (got {type(other).__name__})")
        dim = self._check_dim(dim)
        same = ("bits", "axis", "block", "head_dim")
        if any(getattr(self, a) != getattr(other, a) for a in same) or (
            (self.levels is None) != (other.levels is None)
        ):
            raise ValueError("cannot concatenate blocks coded with different settings")
        mine, theirs = self._tensors(), other._tensors()
        return replace(self, **{n: torch.cat([t, theirs[n]], dim) for n, t in mine.items()})

    def index_select(self, dim: int, index: torch.Tensor) -> SparseBlocks:
        """The rows at ``index`` along ``dim`` (0: batch rows, repeats allowed)."""
        dim = self._check_dim(dim)
        index = index.to(self.codes.device)
        return replace(self, **{n: t.index_select(dim, index) for n, t in self._tensors().items()})

    def to(self, device: torch.device | str) -> SparseBlocks:
        """The same blocks on ``device``."""
        return replace(self, **{n: t.to(device) for n, t in self._tensors().items()})


def _check_block(x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() != 4:
        raise TypeError(
            "states must be a 4-d floating tensor (batch, kv_heads, tokens, head_dim) "
            f"(got {getattr(x, 'shape', type(x).__name__)})"
        )
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("states contain NaN or Inf")
    if x.numel() and float(x.abs().max()) > torch.finfo(torch.float16).max:
        raise ValueError("states exceed float16's range: minima, maxima and outliers are float16")
    t, d = x.shape[2], x.shape[3]
    if t == 0 or d % 8:
        raise ValueError(f"a block needs tokens >= 1 and head_dim a multiple of 8 (got {t}, {d})")
    if t * d > 32768:
        raise ValueError(f"a block holds at most 32768 entries (int16 positions); got {t * d}")
    return x


def outlier_count(tokens: int, head_dim: int, fraction: float) -> int:
    """Outliers one block keeps per head: ``round(fraction * tokens * head_dim)``."""
    return round(fraction * tokens * head_dim)


def _lloyd(u: torch.Tensor, weight: torch.Tensor, levels: int) -> torch.Tensor:
    """Sorted levels ``(..., levels)`` from Lloyd's algorithm on ``u`` ``(..., N)`` in [0, 1]
    (entries of zero ``weight`` ignored), started from the uniform levels."""
    c = torch.linspace(0, 1, levels, dtype=u.dtype, device=u.device).expand(*u.shape[:-1], levels)
    c = c.contiguous()
    for _ in range(LLOYD_ITERATIONS):
        cell = torch.searchsorted((c[..., 1:] + c[..., :-1]).mul_(0.5).contiguous(), u)
        sums = torch.zeros_like(c).scatter_add_(-1, cell, u * weight)
        count = torch.zeros_like(c).scatter_add_(-1, cell, weight)
        c = torch.where(count > 0, sums / count.clamp(min=_TINY), c).sort(-1).values
    return c


def encode_block(
    x: torch.Tensor,
    bits: int,
    axis: str,
    outlier_fraction: float = OUTLIER_FRACTION,
    nuq: bool = True,
) -> SparseBlocks:
    """Encode one block ``(batch, kv_heads, T, head_dim)`` (see the module docstring).

    Raises:
        TypeError / ValueError: bad arguments, non-finite states or states beyond float16.
    """
    x = _check_block(x)
    bits = _check_bits(bits)
    _check_axis(axis)
    fraction = _check_fraction(outlier_fraction)
    b, h, t, d = x.shape
    x = x.float()
    flat = x.reshape(b, h, t * d)
    reduce = 2 if axis == "channel" else 3
    k = outlier_count(t, d, fraction)
    outlier = torch.zeros_like(flat, dtype=torch.bool)
    if k:
        mean = x.mean(reduce, keepdim=True)
        spread = x.std(reduce, keepdim=True, correction=0).clamp(min=_TINY)
        z = ((x - mean).abs() / spread).reshape(b, h, t * d)
        index = z.topk(k, dim=-1).indices.sort(-1).values
        outlier.scatter_(-1, index, True)
    else:
        index = flat.new_zeros((b, h, 0), dtype=torch.long)
    values = flat.gather(-1, index).half()
    mask = outlier.view(b, h, t, d)
    low = torch.where(mask, math.inf, x).amin(reduce)
    high = torch.where(mask, -math.inf, x).amax(reduce)
    empty = ~torch.isfinite(low)  # every entry of that channel/token is an outlier
    low, high = low.masked_fill(empty, 0).half(), high.masked_fill(empty, 0).half()
    lo, hi = low.float().unsqueeze(reduce), high.float().unsqueeze(reduce)
    u = ((x - lo) / (hi - lo).clamp(min=_TINY)).clamp(0, 1).reshape(b, h, t * d)
    n_levels = 1 << bits
    levels = None
    if nuq:
        levels = _lloyd(u, (~outlier).float(), n_levels).half()
        grid = levels.float()
    else:
        grid = torch.linspace(0, 1, n_levels).expand(b, h, n_levels)
    codes = torch.searchsorted((grid[..., 1:] + grid[..., :-1]).mul(0.5).contiguous(), u)
    packed = pack_uint8(codes.to(torch.uint8).contiguous(), bits).view(b, h, 1, -1)
    return SparseBlocks(
        packed,
        low.unsqueeze(2),
        high.unsqueeze(2),
        None if levels is None else levels.unsqueeze(2),
        values.unsqueeze(2),
        index.to(torch.int16).unsqueeze(2),
        bits,
        axis,
        t,
        d,
    )


def decode_block(
    enc: SparseBlocks, dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """States ``enc.shape`` ``(batch, kv_heads, n * block, head_dim)`` in ``dtype``.

    Args:
        out: where to write them, of ``enc.shape`` (any strides along the sequence, e.g. a slice
            of the tensor attention reads); its dtype wins over ``dtype``.

    Returns:
        The states (``out`` when given).
    """
    if not isinstance(enc, SparseBlocks):
        raise TypeError(f"enc must be SparseBlocks (got {type(enc).__name__})")
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != enc.shape):
        raise ValueError(f"out must be a tensor of shape {tuple(enc.shape)}")
    b, h, n, _ = enc.codes.shape
    t, d = enc.block, enc.head_dim
    codes = unpack(enc.codes.reshape(-1), enc.bits, b * h * n * t * d).view(b, h, n, t * d)
    if enc.levels is None:
        u = codes.float() / ((1 << enc.bits) - 1)
    else:
        u = enc.levels.float().gather(-1, codes.long())
    reduce = 3 if enc.axis == "channel" else 4
    lo = enc.low.float().unsqueeze(reduce)
    span = enc.high.float().unsqueeze(reduce) - lo
    # A float32 ``out`` is written in place (one pass, no copy); ``(n * block)`` splits into
    # ``(n, block)`` and ``(block, head_dim)`` merges even in a slice along the sequence.
    direct = out is not None and out.dtype == torch.float32
    x = out.view(b, h, n, t, d) if direct else torch.empty(b, h, n, t, d, device=u.device)
    torch.addcmul(lo, span, u.view(b, h, n, t, d), out=x)
    x.view(b, h, n, t * d).scatter_(-1, enc.outlier_index.long(), enc.outlier_values.float())
    if direct:
        return out
    if out is not None:
        return out.copy_(x.view(b, h, n * t, d))
    return x.view(b, h, n * t, d).to(dtype)


def block_nbytes(
    tokens: int, head_dim: int, bits: int, axis: str, fraction: float, nuq: bool
) -> int:
    """Bytes one block of one head takes (codes, minima and maxima, levels, outliers)."""
    lengths = head_dim if axis == "channel" else tokens
    levels = 2 * (1 << bits) if nuq else 0
    return (
        packed_nbytes(tokens * head_dim, bits)
        + 4 * lengths
        + levels
        + 4 * outlier_count(tokens, head_dim, fraction)
    )


def _check_bits(bits: Any) -> int:
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be one of {BITS} (got {bits!r})")
    return bits


def _check_axis(axis: Any) -> str:
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES} (got {axis!r})")
    return axis


def _check_fraction(fraction: Any) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError(f"outlier_fraction must be a number (got {type(fraction).__name__})")
    if not 0 <= fraction < 0.5:
        raise ValueError(f"outlier_fraction must be in [0, 0.5) (got {fraction})")
    return float(fraction)


class KVQuantizer:
    """Keys per channel, values per token, both dense-and-sparse (see the module docstring).

    The layer (:class:`kvlib.caches.kvquant.KVQuantLayer`) passes one block of tokens at a time,
    keys with RoPE already undone.

    Args:
        head_dim: channels per head, a multiple of 8.
        key_bits, value_bits: :data:`BITS`.
        outlier_fraction: share of each block's entries kept exactly, in ``[0, 0.5)`` (KVQuant:
            0.01).
        nuq: non-uniform levels fitted per block (else uniform ones).

    Raises:
        TypeError / ValueError: any argument outside the above.
    """

    def __init__(
        self,
        head_dim: int,
        key_bits: int = 3,
        value_bits: int = 3,
        *,
        outlier_fraction: float = OUTLIER_FRACTION,
        nuq: bool = True,
    ) -> None:
        self.head_dim = check_int(head_dim, "head_dim", minimum=8)
        if head_dim % 8:
            raise ValueError(f"head_dim must be a multiple of 8 (got {head_dim})")
        self.key_bits, self.value_bits = _check_bits(key_bits), _check_bits(value_bits)
        self.outlier_fraction = _check_fraction(outlier_fraction)
        if not isinstance(nuq, bool):
            raise TypeError(f"nuq must be a bool (got {nuq!r})")
        self.nuq = nuq

    def __repr__(self) -> str:
        return (
            f"KVQuantizer(head_dim={self.head_dim}, key_bits={self.key_bits}, value_bits="
            f"{self.value_bits}, outlier_fraction={self.outlier_fraction}, nuq={self.nuq})"
        )

    def _check(self, x: Any, name: str) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[-1] != self.head_dim:
            raise ValueError(
                f"{name} must end in head_dim {self.head_dim} (got shape {tuple(x.shape)})"
            )
        return x

    def encode_keys(self, keys: torch.Tensor) -> SparseBlocks:
        """One block of keys ``(batch, kv_heads, T, head_dim)``, per channel."""
        keys = self._check(keys, "keys")
        return encode_block(keys, self.key_bits, "channel", self.outlier_fraction, self.nuq)

    def decode_keys(
        self,
        enc: SparseBlocks,
        dtype: torch.dtype = torch.float32,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Keys ``(batch, kv_heads, n * T, head_dim)`` in ``dtype``, or written into ``out``
        (:func:`decode_block`). Values decode the same way: :meth:`decode_values` is this
        method."""
        return decode_block(enc, dtype, out=out)

    def encode_values(self, values: torch.Tensor) -> SparseBlocks:
        """One block of values ``(batch, kv_heads, T, head_dim)``, per token."""
        values = self._check(values, "values")
        return encode_block(values, self.value_bits, "token", self.outlier_fraction, self.nuq)

    #: Values ``(batch, kv_heads, n * T, head_dim)``: decoded as keys are (:func:`decode_block`).
    decode_values = decode_keys

    def block_nbytes(self, tokens: int) -> int:
        """Bytes one block of ``tokens`` tokens takes in one KV head, keys and values."""
        f, d, nuq = self.outlier_fraction, self.head_dim, self.nuq
        return block_nbytes(tokens, d, self.key_bits, "channel", f, nuq) + block_nbytes(
            tokens, d, self.value_bits, "token", f, nuq
        )

    def bits_per_value(self, tokens: int) -> float:
        """Bits per cached number of a block of ``tokens`` tokens, everything counted."""
        return 8 * self.block_nbytes(tokens) / (2 * tokens * self.head_dim)
