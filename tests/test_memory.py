"""Tests for kvlib.memory: registry figures, the formula, what fits, and the real cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvlib.memory import (
    ACCEPTED_BITS,
    GPUS,
    REGISTRY,
    UNBOUNDED,
    ModelSpec,
    get_spec,
    human_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    list_specs,
    max_batch,
    max_context,
    spec_from_config,
)

GIB = 1024**3


def cache_nbytes(cache) -> int:
    """Bytes of every key/value tensor a transformers cache holds, summed over layers."""
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


# -- registry -------------------------------------------------------------------------------

REQUIRED = [
    "llama-2-7b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.1-405b",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "mistral-7b",
    "mixtral-8x7b",
    "qwen2.5-0.5b",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "gemma-2-9b",
    "phi-3-mini",
    "deepseek-v3",
    "smollm2-135m",
    "smollm2-1.7b",
]


@pytest.mark.parametrize("name", REQUIRED)
def test_required_models_registered(name):
    spec = get_spec(name)
    assert spec.num_params is not None
    assert spec.source  # every figure names where it comes from


@pytest.mark.parametrize(
    ("name", "layers", "heads", "kv_heads", "head_dim", "kind"),
    [
        ("llama-2-7b", 32, 32, 32, 128, "MHA"),
        ("llama-3.1-8b", 32, 32, 8, 128, "GQA"),
        ("llama-3.1-70b", 80, 64, 8, 128, "GQA"),
        ("llama-3.1-405b", 126, 128, 8, 128, "GQA"),
        ("llama-3.2-1b", 16, 32, 8, 64, "GQA"),
        ("llama-3.2-3b", 28, 24, 8, 128, "GQA"),
        ("mistral-7b", 32, 32, 8, 128, "GQA"),
        ("mixtral-8x7b", 32, 32, 8, 128, "GQA"),
        ("qwen2.5-0.5b", 24, 14, 2, 64, "GQA"),
        ("qwen2.5-7b", 28, 28, 4, 128, "GQA"),
        ("qwen2.5-72b", 80, 64, 8, 128, "GQA"),
        ("gemma-2-9b", 42, 16, 8, 256, "GQA"),
        ("phi-3-mini", 32, 32, 32, 96, "MHA"),
        ("falcon-7b", 32, 71, 1, 64, "MQA"),
        ("smollm2-135m", 30, 9, 3, 64, "GQA"),
        ("smollm2-1.7b", 24, 32, 32, 64, "MHA"),
    ],
)
def test_registry_figures(name, layers, heads, kv_heads, head_dim, kind):
    spec = get_spec(name)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        layers,
        heads,
        kv_heads,
        head_dim,
    )
    assert spec.attention_type == kind


def test_well_known_per_token_figures():
    # widely quoted: Llama-3.1-8B 128 KiB/token, Llama-2-7B 512 KiB/token at fp16
    assert kv_bytes_per_token(get_spec("llama-3.1-8b")) == 128 * 1024
    assert kv_bytes_per_token(get_spec("llama-2-7b")) == 512 * 1024
    assert kv_cache_bytes("llama-3.1-70b", 128 * 1024) == 40 * GIB
    # DeepSeek-V3 MLA: 61 layers × 576 values × 2 bytes
    assert kv_bytes_per_token("deepseek-v3") == 61 * 576 * 2 == 70_272


def test_sliding_patterns_in_registry():
    gemma2 = get_spec("gemma-2-9b")
    assert gemma2.sliding_window == 4096
    assert gemma2.layer_kinds[:4] == ("sliding", "full", "sliding", "full")
    assert gemma2.num_sliding_layers == gemma2.num_full_layers == 21
    gemma3 = get_spec("gemma-3-27b")
    assert gemma3.layer_kinds[:6] == ("sliding",) * 5 + ("full",)
    assert gemma3.num_full_layers == 10  # layers 5, 11, ..., 59
    mistral = get_spec("mistral-7b-v0.1")
    assert mistral.sliding_window == 4096 and mistral.num_full_layers == 0
    assert get_spec("mistral-7b-v0.3").sliding_window is None


def test_deepseek_v3_is_mla():
    spec = get_spec("deepseek-v3")
    assert spec.attention_type == "MLA"
    assert (spec.num_layers, spec.kv_lora_rank, spec.qk_rope_head_dim) == (61, 512, 64)
    plain = spec.without_mla()
    assert plain.attention_type == "MHA"
    assert kv_bytes_per_token(plain) == 2 * 61 * 128 * 128 * 2
    assert kv_bytes_per_token(plain) > 50 * kv_bytes_per_token(spec)


@pytest.mark.parametrize(
    "alias", ["Llama-3.1-8B", "llama_3_1_8b", "LLAMA 3.1 8B", "meta-llama/Llama-3.1-8B-Instruct"]
)
def test_get_spec_is_tolerant(alias):
    assert get_spec(alias) is REGISTRY["llama-3.1-8b"]


def test_list_specs_matches_registry():
    names = list_specs()
    assert names == list(REGISTRY) and len(names) >= 15
    assert all(REGISTRY[n].name == n for n in names)
    assert all(n == n.lower() for n in names)


def test_unknown_model_suggests_close_matches():
    with pytest.raises(ValueError, match=r"unknown model 'llama-3-8' — did you mean llama-3\.1-8b"):
        get_spec("llama-3-8")
    with pytest.raises(ValueError, match="did you mean.*qwen2.5-7b"):
        get_spec("qwen-2.5-7")
    with pytest.raises(TypeError, match="string"):
        get_spec(7)


# -- formula ---------------------------------------------------------------------------------


@given(
    layers=st.integers(1, 128),
    kv_heads=st.integers(1, 16),
    group=st.integers(1, 8),
    head_dim=st.integers(1, 256),
    seq_len=st.integers(0, 200_000),
    batch=st.integers(1, 64),
    bits=st.sampled_from(ACCEPTED_BITS),
)
@settings(max_examples=150, deadline=None)
def test_formula_plain(layers, kv_heads, group, head_dim, seq_len, batch, bits):
    spec = ModelSpec("x", layers, kv_heads * group, kv_heads, head_dim)
    expected_bits = 2 * layers * kv_heads * head_dim * bits * seq_len * batch
    assert kv_cache_bytes(spec, seq_len, batch, bits) == -(-expected_bits // 8)
    assert isinstance(kv_cache_bytes(spec, seq_len, batch, bits), int)


def test_formula_example_by_hand():
    spec = get_spec("llama-3.1-8b")
    # 2 × 32 layers × 8 kv heads × 128 dims × 2 bytes × 8192 tokens × 4 sequences
    assert kv_cache_bytes(spec, 8192, batch_size=4) == 2 * 32 * 8 * 128 * 2 * 8192 * 4
    assert kv_cache_bytes(spec, 8192, bits=4) == kv_cache_bytes(spec, 8192) // 4
    assert kv_cache_bytes(spec, 8192, bits=8) == kv_cache_bytes(spec, 8192) // 2
    assert kv_cache_bytes(spec, 8192, bits=2) == kv_cache_bytes(spec, 8192) // 8
    assert kv_cache_bytes(spec, 0) == 0
    assert spec.kv_bytes_per_token(bits=8) == 64 * 1024


def test_gqa_mqa_mha_scale_with_kv_heads():
    base = dict(name="x", num_layers=4, num_heads=8, head_dim=64)
    mha = ModelSpec(num_kv_heads=8, **base)
    gqa = ModelSpec(num_kv_heads=2, **base)
    mqa = ModelSpec(num_kv_heads=1, **base)
    assert [s.attention_type for s in (mha, gqa, mqa)] == ["MHA", "GQA", "MQA"]
    assert kv_cache_bytes(mha, 100) == 4 * kv_cache_bytes(gqa, 100) == 8 * kv_cache_bytes(mqa, 100)
    assert ModelSpec("one-head", 2, 1, 1, 8).attention_type == "MHA"


def test_mla_formula():
    spec = ModelSpec("mla", 3, 8, 8, 32, kv_lora_rank=100, qk_rope_head_dim=12)
    assert kv_cache_bytes(spec, 10, 2, bits=16) == 3 * (100 + 12) * 2 * 10 * 2


def test_sliding_window_caps_tokens():
    all_sliding = ModelSpec("s", 4, 4, 2, 16, sliding_window=10)
    per_token = kv_bytes_per_token(all_sliding)
    assert kv_cache_bytes(all_sliding, 7) == 7 * per_token
    assert kv_cache_bytes(all_sliding, 10) == kv_cache_bytes(all_sliding, 10_000) == 10 * per_token
    hybrid = ModelSpec(
        "h", 4, 4, 2, 16, sliding_window=10, layer_types=("sliding", "full", "local", "global")
    )
    per_layer = per_token // 4
    assert kv_cache_bytes(hybrid, 1000) == per_layer * (10 + 1000 + 10 + 1000)
    assert hybrid.tokens_cached(5) == (5, 5, 5, 5)
    # transformers' layer names are accepted and normalised
    hf_names = ModelSpec(
        "h", 2, 4, 2, 16, sliding_window=3, layer_types=["sliding_attention", "full_attention"]
    )
    assert hf_names.layer_types == ("sliding", "full")


def test_gemma2_half_the_layers_stop_growing():
    spec = get_spec("gemma-2-9b")
    per_layer = 2 * 8 * 256 * 2
    assert kv_cache_bytes(spec, 32_768) == 21 * per_layer * 32_768 + 21 * per_layer * 4096


def test_group_size_adds_scales_and_zero_points():
    spec = ModelSpec("g", 1, 1, 1, 64)
    # 2 vectors (K, V) of 64 values at 4 bits + 2 groups of 32 each with fp16 scale + zero
    assert kv_cache_bytes(spec, 1, bits=4, group_size=32) == (2 * 64 * 4 + 2 * 2 * 32) // 8
    assert kv_cache_bytes(spec, 1, bits=16, group_size=32) == kv_cache_bytes(spec, 1)
    assert kv_bytes_per_token(spec, 4, group_size=64) == 2 * 32 + 2 * 4


def test_weights_bytes():
    spec = get_spec("llama-3.1-8b")
    assert spec.weights_bytes() == 2 * 8_030_261_248
    assert spec.weights_bytes(bits=4) == 8_030_261_248 // 2
    with pytest.raises(ValueError, match="num_params is unknown"):
        ModelSpec("x", 1, 1, 1, 1).weights_bytes()


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["num_layers", "num_heads", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [0, -3])
def test_zero_or_negative_sizes_rejected(field, value):
    kwargs = dict(name="x", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        ModelSpec(**kwargs)


def test_bad_specs_rejected():
    with pytest.raises(ValueError, match="divisible"):
        ModelSpec("x", 2, 6, 4, 8)
    with pytest.raises(TypeError, match="num_layers must be an integer"):
        ModelSpec("x", 2.5, 4, 2, 8)
    with pytest.raises(ValueError, match="sliding_window"):
        ModelSpec("x", 2, 4, 2, 8, sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window is None"):
        ModelSpec("x", 2, 4, 2, 8, layer_types=("sliding", "full"))
    with pytest.raises(ValueError, match="entries but num_layers is 2"):
        ModelSpec("x", 2, 4, 2, 8, sliding_window=4, layer_types=("sliding",))
    with pytest.raises(ValueError, match=r"layer_types\[1\] must be one of"):
        ModelSpec("x", 2, 4, 2, 8, sliding_window=4, layer_types=("sliding", "mamba"))
    with pytest.raises(ValueError, match="both kv_lora_rank and qk_rope_head_dim"):
        ModelSpec("x", 2, 4, 4, 8, kv_lora_rank=16)


@pytest.mark.parametrize("bits", [0, 1, 5, 6, 12, 64, -4, 4.0, "8", True])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match=r"bits must be one of 2, 3, 4, 8, 16, 32"):
        kv_cache_bytes("smollm2-135m", 10, bits=bits)


def test_bad_lengths_and_batches():
    with pytest.raises(ValueError, match=r"seq_len must be >= 0 \(got -1\)"):
        kv_cache_bytes("smollm2-135m", -1)
    with pytest.raises(ValueError, match=r"batch_size must be positive \(got 0\)"):
        kv_cache_bytes("smollm2-135m", 10, batch_size=0)
    with pytest.raises(TypeError, match="seq_len must be an integer"):
        kv_cache_bytes("smollm2-135m", 10.5)
    with pytest.raises(TypeError, match="ModelSpec"):
        kv_cache_bytes(None, 10)
    with pytest.raises(ValueError, match="group_size must be positive"):
        kv_cache_bytes("smollm2-135m", 10, bits=4, group_size=0)


def test_bad_memory_inputs():
    with pytest.raises(ValueError, match="memory_bytes must be a finite number >= 0"):
        max_context("llama-3.1-8b", -1)
    with pytest.raises(ValueError, match="memory_bytes"):
        max_batch("llama-3.1-8b", float("nan"), 1024)
    with pytest.raises(ValueError, match="utilization must be in"):
        max_context("llama-3.1-8b", GPUS["H100 80GB"], utilization=1.5)
    with pytest.raises(ValueError, match="overhead_bytes"):
        max_context("llama-3.1-8b", GPUS["H100 80GB"], overhead_bytes=-5)
    with pytest.raises(ValueError, match="weight_bits must be one of"):
        max_context("llama-3.1-8b", GPUS["H100 80GB"], weight_bits=5)
    with pytest.raises(ValueError, match=r"seq_len must be positive \(got 0\)"):
        max_batch("llama-3.1-8b", GPUS["H100 80GB"], 0)
    with pytest.raises(ValueError, match="num_params is unknown"):
        max_context(ModelSpec("x", 1, 1, 1, 1), GPUS["T4"])


# -- what fits -------------------------------------------------------------------------------


def test_max_context_examples():
    spec = get_spec("llama-3.1-8b")
    free = GPUS["H100 80GB"] - spec.weights_bytes()
    assert max_context(spec, GPUS["H100 80GB"]) == free // (128 * 1024)
    # the weights alone do not fit: 0, not negative
    assert max_context("llama-3.1-70b", GPUS["A100 80GB"]) == 0
    assert max_batch("llama-3.1-70b", GPUS["A100 80GB"], 1024) == 0
    assert max_context(spec, 0) == 0
    # 4-bit weights make room
    assert max_context("llama-3.1-70b", GPUS["A100 80GB"], weight_bits=4) > 100_000
    # vLLM-style utilization and a fixed reserve shrink the budget
    assert max_context(spec, GPUS["H100 80GB"], utilization=0.9) < max_context(
        spec, GPUS["H100 80GB"]
    )
    reserve = 2 * 10**9
    assert max_context(spec, GPUS["H100 80GB"], overhead_bytes=reserve) == (
        (free - reserve) // (128 * 1024)
    )


def test_max_context_sliding_window():
    # every layer slides and the windows fit: memory sets no limit
    assert max_context("mistral-7b-v0.1", GPUS["A100 80GB"]) == UNBOUNDED
    # a tiny budget that cannot hold the whole window still gives a finite answer
    spec = get_spec("mistral-7b-v0.1")
    budget = spec.weights_bytes() + 1000 * spec.kv_bytes_per_token()
    assert max_context(spec, budget) == 1000
    # hybrid: only full layers grow past the window
    gemma = get_spec("gemma-2-9b")
    n = max_context(gemma, GPUS["A100 80GB"])
    assert kv_cache_bytes(gemma, n) <= GPUS["A100 80GB"] - gemma.weights_bytes()
    assert kv_cache_bytes(gemma, n + 1) > GPUS["A100 80GB"] - gemma.weights_bytes()


def test_max_batch_example():
    spec = get_spec("llama-3.1-8b")
    free = GPUS["A100 80GB"] - spec.weights_bytes()
    assert max_batch(spec, GPUS["A100 80GB"], 8192) == free // kv_cache_bytes(spec, 8192)


SPEC_NAMES = st.sampled_from(
    [
        "smollm2-135m",
        "llama-3.1-8b",
        "qwen2.5-7b",
        "gemma-2-9b",
        "gemma-3-27b",
        "deepseek-v2-lite",
        "phi-3-mini",
    ]
)


@given(
    name=SPEC_NAMES,
    memory=st.integers(0, 200 * 10**9),
    batch=st.integers(1, 64),
    bits=st.sampled_from(ACCEPTED_BITS),
)
@settings(max_examples=80, deadline=None)
def test_max_context_is_the_largest_fit(name, memory, batch, bits):
    spec = get_spec(name)
    n = max_context(spec, memory, batch, bits)
    assert n >= 0
    budget = memory - spec.weights_bytes()
    if budget < 0:
        assert n == 0
        return
    assert kv_cache_bytes(spec, n, batch, bits) <= budget
    assert kv_cache_bytes(spec, n + 1, batch, bits) > budget
    # inverse relation with max_batch
    if n >= 1:
        assert max_batch(spec, memory, n, bits) >= batch
    assert max_batch(spec, memory, n + 1, bits) < batch


@given(
    name=SPEC_NAMES,
    memory=st.integers(0, 200 * 10**9),
    extra=st.integers(0, 50 * 10**9),
    seq_len=st.integers(1, 256_000),
    bits=st.sampled_from(ACCEPTED_BITS),
)
@settings(max_examples=80, deadline=None)
def test_fits_is_monotone(name, memory, extra, seq_len, bits):
    spec = get_spec(name)
    b = max_batch(spec, memory, seq_len, bits)
    assert 0 <= b <= max_batch(spec, memory + extra, seq_len, bits)
    assert max_batch(spec, memory, seq_len + 1, bits) <= b
    assert max_context(spec, memory, 1, bits) <= max_context(spec, memory + extra, 1, bits)
    assert max_context(spec, memory, 2, bits) <= max_context(spec, memory, 1, bits)
    # fewer bits never fit less
    if bits > 2:
        smaller = ACCEPTED_BITS[ACCEPTED_BITS.index(bits) - 1]
        assert max_batch(spec, memory, seq_len, smaller) >= b
    if b >= 1:
        assert kv_cache_bytes(spec, seq_len, b, bits) <= memory - spec.weights_bytes()
    assert kv_cache_bytes(spec, seq_len, b + 1, bits) > memory - spec.weights_bytes()


# -- GPUs and formatting ---------------------------------------------------------------------


def test_gpus():
    assert GPUS["T4"] == 16 * 10**9
    assert GPUS["H200"] == 141 * 10**9
    assert GPUS["A100 80GB"] == GPUS["H100 80GB"] == 80 * 10**9
    assert {"L4", "RTX 4090", "A100 40GB"} <= set(GPUS)


@pytest.mark.parametrize(
    ("n", "kwargs", "text"),
    [
        (0, {}, "0 B"),
        (1023, {}, "1023 B"),
        (131072, {}, "128 KiB"),
        (1024**3 * 1.5, {}, "1.5 GiB"),
        (1024 * 1024 - 1, {}, "1 MiB"),
        (80 * 10**9, {"binary": False}, "80 GB"),
        (-2048, {}, "-2 KiB"),
    ],
)
def test_human_bytes(n, kwargs, text):
    assert human_bytes(n, **kwargs) == text


def test_human_bytes_rejects_garbage():
    with pytest.raises(ValueError, match="finite number"):
        human_bytes(float("inf"))


# -- spec_from_config ------------------------------------------------------------------------


def test_spec_from_bundled_config(model):
    spec = spec_from_config(model.config)
    reg = get_spec("smollm2-135m")
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert kv_bytes_per_token(spec) == kv_bytes_per_token(reg)
    assert sum(p.numel() for p in model.parameters()) == reg.num_params


def test_spec_from_config_dicts():
    # head_dim and num_key_value_heads missing: hidden // heads, MHA
    spec = spec_from_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    assert (spec.head_dim, spec.num_kv_heads, spec.attention_type) == (16, 4, "MHA")
    falcon = spec_from_config(
        {"n_layer": 32, "n_head": 71, "hidden_size": 4544, "multi_query": True}
    )
    assert (falcon.num_kv_heads, falcon.head_dim) == (1, 64)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        spec_from_config({"hidden_size": 64})


def _config_like(name: str) -> dict:
    s = get_spec(name)
    return {
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "hidden_size": s.hidden_size,
        "vocab_size": s.vocab_size,
        "max_position_embeddings": s.max_position_embeddings,
    }


def test_spec_from_transformers_configs_match_registry():
    from transformers import (
        DeepseekV3Config,
        Gemma2Config,
        Gemma3TextConfig,
        MistralConfig,
        Qwen2Config,
    )

    pairs = [
        (Qwen2Config(**_config_like("qwen2.5-7b"), sliding_window=131072), "qwen2.5-7b"),
        (MistralConfig(**_config_like("mistral-7b-v0.1"), sliding_window=4096), "mistral-7b-v0.1"),
        (MistralConfig(**_config_like("mistral-7b-v0.3"), sliding_window=None), "mistral-7b-v0.3"),
        (
            Gemma2Config(**_config_like("gemma-2-9b"), head_dim=256, sliding_window=4096),
            "gemma-2-9b",
        ),
        (
            Gemma3TextConfig(**_config_like("gemma-3-27b"), head_dim=128, sliding_window=1024),
            "gemma-3-27b",
        ),
        (
            DeepseekV3Config(**_config_like("deepseek-v3"), kv_lora_rank=512, qk_rope_head_dim=64),
            "deepseek-v3",
        ),
    ]
    for config, name in pairs:
        got, want = spec_from_config(config), get_spec(name)
        assert got.layer_kinds == want.layer_kinds, name
        assert got.sliding_window == want.sliding_window, name
        for n in (1, 1000, 100_000):
            assert kv_cache_bytes(got, n) == kv_cache_bytes(want, n), name
    # config.json-style dict with model_type: transformers fills in the layer pattern
    gemma = spec_from_config(
        {"model_type": "gemma2", **_config_like("gemma-2-9b"), "head_dim": 256}
    )
    assert gemma.layer_kinds == get_spec("gemma-2-9b").layer_kinds


# -- the formula against a real transformers cache -------------------------------------------


@pytest.mark.parametrize(("batch", "n_tokens"), [(1, 1), (1, 57), (3, 20)])
def test_formula_matches_real_dynamic_cache(model, eval_ids, batch, n_tokens):
    spec = spec_from_config(model.config)
    ids = eval_ids[:, :n_tokens].repeat(batch, 1)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    assert model.dtype == torch.float32
    assert cache_nbytes(cache) == kv_cache_bytes(spec, n_tokens, batch, bits=32)
    # decode steps grow it by exactly one token's worth each
    with torch.no_grad():
        for _ in range(3):
            model(input_ids=ids[:, -1:], cache=cache, use_cache=True)
    assert cache_nbytes(cache) == kv_cache_bytes(spec, n_tokens + 3, batch, bits=32)
    assert cache_nbytes(cache) == (n_tokens + 3) * batch * kv_bytes_per_token(spec, bits=32)


def test_formula_matches_real_fp16_cache(model, eval_ids):
    """The same model in fp16 holds exactly the 16-bit figure (bf16 would too)."""
    import copy

    half = copy.deepcopy(model).to(torch.float16)
    cache = DynamicCache(config=half.config)
    with torch.no_grad():
        half(input_ids=eval_ids[:, :64], cache=cache, use_cache=True)
    assert cache.layers[0].keys.dtype == torch.float16
    assert cache_nbytes(cache) == kv_cache_bytes(spec_from_config(half.config), 64, bits=16)


def test_sliding_window_against_real_cache():
    """A tiny random Mistral with a 16-token window on every layer: transformers keeps
    window − 1 tokens between steps (attention reads window tokens once the new one is added)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
        max_position_embeddings=128,
    )
    tiny = MistralForCausalLM(config).eval()
    spec = spec_from_config(config)
    assert spec.sliding_window == 16 and spec.num_full_layers == 0
    for n in (5, 40):
        cache = DynamicCache(config=config)
        with torch.no_grad():
            tiny(input_ids=torch.arange(n).remainder(64)[None], cache=cache, use_cache=True)
        assert cache_nbytes(cache) == kv_cache_bytes(spec, min(n, 15), bits=32)
        assert kv_cache_bytes(spec, n, bits=32) == kv_cache_bytes(spec, min(n, 16), bits=32)
