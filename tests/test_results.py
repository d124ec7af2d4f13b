"""kvlib.results: the one versioned results file, and RESULTS.md quoting only what it holds."""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlib import results, specs
from kvlib.caches import registry as cache_registry

ROOT = Path(__file__).resolve().parents[1]

#: Which run of kvlib/results.json each section of benchmarks/RESULTS.md reports.
SECTION_RUNS = {
    "vLLM's KV-cache dtypes on the bundled model (benchmarks/bench_vllm.py)": "vllm",
    "Quantization kernels (kvlib.quant.tensor)": "quant",
    "Quantized KV cache in transformers (kvlib.caches.quantized vs HF QuantizedCache)": "cache",
    "PCA transform coding (kvlib.kvtc.pca)": "pca",
    "The same coding on Gemma 3 270M (run `pca/gemma-3-270m`)": "pca/gemma-3-270m",
    "TurboQuant and KVQuant at equal bits (benchmarks/bench_turboquant.py)": "turboquant",
    "The same run on Gemma 3 270M (run `turboquant/gemma-3-270m`)": "turboquant/gemma-3-270m",
    "The same table on Gemma 3 270M (run `eviction/gemma-3-270m`)": "eviction/gemma-3-270m",
    "Serving simulation (300 requests, seed 0, 1 GiB KV, max_len 2048)": "paged",
    "Parallel sampling in the simulation (75 requests x 4 samples, paged 16)": "paged",
    "Prefix sharing: 4 parallel samples of a 1024-token prompt (block size 16)": "paged",
    "Paged attention vs dense SDPA (fp32 CPU, 9/3 heads, d=64, block 16)": "paged",
    "Generation on the bundled SmolLM2-135M (16 new tokens, greedy, CPU)": "paged",
    "CPU: the bundled SmolLM2-135M, every cache side by side (notebook 08)": "full_model_cpu",
    "CPU dry run of the GPU check": "gpu_check_dry_run",
    "llama.cpp's KV-cache types on the bundled GGUF (benchmarks/bench_engines.py)": "llama.cpp",
    "The same types on Gemma 3 270M (run `llama.cpp/gemma-3-270m`)": "llama.cpp/gemma-3-270m",
    "Every family at equal bytes (benchmarks/bench_eviction.py)": "eviction",
    "Group size of eviction on int4 (benchmarks/bench_eviction.py --int4-groups)": "eviction_int4_groups",
    "kvlib's policies against kvpress 0.5.5 (benchmarks/bench_kvpress.py)": "kvpress",
    "The keys behind int4 eviction's cost (benchmarks/bench_keys.py)": "keys",
    "The same on Gemma 3 270M (run `keys/gemma-3-270m`)": "keys/gemma-3-270m",
}


def _tables(text: str) -> list[tuple[str, list[list[str]]]]:
    """(heading, body rows as cells) of every Markdown table, under its nearest heading."""
    out, heading, block = [], "", []

    def flush() -> None:
        if len(block) >= 2 and set(block[1].replace("|", "").strip()) <= set("-: "):
            rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block[2:]]
            out.append((heading, rows))
        block.clear()

    for line in text.splitlines():
        if line.lstrip().startswith("|"):
            block.append(line)
            continue
        flush()
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
    flush()
    return out


def _numbers(x) -> list[float]:
    if isinstance(x, bool):
        return []
    if isinstance(x, int | float):
        return [float(x)]
    if isinstance(x, dict):
        return [n for v in x.values() for n in _numbers(v)]
    if isinstance(x, list):
        return [n for v in x for n in _numbers(v)]
    return []


_NUMBER = re.compile(r"^[+-]?\d+(?:\.(\d+))?(?:e([+-]\d+))?$")


def _cell_value(cell: str) -> tuple[float, float] | None:
    """(value, half a unit of its last printed digit), or None for a non-number."""
    text = re.sub(r"\s*(%|×|x|MiB)$", "", cell.replace("**", "").strip())
    for part in text.split(" / "):  # "0.0219 / 0.0320": checked one by one by the caller
        if not _NUMBER.match(part):
            return None
    match = _NUMBER.match(text)
    if match is None:
        return None
    decimals = len(match.group(1) or "")
    exponent = int(match.group(2) or 0)
    return float(text), 0.5 * 10.0 ** (exponent - decimals)


