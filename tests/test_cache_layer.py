"""kvlib.caches.base: the state check and the batch operations every kvlib cache layer shares."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.caches.base import check_states, row_indices
from kvlib.caches.eviction.cache import EvictionLayer
from kvlib.caches.kvquant import KVQuantLayer
from kvlib.caches.quantized import QuantizedKVLayer
from kvlib.caches.sliding import SlidingWindowLayer
from kvlib.caches.turboquant import TurboQuantLayer
from kvlib.quant.kvquant import KVQuantizer
from kvlib.quant.turboquant import TurboQuantizer

LAYERS = {
    "quantized": lambda: QuantizedKVLayer(4, 4, group_size=16, residual_length=16, sink_tokens=2),
    "eviction": lambda: EvictionLayer("knorm", 24),
    "eviction-int4": lambda: EvictionLayer("knorm", 24, bits=4, group_size=16),
    "sliding": lambda: SlidingWindowLayer(20),
    "turboquant": lambda: TurboQuantLayer(TurboQuantizer(32, 3, 3)),
    "turboquant-window": lambda: TurboQuantLayer(
        TurboQuantizer(32, 2, 4), sink_tokens=2, residual_length=16, center_keys=True
    ),
    "kvquant": lambda: KVQuantLayer(
        KVQuantizer(32, 3, 2), 1 / 10_000 ** (torch.arange(16) / 16), 1.0, 2, 16
    ),
}


def _filled(make, k: torch.Tensor, v: torch.Tensor):
    layer = make()
    for start in range(0, k.shape[2], 10):  # prefill, then chunks: blocks, windows, evictions
        layer.update(k[:, :, start : start + 10], v[:, :, start : start + 10])
    return layer


@pytest.mark.parametrize("kind", LAYERS)
@settings(max_examples=15, deadline=None)
@given(mask=st.lists(st.booleans(), min_size=4, max_size=4).filter(any), seed=st.integers(0, 99))
def test_a_boolean_mask_keeps_the_rows_its_indices_keep(kind, mask, seed):
    """Every layer's batch_select_indices takes a mask or its indices alike, and keeps exactly
    what a layer fed only those rows holds (tokens stored once are not re-quantized)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 4, 2, 50, 32, generator=gen)
    keep = torch.tensor(mask)
    by_mask, by_index = _filled(LAYERS[kind], k, v), _filled(LAYERS[kind], k, v)
    by_mask.batch_select_indices(keep)
    by_index.batch_select_indices(keep.nonzero().flatten())
    alone = _filled(LAYERS[kind], k[keep], v[keep])
    probe = torch.zeros(int(keep.sum()), 2, 1, 32)
    want_k, want_v = alone.update(probe, probe)
    for layer in (by_mask, by_index):
        assert layer.batch_size == int(keep.sum())
        got_k, got_v = layer.update(probe, probe)
        torch.testing.assert_close(got_k, want_k)
        torch.testing.assert_close(got_v, want_v)


@pytest.mark.parametrize("kind", LAYERS)
def test_repeat_interleave_repeats_rows_and_reorder_permutes(kind):
    k, v = torch.randn(2, 2, 2, 30, 32, generator=torch.Generator().manual_seed(0))
    layer = _filled(LAYERS[kind], k, v)
    layer.batch_repeat_interleave(3)
    assert layer.batch_size == 6
    layer.reorder_cache(torch.tensor([5, 0, 3, 1, 4, 2]))
    got_k, _ = layer.update(torch.zeros(6, 2, 1, 32), torch.zeros(6, 2, 1, 32))
    torch.testing.assert_close(got_k[0], got_k[4])  # rows 5 and 4 both came from row 1
    torch.testing.assert_close(got_k[1], got_k[5])  # rows 0 and 2 both came from row 0
    assert not torch.equal(got_k[0], got_k[1])


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize(
    "k, v, match",
    [
        (torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), "4-d floating tensor"),
        (torch.zeros(1, 2, 3, 8, dtype=torch.int64), torch.zeros(1, 2, 3, 8), "key_states must"),
        ([[0.0]], torch.zeros(1, 2, 3, 8), "key_states must be a 4-d"),
        (torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 4, 16), "the same shape"),
    ],
)
def test_every_layer_refuses_bad_states_clearly(kind, k, v, match):
    with pytest.raises(ValueError, match=match):
        LAYERS[kind]().update(k, v)


def test_row_indices_and_check_states_directly():
    assert row_indices([True, False, True], torch.device("cpu")).tolist() == [0, 2]
    assert row_indices([2, 2, 0], torch.device("cpu")).dtype == torch.int64
    check_states(torch.zeros(1, 1, 0, 4), torch.zeros(1, 1, 0, 4))  # an empty chunk is fine


CODED = ("turboquant", "turboquant-window", "kvquant")


@pytest.mark.parametrize("kind", CODED)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_model_reads_the_float32_past_rounded_once(kind, dtype):
    """The coded layers write each part of what attention reads straight into one tensor of
    the model's dtype. A float32 model and a half-precision one store the same float16 tokens
    (states exact in ``dtype``), so the half-precision model must read the float32 model's past
    rounded once to its dtype: decoded in float32, then cast, never computed in half
    precision."""
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, 1, 2, 70, 32, generator=gen) * 3).to(dtype).float()
    wide, narrow = _filled(LAYERS[kind], k, v), _filled(LAYERS[kind], k.to(dtype), v.to(dtype))
    probe = torch.randn(1, 2, 1, 32, generator=gen).to(dtype)
    want_k, want_v = wide.update(probe.float(), probe.float())
    got_k, got_v = narrow.update(probe, probe)
    assert got_k.dtype == got_v.dtype == dtype and got_k.shape == want_k.shape
    assert torch.equal(got_k, want_k.to(dtype)) and torch.equal(got_v, want_v.to(dtype))
    wide_k, _ = wide.dequantized()
    assert torch.equal(narrow.dequantized()[0], wide_k.to(dtype))
