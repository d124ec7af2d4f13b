"""benchmarks/bench_eviction.py: the Markdown tables it prints from a recorded run (the ones
RESULTS.md quotes), with and without several perplexity segments."""

from __future__ import annotations

from pathlib import Path

import pytest
from _scripts import load_script
from _tiny_models import gemma3_config, llama_config

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_eviction.py"


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_eviction.py")


def _row(delta, acc, fraction, segments=None):
    row = {
        "perplexity": 10.0,
        "perplexity_delta_pct": delta,
        "fp16_fraction": fraction,
        "retrieval_1024": acc,
        "retrieval_1024_ci": [acc / 2, 1.0],
        "retrieval_multi_1024": acc / 2,
        "retrieval_multi_1024_ci": [0.0, acc],
    }
    if segments:
        row["perplexity_delta_pct_segments"] = segments
        row["perplexity_delta_pct_mean"] = sum(segments) / len(segments)
    return row


def _run(segments: int) -> dict:
    seg = segments > 1
    rows = {
        "dynamic-fp32": _row(0.0, 1.0, 2.0, [0.0] * segments if seg else None),
        "evict-h2o-int4@1/4": _row(0.5, 0.95, 0.25, [0.5, 0.25, 0.75] if seg else None),
        "kvtc@1/4": {
            "retrieval_1024": 0.9,
            "retrieval_1024_ci": [0.7, 0.97],
            "retrieval_1024_fp16_fraction": 0.224,
            "retrieval_multi_1024": 0.6,
            "retrieval_multi_1024_ci": [0.4, 0.8],
        },
    }
    best = {"1/4 eviction+int4": "evict-h2o-int4@1/4", "1/4 transform coding": "kvtc@1/4"}
    return {"rows": rows, "best": best, "settings": {"segments": segments}}


def test_tables_quote_the_mean_and_every_segment(bench):
    text = bench.markdown_tables(_run(3))
    lines = text.splitlines()
    assert lines[0] == (
        "| budget | family | best row | Δ perplexity, mean (%) | per segment (%) | "
        "retrieval @1024 [95 % CI] | retrieval multi @1024 [95 % CI] | bytes / fp16 |"
    )
    assert (
        "| 1/4 | eviction+int4 | evict-h2o-int4@1/4 | +0.500 | +0.50 / +0.25 / +0.75 | "
        "0.95 [0.47, 1.00] | 0.47 [0.00, 0.95] | 0.250 |"
    ) in lines
    assert "| 1/4 | transform coding | kvtc@1/4 | n/a | n/a | 0.90 [0.70, 0.97] | " in text
    assert "| kvtc@1/4 | n/a | n/a | 0.90 | 0.60 | 0.224 |" in lines
    # every table row has as many cells as its header
    tables = [[ln for ln in b.splitlines() if ln.startswith("|")] for b in text.split("\n\n")]
    assert [len(t) for t in tables if t] == [5, 5]  # header, rule, reference + 2 best; 3 rows
    for table in filter(None, tables):
        assert {ln.count("|") for ln in table} == {table[0].count("|")}


def test_one_segment_prints_the_single_cost(bench):
    text = bench.markdown_tables(_run(1))
    assert "| evict-h2o-int4@1/4 | +0.500 | 0.95 | 0.47 | 0.250 |" in text.splitlines()
    assert "per segment" not in text


def test_factories_name_every_policy_at_every_budget_by_registry_name(bench):
    from kvlib.caches import registry
    from kvlib.caches.eviction.cache import EvictionCache

    config = llama_config()
    names = bench.cache_factories(config, "dynamic-fp32", (2, 4), ["h2o", "tova"], [None])
    assert list(names)[:5] == ["dynamic-fp32", *bench.QUANT]
    assert {"evict-h2o@1/2", "evict-tova-int4@1/4"} <= set(names)
    assert len(names) == 5 + 2 * 2 * 2
    assert all(registry.cache_info(n).name for n in names)  # every name is the registry's
    grouped = bench.cache_factories(config, "dynamic-fp32", (4,), ["h2o"], [32], only_int4=True)
    assert list(grouped) == ["dynamic-fp32", "evict-h2o-int4-g32@1/4"]
    assert grouped["dynamic-fp32"](100) is None  # the model's own DynamicCache
    assert isinstance(grouped["evict-h2o-int4-g32@1/4"](256)(), EvictionCache)


