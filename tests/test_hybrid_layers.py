"""Hybrid models (sliding-window layers between global ones) in kvlib's caches: a tiny random
Gemma 3 text model (5 sliding : 1 global, one KV head), no weights downloaded.

QuantizedKVCache and EvictionCache keep each sliding layer's last ``sliding_window`` tokens
(kvlib.caches.sliding), the model's outputs follow a DynamicCache's, and ``nbytes()`` is
kvlib.memory's prediction byte for byte, below and above the window."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _tiny_models import gemma3_config as tiny_gemma3_config
from _tiny_models import llama_config
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig

from kvlib import compat, memory, specs
from kvlib.caches.eviction.cache import EvictionCache, EvictionLayer, capture_queries, token_nbytes
from kvlib.caches.quantized import QuantizedKVCache, QuantizedKVLayer
from kvlib.caches.sliding import SlidingWindowLayer

WINDOW = 16
HEAD_DIM = 64
VOCAB = 128


def gemma3_config(window: int = WINDOW) -> Gemma3TextConfig:
    """Gemma 3 270M's shape, shrunk: 6 layers (5 sliding, 1 global), one KV head."""
    return tiny_gemma3_config(window, HEAD_DIM)


@pytest.fixture(scope="module")
def gemma() -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(gemma3_config()).eval()
    with torch.no_grad():  # random weights: make the attention sharp enough to matter
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    return model


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def chunked_logits(model, tokens: torch.Tensor, cache, chunks: list[int]) -> torch.Tensor:
    """Last-position logits of every forward pass, feeding ``tokens`` in ``chunks``."""
    out, start = [], 0
    for n in chunks:
        logits = compat.forward(model, tokens[:, start : start + n], cache).logits
        out.append(logits[:, -1].float())
        start += n
    return torch.cat(out)


def quantized(cfg, bits: int = 8, **options) -> QuantizedKVCache:
    options = {"residual_length": 8, "sink_tokens": 2, **options}
    return QuantizedKVCache(cfg, bits, **options)


def predicted(cache: QuantizedKVCache, cfg, seq_len: int) -> int:
    window_bits = torch.finfo(cache.layers[-1].window_dtype).bits
    return memory.quantized_cache_bytes(
        specs.spec_from_config(cfg),
        seq_len,
        key_bits=cache.key_bits,
        value_bits=cache.value_bits,
        group_size=cache.group_size,
        key_group_size=cache.key_group_size,
        residual_length=cache.residual_length,
        sink_tokens=cache.sink_tokens,
        window_bits=window_bits,
        rotate=cache.rotate,
    )


def test_layers_follow_the_configs_layer_types():
    cfg = gemma3_config()
    assert compat.layer_windows(cfg) == [WINDOW] * 5 + [None]
    q = quantized(cfg)
    assert [type(layer) for layer in q.layers] == [SlidingWindowLayer] * 5 + [QuantizedKVLayer]
    assert q.is_sliding == [True] * 5 + [False]
    e = EvictionCache(cfg, "streaming", 24)
    assert [type(layer) for layer in e.layers] == [SlidingWindowLayer] * 5 + [EvictionLayer]


def test_quantized_cache_follows_a_dynamic_cache_past_the_window(gemma):
    """Prefill longer than the window, then chunks and single tokens: the window layers are
    exact up to float16, the global layer is int8; the logits stay with the reference."""
    cfg, tokens, chunks = gemma.config, ids(60), [37, 5, 1, 1, 16]
    ref = chunked_logits(gemma, tokens, compat.dynamic_cache(cfg), chunks)
    cache = quantized(cfg, 8)
    got = chunked_logits(gemma, tokens, cache, chunks)
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= 0.02 * scale, ((got - ref).abs().max(), scale)
    assert cache.get_seq_length() == 60
    for layer in cache.layers[:5]:
        assert layer.kept() == WINDOW and layer.keys.dtype == torch.float16
    # nothing quantized yet (one 64-token block) and float32 windows: the reference, up to
    # float rounding (the masked extra token of each window changes the summation order)
    exact = quantized(cfg, 8, window_dtype=torch.float32, sink_tokens=0, residual_length=64)
    torch.testing.assert_close(chunked_logits(gemma, tokens, exact, chunks), ref)


