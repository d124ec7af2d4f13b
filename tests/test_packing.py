"""Tests for kvlib.quant.packing: the byte layout of 8/4/3/2-bit codes, round trips, bad input."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.quant.packing import pack, packed_nbytes, unpack, unpack_by_shifts

BITS = (2, 3, 4, 8)


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_every_byte_exhaustive(bits):
    per = 8 // bits
    tuples = list(itertools.product(range(1 << bits), repeat=per))  # 256 tuples
    codes = torch.tensor(tuples, dtype=torch.uint8)
    # little-end first: code j of a byte sits at bits j*bits ..
    expected = sum(codes[:, j].int() << (bits * j) for j in range(per)).to(torch.uint8)
    packed = pack(codes, bits)
    assert torch.equal(packed, expected)
    assert sorted(packed.tolist()) == list(range(256))
    assert torch.equal(unpack(packed, bits, codes.numel()), codes.reshape(-1))


def test_pack_3bit_every_value_at_every_position():
    # 8 positions x 8 values: row r holds value (r + j) % 8 at position j, so each value appears
    # at each position of the 3-byte word.
    r = torch.arange(64)[:, None]
    j = torch.arange(8)[None, :]
    codes = ((r // 8 + r * j + j) % 8).to(torch.uint8)
    for v, p in itertools.product(range(8), range(8)):
        assert bool((codes[:, p] == v).any())
    packed = pack(codes, 3)
    assert packed.numel() == 64 * 3
    assert torch.equal(unpack(packed, 3, codes.numel()), codes.reshape(-1))
    # reference bit layout for the first word
    word = sum(int(codes[0, k]) << (3 * k) for k in range(8))
    assert packed[:3].tolist() == [word & 255, (word >> 8) & 255, word >> 16]


def test_unpack_3bit_every_byte_at_every_position():
    g = torch.Generator().manual_seed(0)
    cols = [torch.randperm(256, generator=g) for _ in range(3)]
    packed = torch.stack(cols, 1).to(torch.uint8).reshape(-1)
    codes = unpack(packed, 3, 256 * 8)
    assert int(codes.max()) <= 7
    assert torch.equal(pack(codes, 3), packed)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_unpack_every_byte(bits):
    packed = torch.arange(256, dtype=torch.uint8)
    codes = unpack(packed, bits, 256 * 8 // bits)
    assert torch.equal(pack(codes, bits), packed)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from(BITS), n=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_pack_roundtrip_any_length(bits, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int64)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(n, bits)
    assert torch.equal(unpack(packed, bits, n).long(), codes)


def test_pack_rejects_bad_codes():
    with pytest.raises(ValueError, match=r"codes must lie in 0\.\.15"):
        pack(torch.tensor([0, 16]), 4)
    with pytest.raises(ValueError, match="0..3"):
        pack(torch.tensor([-1]), 2)
    with pytest.raises(TypeError, match="integer"):
        pack(torch.tensor([0.5]), 4)
    with pytest.raises(ValueError, match=r"bits must be one of 2, 3, 4, 8 \(got 5\)"):
        pack(torch.tensor([1]), 5)


def test_unpack_rejects_bad_input():
    with pytest.raises(ValueError, match="need 3 bytes"):
        unpack(torch.zeros(2, dtype=torch.uint8), 3, 8)
    with pytest.raises(TypeError, match="uint8"):
        unpack(torch.zeros(2, dtype=torch.int32), 4, 4)
    with pytest.raises(ValueError, match="non-negative"):
        unpack(torch.zeros(2, dtype=torch.uint8), 4, -1)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4]),
    data=st.binary(min_size=0, max_size=300),
    cut=st.integers(0, 7),
)
def test_unpack_by_table_reads_any_bytes_as_the_shifts_do(bits, data, cut):
    """unpack looks 2- and 3-bit codes up in a table (2 or 4 at a time); the shifts and masks
    that spell the layout out are the reference, on arbitrary bytes (every byte value, padding included) and a
    code count that ends inside the last unit."""
    unit = 3 if bits == 3 else 1
    data = data[: len(data) // unit * unit]
    packed = torch.tensor(list(data), dtype=torch.uint8)
    every = unpack_by_shifts(packed, bits)
    n = max(0, every.numel() - cut)
    assert torch.equal(unpack(packed, bits, n), every[:n])
    assert unpack(packed, bits, n).dtype == torch.uint8


@pytest.mark.parametrize("bits", [2, 3])
def test_unpack_every_table_entry(bits):
    """Each index of the lookup table once: every byte (2 bits), every 24-bit word's halves
    (3 bits) through all 4,096 values."""
    if bits == 3:
        halves = torch.arange(4096, dtype=torch.int32)
        words = halves | (halves.flip(0) << 12)  # each half takes every value
        packed = torch.stack([(words >> (8 * i)) & 0xFF for i in range(3)], 1).to(torch.uint8)
    else:
        packed = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    packed = packed.reshape(-1)
    every = unpack_by_shifts(packed, bits)
    assert torch.equal(unpack(packed, bits, every.numel()), every)
