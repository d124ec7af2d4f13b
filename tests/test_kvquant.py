"""KVQuant: the codec (kvlib.quant.kvquant), RoPE from a config (kvlib.rope) and the cache
(kvlib.caches.kvquant).

The codec's dense entries are checked against half a step of their level grid (uniform) and
Lloyd's promise (never worse than the uniform levels it starts from), its outliers against a
brute-force choice, its bytes against the formula of what it stores; the cache's pre-RoPE keys
against keys that are constant before RoPE (exact there, not after RoPE), its reads against
chunking, its byte count against its layout, and a model run through ``generate()``."""

from __future__ import annotations

import pytest
import torch
from _tiny_models import gemma3_config
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Gemma3TextConfig, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kvlib import compat
from kvlib.caches import registry
from kvlib.caches.kvquant import KVQuantCache, KVQuantLayer
from kvlib.caches.sliding import SlidingWindowLayer
from kvlib.eval.model_choice import random_config
from kvlib.quant.kvquant import (
    KVQuantizer,
    SparseBlocks,
    block_nbytes,
    decode_block,
    encode_block,
    outlier_count,
)
from kvlib.rope import apply_rope, rope_from_config, undo_rope

BITS = st.sampled_from([2, 3, 4])
AXIS = st.sampled_from(["channel", "token"])


