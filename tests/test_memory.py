"""Tests for kvlib.memory: the byte formula, what fits in a GPU, and the real cache."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvlib import memory
from kvlib.memory import (
    GIB,
    GPUS,
    UNBOUNDED,
    human_bytes,
    kv_bytes_per_token,
    kv_cache_bits,
    kv_cache_bytes,
    max_batch,
    max_context,
    window_bytes,
)
from kvlib.specs import ModelSpec, get_spec, spec_from_config
from kvlib.validate import PRICED_BITS


def cache_nbytes(cache) -> int:
    """Bytes of every key/value tensor a transformers cache holds, summed over layers."""
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def test_well_known_per_token_figures():
    # widely quoted: Llama-3.1-8B 128 KiB/token, Llama-2-7B 512 KiB/token at fp16
    assert kv_bytes_per_token(get_spec("llama-3.1-8b")) == 128 * 1024
    assert kv_bytes_per_token(get_spec("llama-2-7b")) == 512 * 1024
    assert kv_cache_bytes("llama-3.1-70b", 128 * 1024) == 40 * GIB
    # DeepSeek-V3 MLA: 61 layers × 576 values × 2 bytes
    assert kv_bytes_per_token("deepseek-v3") == 61 * 576 * 2 == 70_272
    plain = get_spec("deepseek-v3").without_mla()
    # as plain MHA: 128 heads, keys 128 + 64 (RoPE) wide, values 128 wide, fp16
    assert kv_bytes_per_token(plain) == 61 * 128 * (192 + 128) * 2
    assert kv_bytes_per_token(plain) > 50 * kv_bytes_per_token("deepseek-v3")


# -- formula ---------------------------------------------------------------------------------


@given(
    layers=st.integers(1, 128),
    kv_heads=st.integers(1, 16),
    group=st.integers(1, 8),
    head_dim=st.integers(1, 256),
    seq_len=st.integers(0, 200_000),
    batch=st.integers(1, 64),
    bits=st.sampled_from(PRICED_BITS),
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
    assert kv_bytes_per_token(spec, bits=8) == 64 * 1024


def test_gqa_mqa_mha_scale_with_kv_heads():
    base = dict(name="x", num_layers=4, num_heads=8, head_dim=64)
    mha = ModelSpec(num_kv_heads=8, **base)
    gqa = ModelSpec(num_kv_heads=2, **base)
    mqa = ModelSpec(num_kv_heads=1, **base)
    assert kv_cache_bytes(mha, 100) == 4 * kv_cache_bytes(gqa, 100) == 8 * kv_cache_bytes(mqa, 100)


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


def test_bytes_round_up_once():
    spec = ModelSpec("odd", 1, 1, 1, 3)  # 2 × 3 values × 3 bits = 18 bits per token
    assert kv_cache_bits(spec, 4, bits=3) == 72
    assert kv_cache_bytes(spec, 4, bits=3) == 9  # not 4 × ceil(18 / 8) = 12
    assert kv_bytes_per_token(spec, 3) == 3


def test_group_size_adds_scales_and_zero_points():
    spec = ModelSpec("g", 1, 1, 1, 64)
    # 2 vectors (K, V) of 64 values at 4 bits + 2 groups of 32 each with fp16 scale + zero
    assert kv_cache_bytes(spec, 1, bits=4, group_size=32) == (2 * 64 * 4 + 2 * 2 * 32) // 8
    assert kv_cache_bytes(spec, 1, bits=16, group_size=32) == kv_cache_bytes(spec, 1)
    assert kv_bytes_per_token(spec, 4, group_size=64) == 2 * 32 + 2 * 4
    # keys 96 wide (3 groups of 32), values 64 wide (2 groups): groups counted per vector
    wide_keys = ModelSpec("kv", 1, 2, 2, 96, value_head_dim=64)
    assert (
        kv_cache_bits(wide_keys, 1, bits=4, group_size=32) == 2 * (96 + 64) * 4 + 2 * (3 + 2) * 32
    )


def test_scale_only_groups_price_llama_cpp_blocks_exactly():
    """q8_0 / q4_0 keep one fp16 scale per block of 32 values: 8.5 / 4.5 bits per value, also
    where head_dim (96) is not a multiple of 64."""
    spec = ModelSpec("h96", 1, 1, 1, 96, num_params=1)
    for bits in (8, 4):
        got = kv_cache_bits(spec, 1, bits=bits, group_size=32, group_meta_bits=16)
        assert got == 2 * 96 * bits + 2 * 3 * 16 and got / (2 * 96) == bits + 0.5
    # groups of 64 with scale + zero point round up to 2 groups per 96 values: not the same
    assert kv_cache_bits(spec, 1, bits=8, group_size=64) == 2 * 96 * 8 + 2 * 2 * 32
    assert max_batch(spec, 10**6, 100, bits=4, group_size=32, group_meta_bits=16) == (
        8 * 10**6 // kv_cache_bits(spec, 100, bits=4, group_size=32, group_meta_bits=16)
    )
    with pytest.raises(ValueError, match="group_meta_bits"):
        kv_cache_bytes(spec, 1, bits=8, group_size=32, group_meta_bits=-1)


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [0, 1, 7, 12, 64, -4])
def test_bad_bits(bits):
    with pytest.raises(
        ValueError, match=rf"bits must be one of 2, 3, 4, 5, 6, 8, 16, 32 \(got {bits}\)"
    ):
        kv_cache_bytes("smollm2-135m", 10, bits=bits)
    with pytest.raises(ValueError, match="bits must be one of 2, 3, 4, 5, 6, 8, 16, 32"):
        kv_bytes_per_token("smollm2-135m", bits=bits)


@pytest.mark.parametrize("bits", [4.0, "8", True, None])
def test_bits_of_the_wrong_kind(bits):
    with pytest.raises(TypeError, match=r"bits must be an int, one of 2, 3, 4, 5, 6, 8, 16, 32"):
        kv_cache_bytes("smollm2-135m", 10, bits=bits)


def test_bad_lengths_and_batches():
    with pytest.raises(ValueError, match=r"seq_len must be an int >= 0 \(got -1\)"):
        kv_cache_bytes("smollm2-135m", -1)
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1 \(got 0\)"):
        kv_cache_bytes("smollm2-135m", 10, batch_size=0)
    with pytest.raises(TypeError, match="seq_len must be an int"):
        kv_cache_bytes("smollm2-135m", 10.5)
    with pytest.raises(TypeError, match="ModelSpec"):
        kv_cache_bytes(None, 10)
    with pytest.raises(ValueError, match="unknown model"):
        kv_cache_bytes("no-such-model", 10)
    with pytest.raises(ValueError, match=r"group_size must be an int >= 1 \(got 0\)"):
        kv_cache_bytes("smollm2-135m", 10, bits=4, group_size=0)


def test_bad_memory_inputs():
    with pytest.raises(ValueError, match="memory_bytes must be a finite number >= 0"):
        max_context("llama-3.1-8b", -1)
    with pytest.raises(ValueError, match="memory_bytes must be finite"):
        max_batch("llama-3.1-8b", float("nan"), 1024)
    with pytest.raises(TypeError, match="memory_bytes must be a number"):
        max_batch("llama-3.1-8b", "80GB", 1024)
    with pytest.raises(ValueError, match="utilization must be in"):
        max_context("llama-3.1-8b", GPUS["H100 80GB"], utilization=1.5)
    with pytest.raises(ValueError, match="overhead_bytes"):
        max_context("llama-3.1-8b", GPUS["H100 80GB"], overhead_bytes=-5)
    with pytest.raises(ValueError, match="weight_bits must be one of"):
        max_context("llama-3.1-8b", GPUS["H100 80GB"], weight_bits=7)
    with pytest.raises(ValueError, match=r"seq_len must be an int >= 1 \(got 0\)"):
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
    budget = spec.weights_bytes() + 1000 * kv_bytes_per_token(spec)
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
    bits=st.sampled_from(PRICED_BITS),
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
    bits=st.sampled_from(PRICED_BITS),
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
        smaller = PRICED_BITS[PRICED_BITS.index(bits) - 1]
        assert max_batch(spec, memory, seq_len, smaller) >= b
    if b >= 1:
        assert kv_cache_bytes(spec, seq_len, b, bits) <= memory - spec.weights_bytes()
    assert kv_cache_bytes(spec, seq_len, b + 1, bits) > memory - spec.weights_bytes()


# -- GPUs and formatting ---------------------------------------------------------------------


def test_gpus_are_counted_as_their_driver_reports():
    """One unit for GPU memory (GiB), each card at the total nvidia-smi reports in MiB: a little
    under the size in its name (ECC on a T4), never over it, and never more than 6.5 % under."""
    from kvlib.memory import GPU_NAMED_GIB, MIB

    assert set(GPUS) == set(GPU_NAMED_GIB)
    for name, nbytes in GPUS.items():
        assert nbytes % MIB == 0, name
        named = GPU_NAMED_GIB[name] * GIB
        assert 0.935 * named <= nbytes <= named, name
        label = re.search(r"(\d+)GB", name)
        if label:
            assert int(label.group(1)) == GPU_NAMED_GIB[name], name
    assert GIB == 1024**3 and MIB == 1024**2
    assert GPUS["T4"] == 15 * GIB and GPUS["A100 80GB"] == 80 * GIB  # ECC's 1/16 on a T4
    assert human_bytes(GPUS["H100 80GB"]) == "79.6 GiB" and GPUS["H100 80GB"] == 81_559 * MIB


def test_what_fits_on_an_80_gib_card():
    """Notebook 01's example: Llama-3.1-8B, fp16 weights and cache, 90 % of an H100 (79.65 GiB)."""
    llama8, h100 = get_spec("llama-3.1-8b"), GPUS["H100 80GB"]
    budget = int(0.9 * h100) - llama8.weights_bytes()
    per_seq = kv_cache_bytes(llama8, 8192)  # 1 GiB per 8k-token sequence
    assert per_seq == GIB
    assert max_batch(llama8, h100, 8192, utilization=0.9) == budget // per_seq == 56
    assert max_batch(llama8, h100, 8192, bits=4, utilization=0.9) == budget // (per_seq // 4)


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


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(
        ["gemma-2-9b", "gemma-3-27b", "gemma-3-270m", "mistral-7b-v0.1", "llama-3.1-8b"]
    ),
    seq_len=st.integers(0, 70_000),
    batch=st.integers(1, 4),
    bits=st.sampled_from([2, 4, 8]),
    window_bits=st.sampled_from([None, 4, 8, 16]),
)
def test_window_bits_price_the_sliding_layers_alone(name, seq_len, batch, bits, window_bits):
    """The cache at ``bits`` with sliding layers at ``window_bits`` is the global layers at
    ``bits`` plus the sliding layers at ``window_bits``, each priced as its own model; None is
    ``bits``; a model without sliding layers does not see it."""
    spec = get_spec(name)
    kinds = spec.layer_kinds
    part = {
        kind: ModelSpec(
            kind,
            kinds.count(kind),
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            sliding_window=spec.sliding_window if kind == "sliding" else None,
        )
        for kind in set(kinds)
    }
    wb = bits if window_bits is None else window_bits
    expected = sum(
        kv_cache_bits(part[k], seq_len, batch, wb if k == "sliding" else bits, group_size=32)
        for k in part
    )
    got = kv_cache_bits(spec, seq_len, batch, bits, group_size=32, window_bits=window_bits)
    assert got == expected
    if spec.num_sliding_layers == 0:
        assert got == kv_cache_bits(spec, seq_len, batch, bits, group_size=32)