def test_package_results_load_and_name_caches_by_the_registry():
    data = results.load_results()
    assert data["schema_version"] == results.SCHEMA_VERSION
    assert {"cache", "pca", "paged", "quant"} <= set(data["runs"])
    for cache_run in results.model_runs("cache", data).values():  # every model's
        assert cache_run["rows"] and cache_run["decode"] and cache_run["model"]
        for name in (*cache_run["rows"], *cache_run["decode"]):
            cache_registry.cache_info(name)  # raises for a name the registry does not know
    assert "kvlib-int4" in results.cache_costs()


def test_every_figure_in_results_md_tables_is_in_the_json():
    data = results.load_results()
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    checked = 0
    for heading, rows in _tables(text):
        assert heading in SECTION_RUNS, f"RESULTS.md table under {heading!r} has no run"
        numbers = _numbers(data["runs"][SECTION_RUNS[heading]])
        for row in rows:
            for cell in row[1:]:
                parts = cell.split(" / ") if " / " in cell else [cell]
                for part in parts:
                    parsed = _cell_value(part)
                    if parsed is None:
                        continue
                    value, tol = parsed
                    assert any(abs(n - value) <= tol * 1.0001 for n in numbers), (
                        f"{heading}: {row[0]} quotes {part!r}, not in run "
                        f"{SECTION_RUNS[heading]!r} of kvlib/results.json"
                    )
                    checked += 1
    assert checked > 300


def test_results_md_quotes_a_figure_the_json_lacks_fails(tmp_path):
    """The check above can fail: a changed figure is caught."""
    data = results.load_results()
    numbers = _numbers(data["runs"]["cache"])
    value, tol = _cell_value("+0.248")
    assert not any(abs(n - value) <= tol for n in numbers)
    value, tol = _cell_value("+0.247")
    assert any(abs(n - value) <= tol for n in numbers)


def test_cache_cost_reads_one_row_and_refuses_unknown_names():
    costs = results.cache_cost("kvlib-int4")
    row = results.load_results()["runs"]["cache"]["rows"]["kvlib-int4"]
    assert costs["perplexity_delta_pct"] == row["perplexity_delta_pct"]
    assert costs["x_smaller_than_fp16"] == row["x_smaller_than_fp16"]
    assert results.cache_cost("kvlib-int4", {"schema_version": 1, "runs": {}}) == {}
    assert results.cache_cost("fp16-dynamic") == {}  # the old name is gone
    with pytest.raises(TypeError, match="cache name"):
        results.cache_cost(4)


def test_record_run_round_trips_and_keeps_other_runs(tmp_path):
    path = tmp_path / "results.json"
    entry = {
        "source": "benchmarks/x.py",
        "command": "python benchmarks/x.py",
        "machine": "test",
        "rows": {"kvlib-int4": {"perplexity": 1.5, "x_smaller_than_fp16": math.nan}},
    }
    results.record_run("cache", entry, path)
    results.record_run("pca", {**entry, "source": "benchmarks/y.py"}, path)
    data = results.load_results(path)
    assert set(data["runs"]) == {"cache", "pca"}
    assert data["runs"]["cache"]["date"]  # defaulted to today
    assert data["runs"]["cache"]["rows"]["kvlib-int4"]["x_smaller_than_fp16"] is None
    assert results.cache_cost("kvlib-int4", data) == {"perplexity": 1.5}


def test_bad_results_files_raise_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not exist"):
        results.load_results(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        results.load_results(bad)
    bad.write_text(json.dumps({"schema_version": 99, "runs": {}}))
    with pytest.raises(ValueError, match="schema_version 99"):
        results.load_results(bad)
    bad.write_text(json.dumps({"schema_version": 1, "runs": {"cache": {"rows": {}}}}))
    with pytest.raises(ValueError, match="lacks source, command, date, machine"):
        results.load_results(bad)
    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="does not exist"):
        results.load_results()
    with pytest.raises(ValueError, match="lacks"):
        results.record_run("cache", {"rows": {}}, tmp_path / "new.json")


def test_provenance_names_the_model_only_when_the_run_has_one():
    run = {"source": "benchmarks/b.py", "date": "2026-12-03", "model": "M"}
    assert results.provenance(run) == "on M, measured 2026-12-03 by benchmarks/b.py"
    del run["model"]
    assert results.provenance(run) == "measured 2026-12-03 by benchmarks/b.py"