def test_retrieval_grids_add_the_multi_key_column_at_the_first_context(bench):
    grids = bench.retrieval_grids((1024, 2048), trials=4, multi_trials=2)
    assert [c for c, _ in grids] == ["retrieval_1024", "retrieval_2048", "retrieval_multi_1024"]
    assert grids[2][1] == {"context_tokens": (1024,), "n_keys": bench.MULTI_KEYS, "trials": 2}
    assert len(bench.retrieval_grids((1024,), trials=4, multi_trials=0)) == 1


def test_segment_costs_are_against_the_reference_on_each_segment(bench):
    measured = {
        "dynamic-fp32": {"perplexity": 10.0, "perplexity_segments": [10.0, 20.0]},
        "kvlib-int4": {"perplexity": 10.1, "perplexity_segments": [10.1, 19.8]},
        "kvtc@1/4": {"retrieval_1024": 1.0},
    }
    bench.add_segment_costs(measured, "dynamic-fp32")
    row = measured["kvlib-int4"]
    assert row["perplexity_delta_pct_segments"] == pytest.approx([1.0, -1.0])
    assert row["perplexity_delta_pct_mean"] == pytest.approx(0.0, abs=1e-12)
    assert row["perplexity_delta_pct_worst"] == pytest.approx(1.0)
    assert "perplexity_delta_pct" not in measured["kvtc@1/4"]


def test_best_rows_rank_retrieval_first_then_perplexity_within_the_budget(bench):
    def row(acc, mean, fraction):
        return {"retrieval_1024": acc, "perplexity_delta_pct_mean": mean, "fp16_fraction": fraction}

    measured = {
        "kvlib-int4": row(1.0, 0.2, 0.34),  # fits 1/2 only
        "kvlib-int2": row(0.9, 6.0, 0.22),  # fits 1/2 and 1/4
        "evict-h2o@1/4": row(0.5, 4.0, 0.25),
        "evict-tova@1/4": row(0.5, 3.0, 0.25),
        "evict-h2o-int4@1/4": row(1.0, 0.4, 0.25),
    }
    best = bench.best_rows(measured, (2, 4), 1024)
    assert best == {
        "1/2 quantization": "kvlib-int4",
        "1/4 quantization": "kvlib-int2",
        "1/4 eviction": "evict-tova@1/4",
        "1/4 eviction+int4": "evict-h2o-int4@1/4",
    }


def test_on_a_hybrid_model_budgets_share_the_global_layers_and_keep_the_windows(bench):
    from kvlib.caches import registry

    config = gemma3_config(window=16)
    names = bench.cache_factories(config, "dynamic-fp32", (2, 4), ["streaming"], [None])
    windows = registry.window_fp16_bytes(config, 40)
    assert windows > registry.fp16_bytes(config, 40) // 2  # half the whole cannot hold them
    for k in (2, 4):
        cache = names[f"evict-streaming@1/{k}"](40)()
        assert cache.max_bytes == bench.budget_bytes(config, 40, k)
        assert cache.max_bytes == windows + (registry.fp16_bytes(config, 40) - windows) // k


