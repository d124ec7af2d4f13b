"""kvlib.caches.registry: one name per cache, defaults read from the classes."""

from __future__ import annotations

import inspect
import re
from fractions import Fraction

import pytest
import torch
import transformers
from _synthetic_kv import correlated_layers
from _tiny_models import gemma3_config, llama_config

from kvlib import compat
from kvlib.caches import layout as cache_layout
from kvlib.caches import registry as cache_registry
from kvlib.eval.model_choice import random_config
from kvlib.kvtc import codec as kvtc
from kvlib.kvtc import pca
from kvlib.quant import turboquant as tq

REFERENCES = {
    "dynamic-fp32": torch.float32,
    "dynamic-fp16": torch.float16,
    "dynamic-bf16": torch.bfloat16,
}


@pytest.fixture(scope="module")
def config():
    """A 2-layer config with SmolLM2-135M's attention shapes (no weights needed)."""
    return random_config("smollm2-135m", num_layers=2, vocab_size=512, intermediate_size=256)


def test_cache_info_parses_every_name():
    for name in cache_registry.CACHE_NAMES:
        info = cache_registry.cache_info(name)
        assert info.name == name and info.family in cache_registry.FAMILIES
        if info.family == "dynamic":
            assert info.group_size is None and info.residual_tokens == 0
            dtype = REFERENCES[name]
            assert cache_registry.reference_name(dtype) == name
            assert info.bits == torch.finfo(dtype).bits
            assert info.cache_bits(info.bits) == info.bits
            with pytest.raises(ValueError, match="reference_name"):
                info.cache_bits(8)
        elif info.family == "paged":
            assert info.cache_bits(32) == 32 and info.cache_bits(16) == 16  # the model's dtype
            assert not info.budgeted and info.group_size is None and info.residual_tokens == 0
        elif info.family == "turboquant":
            kb, vb = info.options["key_bits"], info.options["value_bits"]
            assert info.bits == max(kb, vb) == info.cache_bits(32) and info.group_size
            if name.endswith("-centered"):
                assert (
                    info.residual_tokens
                    == info.options["residual_length"] + info.options["sink_tokens"]
                    > 0
                    and f"-{kb}bit-" in name
                )
            else:  # vLLM's dtype names, round trip
                assert tq.VLLM_PRESETS[name.replace("-", "_")] == (kb, vb)
                assert info.residual_tokens == 0
        elif info.family == "kvquant":
            kb, vb = info.options["key_bits"], info.options["value_bits"]
            assert info.bits == kb == vb == info.cache_bits(32) and info.group_size
            assert f"-{kb}bit" in name and info.options["nuq"] != name.endswith("-uniform")
            assert info.residual_tokens > 0
        elif info.family == "evict":
            assert info.budgeted and info.policy and name.startswith(f"evict-{info.policy}")
            assert (info.bits, info.group_size is None) == (
                (4, False) if "int4" in name else (16, True)
            )
        elif info.family == "kvtc":
            assert info.stored and info.budgeted and info.requires == ("basis",)
            assert info.residual_tokens == sum(cache_registry.KVTC_WINDOW)
        else:
            assert not info.budgeted and info.policy is None
            bits = re.search(r"(?:int|fp)(\d)", name)
            assert bits and info.bits == int(bits.group(1)) == info.cache_bits(32)
            if info.family != "fp8":
                assert info.group_size and info.residual_tokens > 0


@pytest.mark.parametrize("bad", ["kvlib-int5", "Dynamic", "dynamic", ""])
def test_cache_info_rejects_unknown(bad):
    with pytest.raises(ValueError, match="accepted"):
        cache_registry.cache_info(bad)


@pytest.mark.parametrize("bad", [4, None])
def test_cache_info_rejects_non_strings(bad):
    with pytest.raises(TypeError, match="str"):
        cache_registry.cache_info(bad)


def test_factories_make_fresh_caches(config):
    ref = cache_registry.cache_factory(cache_registry.reference_name(torch.float32), config)
    a, b = ref(), ref()
    assert a is not b and a.get_seq_length() == 0
    assert type(a).__name__ == "DynamicCache"
    q = cache_registry.make_cache("quanto-int4", config)
    assert type(q).__name__ == "QuantizedCache" and q.get_seq_length() == 0
    with pytest.raises(ValueError, match="no options"):
        cache_registry.cache_factory("dynamic-fp32", config, bits=4)


def test_kvlib_factories(config):
    from kvlib.caches.quantized import QuantizedKVCache

    for bits in (8, 4, 2):
        cache = cache_registry.make_cache(f"kvlib-int{bits}", config)
        assert isinstance(cache, QuantizedKVCache) and cache.get_seq_length() == 0