def test_results_md_t4_prediction_is_kvlib_memory_at_notebook_08s_budget():
    """The predicted-fits paragraph is byte math: recompute every figure it quotes."""
    from kvlib import memory, specs

    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    start = text.index('Predicted "what fits" on a T4')
    paragraph = " ".join(text[start : text.index("Not yet confirmed on a GPU.", start)].split())
    assert "13.5 GiB" in paragraph
    budget = 0.9 * memory.GPUS["T4"]  # notebook 08's BUDGET_BYTES
    spec = specs.get_spec("smollm2-1.7b")
    names = ["dynamic-fp16", "kvlib-int8", "kvlib-int4", "kvlib-int2", "quanto-int4"]
    contexts, batches = [], []
    for name in names:
        info = cache_registry.cache_info(name)
        bits = info.cache_bits(16)
        group = info.group_size if bits < 16 else None
        contexts.append(memory.max_context(spec, budget, bits=bits, group_size=group))
        batches.append(memory.max_batch(spec, budget, 8192, bits=bits, group_size=group))
    for name, context in zip(names, contexts, strict=True):
        quoted = f"{context:,}".replace(",", " ")
        assert quoted in paragraph, f"{name}: {quoted} tokens not quoted"
    assert "largest batch at 8192 tokens " + " / ".join(map(str, batches)) in paragraph


def test_a_citation_names_model_engine_and_device():
    run = {"source": "benchmarks/bench_engines.py", "command": "x", "date": "2031-01-02"}
    cpu = results.citation(run | {"model": "Tiny", "machine": "AMD EPYC, 2-core CPU, no GPU"})
    assert (
        cpu == "on Tiny with llama.cpp on a CPU (AMD EPYC), measured 2031-01-02 by " + run["source"]
    )
    gpu = results.citation(run | {"machine": "NVIDIA H200; torch 2.11.0+cu130", "engine": "vLLM"})
    assert gpu == "with vLLM on a GPU (NVIDIA H200), measured 2031-01-02 by " + run["source"]
    assert results.citation({"source": "s", "date": "d"}) == "measured d by s"


def test_runs_on_other_models_are_named_after_the_model(tmp_path):
    """A run on the default model keeps its plain name; another model's copy of the run is
    "<run>/<model>", and model_runs gathers them, the default first."""
    assert results.run_name("cache") == results.run_name("cache", "smollm2-135m") == "cache"
    assert results.run_name("cache", "gemma-3-270m") == "cache/gemma-3-270m"
    for bad, error in ((("cache/x",), ValueError), (("cache", ""), ValueError), ((3,), TypeError)):
        with pytest.raises(error):
            results.run_name(*bad)
    path = tmp_path / "r.json"
    entry = {"source": "s", "command": "c", "machine": "m", "rows": {}}
    results.record_run("cache/gemma-3-270m", {**entry, "model": "Gemma-3-270M"}, path)
    results.record_run("cache", {**entry, "model": "SmolLM2-135M"}, path)
    results.record_run("cachex", entry, path)
    runs = results.model_runs("cache", results.load_results(path))
    assert list(runs) == ["smollm2-135m", "gemma-3-270m"]
    assert runs["gemma-3-270m"]["model"] == "Gemma-3-270M"
    assert results.model_runs("pca", results.load_results(path)) == {}


def _two_model_results(tmp_path):
    """A results file with run "cache" on SmolLM2 and on Gemma 3 270M, and "pca" on one."""
    path = tmp_path / "two.json"
    entry = {"source": "benchmarks/bench_cache.py", "command": "c", "machine": "m", "date": "d"}
    for name, model, delta in (
        ("cache", "SmolLM2-135M", 0.1),
        ("cache/gemma-3-270m", "Gemma-3-270M", 0.7),
    ):
        rows = {"kvlib-int4": {"perplexity_delta_pct": delta, "x_smaller_than_fp16": 3.0}}
        results.record_run(name, {**entry, "model": model, "rows": rows}, path)
    results.record_run("pca", {**entry, "model": "SmolLM2-135M", "rows": {}}, path)
    return results.load_results(path)


@given(a=st.sampled_from(specs.list_specs()), b=st.sampled_from(specs.list_specs()))
def test_build_distance_is_zero_on_one_build_symmetric_and_never_negative(a, b):
    sa, sb = specs.get_spec(a), specs.get_spec(b)
    assert results.build_distance(sa, sa) == 0
    assert results.build_distance(sa, sb) == pytest.approx(results.build_distance(sb, sa))
    assert results.build_distance(sa, sb) >= 0
    if (sa.num_sliding_layers == 0) != (sb.num_sliding_layers == 0):  # windows weigh most
        assert results.build_distance(sa, sb) > 0


