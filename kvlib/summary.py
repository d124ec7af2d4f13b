"""The series in one table: what each technique buys and costs, from the measured results.

Introduced in notebook 08 (section 7). Every figure is read from a results file
(:mod:`kvlib.results`) or computed by :mod:`kvlib.memory`; nothing here is typed in. A cost
measured on several text segments is given as its range, and a range that spans zero is called
no measurable cost, as the planner's reasons do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvlib import results as kvresults
from kvlib.memory import kv_bytes_per_token
from kvlib.plan_rule import KV_SETTINGS
from kvlib.specs import get_spec

__all__ = ["TechniqueLine", "series_summary", "format_summary"]


@dataclass(frozen=True)
class TechniqueLine:
    """One technique of the series: what it ``buys``, what it ``costs``, and one more fact."""

    technique: str
    buys: str
    costs: str
    also: str


def _span(rows: list[Mapping[str, Any]], key: str, unit: str = "", sign: str = "") -> str:
    vals = [r[key] for r in rows]
    return f"{min(vals):{sign}.3g}{unit} to {max(vals):{sign}.3g}{unit}"


def _quant_line(setting: str, results: Mapping[str, Any]) -> TechniqueLine:
    s = KV_SETTINGS[setting]
    cost = kvresults.cache_cost(s.cache_name, results)
    tokens = kvresults.run("cache", results)["settings"]["tokens"]
    quant = kvresults.run("quant", results)["rows"]
    seg = cost.get("perplexity_delta_pct_segments") or [cost["perplexity_delta_pct"]]
    lo, hi = min(seg), max(seg)
    note = f"{sum(seg) / len(seg):+.2g} % on average over {len(seg)} segments ({lo:+.2g} % … {hi:+.2g} %"
    note += "; no measurable cost)" if lo <= 0 <= hi else ")"
    return TechniqueLine(
        f"{setting} KV cache (02–04, {s.cache_name})",
        f"{cost['x_smaller_than_fp16']:.3g}× smaller than fp16 at {tokens:,} tokens "
        f"({cost['x_smaller_than_fp16_at_4096']:.3g}× at 4,096)",
        f"perplexity {note} vs the unquantized cache",
        f"quantize-dequantize rel. RMSE {quant[f'kvlib per-token-{s.bits}']['rel_rmse']:.3g} "
        "(per-token groups of 64)",
    )


def series_summary(results: Mapping[str, Any] | None = None) -> list[TechniqueLine]:
    """One :class:`TechniqueLine` per technique of notebooks 01–06, from ``results`` (default:
    the package's ``kvlib/results.json``): GQA, int8/int4/int2 caches, PCA transform coding and
    PagedAttention.

    Raises:
        ValueError: a run the summary needs is missing from ``results``.
        KeyError: a figure the summary needs is missing from a run.
    """
    results = kvresults.load_results() if results is None else results
    missing = [n for n in ("cache", "quant", "pca", "paged") if not kvresults.run(n, results)]
    if missing:
        raise ValueError(
            f"the results hold no {', '.join(map(repr, missing))} run: run the benchmark "
            "(benchmarks/bench_*.py) that writes it"
        )
    pca_run = kvresults.run("pca", results)
    pca_rows = [r for n, r in pca_run["rows"].items() if n.startswith("PCA cross-layer")]
    paged = kvresults.run("paged", results)
    llama8 = get_spec("llama-3.1-8b")
    mha = dataclasses.replace(llama8, num_kv_heads=llama8.num_heads)
    gqa = kv_bytes_per_token(mha) / kv_bytes_per_token(llama8)
    serving = paged["serving"]
    slow = [r["paged_per_dense"] for r in paged["attention"].values()]
    return [
        TechniqueLine(
            "GQA (01, architecture)",
            f"{gqa:.3g}× smaller cache than MHA (Llama-3.1-8B)",
            "fixed by the model, not a runtime switch",
            "exact byte formula",
        ),
        *(_quant_line(s, results) for s in ("int8", "int4", "int2")),
        TechniqueLine(
            "PCA transform coding (05)",
            f"idle caches {_span(pca_rows, 'x_smaller_than_fp16', '×')} smaller than fp16 "
            "(cross-layer basis)",
            f"perplexity {_span(pca_rows, 'perplexity_delta_pct', ' %', '+')}; encode "
            f"{_span(pca_rows, 'encode_s', ' s')} per "
            f"{pca_run['settings']['prefix_tokens']:,}-token store",
            "a storage format between turns, not the hot path; basis stored once per model",
        ),
        TechniqueLine(
            "PagedAttention (06)",
            f"waste {serving['paged-16']['waste_pct']:.3g} % (blocks of 16) vs "
            f"{serving['contiguous-max']['waste_pct']:.3g} % contiguous-max",
            f"block-table gather in attention: {min(slow):.3g}× to {max(slow):.3g}× dense "
            "SDPA's time on this CPU (a reference implementation; fused GPU kernels close the gap)",
            f"prefix sharing: {paged['prefix_sharing']['128']['memory_saved']:.3g} % less memory "
            "(4 samples, 128-token outputs)",
        ),
    ]


def format_summary(lines: list[TechniqueLine]) -> str:
    """The lines as text: the technique, then indented ``buys:``, ``costs:`` and ``also:``."""
    out = []
    for line in lines:
        out.append(line.technique)
        for label in ("buys", "costs", "also"):
            out.append(f"  {label + ':':<7}{getattr(line, label)}")
    return "\n".join(out)
