"""kvlib.caches.eviction.cache and kvlib.caches.eviction.scores: budgets in bytes, RoPE positions, equality with a
DynamicCache at full budget, clear errors, and the kept-set invariants (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from _tiny_models import llama_config, tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import compat
from kvlib.caches import registry as cache_registry
from kvlib.caches.eviction import scores as es
from kvlib.caches.eviction.cache import POLICIES, EvictionCache, capture_queries, token_nbytes
from kvlib.caches.eviction.h2o import H2O
from kvlib.caches.eviction.policy import Observation
from kvlib.caches.eviction.snapkv import snapkv_scores
from kvlib.caches.eviction.tova import TOVA
from kvlib.keys import RowKey
from kvlib.specs import kv_geometry

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STORAGES = [None, 4]  # the model's dtype, int4


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer Llama with 4 query heads sharing 2 KV heads of head_dim 16 (random weights)."""
    return tiny_llama()


def ids_of(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def chunked_logits(model, ids, cache, chunk=16):
    out = []
    with capture_queries(model):
        for s in range(0, ids.shape[1], chunk):
            out.append(compat.forward(model, ids[:, s : s + chunk], cache).logits)
    return torch.cat(out, dim=1)


# ---------------------------------------------------------------- full budget = DynamicCache


@pytest.mark.parametrize("policy", list(POLICIES))
def test_full_budget_equals_dynamic_cache(tiny, policy):
    ids = ids_of(48)
    ref = chunked_logits(tiny, ids, compat.dynamic_cache(tiny.config))
    cache = EvictionCache(tiny.config, policy, budget=48)
    got = chunked_logits(tiny, ids, cache)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert cache.get_seq_length() == 48 and cache.kept() == 48


def test_streaming_window_at_least_the_length_equals_dynamic_cache(tiny):
    ids = ids_of(40)
    ref = compat.generate(tiny, ids, max_new_tokens=6, do_sample=False)
    got = compat.generate(
        tiny, ids, cache=EvictionCache(tiny.config, "streaming", budget=64), max_new_tokens=6
    )
    assert torch.equal(got, ref)


# ---------------------------------------------------------------- RoPE positions


def test_streaming_decode_matches_a_masked_full_sequence(tiny):
    """After eviction, the next token is computed at its real position: the logits equal a
    cache-free run of the whole sequence whose last row may only see the kept tokens."""
    t, budget, sinks = 40, 12, 4
    ids = ids_of(t + 1)
    cache = EvictionCache(tiny.config, "streaming", budget=budget, sinks=sinks)
    compat.forward(tiny, ids[:, :t], cache)
    kept = cache.layers[0].positions[0, 0].tolist()
    got = compat.forward(tiny, ids[:, t:], cache).logits[0, -1]
    assert kept == [*range(sinks), *range(t - (budget - sinks), t)]
    assert cache.get_seq_length() == t + 1  # positions count tokens seen, not kept
    mask = torch.where(torch.ones(t + 1, t + 1).tril().bool(), 0.0, float("-inf"))
    last = torch.full((t + 1,), float("-inf"))
    last[kept + [t]] = 0.0
    mask[t] = last
    with torch.inference_mode():
        ref = tiny(input_ids=ids, attention_mask=mask[None, None], use_cache=False).logits[0, -1]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "knorm"])
def test_per_head_eviction_reads_the_next_token_at_its_real_position(tiny, policy):
    """Per-head kept sets: the decode step equals a DynamicCache holding the kept keys and
    values with the query's position given explicitly, and differs with the position a
    shrunken cache would imply."""
    t = 40
    ids = ids_of(t + 1)
    cache = EvictionCache(tiny.config, policy, budget=10)
    with capture_queries(tiny):
        compat.forward(tiny, ids[:, :t], cache)
        kept = [layer.stored() for layer in cache.layers]
        got = compat.forward(tiny, ids[:, t:], cache).logits[0, -1]
    assert all(k.shape[2] == 10 for k, _ in kept)

    def decode(position_ids):
        ref_cache = compat.dynamic_cache_from([(k.clone(), v.clone()) for k, v in kept])
        return compat.forward(tiny, ids[:, t:], ref_cache, position_ids=position_ids).logits[0, -1]

    torch.testing.assert_close(got, decode(torch.tensor([[t]])), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, decode(torch.tensor([[10]])), atol=1e-4)