def test_defaults_are_read_from_the_classes():
    """The entries follow the classes' defaults: a changed default changes the registry."""
    from transformers.cache_utils import QuantizedLayer

    from kvlib.caches import quantized as kvcache

    init = inspect.signature(kvcache.QuantizedKVCache.__init__).parameters
    window = init["residual_length"].default + init["sink_tokens"].default
    for bits in (8, 4, 3, 2):
        info = cache_registry.cache_info(f"kvlib-int{bits}")
        keys = kvcache.default_key_group_size(bits, init["residual_length"].default)
        assert info.residual_tokens == window
        assert info.group_size == min(keys, cache_layout.DEFAULT_VALUE_GROUP_CHANNELS)
    hf = inspect.signature(QuantizedLayer.__init__).parameters
    for name in ("quanto-int4", "hqq-int2-axis1"):
        info = cache_registry.cache_info(name)
        assert info.group_size == hf["q_group_size"].default
        assert info.residual_tokens == hf["residual_length"].default


def test_transformers_quantized_layer_defaults_are_its_own():
    """kvlib.caches.hf_layout keeps transformers' QuantizedLayer defaults as numbers (so the
    registry's table needs no transformers): they must still be transformers' own."""
    from transformers.cache_utils import QuantizedLayer

    from kvlib.caches import hf_layout

    hf = inspect.signature(QuantizedLayer.__init__).parameters
    assert hf["q_group_size"].default == hf_layout.Q_GROUP_SIZE
    assert hf["residual_length"].default == hf_layout.RESIDUAL_LENGTH
    assert hf["axis_key"].default == hf_layout.AXIS_KEY
    assert hf["axis_value"].default == hf_layout.AXIS_VALUE


def test_the_torch_free_table_matches_torch():
    """The table's plain data (dtype names and bits, the eviction policies' lines) agrees with
    what the torch side builds: the reference's bits, ``POLICIES``, the caches' defaults."""
    from kvlib.caches import entries, eviction_settings
    from kvlib.caches.eviction.cache import POLICIES
    from kvlib.caches.eviction.layer import GROUP_SIZE
    from kvlib.caches.kvquant import KVQuantCache
    from kvlib.caches.turboquant import BOUNDARY_LAYERS
    from kvlib.quant import presets

    for short, (dtype, bits) in entries.REFERENCE_DTYPES.items():
        assert torch.finfo(getattr(torch, dtype)).bits == bits
        assert cache_registry.reference_name(getattr(torch, dtype)) == f"dynamic-{short}"
    assert list(cache_registry.DTYPE_NAMES) == [torch.float32, torch.float16, torch.bfloat16]
    assert list(POLICIES) == list(eviction_settings.POLICY_LINES)  # the registry's order
    for name, policy in POLICIES.items():
        assert policy.description == eviction_settings.POLICY_LINES[name]
    assert GROUP_SIZE == eviction_settings.GROUP_SIZE
    assert tq.VLLM_PRESETS is presets.VLLM_PRESETS and BOUNDARY_LAYERS == presets.BOUNDARY_LAYERS
    init = inspect.signature(KVQuantCache.__init__).parameters
    assert init["outlier_fraction"].default == presets.OUTLIER_FRACTION


def test_eviction_entries_name_their_dtype(config):
    """The table names the eviction caches' dtype (``"float16"``); the factory passes the torch
    dtype, and an explicit ``dtype=`` still overrides it."""
    for name in cache_registry.EVICTION_NAMES:
        assert cache_registry.cache_info(name).options["dtype"] == "float16"
    keys = torch.randn(1, config.num_key_value_heads, 3, config.head_dim)
    for options, dtype in (({}, torch.float16), ({"dtype": torch.float32}, torch.float32)):
        for name in ("evict-streaming", "evict-knorm-int4"):
            cache = cache_registry.make_cache(name, config, budget=8, **options)
            cache.update(keys, keys, 0)
            assert cache.layers[0].dtype == dtype


