"""kvlib.eval.capacity: what fits in a memory budget, predicted (capped at the model's maximum
context) and measured, with out-of-memory caught and memory released."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import memory
from kvlib.caches.registry import cache_factory, cache_info, reference_name
from kvlib.eval import capacity
from kvlib.specs import get_spec

FP16 = reference_name(torch.float16)  # the reference for the fp16 predictions
FP32 = reference_name(torch.float32)  # the bundled model computes in fp32


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- predicted ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec_name", "budget"),
    [("smollm2-1.7b", 3.6e9), ("llama-3.2-3b", 15e9), ("qwen2.5-0.5b", 15e9)],
)
def test_what_fits_prediction_matches_kvlib_memory(spec_name, budget):
    rows = capacity.what_fits(spec_name, budget, [FP16, "quanto-int4", "kvlib-int2"])
    spec = get_spec(spec_name)
    for row in rows:
        info = cache_info(row.cache)
        bits = info.cache_bits(16)
        group = info.group_size if bits < 16 else None
        memory_only = memory.max_context(spec, budget, bits=bits, group_size=group)
        assert row.predicted_max_context == min(memory_only, spec.max_position_embeddings)
        assert ("capped" in row.note) == (memory_only > spec.max_position_embeddings)
        assert row.predicted_max_batch == memory.max_batch(
            spec, budget, 8192, bits=bits, group_size=group
        )
        assert row.measured_max_context is None and row.measured_max_batch is None
    ref, q4, q2 = rows
    assert ref.bits == 16 and q4.bits == 4 and q2.bits == 2
    assert ref.predicted_max_context <= q4.predicted_max_context <= q2.predicted_max_context
    assert ref.predicted_max_batch <= q4.predicted_max_batch <= q2.predicted_max_batch


def test_what_fits_caps_the_context_at_the_models_maximum():
    """2 GB hold far more than SmolLM2-135M's 8192 positions: the prediction and the measured
    search stop there, and the row says so; without a known maximum nothing is capped."""
    spec = get_spec("smollm2-135m")
    budget = 2e9
    memory_only = memory.max_context(spec, budget, bits=16)
    assert memory_only > 8 * spec.max_position_embeddings
    contexts = []

    def runner(name, context, batch):
        if batch == 1:
            contexts.append(context)
        return 0

    (row,) = capacity.what_fits(spec, budget, [FP16], runner=runner, max_probes=12)
    assert row.predicted_max_context == spec.max_position_embeddings == 8192
    assert row.note == "context capped at the model's maximum (8192 tokens)"
    assert max(contexts) == 8192 and row.measured_max_context == 8192
    assert row.context_resolution == 0

    (free,) = capacity.what_fits(replace(spec, max_position_embeddings=None), budget, [FP16])
    assert free.predicted_max_context == memory_only and free.note == ""


# -- the search --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    limit=st.integers(0, 5000),
    guess=st.integers(1, 20000),
    step=st.sampled_from([1, 7, 64]),
    upper=st.none() | st.integers(0, 8000),
)
def test_search_max_finds_the_threshold(limit, guess, step, upper):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= limit

    found, resolution = capacity.search_max(fits, guess, step=step, max_probes=64, upper=upper)
    assert found % step == 0 and found <= limit
    assert all(c % step == 0 and c >= step for c in calls)
    top = None if upper is None else upper // step * step
    if top is not None:
        assert all(c <= top for c in calls)
    if top is not None and top <= limit:  # the cap fits: that is the answer, no failure seen
        assert found == top and resolution == 0
    elif limit >= step:  # a failure above was seen and the gap closed to one step
        assert resolution == step and limit - found < step
    else:
        assert found == 0


# -- measured, out-of-memory handled -----------------------------------------------------------


def test_oom_is_reported_as_does_not_fit_and_memory_released(monkeypatch):
    """A fake runner raises torch.OutOfMemoryError past a size; what_fits keeps going, every
    failure is followed by a release, and the measured limits are the fake's thresholds."""
    released = []
    monkeypatch.setattr(capacity, "release_memory", lambda device=None: released.append(device))
    spec = replace(get_spec("smollm2-135m"), max_position_embeddings=None)
    budget = 2e9
    predicted = memory.max_context(spec, budget, bits=16)
    limit_ctx, limit_batch = predicted - 3000, 3
    calls, failures = [], []

    def runner(name, context, batch):
        calls.append((name, context, batch))
        if (batch == 1 and context > limit_ctx) or batch > limit_batch or name == "quanto-int2":
            failures.append((name, context, batch))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (fake)")
        return 0

    rows = capacity.what_fits(
        spec, budget, [FP16, "quanto-int2"], runner=runner, context_step=256, max_probes=12
    )
    ref, q2 = rows
    assert failures and len(released) >= len(calls)
    assert ref.measured_max_context == (limit_ctx // 256) * 256
    assert ref.measured_max_batch == limit_batch and ref.batch_resolution == 1
    assert q2.measured_max_context == 0 and q2.measured_max_batch == 0  # "does not fit"


def test_non_oom_errors_are_not_swallowed():
    def runner(name, context, batch):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        capacity.what_fits("smollm2-135m", 1e9, [FP16], runner=runner)
    assert capacity.is_oom(torch.OutOfMemoryError("x"))
    assert capacity.is_oom(RuntimeError("CUDA error: out of memory"))
    assert not capacity.is_oom(ValueError("out of memory"))


def test_what_fits_rejects_bad_caches():
    with pytest.raises(TypeError, match="list of cache names"):
        capacity.what_fits("smollm2-135m", 1e9, FP16)
    with pytest.raises(ValueError, match="unknown cache"):
        capacity.what_fits("smollm2-135m", 1e9, ["dynamic"])


def test_measuring_without_cuda_needs_a_runner(model):
    with pytest.raises(ValueError, match="needs CUDA"):
        capacity.what_fits(model, 1e9, [FP32], measure=True)
    with pytest.raises(ValueError, match="CUDA"):
        with capacity.memory_limit(1e9, "cpu"):
            pass


def test_fill_and_step_and_simulated_budget(model):
    nbytes = capacity.fill_and_step(model, cache_factory(FP32, model.config), 40, 2)
    spec = get_spec("smollm2-135m")
    assert nbytes == memory.kv_cache_bytes(spec, 41, batch_size=2, bits=32)  # + decode token
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = memory.kv_bytes_per_token(spec, bits=32)
    budget = weights + 300 * per_token
    runner = capacity.simulated_budget_runner(model, budget)
    rows = capacity.what_fits(
        model, budget, [FP32], dtype_bits=32, runner=runner, context_step=64, max_probes=6
    )
    (row,) = rows
    assert row.predicted_max_context == 300 and row.note == ""
    # the decode step adds one token: 256 + 1 fits, 320 + 1 does not
    assert row.measured_max_context == 256 and row.context_resolution == 64


def test_fill_or_none_catches_oom(model, monkeypatch):
    assert capacity.fill_or_none(model, FP32, 8, 1) == memory.kv_cache_bytes(
        get_spec("smollm2-135m"), 9, bits=32
    )

    def boom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    monkeypatch.setattr(capacity, "fill_and_step", boom)
    assert capacity.fill_or_none(model, FP32, 8, 1) is None
