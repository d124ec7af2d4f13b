"""TurboQuant: keys quantized with one fixed codebook after a rotation, as vLLM's cache does.

TurboQuant (Zandieh et al. 2025, arXiv 2504.19874) stores each key vector ``k`` of head_dim
``d`` as its norm and the codes of its rotated direction:

1. ``u = k / |k|`` (the norm kept in float16);
2. ``y = u @ R`` for an orthonormal ``R`` (:mod:`kvlib.quant.rotation`): after a random
   rotation every coordinate of ``y`` follows the same known distribution, about
   ``N(0, 1/d)`` (:func:`kvlib.quant.codebook.sphere_codebook` is the exact one);
3. each coordinate is replaced by the index of its nearest Lloyd–Max level for that
   distribution (:func:`kvlib.quant.codebook.gaussian_codebook`, scaled by ``1/sqrt(d)``):
   no per-group scale or zero point, one codebook for every key of every layer.

Reading a key back looks its levels up, optionally rescales the level vector to unit norm
(vLLM's *norm correction*, the ``_nc`` of its dtype names), rotates back and multiplies by the
norm. The paper's second stage, a 1-bit QJL sketch of the residual that makes inner products
unbiased (:class:`QJL`), is left out of every vLLM preset ("it hurts attention quality", says
vLLM's source).

vLLM 0.32's presets (``--kv-cache-dtype``, :data:`VLLM_PRESETS`, kept in
:mod:`kvlib.quant.presets`), read from its source
(``vllm/model_executor/layers/quantization/turboquant/config.py``):

=========================  ==============================  ===========================
dtype                      keys                            values
=========================  ==============================  ===========================
``turboquant_k8v4``        float8 (e4m3), no scale         4-bit, per token min/max
``turboquant_4bit_nc``     4-bit codebook + fp16 norm      4-bit, per token min/max
``turboquant_k3v4_nc``     3-bit codebook + fp16 norm      4-bit, per token min/max
``turboquant_3bit_nc``     3-bit codebook + fp16 norm      3-bit, per token min/max
=========================  ==============================  ===========================

Values are not rotated: each token's head_dim values get one float16 scale and zero point
(:func:`kvlib.quant.tensor.quantize` with ``axis=-1``). vLLM's rotation is the plain Hadamard
matrix (so head_dim must be a power of two) and its codebook the Gaussian one; both are the
defaults here, and the paper's Haar rotation and exact sphere codebook are options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvlib.quant.codebook import Codebook, gaussian_codebook, sphere_codebook
from kvlib.quant.packing import pack_uint8, packed_nbytes, unpack
from kvlib.quant.presets import VLLM_PRESETS  # no torch there: the registry's table reads it
from kvlib.quant.rotation import hadamard, random_orthogonal, rotate, unrotate
from kvlib.quant.tensor import QuantizedTensor, quantize
from kvlib.validate import check_int

__all__ = [
    "FP8_MAX",
    "KEY_BITS",
    "QJL",
    "VALUE_BITS",
    "VLLM_PRESETS",
    "EncodedKeys",
    "TurboQuantizer",
]

#: Bits per key coordinate: 2, 3 or 4 through the codebook; 8 stores float8 e4m3 keys.
KEY_BITS: tuple[int, ...] = (2, 3, 4, 8)
#: Bits per value (per-token min/max integer quantization).
VALUE_BITS: tuple[int, ...] = (2, 3, 4, 8)
#: Largest finite float8 e4m3fn value: fp8 keys are clamped to it (vLLM casts without a scale).
FP8_MAX = 448.0

_ROTATIONS = ("hadamard", "random")
_CODEBOOKS = ("gaussian", "sphere")


def _check_choice(value: Any, name: str, allowed: tuple[Any, ...]) -> Any:
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"{name} must be one of {allowed} (got {value!r})")
    return value


@dataclass(frozen=True)
class EncodedKeys:
    """Keys as TurboQuant stores them, for ``shape[:-1]`` vectors of head_dim ``shape[-1]``.

    Attributes:
        codes: ``(*shape[:-1], bytes per vector)`` uint8 packed codebook indices, or
            ``shape`` float8_e4m3fn keys when ``bits == 8``.
        norms: ``shape[:-1]`` float16 vector norms (``None`` for float8 keys).
        bits: bits per coordinate (:data:`KEY_BITS`).
        shape: the keys' shape.
    """

    codes: torch.Tensor
    norms: torch.Tensor | None
    bits: int
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        """Bytes held: codes and norms."""
        n = self.codes.numel() * self.codes.element_size()
        return n + (0 if self.norms is None else self.norms.numel() * self.norms.element_size())

    def _check_dim(self, dim: Any) -> int:
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < len(self.shape) - 1:
            raise ValueError(f"dim must be a vector axis in 0..{len(self.shape) - 2} (got {dim!r})")
        return dim

    def cat(self, other: EncodedKeys, dim: int) -> EncodedKeys:
        """``other``'s vectors after these along axis ``dim`` (codes copied, nothing re-encoded).

        Raises:
            TypeError / ValueError: not :class:`EncodedKeys` of the same bits and head_dim.
        """
        if not isinstance(other, EncodedKeys):
            raise TypeError(f"other must be EncodedKeys (got {type(other).__name__})")
        dim = self._check_dim(dim)
        if other.bits != self.bits or other.shape[-1] != self.shape[-1]:
            raise ValueError("cannot concatenate keys of different bits or head_dim")
        shape = list(self.shape)
        shape[dim] += other.shape[dim]
        norms = None if self.norms is None else torch.cat([self.norms, other.norms], dim)
        return EncodedKeys(
            torch.cat([self.codes, other.codes], dim), norms, self.bits, torch.Size(shape)
        )

    def index_select(self, dim: int, index: torch.Tensor) -> EncodedKeys:
        """The vectors at ``index`` along axis ``dim`` (repeats allowed)."""
        dim = self._check_dim(dim)
        index = index.to(self.codes.device)
        shape = list(self.shape)
        shape[dim] = index.numel()
        norms = None if self.norms is None else self.norms.index_select(dim, index)
        return replace(
            self, codes=self.codes.index_select(dim, index), norms=norms, shape=torch.Size(shape)
        )

    def to(self, device: torch.device | str) -> EncodedKeys:
        """The same keys on ``device``."""
        norms = None if self.norms is None else self.norms.to(device)
        return replace(self, codes=self.codes.to(device), norms=norms)


class TurboQuantizer:
    """Encode and decode keys (codebook) and values (per-token min/max) of one head_dim.

    Args:
        head_dim: channels per vector, a power of two for the Hadamard rotation, a multiple of
            8 (whole bytes of codes per vector).
        key_bits: :data:`KEY_BITS` (8: float8 e4m3 keys, no rotation, no norm).
        value_bits: :data:`VALUE_BITS`.
        rotation: ``"hadamard"`` (vLLM) or ``"random"`` (the paper's Haar rotation, ``seed``).
        codebook: ``"gaussian"`` (vLLM: Lloyd–Max for ``N(0, 1/d)``) or ``"sphere"`` (exact for
            a coordinate of a random unit vector).
        norm_correction: rescale the level vector to unit norm before rotating back (vLLM's
            ``_nc`` presets).
        seed: the random rotation's seed.

    Raises:
        TypeError / ValueError: any argument outside the above.
    """

    def __init__(
        self,
        head_dim: int,
        key_bits: int = 4,
        value_bits: int = 4,
        *,
        rotation: str = "hadamard",
        codebook: str = "gaussian",
        norm_correction: bool = True,
        seed: int = 0,
    ) -> None:
        head_dim = check_int(head_dim, "head_dim", minimum=8)
        if head_dim % 8:
            raise ValueError(f"head_dim must be a multiple of 8 (got {head_dim})")
        self.key_bits = _check_choice(key_bits, "key_bits", KEY_BITS)
        self.value_bits = _check_choice(value_bits, "value_bits", VALUE_BITS)
        self.rotation_kind = _check_choice(rotation, "rotation", _ROTATIONS)
        self.codebook_kind = _check_choice(codebook, "codebook", _CODEBOOKS)
        if not isinstance(norm_correction, bool):
            raise TypeError(f"norm_correction must be a bool (got {norm_correction!r})")
        if rotation == "hadamard" and head_dim & (head_dim - 1):
            raise ValueError(
                f"the Hadamard rotation needs a power-of-two head_dim (got {head_dim}); "
                "pass rotation='random'"
            )
        self.head_dim, self.norm_correction, self.seed = head_dim, norm_correction, seed
        self.rotation: torch.Tensor | None = None
        self.codebook: Codebook | None = None
        if key_bits != 8:
            self.rotation = (
                hadamard(head_dim) if rotation == "hadamard" else random_orthogonal(head_dim, seed)
            )
            if codebook == "gaussian":
                self.codebook = gaussian_codebook(key_bits)
                self._unit = 1 / math.sqrt(head_dim)  # levels of N(0, 1/d) = N(0, 1) ones / sqrt(d)
            else:
                self.codebook = sphere_codebook(key_bits, head_dim)
                self._unit = 1.0

    def __repr__(self) -> str:
        return (
            f"TurboQuantizer(head_dim={self.head_dim}, key_bits={self.key_bits}, value_bits="
            f"{self.value_bits}, rotation={self.rotation_kind!r}, codebook="
            f"{self.codebook_kind!r}, norm_correction={self.norm_correction})"
        )

    # ------------------------------------------------------------------ keys

    def _check(self, x: Any, name: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() < 1:
            raise TypeError(f"{name} must be a floating torch.Tensor (got {type(x).__name__})")
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"{name} must end in head_dim {self.head_dim} (got shape {tuple(x.shape)})"
            )
        if x.numel() and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} contains NaN or Inf")
        return x

    def encode_keys(self, keys: torch.Tensor) -> EncodedKeys:
        """Encode ``keys`` ``(..., head_dim)``.

        Raises:
            TypeError / ValueError: not a finite floating tensor ending in head_dim; a norm
                beyond float16's range.
        """
        keys = self._check(keys, "keys")
        if self.key_bits == 8:
            fp8 = keys.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            return EncodedKeys(fp8, None, 8, keys.shape)
        x = keys.float()
        norms = x.norm(dim=-1, keepdim=True)
        if norms.numel() and float(norms.max()) > torch.finfo(torch.float16).max:
            raise ValueError("a key's norm exceeds float16's range: TurboQuant keeps it in fp16")
        y = rotate(x / (norms + 1e-8), self.rotation)
        codes = self.codebook.encode(y / self._unit)
        per = packed_nbytes(self.head_dim, self.key_bits)
        packed = pack_uint8(codes.contiguous(), self.key_bits).view(*keys.shape[:-1], per)
        return EncodedKeys(packed, norms.squeeze(-1).half(), self.key_bits, keys.shape)

    def decode_keys(
        self,
        enc: EncodedKeys,
        dtype: torch.dtype = torch.float32,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Keys ``enc.shape`` in ``dtype``: levels looked up, renormalised (norm correction),
        rotated back and scaled by the stored norm.

        Args:
            out: where to write them, of ``enc.shape`` (any strides, e.g. a slice of the tensor
                attention reads); its dtype wins over ``dtype``.

        Returns:
            The keys (``out`` when given).
        """
        if not isinstance(enc, EncodedKeys) or enc.bits != self.key_bits:
            raise TypeError(f"enc must be EncodedKeys of {self.key_bits} bits")
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != enc.shape):
            raise ValueError(f"out must be a tensor of shape {tuple(enc.shape)}")
        if self.key_bits == 8:
            return enc.codes.to(dtype) if out is None else out.copy_(enc.codes)
        n = math.prod(enc.shape)
        codes = unpack(enc.codes.reshape(-1), self.key_bits, n).view(enc.shape)
        y = self.codebook.decode(codes, scale=self._unit)
        if self.norm_correction:
            y = y / y.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        x, norms = unrotate(y, self.rotation), enc.norms.float().unsqueeze(-1)
        if out is None:
            return (x * norms).to(dtype)
        if out.dtype == torch.float32:  # scaled straight into `out`
            return torch.mul(x, norms, out=out)
        return out.copy_(x * norms)

    # ------------------------------------------------------------------ values

    def encode_values(self, values: torch.Tensor) -> QuantizedTensor:
        """Values ``(..., head_dim)`` with one float16 scale and zero point per vector, rows
        laid out per vector (:meth:`QuantizedTensor.with_rows`)."""
        values = self._check(values, "values")
        q = quantize(values.contiguous(), self.value_bits, axis=-1)
        return q.with_rows(values.dim() - 1)

    def decode_values(
        self,
        q: QuantizedTensor,
        dtype: torch.dtype = torch.float32,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values back, in ``dtype``, or written into ``out`` (of the values' shape, any
        strides; its dtype wins over ``dtype``)."""
        if out is None:
            return q.dequantize(dtype)
        if out.dtype == torch.float32:  # computed in place, as dequantize() computes it
            return q.dequantize_into(out)
        return out.copy_(q.dequantize(out.dtype))

    # ------------------------------------------------------------------ bytes

    def token_nbytes(self) -> int:
        """Bytes one token takes in one KV head, keys and values, as vLLM lays them out
        (before its padding of a slot to an even size): codes, the key's norm, the values'
        scale and zero point."""
        keys = (
            self.head_dim if self.key_bits == 8 else packed_nbytes(self.head_dim, self.key_bits) + 2
        )
        return keys + packed_nbytes(self.head_dim, self.value_bits) + 4

    def bits_per_value(self) -> float:
        """Bits per cached number, everything counted: ``8 * token_nbytes / (2 * head_dim)``."""
        return 8 * self.token_nbytes() / (2 * self.head_dim)


class QJL:
    """The 1-bit Quantized Johnson–Lindenstrauss sketch (Zandieh et al. 2024) of a vector,
    TurboQuant's second stage: ``sign(S r)`` and ``|r|`` for a ``(d, d)`` standard Gaussian
    ``S``; then ``sqrt(pi / 2) / d * |r| * <S q, sign(S r)>`` is an *unbiased* estimate of
    ``<q, r>`` (over the draw of ``S``). Applied to the residual ``r = k - k_hat`` of the
    codebook stage, it removes the bias of the quantized inner products, at one more bit per
    coordinate and more variance. vLLM's presets leave it out.

    Args:
        dim: ``d``.
        seed: the sketch's seed.
    """

    def __init__(self, dim: int, seed: int = 0) -> None:
        self.dim = check_int(dim, "dim", minimum=1)
        seed = check_int(seed, "seed", minimum=0)
        g = torch.Generator().manual_seed(seed)
        self.sketch = torch.randn(dim, dim, generator=g, dtype=torch.float32)

    def encode(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``r`` ``(..., d)`` as its signs ``(..., d)`` bool (``S r >= 0``) and norms ``(...,)``."""
        if not isinstance(r, torch.Tensor) or r.shape[-1:] != (self.dim,):
            raise ValueError(f"r must be a tensor ending in {self.dim}")
        r = r.float()
        return (r @ self.sketch.T) >= 0, r.norm(dim=-1)

    def inner_product(
        self, q: torch.Tensor, signs: torch.Tensor, norms: torch.Tensor
    ) -> torch.Tensor:
        """Estimates of ``<q_i, r_j>``: ``q`` ``(..., m, d)``, ``signs`` ``(..., n, d)``,
        ``norms`` ``(..., n)``; returns ``(..., m, n)``."""
        z = signs.float() * 2 - 1
        sq = q.float() @ self.sketch.T
        return math.sqrt(math.pi / 2) / self.dim * (sq @ z.transpose(-1, -2)) * norms.unsqueeze(-2)
