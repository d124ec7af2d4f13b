"""kvlib.eval.quality and kvlib.compat: chunked perplexity, generation benchmark, bad input."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from kvlib import compat
from kvlib.eval import quality


def test_chunked_perplexity_matches_one_shot(model, eval_ids):
    ids = eval_ids[:, :256]
    chunked = quality.perplexity(model, ids, chunk_size=64)
    one_shot = quality.perplexity(model, ids, chunk_size=256)
    assert 1.0 < chunked < 100.0
    assert chunked == pytest.approx(one_shot, rel=1e-4)


def test_perplexity_batch_and_1d(model, eval_ids):
    ids = eval_ids[:, :96]
    single = quality.perplexity(model, ids[0], chunk_size=32)
    batch = quality.perplexity(model, ids.repeat(2, 1), chunk_size=32)
    assert batch == pytest.approx(single, rel=1e-4)


def test_perplexity_bad_input(model, eval_ids):
    with pytest.raises(TypeError, match="torch.Tensor"):
        quality.perplexity(model, [1, 2, 3])
    with pytest.raises(TypeError, match="integer token ids"):
        quality.perplexity(model, eval_ids[:, :8].float())
    with pytest.raises(ValueError, match="at least 2 tokens"):
        quality.perplexity(model, eval_ids[:, :1])
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        quality.perplexity(model, eval_ids[:, :8], chunk_size=0)
    with pytest.raises(ValueError, match=r"must lie in \[0, "):
        quality.perplexity(model, torch.full((1, 4), 10**7))
    cache = compat.dynamic_cache(model.config)
    compat.forward(model, eval_ids[:, :4], cache)
    with pytest.raises(ValueError, match="already holds 4 tokens"):
        quality.perplexity(model, eval_ids[:, :8], cache=cache)
    with pytest.raises(TypeError, match="transformers Cache"):
        quality.perplexity(model, eval_ids[:, :8], cache=object())


def _continuation_perplexity_reference(model, cache, next_ids, chunk_size):
    """continuation_perplexity as kvlib.kvtc.pca had it, with its own loop: every token fed (the
    last chunk's final logits unused), cross-entropy summed per chunk."""
    nll, count, prev = torch.zeros((), dtype=torch.float64), 0, None
    for start in range(0, next_ids.shape[1], chunk_size):
        chunk = next_ids[:, start : start + chunk_size]
        logits = compat.forward(model, chunk, cache).logits.float()
        if prev is not None:
            logits_all, targets = torch.cat([prev, logits[:, :-1]], dim=1), chunk
        else:
            logits_all, targets = logits[:, :-1], chunk[:, 1:]
        if targets.numel():
            nll += torch.nn.functional.cross_entropy(
                logits_all.reshape(-1, logits_all.shape[-1]), targets.reshape(-1), reduction="sum"
            ).double()
            count += targets.numel()
        prev = logits[:, -1:]
    return float(torch.exp(nll / count))


@pytest.mark.parametrize("chunk_size", [64, 24])
def test_continuation_perplexity_matches_its_own_loop(model, eval_ids, chunk_size):
    prefix, nxt = eval_ids[:, :200], eval_ids[:, 200:264]
    cache = compat.prefill_cache(model, prefix)
    ref = _continuation_perplexity_reference(model, compat.clone_cache(cache), nxt, chunk_size)
    got = quality.continuation_perplexity(model, cache, nxt, chunk_size)
    assert got == pytest.approx(ref, rel=1e-5)
    assert cache.get_seq_length() == 200 + 64 - 1  # the last token is only a target
    # the prefix is really read: scored from scratch, the same tokens come out worse
    assert quality.perplexity(model, nxt, chunk_size=chunk_size) > 1.05 * got
    with pytest.raises(TypeError, match="transformers Cache"):
        quality.continuation_perplexity(model, None, nxt)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        quality.continuation_perplexity(model, compat.clone_cache(cache), nxt[:, :1])


def test_generation_benchmark_and_no_deprecation_warning(model, tokenizer, eval_ids):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = quality.generation_benchmark(
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