def _keys(b: int, h: int, t: int, d: int, seed: int) -> torch.Tensor:
    """Heavy-tailed states whose channels differ in scale and sit off zero, as keys do."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, d, generator=g) * torch.logspace(-1, 1, d) + torch.linspace(-2, 2, d)
    tails = torch.randn(b, h, t, d, generator=g) / torch.rand(b, h, t, d, generator=g).add(0.05)
    return x + 0.05 * tails


# ---------------------------------------------------------------------- the codec


@settings(max_examples=20, deadline=None)
@given(bits=BITS, axis=AXIS, fraction=st.sampled_from([0.0, 0.01, 0.05]), seed=st.integers(0, 999))
def test_dense_entries_stay_within_half_a_step_and_outliers_are_exact(bits, axis, fraction, seed):
    x = _keys(2, 3, 32, 16, seed)
    enc = encode_block(x, bits, axis, fraction, nuq=False)
    y = decode_block(enc)
    flat_x, flat_y = x.reshape(2, 3, -1), y.reshape(2, 3, -1)
    idx = enc.outlier_index.squeeze(2).long()
    assert idx.shape[-1] == outlier_count(32, 16, fraction)
    assert torch.equal(flat_y.gather(-1, idx), flat_x.gather(-1, idx).half().float())
    dense = torch.ones_like(flat_x, dtype=torch.bool).scatter_(-1, idx, False).view(x.shape)
    reduce = 2 if axis == "channel" else 3
    lo, hi = enc.low.squeeze(2).float().unsqueeze(reduce), enc.high.squeeze(2).float()
    step = (hi.unsqueeze(reduce) - lo) / ((1 << bits) - 1)
    err = (y - x).abs()
    bound = step / 2 + 1e-3 * (x.abs() + 1)  # float16 rounding of the minimum and maximum
    assert bool((err <= bound)[dense].all())


@settings(max_examples=20, deadline=None)
@given(bits=BITS, axis=AXIS, seed=st.integers(0, 999))
def test_lloyd_levels_never_code_worse_than_the_uniform_ones(bits, axis, seed):
    """Lloyd's algorithm starts from the uniform levels and each step lowers the squared error
    it fits: the error relative to each channel's (token's) range, since one codebook serves
    every channel of a block (up to the float16 rounding of the levels it stores). The error in
    the states' own units weighs wide channels more, so there the levels may lose a little
    (at most 0.23 % over 6,000 blocks like these)."""
    x = _keys(1, 2, 64, 32, seed)
    reduce = 2 if axis == "channel" else 3
    err, err_abs = {}, {}
    for nuq in (False, True):
        enc = encode_block(x, bits, axis, 0.01, nuq)
        y = decode_block(enc)
        lo = enc.low.squeeze(2).float().unsqueeze(reduce)
        hi = enc.high.squeeze(2).float().unsqueeze(reduce)
        err[nuq] = float((((y - x) / (hi - lo).clamp(min=1e-12)) ** 2).sum())
        err_abs[nuq] = float(((y - x) ** 2).sum())
    assert err[True] <= err[False] * 1.001
    assert err_abs[True] <= err_abs[False] * 1.01
    levels = encode_block(x, bits, axis, 0.01, True).levels
    assert levels.shape == (1, 2, 1, 1 << bits)
    assert bool((levels[..., 1:] >= levels[..., :-1]).all())
    assert bool((levels >= 0).all() and (levels <= 1).all())


def test_outliers_are_the_entries_furthest_from_their_channel_or_token():
    x = _keys(1, 1, 16, 8, 3)
    for axis, reduce in (("channel", 2), ("token", 3)):
        enc = encode_block(x, 3, axis, 0.05)
        k = outlier_count(16, 8, 0.05)
        mean, sd = x.mean(reduce, keepdim=True), x.std(reduce, keepdim=True, correction=0)
        z = ((x - mean).abs() / sd).flatten().tolist()
        brute = sorted(range(len(z)), key=lambda i: -z[i])[:k]
        assert sorted(enc.outlier_index.flatten().tolist()) == sorted(brute)


@settings(max_examples=15, deadline=None)
@given(
    bits=BITS,
    axis=AXIS,
    nuq=st.booleans(),
    fraction=st.sampled_from([0.0, 0.01, 0.1]),
    shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.sampled_from([8, 24, 128])),
    d=st.sampled_from([8, 64]),
)
def test_bytes_held_are_the_blocks_formula(bits, axis, nuq, fraction, shape, d):
    b, h, t = shape
    enc = encode_block(torch.randn(b, h, t, d), bits, axis, fraction, nuq)
    assert enc.nbytes == b * h * block_nbytes(t, d, bits, axis, fraction, nuq)
    q = KVQuantizer(d, bits, bits, outlier_fraction=fraction, nuq=nuq)
    both = (
        q.encode_keys(torch.randn(b, h, t, d)).nbytes
        + q.encode_values(torch.randn(b, h, t, d)).nbytes
    )
    assert both == b * h * q.block_nbytes(t)
    assert q.bits_per_value(t) == pytest.approx(8 * q.block_nbytes(t) / (2 * t * d))


def test_blocks_concatenate_select_and_move_without_reencoding():
    x = _keys(3, 2, 32, 16, 0)
    a, b = encode_block(x[:, :, :16], 3, "channel"), encode_block(x[:, :, 16:], 3, "channel")
    both = a.cat(b, dim=2)
    assert both.blocks == 2 and both.shape == x.shape and both.nbytes == a.nbytes + b.nbytes
    assert torch.equal(decode_block(both), torch.cat([decode_block(a), decode_block(b)], 2))
    rows = torch.tensor([2, 0, 0])
    assert torch.equal(decode_block(both.index_select(0, rows)), decode_block(both)[rows])
    assert torch.equal(decode_block(both.to("cpu")), decode_block(both))
    with pytest.raises(ValueError, match="different settings"):
        a.cat(encode_block(x[:, :, :16], 2, "channel"))
    with pytest.raises(TypeError, match="SparseBlocks"):
        a.cat(x)
    with pytest.raises(ValueError, match="dim"):
        a.cat(b, dim=3)


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((64, 5, 3), {}, ValueError, "bits"),
        ((64, 3, 1), {}, ValueError, "bits"),
        ((60, 3, 3), {}, ValueError, "multiple of 8"),
        ((64, 3, 3), {"outlier_fraction": 0.5}, ValueError, "outlier_fraction"),
        ((64, 3, 3), {"outlier_fraction": "1%"}, TypeError, "outlier_fraction"),
        ((64, 3, 3), {"nuq": 1}, TypeError, "nuq"),
    ],
)
def test_the_codec_refuses_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        KVQuantizer(*args, **kwargs)


def test_the_codec_refuses_bad_tensors():
    q = KVQuantizer(16)
    with pytest.raises(ValueError, match="head_dim 16"):
        q.encode_keys(torch.randn(1, 1, 8, 32))
    with pytest.raises(TypeError, match="4-d floating"):
        q.encode_values(torch.randint(0, 3, (1, 1, 8, 16)))
    with pytest.raises(ValueError, match="NaN or Inf"):
        q.encode_keys(torch.full((1, 1, 8, 16), float("nan")))
    with pytest.raises(ValueError, match="float16's range"):
        q.encode_keys(torch.full((1, 1, 8, 16), 1e6))
    with pytest.raises(ValueError, match="32768"):
        encode_block(torch.randn(1, 1, 1024, 64), 3, "channel")
    with pytest.raises(ValueError, match="axis"):
        encode_block(torch.randn(1, 1, 8, 16), 3, "row")
    with pytest.raises(TypeError, match="SparseBlocks"):
        decode_block(torch.zeros(3))


# ---------------------------------------------------------------------- RoPE from a config


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ],
)
def test_rope_from_a_config_is_the_models_own(rope):
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        rope_parameters=rope,
    )
    module = LlamaRotaryEmbedding(cfg)
    inv, scaling = rope_from_config(cfg)
    assert torch.equal(inv, module.inv_freq)
    assert scaling == pytest.approx(module.attention_scaling)


def test_rope_from_a_config_per_layer_type_and_refusals():
    cfg = Gemma3TextConfig(num_hidden_layers=6, head_dim=64, num_attention_heads=2)
    local, _ = rope_from_config(cfg, "sliding_attention")
    glob, _ = rope_from_config(cfg, "full_attention")
    assert local.shape == glob.shape == (32,) and not torch.equal(local, glob)
    with pytest.raises(ValueError, match="layer_type"):
        rope_from_config(cfg)
    with pytest.raises(TypeError, match="config"):
        rope_from_config({"rope_theta": 1.0})
    dyn = LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic"):
        rope_from_config(dyn)


# ---------------------------------------------------------------------- the cache


@pytest.fixture(scope="module")
def config():
    return random_config("smollm2-135m", num_layers=3, vocab_size=512, intermediate_size=256)


def test_keys_constant_before_rope_come_back_exactly_only_with_pre_rope(config):
    """Keys that are one vector per head before RoPE: per channel, each pre-RoPE block is
    constant and codes exactly (to float16); after RoPE the same keys spin through their
    channel pairs, and per-channel codes at 2 bits lose them."""
    inv, _ = rope_from_config(config)
    d = 2 * inv.numel()
    t = 4 + 3 * 32 + 5  # sinks, three blocks, part of a window
    base = torch.randn(1, 3, 1, d, generator=torch.Generator().manual_seed(0)).expand(1, 3, t, d)
    keys = apply_rope(base.contiguous(), torch.arange(t), inv)
    err = {}
    for pre in (True, False):
        layer = KVQuantLayer(
            KVQuantizer(d, 2, 2, outlier_fraction=0.0), inv if pre else None, 1.0, 4, 32
        )
        layer.update(keys, keys.clone())
        back, _ = layer.dequantized()
        err[pre] = float((back - keys).abs().max())
    assert err[True] < 5e-3 * float(keys.abs().max())
    assert err[False] > 20 * err[True]


@settings(max_examples=10, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_how_tokens_arrive_does_not_change_what_is_read(config, sizes, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    k, v = torch.randn(2, 1, 3, total, 64, generator=g)
    whole = KVQuantCache(config, 3, 3, residual_length=16)
    parts = KVQuantCache(config, 3, 3, residual_length=16)
    whole.update(k, v, 0)
    start = 0
    for n in sizes:
        parts.update(k[:, :, start : start + n], v[:, :, start : start + n], 0)
        start += n
    for a, b in zip(whole.layers[0].dequantized(), parts.layers[0].dequantized(), strict=True):
        assert torch.equal(a, b)
    assert whole.nbytes() == parts.nbytes()


@pytest.mark.parametrize("nuq", [True, False])
@pytest.mark.parametrize("tokens", [3, 4, 40, 132, 300])
def test_nbytes_is_the_layouts_formula(config, nuq, tokens):
    cache = KVQuantCache(config, 2, 4, nuq=nuq, residual_length=32)
    k, v = torch.randn(2, 2, 3, tokens, 64)
    for i in range(3):
        cache.update(k, v, i)
    q = cache.quantizer
    sinks = min(tokens, 4)
    blocks = (tokens - sinks) // 32
    plain = 2 * 2 * 2 * 3 * (tokens - blocks * 32) * 64  # fp16 sinks and window, k and v
    expect = 3 * (plain + 2 * 3 * blocks * q.block_nbytes(32))
    assert cache.nbytes() == expect
    assert cache.fp16_nbytes() == 3 * 2 * 2 * 3 * tokens * 64 * 2


def test_a_hybrid_model_keeps_windows_in_its_sliding_layers():
    cfg = gemma3_config(window=16, head_dim=256)
    cache = KVQuantCache(cfg, 3, 3)
    sliding = [isinstance(layer, SlidingWindowLayer) for layer in cache.layers]
    assert sliding == [t == "sliding_attention" for t in cfg.layer_types]
    glob = cache.layers[sliding.index(False)]
    assert torch.equal(glob.inv_freq, rope_from_config(cfg, "full_attention")[0])
    k, v = torch.randn(2, 1, 1, 200, 256)
    for i in range(6):
        cache.update(k, v, i)
    assert all(layer.get_seq_length() == 200 for layer in cache.layers)
    n_sliding = sliding.count(True)
    pairs = zip(cache.layers, sliding, strict=True)
    dense = sum(compat.layer_nbytes(layer) for layer, s in pairs if not s)
    assert cache.nbytes() == dense + n_sliding * 16 * 256 * 2 * 2


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"key_bits": 8}, ValueError, "bits"),
        ({"residual_length": 0}, ValueError, "residual_length"),
        ({"pre_rope": "yes"}, TypeError, "pre_rope"),
        ({"outlier_fraction": -0.1}, ValueError, "outlier_fraction"),
        ({"sink_tokens": -1}, ValueError, "sink_tokens"),
    ],
)
def test_the_cache_refuses_bad_options(config, kwargs, error, match):
    with pytest.raises(error, match=match):
        KVQuantCache(config, **kwargs)


def test_the_cache_and_layer_refuse_bad_configs_and_states(config):
    with pytest.raises(TypeError, match="PretrainedConfig"):
        KVQuantCache({"num_hidden_layers": 2})
    with pytest.raises(TypeError, match="KVQuantizer"):
        KVQuantLayer("3bit", None)
    with pytest.raises(ValueError, match="inv_freq"):
        KVQuantLayer(KVQuantizer(16), torch.ones(9))
    cache = KVQuantCache(config)
    with pytest.raises(ValueError, match="built for 64"):
        cache.update(torch.randn(1, 3, 4, 32), torch.randn(1, 3, 4, 32), 0)
    with pytest.raises(ValueError, match="holds no tokens"):
        cache.layers[1].dequantized()


def test_undo_then_apply_rope_is_the_identity_the_cache_relies_on(config):
    inv, _ = rope_from_config(config)
    k = torch.randn(1, 3, 50, 64)
    pos = torch.arange(7, 57)
    torch.testing.assert_close(apply_rope(undo_rope(k, pos, inv), pos, inv), k, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def model(config):
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_generate_runs_through_every_registry_entry_and_follows_at_4_bits(model, config):
    """Through ``generate()``: every KVQuant entry generates the requested tokens with finite
    logits; at 4 bits with 1 % outliers the logits follow a DynamicCache's."""
    ids = torch.randint(0, 512, (2, 180), generator=torch.Generator().manual_seed(0))
    kwargs = dict(
        max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    ref = compat.generate(model, ids, compat.dynamic_cache(config), **kwargs)
    for name in registry.CACHE_NAMES:
        if registry.cache_info(name).family != "kvquant":
            continue
        out = compat.generate(model, ids, registry.make_cache(name, config), **kwargs)
        assert out.sequences.shape == (2, 186)
        assert all(bool(torch.isfinite(x).all()) for x in out.logits)
        if name == "kvquant-4bit":
            for a, b in zip(out.logits, ref.logits, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0.1 * float(b.abs().max()))
    cache = registry.make_cache("kvquant-3bit", config)
    assert isinstance(cache, KVQuantCache) and "pre_rope=True" in repr(cache)
    assert isinstance(cache.layers[0].codes, type(None))
    compat.generate(model, ids, cache, max_new_tokens=2, do_sample=False)
    assert isinstance(cache.layers[0].codes, SparseBlocks)


@pytest.mark.parametrize("nuq", [True, False])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_decode_block_writes_into_a_slice_what_it_returns(nuq, axis):
    x = _keys(1, 2, 64, 32, seed=5)
    first, second = (encode_block(x[:, :, s : s + 32], 3, axis, nuq=nuq) for s in (0, 32))
    enc = first.cat(second)
    want = decode_block(enc)
    big = torch.full((1, 2, 70, 32), float("nan"))
    assert decode_block(enc, out=big[:, :, 3:67]).data_ptr() == big[:, :, 3:67].data_ptr()
    assert torch.equal(big[:, :, 3:67], want) and big[:, :, :3].isnan().all()
    half = torch.empty(1, 2, 64, 32, dtype=torch.float16)
    assert torch.equal(decode_block(enc, out=half), want.half())
    with pytest.raises(ValueError, match="out must be a tensor of shape"):
        decode_block(enc, out=torch.empty(1, 2, 63, 32))
