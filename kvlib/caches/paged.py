"""PagedAttention from first principles: a paged K/V store, paged attention (notebook 07).

A contiguous KV cache reserves one ``(kv_heads, max_len, head_dim)`` buffer per request, and a
request that stops early leaves most of it unused. Paging (Kwon et al., *Efficient Memory
Management for Large Language Model Serving with PagedAttention*, SOSP 2023 — the vLLM paper)
splits the cache into fixed-size **blocks** of ``block_size`` tokens drawn from one preallocated
pool, addressed through per-sequence **block tables**. The bookkeeping (free list, reference
counts, fork and copy-on-write) is :class:`kvlib.caches.blocks.BlockAllocator`; this module puts the
tensors behind it:

* :class:`PagedKVCache` — one K and one V pool per layer, shaped
  ``(num_blocks, kv_heads, block_size, head_dim)``, addressed through the allocator.
* :func:`paged_attention` — one decode step for a batch of sequences of different lengths,
  reading keys and values through their block tables (vectorised gather, masked tail, GQA); it
  equals the dense reference :func:`kvlib.attention.dense_attention`.
* :class:`PagedCache` / :class:`PagedCacheLayer` — a transformers ``Cache`` backed by the pool,
  so ``model.generate(..., cache=PagedCache(model.config, num_blocks=...))`` runs on it.
* :func:`parallel_sampling` — the blocks prefix sharing saves for parallel samples.

The serving simulation (:func:`~kvlib.eval.serving.simulate_serving`) lives in :mod:`kvlib.eval.serving`,
which needs only the allocator (:mod:`kvlib.caches.blocks`), not this module.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlib.caches.blocks import BlockAllocator, OutOfBlocks, blocks_needed
from kvlib.specs import kv_geometry
from kvlib.validate import check_int

__all__ = [
    "PagedCache",
    "PagedCacheLayer",
    "PagedKVCache",
    "ParallelSampling",
    "paged_attention",
    "parallel_sampling",
]


class PagedKVCache:
    """A paged K/V store: per-layer pools addressed through one :class:`BlockAllocator`.

    Pools are ``k_pools[layer]`` / ``v_pools[layer]`` of shape
    ``(num_blocks, kv_heads, block_size, head_dim)``. All layers share the block tables (as in
    vLLM): the first layer to append a token reserves its slot, the other layers write into it.

    Args:
        num_blocks, block_size: pool geometry.
        kv_heads, head_dim: per-token K/V shape.
        num_layers: number of layers (pools).
        dtype, device: of the pools.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        check_int(kv_heads, "kv_heads", minimum=1)
        check_int(head_dim, "head_dim", minimum=1)
        check_int(num_layers, "num_layers", minimum=1)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.kv_heads, self.head_dim, self.num_layers = kv_heads, head_dim, num_layers
        shape = (num_blocks, kv_heads, block_size, head_dim)
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._written: dict[Hashable, list[int]] = {}

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def nbytes(self) -> int:
        """Bytes of all K and V pools (the preallocated memory)."""
        return sum(p.numel() * p.element_size() for p in (*self.k_pools, *self.v_pools))

    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, K and V."""
        return self.nbytes // self.num_blocks

    def seq_len(self, seq_id: Hashable, layer: int = 0) -> int:
        """Tokens written for ``seq_id`` in ``layer``."""
        if seq_id not in self._written:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return self._written[seq_id][self._check_layer(layer)]

    def _check_layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}) (got {layer})")
        return layer

    def _apply_copies(self, copies: Iterable[tuple[int, int]]) -> None:
        for src, dst in copies:
            for pool in (*self.k_pools, *self.v_pools):
                pool[dst].copy_(pool[src])

    def append(self, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> None:
        """Append ``k``, ``v`` of shape ``(kv_heads, n, head_dim)`` to ``seq_id`` in ``layer``.

        A new ``seq_id`` is created on first use. Raises :class:`OutOfBlocks` (nothing written,
        nothing allocated) when the pool is full.
        """
        self._check_layer(layer)
        expected = (self.kv_heads, k.shape[-2] if k.dim() == 3 else -1, self.head_dim)
        if k.dim() != 3 or tuple(k.shape) != expected or k.shape != v.shape:
            raise ValueError(
                f"k and v must both have shape (kv_heads={self.kv_heads}, n, head_dim={self.head_dim}) "
                f"(got {tuple(k.shape)} and {tuple(v.shape)})"
            )
        pool = self.k_pools[layer]
        if k.dtype != pool.dtype or k.device != pool.device:
            k, v = k.to(pool), v.to(pool)
        n = k.shape[1]
        created = seq_id not in self._written
        if created:
            self.allocator.allocate(seq_id, 0)
            self._written[seq_id] = [0] * self.num_layers
        start = self._written[seq_id][layer]
        extra = start + n - self.allocator.seq_len(seq_id)
        if extra > 0:
            try:
                appended = self.allocator.append_slots(seq_id, extra)
            except OutOfBlocks:
                if created:  # leave no empty sequence behind
                    self.free(seq_id)
                raise
            self._apply_copies(appended.copies)
        self._write(seq_id, layer, start, k, v)
        self._written[seq_id][layer] = start + n

    def _write(
        self, seq_id: Hashable, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        n, bs = k.shape[1], self.block_size
        if n == 0:
            return
        table = torch.tensor(self.allocator.block_table(seq_id), device=k.device)
        pos = torch.arange(start, start + n, device=k.device)
        blocks, offsets = table[pos // bs], pos % bs
        # pool[blocks, :, offsets] has shape (n, kv_heads, head_dim)
        self.k_pools[layer][blocks, :, offsets] = k.transpose(0, 1)
        self.v_pools[layer][blocks, :, offsets] = v.transpose(0, 1)

    def gather(self, seq_id: Hashable, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``seq_id`` as contiguous ``(kv_heads, seq_len, head_dim)`` tensors."""
        n = self.seq_len(seq_id, layer)
        table = torch.tensor(self.allocator.block_table(seq_id), device=self.k_pools[layer].device)
        nb = blocks_needed(n, self.block_size)
        out = []
        for pool in (self.k_pools[layer], self.v_pools[layer]):
            blocks = pool[table[:nb]]  # (nb, kv_heads, block_size, head_dim)
            out.append(blocks.transpose(0, 1).reshape(self.kv_heads, -1, self.head_dim)[:, :n])
        return out[0], out[1]

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """``child`` shares all of ``parent``'s blocks (prefix sharing; copy-on-write later)."""
        written = self._written.get(parent)
        if written is None:
            raise KeyError(f"unknown sequence {parent!r}")
        if len(set(written)) != 1:
            raise ValueError(
                f"fork {parent!r} between decode steps: its layers hold {written} tokens"
            )
        self.allocator.fork(parent, child)
        self._written[child] = list(written)

    def free(self, seq_id: Hashable) -> None:
        """Release ``seq_id``'s blocks (shared blocks stay with their other owners)."""
        self.allocator.free(seq_id)
        del self._written[seq_id]

    def block_tables(self, seq_ids: Iterable[Hashable]) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded ``block_tables`` ``(num_seqs, max_blocks)`` int64 (pad 0) and ``context_lens``."""
        seq_ids = list(seq_ids)
        tables = [self.allocator.block_table(s) for s in seq_ids]
        width = max((len(t) for t in tables), default=0)
        device = self.k_pools[0].device
        bt = torch.zeros((len(seq_ids), max(width, 1)), dtype=torch.long, device=device)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        lens = torch.tensor([self.seq_len(s) for s in seq_ids], dtype=torch.long, device=device)
        return bt, lens


def _check_paged_inputs(
    query: Any, k_pool: Any, v_pool: Any, block_tables: Any, context_lens: Any
) -> None:
    """Refuse what :func:`paged_attention` cannot read: it takes a floating ``query``
    ``(num_seqs, num_heads, head_dim)`` and pools ``(num_blocks, kv_heads, block_size,
    head_dim)`` (``num_heads`` a multiple of ``kv_heads``), integer ``block_tables``
    ``(num_seqs, max_blocks)`` and ``context_lens`` ``(num_seqs,)``."""
    for name, t in (("query", query), ("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point torch.Tensor (got {type(t).__name__})"
            )
    if query.dim() != 3:
        raise ValueError(
            f"query must be (num_seqs, num_heads, head_dim) (got shape {tuple(query.shape)})"
        )
    if k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(
            "k_pool and v_pool must both be (num_blocks, kv_heads, block_size, head_dim) "
            f"(got {tuple(k_pool.shape)} and {tuple(v_pool.shape)})"
        )
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, kv_heads, block_size, pool_dim = k_pool.shape
    if pool_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != pool head_dim {pool_dim}")
    if num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of kv_heads ({kv_heads})")
    if not isinstance(block_tables, torch.Tensor) or block_tables.dtype.is_floating_point:
        raise TypeError("block_tables must be an integer torch.Tensor")
    if not isinstance(context_lens, torch.Tensor) or context_lens.dtype.is_floating_point:
        raise TypeError("context_lens must be an integer torch.Tensor")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be (num_seqs={num_seqs}, max_blocks) (got {tuple(block_tables.shape)})"
        )
    if context_lens.shape != (num_seqs,):
        raise ValueError(
            f"context_lens must be (num_seqs={num_seqs},) (got {tuple(context_lens.shape)})"
        )


def _used_tables(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_tables`` ``(num_seqs, max_blocks)`` with the entries past each sequence's last
    block zeroed, and ``context_lens`` ``(num_seqs,)``, both int64 on ``device``.

    Raises:
        ValueError: a length outside ``[1, max_blocks * block_size]``, or a used entry that is
            not a block of the pool.
    """
    max_blocks = block_tables.shape[1]
    block_tables = block_tables.to(device=device, dtype=torch.long)
    context_lens = context_lens.to(device=device, dtype=torch.long)
    if bool((context_lens < 1).any()) or bool((context_lens > max_blocks * block_size).any()):
        raise ValueError(
            f"context_lens must be in [1, max_blocks * block_size = {max_blocks * block_size}] "
            f"(got {context_lens.tolist()})"
        )
    used = (
        torch.arange(max_blocks, device=device)
        < (context_lens[:, None] + block_size - 1) // block_size
    )
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        raise ValueError(f"block_tables holds block ids outside [0, {num_blocks}) in used entries")
    tables = torch.where(used, block_tables, torch.zeros_like(block_tables))
    return tables, context_lens