def test_generate_runs_with_both_caches(gemma):
    prompt = ids(20, seed=1)
    ref = compat.generate(gemma, prompt, compat.dynamic_cache(gemma.config), max_new_tokens=12)
    q = compat.generate(gemma, prompt, quantized(gemma.config, 8), max_new_tokens=12)
    assert q.shape == ref.shape == (1, 32)
    cache = EvictionCache(gemma.config, "streaming", 64)  # budget above the length: no eviction
    e = compat.generate(gemma, prompt, cache, max_new_tokens=12)
    assert torch.equal(e, ref)
    assert cache.kept() == 31 and all(layer.kept() == WINDOW for layer in cache.layers[:5])


def test_fused_decode_runs_on_the_global_layer_only(monkeypatch):
    """The fused kernel (Triton's interpreter on CPU) reads the quantized global layer; the
    sliding layers go to sdpa with the sliding mask: the same tokens as the torch path."""
    from kvlib.kernels import decode as kernels
    from kvlib.kernels import fused_attention

    torch.manual_seed(0)
    cfg = gemma3_config()
    cfg._attn_implementation = "sdpa"
    model = Gemma3ForCausalLM(cfg).eval()
    prompt = ids(21, seed=3)
    calls = []
    real = kernels._triton_decode
    monkeypatch.setattr(kernels, "_triton_decode", lambda *a: calls.append(1) or real(*a))
    kw = {"residual_length": 8, "sink_tokens": 2, "window_dtype": torch.float32}

    def run(fused: bool):
        cache = quantized(cfg, 4, fused_decode=fused, **kw)
        out = compat.generate(
            model, prompt, cache, max_new_tokens=6, output_scores=True, return_dict_in_generate=True
        )
        return out, cache

    (ref, ref_cache), n_torch = run(False), len(calls)
    (out, cache), n_fused = run(True), len(calls)
    assert n_torch == 0 and n_fused == 5  # 5 decode steps, one global layer
    assert cfg._attn_implementation == fused_attention.ATTN_IMPLEMENTATION
    assert torch.equal(out.sequences, ref.sequences)
    err = max(float((a - b).abs().max()) for a, b in zip(out.scores, ref.scores, strict=True))
    assert err < 1e-4, err
    assert cache.nbytes() == ref_cache.nbytes() == predicted(cache, cfg, 26)


def test_eviction_cache_evicts_global_layers_only(gemma):
    cfg, tokens, chunks = gemma.config, ids(56, seed=2), [30, 1, 1, 24]
    ref = chunked_logits(gemma, tokens, compat.dynamic_cache(cfg), chunks)
    roomy = EvictionCache(cfg, "h2o", 100)
    with capture_queries(gemma):  # the query hook reads Gemma's q_norm and scaling
        same = chunked_logits(gemma, tokens, roomy, chunks)
    assert torch.allclose(same, ref, atol=1e-5)
    for bits in (None, 4):
        cache = EvictionCache(cfg, "streaming", 24, bits=bits)
        chunked_logits(gemma, tokens, cache, chunks)
        assert cache.kept() == 24 and cache.get_seq_length() == 56
        for layer in cache.layers[:5]:  # the window, in the model's dtype, quantized cache or not
            assert layer.kept() == WINDOW and layer.keys.dtype == torch.float32
        # the sliding layers are kvlib.memory's price of them (float32 windows), the full
        # layer eviction's own price per kept token (keys, values, position)
        spec = specs.spec_from_config(cfg)
        windows = dataclasses.replace(spec, num_layers=5, layer_types=("sliding",) * 5)
        per = token_nbytes(HEAD_DIM, 1, "streaming", bits=bits, dtype=torch.float32)
        assert cache.nbytes() == memory.kv_cache_bytes(windows, 56, bits=32) + 24 * per
        assert memory.kv_cache_bytes(windows, 56, bits=32) == 5 * 2 * WINDOW * HEAD_DIM * 4


