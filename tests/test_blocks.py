"""Tests for kvlib.caches.blocks: the block allocator (tables, reference counts, fork, copy-on-write).

The same bookkeeping under random operations, with real K/V data behind it, is tested in
tests/test_paged.py (``test_allocator_invariants_under_random_ops``).
"""

from __future__ import annotations

import pytest

from kvlib.caches.blocks import BlockAllocator, OutOfBlocks, blocks_needed

# --- BlockAllocator ---------------------------------------------------------------------------


def test_allocate_append_free_roundtrip():
    a = BlockAllocator(8, 4)
    assert a.allocate("x", 6) == [0, 1]
    assert a.seq_len("x") == 6 and a.num_free == 6
    out = a.append_slots("x", 3)  # fills slots 6, 7 of block 1, then one of a new block
    assert out.slots == (1 * 4 + 2, 1 * 4 + 3, 2 * 4 + 0)
    assert out.new_blocks == (2,) and out.copies == ()
    assert a.block_table("x") == [0, 1, 2]
    assert sorted(a.free("x")) == [0, 1, 2]
    assert a.num_free == 8 and a.sequences == []
    a.check_invariants()


def test_fork_shares_and_copy_on_write_only_when_partial():
    a = BlockAllocator(8, 4)
    a.allocate("p", 6)
    a.fork("p", "c")
    assert a.block_table("c") == a.block_table("p") == [0, 1]
    assert a.refcount(0) == a.refcount(1) == 2 and a.num_used == 2
    out = a.append_slots("c", 1)  # block 1 is half full and shared -> copy it first
    assert out.copies == ((1, 2),)
    assert a.block_table("c") == [0, 2] and a.block_table("p") == [0, 1]
    assert a.refcount(1) == 1 and a.refcount(2) == 1 and a.refcount(0) == 2
    out = a.append_slots("p", 1)  # p owns block 1 alone now: no copy
    assert out.copies == () and a.block_table("p") == [0, 1]
    a.check_invariants()
    # a full shared last block is never copied: the next token opens a new block
    b = BlockAllocator(4, 4)
    b.allocate("p", 4)
    b.fork("p", "c")
    assert b.append_slots("c", 1).copies == ()
    assert b.block_table("c") == [0, 1] and b.refcount(0) == 2


def test_out_of_blocks_leaves_state_unchanged():
    a = BlockAllocator(3, 4)
    a.allocate("x", 8)
    with pytest.raises(OutOfBlocks) as err:
        a.allocate("y", 9)
    assert err.value.requested == 3 and err.value.available == 1
    assert "y" not in a and a.num_free == 1
    with pytest.raises(OutOfBlocks):
        a.append_slots("x", 9)  # needs 3 more blocks, 1 free
    assert a.seq_len("x") == 8 and a.block_table("x") == [0, 1] and a.num_free == 1
    # copy-on-write that cannot get its block: nothing changes either
    a.allocate("z", 3)
    a.fork("z", "w")
    with pytest.raises(OutOfBlocks):
        a.append_slots("w", 1)
    assert a.block_table("w") == a.block_table("z") and a.refcount(2) == 2
    a.check_invariants()


def test_allocator_bad_input():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0, 16)
    with pytest.raises(TypeError, match="block_size"):
        BlockAllocator(4, 2.5)
    a = BlockAllocator(4, 4)
    a.allocate("x", 1)
    with pytest.raises(ValueError, match="already exists"):
        a.allocate("x", 1)
    with pytest.raises(ValueError, match="non-negative"):
        a.append_slots("x", -1)
    with pytest.raises(KeyError, match="unknown sequence"):
        a.free("nope")
    with pytest.raises(ValueError, match="already exists"):
        a.fork("x", "x")
    assert blocks_needed(0, 16) == 0 and blocks_needed(17, 16) == 2
