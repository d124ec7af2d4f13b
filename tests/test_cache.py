"""kvlib.caches.quantized.QuantizedKVCache: agreement with DynamicCache, byte accounting, batch, chunked
prefill, reset, quantize-once, bad input, and a property test of the layer."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from kvlib import compat
from kvlib.caches.quantized import QuantizedKVCache, QuantizedKVLayer
from kvlib.eval import quality
from kvlib.quant.packing import packed_nbytes
from kvlib.quant.rotation import hadamard


def tiny_config(layers: int = 2, kv_heads: int = 2, head_dim: int = 16) -> LlamaConfig:
    return LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=32,
        vocab_size=64,
    )


def feed(cache_or_layer, k: torch.Tensor, v: torch.Tensor, chunks: list[int]) -> list:
    """Feed (b, h, T, d) states in chunks of the given sizes; return what each update returned."""
    outs, start = [], 0
    for n in chunks:
        sl = slice(start, start + n)
        if isinstance(cache_or_layer, QuantizedKVLayer):
            outs.append(cache_or_layer.update(k[:, :, sl], v[:, :, sl]))
        else:
            for i in range(len(cache_or_layer.layers)):
                outs.append(cache_or_layer.update(k[:, :, sl], v[:, :, sl], i))
        start += n
    assert start == k.shape[2]
    return outs


def state(layer: QuantizedKVLayer) -> dict[str, torch.Tensor]:
    """Every stored tensor of a layer, by name."""
    out = {
        "sink_keys": layer.sink_keys,
        "sink_values": layer.sink_values,
        "residual_keys": layer.residual_keys,
        "residual_values": layer.residual_values,
    }
    for name in ("key_blocks", "value_blocks"):
        q = getattr(layer, name)
        if q is not None:
            out[f"{name}.packed"] = q.packed
            out[f"{name}.scale"] = q.scale
            out[f"{name}.offset"] = q.offset
    return out


def assert_same_state(a: QuantizedKVLayer, b: QuantizedKVLayer) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].shape == sb[name].shape, name
        assert torch.equal(sa[name], sb[name]), name
    assert a.get_seq_length() == b.get_seq_length()


# ------------------------------------------------------------------ with the bundled model


def test_int8_argmax_agrees_with_dynamic_cache(model, eval_ids):
    # the reference: DynamicCache (full precision; chunking does not change it)
    _, ref = quality.token_logprobs(model, eval_ids, chunk_size=eval_ids.shape[1])
    # chunks of 64, so every chunk reads the quantized past
    cache = QuantizedKVCache(model.config, 8)
    _, got = quality.token_logprobs(model, eval_ids, cache=cache, chunk_size=64)
    assert got.shape == ref.shape == (1, 2047)
    assert cache.layers[0].n_blocks == (2047 - 4) // 128  # the past really was quantized
    agree = (got == ref).float().mean().item()
    assert agree >= 0.99, f"int8 argmax agrees on {agree:.2%} of positions"


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_low_bits_run_with_finite_logits(model, eval_ids, bits):
    ids = eval_ids[:, :96]
    cache = QuantizedKVCache(model.config, bits, residual_length=16)
    lp, _ = quality.token_logprobs(model, ids, cache=cache, chunk_size=32)
    assert torch.isfinite(lp).all()
    assert cache.layers[0].n_blocks == (96 - 1 - 4) // 16
    ref, _ = quality.token_logprobs(model, ids, chunk_size=96)
    ppl, ppl_ref = math.exp(-lp.mean().item()), math.exp(-ref.mean().item())
    assert ppl < ppl_ref * (1.05 if bits >= 4 else 1.6)
    assert cache.compression_ratio() > 1.0


def test_greedy_generate_int8_matches_dynamic_without_warnings(model, tokenizer, eval_ids):
    prompt = eval_ids[:, :60]  # 4 sinks, then blocks of 16 quantized during generation
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = QuantizedKVCache(model.config, 8, residual_length=16)
        out = compat.generate(model, prompt, cache=cache, max_new_tokens=12, do_sample=False)
        ref = compat.generate(model, prompt, max_new_tokens=12, do_sample=False)
    assert cache.layers[0].n_blocks == (60 + 11 - 4) // 16
    assert tokenizer.decode(out[0, 60:]) == tokenizer.decode(ref[0, 60:])
    assert cache.get_seq_length() == 60 + 12 - 1


def test_beam_search_reorders(model, eval_ids):
    prompt = eval_ids[:, :40]
    kw = dict(max_new_tokens=4, do_sample=False, num_beams=2)
    cache = QuantizedKVCache(model.config, 8, residual_length=16)
    out = compat.generate(model, prompt, cache=cache, **kw)
    ref = compat.generate(model, prompt, **kw)
    assert out.shape == ref.shape
    assert torch.equal(out, ref)


def test_batch_equals_rows_in_the_model(model, eval_ids):
    rows = torch.cat([eval_ids[:, :80], eval_ids[:, 400:480]])
    cache = QuantizedKVCache(model.config, 4, residual_length=16)
    batch_lp, batch_am = quality.token_logprobs(model, rows, cache=cache, chunk_size=32)
    for i in range(2):
        c = QuantizedKVCache(model.config, 4, residual_length=16)
        lp, am = quality.token_logprobs(model, rows[i : i + 1], cache=c, chunk_size=32)
        # batched matmuls may differ in the last float bits, which can move a code by one step
        assert (am[0] == batch_am[i]).float().mean() >= 0.98
        torch.testing.assert_close(lp[0], batch_lp[i], atol=0.05, rtol=0)


def test_reset_and_reuse(model, eval_ids):
    ids = eval_ids[:, :80]
    cache = QuantizedKVCache(model.config, 4, residual_length=16)
    first = quality.perplexity(model, ids, cache=cache, chunk_size=32)
    assert cache.get_seq_length() == 79 and cache.nbytes() > 0
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0 and cache.fp16_nbytes() == 0
    again = quality.perplexity(model, ids, cache=cache, chunk_size=32)
    assert again == pytest.approx(first, rel=1e-6)


# ------------------------------------------------------------------ layer on random tensors


def test_byte_accounting_hand_count():
    cfg = tiny_config(layers=2, kv_heads=2, head_dim=16)
    b, h, d, r, s, g = 3, 2, 16, 8, 4, 8
    t = s + 2 * r + 5  # 4 sinks, 2 blocks, 5 in the window
    torch.manual_seed(0)
    k, v = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    for kb, vb, kg in ((4, 4, 8), (3, 2, 4), (8, 8, 2), (4, 2, 1)):
        cache = QuantizedKVCache(
            cfg,
            4,
            key_bits=kb,
            value_bits=vb,
            group_size=g,
            residual_length=r,
            sink_tokens=s,
            key_group_size=kg,
            rotate=False,
        )
        feed(cache, k, v, [7, 13, t - 20])
        # per layer, keys and values each: sinks + window in float16 (2 B)
        full = 2 * b * h * (s + 5) * d * 2
        n = 2
        key_codes = n * b * h * math.ceil(r * d * kb / 8) if kb != 3 else n * b * h * r * d * 3 // 8
        val_codes = n * b * h * math.ceil(r * d * vb / 8) if vb != 3 else n * b * h * r * d * 3 // 8
        # one fp16 scale + zero point per channel per group of kg tokens of a block
        key_meta = n * b * h * (r // kg) * d * 2 * 2
        val_meta = n * b * h * r * (d // g) * 2 * 2  # per token, per group of g channels
        per_layer = full + key_codes + val_codes + key_meta + val_meta
        assert cache.nbytes() == 2 * per_layer
        assert compat.cache_nbytes(cache) == cache.nbytes()
        assert cache.fp16_nbytes() == 2 * (2 * b * h * t * d * 2)
        # kvlib.quant.tensor's own count agrees for the codes
        assert cache.layers[0].key_blocks.code_nbytes == n * packed_nbytes(b * h * r * d, kb)
    rotated = QuantizedKVCache(cfg, 4, group_size=g, residual_length=r, rotate=True)
    feed(rotated, k, v, [t])
    unrotated = QuantizedKVCache(cfg, 4, group_size=g, residual_length=r, rotate=False)
    feed(unrotated, k, v, [t])
    assert rotated.nbytes() == unrotated.nbytes() + d * d * 4  # the shared Hadamard matrix


def test_defaults_resolve_per_width():
    cfg = tiny_config(head_dim=64)
    c4, c3, c8 = (QuantizedKVCache(cfg, b) for b in (4, 3, 8))
    assert (c4.key_group_size, c4.group_size, c4.rotate) == (32, 64, False)
    assert (c3.key_group_size, c3.group_size, c3.rotate) == (32, 64, True)
    assert (c8.key_group_size, c8.group_size, c8.rotate) == (128, 64, False)
    # key_bits decides the key defaults; a residual_length that 32 does not divide gets gcd
    mixed = QuantizedKVCache(cfg, 8, key_bits=2, residual_length=48)
    assert (mixed.key_group_size, mixed.rotate) == (16, True)
    # head_dim 80: value groups of 40, and no Hadamard matrix exists, so no default rotation
    odd = QuantizedKVCache(tiny_config(head_dim=80), 2)
    assert (odd.group_size, odd.rotate) == (40, False)
    # explicit values win, and the repr shows what was resolved
    c = QuantizedKVCache(cfg, 3, key_group_size=64, group_size=16, rotate=False)
    assert (c.key_group_size, c.group_size, c.rotate) == (64, 16, False)
    assert "key_group_size=64" in repr(c) and "rotate=False" in repr(c)
    layer = c.layers[0]
    assert (layer.key_group_size, layer.rotation) == (64, None)


def test_key_groups_shrink_the_key_error():
    """Finer key groups inside a block: exact metadata count and a smaller key error."""
    torch.manual_seed(6)
    k, v = torch.randn(1, 2, 4 + 128, 16), torch.randn(1, 2, 4 + 128, 16)
    k = k * torch.linspace(0.5, 2.0, 128 + 4).view(1, 1, -1, 1)  # a drifting channel scale
    errs, metas = {}, {}
    for kg in (128, 32, 8):
        layer = QuantizedKVLayer(4, 4, group_size=16, residual_length=128, key_group_size=kg)
        feed(layer, k, v, [40, 92])
        assert layer.key_blocks.scale.shape == (1, 1, 2, 128 // kg, 1, 16)
        rk, _ = layer.dequantized()
        errs[kg] = float((rk - k).pow(2).mean())
        metas[kg] = layer.key_blocks.metadata_nbytes
        ref = (
            layer.key_blocks.dequantize(torch.float32).permute(1, 2, 0, 3, 4).reshape(1, 2, -1, 16)
        )
        torch.testing.assert_close(rk[:, :, 4:], ref)
    assert errs[8] < errs[32] < errs[128]
    assert metas[8] == 4 * metas[32] == 16 * metas[128] == 16 * 2 * 16 * 2 * 2


def test_chunked_prefill_equals_one_shot():
    torch.manual_seed(1)
    k, v = torch.randn(2, 3, 300, 32), torch.randn(2, 3, 300, 32)
    one = QuantizedKVLayer(3, 2, group_size=16, residual_length=64, sink_tokens=4)
    out_one = feed(one, k, v, [300])
    for chunks in ([1, 63, 64, 100, 72], [64] * 4 + [44], [1] * 10 + [290]):
        many = QuantizedKVLayer(3, 2, group_size=16, residual_length=64, sink_tokens=4)
        feed(many, k, v, chunks)
        assert_same_state(one, many)
        torch.testing.assert_close(many.dequantized()[0], one.dequantized()[0], rtol=0, atol=0)
    assert one.n_blocks == (300 - 4) // 64
    # the first update returns its own states untouched
    assert torch.equal(out_one[0][0], k) and torch.equal(out_one[0][1], v)


def test_batch_rows_are_independent():
    torch.manual_seed(2)
    k, v = torch.randn(3, 2, 150, 32) * 3, torch.randn(3, 2, 150, 32)
    batch = QuantizedKVLayer(4, 4, group_size=32, residual_length=32, sink_tokens=2)
    feed(batch, k, v, [50, 50, 50])
    bk, bv = batch.dequantized()
    for i in range(3):
        row = QuantizedKVLayer(4, 4, group_size=32, residual_length=32, sink_tokens=2)
        feed(row, k[i : i + 1], v[i : i + 1], [150])
        rk, rv = row.dequantized()
        assert torch.equal(rk[0], bk[i]) and torch.equal(rv[0], bv[i])
        sel = QuantizedKVLayer(4, 4, group_size=32, residual_length=32, sink_tokens=2)
        feed(sel, k, v, [150])
        sel.batch_select_indices(torch.tensor([i]))
        assert_same_state(sel, row)


def test_block_is_quantized_once():
    torch.manual_seed(3)
    k, v = torch.randn(1, 2, 400, 16), torch.randn(1, 2, 400, 16)
    layer = QuantizedKVLayer(2, 2, group_size=8, residual_length=32, sink_tokens=4)
    feed(layer, k[:, :, :40], v[:, :, :40], [40])
    assert layer.n_blocks == 1
    first = {name: t[:1].clone() for name, t in state(layer).items() if "blocks" in name}
    sinks = layer.sink_keys.clone()
    feed(layer, k[:, :, 40:], v[:, :, 40:], [1] * 30 + [330])
    assert layer.n_blocks == (400 - 4) // 32
    for name, before in first.items():
        assert torch.equal(state(layer)[name][:1], before), name
    assert torch.equal(layer.sink_keys, sinks)
    # the stored block 0 is what quantizing the original (fp16-rounded) tokens 4..35 gives
    from kvlib.quant.tensor import quantize

    q = quantize(k[:, :, 4:36].half().unsqueeze(0).contiguous(), 2, axis=3)
    assert torch.equal(layer.key_blocks.packed[:1].reshape(-1), q.packed)


def test_reorder_and_repeat():
    torch.manual_seed(4)
    k, v = torch.randn(2, 1, 70, 16), torch.randn(2, 1, 70, 16)
    layer = QuantizedKVLayer(4, 4, group_size=16, residual_length=16, sink_tokens=1)
    feed(layer, k, v, [70])
    before_k, before_v = layer.dequantized()
    layer.reorder_cache(torch.tensor([1, 0]))
    after_k, after_v = layer.dequantized()
    assert torch.equal(after_k, before_k.flip(0)) and torch.equal(after_v, before_v.flip(0))
    layer.batch_repeat_interleave(2)
    rep_k, _ = layer.dequantized()
    assert rep_k.shape[0] == 4 and torch.equal(rep_k[2], before_k[0])
    assert layer.batch_size == 4


def _half_step_ok(q, original: torch.Tensor) -> bool:
    """Every element of the dequantized blocks within half its group's step (+ fp rounding)."""
    x = original
    err = (q.dequantize(torch.float32) - x).abs()
    step = q.step()
    if q.axis == 3:  # per channel, in groups of group_size tokens
        n, b, h, r, d = q.shape
        err = err.view(n, b, h, r // q.group_size, q.group_size, d)
        bound = 0.5 * step
    else:
        n, b, h, r, d = q.shape
        err = err.view(n, b, h, r, d // q.group_size, q.group_size)
        bound = 0.5 * step
    slack = 1e-5 * (x.abs().amax() + 1)
    return bool((err <= bound + slack).all())


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    residual_length=st.sampled_from([1, 2, 8, 16]),
    key_groups=st.sampled_from([1, 2, 4]),
    sink_tokens=st.integers(0, 5),
    group_size=st.sampled_from([4, 8, 16]),
    batch=st.integers(1, 2),
    tokens=st.integers(1, 60),
    chunk=st.integers(1, 25),
    scale=st.floats(0.01, 50.0),
    seed=st.integers(0, 2**16),
)
def test_layer_property_reconstruction(
    bits, residual_length, key_groups, sink_tokens, group_size, batch, tokens, chunk, scale, seed
):
    g = torch.Generator().manual_seed(seed)
    d = 16
    k = torch.randn(batch, 2, tokens, d, generator=g) * scale
    v = torch.randn(batch, 2, tokens, d, generator=g) * scale
    k[..., 3] += 10 * scale  # an outlier channel, as real keys have
    layer = QuantizedKVLayer(
        bits,
        bits,
        group_size=group_size,
        residual_length=residual_length,
        sink_tokens=sink_tokens,
        window_dtype=torch.float32,
        key_group_size=max(1, residual_length // key_groups),
    )
    chunks = [min(chunk, tokens - i) for i in range(0, tokens, chunk)]
    outs = feed(layer, k, v, chunks)
    # every update returned the past as read plus its own new states untouched
    start = 0
    for (ok, ov), n in zip(outs, chunks, strict=True):
        assert ok.shape == (batch, 2, start + n, d)
        assert torch.equal(ok[:, :, start:], k[:, :, start : start + n])
        assert torch.equal(ov[:, :, start:], v[:, :, start : start + n])
        start += n
    s = min(tokens, sink_tokens)
    nb = (tokens - s) // residual_length
    assert layer.n_blocks == nb and layer.get_seq_length() == tokens
    rk, rv = layer.dequantized()
    # sinks and window exact
    tail = s + nb * residual_length
    assert torch.equal(rk[:, :, :s], k[:, :, :s]) and torch.equal(rv[:, :, tail:], v[:, :, tail:])
    if nb:
        blocks = slice(s, tail)
        orig_k = k[:, :, blocks].reshape(batch, 2, nb, residual_length, d).permute(2, 0, 1, 3, 4)
        orig_v = v[:, :, blocks].reshape(batch, 2, nb, residual_length, d).permute(2, 0, 1, 3, 4)
        assert _half_step_ok(layer.key_blocks, orig_k)
        assert _half_step_ok(layer.value_blocks, orig_v)
        # the fast read path equals kvlib.quant.tensor's reference dequantization
        ref_k = layer.key_blocks.dequantize(torch.float32).permute(1, 2, 0, 3, 4)
        ref_v = layer.value_blocks.dequantize(torch.float32).permute(1, 2, 0, 3, 4)
        torch.testing.assert_close(rk[:, :, blocks], ref_k.reshape(batch, 2, -1, d))
        torch.testing.assert_close(rv[:, :, blocks], ref_v.reshape(batch, 2, -1, d))
    assert layer.nbytes() > 0


def test_rotation_round_trip():
    torch.manual_seed(5)
    d = 32
    k, v = torch.randn(1, 2, 100, d), torch.randn(1, 2, 100, d)
    k[..., 5] *= 30
    rot = hadamard(d)
    layer = QuantizedKVLayer(8, 8, group_size=32, residual_length=32, sink_tokens=4, rotation=rot)
    feed(layer, k, v, [100])
    rk, rv = layer.dequantized()
    # stored key codes are of the rotated states; reading rotates back
    ref = layer.key_blocks.dequantize(torch.float32) @ rot.T
    torch.testing.assert_close(rk[:, :, 4:100], ref.permute(1, 2, 0, 3, 4).reshape(1, 2, -1, d))
    rel = (rk - k).norm() / k.norm()
    assert rel < 0.01
    assert (rv - v).norm() / v.norm() < 0.01
    # values are not rotated: their codes equal an unrotated layer's, the keys' do not
    plain = QuantizedKVLayer(8, 8, group_size=32, residual_length=32, sink_tokens=4)
    feed(plain, k, v, [100])
    assert torch.equal(plain.value_blocks.packed, layer.value_blocks.packed)
    assert not torch.equal(plain.key_blocks.packed, layer.key_blocks.packed)
    torch.testing.assert_close(plain.dequantized()[1], rv, rtol=0, atol=0)


# ------------------------------------------------------------------ bad input


def test_bad_input():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="bits must be one of 2, 3, 4, 8 \\(got 5\\)"):
        QuantizedKVCache(cfg, 5)
    with pytest.raises(TypeError, match="bits must be an int"):
        QuantizedKVCache(cfg, True)
    with pytest.raises(ValueError, match="key_bits must be one of"):
        QuantizedKVCache(cfg, 4, key_bits=1)
    with pytest.raises(ValueError, match="value_bits must be one of"):
        QuantizedKVCache(cfg, 4, value_bits=16)
    with pytest.raises(ValueError, match="group_size must divide head_dim 16 \\(got 5"):
        QuantizedKVCache(cfg, 4, group_size=5)
    with pytest.raises(ValueError, match="group_size must divide"):
        QuantizedKVCache(cfg, 4, group_size=0)
    with pytest.raises(TypeError, match="group_size must be an int"):
        QuantizedKVCache(cfg, 4, group_size=8.0)
    with pytest.raises(
        ValueError, match="key_group_size must divide residual_length 128 \\(got 48"
    ):
        QuantizedKVCache(cfg, 4, group_size=8, key_group_size=48)
    with pytest.raises(ValueError, match="key_group_size must divide"):
        QuantizedKVCache(cfg, 4, group_size=8, key_group_size=0)
    with pytest.raises(TypeError, match="key_group_size must be an int or None"):
        QuantizedKVLayer(key_group_size=8.0)
    with pytest.raises(ValueError, match="residual_length must be an int >= 1"):
        QuantizedKVCache(cfg, 4, group_size=8, residual_length=0)
    with pytest.raises(TypeError, match="residual_length must be an int"):
        QuantizedKVCache(cfg, 4, group_size=8, residual_length=None)
    with pytest.raises(ValueError, match="sink_tokens must be an int >= 0"):
        QuantizedKVCache(cfg, 4, group_size=8, sink_tokens=-1)
    with pytest.raises(TypeError, match="rotate must be a bool"):
        QuantizedKVCache(cfg, 4, group_size=8, rotate="yes")
    with pytest.raises(ValueError, match="head_dim to be a power of two"):
        QuantizedKVCache(tiny_config(head_dim=24), 4, group_size=8, rotate=True)
    with pytest.raises(ValueError, match="multiple of 8"):
        QuantizedKVCache(tiny_config(head_dim=12), 4, group_size=4, residual_length=1)
    with pytest.raises(ValueError, match="window_dtype must be"):
        QuantizedKVCache(cfg, 4, group_size=8, window_dtype=torch.int8)
    with pytest.raises(TypeError, match="PretrainedConfig"):
        QuantizedKVCache({"num_hidden_layers": 2}, 4)
    chunked = LlamaConfig(  # sliding layers are served (tests/test_hybrid_layers.py)
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=100,
        layer_types=["chunked_attention", "full_attention"],
        attention_chunk_size=8,
    )
    with pytest.raises(ValueError, match="full_attention and sliding_attention.*chunked"):
        QuantizedKVCache(chunked, 4, group_size=8)
    # states that do not match what is cached
    layer = QuantizedKVCache(cfg, 4, group_size=8).layers[0]
    layer.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16))
    with pytest.raises(ValueError, match="batch=1, kv_heads=2, seq_len, head_dim=16"):
        layer.update(torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16))
    with pytest.raises(ValueError, match="same number of tokens"):
        layer.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 4, 16))
    with pytest.raises(ValueError, match="4-d floating tensor"):
        QuantizedKVLayer().update(torch.randn(2, 3, 16), torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="group_size must divide head_dim 20"):
        QuantizedKVLayer(group_size=8).update(torch.randn(1, 1, 2, 20), torch.randn(1, 1, 2, 20))
    with pytest.raises(ValueError, match="float16 range"):
        QuantizedKVLayer(group_size=8).update(
            torch.full((1, 1, 2, 16), 1e6), torch.zeros(1, 1, 2, 16)
        )
    with pytest.raises(NotImplementedError, match="cannot crop"):
        QuantizedKVCache(cfg, 4, group_size=8).crop(-1)