def test_eviction_max_bytes_sets_the_windows_aside():
    cfg = gemma3_config()
    windows = 5 * 2 * WINDOW * HEAD_DIM * 4  # float32 config dtype
    per = token_nbytes(HEAD_DIM, 1, "streaming", dtype=torch.float32)
    cache = EvictionCache(cfg, "streaming", max_bytes=windows + 40 * per + 3)
    assert cache.budget == 40
    with pytest.raises(ValueError, match="plus 40960 for the sliding windows"):
        EvictionCache(cfg, "streaming", max_bytes=windows + per - 1)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_nbytes_is_memorys_prediction_byte_for_byte(gemma, bits):
    """Below the window, at it, past it, and past several blocks of the global layer."""
    cfg = gemma.config
    cache = quantized(cfg, bits)
    spec = specs.spec_from_config(cfg)
    seen = 0
    for n in (5, 10, 1, 7, 1, 20, 3):
        compat.forward(gemma, ids(n, seed=seen), cache)
        seen += n
        assert cache.nbytes() == predicted(cache, cfg, seen), seen
        # and the fp16 reference is kv_cache_bytes, sliding layers capped at the window
        assert cache.fp16_nbytes() == memory.kv_cache_bytes(spec, seen, bits=16)
    assert seen == 47 and cache.layers[0].kept() == WINDOW


@settings(max_examples=25, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    window=st.integers(1, 24),
    bits=st.sampled_from([2, 4, 8]),
)
def test_sliding_layers_hold_min_length_window(chunks, window, bits):
    """Fed states directly (no model): every sliding layer holds the last min(T, window)
    tokens, returns all it held plus the new ones, and the bytes are the prediction."""
    cfg = gemma3_config(window)
    cache = quantized(cfg, bits, residual_length=8, sink_tokens=1)
    gen = torch.Generator().manual_seed(len(chunks))
    total = sum(chunks)
    k = torch.randn(1, 1, total, HEAD_DIM, generator=gen)
    v = torch.randn(1, 1, total, HEAD_DIM, generator=gen)
    seen = 0
    for n in chunks:
        held = min(seen, window)
        keys, _ = cache.update(k[:, :, seen : seen + n], v[:, :, seen : seen + n], 0)
        for i in range(1, 6):
            cache.update(k[:, :, seen : seen + n], v[:, :, seen : seen + n], i)
        assert keys.shape[2] == held + n
        assert cache.layers[0].get_mask_sizes(1) == (
            min(seen + n, window) + 1,
            seen + n - min(seen + n, window),
        )
        seen += n
        layer = cache.layers[0]
        assert layer.kept() == min(seen, window) and layer.get_seq_length() == seen
        torch.testing.assert_close(
            layer.keys.float(), k[:, :, seen - layer.kept() : seen].half().float()
        )
        assert cache.nbytes() == predicted(cache, cfg, seen)


def test_unserved_layer_types_still_fail_clearly():
    chunked = llama_config(
        vocab_size=100,
        layer_types=["chunked_attention", "full_attention"],
        attention_chunk_size=8,
    )
    for make in (lambda c: QuantizedKVCache(c, 4), lambda c: EvictionCache(c, "knorm", 8)):
        with pytest.raises(ValueError, match="full_attention and sliding_attention.*chunked"):
            make(chunked)
    all_sliding = gemma3_config()
    all_sliding.layer_types = ["sliding_attention"] * 6
    assert all(isinstance(x, SlidingWindowLayer) for x in quantized(all_sliding).layers)
    with pytest.raises(ValueError, match="at least one full_attention layer"):
        EvictionCache(all_sliding, "streaming", 8)
    with pytest.raises(ValueError, match="sliding_window must be"):
        SlidingWindowLayer(0)
    with pytest.raises(ValueError, match="MLA latent"):
        memory.quantized_cache_bytes(
            specs.get_spec("deepseek-v2-lite"),
            8,
            key_bits=4,
            value_bits=4,
            group_size=32,
            key_group_size=32,
            residual_length=128,
            sink_tokens=4,
        )
    layer = SlidingWindowLayer(4)
    layer.update(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8))
    with pytest.raises(ValueError, match="batch=1, kv_heads=1, seq_len, head_dim=8"):
        layer.update(torch.randn(2, 1, 3, 8), torch.randn(2, 1, 3, 8))
    with pytest.raises(NotImplementedError, match="cannot crop"):
        layer.crop(1)


