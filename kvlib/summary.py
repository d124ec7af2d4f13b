"""The series in one table: what each technique buys and costs, from the measured results.

Introduced in notebook 09 (section 7). Every figure is read from a results file
(:mod:`kvlib.results`) or computed by :mod:`kvlib.memory`; nothing here is typed in. A cost
measured on several text segments is given as its range, and a range that spans zero is called
no measurable cost, as the planner's reasons do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kvlib import results as kvresults
from kvlib.keys import BestKey
from kvlib.memory import kv_bytes_per_token
from kvlib.plan.measured import DECODE_ROWS
from kvlib.plan.rule import KV_SETTINGS
from kvlib.specs import get_spec

__all__ = [
    "EngineCacheRow",
    "ModelCacheRow",
    "TechniqueLine",
    "engine_rows",
    "format_engine_rows",
    "format_model_rows",
    "model_rows",
    "format_summary",
    "series_summary",
]


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
        f"the quantizer alone on random Gaussian values in the model's cache shape: rel. RMSE "
        f"{quant[f'kvlib per-token-{s.bits}']['rel_rmse']:.3g} in per-token groups of 64 (the "
        "cache's layout for values; it groups keys per channel)",
    )


def _kernel_line(results: Mapping[str, Any]) -> TechniqueLine:
    run = kvresults.run("kernel", results)
    row = run["attention"]["b1-32768"]
    decode = run["model_decode"]["rows"]
    fused, torch_path = (decode[name] for name in DECODE_ROWS)
    return TechniqueLine(
        "Fused decode kernel (10)",
        f"reads {row['fp16_bytes'] / row['int4_bytes']:.3g}× fewer bytes per step at int4 than fp16 "
        "(Llama-3.1-8B layer, 32k tokens)",
        f"{row['fused_int4_us'] / row['fp16_sdpa_us']:.3g}× fp16 SDPA's time on an H200: it reads "
        f"at {row['bw_int4']:.1%} of the bandwidth, not yet memory-bound",
        f"one layer's attention at 32k {row['torch_int4_us'] / row['fused_int4_us']:.3g}× faster "
        f"than dequantizing first; the whole model decoded {fused['decode_tokens_per_s']:g} "
        f"against {torch_path['decode_tokens_per_s']:g} tokens/s",
    )


def _eviction_line(results: Mapping[str, Any]) -> TechniqueLine:
    run = kvresults.run("eviction", results)
    key = kvresults.best(run)[BestKey(Fraction(1, 4), "eviction+int4")]
    row, ref = run["rows"][str(key)], run["rows"][str(kvresults.reference(run))]
    return TechniqueLine(
        f"Token eviction (11, {key.cache})",
        "1/4 of the fp16 bytes per sequence (int4 storage of the kept tokens)",
        f"perplexity {row['perplexity_delta_pct_mean']:+.2g} % on average; pass key found "
        f"{row['retrieval_1024']:.0%} at 1k tokens, {row['retrieval_2048']:.0%} at 2k "
        f"(uncompressed {ref['retrieval_1024']:.0%}, {ref['retrieval_2048']:.0%})",
        "dropped tokens are gone: for work that needs no facts from far back",
    )


def series_summary(results: Mapping[str, Any] | None = None) -> list[TechniqueLine]:
    """One :class:`TechniqueLine` per technique of the series, from ``results`` (default: the
    package's ``kvlib/results.json``): GQA, int8/int4/int2 caches, PCA transform coding,
    PagedAttention, the fused decode kernel and token eviction.

    Raises:
        ValueError: a run the summary needs is missing from ``results``.
        KeyError: a figure the summary needs is missing from a run.
    """
    results = kvresults.load_results() if results is None else results
    needed = ("cache", "quant", "pca", "paged", "kernel", "eviction")
    missing = [n for n in needed if not kvresults.run(n, results)]
    if missing:
        raise ValueError(
            f"the results hold no {', '.join(map(repr, missing))} run: run the benchmark "
            "(benchmarks/bench_*.py) that writes it"
        )
    pca_run = kvresults.run("pca", results)
    pca_rows = [r for k, r in kvresults.rows(pca_run).items() if k.cache == "PCA cross-layer"]
    paged = kvresults.run("paged", results)
    llama8 = get_spec("llama-3.1-8b")
    mha = dataclasses.replace(llama8, num_kv_heads=llama8.num_heads)
    gqa = kv_bytes_per_token(mha) / kv_bytes_per_token(llama8)
    serving = paged["serving"]
    paged_device = kvresults.device(paged)
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
            "PCA transform coding (06)",
            f"idle caches {_span(pca_rows, 'x_smaller_than_fp16', '×')} smaller than fp16 "
            "(cross-layer basis)",
            f"perplexity {_span(pca_rows, 'perplexity_delta_pct', ' %', '+')}; encode "
            f"{_span(pca_rows, 'encode_s', ' s')} per "
            f"{pca_run['settings']['prefix_tokens']:,}-token store",
            "a storage format between turns, not the hot path; basis stored once per model",
        ),
        TechniqueLine(
            "PagedAttention (07)",
            f"waste {serving['paged-16']['waste_pct']:.3g} % (blocks of 16) vs "
            f"{serving['contiguous-max']['waste_pct']:.3g} % contiguous-max",
            f"block-table gather in attention: {min(slow):.3g}× to {max(slow):.3g}× dense "
            f"SDPA's time on {paged_device} (a reference implementation; fused GPU kernels close "
            "the gap)",
            f"prefix sharing: {paged['prefix_sharing']['128']['memory_saved']:.3g} % less memory "
            "(4 samples, 128-token outputs)",
        ),
        _kernel_line(results),
        _eviction_line(results),
    ]


def format_summary(lines: list[TechniqueLine]) -> str:
    """The lines as text: the technique, then indented ``buys:``, ``costs:`` and ``also:``."""
    out = []
    for line in lines:
        out.append(line.technique)
        for label in ("buys", "costs", "also"):
            out.append(f"  {label + ':':<7}{getattr(line, label)}")
    return "\n".join(out)


@dataclass(frozen=True)
class EngineCacheRow:
    """One KV-cache type as its own engine measured it: the cost against that engine's own
    16-bit cache, on the same text segments, and the bytes it stores.

    Attributes:
        engine: ``"transformers"`` (kvlib's and transformers' caches), ``"llama.cpp"`` or
            ``"vllm"``.
        cache: the name the engine gives the type (a registry name for transformers).
        bytes_per_token: bytes per cached token on the evaluated text, every scale and
            full-precision window included.
        x_smaller_than_fp16: 16-bit bytes over these bytes.
        delta_pct: mean perplexity change (%) against the engine's own 16-bit cache.
        segments: per-segment changes (%), when measured on several segments (else empty).
        reference: what the change is measured against.
        measured: :func:`kvlib.results.citation` of the run (model, engine, device, date).
    """

    engine: str
    cache: str
    bytes_per_token: float
    x_smaller_than_fp16: float
    delta_pct: float
    segments: tuple[float, ...]
    reference: str
    measured: str


#: Per engine: the run, its reference row and what the reference is, and the rows shown.
_ENGINE_RUNS: dict[str, tuple[str, str, tuple[str, ...] | None]] = {
    "transformers": (
        "cache",
        "transformers' DynamicCache of the fp32 model",
        ("kvlib-int8", "kvlib-int4", "kvlib-int3", "kvlib-int2", "quanto-int4", "hf-fp8"),
    ),
    "llama.cpp": ("llama.cpp", "llama.cpp's own f16 cache", None),
    "vllm": ("vllm", "vLLM's own 16-bit (auto) cache", None),
}


def engine_rows(results: Mapping[str, Any] | None = None) -> list[EngineCacheRow]:
    """Every quantized KV-cache type the results measured on each engine (kvlib's and
    transformers' caches, llama.cpp's types, vLLM's dtypes), each against its own engine's
    16-bit cache on the same segments of text (notebooks 04 and 09). A vLLM dtype the run
    marks as not computed correctly on the CPU, and each engine's reference, are left out; an
    engine whose run is missing gives no rows.
    """
    results = kvresults.load_results() if results is None else results
    out = []
    for engine, (run_name, reference, names) in _ENGINE_RUNS.items():
        run = kvresults.run(run_name, results)
        rows = run.get("rows", {}) if run else {}
        for name in names or list(rows):
            row = rows.get(name)
            if not isinstance(row, Mapping) or row.get("computed_correctly_on_cpu") is False:
                continue
            segments = tuple(float(x) for x in row.get("perplexity_delta_pct_segments") or ())
            delta = row.get("perplexity_delta_pct_mean", row.get("perplexity_delta_pct"))
            if delta is None or row.get("x_smaller_than_fp16", 1.0) <= 1.0:
                continue  # a reference (fp32, f16, auto): nothing quantized
            out.append(
                EngineCacheRow(
                    engine=engine,
                    cache=name,
                    bytes_per_token=float(row["bytes_per_token"]),
                    x_smaller_than_fp16=float(row["x_smaller_than_fp16"]),
                    delta_pct=float(delta),
                    segments=segments if len(segments) >= 2 else (),
                    reference=reference,
                    measured=kvresults.citation(run),
                )
            )
    return out


def format_engine_rows(rows: list[EngineCacheRow]) -> str:
    """The rows as a text table, one line each: engine, cache, bytes per token, × smaller than
    16-bit, the mean perplexity change and, where measured on several segments, their range;
    then one line per engine saying what its changes are measured against and on what."""
    head = (
        f"{'engine':<13}{'cache':<16}{'bytes/token':>12}{'× smaller':>11}{'Δ ppl %':>10}  segments"
    )
    lines = [head]
    for r in rows:
        seg = f"{min(r.segments):+.3g} … {max(r.segments):+.3g}" if r.segments else "one"
        lines.append(
            f"{r.engine:<13}{r.cache:<16}{r.bytes_per_token:>12,.0f}{r.x_smaller_than_fp16:>11.3g}"
            f"{r.delta_pct:>+10.3g}  {seg}"
        )
    for engine in dict.fromkeys(r.engine for r in rows):
        first = next(r for r in rows if r.engine == engine)
        lines.append(f"{engine}: against {first.reference}, {first.measured}")
    return "\n".join(lines)


@dataclass(frozen=True)
class ModelCacheRow:
    """One cache measured on one model by the cache benchmark (notebook 04's second model).

    Attributes:
        cache: the :mod:`kvlib.caches.registry` name.
        model: the offline model's name (``"gemma-3-270m"``); ``title`` is the name cited.
        delta_pct: perplexity change against that model's fp32 DynamicCache, mean over the
            segments where measured, else the protocol segment's.
        segments: the per-segment changes (empty where only one was measured).
        x_smaller_at_4096: fp16 bytes / the cache's bytes at 4,096 tokens (``None``: not fed).
    """

    cache: str
    model: str
    title: str
    delta_pct: float
    segments: tuple[float, ...]
    x_smaller_at_4096: float | None


def model_rows(
    names: tuple[str, ...] | None = None, results: Mapping[str, Any] | None = None
) -> list[ModelCacheRow]:
    """The caches the cache benchmark measured on more than one model (:func:`kvlib.results.
    model_runs`), one row per cache and model, the caches in the default model's order
    (``names``: these caches only). A cache measured on one model only is left out."""
    runs = kvresults.model_runs("cache", kvresults.load_results() if results is None else results)
    rows_by_model = {m: run.get("rows", {}) for m, run in runs.items()}
    first = next(iter(rows_by_model.values()), {})
    shared = [
        n for n in (names or tuple(first)) if sum(n in rows for rows in rows_by_model.values()) > 1
    ]
    out = []
    for name in shared:
        for model, rows in rows_by_model.items():
            row = rows.get(name)
            if not isinstance(row, Mapping):
                continue
            segments = tuple(float(x) for x in row.get("perplexity_delta_pct_segments") or ())
            at_4096 = row.get("x_smaller_than_fp16_at_4096")
            out.append(
                ModelCacheRow(
                    cache=name,
                    model=model,
                    title=str(runs[model].get("model", model)),
                    delta_pct=float(
                        row.get("perplexity_delta_pct_mean", row["perplexity_delta_pct"])
                    ),
                    segments=segments if len(segments) >= 2 else (),
                    x_smaller_at_4096=None if at_4096 is None else float(at_4096),
                )
            )
    return out


def format_model_rows(rows: list[ModelCacheRow]) -> str:
    """The rows as a text table, one line per cache, a column pair per model: the mean
    perplexity change (%) and the size at 4,096 tokens (× smaller than fp16). A change measured
    on one segment only is marked ``*``, and a last line says so."""
    models = list(dict.fromkeys(r.title for r in rows))
    cells = {(r.cache, r.title): r for r in rows}
    head = f"{'cache':<17}" + "".join(f"{m + ' Δ ppl %':>24}{'× @4096':>9}" for m in models)
    lines = [head]
    for cache in dict.fromkeys(r.cache for r in rows):
        line = f"{cache:<17}"
        for m in models:
            r = cells.get((cache, m))
            if r is None:
                line += f"{'—':>24}{'':>9}"
                continue
            size = "—" if r.x_smaller_at_4096 is None else f"{r.x_smaller_at_4096:.3g}"
            delta = f"{r.delta_pct:+.3g}" + ("" if r.segments else "*")
            line += f"{delta:>24}{size:>9}"
        lines.append(line)
    if any(not r.segments for r in rows):
        lines.append("* one segment (the first); the others: the mean over the run's segments")
    return "\n".join(lines)