def test_mask_sizes_and_seq_length(tiny):
    cache = EvictionCache(tiny.config, "streaming", budget=8)
    compat.forward(tiny, ids_of(20), cache)
    layer = cache.layers[0]
    assert layer.get_seq_length() == 20 and layer.kept() == 8
    assert layer.get_mask_sizes(3) == (11, 12)


# ---------------------------------------------------------------- bytes


@pytest.mark.parametrize("bits", STORAGES)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_max_bytes_is_respected(tiny, policy, bits):
    per = 2 * token_nbytes(16, 2, policy, bits=bits, dtype=torch.float32)  # two layers
    cache = EvictionCache(tiny.config, policy, max_bytes=10 * per + per // 2, bits=bits)
    assert cache.budget == 10
    ids = ids_of(50)
    with capture_queries(tiny):
        for s in range(0, 50, 7):
            compat.forward(tiny, ids[:, s : s + 7], cache)
            assert cache.nbytes() <= cache.max_bytes
    assert cache.nbytes() == 10 * per  # exactly the budget, counted from the tensors held
    assert cache.fp16_nbytes() == 2 * 2 * 2 * 50 * 16 * 2


def test_int4_storage_is_smaller_and_close(tiny):
    ids = ids_of(32)
    full = EvictionCache(tiny.config, "knorm", budget=32, dtype=torch.float16)
    q4 = EvictionCache(tiny.config, "knorm", budget=32, bits=4)
    compat.forward(tiny, ids, full)
    compat.forward(tiny, ids, q4)
    assert q4.nbytes() < 0.45 * full.nbytes()  # head_dim 16: one scale per 16 codes
    for a, b in zip(full.layers, q4.layers, strict=True):
        ka, va = a.stored()
        kb, vb = b.stored()
        assert (ka - kb).abs().max() < 0.1 * ka.abs().max()
        assert (va - vb).abs().max() < 0.1 * va.abs().max()


def test_int4_eviction_moves_codes_without_requantizing(tiny):
    ids = ids_of(30)
    whole = EvictionCache(tiny.config, "knorm", budget=30, bits=4)
    cut = EvictionCache(tiny.config, "knorm", budget=9, bits=4)
    compat.forward(tiny, ids, whole)
    compat.forward(tiny, ids, cut)
    for a, b in zip(whole.layers, cut.layers, strict=True):
        index = b.positions.long()
        ka, va = a.stored()
        kb, vb = b.stored()
        full = index.unsqueeze(-1).expand(-1, -1, -1, ka.shape[-1])
        assert torch.equal(ka.gather(2, full), kb) and torch.equal(va.gather(2, full), vb)


# ---------------------------------------------------------------- the float residual (int storage)


@settings(max_examples=20, deadline=None)
@given(
    t=st.integers(1, 60),
    budget=st.integers(10, 30),
    residual=st.integers(1, 8),
    chunk=st.integers(1, 9),
    policy=st.sampled_from(["streaming", "knorm", "tova"]),
)
def test_the_residual_holds_the_newest_tokens_unquantized(tiny, t, budget, residual, chunk, policy):
    sinks = 4 if policy == "streaming" else 0
    cache = EvictionCache(tiny.config, policy, budget=budget, bits=4, residual=residual)
    dynamic = compat.dynamic_cache(tiny.config)
    ids = ids_of(t, seed=t)
    with capture_queries(tiny):
        for s in range(0, t, chunk):
            out = compat.forward(tiny, ids[:, s : s + chunk], cache)
            compat.forward(tiny, ids[:, s : s + chunk], dynamic)  # the same chunks: same bits
    ref = compat.cache_tensors(dynamic)
    for i, layer in enumerate(cache.layers):
        r = min(residual, (budget - sinks) // 2, t)  # at most half the free budget
        assert layer.kept() == min(t, budget) and layer.rkeys.shape[2] == r
        assert layer.positions[0, 0, -r:].tolist() == list(range(t - r, t))  # never evicted
        if i:  # deeper layers saw int4 attention: their keys differ from the reference
            continue
        k, _ = layer.stored()
        assert torch.equal(k[:, :, -r:], ref[i][0][:, :, t - r :])  # stored as it came
        if layer.kept() > r:  # the older ones went through int4
            pos = layer.positions[:, :, :-r].long().unsqueeze(-1).expand(-1, -1, -1, 16)
            old = ref[i][0].gather(2, pos)  # each head's own kept tokens
            assert 0 < (k[:, :, :-r] - old).abs().max() < 0.2 * old.abs().max()
    assert out.logits.isfinite().all()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_max_bytes_pays_for_the_residual_first(tiny, policy):
    per_q = 2 * token_nbytes(16, 2, policy, bits=4, dtype=torch.float32)  # two layers
    per_f = 2 * token_nbytes(16, 2, policy, dtype=torch.float32)
    cache = EvictionCache(
        tiny.config, policy, max_bytes=2 * per_f + 20 * per_q + 1, bits=4, residual=2
    )
    assert cache.budget == 22
    with capture_queries(tiny):
        for s in range(0, 50, 7):
            compat.forward(tiny, ids_of(50)[:, s : s + 7], cache)
            assert cache.nbytes() <= cache.max_bytes
    assert cache.nbytes() == 2 * per_f + 20 * per_q
    half = EvictionCache(tiny.config, policy, max_bytes=4 * per_f, bits=4, residual=4)
    assert half.layers[0].residual == 2  # the float tokens take at most half the bytes


def test_a_residual_needs_bits_and_takes_at_most_half_the_budget(tiny):
    with pytest.raises(ValueError, match="residual .* needs bits"):
        EvictionCache(tiny.config, "knorm", budget=8, residual=2)
    assert (
        EvictionCache(tiny.config, "streaming", budget=8, bits=4, residual=5).layers[0].residual
        == 2
    )
    with pytest.raises(ValueError, match="residual must be an int >= 0"):
        EvictionCache(tiny.config, "knorm", budget=8, bits=4, residual=-1)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"budget": 0}, ValueError, "budget must be an int >= 1"),
        ({"budget": -3}, ValueError, "budget must be an int >= 1"),
        ({"budget": 2.5}, TypeError, "budget must be an int"),
        ({"budget": True}, TypeError, "budget must be an int"),
        ({"budget": 4, "sinks": 4}, ValueError, "budget must exceed sinks"),
        ({"budget": 8, "window": 9}, ValueError, "window must be <= budget - sinks"),
        ({}, ValueError, "exactly one of budget"),
        ({"budget": 8, "max_bytes": 10_000}, ValueError, "exactly one of budget"),
        ({"max_bytes": 100}, ValueError, "accepted: >= "),
        ({"budget": 8, "bits": 5}, ValueError, "bits must be one of 2, 3, 4, 8"),
    ],
)
def test_bad_budgets_are_refused(tiny, kwargs, error, match):
    policy = "streaming" if "sinks" in kwargs else "knorm"
    with pytest.raises(error, match=match):
        EvictionCache(tiny.config, policy, **kwargs)