def test_window_bits_in_what_fits_and_bad_values():
    spec = get_spec("gemma-2-9b")
    gib = 2**30
    n16 = max_batch(spec, 22 * gib, 8192, 4, window_bits=16)
    n4 = max_batch(spec, 22 * gib, 8192, 4)
    assert 0 < n16 < n4  # fp16 windows cost room
    c16 = max_context(spec, 22 * gib, 1, 4, window_bits=16)
    assert kv_cache_bytes(spec, c16, 1, 4, window_bits=16) <= 22 * gib - spec.weights_bytes()
    assert kv_cache_bytes(spec, c16 + 1, 1, 4, window_bits=16) > 22 * gib - spec.weights_bytes()
    for bad, error in ((7, ValueError), ("16", TypeError)):
        with pytest.raises(error, match="window_bits"):
            kv_cache_bytes(spec, 10, window_bits=bad)


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(["gemma-2-9b", "gemma-3-27b", "llama-3.1-8b", "mistral-7b-v0.1"]),
    seq_len=st.integers(0, 200_000),
    batch=st.integers(1, 8),
)
def test_window_bytes_are_the_part_of_the_fp16_cache_that_stops_growing(name, seq_len, batch):
    spec = get_spec(name)
    whole = kv_cache_bytes(spec, seq_len, batch)
    windows = window_bytes(spec, seq_len, batch)
    per_token_layer = 2 * spec.num_kv_heads * spec.head_dim * 2  # K and V, fp16
    full = spec.num_layers - spec.num_sliding_layers
    assert whole - windows == full * seq_len * batch * per_token_layer
    if spec.num_sliding_layers:
        held = min(seq_len, spec.sliding_window)
        assert windows == spec.num_sliding_layers * held * batch * per_token_layer
        assert window_bytes(spec, seq_len + spec.sliding_window, batch) == (
            window_bytes(spec, spec.sliding_window, batch)
        )
    else:
        assert windows == 0


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((get_spec("gemma-2-9b"), -1), ValueError),
        ((get_spec("gemma-2-9b"), 8, 0), ValueError),
        ((3, 8), TypeError),
    ],
)
def test_window_bytes_refuses_bad_arguments(args, error):
    with pytest.raises(error):
        window_bytes(*args)


