"""kvlib.eval.compare: caches side by side on a full model (memory, speed, perplexity delta against
the reference DynamicCache) and their agreement with the reference on the same tokens."""

from __future__ import annotations

import math

import pytest
import torch

from kvlib import memory
from kvlib.caches.registry import reference_name
from kvlib.eval import compare
from kvlib.eval.model_choice import random_model
from kvlib.specs import get_spec

FP32 = reference_name(torch.float32)  # the bundled model and the tiny random one are fp32


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_model():
    """Random weights of SmolLM2-135M's attention shapes, 2 layers: agreement in seconds."""
    return random_model(
        "smollm2-135m", device="cpu", num_layers=2, vocab_size=512, intermediate_size=256
    )


# -- memory, speed and quality -----------------------------------------------------------------


def test_comparison_rows_on_bundled_model(model, tokenizer, eval_ids):
    prompt, new = 32, 3
    rows = compare.run_cache_comparison(
        model,
        tokenizer,
        [FP32, "quanto-int4"],
        prompt_tokens=prompt,
        new_tokens=new,
        eval_ids=eval_ids[:, :96],
        repeats=1,
        chunk_size=32,
        sample_tokens=3,
        warmup=False,
    )
    assert [r.cache for r in rows] == [FP32, "quanto-int4"]
    ref, q4 = rows
    spec = get_spec("smollm2-135m")
    # greedy decoding leaves prompt + new - 1 tokens in the cache; fp32 model -> 32 bits
    assert ref.bits == 32 and q4.bits == 4
    assert ref.cache_bytes == memory.kv_cache_bytes(spec, prompt + new - 1, bits=32)
    assert 0 < q4.cache_bytes < ref.cache_bytes
    assert ref.memory_kind == "cache bytes" and ref.memory_bytes == ref.cache_bytes
    assert ref.peak_memory_bytes is None
    assert ref.ppl_delta_pct == 0.0  # the reference is the same DynamicCache computation
    assert math.isfinite(q4.perplexity) and abs(q4.ppl_delta_pct) < 50
    for r in rows:
        assert r.decode_tokens_per_s > 0 and r.time_to_first_token_s > 0
        assert len(r.sample_ids) == 3 and r.sample == tokenizer.decode(r.sample_ids)
    frame = compare.records(rows)
    assert frame[0]["cache"] == FP32 and set(frame[0]) == set(rows[0].to_dict())


def test_comparison_rejects_bad_caches(model, tokenizer):
    with pytest.raises(TypeError, match="list of cache names"):
        compare.run_cache_comparison(model, tokenizer, FP32)
    with pytest.raises(ValueError, match="unknown cache"):
        compare.run_cache_comparison(model, tokenizer, ["int4"])


# -- agreement with the reference --------------------------------------------------------------


def test_cache_agreement_grades_by_bits(tiny_model):
    ids = torch.randint(0, 512, (1, 256), generator=torch.Generator().manual_seed(0))
    names = [FP32, "kvlib-int8", "kvlib-int2"]
    ref, q8, q2 = compare.cache_agreement(tiny_model, ids, names, tail=32, chunk=64)
    assert [r.cache for r in (ref, q8, q2)] == names
    assert (ref.bits, q8.bits, q2.bits) == (32, 8, 2)
    assert ref.attention_rel_err == 0.0 and ref.logits_rel_err == 0.0
    assert ref.top1_agreement == 1.0 and ref.limit is None and ref.passed is None
    assert 0 < q8.attention_rel_err < q2.attention_rel_err  # past the full-precision window
    assert q8.limit == compare.AGREEMENT_LIMITS[8] and q8.passed
    assert (q8.context, q8.tail) == (256, 32)
    (strict,) = compare.cache_agreement(
        tiny_model, ids, ["kvlib-int8"], tail=32, chunk=64, limits={8: 1e-6}
    )
    assert strict.attention_rel_err == q8.attention_rel_err and strict.passed is False


def test_cache_agreement_rejects_bad_input(tiny_model):
    ids = torch.randint(0, 512, (1, 16))
    with pytest.raises(ValueError, match="tail"):
        compare.cache_agreement(tiny_model, ids, [FP32], tail=16)
    with pytest.raises(ValueError, match="batch, seq_len"):
        compare.cache_agreement(tiny_model, ids[0], [FP32], tail=4)
    with pytest.raises(TypeError, match="list of cache names"):
        compare.cache_agreement(tiny_model, ids, FP32, tail=4)