def test_bad_policy_and_missing_queries(tiny):
    with pytest.raises(ValueError, match="accepted: streaming, snapkv"):
        EvictionCache(tiny.config, "lru", budget=8)
    with pytest.raises(TypeError, match="policy must be a str"):
        EvictionCache(tiny.config, None, budget=8)
    cache = EvictionCache(tiny.config, "h2o", budget=8)
    with pytest.raises(RuntimeError, match="capture_queries"):
        compat.forward(tiny, ids_of(12), cache)


def test_registry_names_build_their_caches(tiny):
    assert "evict-snapkv" in cache_registry.EVICTION_NAMES
    assert "evict-snapkv-int4" in cache_registry.EVICTION_NAMES
    for name in cache_registry.EVICTION_NAMES:
        info = cache_registry.cache_info(name)
        cache = cache_registry.make_cache(name, tiny.config, budget=16)
        assert info.family == "evict" and info.budgeted
        assert cache.policy == info.policy and (cache.bits or 16) == info.bits
    with pytest.raises(ValueError, match="accepted: .*evict-streaming"):
        cache_registry.cache_info("evict-lru")
    with pytest.raises(ValueError, match="budget must be an int >= 1"):
        cache_registry.cache_factory("evict-h2o", tiny.config, budget=0)


def test_a_budget_in_the_name_is_a_share_of_the_fp16_bytes(tiny):
    tokens = 200
    fp16 = cache_registry.fp16_bytes(tiny.config, tokens)
    g = kv_geometry(tiny.config)
    assert fp16 == 2 * g.num_layers * g.num_kv_heads * g.head_dim * 2 * tokens
    for name in ("evict-h2o@1/4", "evict-tova-int4@1/8", "evict-knorm@0.5"):
        info = cache_registry.cache_info(name)
        share = RowKey.parse(name).budget
        named = cache_registry.make_cache(name, tiny.config, tokens=tokens)
        bare = cache_registry.make_cache(info.name, tiny.config, max_bytes=int(fp16 * share))
        assert named.budget == bare.budget and named.max_bytes <= fp16 * share
    with pytest.raises(ValueError, match="tokens="):
        cache_registry.make_cache("evict-h2o@1/4", tiny.config)
    with pytest.raises(ValueError, match="already has a budget"):
        cache_registry.make_cache("evict-h2o@1/4", tiny.config, tokens=tokens, budget=8)
    with pytest.raises(ValueError, match="name it"):
        cache_registry.make_cache("evict-h2o", tiny.config, tokens=tokens)
    with pytest.raises(ValueError, match="takes no budget"):
        cache_registry.cache_info("kvlib-int4@1/4")
    with pytest.raises(ValueError, match="bad cache name"):
        cache_registry.cache_info("evict-h2o@2")