def test_variants_build_the_cache_their_name_says(config):
    rot = cache_registry.make_cache("kvlib-int4-rot", config)
    norot = cache_registry.make_cache("kvlib-int2-norot", config)
    block = cache_registry.make_cache("kvlib-int4-block", config)
    assert rot.rotate is True and norot.rotate is False
    assert block.key_group_size == 128 and block.group_size == 32 and block.rotate is False
    # an explicit option overrides the variant's own
    assert cache_registry.make_cache("kvlib-int4-rot", config, rotate=False).rotate is False
    axis1 = cache_registry.make_cache("hqq-int4-axis1", config)
    assert type(axis1).__name__ == "QuantizedCache"
    with pytest.raises(ValueError, match="no options"):
        cache_registry.cache_factory("hf-fp8", config, nbits=4)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_the_short_window_caches_hold_what_their_name_says(config, bits):
    """``kvlib-int<b>-w64``: a 64-token window that is also the key group, every other default
    kept; its bytes are kvlib.memory's formula; at 4096 tokens it saves more than the 64 float16
    tokens it no longer keeps (its key groups are coarser too), and at 3 bits it holds at most a
    quarter of the float16 cache's bytes."""
    from kvlib import memory, specs

    name = f"kvlib-int{bits}-w{cache_registry.SHORT_WINDOW}"
    short, default = (cache_registry.make_cache(n, config) for n in (name, f"kvlib-int{bits}"))
    assert short.residual_length == short.key_group_size == cache_registry.SHORT_WINDOW == 64
    assert (short.key_bits, short.value_bits, short.sink_tokens, short.rotate) == (
        default.key_bits,
        default.value_bits,
        default.sink_tokens,
        default.rotate,
    )
    info = cache_registry.cache_info(name)
    assert info.residual_tokens == 64 + short.sink_tokens and info.bits == bits
    layers, heads, d = config.num_hidden_layers, config.num_key_value_heads, 64
    tokens = 4096
    k = torch.randn(1, heads, tokens, d)
    for cache in (short, default):
        for i in range(layers):
            cache.update(k, k, i)
    spec = specs.spec_from_config(config)
    assert short.nbytes() == memory.quantized_cache_bytes(
        spec,
        tokens,
        key_bits=bits,
        value_bits=bits,
        group_size=short.group_size,
        key_group_size=64,
        residual_length=64,
        sink_tokens=short.sink_tokens,
        window_bits=16,
        rotate=short.rotate,
    )
    window_saved = 64 * 2 * layers * heads * d * (16 - bits) // 8  # 64 fewer fp16 tokens
    assert short.nbytes() < default.nbytes() - window_saved
    assert (short.nbytes() <= short.fp16_nbytes() / 4) == (bits <= 3)


def test_check_names():
    assert cache_registry.check_names(("kvlib-int4", "dynamic-fp32")) == [
        "kvlib-int4",
        "dynamic-fp32",
    ]
    with pytest.raises(TypeError, match="non-empty list"):
        cache_registry.check_names("kvlib-int4")
    with pytest.raises(TypeError, match="non-empty list"):
        cache_registry.check_names([])
    with pytest.raises(ValueError, match="unknown cache"):
        cache_registry.check_names(["kvlib-int4", "int4"])


def test_reference_name_refuses_other_dtypes():
    with pytest.raises(ValueError, match="no reference cache"):
        cache_registry.reference_name(torch.int8)


def test_the_cache_benchmark_names_registry_caches():
    """benchmarks/bench_cache.py compares caches by registry name: no private spellings."""
    from _scripts import load_script

    module = load_script("benchmarks/bench_cache.py")
    assert cache_registry.check_names(module.BENCH_CACHES)


def test_the_paged_cache_by_name_generates_as_dynamic_cache_does(config):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 12))
    make = cache_registry.cache_factory("paged", config, num_blocks=16, block_size=4)
    first, second = make(), make()
    assert first is not second and first.block_size == 4 and first.num_blocks == 16
    with torch.no_grad():
        paged = model.generate(ids, max_new_tokens=5, do_sample=False, cache=first)
        dense = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(paged, dense)
    assert first.store is not None and first.store.allocator.num_used > 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({}, "num_blocks"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 4, "block_size": 0}, "block_size"),
    ],
)
def test_the_paged_cache_refuses_a_missing_or_bad_pool(config, options, match):
    with pytest.raises(ValueError, match=match):
        cache_registry.cache_factory("paged", config, **options)
    with pytest.raises(ValueError, match="takes no budget"):
        cache_registry.cache_info("paged@1/4")


# ------------------------------------------------------------------ transform coding (stored)


@pytest.fixture(scope="module")
def kvtc_basis():
    return pca.fit_basis(correlated_layers(24, 64), cross_layer=False)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_kvtc_budget_sizes_the_stored_bytes(config, kvtc_basis, k):
    """``kvtc@1/k`` builds a codec that aims the stored bytes of ``tokens`` tokens at 95 % of
    1/k of the fp16 cache's, its float16 window paid first (the eviction benchmark's formula);
    on 2,048 synthetic tokens they land within the budget. (It is an aim, not a bound: at 512
    tokens and 1/8, where the window alone is 7 % of the fp16 bytes, they come 2 % over.)"""
    tokens = 2048
    info = cache_registry.cache_info(f"kvtc@1/{k}")
    assert info.stored and info.budgeted and info.requires == ("basis",)
    codec = cache_registry.make_cache(f"kvtc@1/{k}", config, basis=kvtc_basis, tokens=tokens)
    assert isinstance(codec, kvtc.KVTCCodec)
    sinks, recent = cache_registry.KVTC_WINDOW
    assert (codec.sink_tokens, codec.recent_tokens) == (sinks, recent)
    w = (sinks + recent) / tokens
    assert codec.compression == (1 - w) / (0.95 / k - w)
    cache = compat.dynamic_cache_from(correlated_layers(1, tokens, seed=3))
    stored = len(codec.encode(cache))
    fp16 = sum(2 * t.numel() for kv in compat.cache_tensors(cache) for t in kv)
    assert stored <= fp16 / k, (stored, fp16 / k)
    with pytest.raises(ValueError, match="no fixed bits"):
        info.cache_bits()


