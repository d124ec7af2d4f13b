"""Tests for kvlib.eval.capture: captured q/k/v match the model, attention-output error is honest."""

from __future__ import annotations

import pytest
import torch

from kvlib.attention import dense_attention
from kvlib.eval.capture import (
    LayerQKV,
    attention_output_error,
    capture_kv,
    capture_qkv,
    evaluate_recipe,
    evaluate_recipes,
)
from kvlib.quant.recipes import KVRecipe, quantize_kv


def test_attention_output_error_basic():
    q, k, v = torch.randn(1, 3, 16, 8), torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8)
    assert attention_output_error(q, k, v, k, v) == 0.0
    e_small = attention_output_error(q, k, v, k, v + 0.01 * torch.randn_like(v))
    e_big = attention_output_error(q, k, v, k, v + 0.1 * torch.randn_like(v))
    assert 0 < e_small < e_big
    # the error is measured on the causal output: a value error on the newest token reaches
    # only the newest query, so the absolute error of all 16 queries is that of the last one
    v2 = v.clone()
    v2[:, :, -1] += 1.0
    norm_all = dense_attention(q, k, v).norm()
    norm_last = dense_attention(q[:, :, -1:], k, v).norm()
    err_all = attention_output_error(q, k, v, k, v2) * norm_all
    err_last = attention_output_error(q[:, :, -1:], k, v, k, v2) * norm_last
    assert err_last > 0 and float(err_all) == pytest.approx(float(err_last), rel=1e-5)
    with pytest.raises(ValueError, match="k_hat/v_hat"):
        attention_output_error(q, k, v, k[:, :, :8], v)


def test_capture_matches_model_cache_and_attention(model, eval_ids):
    ids = eval_ids[:, :48]
    layers = capture_qkv(model, ids)
    cfg = model.config
    assert len(layers) == cfg.num_hidden_layers
    assert layers[0].q.shape == (1, cfg.num_attention_heads, 48, 64)
    assert layers[0].k.shape == (1, cfg.num_key_value_heads, 48, 64)

    # keys/values equal what transformers puts in its own cache
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    for i in (0, 7, cfg.num_hidden_layers - 1):
        assert torch.allclose(layers[i].k, cache.layers[i].keys, atol=1e-5)
        assert torch.allclose(layers[i].v, cache.layers[i].values, atol=1e-5)

    # attention over the captured q/k/v equals the model's attention output (input of o_proj)
    seen = {}
    attn = model.model.layers[3].self_attn
    handle = attn.o_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    mine = dense_attention(layers[3].q, layers[3].k, layers[3].v).transpose(1, 2).reshape(1, 48, -1)
    assert torch.allclose(mine, seen["x"], atol=1e-4)

    kv = capture_kv(model, ids)
    assert torch.equal(kv[5][0], layers[5].k) and torch.equal(kv[5][1], layers[5].v)


def test_capture_rejects_bad_ids(model):
    with pytest.raises(ValueError, match="batch, seq_len"):
        capture_qkv(model, torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="Llama-style"):
        capture_qkv(torch.nn.Linear(2, 2), torch.zeros(1, 3, dtype=torch.long))


def test_evaluate_recipes_matches_attention_output_error(model, eval_ids):
    layers = capture_qkv(model, eval_ids[:, :256])
    recipes = [
        KVRecipe(16),
        KVRecipe(4, key_axis=-1, value_axis=-1),
        KVRecipe(4, key_axis=-2, value_axis=-1, key_group_size=32, residual=32),
        KVRecipe(2, key_axis=-1, value_axis=-1),
    ]
    results = evaluate_recipes(layers, recipes, n_queries=16)
    assert [r.recipe for r in results] == recipes
    for r in results:
        assert len(r.layer_errors) == len(layers)
        assert r.error == pytest.approx(sum(r.layer_errors) / len(layers))
    # the same number as attention_output_error on quantize_kv's reconstructions
    kivi = results[2]
    for i in (0, 11, 29):
        out = quantize_kv(layers[i].k, layers[i].v, kivi.recipe)
        q = layers[i].q[:, :, -16:]
        expected = attention_output_error(q, layers[i].k, layers[i].v, out.keys, out.values)
        assert kivi.layer_errors[i] == pytest.approx(expected, rel=1e-4)
    nbytes = sum(quantize_kv(layer.k, layer.v, kivi.recipe).nbytes for layer in layers)
    assert kivi.nbytes == nbytes
    assert kivi.bits_per_element == pytest.approx(8 * nbytes / (2 * 30 * 3 * 256 * 64))
    fp16, naive4, kivi4, naive2 = (r.error for r in results)
    assert fp16 < 0.01 and naive4 < naive2
    # real keys have outlier channels: per-channel keys beat per-token ones at 4 bits
    assert kivi4 < naive4
    assert evaluate_recipe(layers, recipes[1], n_queries=16).error == pytest.approx(naive4)


def test_evaluate_recipes_rejects_bad_input():
    layer = LayerQKV(torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))
    with pytest.raises(ValueError, match="at least one"):
        evaluate_recipes([], [KVRecipe()])
    with pytest.raises(ValueError, match="n_queries"):
        evaluate_recipes([layer], [KVRecipe()], n_queries=0)
    with pytest.raises(TypeError, match="KVRecipe"):
        evaluate_recipes([layer], ["kivi"])


def test_capture_applies_the_query_and_key_norms_of_gemma3():
    """Gemma 3 normalises each head's queries and keys before RoPE: the captured keys are the
    ones its cache holds, in the sliding layers and the global one."""
    from _tiny_models import gemma3_config
    from transformers import Gemma3ForCausalLM

    from kvlib import compat

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(gemma3_config(window=64)).eval()
    for attn in (layer.self_attn for layer in model.model.layers):  # norms far from identity
        torch.nn.init.normal_(attn.k_norm.weight, std=1.0)
        torch.nn.init.normal_(attn.q_norm.weight, std=1.0)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = compat.prefill_cache(model, ids)
    for (k, v), got in zip(compat.cache_tensors(cache), capture_qkv(model, ids), strict=True):
        torch.testing.assert_close(got.k, k.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.v, v.float(), rtol=1e-5, atol=1e-5)
