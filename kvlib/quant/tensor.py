"""Integer quantization of one tensor with real bit-packing (int8 / int4 / int3 / int2).

Introduced in notebooks 02 (int8) and 03 (int4, int3, int2, groups, Hadamard rotation). How a
whole layer's keys and values are stored (windows, per-channel keys, rotation) is a *recipe*, in
:mod:`kvlib.quant.recipes`; the byte layout of the codes is :mod:`kvlib.quant.packing`.

Tensors follow the transformers convention ``(batch, kv_heads, seq_len, head_dim)``.
:func:`quantize` reduces its min/max (or absmax) statistics over ONE axis:

* ``axis=-1`` (head_dim): **per-token** statistics — one scale per (batch, head, token);
* ``axis=-2`` (seq_len): **per-channel** statistics — one scale per (batch, head, channel);
* ``group_size=g`` splits the reduced axis into groups of ``g`` consecutive elements, each
  group with its own scale (and zero point).

Asymmetric (default) maps ``[min, max]`` of each group onto the codes ``0 .. 2**bits - 1`` and
keeps a scale and an offset (the group's minimum, i.e. the zero point) per group; symmetric maps
``[-absmax, absmax]`` onto ``-(2**(bits-1) - 1) .. 2**(bits-1) - 1`` and keeps one scale per group.

Storage is real: codes are bit-packed into ``uint8`` (:func:`kvlib.quant.packing.pack`), and
:attr:`QuantizedTensor.nbytes` counts the packed codes plus every scale and offset kept, in the
dtype they are kept in. Scales and offsets are kept in **float16** by default (half the metadata
of float32). Where float16 cannot hold a tensor's statistics faithfully — it would overflow or
underflow, widen a group's step by more than ``2**-6`` of itself, or break exact reconstruction of a
constant group — the whole tensor keeps them in float32 instead (``QuantizedTensor.scale_dtype``
says which; ``nbytes`` counts it).

Guarantee (property-tested): every element of ``quantize(x, ...).dequantize()`` is within half a
quantization step of ``x`` (the step of its group, at most ``1 + 2**-6`` times the ideal
``(max - min) / (2**bits - 1)``), plus the rounding of the output dtype; constant groups
reconstruct exactly. Codes are computed with the stored (rounded) scale, which is what makes the
bound hold.

:mod:`kvlib.quant.rotation` holds the rotations applied along head_dim before quantizing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvlib.quant.packing import pack_uint8, packed_nbytes, unpack
from kvlib.validate import check_bits, check_divisor

__all__ = [
    "QuantizedTensor",
    "StorageCost",
    "quantize",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# float16 metadata may widen a group's step by at most this fraction before we fall back to fp32.
_MAX_STEP_INFLATION = 2.0**-6


# ---------------------------------------------------------------- quantized tensor


class StorageCost:
    """What quantized storage costs, from its ``nbytes`` (real bytes, metadata included) and
    ``numel`` (elements stored): shared by :class:`QuantizedTensor` and
    :class:`kvlib.quant.recipes.QuantizedKV`."""

    nbytes: int
    numel: int

    @property
    def bits_per_element(self) -> float:
        """``8 * nbytes / numel`` — the bits each element really costs, metadata included."""
        return 8 * self.nbytes / self.numel

    def compression_ratio(self, reference_bits: int = 16) -> float:
        """Size at ``reference_bits`` per element divided by :attr:`nbytes`."""
        if reference_bits <= 0:
            raise ValueError(f"reference_bits must be positive (got {reference_bits})")
        return self.numel * reference_bits / 8 / self.nbytes


@dataclass(frozen=True)
class QuantizedTensor(StorageCost):
    """A quantized tensor: bit-packed codes plus per-group scale (and offset).

    ``packed`` holds the codes of the original tensor in its row-major order. With the original
    shape written ``pre + (L,) + post`` (``L`` the length of the reduced ``axis``) and
    ``G = L // group_size`` groups, ``scale`` and ``offset`` have shape
    ``pre + (G, 1) + post``; asymmetric dequantization is ``offset + code * scale``, symmetric is
    ``(code - qmax) / qmax * scale`` with ``scale`` the group's absmax (so ``±absmax`` are exact).
    """

    packed: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    bits: int
    shape: torch.Size
    dtype: torch.dtype
    axis: int
    group_size: int
    symmetric: bool

    # -- sizes
    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def scale_dtype(self) -> torch.dtype:
        """The dtype the scales (and offsets) are kept in: float16, or float32 as a fallback."""
        return self.scale.dtype

    @property
    def code_nbytes(self) -> int:
        """Bytes of the packed codes alone."""
        return self.packed.numel() * self.packed.element_size()

    @property
    def metadata_nbytes(self) -> int:
        """Bytes of every scale and offset kept."""
        n = self.scale.numel() * self.scale.element_size()
        if self.offset is not None:
            n += self.offset.numel() * self.offset.element_size()
        return n

    @property
    def nbytes(self) -> int:
        """Real storage: packed codes + every scale and offset, in their stored dtype."""
        return self.code_nbytes + self.metadata_nbytes

    # -- movement
    def to(self, device: torch.device | str) -> QuantizedTensor:
        """A copy on ``device`` (codes and metadata move together)."""
        return replace(
            self,
            packed=self.packed.to(device),
            scale=self.scale.to(device),
            offset=None if self.offset is None else self.offset.to(device),
        )

    # -- decoding
    def codes(self) -> torch.Tensor:
        """The unpacked integer codes (uint8) in the original shape."""
        return unpack(self.packed, self.bits, self.numel).view(self.shape)

    def step(self) -> torch.Tensor:
        """The quantization step of each group, shape ``pre + (G, 1) + post`` (float32)."""
        if self.symmetric:
            return self.scale.float() / _sym_qmax(self.bits)
        return self.scale.float()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Reconstruct the tensor, original shape, in ``dtype`` (default: the original dtype)."""
        dtype = self.dtype if dtype is None else dtype
        if not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point dtype (got {dtype})")
        work = torch.float64 if dtype == torch.float64 or self.dtype == torch.float64 else None
        work = work or torch.float32
        codes = unpack(self.packed, self.bits, self.numel)
        grouped = self._grouped_shape()
        vals = codes.view(grouped).to(work)
        scale = self.scale.to(work)
        if self.symmetric:
            q = _sym_qmax(self.bits)
            vals.sub_(q).div_(q).mul_(scale)
        else:
            vals.mul_(scale).add_(self.offset.to(work))
        out = vals.view(self.shape)
        return out if out.dtype == dtype else out.to(dtype)

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        """Reconstruct the tensor into ``out`` (shape :attr:`shape`, any strides, e.g. a
        permuted view of a larger buffer), computing in ``out``'s dtype; returns ``out``.

        Nothing of the size of the tensor is allocated besides the unpacked codes, which is
        what a cache that dequantizes its past at every step wants (introduced in notebook 04).
        """
        if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
            raise TypeError("out must be a floating-point torch.Tensor")
        if out.shape != self.shape:
            raise ValueError(
                f"out must have the tensor's shape {tuple(self.shape)} (got {tuple(out.shape)})"
            )
        grouped = self._grouped_shape()
        codes = unpack(self.packed, self.bits, self.numel).view(grouped)
        target = out.view(grouped)  # splits one axis: a view even of a non-contiguous `out`
        scale = self.scale.to(device=out.device, dtype=out.dtype)
        if self.symmetric:
            q = _sym_qmax(self.bits)
            target.copy_(codes)
            target.sub_(q).div_(q).mul_(scale)
        else:
            torch.mul(codes, scale, out=target)
            target.add_(self.offset.to(device=out.device, dtype=out.dtype))
        return out

    # -- whole rows: concatenated and selected without unpacking or re-quantizing
    def with_rows(self, ndim: int) -> QuantizedTensor:
        """The same tensor with ``packed`` laid out as ``shape[:ndim] + (bytes per row,)``.

        Rows along the first ``ndim`` axes (which must come before the quantization ``axis``:
        their elements never share a scale) can then be concatenated (:meth:`cat`) and
        selected (:meth:`index_select`) byte for byte. Each row's codes must fill whole packing
        words (8 codes for 3 bits, ``8 // bits`` otherwise).
        """
        if isinstance(ndim, bool) or not isinstance(ndim, int) or not 0 <= ndim <= self.axis:
            raise ValueError(
                f"ndim must be an int in 0..{self.axis} (the axes before the quantization axis; "
                f"got {ndim!r})"
            )
        row = math.prod(self.shape[ndim:])
        unit = 8 if self.bits == 3 else 8 // self.bits
        if row % unit:
            raise ValueError(
                f"rows of {row} codes do not fill whole {self.bits}-bit packing words "
                f"({unit} codes each)"
            )
        packed = self.packed.reshape(*self.shape[:ndim], packed_nbytes(row, self.bits))
        return replace(self, packed=packed)

    def _check_row_dim(self, dim: int) -> int:
        rows = self.packed.dim() - 1
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < rows:
            raise ValueError(
                f"dim must be one of the row axes 0..{rows - 1} laid out by with_rows() "
                f"(got {dim!r})"
            )
        return dim

    def cat(self, other: QuantizedTensor, dim: int = 0) -> QuantizedTensor:
        """Concatenate ``other`` after this tensor along row axis ``dim`` (see :meth:`with_rows`).

        Codes are copied, never re-quantized, so the result equals quantizing the concatenated
        tensor. Scales are promoted to the wider of the two dtypes.
        """
        if not isinstance(other, QuantizedTensor):
            raise TypeError(f"other must be a QuantizedTensor (got {type(other).__name__})")
        dim = self._check_row_dim(dim)
        for name in ("bits", "axis", "group_size", "symmetric", "dtype"):
            if getattr(self, name) != getattr(other, name):
                raise ValueError(
                    f"cannot concatenate tensors with different {name} "
                    f"({getattr(self, name)!r} vs {getattr(other, name)!r})"
                )
        if other.packed.dim() != self.packed.dim():
            raise ValueError("both tensors must lay out the same row axes (with_rows)")
        same = [i for i in range(len(self.shape)) if i != dim]
        if len(other.shape) != len(self.shape) or any(
            self.shape[i] != other.shape[i] for i in same
        ):
            raise ValueError(
                f"shapes {tuple(self.shape)} and {tuple(other.shape)} differ outside dim {dim}"
            )
        scale_dtype = torch.promote_types(self.scale.dtype, other.scale.dtype)

        def both(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
            return None if a is None else torch.cat([a.to(scale_dtype), b.to(scale_dtype)], dim)

        shape = list(self.shape)
        shape[dim] += other.shape[dim]
        return replace(
            self,
            packed=torch.cat([self.packed, other.packed], dim),
            scale=both(self.scale, other.scale),
            offset=both(self.offset, other.offset),
            shape=torch.Size(shape),
        )

    def index_select(self, dim: int, index: torch.Tensor) -> QuantizedTensor:
        """Keep (or repeat, or reorder) the rows ``index`` of row axis ``dim``: codes and
        metadata move together, nothing is re-quantized (beam search, batch selection)."""
        dim = self._check_row_dim(dim)
        index = torch.as_tensor(index, device=self.packed.device)
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
            raise ValueError("index must be a 1-D tensor of row indices (or a boolean mask)")
        index = index.long()

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(dim, index.to(t.device))

        shape = list(self.shape)
        shape[dim] = index.numel()
        return replace(
            self,
            packed=pick(self.packed).contiguous(),
            scale=pick(self.scale),
            offset=pick(self.offset),
            shape=torch.Size(shape),
        )

    def _grouped_shape(self) -> tuple[int, ...]:
        s = tuple(self.shape)
        a = self.axis
        return s[:a] + (s[a] // self.group_size, self.group_size) + s[a + 1 :]


def _sym_qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def _normalize_axis(axis: object, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"axis must be an int (got {axis!r})")
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"axis {axis} is out of range for a tensor with {ndim} dimensions "
            f"(accepted: {-ndim}..{ndim - 1})"
        )
    return axis % ndim


def _check_input(x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor (got {type(x).__name__})")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"x must be a floating-point tensor (float32, float16, bfloat16 or float64), "
            f"got {x.dtype}"
        )
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension (got a 0-d tensor)")
    if x.numel() == 0:
        raise ValueError(f"x must not be empty (got shape {tuple(x.shape)})")
    return x


def _round_up_fp16(v: torch.Tensor) -> torch.Tensor:
    """Smallest float16 >= v (v float32, non-negative); inf where it overflows."""
    h = v.to(torch.float16)
    low = h.float() < v
    return torch.where(low, torch.nextafter(h, torch.full_like(h, math.inf)), h)


def _round_down_fp16(v: torch.Tensor) -> torch.Tensor:
    """Largest float16 <= v (v float32); -inf where it overflows."""
    h = v.to(torch.float16)
    high = h.float() > v
    return torch.where(high, torch.nextafter(h, torch.full_like(h, -math.inf)), h)


def _check_group_size(group_size: object, axis: int, length: int) -> int:
    """The group size along the reduced axis of ``length`` elements (``None``: the whole axis)."""
    if group_size is None:
        return length
    return check_divisor(group_size, "group_size", length, f"axis {axis} of length {length}")


def _group_min_max(
    xg: torch.Tensor, red: int, work: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Size]:
    """Min and max of each group of ``xg`` over dim ``red``, flat ``(groups,)`` in ``work``, and
    the keepdim shape they came in; raises on NaN, Inf or a range that overflows."""
    # one pass for both statistics; NaN propagates into them and Inf shows, so checking the
    # (small) statistics replaces a full isfinite pass over x
    mn, mx = torch.aminmax(xg, dim=red, keepdim=True)
    stat_shape = mn.shape
    # statistics are handled flat: torch's CPU kernels are much slower on shapes with
    # trailing size-1 dims
    mn, mx = mn.reshape(-1).to(work), mx.reshape(-1).to(work)
    if not bool(torch.isfinite((mx - mn).amax())):
        if not bool(torch.isfinite(mn).all() & torch.isfinite(mx).all()):
            raise ValueError("x contains NaN or Inf; only finite values can be quantized")
        raise ValueError("the range max - min of a group overflows; values too large to quantize")
    return mn, mx, stat_shape


def quantize(
    x: torch.Tensor,
    bits: int,
    axis: int = -1,
    group_size: int | None = None,
    symmetric: bool = False,
    *,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantizedTensor:
    """Quantize ``x`` to ``bits`` bits with statistics reduced over ``axis``.

    Args:
        x: floating tensor, any shape; for the KV cache ``(batch, kv_heads, seq_len, head_dim)``.
        bits: 2, 3, 4 or 8.
        axis: the axis min/max (or absmax) is reduced over: ``-1`` per-token, ``-2``
            per-channel for a KV tensor. Statistics are never mixed across the other axes
            (heads, layers, batch stay separate).
        group_size: split ``axis`` into groups of this many consecutive elements, each with its
            own scale/offset (``None``: the whole axis is one group). Must divide its length.
        symmetric: absmax scaling, no offset (one scale per group) instead of min/max + offset.
        scale_dtype: float16 (default; falls back to float32 per tensor where float16 can't hold
            the statistics faithfully, see the module docstring) or float32.

    Returns:
        A :class:`QuantizedTensor`; ``.dequantize()`` gives back the original shape and dtype.
    """
    bits = check_bits(bits)
    x = _check_input(x)
    ax = _normalize_axis(axis, x.ndim)
    length = x.shape[ax]
    gs = _check_group_size(group_size, axis, length)
    if scale_dtype not in (torch.float16, torch.float32):
        raise ValueError(f"scale_dtype must be torch.float16 or torch.float32 (got {scale_dtype})")

    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    shape = tuple(x.shape)
    grouped = shape[:ax] + (length // gs, gs) + shape[ax + 1 :]
    xg = x.reshape(grouped)
    red = ax + 1  # the within-group dimension of the grouped view
    mn, mx, stat_shape = _group_min_max(xg, red, work)
    if symmetric:
        scale = _symmetric_scale(mn, mx, bits, work, scale_dtype)
        offset = None
        step = scale.to(work) / _sym_qmax(bits)
        inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step)).view(stat_shape)
        q = (xg.to(work) * inv).round_().clamp_(-_sym_qmax(bits), _sym_qmax(bits))
        q.add_(_sym_qmax(bits))
    else:
        scale, offset = _asymmetric_scale(mn, mx, bits, work, scale_dtype)
        s = scale.to(work)
        inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s)).view(stat_shape)
        q = (xg.to(work) - offset.to(work).view(stat_shape)).mul_(inv)
        q.round_().clamp_(0, (1 << bits) - 1)
        offset = offset.view(stat_shape)
    scale = scale.view(stat_shape)
    codes = q.to(torch.uint8)
    return QuantizedTensor(
        packed=pack_uint8(codes, bits),
        scale=scale,
        offset=offset,
        bits=bits,
        shape=x.shape,
        dtype=x.dtype,
        axis=ax,
        group_size=gs,
        symmetric=symmetric,
    )