def test_build_distance_refuses_what_is_not_a_spec():
    with pytest.raises(TypeError, match="ModelSpec"):
        results.build_distance("llama-3.1-8b", specs.get_spec("llama-3.1-8b"))


@pytest.mark.parametrize(
    "model, closest",
    [
        ("llama-3.1-8b", "smollm2-135m"),  # full attention, 8 KV heads of 128
        ("qwen2.5-0.5b", "smollm2-135m"),
        ("gemma-2-9b", "gemma-3-270m"),  # half its layers sliding, heads of 256
        ("gemma-3-27b", "gemma-3-270m"),  # 52 of 62 layers sliding
        ("gemma-3-270m", "gemma-3-270m"),
        ("smollm2-135m", "smollm2-135m"),
    ],
)
def test_a_plan_reads_the_measured_model_closest_in_build(tmp_path, model, closest):
    data = _two_model_results(tmp_path)
    spec = specs.get_spec(model)
    assert results.closest_model(spec, "cache", data) == closest
    view = results.for_model(spec, data)
    assert view["measured_on"] == {"cache": closest}
    want = 0.7 if closest == "gemma-3-270m" else 0.1
    assert results.cache_cost("kvlib-int4", view)["perplexity_delta_pct"] == want
    assert results.run("pca", view) == results.run("pca", data)  # measured on one model only
    assert "measured_on" not in data and data["runs"]["cache"]["model"] == "SmolLM2-135M"


def test_closest_model_without_the_run_or_with_one_model(tmp_path):
    data = _two_model_results(tmp_path)
    assert results.closest_model(specs.get_spec("gemma-2-9b"), "vllm", data) is None
    assert results.closest_model(specs.get_spec("gemma-2-9b"), "pca", data) == "smollm2-135m"
    assert results.for_model(specs.get_spec("gemma-2-9b"), {}) == {}


# -- typed row keys ---------------------------------------------------------------------------------

_CACHE_NAMES = st.from_regex(r"[a-z][a-z0-9-]{0,20}[a-z0-9]", fullmatch=True)
_BUDGETS = st.fractions(min_value=0, max_value=1, max_denominator=1 << 10).filter(lambda f: f > 0)


@given(_CACHE_NAMES, st.one_of(st.none(), _BUDGETS))
def test_a_row_key_round_trips_through_its_name(cache, budget):
    key = results.RowKey(cache, budget)
    assert results.RowKey.parse(str(key)) == key


@given(_BUDGETS, st.sampled_from(["eviction", "eviction+int4", "transform coding", "quantization"]))
def test_a_best_key_round_trips_through_its_name(budget, family):
    key = results.BestKey(budget, family)
    assert results.BestKey.parse(str(key)) == key


@pytest.mark.parametrize(
    ("name", "cache", "budget"),
    [
        ("kvlib-int4", "kvlib-int4", None),
        ("evict-h2o-int4@1/4", "evict-h2o-int4", (1, 4)),
        ("snapkv@0.25", "snapkv", (1, 4)),  # kvpress's compression ratio, written as a decimal
        ("PCA cross-layer, target 16x", "PCA cross-layer", (1, 16)),
        ("k-q8_0/v-q4_0", "k-q8_0/v-q4_0", None),  # a slash in a name is not a budget
    ],
)
def test_row_keys_read_every_form_the_runs_write(name, cache, budget):
    key = results.RowKey.parse(name)
    assert key.cache == cache
    assert key.budget == (None if budget is None else Fraction(*budget))


@pytest.mark.parametrize(
    ("name", "error"),
    [
        (4, TypeError),
        ("", ValueError),
        (" kvlib-int4", ValueError),
        ("evict-h2o@0", ValueError),  # keeps nothing
        ("evict-h2o@3/2", ValueError),  # more than the fp16 cache
        ("evict-h2o@1/0", ValueError),
        ("auto@0.25GiB", ValueError),  # a memory size, not a share of the fp16 bytes
        ("kvtc@", ValueError),
        ("PCA, target 0.5x", ValueError),
    ],
)
def test_bad_row_names_are_refused_with_a_clear_error(name, error):
    with pytest.raises(error):
        results.RowKey.parse(name)


