"""kvlib.eval and kvlib.compat: chunked perplexity, generation benchmark, bad input."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from kvlib import compat
from kvlib import eval as kv_eval


def test_chunked_perplexity_matches_one_shot(model, eval_ids):
    ids = eval_ids[:, :256]
    chunked = kv_eval.perplexity(model, ids, chunk_size=64)
    one_shot = kv_eval.perplexity(model, ids, chunk_size=256)
    assert 1.0 < chunked < 100.0
    assert chunked == pytest.approx(one_shot, rel=1e-4)


def test_perplexity_batch_and_1d(model, eval_ids):
    ids = eval_ids[:, :96]
    single = kv_eval.perplexity(model, ids[0], chunk_size=32)
    batch = kv_eval.perplexity(model, ids.repeat(2, 1), chunk_size=32)
    assert batch == pytest.approx(single, rel=1e-4)


def test_perplexity_bad_input(model, eval_ids):
    with pytest.raises(TypeError, match="torch.Tensor"):
        kv_eval.perplexity(model, [1, 2, 3])
    with pytest.raises(TypeError, match="integer token ids"):
        kv_eval.perplexity(model, eval_ids[:, :8].float())
    with pytest.raises(ValueError, match="at least 2 tokens"):
        kv_eval.perplexity(model, eval_ids[:, :1])
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        kv_eval.perplexity(model, eval_ids[:, :8], chunk_size=0)
    with pytest.raises(ValueError, match=r"must lie in \[0, "):
        kv_eval.perplexity(model, torch.full((1, 4), 10**7))
    cache = compat.dynamic_cache(model.config)
    compat.forward(model, eval_ids[:, :4], cache)
    with pytest.raises(ValueError, match="already holds 4 tokens"):
        kv_eval.perplexity(model, eval_ids[:, :8], cache=cache)
    with pytest.raises(TypeError, match="transformers Cache"):
        kv_eval.perplexity(model, eval_ids[:, :8], cache=object())


def test_generation_benchmark_and_no_deprecation_warning(model, tokenizer, eval_ids):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = kv_eval.generation_benchmark(
            model,
            tokenizer,
            lambda: compat.dynamic_cache(model.config),
            prompt_tokens=32,
            new_tokens=4,
            repeats=1,
            prompt_ids=eval_ids,
            warmup=False,
        )
    assert result.prompt_tokens == 32 and len(result.generated_ids) == 4
    assert result.decode_tokens_per_s > 0 and result.time_to_first_token_s > 0
    # fp32 DynamicCache after 35 tokens: layers * 2 (K, V) * kv_heads * tokens * head_dim * 4 B
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    expected = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 35 * head_dim * 4
    assert result.cache_nbytes == expected
    ref = compat.generate(model, eval_ids[:, :32], max_new_tokens=4, do_sample=False)
    assert ref[0, 32:].tolist() == result.generated_ids


def test_compat_keyword_and_errors(model):
    # The keyword is one the installed model's forward really takes (so passing it works).
    assert compat.cache_kwarg(model) in inspect.signature(type(model).forward).parameters
    assert set(compat.layer_types(model.config)) == {"full_attention"}
    with pytest.raises(ValueError, match="backend must be one of"):
        compat.hf_quantized_cache(model.config, "gguf")
    with pytest.raises(ValueError, match=r"shape \(batch, seq_len\)"):
        compat.forward(model, torch.tensor([1, 2, 3]))


def test_cache_kwarg_follows_the_signature() -> None:
    """transformers renamed past_key_values to cache within 5.x; the adapter reads which."""

    def new_forward(self, input_ids=None, cache=None, past_key_values=None): ...

    def old_forward(self, input_ids=None, past_key_values=None): ...

    new_model = type("NewLM", (), {"forward": new_forward})()
    old_model = type("OldLM", (), {"forward": old_forward})()
    assert compat.cache_kwarg(new_model) == "cache"
    assert compat.cache_kwarg(old_model) == "past_key_values"
