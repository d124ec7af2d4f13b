"""TurboQuant: the codec (kvlib.quant.turboquant) and the cache (kvlib.caches.turboquant).

The codec's distortion is checked against the codebook's own (and against the figures of the
TurboQuant paper's Theorem 1), its byte counts against the encodings it really makes, the QJL
stage's unbiasedness statistically; the cache's byte count against a formula of its layout,
its reads against the codec, its chunking, its layers on dense and hybrid models, and a model
run through ``generate()``."""

from __future__ import annotations

import math

import pytest
import torch
from _tiny_models import gemma3_config
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from kvlib import compat
from kvlib.caches import registry
from kvlib.caches.sliding import SlidingWindowLayer
from kvlib.caches.turboquant import BOUNDARY_LAYERS, TurboQuantCache, TurboQuantLayer
from kvlib.eval.model_choice import random_config
from kvlib.quant.packing import packed_nbytes
from kvlib.quant.turboquant import FP8_MAX, QJL, VLLM_PRESETS, TurboQuantizer

HEAD_DIM = 64  # SmolLM2's
BITS = st.sampled_from([2, 3, 4])


def _anisotropic(n: int, d: int, seed: int) -> torch.Tensor:
    """Vectors whose channels differ in scale by 100x and sit off zero: what a rotation must
    turn into the codebook's distribution."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-1, 1, d)
    return torch.randn(n, d, generator=g) * scales + torch.linspace(-2, 2, d)


# ---------------------------------------------------------------------- the codec


@settings(max_examples=12, deadline=None)
@given(bits=BITS, d=st.sampled_from([32, 64, 128]), seed=st.integers(0, 10_000))
def test_random_rotation_makes_the_codebook_distortion_data_oblivious(bits, d, seed):
    """Averaged over Haar rotations, every coordinate of a rotated unit vector follows the
    sphere's coordinate law, so the mean relative error of any input is ``d`` times the
    codebook's per-coordinate MSE, however skewed the input's channels are. One rotation of a
    skewed input misses that by up to ~5 % (one standard deviation at d=32, less at larger d),
    so the test averages 8 rotations and allows 10 %."""
    x = _anisotropic(3000, d, seed)
    rel, mse = [], None
    for r in range(8):
        q = TurboQuantizer(
            d, bits, 4, rotation="random", codebook="sphere", norm_correction=False, seed=seed + r
        )
        y = q.decode_keys(q.encode_keys(x))
        rel.append(float(((y - x).norm(dim=-1) ** 2 / x.norm(dim=-1) ** 2).mean()))
        mse = q.codebook.mse
    assert sum(rel) / len(rel) == pytest.approx(d * mse, rel=0.1)


@pytest.mark.parametrize("bits, limit", [(2, 0.1175), (3, 0.03454), (4, 0.009497)])
def test_distortion_matches_the_papers_theorem(bits, limit):
    """TurboQuant's Theorem 1: D_mse of a unit vector tends to the Gaussian Lloyd-Max MSE (Max
    1960: 0.1175, 0.03454, 0.009497 at 2, 3, 4 bits; the paper rounds them to 0.117, 0.03 and
    0.009) as the dimension grows."""
    q = TurboQuantizer(128, bits, 4, rotation="random", codebook="sphere", norm_correction=False)
    x = torch.randn(4000, 128, generator=torch.Generator().manual_seed(bits))
    x = x / x.norm(dim=-1, keepdim=True)
    err = float(((q.decode_keys(q.encode_keys(x)) - x) ** 2).sum(-1).mean())
    assert err == pytest.approx(limit, rel=0.05)


@settings(max_examples=10, deadline=None)
@given(bits=BITS, seed=st.integers(0, 10_000))
def test_vllms_settings_reach_the_gaussian_codebooks_distortion(bits, seed):
    """vLLM's choice (plain Hadamard, Gaussian N(0, 1/d) codebook, norm correction) on isotropic
    keys: within 10 % of the codebook's distortion, and norms kept to float16's precision."""
    q = TurboQuantizer(HEAD_DIM, bits, 4)
    x = torch.randn(2000, HEAD_DIM, generator=torch.Generator().manual_seed(seed)) * 3
    y = q.decode_keys(q.encode_keys(x))
    rel = ((y - x).norm(dim=-1) ** 2 / x.norm(dim=-1) ** 2).mean()
    assert float(rel) <= 1.1 * q.codebook.mse
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-3, atol=0)


@settings(max_examples=15, deadline=None)
@given(
    kv=st.sampled_from(sorted(VLLM_PRESETS.values()) + [(2, 2), (4, 8)]),
    d=st.sampled_from([32, 64, 256]),
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
)
def test_bytes_held_are_the_token_formula(kv, d, shape):
    """The encodings' bytes are exactly ``token_nbytes()`` per vector: the codes, the key's
    fp16 norm (none for float8 keys), the values' codes and fp16 scale and zero point."""
    q = TurboQuantizer(d, *kv)
    x = torch.randn(*shape, d)
    held = q.encode_keys(x).nbytes + q.encode_values(x).nbytes
    assert held == math.prod(shape) * q.token_nbytes()
    key_bytes = d if kv[0] == 8 else packed_nbytes(d, kv[0]) + 2
    assert q.token_nbytes() == key_bytes + packed_nbytes(d, kv[1]) + 4
    assert q.bits_per_value() == 8 * q.token_nbytes() / (2 * d)


