"""Token eviction in the planner: offered (never chosen) when a request does not fit — the
budget rule (kvlib.plan.eviction), the decision's field, the line citing the eviction run, and
the CLI."""

from __future__ import annotations

import dataclasses
import json
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import memory, specs
from kvlib.cli import main
from kvlib.plan import engines
from kvlib.plan import suggestions as plan_suggestions
from kvlib.plan import text as plan_text
from kvlib.plan.eviction import EVICTION_KEEP, evictable, eviction_option
from kvlib.plan.fallbacks import fallbacks
from kvlib.plan.planner import recommend
from kvlib.plan.rule import decide

LLAMA8 = specs.get_spec("llama-3.1-8b")
GIB = 2**30


def _run(budgets: list[str], rows: dict, best: dict) -> dict:
    """A results mapping holding only an eviction run (figures made up for the tests)."""
    run = {
        "source": "benchmarks/bench_eviction.py",
        "command": "python benchmarks/bench_eviction.py",
        "machine": "test",
        "model": "TinyTest-1M",
        "date": "2031-01-02",
        "settings": {"tokens": 2048, "budgets": budgets},
        "rows": rows,
        "best": best,
    }
    return {"schema_version": 1, "runs": {"eviction": run}}


ROWS = {
    "dynamic-fp32": {
        "perplexity_delta_pct": 0.0,
        "retrieval_1024": 0.9,
        "retrieval_1024_ci": [0.6, 0.98],
        "retrieval_2048": 0.8,
        "retrieval_2048_ci": [0.5, 0.95],
        "retrieval_multi_1024": 0.7,
    },
    "evict-h2o-int4@1/4": {
        "perplexity_delta_pct": 0.125,
        "retrieval_1024": 0.85,
        "retrieval_1024_ci": [0.62, 0.96],
        "retrieval_1024_trials": 20,
        "retrieval_2048": 0.45,
        "retrieval_2048_ci": [0.25, 0.67],
        "retrieval_multi_1024": 0.35,
        "retrieval_multi_1024_ci": [0.15, 0.6],
    },
    "evict-tova@1/4": {
        "perplexity_delta_pct": 2.5,
        "retrieval_1024": 0.15,
        "retrieval_1024_ci": [0.05, 0.36],
    },
}
BEST = {"1/4 eviction+int4": "evict-h2o-int4@1/4", "1/4 eviction": "evict-tova@1/4"}
MEAS = _run(["1/4"], ROWS, BEST)


def _holds(budget: int, fp16_bytes: int, keep: int, n: int) -> bool:
    """n sequences each keeping 1/keep of fp16_bytes fit in budget."""
    return n * max(1, memory.budget_bytes(fp16_bytes, Fraction(1, keep))) <= budget


# -------------------------------------------------------------------------------- the rule


@settings(max_examples=300, deadline=None)
@given(
    budget=st.integers(1, 2**40),
    fp16_bytes=st.integers(1, 2**36),
    concurrency=st.integers(1, 256),
    status=st.sampled_from(["reduced", "impossible"]),
)
def test_the_option_is_the_largest_fraction_that_holds_every_sequence(
    budget, fp16_bytes, concurrency, status
):
    o = eviction_option(LLAMA8, budget, fp16_bytes, concurrency, status)
    holding = [k for k in EVICTION_KEEP if _holds(budget, fp16_bytes, k, concurrency)]
    if not holding:
        assert o is None
        return
    assert o is not None and o.keep == min(holding) and o.engine == "transformers"
    # what the cache keeps at a budget of 1/keep (kvlib.memory.budget_bytes rounds down)
    assert o.bytes_per_sequence == max(1, memory.budget_bytes(fp16_bytes, Fraction(1, o.keep)))
    assert o.bytes_per_sequence * o.keep <= max(fp16_bytes, o.keep)
    # the count is every sequence the budget holds at that size: one more does not fit
    assert concurrency <= o.sequences and o.sequences * o.bytes_per_sequence <= budget
    assert (o.sequences + 1) * o.bytes_per_sequence > budget
    # every larger fraction (less eviction) offered leaves some requested sequence out
    assert all(not _holds(budget, fp16_bytes, k, concurrency) for k in EVICTION_KEEP if k < o.keep)
    # a plan that holds everything gets no option, and neither do several GPUs
    assert eviction_option(LLAMA8, budget, fp16_bytes, concurrency, "ok") is None
    assert eviction_option(LLAMA8, budget, fp16_bytes, concurrency, status, tp=2) is None