@pytest.mark.parametrize("head_dim, group", [(64, 32), (80, 20), (16, 16)])
def test_int4_eviction_groups_32_channels_or_the_largest_divisor_below(head_dim, group):
    config = llama_config(head_dim=head_dim)
    size = 2 * 2 * head_dim * 2 * 64  # 64 fp16 tokens
    built = cache_registry.make_cache("evict-streaming-int4", config, max_bytes=size)
    store = {"bits": 4, "residual": cache_registry.INT_RESIDUAL, "dtype": torch.float16}
    same = EvictionCache(config, "streaming", max_bytes=size, group_size=group, **store)
    coarser = EvictionCache(config, "streaming", max_bytes=size, group_size=head_dim, **store)
    assert built.budget == same.budget
    assert EvictionCache(config, "streaming", max_bytes=size, bits=4).budget == (
        size // (2 * token_nbytes(head_dim, 2, "streaming", bits=4, group_size=group))
    )
    assert group == head_dim or built.budget < coarser.budget  # finer scales cost tokens
    k = torch.randn(1, 2, 8, head_dim)
    built.update(k, k.clone(), 0)
    assert built.layers[0].group_size == group


# ---------------------------------------------------------------- scores


def test_attention_weights_are_causal_and_normalised():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 9, 8)
    kpos = torch.arange(9).expand(1, 2, 9)
    w = es.attention_weights(q, k, kpos, torch.arange(4, 9))
    assert w.shape == (1, 2, 2, 5, 9)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 2, 5))
    assert w[..., 0, 5:].abs().max() == 0  # query at position 4 sees keys 0..4
    ref = torch.softmax((q[:, :2, -1] @ k[:, 0].transpose(-1, -2)) / 8**0.5, -1)
    torch.testing.assert_close(w[0, 0, :, -1], ref[0])