def test_float8_keys_round_to_e4m3_and_clamp():
    q = TurboQuantizer(HEAD_DIM, 8, 4)
    x = torch.randn(50, HEAD_DIM, generator=torch.Generator().manual_seed(0)) * 10
    enc = q.encode_keys(x)
    assert enc.codes.dtype == torch.float8_e4m3fn and enc.norms is None
    y = q.decode_keys(enc)
    normal = x.abs() > 2**-6  # e4m3's smallest normal
    assert bool(((y - x).abs() <= x.abs() * 2**-4)[normal].all())  # half of 3 mantissa bits
    big = q.decode_keys(q.encode_keys(torch.full((1, HEAD_DIM), 1e4)))
    assert bool((big == FP8_MAX).all())


@settings(max_examples=15, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), seed=st.integers(0, 10_000))
def test_values_stay_within_half_a_step_of_their_tokens_range(bits, seed):
    q = TurboQuantizer(HEAD_DIM, 4, bits)
    v = torch.randn(3, 40, HEAD_DIM, generator=torch.Generator().manual_seed(seed)) * 5
    err = (q.decode_values(q.encode_values(v)) - v).abs()
    step = (v.amax(-1) - v.amin(-1)) / (2**bits - 1)
    assert bool((err <= step.unsqueeze(-1) * 0.5 * 1.01 + 1e-3).all())


def test_encoded_keys_concatenate_and_select_without_reencoding():
    q = TurboQuantizer(HEAD_DIM, 3, 4)
    a, b = torch.randn(2, 3, 5, HEAD_DIM), torch.randn(2, 3, 7, HEAD_DIM)
    ea, eb = q.encode_keys(a), q.encode_keys(b)
    both = ea.cat(eb, dim=2)
    assert both.shape == (2, 3, 12, HEAD_DIM) and both.nbytes == ea.nbytes + eb.nbytes
    full = q.decode_keys(both)
    torch.testing.assert_close(full, torch.cat([q.decode_keys(ea), q.decode_keys(eb)], 2))
    idx = torch.tensor([11, 0, 0, 6])
    torch.testing.assert_close(q.decode_keys(both.index_select(2, idx)), full[:, :, idx])
    with pytest.raises(ValueError, match="dim must be a vector axis"):
        ea.cat(eb, dim=3)
    with pytest.raises(ValueError, match="different bits"):
        ea.cat(TurboQuantizer(HEAD_DIM, 4, 4).encode_keys(b), dim=2)
    with pytest.raises(TypeError, match="EncodedKeys"):
        ea.cat(b, dim=2)


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((60,), {}, ValueError, "multiple of 8"),
        ((4,), {}, ValueError, "head_dim"),
        ((24,), {}, ValueError, "power-of-two head_dim"),
        ((64, 5), {}, ValueError, "key_bits"),
        ((64, True), {}, ValueError, "key_bits"),
        ((64, 4, 1), {}, ValueError, "value_bits"),
        ((64,), {"rotation": "haar"}, ValueError, "rotation"),
        ((64,), {"codebook": "beta"}, ValueError, "codebook"),
        ((64,), {"norm_correction": 1}, TypeError, "norm_correction"),
        ((64.0,), {}, TypeError, "head_dim"),
    ],
)
def test_the_codec_refuses_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        TurboQuantizer(*args, **kwargs)