def _asymmetric_scale(mn, mx, bits, work, scale_dtype):
    """Per-group (scale, offset), flat; offset <= min and offset + qmax * scale >= max."""
    qmax = (1 << bits) - 1
    ideal = (mx - mn) / qmax
    if scale_dtype == torch.float16 and work == torch.float32:
        off16 = _round_down_fp16(mn)
        s16 = _round_up_fp16((mx - off16.float()) / qmax)
        off16f = off16.float()
        # the float32 quotient itself is rounded: where it rounded down onto a float16 value,
        # offset + qmax * scale can fall a hair short of max; one float16 step up covers it
        # (without this, one such group in thousands sent the whole tensor to float32)
        short = off16f + qmax * s16.float() < mx
        s16 = torch.where(short, torch.nextafter(s16, torch.full_like(s16, math.inf)), s16)
        s16f = s16.float()
        ok = (
            torch.isfinite(off16f)
            & torch.isfinite(s16f)
            & (off16f + qmax * s16f >= mx)
            & (s16f <= ideal * (1 + _MAX_STEP_INFLATION))
        )
        if bool(ok.all()):
            return s16, off16
    return ideal, mn


def _symmetric_scale(mn, mx, bits, work, scale_dtype):
    """Per-group absmax, flat (the step is absmax / qmax)."""
    amax = torch.maximum(-mn, mx)
    if scale_dtype == torch.float16 and work == torch.float32:
        a16 = _round_up_fp16(amax)
        a16f = a16.float()
        ok = (
            torch.isfinite(a16f)
            & (a16f <= amax * (1 + _MAX_STEP_INFLATION))
            & ((mn != mx) | (a16f == amax))  # constant groups must stay exact
        )
        if bool(ok.all()):
            return a16
    return amax