def paged_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step of attention, reading K/V through block tables (reference implementation).

    Args:
        query: ``(num_seqs, num_heads, head_dim)``, one new token per sequence.
        k_pool, v_pool: ``(num_blocks, kv_heads, block_size, head_dim)``; ``num_heads`` must be a
            multiple of ``kv_heads`` (grouped-query attention: query head ``h`` reads KV head
            ``h // (num_heads // kv_heads)``).
        block_tables: ``(num_seqs, max_blocks)`` integer; row ``i``'s first
            ``ceil(context_lens[i] / block_size)`` entries are physical blocks, the rest padding.
        context_lens: ``(num_seqs,)`` tokens each sequence attends to (≥ 1).
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``(num_seqs, num_heads, head_dim)``: softmax over the key axis (each sequence's own
        ``context_lens[i]`` tokens; the unused tail of the last block and padding blocks are masked).

    All sequences are handled in one batched gather + two matmuls; there is no loop over tokens or
    sequences. Memory is ``num_seqs × max_blocks × block_size`` keys — a reference, not a fused
    kernel (vLLM's CUDA kernel reads the blocks in place instead of gathering them).
    """
    _check_paged_inputs(query, k_pool, v_pool, block_tables, context_lens)
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, kv_heads, block_size, _ = k_pool.shape
    max_blocks = block_tables.shape[1]
    device = query.device
    tables, context_lens = _used_tables(block_tables, context_lens, num_blocks, block_size, device)

    # Gather whole blocks, keeping the pool's layout: (S, M, KVH, B, D). Flattening to
    # (S, KVH, M*B, D) would copy everything once more; instead the softmax runs over the two
    # key axes (M = block, B = offset in block) together.
    keys, values = k_pool[tables], v_pool[tables]
    group = num_heads // kv_heads
    q = query.reshape(num_seqs, 1, kv_heads, group, head_dim)
    scale = head_dim**-0.5 if scale is None else scale
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # (S, M, KVH, G, B)
    valid = torch.arange(max_blocks * block_size, device=device) < context_lens[:, None]
    scores = scores.masked_fill(~valid.view(num_seqs, max_blocks, 1, 1, block_size), float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=(1, 4), keepdim=True))  # softmax over (M, B)
    weights = weights / weights.sum(dim=(1, 4), keepdim=True)
    out = torch.matmul(weights.to(values.dtype), values).sum(dim=1)  # (S, KVH, G, D)
    return out.reshape(num_seqs, num_heads, head_dim)


# --- transformers integration ---------------------------------------------------------------
class PagedCacheLayer(CacheLayerMixin):
    """One layer of :class:`PagedCache`: ``update`` appends into the shared paged pool and
    returns the gathered ``(batch, kv_heads, seq_len, head_dim)`` keys and values.

    Batch row ``b`` is sequence ``b`` of the pool. Attention itself stays the model's own (it
    receives the gathered tensors), so outputs match :class:`transformers.DynamicCache` exactly.

    The layer talks to its :class:`PagedCache` (``parent``) through two public methods only:
    :meth:`PagedCache.ensure_store` (the shared pool, made on first use) and
    :meth:`PagedCache.reset`.
    """

    is_sliding = False
    is_croppable = False

    def __init__(self, parent: PagedCache, layer_idx: int) -> None:
        super().__init__()
        self.parent = parent
        self.layer_idx = layer_idx
        self._len = 0
        self._batch = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.parent.ensure_store(key_states)
        self.device = key_states.device
        self._batch = key_states.shape[0]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self._batch:
            raise ValueError(f"batch size changed from {self._batch} to {key_states.shape[0]}")
        store = self.parent.ensure_store(key_states)
        for b in range(self._batch):
            store.append(b, key_states[b], value_states[b], layer=self.layer_idx)
        self._len += key_states.shape[-2]
        ks, vs = zip(*(store.gather(b, self.layer_idx) for b in range(self._batch)), strict=True)
        return torch.stack(ks), torch.stack(vs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Reset the whole :class:`PagedCache`: its layers share one pool and one set of block
        tables, so one layer cannot be emptied alone."""
        self.parent.reset()

    def clear(self) -> None:
        """Forget this layer's length and batch (called by :meth:`PagedCache.reset`)."""
        self._len, self._batch, self.is_initialized = 0, 0, False

    def offload(self) -> None:  # the pool stays where it is
        return None

    def prefetch(self) -> None:
        return None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("PagedCache does not support beam search (reorder_cache)")


class PagedCache(Cache):
    """A transformers ``Cache`` whose layers live in one :class:`PagedKVCache` pool.

    ``model.generate(input_ids, cache=PagedCache(model.config, num_blocks=256))`` generates the
    same tokens as with ``DynamicCache``; afterwards ``cache.store`` holds the block tables and
    pools (``cache.store.allocator`` shows how many blocks the generation took).

    Args:
        config: the model config (``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``).
        num_blocks: size of the pool (all layers share the tables; each layer has its own pool).
        block_size: tokens per block.
    """

    def __init__(self, config: Any, num_blocks: int, block_size: int = 16) -> None:
        self.num_blocks = check_int(num_blocks, "num_blocks", minimum=1)
        self.block_size = check_int(block_size, "block_size", minimum=1)
        geometry = kv_geometry(config)
        self.num_layers = geometry.num_layers
        self.kv_heads = geometry.num_kv_heads
        self.head_dim = geometry.head_dim
        self.store: PagedKVCache | None = None
        super().__init__(layers=[PagedCacheLayer(self, i) for i in range(self.num_layers)])

    def ensure_store(self, key_states: torch.Tensor) -> PagedKVCache:
        """The shared pool, made on first use with the dtype and device of ``key_states``
        ``(batch, kv_heads, seq_len, head_dim)`` (which must match the config)."""
        if self.store is None:
            if key_states.shape[1] != self.kv_heads or key_states.shape[-1] != self.head_dim:
                raise ValueError(
                    f"key_states {tuple(key_states.shape)} do not match the config "
                    f"(kv_heads={self.kv_heads}, head_dim={self.head_dim})"
                )
            self.store = PagedKVCache(
                self.num_blocks,
                self.block_size,
                self.kv_heads,
                self.head_dim,
                num_layers=self.num_layers,
                dtype=key_states.dtype,
                device=key_states.device,
            )
        return self.store

    def reset(self) -> None:
        """Drop the pool and every layer's state; the next ``update`` starts from scratch."""
        self.store = None
        for layer in self.layers:
            layer.clear()


@dataclass(frozen=True)
class ParallelSampling:
    """KV memory of ``num_samples`` continuations of one prompt, with or without prefix sharing.

    Attributes:
        prompt_len, num_samples, output_len, block_size: the scenario.
        blocks_shared: blocks used when samples fork the prompt's blocks (copy-on-write).
        blocks_unshared: blocks used when each sample holds its own copy of the prompt.
        cow_copies: partly filled prompt blocks copied on write in the shared case.
    """

    prompt_len: int
    num_samples: int
    output_len: int
    block_size: int
    blocks_shared: int
    blocks_unshared: int
    cow_copies: int
    timeline_shared: list[int] = field(default_factory=list, repr=False)
    timeline_unshared: list[int] = field(default_factory=list, repr=False)

    @property
    def memory_saved(self) -> float:
        """Fraction of KV memory saved by sharing: ``1 - shared / unshared`` (at the end)."""
        return 1.0 - self.blocks_shared / self.blocks_unshared


def parallel_sampling(
    prompt_len: int, num_samples: int, output_len: int, block_size: int = 16
) -> ParallelSampling:
    """Run parallel sampling through a real :class:`BlockAllocator`, with and without sharing.

    Shared: the prompt is prefilled once, then forked ``num_samples - 1`` times; each sample then
    appends ``output_len`` tokens (the first write into a partly filled shared block copies it).
    Unshared: each sample prefills its own copy of the prompt.
    """
    for name, value in (("prompt_len", prompt_len), ("num_samples", num_samples)):
        check_int(value, name, minimum=1)
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 0:
        raise ValueError(f"output_len must be a non-negative int (got {output_len!r})")
    check_int(block_size, "block_size", minimum=1)
    per_sample = blocks_needed(prompt_len + output_len, block_size)
    big = num_samples * per_sample + num_samples
    results = {}
    for share in (True, False):
        alloc = BlockAllocator(big, block_size)
        if share:
            alloc.allocate(0, prompt_len)
            for s in range(1, num_samples):
                alloc.fork(0, s)
        else:
            for s in range(num_samples):
                alloc.allocate(s, prompt_len)
        timeline = [alloc.num_used]
        for _ in range(output_len):
            for s in range(num_samples):
                alloc.append_slots(s, 1)
            timeline.append(alloc.num_used)
        results[share] = (alloc.num_used, alloc.num_cow_copies, timeline)
    return ParallelSampling(
        prompt_len=prompt_len,
        num_samples=num_samples,
        output_len=output_len,
        block_size=block_size,
        blocks_shared=results[True][0],
        blocks_unshared=results[False][0],
        cow_copies=results[True][1],
        timeline_shared=results[True][2],
        timeline_unshared=results[False][2],
    )