def test_the_codec_refuses_bad_tensors():
    q = TurboQuantizer(HEAD_DIM, 4, 4)
    TurboQuantizer(24, rotation="random")  # any multiple of 8 with a random rotation
    with pytest.raises(TypeError, match="floating"):
        q.encode_keys(torch.zeros(2, HEAD_DIM, dtype=torch.int64))
    with pytest.raises(ValueError, match="head_dim 64"):
        q.encode_values(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="NaN"):
        q.encode_keys(torch.full((1, HEAD_DIM), float("nan")))
    with pytest.raises(ValueError, match="float16's range"):
        q.encode_keys(torch.full((1, HEAD_DIM), 1e5))
    with pytest.raises(TypeError, match="EncodedKeys of 4 bits"):
        q.decode_keys(TurboQuantizer(HEAD_DIM, 3, 4).encode_keys(torch.ones(1, HEAD_DIM)))


def test_qjl_makes_the_quantized_inner_product_unbiased():
    """TurboQuant's second stage: over the draw of rotation and sketch, ``<q, k_hat> + QJL(q,
    k - k_hat)`` averages to ``<q, k>``, while the codebook stage alone (no norm correction)
    shrinks inner products by the share of the norm it loses."""
    d, seeds = 32, 300
    g = torch.Generator().manual_seed(7)
    k, qv = torch.randn(d, generator=g), torch.randn(d, generator=g)
    qv = qv + k  # correlated, so the true inner product is well away from zero
    truth = float(qv @ k)
    mse_only, corrected = [], []
    for s in range(seeds):
        tq = TurboQuantizer(d, 2, 4, rotation="random", norm_correction=False, seed=s)
        k_hat = tq.decode_keys(tq.encode_keys(k[None]))[0]
        sketch = QJL(d, seed=s)
        signs, norms = sketch.encode((k - k_hat)[None])
        mse_only.append(float(qv @ k_hat))
        corrected.append(float(qv @ k_hat) + float(sketch.inner_product(qv[None], signs, norms)))
    est = torch.tensor(corrected)
    assert abs(float(est.mean()) - truth) < 4 * float(est.std()) / math.sqrt(seeds)
    biased = torch.tensor(mse_only)
    assert abs(float(biased.mean()) - truth) > 4 * float(biased.std()) / math.sqrt(seeds)
    with pytest.raises(ValueError, match="ending in 32"):
        QJL(d).encode(torch.zeros(3, 16))


# ---------------------------------------------------------------------- the cache


@pytest.fixture(scope="module")
def config():
    return random_config("smollm2-135m", num_layers=6, vocab_size=512, intermediate_size=256)


def _layout_bytes(layer: TurboQuantLayer, q: TurboQuantizer, b: int, h: int, t: int) -> int:
    """Bytes of ``t`` tokens in one layer, from the layout alone."""
    fp16 = 2 * HEAD_DIM * 2  # one token's key and value in float16
    if layer.quantizer is None:
        return b * h * t * fp16
    sinks = min(layer.sink_tokens, t)
    rest = t - sinks
    r = layer.residual_length
    encoded = rest if r == 0 else rest // r * r
    means = encoded // r * HEAD_DIM * 2 if layer.center_keys else 0
    return b * h * ((sinks + rest - encoded) * fp16 + encoded * q.token_nbytes() + means)


LAYOUTS = {
    "vllm": {},
    "kvlib": {"sink_tokens": 4, "residual_length": 32, "center_keys": True, "boundary_layers": 0},
}


@settings(max_examples=20, deadline=None)
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    kv=st.sampled_from(sorted(VLLM_PRESETS.values())),
    prefill=st.integers(1, 150),
    steps=st.integers(0, 6),
    batch=st.integers(1, 2),
)
def test_nbytes_is_the_layouts_formula(config, layout, kv, prefill, steps, batch):
    cache = TurboQuantCache(config, *kv, **LAYOUTS[layout])
    h = config.num_key_value_heads
    g = torch.Generator().manual_seed(prefill)
    for n in [prefill] + [1] * steps:
        for i in range(len(cache.layers)):
            k, v = torch.randn(2, batch, h, n, HEAD_DIM, generator=g)
            cache.update(k, v, i)
    t = prefill + steps
    want = sum(_layout_bytes(la, cache.quantizer, batch, h, t) for la in cache.layers)
    assert cache.nbytes() == want
    assert cache.fp16_nbytes() == len(cache.layers) * batch * h * t * 2 * HEAD_DIM * 2
    assert cache.compression_ratio() == pytest.approx(cache.fp16_nbytes() / want)