def test_a_row_key_refuses_bad_fields():
    with pytest.raises(TypeError, match="Fraction"):
        results.RowKey("kvtc", 0.25)
    with pytest.raises(ValueError, match="'@'"):
        results.RowKey("kvtc@1/4")
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        results.RowKey("kvtc", Fraction(5, 4))
    with pytest.raises(ValueError, match="expected"):
        results.BestKey.parse("eviction 1/4")


def test_every_budgeted_row_of_the_package_results_parses():
    runs = results.load_results()["runs"]
    budgeted = {
        str(k)
        for name in ("eviction", "eviction_int4_groups", "kvpress", "pca")
        for k in results.rows(runs[name])
        if k.budget is not None
    }
    assert {"evict-h2o-int4@1/4", "kvtc@1/16", "snapkv@1/8", "PCA cross-layer@1/12"} <= budgeted
    best = results.best(runs["eviction"])
    key = best[results.BestKey(Fraction(1, 4), "eviction+int4")]
    assert key.budget == Fraction(1, 4) and str(key) in runs["eviction"]["rows"]
    assert str(results.reference(runs["eviction"])) == "dynamic-fp32"


def test_the_reference_caches_are_the_registry_s():
    import torch

    names = {
        cache_registry.reference_name(d) for d in (torch.float32, torch.float16, torch.bfloat16)
    }
    assert names == set(results.REFERENCE_CACHES)


def test_rows_refuse_two_names_of_one_key_and_a_best_row_the_run_lacks():
    with pytest.raises(ValueError, match="same key"):
        results.rows({"rows": {"snapkv@0.25": {}, "snapkv@1/4": {}}})
    with pytest.raises(ValueError, match="not among"):
        results.best({"rows": {"kvtc@1/4": {}}, "best": {"1/4 transform coding": "kvtc@1/8"}})
    with pytest.raises(ValueError, match="no group"):
        results.rows({"rows": {}}, "best")
    with pytest.raises(ValueError, match="one reference"):
        results.reference({"rows": {"kvtc@1/4": {}}})


@given(st.integers(min_value=1, max_value=10**7), st.booleans())
def test_retrieval_columns_round_trip(context, multi):
    from kvlib.keys import RetrievalColumn

    column = RetrievalColumn(context, multi)
    assert RetrievalColumn.parse(str(column)) == column
    assert str(column).startswith("retrieval_multi_" if multi else "retrieval_")


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ("retrieval_1024_ci", ValueError),  # a column's interval, not a column
        ("retrieval_0", ValueError),
        ("retrieval_multi", ValueError),
        ("perplexity", ValueError),
        (" retrieval_1024", ValueError),
        (1024, TypeError),
    ],
)
def test_retrieval_column_refuses_other_names(bad, error):
    from kvlib.keys import RetrievalColumn

    with pytest.raises(error):
        RetrievalColumn.parse(bad)


def test_retrieval_columns_of_the_eviction_run_match_its_settings():
    """The columns a row holds are the contexts the run's settings name, and the multi-key
    variant at the first of them, in the row's order."""
    from kvlib.keys import RetrievalColumn

    run = results.run("eviction")
    contexts = run["settings"]["retrieval_contexts"]
    for name, row in run["rows"].items():
        columns = RetrievalColumn.of(row)
        assert columns == [
            *(RetrievalColumn(c) for c in contexts),
            RetrievalColumn(contexts[0], multi=True),
        ], name
        assert all(f"{c}_ci" in row for c in columns)
    with pytest.raises(TypeError):
        RetrievalColumn(1024.0)
    with pytest.raises(ValueError):
        RetrievalColumn(0)


def test_key_means_average_a_keys_run_over_its_segments():
    run = {
        "keys": {
            "channel_spread_segments": [8.0, 10.0],
            "attention_error_segments per-token": [0.2, 0.4],
            "attention_error_segments per-channel": [0.1, 0.1],
        }
    }
    assert results.key_means(run) == pytest.approx(
        {"channel spread": 9.0, "per-token": 0.3, "per-channel": 0.1}
    )
    gemma = results.key_means(results.run("keys/gemma-3-270m"))
    assert set(gemma) == {"channel spread", "per-token", "per-token, rotated", "per-channel"}
    with pytest.raises(ValueError, match="bench_keys"):
        results.key_means(results.run("pca"))
