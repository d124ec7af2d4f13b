"""kvlib.summary: the series table is read from the results, never typed in."""

import copy

import pytest

from kvlib import results, summary


def test_every_technique_has_a_line_with_its_measured_figures():
    lines = summary.series_summary()
    names = [line.technique for line in lines]
    assert names[0].startswith("GQA") and names[-1].startswith("Token eviction")
    assert [n.split(" (")[0] for n in names[-3:]] == [
        "PagedAttention",
        "Fused decode kernel",
        "Token eviction",
    ]
    assert sum("KV cache" in n for n in names) == 3
    int4 = next(line for line in lines if "kvlib-int4" in line.technique)
    cost = results.cache_cost("kvlib-int4")
    assert f"{cost['x_smaller_than_fp16']:.3g}×" in int4.buys
    assert f"{len(cost['perplexity_delta_pct_segments'])} segments" in int4.costs


def test_a_changed_result_changes_the_line():
    data = copy.deepcopy(results.load_results())
    data["runs"]["cache"]["rows"]["kvlib-int2"]["perplexity_delta_pct_segments"] = [1.0, 2.0]
    line = next(x for x in summary.series_summary(data) if "kvlib-int2" in x.technique)
    assert "+1.5 % on average over 2 segments (+1 % … +2 %)" in line.costs


def test_a_range_across_zero_is_no_measurable_cost():
    data = copy.deepcopy(results.load_results())
    data["runs"]["cache"]["rows"]["kvlib-int2"]["perplexity_delta_pct_segments"] = [-0.1, 0.2]
    line = next(x for x in summary.series_summary(data) if "kvlib-int2" in x.technique)
    assert "no measurable cost" in line.costs


def test_missing_runs_are_named():
    data = copy.deepcopy(results.load_results())
    del data["runs"]["paged"]
    with pytest.raises((KeyError, ValueError), match="paged"):
        summary.series_summary(data)


def test_format_summary_indents_each_part():
    text = summary.format_summary([summary.TechniqueLine("T", "b", "c", "a")])
    assert text.splitlines() == ["T", "  buys:  b", "  costs: c", "  also:  a"]


def _run(source: str, rows: dict) -> dict:
    return {"source": source, "command": "x", "date": "2031-01-02", "machine": "test", "rows": rows}


def test_engine_rows_compare_each_engine_against_its_own_reference():
    data = {
        "schema_version": 1,
        "runs": {
            "llama.cpp": _run(
                "benchmarks/bench_engines.py",
                {
                    "f16": {"bytes_per_token": 100, "x_smaller_than_fp16": 1.0,
                            "perplexity_delta_pct_mean": 0.0},
                    "q4_0": {"bytes_per_token": 28, "x_smaller_than_fp16": 3.5,
                             "perplexity_delta_pct_mean": 6.5,
                             "perplexity_delta_pct_segments": [6.0, 7.0]},
                },
            ),
            "vllm": _run(
                "benchmarks/bench_vllm.py",
                {
                    "fp8": {"bytes_per_token": 50, "x_smaller_than_fp16": 2.0,
                            "perplexity_delta_pct_mean": 4.0},
                    "int8_per_token_head": {"computed_correctly_on_cpu": False},
                },
            ),
        },
    }  # fmt: skip
    rows = summary.engine_rows(data)
    assert [(r.engine, r.cache) for r in rows] == [("llama.cpp", "q4_0"), ("vllm", "fp8")]
    q4, fp8 = rows
    assert (q4.delta_pct, q4.segments, q4.bytes_per_token) == (6.5, (6.0, 7.0), 28.0)
    assert fp8.segments == () and "with vLLM" in fp8.measured and "llama.cpp" in q4.measured
    assert q4.reference == "llama.cpp's own f16 cache"
    # the package's results: all three engines, every row against its own reference
    engines = {r.engine for r in summary.engine_rows()}
    assert engines == {"transformers", "llama.cpp", "vllm"}


def test_model_rows_pair_the_caches_measured_on_both_models():
    data = copy.deepcopy(results.load_results())
    for name in [n for n in data["runs"] if n.startswith("cache/")]:
        del data["runs"][name]  # only the default model's run and the one made up here
    base = data["runs"]["cache"]
    other = copy.deepcopy(base)
    other["model"] = "Other-1B"
    other["rows"] = {
        "kvlib-int4": {
            "perplexity_delta_pct": 0.5,
            "perplexity_delta_pct_segments": [0.5, 0.1],
            "perplexity_delta_pct_mean": 0.3,
            "x_smaller_than_fp16_at_4096": 2.5,
        },
        "quanto-int4": {"perplexity_delta_pct": 7.0, "x_smaller_than_fp16_at_4096": None},
        "only-here": {"perplexity_delta_pct": 1.0},
    }
    data["runs"]["cache/other-1b"] = other
    rows = summary.model_rows(results=data)
    assert [(r.cache, r.model) for r in rows] == [
        ("quanto-int4", "smollm2-135m"),
        ("quanto-int4", "other-1b"),
        ("kvlib-int4", "smollm2-135m"),
        ("kvlib-int4", "other-1b"),
    ]  # the default model's order; a cache on one model only is left out
    mine = {(r.cache, r.model): r for r in rows}
    assert mine["kvlib-int4", "other-1b"].delta_pct == 0.3  # the mean, not the first segment
    assert mine["kvlib-int4", "other-1b"].segments == (0.5, 0.1)
    assert mine["quanto-int4", "other-1b"].segments == ()
    assert (
        mine["kvlib-int4", "smollm2-135m"].delta_pct
        == base["rows"]["kvlib-int4"]["perplexity_delta_pct_mean"]
    )
    text = summary.format_model_rows(rows)
    assert "Other-1B Δ ppl %" in text and "SmolLM2-135M Δ ppl %" in text
    assert text.splitlines()[2].split()[:4] == ["kvlib-int4", "+0.0786", "3.14", "+0.3"]
    # quanto's row on other-1b has one segment: marked, and the marker explained
    assert text.splitlines()[1].split()[3].endswith("*") and text.splitlines()[-1].startswith(
        "* one"
    )
    means_only = [r for r in rows if r.cache == "kvlib-int4"]
    assert "*" not in summary.format_model_rows(means_only)
    assert summary.model_rows(results={"schema_version": 1, "runs": {}}) == []


def test_each_line_names_the_notebook_that_teaches_it():
    """The notebook number in a technique's label is the notebook of that name in the course
    (notebooks/series.toml), so renumbering the series cannot leave the table pointing at the
    wrong notebook."""
    import re
    import tomllib
    from pathlib import Path

    course = tomllib.loads(
        (Path(__file__).resolve().parents[1] / "notebooks" / "series.toml").read_text()
    )
    short = {int(nb["file"][:2]): nb["short"].lower() for nb in course["notebook"]}
    expected = {
        "GQA": ["memory math"],
        "KV cache": ["int8 quantization", "int4 / int2", "quantized cache in transformers"],
        "PCA transform coding": ["pca transform coding"],
        "PagedAttention": ["pagedattention"],
        "Fused decode kernel": ["fused decode kernel"],
        "Token eviction": ["token eviction"],
    }
    for line in summary.series_summary():
        first, last = re.search(r"\((\d\d)(?:–(\d\d))?", line.technique).groups()
        numbers = range(int(first), int(last or first) + 1)
        topic = next(t for t in expected if t in line.technique)
        assert [short[n] for n in numbers] == expected[topic], line.technique