def test_vllms_boundary_layers(config):
    cache = TurboQuantCache(config)
    kinds = [layer.quantizer is None for layer in cache.layers]
    n = len(kinds)
    assert kinds == [i < BOUNDARY_LAYERS or i >= n - BOUNDARY_LAYERS for i in range(n)]
    small = random_config("smollm2-135m", num_layers=4, vocab_size=512, intermediate_size=256)
    assert all(layer.quantizer is None for layer in TurboQuantCache(small).layers)
    assert all(la.quantizer is not None for la in TurboQuantCache(config, boundary_layers=0).layers)
    with pytest.raises(ValueError, match="leaves none of the 4 layers"):
        TurboQuantCache(small, boundary_layers=2)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_new_states_come_back_as_given_and_the_past_as_the_codec_reads_it(config, layout):
    cache = TurboQuantCache(config, 3, 4, **LAYOUTS[layout])
    h, i = config.num_key_value_heads, 2  # a quantized layer in both layouts
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 1, h, 70, HEAD_DIM, generator=g)
    out_k, out_v = cache.update(k, v, i)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)  # a prefill attends to itself exactly
    k1, v1 = torch.randn(2, 1, h, 1, HEAD_DIM, generator=g)
    out_k, out_v = cache.update(k1, v1, i)
    assert torch.equal(out_k[:, :, -1:], k1) and torch.equal(out_v[:, :, -1:], v1)
    layer, q = cache.layers[i], cache.quantizer
    if layout == "vllm":
        want_k = q.decode_keys(q.encode_keys(k.half().float()))
        want_v = q.decode_values(q.encode_values(v.half().float()))
    else:  # 4 sinks in fp16, two centred 32-token blocks, 2 + 1 tokens in the window
        blocks = k[:, :, 4:68].half().float()
        means = blocks.view(1, h, 2, 32, HEAD_DIM).mean(3, keepdim=True).half().float()
        centred = (blocks.view(1, h, 2, 32, HEAD_DIM) - means).view(1, h, 64, HEAD_DIM)
        enc = q.decode_keys(q.encode_keys(centred)).view(1, h, 2, 32, HEAD_DIM) + means
        want_k = torch.cat([k[:, :, :4].half().float(), enc.view(1, h, 64, HEAD_DIM)], 2)
        want_k = torch.cat([want_k, k[:, :, 68:].half().float()], 2)
        want_v = torch.cat(
            [
                v[:, :, :4].half().float(),
                q.decode_values(q.encode_values(v[:, :, 4:68].half().float())),
                v[:, :, 68:].half().float(),
            ],
            2,
        )
    torch.testing.assert_close(out_k[:, :, :70], want_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out_v[:, :, :70], want_v, rtol=1e-4, atol=1e-4)
    assert layer.get_seq_length() == 71 == cache.get_seq_length(i)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_how_tokens_arrive_does_not_change_what_is_read(config, layout):
    """Blocks close at fixed token counts and every vector is encoded on its own, so a prefill
    of 90 tokens and the same tokens in uneven chunks read back the same."""
    h = config.num_key_value_heads
    k, v = torch.randn(2, 1, h, 90, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    whole, chunked = (TurboQuantCache(config, 2, 3, **LAYOUTS[layout]) for _ in range(2))
    whole.update(k, v, 2)
    start = 0
    for n in (37, 1, 1, 29, 22):
        chunked.update(k[:, :, start : start + n], v[:, :, start : start + n], 2)
        start += n
    a, b = whole.layers[2].dequantized(), chunked.layers[2].dequantized()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert whole.nbytes() == chunked.nbytes()


def test_a_hybrid_model_keeps_windows_in_its_sliding_layers():
    cfg = gemma3_config(window=16, head_dim=256)
    cache = TurboQuantCache(cfg, 3, 4)
    assert cache.boundary_layers == 0  # vLLM quantizes every layer of a hybrid model
    sliding = [isinstance(layer, SlidingWindowLayer) for layer in cache.layers]
    assert sliding == [t == "sliding_attention" for t in cfg.layer_types]
    k, v = torch.randn(2, 1, 1, 40, 256)
    for i in range(6):
        cache.update(k, v, i)
    q = cache.quantizer
    n_global, n_sliding = sliding.count(False), sliding.count(True)
    assert cache.nbytes() == n_global * 40 * q.token_nbytes() + n_sliding * 16 * 256 * 2 * 2


def test_the_registry_builds_vllms_presets_and_kvlibs_layout(config):
    for dtype, (kb, vb) in VLLM_PRESETS.items():
        cache = registry.make_cache(dtype.replace("_", "-"), config)
        assert isinstance(cache, TurboQuantCache)
        assert (cache.quantizer.key_bits, cache.quantizer.value_bits) == (kb, vb)
        assert cache.quantizer.norm_correction == dtype.endswith("_nc")
        assert cache.boundary_layers == BOUNDARY_LAYERS and cache.residual_length == 0
    cache = registry.make_cache("turboquant-3bit-centered", config)
    assert (cache.sink_tokens, cache.residual_length, cache.center_keys) == (4, 128, True)
    assert cache.boundary_layers == 0
    with pytest.raises(TypeError):
        registry.make_cache("turboquant-3bit-centered", config, no_such_option=1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"key_bits": 6}, ValueError, "key_bits"),
        ({"boundary_layers": 3}, ValueError, "leaves none"),
        ({"boundary_layers": -1}, ValueError, "boundary_layers"),
        ({"center_keys": True}, ValueError, "residual_length >= 1"),
        ({"center_keys": "yes", "residual_length": 8}, TypeError, "center_keys"),
        ({"sink_tokens": -1}, ValueError, "sink_tokens"),
    ],
)
def test_the_cache_refuses_bad_options(config, kwargs, error, match):
    with pytest.raises(error, match=match):
        TurboQuantCache(config, **kwargs)


