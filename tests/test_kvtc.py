"""kvlib.kvtc.codec: codec round trips within the predicted error, the byte format, bad bytes."""

from __future__ import annotations

import json
import struct
import zlib
from types import SimpleNamespace

import pytest
import torch
from _synthetic_kv import correlated_layers
from _tiny_models import gemma3_config
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Gemma3ForCausalLM

import kvlib
from kvlib import compat, rope
from kvlib.eval import quality
from kvlib.kvtc import codec as kvtc
from kvlib.kvtc import pca


def _mid_mse(a, b, sink: int, recent: int) -> float:
    """Mean squared error of two caches over the compressed tokens (between the windows)."""
    errs = []
    for (k1, v1), (k2, v2) in zip(compat.cache_tensors(a), compat.cache_tensors(b), strict=True):
        end = k1.shape[2] - recent
        errs += [
            ((k1 - k2)[:, :, sink:end] ** 2).flatten(),
            ((v1 - v2)[:, :, sink:end] ** 2).flatten(),
        ]
    return float(torch.cat(errs).double().mean())


@pytest.mark.parametrize("cross_layer", [True, False])
@pytest.mark.parametrize("compression", [3.0, 6.0])
def test_random_cache_round_trip_within_predicted_error(cross_layer, compression) -> None:
    basis = pca.fit_basis(correlated_layers(24, 64), cross_layer=cross_layer)
    codec = kvtc.KVTCCodec(basis, compression=compression, sink_tokens=2, recent_tokens=8)
    cache = compat.dynamic_cache_from(correlated_layers(2, 200, seed=7))
    out = codec.decode(codec.encode(cache))
    measured = _mid_mse(cache, out, 2, 8)
    predicted = codec.predicted_mse()
    assert 0.6 * predicted <= measured <= 1.4 * predicted, (measured, predicted)
    for (k1, v1), (k2, v2) in zip(
        compat.cache_tensors(cache), compat.cache_tensors(out), strict=True
    ):
        assert k2.shape == k1.shape and k2.dtype == k1.dtype
        # the windows come back as their float16 values
        assert torch.equal(k2[:, :, :2], k1[:, :, :2].half().float())
        assert torch.equal(v2[:, :, -8:], v1[:, :, -8:].half().float())


@pytest.fixture(scope="module")
def real_basis(model, tokenizer):
    calib, _ = kvlib.data.split_text(kvlib.data.load_eval_text(), 0.5)
    return pca.fit_kv_pca(
        model, tokenizer, calib, cross_layer=False, max_tokens=1024, chunk_len=256
    )


def test_real_cache_round_trip_and_continue(model, tokenizer, real_basis) -> None:
    calib, evaluation = kvlib.data.split_text(kvlib.data.load_eval_text(), 0.5)
    assert evaluation[:6000] not in calib  # calibration and evaluation text are disjoint
    ids = tokenizer(evaluation[:6000], return_tensors="pt").input_ids[:, :364]
    prefix, nxt = ids[:, :300], ids[:, 300:]
    cache = compat.prefill_cache(model, prefix)
    codec = kvtc.KVTCCodec(real_basis, compression=6.0, recent_tokens=64)
    data = codec.encode(cache)
    info = codec.inspect(data)
    assert info.seq_len == 300 and info.compressed_tokens == 300 - 4 - 64
    assert info.compression_ratio() > 2.0
    out = codec.decode(data)
    measured = _mid_mse(cache, out, 4, 64)
    assert 0.5 * codec.predicted_mse() <= measured <= 2.0 * codec.predicted_mse()
    ref = quality.continuation_perplexity(model, compat.clone_cache(cache), nxt)
    got = quality.continuation_perplexity(model, out, nxt)
    assert out.get_seq_length() == 300 + 64 - 1  # the last token is only a target
    assert cache.get_seq_length() == 300  # the clone was scored, not the original
    assert abs(got / ref - 1) < 0.25, (got, ref)
    assert real_basis.nbytes() > 0