@pytest.mark.parametrize("bits", [4, 2])
def test_prediction_also_holds_for_smollm2_with_the_defaults(bits):
    """The same function on a full-attention model: SmolLM2-135M's geometry, the cache's
    defaults (int2 rotates its keys: the Hadamard matrix counts), 300 tokens fed directly."""
    spec = specs.get_spec("smollm2-135m")
    cfg = LlamaConfig(
        num_hidden_layers=spec.num_layers,
        hidden_size=spec.num_heads * spec.head_dim,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=64,
        vocab_size=64,
    )
    cache = QuantizedKVCache(cfg, bits)
    k = torch.randn(1, spec.num_kv_heads, 300, spec.head_dim)
    for i in range(spec.num_layers):
        cache.update(k[:, :, :290], k[:, :, :290], i)
        cache.update(k[:, :, 290:], k[:, :, 290:], i)
    assert cache.rotate == (bits == 2)
    assert specs.spec_from_config(cfg).tokens_cached(300) == spec.tokens_cached(300)
    assert cache.nbytes() == predicted(cache, cfg, 300)
    assert cache.fp16_nbytes() == memory.kv_cache_bytes(spec, 300, bits=16)


def test_sliding_layer_batch_operations_move_rows_together():
    layer = SlidingWindowLayer(4, torch.float16)
    k = torch.arange(2 * 6, dtype=torch.float32).view(2, 1, 6, 1).expand(2, 1, 6, 8)
    layer.update(k, -k)
    assert layer.kept() == 4 and layer.nbytes() == 2 * 2 * 4 * 8 * 2
    layer.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.keys[0, 0, :, 0].float(), torch.tensor([8.0, 9, 10, 11]))
    layer.batch_repeat_interleave(2)
    assert layer.batch_size == 4 and torch.equal(layer.values[3], -layer.keys[3])
    layer.batch_select_indices(torch.tensor([0, 3]))
    assert layer.keys.shape == (2, 1, 4, 8) and layer.get_seq_length() == 6
    layer.reset()
    assert layer.nbytes() == 0 and layer.get_seq_length() == 0 and layer.kept() == 0


@pytest.mark.parametrize("name", ["quanto-int4", "hqq-int8-axis1", "hf-fp8"])
def test_transformers_quantized_caches_serve_hybrid_models_through_the_registry(gemma, name):
    """transformers' QuantizedCache refuses sliding layers; the registry's copy gives them
    kvlib's float16 windows and keeps transformers' quantized layer on the global one, so that
    the comparison with kvlib's caches differs only there."""
    from transformers import QuantizedCache

    from kvlib.caches import registry as cache_registry

    cfg = gemma.config
    with pytest.raises(ValueError, match="only full attention"):
        QuantizedCache("quanto", cfg)
    cache = cache_registry.make_cache(name, cfg)
    assert [type(x).__name__ for x in cache.layers[:5]] == ["SlidingWindowLayer"] * 5
    global_layer = cache.layers[5]
    assert "QuantizedLayer" in type(global_layer).__name__
    tokens, chunks = ids(60), [37, 5, 1, 1, 16]
    ref = chunked_logits(gemma, tokens, compat.dynamic_cache(cfg), chunks)
    got = chunked_logits(gemma, tokens, cache, chunks)
    assert torch.isfinite(got).all() and (got - ref).abs().max() <= 0.2 * ref.abs().max()
    for layer in cache.layers[:5]:
        assert layer.kept() == WINDOW and layer.keys.dtype == torch.float16
    # bytes: the windows exactly as kvlib.memory prices them, plus the global layer's own
    windows = sum(compat.layer_nbytes(x) for x in cache.layers[:5])
    assert windows == 5 * 2 * WINDOW * HEAD_DIM * 2
    assert compat.cache_nbytes(cache) == windows + compat.layer_nbytes(global_layer) > windows
    # the same cache on a full-attention model is transformers' own class
    full = gemma3_config()
    full.layer_types = ["full_attention"] * 6
    assert type(cache_registry.make_cache(name, full)) is QuantizedCache