def test_global_bytes_count_the_full_attention_layers_only(bench):
    import torch
    import transformers

    from kvlib import compat
    from kvlib.caches import registry

    config = gemma3_config(window=16)
    model = transformers.Gemma3ForCausalLM(config).eval()
    segments = [torch.randint(0, config.vocab_size, (1, 65))]
    row = bench.perplexity_row(model, segments, lambda: compat.dynamic_cache(config))
    # a float32 DynamicCache: twice the fp16 bytes in its one global layer
    assert row["global_fp16_fraction"] == pytest.approx(2.0)
    assert row["fp16_fraction"] < 2.0  # the sliding layers keep one token fewer (transformers)
    cache = registry.make_cache("evict-streaming", config, budget=20)
    with pytest.raises(ValueError, match="one layer per model layer"):
        bench.global_nbytes(compat.dynamic_cache(), config)
    assert bench.global_nbytes(cache, config) == 0  # nothing held yet


def test_hybrid_runs_print_the_global_share_and_rank_by_it(bench):
    run = _run(3)
    for name, fraction in (("dynamic-fp32", 2.0), ("evict-h2o-int4@1/4", 0.25)):
        run["rows"][name]["global_fp16_fraction"] = fraction
        run["rows"][name]["fp16_fraction"] = 0.9 if fraction < 1 else 2.0
    text = bench.markdown_tables(run)
    assert text.splitlines()[0].endswith("| bytes / fp16 | global layers / fp16 |")
    assert "| kvtc@1/4 | n/a | n/a | 0.90 | 0.60 | 0.224 | n/a |" in text.splitlines()
    assert "| 0.95 [0.47, 1.00] | 0.47 [0.00, 0.95] | 0.900 | 0.250 |" in text
    tables = [[ln for ln in b.splitlines() if ln.startswith("|")] for b in text.split("\n\n")]
    for table in filter(None, tables):
        assert {ln.count("|") for ln in table} == {table[0].count("|")}

    def row(acc, mean, whole, glob):
        return {
            "retrieval_1024": acc,
            "perplexity_delta_pct_mean": mean,
            "fp16_fraction": whole,
            "global_fp16_fraction": glob,
        }

    measured = {  # whole-cache fractions over 1/2: the windows; the global shares decide
        "kvlib-int4": row(1.0, 0.1, 0.88, 0.40),
        "evict-h2o@1/2": row(0.5, 0.3, 0.90, 0.50),
    }
    assert bench.best_rows(measured, (2, 4), 1024) == {
        "1/2 quantization": "kvlib-int4",
        "1/2 eviction": "evict-h2o@1/2",
    }


def test_a_stored_cache_on_a_hybrid_model_counts_its_global_share_from_the_prompts(bench):
    run = _run(3)
    run["rows"]["dynamic-fp32"]["global_fp16_fraction"] = 2.0
    run["rows"]["kvtc@1/4"]["retrieval_1024_global_fp16_fraction"] = 0.249
    assert "| kvtc@1/4 | n/a | n/a | 0.90 | 0.60 | 0.224 | 0.249 |" in bench.markdown_tables(run)
    stored = {
        "retrieval_1024": 0.9,
        "retrieval_1024_fp16_fraction": 0.6,  # the windows: over 1/4 of the whole
        "retrieval_1024_global_fp16_fraction": 0.249,
    }
    assert bench.best_rows({"kvtc@1/4": stored}, (4,), 1024) == {"1/4 transform coding": "kvtc@1/4"}
    stored["retrieval_1024_global_fp16_fraction"] = 0.3  # over its budget: not counted
    assert bench.best_rows({"kvtc@1/4": stored}, (4,), 1024) == {}


def test_add_kvtc_refuses_a_run_that_has_its_rows_or_none(bench):
    with pytest.raises(SystemExit, match="already"):  # SmolLM2's run was measured with them
        bench.add_kvtc(bench.parse_args(["--add-kvtc"]), None, None, "")
    with pytest.raises(SystemExit, match="no run"):
        bench.add_kvtc(bench.parse_args(["--add-kvtc", "--run-name", "nothing"]), None, None, "")
    with pytest.raises(SystemExit):
        bench.parse_args(["--add-kvtc", "--no-kvtc"])