@settings(max_examples=200, deadline=None)
@given(
    fp16=st.integers(0, 2**40),
    window_share=st.fractions(0, 1),
    num=st.integers(1, 64),
    den=st.integers(1, 64),
)
def test_budget_bytes_keeps_the_windows_and_a_share_of_the_rest(fp16, window_share, num, den):
    share = Fraction(min(num, den), den)
    windows = int(fp16 * window_share)
    b = memory.budget_bytes(fp16, share, windows)
    assert windows <= b <= fp16
    assert b - windows <= (fp16 - windows) * share < b - windows + 1  # the rest, rounded down
    assert memory.budget_bytes(fp16, Fraction(1), windows) == fp16
    if share < 1:  # a smaller share never keeps more
        assert memory.budget_bytes(fp16, share / 2, windows) <= b


def test_budget_bytes_refuses_bad_arguments():
    with pytest.raises(ValueError, match="share"):
        memory.budget_bytes(100, Fraction(3, 2))
    with pytest.raises(ValueError, match="share"):
        memory.budget_bytes(100, 0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window_bytes"):
        memory.budget_bytes(100, Fraction(1, 2), 101)
    with pytest.raises(TypeError):
        memory.budget_bytes(100.0, Fraction(1, 2))  # type: ignore[arg-type]