def test_snapkv_scores_match_a_direct_computation():
    torch.manual_seed(1)
    w = torch.softmax(torch.randn(1, 2, 3, 6, 20), -1)
    got = snapkv_scores(w, window=4, kernel_size=3)
    obs = w[..., -4:, :16].mean(-2)  # (1, 2, 3, 16)
    padded = torch.nn.functional.pad(obs, (1, 1))
    pooled = (padded[..., :-2] + padded[..., 1:-1] + padded[..., 2:]) / 3
    torch.testing.assert_close(got[..., :16], pooled.mean(2))
    assert torch.equal(got[..., 16:], got[..., :16].amax(-1, keepdim=True).expand(1, 2, 4))


def _observation(q_len: int, n: int, previous: torch.Tensor | None = None, seed: int = 2):
    """Random queries and keys for 4 query heads on 2 KV heads: the last ``q_len`` of ``n``."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 2, n, 8, generator=g)
    return Observation(
        keys=keys,
        positions=torch.arange(n).expand(1, 2, n),
        q_len=q_len,
        seen=n,
        window=1,
        previous=previous,
        queries=torch.randn(1, 4, q_len, 8, generator=g),
        scaling=8**-0.5,
    )


def _direct_weights(seen: Observation) -> torch.Tensor:
    """``(heads, q_len, n)`` causal softmax attention, written out head by head."""
    n, first = seen.keys.shape[2], seen.seen - seen.q_len
    out = torch.zeros(4, seen.q_len, n)
    for h in range(4):
        logits = seen.queries[0, h] @ seen.keys[0, h // 2].T * seen.scaling
        for i in range(seen.q_len):
            out[h, i, : first + i + 1] = torch.softmax(logits[i, : first + i + 1], -1)
    return out


def test_h2o_scores_sum_the_attention_each_token_received():
    seen = _observation(q_len=300, n=330, previous=torch.rand(1, 2, 30))  # > one query slice
    got = H2O().score(seen)
    w = _direct_weights(seen).sum(1)  # (heads, n): summed over the queries
    want = torch.stack([w[0] + w[1], w[2] + w[3]])  # and over each KV head's query heads
    want[:, :30] += seen.previous[0]
    torch.testing.assert_close(got[0], want)


def test_tova_scores_are_the_last_querys_attention_over_every_head():
    seen = _observation(q_len=5, n=12)
    got = TOVA().score(seen)
    want = _direct_weights(seen)[:, -1].mean(0)
    torch.testing.assert_close(got[0], torch.stack([want, want]))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    budget=st.integers(1, 30),
    sinks=st.integers(0, 6),
    window=st.integers(0, 10),
    seed=st.integers(0, 2**16),
)
def test_keep_indices_invariants(n, budget, sinks, window, seed):
    if sinks + window > budget:
        with pytest.raises(ValueError, match="must not exceed budget"):
            es.keep_indices(
                torch.zeros(1, 2, n), torch.arange(n).expand(1, 2, n), budget, sinks, window
            )
        return
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 5, (1, 2, n), generator=g).float()  # ties on purpose
    pos = torch.arange(100, 100 + n).expand(1, 2, n) - 100
    idx = es.keep_indices(scores, pos, budget, sinks, window)
    assert idx.shape == (1, 2, min(n, budget))
    for h in range(2):
        kept = idx[0, h].tolist()
        assert kept == sorted(set(kept))  # unique, in position order
        assert set(range(min(sinks, n))) <= set(kept)  # sinks always kept
        assert set(range(max(0, n - window), n)) <= set(kept)  # the recent window too
        if n > budget:  # every dropped token scores no higher than every freely kept one
            free = [i for i in kept if i >= sinks and i < n - window]
            dropped = [i for i in range(n) if i not in kept]
            if free and dropped:
                assert max(scores[0, h, dropped]) <= min(scores[0, h, free])


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 60), budget=st.integers(5, 20), chunk=st.integers(1, 9))
def test_streaming_keeps_sinks_and_the_most_recent(tiny, t, budget, chunk):
    cache = EvictionCache(tiny.config, "streaming", budget=budget, sinks=4)
    ids = ids_of(t, seed=t)
    for s in range(0, t, chunk):
        compat.forward(tiny, ids[:, s : s + chunk], cache)
        layer = cache.layers[1]
        assert layer.kept() <= budget
    expect = list(range(t)) if t <= budget else [*range(4), *range(t - budget + 4, t)]
    assert cache.layers[1].positions[0, 1].tolist() == expect


# ---------------------------------------------------------------- the bundled model (slow)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_full_budget_generates_what_dynamic_cache_does(model, eval_ids, policy):
    ids = eval_ids[:, :96]
    ref = compat.generate(model, ids, max_new_tokens=8, do_sample=False)
    cache = EvictionCache(model.config, policy, budget=128)
    with capture_queries(model):
        got = compat.generate(model, ids, cache=cache, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, ref)


def test_a_small_budget_holds_its_bytes_on_the_bundled_model(model, eval_ids):
    ids = eval_ids[:, :256]
    name = "evict-snapkv-int4"
    fp16 = 30 * 3 * 256 * 64 * 2 * 2
    cache = cache_registry.make_cache(name, model.config, max_bytes=fp16 // 8)
    with capture_queries(model):
        compat.generate(model, ids, cache=cache, max_new_tokens=4, do_sample=False)
    assert cache.get_seq_length() == 256 + 3 and cache.nbytes() <= fp16 // 8


def test_every_policy_is_a_class_in_its_own_module():
    """One module per policy, each a Policy subclass with its own name; the registry's lines
    are the policies' own descriptions."""
    import importlib

    from kvlib.caches.eviction.policy import Policy

    for name, policy in POLICIES.items():
        assert isinstance(policy, Policy) and policy.name == name
        module = importlib.import_module(type(policy).__module__)
        assert module.__name__.rsplit(".", 1)[1] == name
        assert cache_registry.cache_info(f"evict-{name}").description.startswith(policy.description)
        for budget in (1, 2, 64, 1000):
            sinks = min(policy.default_sinks, budget - 1)
            assert 0 <= policy.window(budget, sinks, None) <= budget - sinks
    with pytest.raises(NotImplementedError):
        Policy().score(None)