def test_hybrid_hf_cache_refuses_what_transformers_refuses():
    cfg = gemma3_config()
    with pytest.raises(ValueError, match="only full attention"):
        compat.hf_quantized_cache(cfg, "quanto", 4)  # no sliding_layer: transformers decides
    with pytest.raises(ValueError, match="takes no"):
        compat.hf_quantized_cache(cfg, "fp8", residual_length=8, sliding_layer=SlidingWindowLayer)
    with pytest.raises(ValueError, match="backend must be one of"):
        compat.hf_quantized_cache(cfg, "int4", sliding_layer=SlidingWindowLayer)


def test_one_shared_prefill_answers_as_generate_does_on_a_hybrid_model(gemma):
    """kvlib.eval.retrieval.compare_retrieval on a model with sliding-window layers: the shared
    prefill stores every layer in full, so each cache (which keeps its own window) answers what
    its own evaluate_retrieval run answers; a base model's tokenizer (no chat template) gets the
    plain-text prompt."""
    from kvlib.caches import registry
    from kvlib.eval import retrieval

    class Tokenizer:  # one token per character of the tiny vocabulary, no chat template
        chat_template = None

        def __call__(self, text, return_tensors=None):
            ids = [ord(c) % VOCAB for c in text]

            class Out:
                input_ids = torch.tensor([ids]) if return_tensors == "pt" else ids

            return Out()

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(48 + int(i) % 10) if int(i) < 20 else chr(int(i)) for i in ids)

        def apply_chat_template(self, *args, **kwargs):
            raise AssertionError("a base model's prompt must not use a chat template")

    cfg, tok = gemma.config, Tokenizer()
    corpus = "\n".join(f"Line {i} of the filler, about the data model." for i in range(400))
    caches = {
        "dynamic": None,
        "kvlib-int4": registry.cache_factory("kvlib-int4", cfg),
        "h2o": registry.cache_factory("evict-h2o", cfg, budget=96),
    }
    grid = {"context_tokens": (200,), "depths": (0.3, 0.8), "trials": 1, "seed": 2}
    from unittest import mock

    def stored(cache):  # storage between turns, e.g. kvtc: gets what the model's cache holds
        return cache, compat.cache_nbytes(cache)

    with mock.patch("kvlib.eval.passkey.load_eval_text", return_value=corpus):
        shared = retrieval.compare_retrieval(
            gemma, tok, caches, restored={"stored": stored}, **grid
        )
        for name, factory in caches.items():
            alone = retrieval.evaluate_retrieval(gemma, tok, factory, **grid)
            for a, b in zip(shared[name].records, alone.records, strict=True):
                assert b["output"].startswith(a["output"]) and a["correct"] == b["correct"], name
    assert shared["h2o"].records[0]["nbytes"] < shared["dynamic"].records[0]["nbytes"]
    # the stored cache holds each sliding layer's window, not the whole prompt
    assert [r["nbytes"] for r in shared["stored"].records] == [
        r["nbytes"] for r in shared["dynamic"].records
    ]
    assert [r["output"] for r in shared["stored"].records] == [
        r["output"] for r in shared["dynamic"].records
    ]
