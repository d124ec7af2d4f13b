"""Tests for kvlib.eval.serving: the seeded trace and the serving simulation's waste and invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.caches.blocks import blocks_needed
from kvlib.eval.serving import Request, ServingStats, make_trace, simulate_serving

# --- serving simulation -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace():
    return make_trace(250, seed=0)


def test_make_trace_is_seeded_and_bounded(trace):
    again = make_trace(250, seed=0)
    assert trace == again and make_trace(250, seed=1) != trace
    assert all(4 <= r.prompt_len and r.output_len >= 1 for r in trace)
    assert all(r.prompt_len + r.output_len <= 2048 for r in trace)
    arrivals = [r.arrival for r in trace]
    assert arrivals == sorted(arrivals)
    with pytest.raises(ValueError, match="num_requests"):
        make_trace(0)
    with pytest.raises(ValueError, match="arrival_rate"):
        make_trace(3, arrival_rate=-1.0)


def test_simulation_targets(trace):
    cap = 2**30 // 4  # 256 MiB: memory is the bottleneck
    stats = {p: simulate_serving(trace, cap, p) for p in ("contiguous-max", "contiguous-exact")}
    for bs in (8, 16, 32):
        stats[f"paged{bs}"] = simulate_serving(trace, cap, "paged", block_size=bs)
    for s in stats.values():
        assert isinstance(s, ServingStats) and s.completed == len(trace)
        assert 0.0 <= s.waste_fraction < 1.0 and s.peak_concurrent >= 1
        assert all(u <= r <= s.capacity_tokens for u, r in zip(s.used, s.reserved, strict=True))
    assert stats["paged16"].waste_fraction <= 0.04
    assert stats["contiguous-max"].waste_fraction >= 0.30
    assert (
        stats["paged8"].waste_fraction
        < stats["paged16"].waste_fraction
        < stats["paged32"].waste_fraction
    )
    assert stats["contiguous-max"].waste_fraction > stats["contiguous-exact"].waste_fraction
    assert stats["paged16"].peak_concurrent > 2 * stats["contiguous-max"].peak_concurrent
    assert stats["paged16"].throughput > stats["contiguous-max"].throughput
    assert stats["contiguous-max"].preemptions == 0


def test_simulation_prefix_sharing_helps():
    trace = make_trace(80, seed=0, num_samples=4)
    cap = 2**30 // 4
    plain = simulate_serving(trace, cap, "paged", share_prefix=False)
    shared = simulate_serving(trace, cap, "paged", share_prefix=True)
    assert plain.completed == shared.completed == 80
    assert shared.mean_concurrent > plain.mean_concurrent


def test_simulation_bad_input(trace):
    with pytest.raises(ValueError, match="policy must be one of"):
        simulate_serving(trace, 2**30, "lru")
    with pytest.raises(ValueError, match="share_prefix"):
        simulate_serving(trace, 2**30, "contiguous-max", share_prefix=True)
    with pytest.raises(ValueError, match="capacity"):
        simulate_serving(trace, 10_000, "contiguous-max")  # one 2048-token buffer does not fit
    with pytest.raises(ValueError, match="empty"):
        simulate_serving([], 2**30, "paged")


def test_make_trace_follows_its_stated_distributions():
    trace = make_trace(4000, seed=3, arrival_rate=2.0, prompt_median=100, output_median=200)
    prompts = sorted(r.prompt_len for r in trace)
    outputs = sorted(r.output_len for r in trace)
    assert 90 <= prompts[len(prompts) // 2] <= 110
    assert 180 <= outputs[len(outputs) // 2] <= 220
    gaps = [b.arrival - a.arrival for a, b in zip(trace, trace[1:], strict=False)]
    assert 0.45 <= sum(gaps) / len(gaps) <= 0.55  # Poisson at 2 requests per step


@settings(max_examples=60, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 20), st.integers(1, 20), st.integers(1, 3)),
        min_size=1,
        max_size=8,
    ),
    policy=st.sampled_from(["contiguous-max", "contiguous-exact", "paged", "paged-shared"]),
    block_size=st.sampled_from([1, 2, 3, 4, 8]),
    extra=st.integers(0, 40),
)
def test_simulation_invariants_on_random_traces(reqs, policy, block_size, extra):
    """Tight pools force preemption; every request still completes and the books balance."""
    trace = [Request(i, float(a), p, o, n) for i, (a, p, o, n) in enumerate(reqs)]
    share = policy == "paged-shared"
    policy = "paged" if share else policy
    max_len = 48
    per = {
        "contiguous-max": lambda r: max_len * r.num_samples,
        "contiguous-exact": lambda r: (r.prompt_len + r.output_len) * r.num_samples,
        "paged": lambda r: (
            blocks_needed(r.prompt_len + r.output_len, block_size) * block_size * r.num_samples
        ),
    }[policy]
    cap = max(per(r) for r in trace) + extra  # the largest request just fits alone
    s = simulate_serving(
        trace,
        cap,
        policy,
        block_size,
        bytes_per_token=1,
        max_len=max_len,
        max_num_seqs=4,
        share_prefix=share,
    )
    assert s.completed == len(trace) and s.capacity_tokens == cap
    assert 0.0 <= s.waste_fraction < 1.0 and 1 <= s.peak_concurrent <= 4
    assert len(s.used) == len(s.reserved) == len(s.concurrent) == len(s.finished) == s.makespan
    assert s.finished == sorted(s.finished) and s.finished[-1] == len(trace)
    assert all(u <= r <= cap for u, r in zip(s.used, s.reserved, strict=True))
    assert max(s.concurrent) == s.peak_concurrent
    assert s.makespan >= max(r.arrival + r.output_len for r in trace)
    if policy != "paged":
        assert s.preemptions == 0
