"""The block allocator of a paged KV cache: free list, reference counts, block tables (notebook 07).

A paged KV cache (Kwon et al., SOSP 2023 — the vLLM paper) splits its memory into fixed-size
**blocks** of ``block_size`` tokens drawn from one preallocated pool; a per-sequence **block
table** maps logical block ``i`` of a sequence to a physical block. Only the last block of a
sequence can be partly empty, and blocks can be shared between sequences (reference counts;
copy-on-write when a shared, partly filled block is written).

This module is the bookkeeping alone, no tensors: :class:`BlockAllocator` (allocate, append,
``fork``, copy-on-write, free), :class:`Appended` (what an append did, for the data layer to
mirror), :class:`OutOfBlocks` (the pool is exhausted; nothing is half-allocated) and
:func:`blocks_needed`. :class:`kvlib.caches.paged.PagedKVCache` puts K/V pools behind it;
:func:`kvlib.eval.serving.simulate_serving` runs a whole serving trace through it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from kvlib.validate import check_int

__all__ = ["Appended", "BlockAllocator", "OutOfBlocks", "blocks_needed"]


class OutOfBlocks(RuntimeError):
    """The block pool cannot satisfy a request; the allocator state is unchanged.

    A scheduler catches this to preempt a sequence (free its blocks and recompute it later).

    Attributes:
        requested: blocks the operation needed.
        available: free blocks at the time.
    """

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"out of KV blocks: needed {requested}, {available} free")
        self.requested = requested
        self.available = available


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class Appended:
    """What :meth:`BlockAllocator.append_slots` did, for the data layer to mirror.

    Attributes:
        slots: flat slot index ``block * block_size + offset`` for each new token, in order.
        copies: ``(src_block, dst_block)`` pairs copied on write (copy the data before writing).
        new_blocks: physical blocks freshly taken from the free list (including copy targets).
    """

    slots: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]
    new_blocks: tuple[int, ...]


class BlockAllocator:
    """Physical block bookkeeping for a paged KV cache (no tensors; see
    :class:`kvlib.caches.paged.PagedKVCache`).

    Every block is either on the free list (reference count 0) or referenced by one or more
    sequences' block tables (reference count = number of tables that hold it). Operations are
    atomic: an operation that would need more blocks than are free raises :class:`OutOfBlocks`
    before changing anything.

    Args:
        num_blocks: size of the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = check_int(num_blocks, "num_blocks", minimum=1)
        self.block_size = check_int(block_size, "block_size", minimum=1)
        # Popped from the end: block 0 is handed out first, which makes pictures readable.
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._refcount = [0] * self.num_blocks
        self._tables: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}
        self.num_cow_copies = 0

    # --- inspection -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def sequences(self) -> list[Hashable]:
        """Ids of the live sequences, in creation order."""
        return list(self._tables)

    @property
    def free_list(self) -> list[int]:
        """A copy of the free list (next block handed out last)."""
        return list(self._free)

    def refcount(self, block: int) -> int:
        """Number of block tables that hold physical block ``block``."""
        return self._refcount[block]

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block table (logical block ``i`` → physical block)."""
        return list(self._tables[self._check_seq(seq_id)])

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens the sequence holds."""
        return self._lens[self._check_seq(seq_id)]

    def last_block(self, seq_id: Hashable) -> int | None:
        """Physical block holding the sequence's last token (``None`` when it is empty)."""
        table = self._tables[self._check_seq(seq_id)]
        return table[-1] if table else None

    def used_tokens(self) -> int:
        """Distinct tokens stored: shared blocks count once (a shared block is full or identical)."""
        filled: dict[int, int] = {}
        for seq_id, table in self._tables.items():
            n = self._lens[seq_id]
            for i, block in enumerate(table):
                filled[block] = max(
                    filled.get(block, 0), min(self.block_size, n - i * self.block_size)
                )
        return sum(filled.values())

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"used={self.num_used}, sequences={len(self._tables)})"
        )

    def _check_seq(self, seq_id: Hashable) -> Hashable:
        if seq_id not in self._tables:
            raise KeyError(f"unknown sequence {seq_id!r} (live: {list(self._tables)[:8]})")
        return seq_id

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        taken = [self._free.pop() for _ in range(n)]
        for block in taken:
            self._refcount[block] = 1
        return taken

    def _release(self, block: int) -> None:
        if self._refcount[block] <= 0:  # pragma: no cover - guarded by the invariants
            raise RuntimeError(
                f"block {block} released with reference count {self._refcount[block]}"
            )
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            self._free.append(block)

    # --- operations -------------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, num_tokens: int = 0) -> list[int]:
        """Create sequence ``seq_id`` holding ``num_tokens`` tokens; return its block table.

        Raises:
            ValueError: ``seq_id`` already exists or ``num_tokens`` is negative.
            OutOfBlocks: fewer than ``ceil(num_tokens / block_size)`` blocks are free.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already exists; free it or pick a new id")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int (got {num_tokens!r})")
        table = self._take(blocks_needed(num_tokens, self.block_size))
        self._tables[seq_id] = table
        self._lens[seq_id] = num_tokens
        return list(table)

    def append_slots(self, seq_id: Hashable, num_tokens: int = 1) -> Appended:
        """Make room for ``num_tokens`` more tokens at the end of ``seq_id``.

        New blocks are taken when the last block fills up. If the last block is partly filled
        and shared with another sequence, it is first copied to a fresh block (copy-on-write),
        so that writing the new tokens cannot change the other sequence's data.

        Raises:
            OutOfBlocks: not enough free blocks (the sequence and the pool are unchanged).
        """
        self._check_seq(seq_id)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int (got {num_tokens!r})")
        table, n, bs = self._tables[seq_id], self._lens[seq_id], self.block_size
        grow = blocks_needed(n + num_tokens, bs) - len(table)
        cow = num_tokens > 0 and n % bs != 0 and self._refcount[table[-1]] > 1
        fresh = self._take(grow + int(cow))  # raises before anything changes
        copies: list[tuple[int, int]] = []
        if cow:
            src, dst = table[-1], fresh[0]
            self._release(src)
            table[-1] = dst
            copies.append((src, dst))
            self.num_cow_copies += 1
        table.extend(fresh[int(cow) :])
        slots = tuple(table[t // bs] * bs + t % bs for t in range(n, n + num_tokens))
        self._lens[seq_id] = n + num_tokens
        return Appended(slots=slots, copies=tuple(copies), new_blocks=tuple(fresh))

    def fork(self, parent: Hashable, child: Hashable) -> list[int]:
        """Create ``child`` sharing every block of ``parent`` (reference counts +1); no copy.

        Raises:
            KeyError: unknown ``parent``.
            ValueError: ``child`` already exists.
        """
        self._check_seq(parent)
        if child in self._tables:
            raise ValueError(f"sequence {child!r} already exists; free it or pick a new id")
        table = list(self._tables[parent])
        for block in table:
            self._refcount[block] += 1
        self._tables[child] = table
        self._lens[child] = self._lens[parent]
        return list(table)

    def free(self, seq_id: Hashable) -> list[int]:
        """Drop ``seq_id``; blocks no other sequence holds go back to the free list (returned)."""
        table = self._tables.pop(self._check_seq(seq_id))
        del self._lens[seq_id]
        before = len(self._free)
        for block in reversed(table):
            self._release(block)
        return self._free[before:]

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (used by the tests)."""
        counts = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            assert len(table) == blocks_needed(self._lens[seq_id], self.block_size), seq_id
            assert len(set(table)) == len(table), f"{seq_id!r} holds a block twice"
            for block in table:
                counts[block] += 1
        assert counts == self._refcount, "reference counts disagree with the block tables"
        assert len(set(self._free)) == len(self._free), "a block is on the free list twice"
        assert all(c >= 0 for c in self._refcount), "negative reference count"
        free = set(self._free)
        assert all((c == 0) == (b in free) for b, c in enumerate(counts)), "free list is wrong"