def test_bytes_decode_with_a_saved_and_loaded_basis(tmp_path) -> None:
    basis = pca.fit_basis(correlated_layers(8, 32), cross_layer=True, inv_freq=torch.ones(4))
    basis.save(tmp_path / "b.safetensors")
    back = pca.KVPCABasis.load(tmp_path / "b.safetensors")
    cache = compat.dynamic_cache_from(correlated_layers(1, 40, seed=3))
    data = kvtc.KVTCCodec(basis, compression=4.0, recent_tokens=4).encode(cache)
    out = kvtc.KVTCCodec(back, compression=4.0, recent_tokens=4).decode(data)
    assert out.get_seq_length() == 40
    ref = kvtc.KVTCCodec(basis, compression=4.0, recent_tokens=4).decode(data)
    for (k1, v1), (k2, v2) in zip(
        compat.cache_tensors(ref), compat.cache_tensors(out), strict=True
    ):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_header_describes_the_bytes() -> None:
    basis = pca.fit_basis(correlated_layers(8, 32), cross_layer=False)
    codec = kvtc.KVTCCodec(basis, compression=4.0, sink_tokens=3, recent_tokens=5, coder="zlib")
    data = codec.encode(compat.dynamic_cache_from(correlated_layers(2, 40, seed=1)))
    assert data[:4] == kvtc.MAGIC
    info = codec.inspect(data)
    assert (info.batch, info.seq_len, info.num_layers, info.kv_heads, info.head_dim) == (
        2, 40, 2, 2, 8,
    )  # fmt: skip
    assert (info.sink_tokens, info.recent_tokens, info.compressed_tokens) == (3, 5, 32)
    assert (info.dtype, info.coder, info.nbytes) == ("float32", "zlib", len(data))
    assert info.fp16_bytes == 2 * 2 * 2 * 2 * 2 * 40 * 8
    assert info.window_bytes + info.code_bytes < len(data)


