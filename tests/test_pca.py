"""kvlib.kvtc.pca: fitting a basis on synthetic keys/values, its features, persistence, bad inputs.

The codec that uses the basis is tested in test_kvtc.py.
"""

from __future__ import annotations

import pytest
import torch
from _synthetic_kv import correlated_layers

from kvlib.kvtc import pca


@pytest.mark.parametrize("cross_layer", [True, False])
def test_basis_finds_the_low_rank_structure(cross_layer) -> None:
    basis = pca.fit_basis(correlated_layers(24, 64), cross_layer=cross_layer)
    assert basis.cross_layer is cross_layer
    assert len(basis.blocks) == (1 if cross_layer else 2)
    for kind in ("keys", "values"):
        explained = basis.explained_variance(kind)
        # a rank-6 mix plus 0.05 noise: per layer block the same 6 directions carry the energy
        n = 6 if cross_layer else 12
        assert explained[n - 1] > 0.98, explained[:n]
        assert explained[0] < 0.9  # more than one direction is needed
    for comps in basis.components:
        eye = comps.T @ comps
        assert torch.allclose(eye, torch.eye(eye.shape[0]), atol=1e-4)  # orthonormal columns
    assert basis.calib_tokens > 0 and basis.meta["heldout_tokens"] > 0


def test_features_and_unfeatures_are_inverse_with_rope() -> None:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    basis = pca.fit_basis(correlated_layers(4, 32), cross_layer=True, inv_freq=inv_freq)
    layers = correlated_layers(2, 10, seed=4)
    positions = torch.arange(5, 15)
    feats = basis.features(layers, positions)
    assert [f.shape for f in feats] == [(20, 32), (20, 32)]  # (batch · seq, layers · heads · hd)
    back = basis.unfeatures(feats, 2, positions, torch.float32)
    for (k, v), (k2, v2) in zip(layers, back, strict=True):
        assert torch.allclose(k2, k, atol=1e-5) and torch.equal(v2, v)
    # keys are de-rotated in feature space: without RoPE the features differ
    plain = pca.fit_basis(correlated_layers(4, 32), cross_layer=True)
    assert not torch.allclose(plain.features(layers, positions)[0], feats[0], atol=1e-3)


def test_truncate_moves_variance_to_the_residual() -> None:
    basis = pca.fit_basis(correlated_layers(8, 32), cross_layer=False)
    small = basis.truncate(3)
    assert all(c.shape[1] == 3 for c in small.components)
    for v, r, v2, r2 in zip(
        basis.variances, basis.residual, small.variances, small.residual, strict=True
    ):
        assert float(v.double().sum()) + r == pytest.approx(float(v2.double().sum()) + r2)
    assert small.nbytes() < basis.nbytes()
    assert small.fingerprint() != basis.fingerprint()


def test_save_load_round_trip(tmp_path) -> None:
    basis = pca.fit_basis(correlated_layers(8, 32), cross_layer=True, inv_freq=torch.ones(4))
    basis.meta["model"] = "synthetic"
    path = tmp_path / "b.safetensors"
    basis.save(path)
    back = pca.KVPCABasis.load(path)
    assert back.fingerprint() == basis.fingerprint()
    for a, b in zip(
        [*basis.components, *basis.means, *basis.variances],
        [*back.components, *back.means, *back.variances],
        strict=True,
    ):
        assert torch.equal(a, b)
    assert torch.equal(back.inv_freq, basis.inv_freq)
    assert torch.equal(back.unit_distortion, basis.unit_distortion)
    assert (back.blocks, back.residual, back.meta) == (basis.blocks, basis.residual, basis.meta)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="safetensors"):
        pca.KVPCABasis.load(tmp_path / "bad.safetensors")
    with pytest.raises(FileNotFoundError):
        pca.KVPCABasis.load(tmp_path / "missing.safetensors")


def test_bad_fit_inputs() -> None:
    with pytest.raises(ValueError, match="max_components"):
        pca.fit_basis(correlated_layers(4, 16), max_components=0)
    with pytest.raises(ValueError, match="skip_tokens"):
        pca.fit_basis(correlated_layers(4, 16), skip_tokens=16)
    with pytest.raises(ValueError, match="holdout_every"):
        pca.fit_basis(correlated_layers(4, 16), holdout_every=1)
    with pytest.raises(ValueError, match="layers"):
        pca.fit_basis([])
    with pytest.raises(ValueError, match="max_components"):
        pca.fit_basis(correlated_layers(4, 16)).truncate(0)
    with pytest.raises(ValueError, match="kind"):
        pca.fit_basis(correlated_layers(4, 16)).explained_variance("queries")
