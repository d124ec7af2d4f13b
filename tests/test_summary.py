"""kvlib.summary: the series table is read from the results, never typed in."""

import copy

import pytest

from kvlib import results, summary


def test_every_technique_has_a_line_with_its_measured_figures():
    lines = summary.series_summary()
    names = [line.technique for line in lines]
    assert names[0].startswith("GQA") and names[-1].startswith("PagedAttention")
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
