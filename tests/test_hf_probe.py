"""kvlib.caches.hf_probe: what transformers' quantized layers do, measured through their quantizer."""

import pytest
import torch
from transformers import cache_utils

from kvlib.caches import hf_probe


@pytest.fixture
def keys():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 3, 128, 64, generator=g)


def quanto(**kw):
    return cache_utils.QuantoQuantizedLayer(nbits=4, q_group_size=64, **kw)


@pytest.mark.parametrize(("axis", "grouping"), [(0, "per-token"), (-1, "per-channel")])
def test_quanto_axes_group_as_measured_in_notebook_04(keys, axis, grouping):
    layer = quanto(axis_key=axis, axis_value=axis)
    layer.lazy_initialization(keys, keys)
    spread = hf_probe.outlier_spread(layer, keys, axis)
    assert spread.grouping == grouping
    # 384 token vectors of 64 channels: 384 scales either way, laid out along different axes
    assert sorted(hf_probe.scale_shape(layer, keys, axis)) == [1, 384]


def test_roundtrip_is_close_but_lossy(keys):
    layer = quanto()
    layer.lazy_initialization(keys, keys)
    back = hf_probe.roundtrip(layer, keys, 0)
    assert back.shape == keys.shape
    rel = float((back - keys).norm() / keys.norm())
    assert 0 < rel < 0.2  # 4 bits per token vector of 64 channels


@pytest.mark.parametrize(("prompt", "total", "window"), [(64, 256, 64), (20, 150, 50)])
def test_replay_counts_every_requantization(prompt, total, window):
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 1, 2, total, 64, generator=g)
    seen = hf_probe.replay_requantization(quanto(residual_length=window), k, v, prompt=prompt)
    # the prefill once, then at each flush the whole history again (keys and values)
    flushes = range(prompt + window, total + 1, window)
    assert seen.tokens_quantized == 2 * (prompt + sum(flushes))
    assert len(seen.prompt_errors) == 1 + len(flushes)
    # per-token groups: a de-quantized token re-quantizes onto its own grid, so the error stays
    assert max(seen.prompt_errors) - min(seen.prompt_errors) < 1e-3


def test_replay_leaves_the_layer_class_untouched():
    layer = quanto(residual_length=16)
    k = torch.randn(1, 1, 40, 64)
    hf_probe.replay_requantization(layer, k, k.clone(), prompt=8)
    assert "_quantize" not in vars(layer)  # the counting wrapper was removed


def test_bad_input_is_refused_clearly(keys):
    with pytest.raises(TypeError, match="_quantize"):
        hf_probe.roundtrip(cache_utils.DynamicLayer(), keys, 0)
    with pytest.raises(ValueError, match="prompt"):
        hf_probe.replay_requantization(quanto(), keys, keys, prompt=128)
    with pytest.raises(ValueError, match="same 4-d shape"):
        hf_probe.replay_requantization(quanto(), keys, keys[:, :, :10], prompt=4)
    with pytest.raises(ValueError, match="7 tokens"):
        hf_probe.outlier_spread(quanto(), keys[:, :, :3], 0)
