"""Bit-packing of integer codes into bytes: 8, 4, 3 and 2 bits per code (notebook 03).

A quantized tensor is only as small as its storage: codes of fewer than 8 bits must share bytes.
:func:`pack` lays codes out little-end first (two 4-bit codes per byte, four 2-bit codes, eight
3-bit codes in three bytes), :func:`unpack` reverses it, and :func:`packed_nbytes` says how many
bytes ``n`` codes take, padding included. :mod:`kvlib.quant.tensor` stores its codes this way.
"""

from __future__ import annotations

import functools
import math
import sys

import torch

from kvlib.validate import check_bits

__all__ = ["pack", "pack_uint8", "packed_nbytes", "unpack", "unpack_by_shifts"]


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that :func:`pack` uses for ``n`` codes of ``bits`` bits (padding included)."""
    bits = check_bits(bits)
    if bits == 3:
        return 3 * math.ceil(n / 8)
    return math.ceil(n * bits / 8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer ``codes`` (any shape, values in ``0 .. 2**bits - 1``) into a 1-D uint8 tensor.

    Codes are taken in row-major (flattened) order. Layout, little-end first:

    * 8 bits: one code per byte;
    * 4 bits: two codes per byte, code ``2i`` in the low nibble, ``2i+1`` in the high nibble;
    * 2 bits: four codes per byte, code ``4i + j`` in bits ``2j .. 2j+1``;
    * 3 bits: eight codes in three bytes, code ``8i + j`` in bits ``3j .. 3j+2`` of the 24-bit
      little-endian word made of bytes ``3i, 3i+1, 3i+2``.

    The tail is zero-padded to a whole byte (whole 3-byte word for 3 bits); :func:`unpack` needs
    the code count ``n`` to drop the padding. Returns ``(packed_nbytes(codes.numel(), bits),)``.
    """
    bits = check_bits(bits)
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes must be a torch.Tensor (got {type(codes).__name__})")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor (got {codes.dtype})")
    flat = codes.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) > (1 << bits) - 1):
        raise ValueError(
            f"codes must lie in 0..{(1 << bits) - 1} for bits={bits} "
            f"(got values in {int(flat.min())}..{int(flat.max())})"
        )
    flat = flat.to(torch.uint8)
    return pack_uint8(flat.clone() if bits == 8 else flat, bits)


def pack_uint8(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack` for uint8 codes already known to be in range (no checks, no copy at 8 bits)."""
    flat = codes.reshape(-1)
    if bits == 8:
        return flat
    per = 8 if bits == 3 else 8 // bits
    if flat.numel() % per:
        flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % per)])
    c = flat.view(-1, per)
    if bits == 4:
        return c[:, 0] | (c[:, 1] << 4)
    if bits == 2:
        return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)
    # bits == 3: codes 0..7 of a word -> bits 0..23 of bytes b0, b1, b2 (little-endian)
    out = torch.empty(c.shape[0], 3, dtype=torch.uint8, device=c.device)
    torch.bitwise_or(c[:, 0] | (c[:, 1] << 3), (c[:, 2] & 3) << 6, out=out[:, 0])
    torch.bitwise_or(
        (c[:, 2] >> 2) | (c[:, 3] << 1) | (c[:, 4] << 4), (c[:, 5] & 1) << 7, out=out[:, 1]
    )
    torch.bitwise_or((c[:, 5] >> 1) | (c[:, 6] << 2), c[:, 7] << 5, out=out[:, 2])
    return out.view(-1)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``n`` codes as a 1-D uint8 tensor ``(n,)``."""
    bits = check_bits(bits)
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor (got {type(packed).__name__})")
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor (got {packed.dtype})")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int (got {n!r})")
    need = packed_nbytes(n, bits)
    p = packed.reshape(-1)
    if p.numel() < need:
        raise ValueError(f"{n} codes of {bits} bits need {need} bytes (got {p.numel()})")
    p = p[:need]
    if bits == 8:
        return p
    table = bits != 4 and sys.byteorder == "little"
    out = _unpack_by_table(p, bits) if table else unpack_by_shifts(p, bits)
    return out if out.numel() == n else out[:n]


@functools.lru_cache(maxsize=16)
def _code_table(bits: int, device: str) -> torch.Tensor:
    """What :func:`_unpack_by_table` looks up (2 or 3 bits): for every packed index (a byte at 2
    bits, a 12-bit half of a 3-byte word at 3 bits), the 4 codes it holds, little-end first, as
    one int32 whose bytes are those codes."""
    index = torch.arange(1 << (4 * bits), dtype=torch.int32)
    codes = torch.stack([(index >> (bits * j)) & ((1 << bits) - 1) for j in range(4)], 1)
    return codes.to(torch.uint8).contiguous().view(torch.int32).view(-1).to(device)


def _unpack_by_table(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Every 2- or 3-bit code of whole packed units ``p`` (bytes; 3-byte words at 3 bits) by
    table lookup: one ``index_select`` of 4 codes at a time, whose bytes are the codes in order. On CPU
    this measured 2x faster than :func:`unpack_by_shifts` at 3 bits and 2.5x at 2 (4,096
    tokens of SmolLM2's keys, alone). At 4 bits it was level alone and 10-20 % slower inside
    a cache's decode step (the int32 copy of every byte), so :func:`unpack` keeps the shifts
    there."""
    table = _code_table(bits, str(p.device))
    if bits == 3:
        words = p.numel() // 3
        padded = p.new_zeros((words, 4))  # each 3-byte word as a little-endian int32
        padded[:, :3] = p.view(words, 3)
        w = padded.view(torch.int32).view(-1)
        index = torch.empty((words, 2), dtype=torch.int32, device=p.device)
        torch.bitwise_and(w, 0xFFF, out=index[:, 0])
        torch.bitwise_right_shift(w, 12, out=index[:, 1])
        index = index.view(-1)
    else:
        index = p.to(torch.int32)
    return table.index_select(0, index).view(torch.uint8)


def unpack_by_shifts(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Every code of whole packed units ``p`` by shifts and masks (2, 3 or 4 bits): the
    readable form of the layout :func:`pack` writes, :func:`unpack`'s path at 4 bits, and its
    path on a big-endian machine, where the table's bytes would come out in the wrong order."""
    # Each code position is computed by a contiguous uint8 kernel, then one stack interleaves
    # them (measured faster on CPU than writing each position into a strided output column).
    if bits == 4:
        parts = [p & 0x0F, p >> 4]
    elif bits == 2:
        parts = [p & 3, (p >> 2) & 3, (p >> 4) & 3, p >> 6]
    else:
        b = p.view(-1, 3)
        b0, b1, b2 = b[:, 0], b[:, 1], b[:, 2]
        parts = [
            b0 & 7,
            (b0 >> 3) & 7,
            (b0 >> 6) | ((b1 & 1) << 2),
            (b1 >> 1) & 7,
            (b1 >> 4) & 7,
            (b1 >> 7) | ((b2 & 3) << 1),
            (b2 >> 2) & 7,
            b2 >> 5,
        ]
    return torch.stack(parts, dim=1).view(-1)