def test_rotate_option_sets_the_keys_rotation() -> None:
    """``rotate=None`` rotates int4 keys of a power-of-two head_dim, ``False`` never does, and
    the two store different codes for the same keys; bad values are refused."""
    from _tiny_models import llama_config

    from kvlib.caches.eviction.cache import EvictionCache

    cfg = llama_config()  # head_dim 16
    default, plain = (EvictionCache(cfg, "streaming", 64, bits=4, rotate=r) for r in (None, False))
    assert default.rotation is not None and plain.rotation is None
    assert (
        EvictionCache(cfg, "streaming", 64, rotate=None).rotation is None
    )  # float16: nothing to rotate
    k = torch.randn(1, 2, 8, 16) * torch.linspace(0.1, 8, 16)  # a few outlier channels
    for c in (default, plain):
        c.update(k, k.clone(), 0)
    k_rot, k_plain = default.layers[0].stored()[0], plain.layers[0].stored()[0]
    assert not torch.equal(k_rot, k_plain)
    for got in (k_rot, k_plain):  # both are int4 reconstructions of the same keys
        assert (got - k).abs().max() < 0.2 * k.abs().max()
    with pytest.raises(ValueError, match="rotate=True"):
        EvictionCache(cfg, "streaming", 64, rotate=True)  # float16 keys
    with pytest.raises(ValueError, match="power-of-two"):
        EvictionCache(llama_config(head_dim=24), "streaming", 64, bits=4, rotate=True)
    with pytest.raises(TypeError, match="rotate"):
        EvictionCache(cfg, "streaming", 64, bits=4, rotate="yes")  # type: ignore[arg-type]