def test_models_with_global_layers_and_no_mla_are_evictable():
    assert evictable(LLAMA8) and evictable(specs.get_spec("qwen2.5-7b"))
    assert evictable(specs.get_spec("gemma-2-9b"))  # sliding and global layers
    assert not evictable(specs.get_spec("mistral-7b-v0.1"))  # every layer slides: bounded
    mla = specs.get_spec("deepseek-v2-lite")
    assert not evictable(mla) and evictable(mla.without_mla())
    # what a budget holds is the same for every spec: only the model's kind decides
    assert eviction_option(mla, 10 * GIB, GIB, 4, "reduced") is None
    assert eviction_option(mla.without_mla(), 10 * GIB, GIB, 4, "reduced") is not None


# -------------------------------------------------------------------------------- the decision


def test_decide_offers_eviction_only_when_the_request_does_not_fit():
    assert decide(LLAMA8, 80, 8192, 1).eviction is None  # fp16 holds it
    assert decide(LLAMA8, 24, 32768, 4).fits and decide(LLAMA8, 24, 32768, 4).eviction is None
    d = decide(LLAMA8, 24, 32768, 5)  # q4_0 holds 4 of 5
    assert d.status == "reduced" and d.eviction is not None
    o, budget, fp16 = d.eviction, d.budget.kv_budget_bytes, d.kv_bytes_per_sequence_fp16
    # the same bytes as the plan's: the fp16 cache of one sequence, cut to 1/k
    per_sequence = memory.budget_bytes(fp16, Fraction(1, o.keep))
    assert o.bytes_per_sequence == per_sequence and o.sequences == budget // per_sequence
    assert o.sequences >= 5 and not _holds(budget, fp16, o.keep // 2, 5)
    # not one sequence fits at any bit width, yet a smaller budget holds it
    tight = decide(LLAMA8, 20, 131072, 1)
    assert tight.status == "impossible" and tight.budget.kv_budget_bytes > 0
    assert tight.eviction is not None and tight.eviction.keep > 2
    # weights leave nothing, several GPUs, or not even 1/16 holds them: no option
    assert decide(specs.get_spec("qwen2.5-7b"), 16, 8192).eviction is None
    llama70 = specs.get_spec("llama-3.1-70b")
    assert decide(llama70, 80, 32768, 16, num_gpus=2).status == "reduced"
    assert decide(llama70, 80, 32768, 16, num_gpus=2).eviction is None
    crowd = decide(LLAMA8, 24, 32768, 200)
    assert crowd.status == "reduced" and crowd.eviction is None
    assert not _holds(crowd.budget.kv_budget_bytes, crowd.kv_bytes_per_sequence_fp16, 16, 200)


def test_no_option_for_mla_models():
    d = decide(specs.get_spec("deepseek-v2-lite"), 48, 131072, 16)
    assert d.status == "reduced" and d.eviction is None
    # the same budget and bytes for a full-attention model would get one: the kind decides
    numbers = (d.budget.kv_budget_bytes, d.kv_bytes_per_sequence_fp16, d.concurrency, d.status)
    assert eviction_option(LLAMA8, *numbers) is not None


def test_a_hybrid_model_keeps_its_windows_whole_and_evicts_in_the_global_layers():
    gemma = specs.get_spec("gemma-2-9b")
    d = decide(gemma, 48, 32768, 16)
    o = d.eviction
    assert d.status == "reduced" and o is not None
    windows = memory.window_bytes(gemma, 32768)
    assert o.window_bytes == windows > 0
    fp16 = d.kv_bytes_per_sequence_fp16
    assert o.bytes_per_sequence == memory.budget_bytes(fp16, Fraction(1, o.keep), windows)
    assert o.sequences * o.bytes_per_sequence <= d.budget.kv_budget_bytes
    # a whole-cache share would have promised more than the cache can keep: the windows
    assert o.bytes_per_sequence > memory.budget_bytes(fp16, Fraction(1, o.keep))


@settings(max_examples=200, deadline=None)
@given(
    budget=st.integers(1, 2**40),
    fp16_bytes=st.integers(1, 2**36),
    window_share=st.floats(0.0, 1.0),
    concurrency=st.integers(1, 64),
)
def test_windows_kept_whole_cost_every_budget_their_bytes(
    budget, fp16_bytes, window_share, concurrency
):
    gemma = specs.get_spec("gemma-2-9b")
    windows = int(fp16_bytes * window_share)
    o = eviction_option(gemma, budget, fp16_bytes, concurrency, "reduced", 1, windows)
    plain = eviction_option(gemma, budget, fp16_bytes, concurrency, "reduced")
    if o is None:
        return
    kept = memory.budget_bytes(fp16_bytes, Fraction(1, o.keep), windows)
    assert o.bytes_per_sequence == max(1, kept)
    assert o.sequences >= concurrency and o.sequences * o.bytes_per_sequence <= budget
    # the windows never make a budget cheaper: eviction keeps at least as much of the rest
    assert plain is not None and plain.keep <= o.keep


@pytest.mark.parametrize("windows", [-1, 11])
def test_window_bytes_outside_the_cache_are_refused(windows):
    with pytest.raises(ValueError, match="window_bytes must be in"):
        eviction_option(LLAMA8, 2**30, 10, 1, "reduced", 1, windows)


# -------------------------------------------------------------------------------- the words


def _eviction_lines(d, results) -> list[str]:
    return [s for s in plan_suggestions.suggestions(d, fallbacks(d), results) if "eviction" in s]


def test_the_line_cites_the_best_int4_row_with_its_retrieval():
    d = decide(LLAMA8, 24, 32768, 5)
    assert d.eviction.fraction == "1/4"
    (line,) = _eviction_lines(d, MEAS)
    assert line == plan_suggestions.suggestions(d, fallbacks(d), MEAS)[-1]  # last: the riskiest
    assert line.startswith(
        "token eviction: the whole request with kvlib's evict-h2o-int4 at 1/4 of the fp16 bytes"
    )
    assert "on TinyTest-1M with transformers on a CPU" in line
    assert "measured 2031-01-02 by benchmarks/bench_eviction.py" in line
    assert "+0.125 % perplexity on 2,048 tokens" in line
    assert (
        "pass-key retrieval 0.85 [0.62, 0.96] vs 0.90 uncompressed at 1,024 tokens, "
        "0.45 [0.25, 0.67] vs 0.80 uncompressed at 2,048 tokens" in line
    )
    assert "multi-key retrieval 0.35 [0.15, 0.60] vs 0.70 uncompressed at 1,024 tokens" in line
    assert line.endswith("eviction drops tokens, and a dropped fact is gone")
    assert plan_suggestions.eviction_note(d, MEAS) == line


def test_on_a_hybrid_model_the_line_says_the_windows_are_kept_whole():
    d = decide(specs.get_spec("gemma-2-9b"), 48, 32768, 16)
    line = plan_suggestions.eviction_note(d, _run([d.eviction.fraction], ROWS, {}))
    assert line.startswith(
        f"token eviction: the whole request with kvlib's evict-<policy>-int4 caches at "
        f"{d.eviction.fraction} of the global layers' fp16 bytes per sequence, the sliding "
        "windows kept whole in fp16"
    )
    full = plan_suggestions.eviction_note(decide(LLAMA8, 24, 32768, 5), MEAS)
    assert "global layers" not in full and "kept whole" not in full


def test_the_line_reads_the_mean_over_segments_when_the_run_has_them():
    d = decide(LLAMA8, 24, 32768, 5)
    row = ROWS["evict-h2o-int4@1/4"] | {
        "perplexity_delta_pct_segments": [0.125, 0.5, 0.375],
        "perplexity_delta_pct_mean": 1 / 3,
    }
    line = plan_suggestions.eviction_note(
        d, _run(["1/4"], ROWS | {"evict-h2o-int4@1/4": row}, BEST)
    )
    assert "+0.333 % perplexity (mean on 3 × 2,048 tokens)" in line
    assert "+0.125 %" not in line


def test_the_line_falls_back_to_float_eviction_and_quality_max_uses_it():
    d = decide(LLAMA8, 24, 32768, 5)
    no_int4 = _run(["1/4"], ROWS, {"1/4 eviction": "evict-tova@1/4"})
    line = plan_suggestions.eviction_note(d, no_int4)
    assert "kvlib's evict-tova at 1/4" in line and "+2.5 % perplexity" in line
    assert "pass-key retrieval 0.15 [0.05, 0.36] vs 0.90 uncompressed at 1,024" in line
    # quality="max" forbids quantized storage: float eviction even where int4 was measured
    fp16_only = decide(LLAMA8, 24, 131072, 1, quality="max")
    assert fp16_only.status == "impossible" and fp16_only.eviction.fraction == "1/4"
    assert "kvlib's evict-tova at 1/4" in plan_suggestions.eviction_note(fp16_only, MEAS)


def test_without_a_measured_budget_the_line_gives_the_fit_and_no_figures():
    d = decide(LLAMA8, 24, 32768, 5)
    other = _run(["1/8", "1/16"], ROWS, {"1/8 eviction+int4": "evict-h2o-int4@1/4"})
    for results, why in (
        (other, "not measured at 1/4: the eviction run has 1/8, 1/16"),
        ({}, "not measured yet (benchmarks/bench_eviction.py)"),
        (_run(["1/4"], ROWS, {"1/4 eviction+int4": "evict-gone@1/4"}), "not measured at 1/4"),
    ):
        line = plan_suggestions.eviction_note(d, results)
        assert line.startswith("token eviction: the whole request with kvlib's evict-<policy>-int4")
        assert why in line and not re.search(r"\d %|retrieval \d", line)
    # recommend() without an eviction run: the line is still there, without figures
    assert any(
        "not measured yet" in s for s in recommend(LLAMA8, 24, 32768, 5, results={}).suggestions
    )


def test_no_line_when_everything_fits_and_the_engines_named_when_it_does_not():
    ok = decide(LLAMA8, 80, 8192, 1)
    assert plan_suggestions.eviction_note(ok, MEAS) is None
    assert not any("eviction" in w for w in plan_text.watch(ok, MEAS))
    d = decide(LLAMA8, 24, 32768, 5)
    (watch,) = [w for w in plan_text.watch(d, MEAS) if "eviction" in w]
    assert all(f"{e}: {what}" in watch for e, what in engines.TOKEN_EVICTION.items())
    assert set(engines.TOKEN_EVICTION) == set(engines.ENGINES)
    assert "--context-shift" in engines.TOKEN_EVICTION["llama.cpp"]
    assert "--keep" in engines.TOKEN_EVICTION["llama.cpp"]


# -------------------------------------------------------------------------------- plan and CLI


def test_plan_and_cli_carry_the_option(tmp_path, capsys):
    p = recommend("llama-3.1-8b", 24, 32768, 5, results=MEAS)
    d = p.to_dict()
    assert d["eviction"] == {**dataclasses.asdict(p.eviction), "fraction": "1/4"}
    assert recommend("llama-3.1-8b", 80, 8192, results=MEAS).to_dict()["eviction"] is None
    path = tmp_path / "m.json"
    path.write_text(json.dumps(MEAS))
    argv = ["plan", "--model", "llama-3.1-8b", "--gpu-memory", "24", "--context", "32k"]
    assert main([*argv, "--concurrency", "5", "--results", str(path)]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("would fit: token eviction")]
    assert line == f"would fit: {plan_suggestions.eviction_note(p, MEAS)}"
    assert main([*argv, "--concurrency", "4", "--results", str(path)]) == 0  # q4_0 holds 4
    assert "eviction" not in capsys.readouterr().out
    assert main([*argv, "--concurrency", "5", "--results", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["eviction"]["fraction"] == "1/4"