def test_corrupted_or_truncated_bytes_rejected() -> None:
    basis = pca.fit_basis(correlated_layers(8, 32), cross_layer=False)
    codec = kvtc.KVTCCodec(basis, compression=4.0, recent_tokens=4)
    data = codec.encode(compat.dynamic_cache_from(correlated_layers(1, 40, seed=1)))
    for bad in (data[:-1], data[: len(data) // 2], data[:5], b""):
        with pytest.raises(ValueError, match="truncated|corrupted"):
            codec.decode(bad)
    for pos in (len(data) // 3, len(data) - 10, 20):
        flipped = bytearray(data)
        flipped[pos] ^= 0x40
        with pytest.raises(ValueError):
            codec.decode(bytes(flipped))
    with pytest.raises(ValueError, match="magic"):
        codec.decode(b"XXXX" + data[4:])
    newer = data[:4] + struct.pack("<H", kvtc.FORMAT_VERSION + 1) + data[6:]
    with pytest.raises(ValueError, match="format version"):
        codec.decode(newer)
    other = pca.fit_basis(correlated_layers(8, 32, seed=5), cross_layer=False)
    with pytest.raises(ValueError, match="different PCA basis"):
        kvtc.KVTCCodec(other).decode(data)
    with pytest.raises(TypeError, match="bytes"):
        codec.decode("text")  # type: ignore[arg-type]


def test_bad_codec_inputs() -> None:
    basis = pca.fit_basis(correlated_layers(8, 32), cross_layer=True)
    with pytest.raises(ValueError, match="compression"):
        kvtc.KVTCCodec(basis, compression=0.5)
    with pytest.raises(ValueError, match="compression"):
        kvtc.KVTCCodec(basis, compression=float("inf"))
    with pytest.raises(TypeError, match="KVPCABasis"):
        kvtc.KVTCCodec("basis")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="coder"):
        kvtc.KVTCCodec(basis, coder="gzip")
    with pytest.raises(ValueError, match="max_bits"):
        kvtc.KVTCCodec(basis, max_bits=9)
    with pytest.raises(ValueError, match="recent_tokens"):
        kvtc.KVTCCodec(basis, recent_tokens=-1)
    with pytest.raises(TypeError, match="DynamicCache"):
        kvtc.KVTCCodec(basis).encode(torch.zeros(3))
    wrong = compat.dynamic_cache_from(correlated_layers(1, 20, layers=3))
    with pytest.raises(ValueError, match="basis was fitted"):
        kvtc.KVTCCodec(basis).encode(wrong)


# -- hybrid models: the global layers coded, the sliding windows stored whole ----------------


class _CharTokenizer:
    """Token ids from characters, for a tiny model with a 128-token vocabulary."""

    def __call__(self, text: str, return_tensors: str = "pt") -> SimpleNamespace:
        return SimpleNamespace(input_ids=torch.tensor([[ord(c) % 128 for c in text]]))


@pytest.fixture(scope="module")
def tiny_gemma():
    torch.manual_seed(0)
    return Gemma3ForCausalLM(gemma3_config(window=16)).eval()


def test_hybrid_basis_codes_the_global_layers(tiny_gemma) -> None:
    text = kvlib.data.load_eval_text()[:3000]
    basis = pca.fit_kv_pca(tiny_gemma, _CharTokenizer(), text, max_tokens=1024, chunk_len=64)
    windows = compat.layer_windows(tiny_gemma.config)
    assert basis.coded_layers == [i for i, w in enumerate(windows) if w is None] == [5]
    assert basis.num_layers == 6 and basis.token_dim == 2 * 1 * 64
    inv, scaling = rope.rope_from_config(tiny_gemma.config, "full_attention")
    assert torch.equal(basis.inv_freq, inv) and basis.attention_scaling == scaling
    sliding_inv, _ = rope.rope_from_config(tiny_gemma.config, "sliding_attention")
    assert not torch.equal(inv, sliding_inv)  # the global layers' own RoPE, not the local one

    ids = _CharTokenizer()(kvlib.data.load_eval_text()[5000:5060]).input_ids
    cache = compat.prefill_cache(tiny_gemma, ids[:, :48])
    codec = kvtc.KVTCCodec(basis, compression=2.0, sink_tokens=2, recent_tokens=8)
    data = codec.encode(cache)
    info = codec.inspect(data)
    assert info.layer_tokens == (15, 15, 15, 15, 15, 48) and info.coded_layers == (5,)
    assert info.fp16_bytes == sum(
        2 * (k.numel() + v.numel()) for k, v in compat.cache_tensors(cache)
    )
    assert info.coded_fp16_bytes == 2 * 2 * 48 * 64
    assert info.whole_bytes > 0
    assert info.coded_compression_ratio() > info.compression_ratio()
    out = codec.decode(data)
    # the basis was fitted on the keys the cache holds (QK-normed, then rotated): the error
    # on the coded tokens is what the calibration predicts
    (k1, v1), (k2, v2) = compat.cache_tensors(cache)[5], compat.cache_tensors(out)[5]
    measured = float(torch.cat([(k1 - k2)[:, :, 2:-8], (v1 - v2)[:, :, 2:-8]]).pow(2).mean())
    assert 0.3 * codec.predicted_mse() < measured < 3 * codec.predicted_mse()
    assert compat.cache_windows(out) == compat.cache_windows(cache) == windows
    assert out.get_seq_length() == cache.get_seq_length() == 48
    for i, ((k1, v1), (k2, v2)) in enumerate(
        zip(compat.cache_tensors(cache), compat.cache_tensors(out), strict=True)
    ):
        assert k2.shape == k1.shape
        if windows[i] is not None:  # stored whole, as float16
            assert torch.equal(k2, k1.half().float()) and torch.equal(v2, v1.half().float())
    # the decoded cache continues like the original: the sliding layers' masks are right
    with torch.no_grad():
        ref = compat.forward(tiny_gemma, ids[:, 48:], compat.clone_cache(cache)).logits
        near = kvtc.KVTCCodec(basis, compression=1.0, max_bits=8, sink_tokens=2, recent_tokens=8)
        got = compat.forward(tiny_gemma, ids[:, 48:], near.decode(near.encode(cache))).logits
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_a_full_model_basis_refuses_a_hybrid_cache(tiny_gemma) -> None:
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    cache = compat.prefill_cache(tiny_gemma, ids)
    full = pca.fit_basis(
        [(torch.randn(2, 1, 40, 64), torch.randn(2, 1, 40, 64)) for _ in range(6)],
        cross_layer=False,
    )
    with pytest.raises(ValueError, match="sliding-window layers"):
        kvtc.KVTCCodec(full).encode(cache)
    with pytest.raises(ValueError, match="coded_layers"):
        pca.fit_basis(correlated_layers(8, 32), coded_layers=[0, 2])
    with pytest.raises(ValueError, match="coded_layers"):
        pca.fit_basis(correlated_layers(8, 32), coded_layers=[])
    with pytest.raises(TypeError, match="coded_layers"):
        pca.fit_basis(correlated_layers(8, 32), coded_layers="0")  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None)
@given(
    layout=st.lists(st.one_of(st.none(), st.integers(2, 30)), min_size=2, max_size=4).filter(
        lambda ws: any(w is None for w in ws)
    ),
    seq=st.integers(14, 40),
    cross=st.booleans(),
)
def test_hybrid_layouts_round_trip_and_count_every_byte(layout, seq, cross) -> None:
    """Any mix of full and sliding layers: the whole layers come back as stored, every layer
    keeps its length and window, and the header's byte counts add up."""
    n = len(layout)
    coded = [i for i, w in enumerate(layout) if w is None]
    basis = pca.fit_basis(correlated_layers(8, 32, layers=n), cross_layer=cross, coded_layers=coded)
    full = correlated_layers(1, seq, layers=n, seed=2)
    layers = [kv if w is None else (kv[0][:, :, -(w - 1) :], kv[1][:, :, -(w - 1) :])
              for kv, w in zip(full, layout, strict=True)]  # fmt: skip
    cache = compat.dynamic_cache_from(layers, layout, seq_len=seq)
    codec = kvtc.KVTCCodec(basis, compression=3.0, sink_tokens=2, recent_tokens=4)
    data = codec.encode(cache)
    info = codec.inspect(data)
    assert info.nbytes == len(data)
    assert info.fp16_bytes == sum(2 * (k.numel() + v.numel()) for k, v in layers)
    assert info.coded_fp16_bytes == 2 * 2 * 2 * 8 * seq * len(coded)
    assert (info.whole_bytes > 0) == (len(coded) < n)
    out = codec.decode(data)
    assert compat.cache_windows(out) == layout and out.get_seq_length() == seq
    for (k1, v1), (k2, v2), w in zip(layers, compat.cache_tensors(out), layout, strict=True):
        assert k2.shape == k1.shape and v2.shape == v1.shape
        if w is not None:
            assert torch.equal(k2, k1.half().float()) and torch.equal(v2, v1.half().float())


def test_version_1_bytes_still_decode() -> None:
    """Bytes written before the whole-layers section (format version 1) decode as before."""
    basis = pca.fit_basis(correlated_layers(8, 32), cross_layer=True)
    codec = kvtc.KVTCCodec(basis, compression=4.0, recent_tokens=4)
    cache = compat.dynamic_cache_from(correlated_layers(1, 40, seed=1))
    data = codec.encode(cache)
    header, sections = kvtc._unpack(data)
    for key in ("layer_tokens", "windows", "coded_layers"):
        del header[key]
    header["raw"], header["sections"] = header["raw"][:3], header["sections"][:3]
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    body = struct.pack("<4sHHI", kvtc.MAGIC, 1, 0, len(hbytes)) + hbytes + b"".join(sections[:3])
    old = body + struct.pack("<I", zlib.crc32(body))
    assert 1 in kvtc.READABLE_VERSIONS and kvtc.FORMAT_VERSION == 2
    for (k1, v1), (k2, v2) in zip(
        compat.cache_tensors(codec.decode(data)),
        compat.cache_tensors(codec.decode(old)),
        strict=True,
    ):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert codec.inspect(old).whole_bytes == 0


def test_a_kvtc_budget_on_a_hybrid_model_is_a_share_of_its_global_layers(tiny_gemma) -> None:
    """``kvtc@1/4`` on Gemma 3: the coded layers land near a quarter of their fp16 bytes, the
    windows stored whole on top (the registry's docstring)."""
    from kvlib.caches import registry
    from kvlib.eval import capture

    g = torch.Generator().manual_seed(0)
    chunks = [
        capture.capture_kv(tiny_gemma.model, torch.randint(0, 128, (1, 64), generator=g))
        for _ in range(16)
    ]
    layers = [
        (torch.cat([c[i][0] for c in chunks]), torch.cat([c[i][1] for c in chunks]))
        for i in range(6)
    ]
    basis = pca.fit_basis(layers, cross_layer=True, coded_layers=[5], skip_tokens=2)
    cache = compat.prefill_cache(tiny_gemma, torch.randint(0, 128, (1, 400), generator=g))
    codec = registry.make_cache("kvtc@1/4", tiny_gemma.config, basis=basis, tokens=400)
    data = codec.encode(cache)
    info = codec.inspect(data)
    coded_share = (len(data) - info.whole_bytes) / info.coded_fp16_bytes
    assert 0.2 < coded_share <= 0.25, coded_share
    assert info.whole_bytes > 0.8 * 2 * sum(
        2 * k.numel() for k, _ in compat.cache_tensors(cache)[:5]
    )
