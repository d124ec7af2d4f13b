"""Tests for kvlib.caches.paged: the paged K/V store, paged attention and the transformers paged cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.attention import dense_attention, pad_sequences
from kvlib.caches.blocks import OutOfBlocks, blocks_needed
from kvlib.caches.paged import PagedCache, PagedKVCache, paged_attention, parallel_sampling


def _dense_decode(query, keys, values):
    """The dense reference for one decode step: query ``(S, H, D)`` against per-sequence
    ``(KVH, n_i, D)`` keys and values."""
    k, lengths = pad_sequences(keys)
    v, _ = pad_sequences(values)
    return dense_attention(query[:, :, None], k, v, lengths=lengths)[:, :, 0]


# --- PagedKVCache through the allocator ------------------------------------------------------


# Random op sequences through the real data layer: kv_heads=1, head_dim=1, each token's value is
# a unique number, so reading a sequence back shows whether anyone else's write reached it.
ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "append", "fork", "free"]),
        st.integers(0, 7),
        st.integers(1, 7),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=120, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 3, 4]),
    num_layers=st.sampled_from([1, 2]),
)
def test_allocator_invariants_under_random_ops(ops, num_blocks, block_size, num_layers):
    cache = PagedKVCache(num_blocks, block_size, kv_heads=1, head_dim=1, num_layers=num_layers)
    alloc = cache.allocator

    def write(seq, values):  # layer by layer, as a model does (layer l stores value + 1000 l)
        for layer in range(num_layers):
            t = torch.tensor(values).view(1, -1, 1) + 1000.0 * layer
            cache.append(seq, t, -t, layer=layer)

    expected: dict[int, list[float]] = {}
    counter = 0.0
    next_id = 0
    for op, pick, n in ops:
        live = sorted(expected)
        target = live[pick % len(live)] if live else None
        free_before, tables_before = alloc.num_free, {s: alloc.block_table(s) for s in live}
        try:
            if op == "alloc" or target is None:
                values = [counter + i for i in range(n)]
                counter += n
                write(next_id, values)
                expected[next_id] = values
                next_id += 1
            elif op == "append":
                values = [counter + i for i in range(n)]
                counter += n
                write(target, values)
                expected[target] = expected[target] + values
            elif op == "fork":
                cache.fork(target, next_id)
                expected[next_id] = list(expected[target])
                next_id += 1
            else:
                cache.free(target)
                del expected[target]
        except OutOfBlocks:
            # nothing half-allocated: same free count, same tables, no new sequence
            assert alloc.num_free == free_before
            assert {
                s: alloc.block_table(s) for s in alloc.sequences if s in tables_before
            } == tables_before
            assert next_id not in alloc  # a failed first append leaves no sequence behind
            if op == "alloc" or target is None:
                next_id += 1
        alloc.check_invariants()
        assert all(alloc.refcount(b) >= 0 for b in range(num_blocks))
        owners = [b for s in alloc.sequences for b in alloc.block_table(s)]
        for b in set(owners):  # a block is listed by exactly refcount tables, never twice in one
            assert owners.count(b) == alloc.refcount(b)
        for s, values in expected.items():  # copy-on-write never changed anyone else's data
            for layer in range(num_layers):
                k, v = cache.gather(s, layer)
                assert k.flatten().tolist() == [x + 1000.0 * layer for x in values]
                assert v.flatten().tolist() == [-x - 1000.0 * layer for x in values]
    for s in list(expected):
        cache.free(s)
    assert alloc.num_free == num_blocks and sorted(alloc.free_list) == list(range(num_blocks))
    alloc.check_invariants()


# --- PagedKVCache -----------------------------------------------------------------------------


def test_paged_kv_cache_layers_share_tables():
    c = PagedKVCache(16, 4, kv_heads=3, head_dim=8, num_layers=2)
    k0, v0 = torch.randn(3, 7, 8), torch.randn(3, 7, 8)
    k1, v1 = torch.randn(3, 7, 8), torch.randn(3, 7, 8)
    c.append("s", k0, v0, layer=0)
    c.append("s", k1, v1, layer=1)
    assert c.allocator.seq_len("s") == 7 and c.allocator.num_used == 2  # one table for both layers
    for layer, (k, v) in enumerate([(k0, v0), (k1, v1)]):
        gk, gv = c.gather("s", layer)
        assert torch.equal(gk, k) and torch.equal(gv, v)
    assert c.nbytes == 2 * 2 * 16 * 3 * 4 * 8 * 4
    with pytest.raises(ValueError, match="kv_heads=3"):
        c.append("s", torch.randn(2, 1, 8), torch.randn(2, 1, 8))
    with pytest.raises(ValueError, match="layer must be"):
        c.gather("s", layer=2)


def test_paged_kv_cache_fork_copy_on_write_keeps_parent():
    c = PagedKVCache(8, 4, kv_heads=1, head_dim=2, num_layers=2)
    prompt = torch.randn(1, 6, 2)
    for layer in range(2):
        c.append("p", prompt, prompt, layer=layer)
    c.fork("p", "c")
    new = torch.randn(1, 1, 2)
    for layer in range(2):
        c.append("c", new, new, layer=layer)
    assert c.allocator.num_cow_copies == 1
    for layer in range(2):
        assert torch.equal(c.gather("p", layer)[0], prompt)
        assert torch.equal(c.gather("c", layer)[0], torch.cat([prompt, new], dim=1))


# --- paged_attention --------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 3, 8, 16, 32]),
    kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([8, 64]),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_matches_dense_reference(lens, block_size, kv_heads, group, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(blocks_needed(n, block_size) for n in lens) + 3
    k_pool = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g)
    v_pool = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # blocks scattered over the pool
    width = max(blocks_needed(n, block_size) for n in lens)
    tables = torch.full((len(lens), width), -1, dtype=torch.long)  # -1 padding must be ignored
    keys, values = [], []
    for i, n in enumerate(lens):
        nb = blocks_needed(n, block_size)
        blocks = [perm.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(blocks)
        keys.append(k_pool[blocks].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :n])
        values.append(v_pool[blocks].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :n])
    query = torch.randn(len(lens), kv_heads * group, head_dim, generator=g)
    out = paged_attention(query, k_pool, v_pool, tables, torch.tensor(lens))
    ref = _dense_decode(query, keys, values)
    assert out.shape == query.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_paged_attention_through_paged_kv_cache():
    c = PagedKVCache(32, 16, kv_heads=3, head_dim=64)
    lens = [1, 16, 17, 40]
    ks, vs = [], []
    for i, n in enumerate(lens):
        k, v = torch.randn(3, n, 64), torch.randn(3, n, 64)
        c.append(i, k, v)
        ks.append(k)
        vs.append(v)
    q = torch.randn(4, 9, 64)
    tables, context = c.block_tables(range(4))
    out = paged_attention(q, c.k_pools[0], c.v_pools[0], tables, context)
    torch.testing.assert_close(out, _dense_decode(q, ks, vs), atol=1e-5, rtol=1e-5)


def test_paged_attention_bad_input():
    kp = torch.randn(4, 2, 4, 8)
    q = torch.randn(2, 4, 8)
    bt = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_attention(torch.randn(2, 3, 8), kp, kp, bt, torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="context_lens must be in"):
        paged_attention(q, kp, kp, bt, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="context_lens must be in"):
        paged_attention(q, kp, kp, bt, torch.tensor([9, 3]))
    with pytest.raises(ValueError, match="outside"):
        paged_attention(q, kp, kp, torch.tensor([[0, 7], [2, 3]]), torch.tensor([8, 3]))
    with pytest.raises(TypeError, match="block_tables"):
        paged_attention(q, kp, kp, bt.float(), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(torch.randn(2, 4, 7), kp, kp, bt, torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="k_pool and v_pool"):
        paged_attention(q, kp, kp[:, :1], bt, torch.tensor([3, 3]))


def test_parallel_sampling_saves_memory():
    ps = parallel_sampling(1024, 4, 128, block_size=16)
    assert ps.blocks_unshared == 4 * (64 + 8) and ps.blocks_shared == 64 + 4 * 8
    assert ps.memory_saved >= 0.5 and ps.cow_copies == 0
    odd = parallel_sampling(1000, 4, 128, block_size=16)  # partial last prompt block: copied
    assert odd.cow_copies == 3 and odd.memory_saved >= 0.5


# --- transformers cache layer -----------------------------------------------------------------


def _generate(model, ids, cache, n, **kwargs):
    try:
        from kvlib import compat
    except ImportError:  # pragma: no cover - before kvlib.compat existed
        with torch.inference_mode():
            return model.generate(ids, cache=cache, max_new_tokens=n, do_sample=False, **kwargs)
    return compat.generate(model, ids, cache=cache, max_new_tokens=n, do_sample=False, **kwargs)


def test_paged_cache_generates_dynamic_cache_tokens(model, tokenizer, recwarn):
    from transformers import DynamicCache

    ids = tokenizer(["The history of the printing press"], return_tensors="pt").input_ids
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ~10x faster than 2 threads on this shared 2-core machine
    try:
        dense = _generate(model, ids, DynamicCache(config=model.config), 12)
        cache = PagedCache(model.config, num_blocks=8, block_size=16)
        paged = _generate(model, ids, cache, 12)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(dense, paged)
    alloc = cache.store.allocator
    assert alloc.seq_len(0) == paged.shape[1] - 1  # the last token is never fed back
    assert alloc.num_used == blocks_needed(paged.shape[1] - 1, 16)
    assert len(cache.store.k_pools) == model.config.num_hidden_layers
    assert not [w for w in recwarn if "deprecat" in str(w.message).lower()]


def test_paged_cache_batch_with_padding(model, tokenizer):
    from transformers import DynamicCache

    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    tokenizer.pad_token = pad or tokenizer.eos_token
    try:
        prompts = ["Paris is", "The largest planet of the solar system"]
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
    finally:  # the tokenizer fixture is shared by the whole session
        tokenizer.padding_side, tokenizer.pad_token = side, pad
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kw = {"attention_mask": batch.attention_mask}
        dense = _generate(model, batch.input_ids, DynamicCache(config=model.config), 6, **kw)
        cache = PagedCache(model.config, num_blocks=8, block_size=4)
        paged = _generate(model, batch.input_ids, cache, 6, **kw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(dense, paged)
    assert cache.store.allocator.sequences == [0, 1]
    with pytest.raises(ValueError, match="num_blocks"):
        PagedCache(model.config, num_blocks=0)


def test_paged_cache_out_of_blocks_is_raised(model, tokenizer):
    ids = tokenizer(["A prompt of more than four tokens, surely"], return_tensors="pt").input_ids
    assert ids.shape[1] > 4
    cache = PagedCache(model.config, num_blocks=1, block_size=4)
    with pytest.raises(OutOfBlocks):
        _generate(model, ids, cache, 1)
    assert cache.store is not None and cache.store.allocator.num_free == 1  # nothing kept


def test_paged_cache_layers_share_one_pool_and_reset_together():
    from transformers import LlamaConfig

    config = LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32
    )
    cache = PagedCache(config, num_blocks=4, block_size=4)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    for i, layer in enumerate(cache.layers):
        keys, values = layer.update(k + i, v - i)
        assert torch.equal(keys, k + i) and torch.equal(values, v - i)
    store = cache.store
    assert cache.ensure_store(k) is store  # one pool, made on first use
    assert cache.get_seq_length() == 5 and store.allocator.num_used == 2  # tables shared
    keys, _ = cache.layers[1].update(k[:, :, :1], v[:, :, :1])
    assert keys.shape == (1, 2, 6, 8) and torch.equal(keys[:, :, :5], k + 1)
    cache.layers[1].reset()  # the layers share the pool: resetting one resets the cache
    assert cache.store is None
    assert all(layer.get_seq_length() == 0 and not layer.is_initialized for layer in cache.layers)
    cache.layers[0].update(k, v)
    assert cache.store is not store and cache.store.allocator.seq_len(0) == 5
    cache.reset()
    assert cache.store is None and cache.get_seq_length() == 0
    with pytest.raises(ValueError, match="do not match the config"):
        cache.layers[0].update(torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8))