@pytest.mark.parametrize(
    "name, options, error, match",
    [
        ("kvtc@1/4", {"tokens": 64}, ValueError, "needs basis="),
        ("kvtc@1/4", {"basis": "B"}, ValueError, "pass tokens="),
        ("kvtc@1/4", {"basis": "B", "tokens": 64, "compression": 4.0}, ValueError, "already"),
        ("kvtc@1/16", {"basis": "B", "tokens": 64}, ValueError, "window alone"),
        ("kvtc", {"basis": "B", "tokens": 64}, ValueError, "fractional budget"),
        ("kvtc@1/4", {"basis": "B", "tokens": 0}, ValueError, "tokens"),
        ("kvtc@1/4", {"basis": "B", "tokens": 512, "coder": "zip"}, ValueError, "coder"),
        ("kvtc", {"basis": object()}, TypeError, "KVPCABasis"),
    ],
)
def test_kvtc_bad_options_are_refused(config, kvtc_basis, name, options, error, match):
    options = {k: kvtc_basis if v == "B" else v for k, v in options.items()}
    with pytest.raises(error, match=match):
        cache_registry.cache_factory(name, config, **options)


# ------------------------------------------------ budgets on a model with sliding layers


def test_window_bytes_are_what_a_dynamic_cache_holds_in_its_sliding_layers():
    config = gemma3_config(window=16)
    cache = compat.dynamic_cache(config)
    model = transformers.Gemma3ForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 40))
    with torch.no_grad():
        compat.forward(model, ids, cache=cache)
    kinds = compat.layer_types(config)
    sliding = sum(
        compat.layer_nbytes(layer)
        for layer, kind in zip(cache.layers, kinds, strict=True)
        if kind == "sliding_attention"
    )
    # the float32 model's windows hold twice the float16 bytes; transformers' sliding layer
    # keeps one token fewer between steps than attention reads (kvlib.memory's docstring)
    held = cache_registry.window_fp16_bytes(config, 40) * (config.sliding_window - 1)
    assert 2 * held == sliding * config.sliding_window
    llama = llama_config()
    assert cache_registry.window_fp16_bytes(llama, 40) == 0


@pytest.mark.parametrize("tokens", [8, 16, 17, 300])
@pytest.mark.parametrize("k", [1, 2, 4, 16])
def test_a_global_share_keeps_the_windows_whole_and_shares_the_rest(tokens, k):
    config = gemma3_config(window=16)
    whole = cache_registry.fp16_bytes(config, tokens)
    windows = cache_registry.window_fp16_bytes(config, tokens)
    share = Fraction(1, k)
    got = cache_registry.share_bytes(config, tokens, share, of="global")
    assert got == windows + (whole - windows) // k
    assert cache_registry.share_bytes(config, tokens, share) == whole // k
    assert cache_registry.share_bytes(config, tokens, share, of="global") >= whole // k
    llama = llama_config()  # no sliding layers: the two shares are one
    assert cache_registry.share_bytes(llama, tokens, share, of="global") == (
        cache_registry.share_bytes(llama, tokens, share)
    )


def test_a_global_share_is_a_budget_an_eviction_cache_meets():
    config = gemma3_config(window=16)
    limit = cache_registry.share_bytes(config, 200, Fraction(1, 4), of="global")
    # the full layer keeps about a quarter of the tokens: a little less, as every kept token
    # also holds its position (and H2O its score) beside its float16 key and value
    for policy in ("streaming", "h2o"):
        cache = cache_registry.make_cache(f"evict-{policy}", config, max_bytes=limit)
        assert 200 // 4 - 3 <= cache.budget < 200 // 4
    with pytest.raises(ValueError, match="max_bytes .* holds no token"):
        cache_registry.make_cache(
            "evict-h2o",
            config,
            max_bytes=cache_registry.share_bytes(config, 200, Fraction(1, 4)),  # of the whole
        )


@pytest.mark.parametrize(
    ("share", "of", "match"),
    [
        (0.25, "cache", "Fraction"),
        (Fraction(3, 2), "cache", "Fraction"),
        (Fraction(1, 2), "all", "'cache' or 'global'"),
    ],
)
def test_share_bytes_refuses_bad_arguments(share, of, match):
    with pytest.raises(ValueError, match=match):
        cache_registry.share_bytes(llama_config(), 16, share, of=of)