def test_the_cache_refuses_bad_configs_and_states(config):
    with pytest.raises(TypeError, match="PretrainedConfig"):
        TurboQuantCache({"num_hidden_layers": 2})
    with pytest.raises(TypeError, match="TurboQuantizer or None"):
        TurboQuantLayer("4bit")
    layer = TurboQuantLayer(TurboQuantizer(HEAD_DIM, 4, 4))
    with pytest.raises(ValueError, match="head_dim 32"):
        layer.update(torch.zeros(1, 1, 2, 32), torch.zeros(1, 1, 2, 32))
    layer.update(torch.zeros(1, 2, 3, HEAD_DIM), torch.zeros(1, 2, 3, HEAD_DIM))
    with pytest.raises(ValueError, match="call reset"):
        layer.update(torch.zeros(1, 3, 1, HEAD_DIM), torch.zeros(1, 3, 1, HEAD_DIM))
    with pytest.raises(NotImplementedError, match="cannot crop"):
        layer.crop(1)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.nbytes() == 0
    with pytest.raises(ValueError, match="float16 range"):
        TurboQuantLayer(None).update(torch.full((1, 1, 1, 8), 1e6), torch.zeros(1, 1, 1, 8))


@pytest.fixture(scope="module")
def model(config):
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_generate_runs_and_follows_the_full_precision_cache(model, config):
    """Through ``generate()``: with float8 keys and 8-bit values the decode logits follow a
    DynamicCache's closely; every preset generates the requested tokens."""
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    kwargs = dict(
        max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    ref = compat.generate(model, ids, compat.dynamic_cache(config), **kwargs)
    fine = compat.generate(model, ids, TurboQuantCache(config, 8, 8), **kwargs)
    for name in ("turboquant-3bit-nc", "turboquant-2bit-centered"):
        out = compat.generate(model, ids, registry.make_cache(name, config), **kwargs)
        assert out.sequences.shape == (2, 46)
        assert all(bool(torch.isfinite(x).all()) for x in out.logits)
    assert torch.equal(fine.sequences, ref.sequences)
    for a, b in zip(fine.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0.05 * float(b.abs().max()))


@pytest.mark.parametrize("key_bits", [3, 8])
def test_decode_writes_into_a_slice_what_it_returns(key_bits):
    q = TurboQuantizer(HEAD_DIM, key_bits, 4)
    x = _anisotropic(2 * 40, HEAD_DIM, seed=3).view(1, 2, 40, HEAD_DIM)
    keys, values = q.encode_keys(x), q.encode_values(x)
    for decode, enc in ((q.decode_keys, keys), (q.decode_values, values)):
        want = decode(enc)
        big = torch.full((1, 2, 45, HEAD_DIM), float("nan"))
        decode(enc, out=big[:, :, 2:42])
        assert torch.equal(big[:, :, 2:42], want) and big[:, :, :2].isnan().all()
        half = torch.empty(1, 2, 40, HEAD_DIM, dtype=torch.float16)
        assert torch.equal(decode(enc, out=half), want.half())
    with pytest.raises(ValueError, match="out must be a tensor of shape"):
        q.decode_keys(keys, out=torch.empty(1, 2, 39, HEAD_DIM))
