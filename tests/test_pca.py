"""kvlib.bitalloc and kvlib.pca: allocation vs brute force, codec round trips, bad bytes."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import kvlib
from kvlib import compat, pca
from kvlib.bitalloc import GAUSSIAN_UNIFORM_DISTORTION, allocate_bits, allocate_bits_dp


def _brute(table: torch.Tensor, budget: int) -> float:
    n, nb = table.shape
    best = float("inf")
    for bits in itertools.product(range(nb), repeat=n):
        if sum(bits) <= budget:
            best = min(best, float(sum(table[j, b] for j, b in enumerate(bits))))
    return best


@settings(max_examples=40, deadline=None)
@given(
    var=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=4),
    budget=st.integers(0, 14),
    max_bits=st.integers(1, 4),
)
def test_greedy_matches_brute_force(var, budget, max_bits) -> None:
    v = torch.tensor(var, dtype=torch.float64)
    c = torch.tensor(GAUSSIAN_UNIFORM_DISTORTION[: max_bits + 1], dtype=torch.float64)
    table = v[:, None] * c[None]
    bits = allocate_bits(v, budget, max_bits=max_bits, unit_distortion=c)
    assert int(bits.sum()) <= budget and int(bits.max()) <= max_bits
    got = float(table[torch.arange(len(var)), bits].sum())
    assert got == pytest.approx(_brute(table, budget), rel=1e-9, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 4),
    nb=st.integers(1, 4),
    budget=st.integers(0, 12),
)
def test_dp_matches_brute_force_on_any_table(seed, n, nb, budget) -> None:
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(n, nb, generator=g, dtype=torch.float64)
    bits = allocate_bits_dp(table, budget)
    assert int(bits.sum()) <= budget
    assert float(table[torch.arange(n), bits].sum()) == pytest.approx(
        _brute(table, budget), rel=1e-9
    )


def test_rope_undo_redo_exact_inverse() -> None:
    k = torch.randn(1, 3, 50, 64)
    inv = 1.0 / (100000.0 ** (torch.arange(0, 64, 2).float() / 64))
    pos = torch.arange(100, 150)
    back = pca.undo_rope(pca.apply_rope(k, pos, inv), pos, inv)
    assert torch.allclose(back, k, atol=1e-5)


def _correlated(batch: int, seq: int, layers: int = 2, heads: int = 2, hd: int = 8, seed: int = 0):
    """Random layers whose features are a fixed low-rank Gaussian mix plus small noise."""
    g = torch.Generator().manual_seed(123)
    dim = layers * heads * hd
    mix = torch.randn(6, dim, generator=g) * torch.linspace(3, 0.5, 6)[:, None]
    g2 = torch.Generator().manual_seed(seed)
    out = []
    feats = [
        torch.randn(batch * seq, 6, generator=g2) @ mix
        + 0.05 * torch.randn(batch * seq, dim, generator=g2)
        for _ in range(2)
    ]
    for i in range(layers):
        kv = []
        for f in feats:
            x = f[:, i * heads * hd : (i + 1) * heads * hd].reshape(batch, seq, heads, hd)
            kv.append(x.permute(0, 2, 1, 3).contiguous())
        out.append(tuple(kv))
    return out


def _mid_mse(a: DynamicCache, b: DynamicCache, sink: int, recent: int) -> float:
    errs = []
    for (k1, v1), (k2, v2) in zip(pca.cache_tensors(a), pca.cache_tensors(b), strict=True):
        end = k1.shape[2] - recent
        errs += [
            ((k1 - k2)[:, :, sink:end] ** 2).flatten(),
            ((v1 - v2)[:, :, sink:end] ** 2).flatten(),
        ]
    return float(torch.cat(errs).double().mean())


@pytest.mark.parametrize("cross_layer", [True, False])
@pytest.mark.parametrize("compression", [3.0, 6.0])
def test_random_cache_round_trip_within_predicted_error(cross_layer, compression) -> None:
    basis = pca.fit_basis(_correlated(24, 64), cross_layer=cross_layer)
    codec = pca.KVTCCodec(basis, compression=compression, sink_tokens=2, recent_tokens=8)
    cache = DynamicCache(ddp_cache_data=_correlated(2, 200, seed=7))
    out = codec.decode(codec.encode(cache))
    measured = _mid_mse(cache, out, 2, 8)
    predicted = codec.predicted_mse()
    assert 0.6 * predicted <= measured <= 1.4 * predicted, (measured, predicted)
    for (k1, v1), (k2, v2) in zip(pca.cache_tensors(cache), pca.cache_tensors(out), strict=True):
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
    cache = pca.prefill_cache(model, prefix)
    codec = pca.KVTCCodec(real_basis, compression=6.0, recent_tokens=64)
    data = codec.encode(cache)
    info = codec.inspect(data)
    assert info.seq_len == 300 and info.compressed_tokens == 300 - 4 - 64
    assert info.compression_ratio() > 2.0
    out = codec.decode(data)
    measured = _mid_mse(cache, out, 4, 64)
    assert 0.5 * codec.predicted_mse() <= measured <= 2.0 * codec.predicted_mse()
    ref = pca.continuation_perplexity(model, pca.clone_cache(cache), nxt)
    got = pca.continuation_perplexity(model, out, nxt)
    assert out.get_seq_length() == 364
    assert abs(got / ref - 1) < 0.25, (got, ref)
    assert real_basis.nbytes() > 0


def test_save_load_round_trip(tmp_path) -> None:
    basis = pca.fit_basis(_correlated(8, 32), cross_layer=True, inv_freq=torch.ones(4))
    path = tmp_path / "b.safetensors"
    basis.save(path)
    back = pca.KVPCABasis.load(path)
    assert back.fingerprint() == basis.fingerprint()
    for a, b in zip(basis.components, back.components, strict=True):
        assert torch.equal(a, b)
    cache = DynamicCache(ddp_cache_data=_correlated(1, 40, seed=3))
    data = pca.KVTCCodec(basis, compression=4.0, recent_tokens=4).encode(cache)
    assert pca.KVTCCodec(back, compression=4.0, recent_tokens=4).decode(data).get_seq_length() == 40
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="safetensors"):
        pca.KVPCABasis.load(tmp_path / "bad.safetensors")


def test_corrupted_or_truncated_bytes_rejected() -> None:
    basis = pca.fit_basis(_correlated(8, 32), cross_layer=False)
    codec = pca.KVTCCodec(basis, compression=4.0, recent_tokens=4)
    data = codec.encode(DynamicCache(ddp_cache_data=_correlated(1, 40, seed=1)))
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
    other = pca.fit_basis(_correlated(8, 32, seed=5), cross_layer=False)
    with pytest.raises(ValueError, match="different PCA basis"):
        pca.KVTCCodec(other).decode(data)
    with pytest.raises(TypeError, match="bytes"):
        codec.decode("text")  # type: ignore[arg-type]


def test_bad_inputs() -> None:
    basis = pca.fit_basis(_correlated(8, 32), cross_layer=True)
    with pytest.raises(ValueError, match="budget_bits"):
        allocate_bits(torch.ones(3), -1)
    with pytest.raises(ValueError, match="positions"):
        pca.undo_rope(torch.randn(1, 1, 4, 8), torch.arange(3), torch.ones(4))
    with pytest.raises(ValueError, match="compression"):
        pca.KVTCCodec(basis, compression=0.5)
    with pytest.raises(TypeError, match="KVPCABasis"):
        pca.KVTCCodec("basis")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="DynamicCache"):
        pca.KVTCCodec(basis).encode(torch.zeros(3))
    wrong = DynamicCache(ddp_cache_data=_correlated(1, 20, layers=3))
    with pytest.raises(ValueError, match="basis was fitted"):
        pca.KVTCCodec(basis).encode(wrong)
    with pytest.raises(ValueError, match="max_components"):
        pca.fit_basis(_correlated(4, 16), max_components=0)
    with pytest.raises(TypeError):
        pca.prefill_cache(None, [1, 2])  # type: ignore[arg-type]
    from transformers import LlamaForCausalLM

    assert compat.cache_kwarg() in inspect.signature(LlamaForCausalLM.forward).parameters
