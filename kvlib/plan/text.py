"""The planner's decision in words: reasons, what to watch, what would fit, and a summary.

Introduced in notebook 08. :func:`kvlib.plan.planner.recommend` builds a :class:`~kvlib.plan.planner.Plan` from
a :class:`~kvlib.plan.rule.Decision` (the numbers) and these sentences. Reasons cite the
project's measured perplexity cost and byte ratio of the chosen setting and say "not measured"
where a figure is missing; no number is invented. A request that does not fit also learns
whether token eviction would hold it (:func:`eviction_note`), with the eviction run's measured
perplexity and retrieval: offered there, never chosen. Library code never prints: the CLI and the
notebooks print :func:`summary`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from kvlib import memory
from kvlib import results as kvresults
from kvlib.keys import BestKey, RetrievalColumn
from kvlib.plan import engine_support, engines
from kvlib.plan import rule as plan_rule
from kvlib.plan.engines import EngineKV
from kvlib.plan.fallbacks import Fallbacks, lower_weight_bits_upgrade
from kvlib.plan.rule import (
    KV_SETTINGS,
    QUALITY_LADDER,
    TP_CANDIDATES,
    VLLM_BLOCK_SIZE,
    Decision,
    engine_candidates,
)
from kvlib.specs import get_spec

__all__ = [
    "alternatives",
    "NOISE_PCT",
    "buys",
    "dominating",
    "eviction_note",
    "fmt_tokens",
    "quality_note",
    "results_to_cite",
    "reasons",
    "suggestions",
    "summary",
    "watch",
]


def results_to_cite(
    results: Mapping[str, Any] | str | os.PathLike[str] | None,
) -> dict[str, Any]:
    """The measured results a plan cites: a mapping as given (``{}`` cites none), a path read as
    a results file, None for :func:`kvlib.results.load_results` (``$KVLIB_RESULTS``, else the
    package's own ``kvlib/results.json``).

    Raises:
        TypeError: anything else.
        ValueError: a named file does not exist or is not a results file.
    """
    if results is None or isinstance(results, (str, os.PathLike)):
        return kvresults.load_results(results)
    if not isinstance(results, Mapping):
        raise TypeError(
            "results must be a mapping, a path to a JSON file or None "
            f"(got {type(results).__name__})"
        )
    return dict(results)


def _label(t: EngineKV) -> str:
    """How a plan names an engine's KV type: ``fp16`` for the full-precision ones (vLLM's
    ``auto``, llama.cpp's ``f16``), else the engine's own name (``fp8``, ``q4_0``)."""
    return "fp16" if t.level == "fp16" else t.name


def _fmt_pct(x: float) -> str:
    return f"{x:+.3g} %"


def quality_note(
    setting: str,
    results: Mapping[str, Any],
    cache_name: str | None = None,
    label: str | None = None,
) -> str:
    """One line: the measured cost of a KV setting (``cache_name``, else the level's
    :data:`KV_SETTINGS` cache, by registry name, in the cache benchmark's run) or of ``"pca"``
    storage (the cross-layer rows of the PCA run), or that it is not measured; ``label`` names
    the setting in the line (default ``setting``). Where the benchmark measured several text
    segments, their range is given, and a range that spans zero is called no measurable cost
    (one segment's delta alone can fall either side of it). Never invents a number.

    Raises:
        ValueError: an unknown setting.
    """
    if setting == "pca":
        run = kvresults.run("pca", results)
        rows = [
            r
            for key, r in (kvresults.rows(run) if run else {}).items()
            if key.cache == "PCA cross-layer" and isinstance(r, Mapping)
        ]
        ratios = [r["x_smaller_than_fp16"] for r in rows if "x_smaller_than_fp16" in r]
        deltas = [r["perplexity_delta_pct"] for r in rows if "perplexity_delta_pct" in r]
        if not ratios or not deltas:
            return "pca: storage figures not measured yet (benchmarks/bench_pca.py)"
        return (
            f"pca: {min(ratios):.3g}–{max(ratios):.3g}× smaller than fp16 at "
            f"{_fmt_pct(min(deltas))} … {_fmt_pct(max(deltas))} perplexity "
            f"{kvresults.citation(run)}"
        )
    if setting not in KV_SETTINGS:
        raise ValueError(
            f"setting must be one of {', '.join([*KV_SETTINGS, 'pca'])} (got {setting!r})"
        )
    name = cache_name or KV_SETTINGS[setting].cache_name
    cost = kvresults.cache_cost(name, results)
    run = kvresults.run("cache", results)
    if setting == "fp16" and "perplexity" not in cost:
        return "fp16: the reference precision, no quantization error"
    parts = []
    if "perplexity_delta_pct" in cost:
        parts.append(f"{_fmt_pct(cost['perplexity_delta_pct'])} perplexity")
    if "perplexity_delta_pct_mean" in cost:
        parts.append(f"{_fmt_pct(cost['perplexity_delta_pct_mean'])} on average over segments")
    seg = _segments(cost)
    if seg:
        lo, hi = min(seg), max(seg)
        parts.append(
            f"{len(seg)} segments {_fmt_pct(lo)} … {_fmt_pct(hi)}"
            + (": no measurable cost" if lo <= 0 <= hi else "")
        )
    if "x_smaller_than_fp16" in cost:
        parts.append(f"{cost['x_smaller_than_fp16']:.3g}× smaller than fp16")
    head = name if label == name else f"{label or setting} ({name})"
    if not parts:
        return f"{head}: quality cost not measured yet (benchmarks/bench_cache.py)"
    return f"{head}: {', '.join(parts)} {kvresults.citation(run)}"


def fmt_tokens(n: int) -> str:
    """A token count with thousands separators, or ``"unbounded"``."""
    return "unbounded" if n >= memory.UNBOUNDED else f"{n:,}"


def _per(d: Decision) -> str:
    return " per GPU" if d.tensor_parallel_size > 1 else ""


def _why_setting(d: Decision) -> list[str]:
    """Why this setting (or why none): the budget against the bytes the request needs."""
    h = memory.human_bytes
    b, per = d.budget, _per(d)
    fits = d.sequences_by_setting
    if b.kv_budget_bytes <= 0:
        return [
            f"the weights ({h(b.weights_bytes)}{per} at {d.weight_bits} bits) plus runtime "
            f"and activations ({h(b.overhead_bytes)}) exceed the usable "
            f"{h(b.usable_bytes)}{per}: nothing is left for the KV cache"
        ]
    if d.kv is None:
        return [
            f"one sequence of {d.context_len:,} tokens needs {h(d.kv_bytes_per_sequence)}{per} "
            f"even at {_label(d.types_by_setting[d.lowest_setting])}, but only "
            f"{h(b.kv_budget_bytes)} is left for the KV cache"
        ]
    need = h(d.concurrency * d.kv_bytes_per_sequence_fp16)
    if d.kv == "fp16":
        return [
            f"{d.concurrency} × {d.context_len:,} tokens at fp16 need {need}{per}, within the "
            f"{h(b.kv_budget_bytes)} left for the KV cache: no need to quantize"
        ]
    ladder = [n for n in QUALITY_LADDER[d.quality] if n in fits]
    higher = ladder[: ladder.index(d.kv)]
    types = d.types_by_setting
    return [
        f"{d.concurrency} × {d.context_len:,} tokens need {need}{per} at fp16 but only "
        f"{h(b.kv_budget_bytes)} is left; "
        + ", ".join(f"{_label(types[n])} fits {fits[n]}" for n in higher)
        + f"; {_label(types[d.kv])} fits {fits[d.kv]}"
    ]


def _why_measured(d: Decision, results: Mapping[str, Any]) -> list[str]:
    """The measured cost of the chosen setting (and of its rotated variant, when measured)."""
    t = d.kv_storage
    if t is None:
        return []
    note = _measured_note(t, results, proxy=True)
    out = [
        note
        or f"{d.kv_type} ({d.engine}) is not measured here; the same bits in kvlib's layout, "
        + quality_note(d.kv, results)
    ]
    if d.engine == "transformers" and d.kv in ("int4", "int2"):
        rot = kvresults.cache_cost(f"kvlib-{d.kv}-rot", results)
        plain = kvresults.cache_cost(f"kvlib-{d.kv}", results)
        where = kvresults.citation(kvresults.run("cache", results))
        head = f"{d.kv} with a Hadamard rotation (kvlib-{d.kv}-rot): "
        seg_r, seg_p = _segments(rot), _segments(plain)
        if seg_r and seg_p:
            overlap = min(seg_r) <= max(seg_p) and min(seg_p) <= max(seg_r)
            out.append(
                head + f"mean {_fmt_pct(sum(seg_r) / len(seg_r))} perplexity against "
                f"{_fmt_pct(sum(seg_p) / len(seg_p))} without, over {len(seg_r)} segments"
                + ("; no measurable difference" if overlap else "")
                + f" {where}"
            )
        elif "perplexity_delta_pct" in rot:
            out.append(head + f"{_fmt_pct(rot['perplexity_delta_pct'])} perplexity {where}")
    return out


def _build(s: Any) -> str:
    """A model's build in the words :func:`_why_model` compares: sliding layers, KV heads."""
    sliding = f"{s.num_sliding_layers}/{s.num_layers} sliding-window layers"
    if s.is_mla:
        return f"{sliding}, a latent (MLA) cache"
    heads = "1 KV head" if s.num_kv_heads == 1 else f"{s.num_kv_heads} KV heads"
    return f"{sliding}, {heads} of {s.head_dim} channels"


def _why_model(d: Decision, results: Mapping[str, Any], lines: list[str]) -> list[str]:
    """Which measured model the figures in ``lines`` come from, where it is not the default
    one: runs measured on several models are read from the one closest in build to the
    request's (:func:`kvlib.results.for_model`). Only runs some line cites are named."""
    cited = {
        base: model
        for base, model in results.get("measured_on", {}).items()
        if model != kvresults.DEFAULT_MODEL
        and any(kvresults.citation(kvresults.run(base, results)) in line for line in lines)
    }
    out = []
    for model in sorted(set(cited.values())):
        bases = sorted(b for b, m in cited.items() if m == model)
        title = kvresults.run(bases[0], results).get("model") or model
        out.append(
            f"the {', '.join(bases)} figures above were measured on {title} "
            f"({_build(get_spec(model))}): of the measured models the closest in build to "
            f"{d.model} ({_build(d.spec)}), so its lessons are the likelier to carry over; "
            "a 270M-parameter model on a CPU, not this model on this GPU"
        )
    return out


def _llama_cpp_note(t: EngineKV, measured: Mapping[str, float], results: Mapping[str, Any]) -> str:
    """The measured cost of a llama.cpp type against llama.cpp's own f16 cache, next to the
    level's smallest type, q4_0 (why a pair like q8_0/q4_0 can be the better buy)."""
    run = kvresults.run("llama.cpp", results)
    k, v = t.cache_types
    name = f"K {k}, V {v}" if t.mixed else t.name
    line = (
        f"{name} (llama.cpp): {_fmt_pct(measured[t.name])} perplexity on average over "
        f"{run.get('settings', {}).get('segments', '?')} segments against llama.cpp's own f16 "
        f"cache, {t.effective_bits:g} bits per value"
    )
    base = engines.planned("llama.cpp")["int4"].name  # q4_0: the level's type without measurements
    if (
        base in measured
        and t.name != base
        and t.effective_bits < engines.kv_type("llama.cpp", "q8_0").effective_bits
    ):
        line += f"; {base}, the level's smallest type, {_fmt_pct(measured[base])}"
    return line + f" ({kvresults.citation(run)})"


def _vllm_note(t: EngineKV, results: Mapping[str, Any]) -> str:
    """The measured cost of a vLLM KV dtype against vLLM's own ``auto`` cache, from vLLM's run
    (``benchmarks/bench_vllm.py``), with its per-segment range."""
    run = kvresults.run("vllm", results)
    row = run["rows"][t.name]
    seg = _segments(row)
    spread = f", {len(seg)} segments {_fmt_pct(min(seg))} … {_fmt_pct(max(seg))}" if seg else ""
    return (
        f"{t.name} (vLLM): {_fmt_pct(row['perplexity_delta_pct_mean'])} perplexity on average "
        f"against vLLM's own 16-bit cache{spread}, {t.effective_bits:g} bits per value "
        f"({kvresults.citation(run)})"
    )


def _segments(cost: Mapping[str, Any]) -> list[float]:
    """Per-segment perplexity deltas (%) of a measured cache, when there are two or more."""
    seg = cost.get("perplexity_delta_pct_segments") or []
    return [float(x) for x in seg] if len(seg) >= 2 else []


def _why_engine(d: Decision, results: Mapping[str, Any]) -> list[str]:
    """Why this engine, and idle storage (no engine advice for a request that does not fit)."""
    if d.kv is None:
        return []
    tp = d.tensor_parallel_size
    if d.engine == "vllm":
        out = [
            "several sequences or GPUs: a serving engine (vLLM) with paged KV blocks of "
            f"{VLLM_BLOCK_SIZE} tokens wastes under 4 % of the cache instead of reserving "
            "max-length buffers, batches continuously"
            + (f", and splits the model over {tp} GPUs (tensor parallelism)" if tp > 1 else "")
            + "; the plan keeps its KV cache at auto or fp8, "
            + _vllm_unmeasured()
        ]
    elif d.engine == "llama.cpp" and d.device == "cpu":
        out = ["CPU: llama.cpp (GGUF weights, KV cache types f16, q8_0, q4_0, flash attention)"]
    elif d.engine == "llama.cpp":
        where = f"over {tp} GPUs (its default layer split)" if tp > 1 else "on one GPU"
        served = (
            "one sequence {where}: llama.cpp serves it in one slot (-np 1), reserving its full "
            "context"
            if d.num_sequences == 1
            else "several sequences {where}: llama.cpp serves them in {n} parallel slots (-np), "
            "each reserving its full context (no paging)"
        )
        out = [served.format(where=where, n=d.num_sequences) + "; its KV types go down to q4_0"]
    else:
        out = ["one sequence on one GPU: transformers generate() with kvlib's cache below"]
    preferred = engine_candidates(d.device, d.concurrency, tp)
    passed = preferred[: preferred.index(d.engine)]
    if passed:
        out.insert(
            0,
            "; ".join(
                f"{e} cannot hold the whole request"
                + (
                    f" ({d.options[e].kv_type} fits {d.options[e].sequences} of {d.concurrency})"
                    if d.options[e].kv
                    else " (not one sequence fits)"
                )
                for e in passed
            )
            + f", so {d.engine}",
        )
    if d.idle_storage:
        out.append(_idle_note(d, results))
    return out


def _idle_note(d: Decision, results: Mapping[str, Any]) -> str:
    """How the plan's engine keeps idle conversations between turns (:data:`IDLE_STORAGE`), and
    what kvlib's PCA codec measured, which only a cache kvlib holds can use."""
    head = f"{d.concurrency} conversations: between turns, "
    pca = quality_note("pca", results)
    if d.idle_storage == "pca":
        return (
            head + "keep idle caches compressed with PCA transform coding (kvlib.kvtc.codec) "
            "instead of fp16 or recomputing — " + pca
        )
    if d.idle_storage == "prefix-caching":
        how = (
            "vLLM's prefix caching (on by default) keeps a finished turn's KV blocks until their "
            "memory is needed, so a returning conversation skips the prefill of what it already "
            "holds"
        )
    else:
        how = (
            "llama-server keeps each slot's cache and reuses the longest matching prefix of the "
            "next request (cache_prompt, on by default); --slot-save-path saves a slot's cache "
            "to disk and restores it"
        )
    return (
        f"{head}{how}; kvlib's PCA codec stores idle caches smaller ({pca}), but "
        f"{_ENGINE_NAMES[d.engine]} cannot load a PCA-coded cache"
    )


#: The idle storage (:data:`kvlib.plan.rule.IDLE_STORAGE`) as the plan's "KV cache:" line says it.
IDLE_SHOWN = {
    "pca": ", idle conversations stored with PCA",
    "prefix-caching": ", finished turns kept by prefix caching",
    "slot-reuse": ", each slot's cache reused across turns",
}


#: Perplexity differences (percentage points) below this are noise, not a better type: the
#: spread of a mean over four 2,048-token segments (one segment alone moves by about ±0.2).
NOISE_PCT = 0.1


def dominating(d: Decision, results: Mapping[str, Any]) -> list[EngineKV]:
    """Measured KV types of the plan's engines that beat the chosen one on both counts: no more
    bits per value and a measured perplexity cost (:func:`kvlib.plan.engines.measured_cost`) lower
    by more than :data:`NOISE_PCT`, among the levels the quality allows and the types each
    engine runs for this model here (:func:`kvlib.plan.rule.kv_types`, with llama.cpp's
    measured candidates). Best first (lowest cost, then fewest bits)."""
    t = d.kv_storage
    own = engines.measured_cost(t, results) if t is not None else None
    if t is None or own is None:
        return []
    allowed = QUALITY_LADDER[d.quality]
    out = []
    for engine in d.options:
        for level in plan_rule.kv_types(engine, d.spec, d.device):
            if level not in allowed:
                continue
            for u in engines.candidates(engine, level, results, d.device, d.spec.head_dim):
                cost = engines.measured_cost(u, results)
                if u == t or cost is None or u.effective_bits > t.effective_bits:
                    continue
                if cost < own - NOISE_PCT:
                    out.append((cost, u.effective_bits, u))
    return [u for _, _, u in sorted(out, key=lambda x: (x[0], x[1]))]


#: Why the plan's engine serves a request that another engine's better-measured type could hold.
_ENGINE_ROLE = {
    "transformers": "transformers' generate() runs one fixed batch, with no continuous batching "
    "or paging",
    "vllm": "vLLM serves several sequences with continuous batching and paged blocks",
    "llama.cpp": "llama.cpp serves them in parallel slots",
}


def _why_not(d: Decision, u: EngineKV, results: Mapping[str, Any]) -> str:
    t = d.kv_storage
    assert t is not None
    cu, ct = engines.measured_cost(u, results), engines.measured_cost(t, results)
    o = d.options[u.engine]
    head = (
        f"{u.name} on {u.engine} would store {u.effective_bits:g} bits per value (against "
        f"{t.effective_bits:g}) at a lower measured cost ({_fmt_pct(cu or 0)} against "
        f"{_fmt_pct(ct or 0)} perplexity, each against its own engine's unquantized cache on a small "
        "model, so the two compare only roughly)"
    )
    if u.engine == d.engine:
        why = "it takes the highest precision level that holds the request"
    elif o.status != "ok":
        why = f"{u.engine} does not hold the whole request ({o.sequences} of {d.concurrency} fit)"
    else:
        traffic = (
            f"{d.tensor_parallel_size} GPUs"
            if d.tensor_parallel_size > 1
            else f"{d.concurrency} concurrent sequences"
        )
        why = f"for {traffic} {_ENGINE_ROLE[d.engine]}, and {_ENGINE_ROLE[u.engine]}"
    return f"{head}; the plan keeps {t.name} on {d.engine}: {why}"


def _vllm_unmeasured() -> str:
    """vLLM's other KV dtypes, from :mod:`kvlib.plan.engine_support`, and why the plan does not use
    them."""
    others = [
        n
        for n in engine_support.vllm_kv_dtypes()
        if engine_support.vllm_dtype(n).runs_on_cuda
        and not engines.accepts("vllm", n)
        and n not in ("float16", "bfloat16")
    ]
    return (
        f"the measured ones: vLLM {engine_support.source('vllm').split(':')[0].split()[-1]} also accepts "
        f"{', '.join(others)} on GPUs (kvlib.plan.engine_support), none measured here — its CPU "
        "build accepts them but does not compute them correctly"
    )  # (the 16-bit names restate auto)


def reasons(d: Decision, results: Mapping[str, Any]) -> tuple[str, ...]:
    """Why the plan chose what it chose: the budget against the need, the measured cost, the
    shortfall when reduced, the engine and idle storage."""
    out = _why_setting(d) + _why_measured(d, results)
    out += _why_model(d, results, out)
    if d.status == "reduced":
        out.append(
            f"even at {_label(d.types_by_setting[d.lowest_setting])} (the lowest "
            f"{d.engine} runs that quality={d.quality!r} allows) only "
            f"{d.sequences_by_setting[d.lowest_setting]} of {d.concurrency} sequences fit at "
            "the full context"
        )
    better = dominating(d, results)
    if better:
        out.append(_why_not(d, better[0], results))
    return tuple(out + _why_engine(d, results))


def watch(d: Decision, results: Mapping[str, Any]) -> tuple[str, ...]:
    """What to watch with this plan: quality of low-bit caches, engine limits, replicated heads,
    contexts past the model's training, low-bit weights, worst-case counting."""
    out: list[str] = []
    spec, tp = d.spec, d.tensor_parallel_size
    if d.kv == "int4":
        out.append(
            "4-bit keys suffer from outlier channels (kvlib's cache keeps per-channel key "
            "statistics; llama.cpp's q4_0 quantizes each key in blocks of 32); check quality on "
            "your own model and task — the measured figure is from a small model"
        )
    if d.kv == "int2":
        delta = kvresults.cache_cost("kvlib-int2", results).get("perplexity_delta_pct")
        out.append(
            "2-bit caches lose noticeable quality"
            + (f" (measured {_fmt_pct(delta)} perplexity)" if delta is not None else "")
            + "; keep recent tokens in full precision and evaluate before serving"
        )
    if upgrade := lower_weight_bits_upgrade(d):
        out.append(_weights_before_cache(d, *upgrade, results))
    if spec.num_sliding_layers > 0 and d.engine == "transformers" and d.kv not in (None, "fp16"):
        out.append(
            f"sliding-window layers: kvlib's cache keeps the {spec.num_sliding_layers} "
            f"sliding layers' windows ({spec.sliding_window:,} tokens) in fp16 and quantizes the "
            f"{spec.num_full_layers} global layers only, as this plan prices it; the windows are "
            "a fixed cost, so the saving grows with the context (transformers' own "
            "QuantizedCache takes full-attention models only)"
        )
    if spec.is_mla and tp > 1:
        out.append(
            "MLA latent cache is replicated on every GPU under tensor parallelism (vLLM); "
            "data-parallel attention avoids that"
        )
    if tp > spec.num_kv_heads and not spec.is_mla:
        out.append(f"tensor parallel {tp} > {spec.num_kv_heads} KV heads: KV heads are replicated")
    max_pos = spec.max_position_embeddings
    if max_pos and d.context_len > max_pos:
        out.append(
            f"context {d.context_len:,} exceeds the model's trained {max_pos:,} tokens: quality "
            "is not guaranteed (vLLM refuses max_model_len beyond it without an override)"
        )
    if d.weight_bits < 16:
        out.append(
            f"{d.weight_bits}-bit weights cost quality of their own, which this project does not "
            f"measure; on {_ENGINE_NAMES[d.engine]}: {WEIGHTS_BY_ENGINE[d.engine, d.weight_bits]}"
        )
    if d.paging:
        o = d.options["vllm"]
        if d.typical_context is None:
            out.append(
                f"{o.sequences} of {d.concurrency} sequences fit at the full context at once (the "
                "guarantee); vLLM admits more when conversations are shorter and preempts the "
                "newest when blocks run out — give the typical length (typical_context) to "
                "size max_num_seqs"
            )
        else:
            out.append(
                f"{o.sequences} of {d.concurrency} sequences fit at the full context at once (the "
                f"guarantee); at the typical {d.typical_context:,} tokens the paged cache admits "
                f"{o.admitted}; past that vLLM preempts the newest sequence and recomputes it"
            )
    if d.engine == "transformers" and d.kv not in (None, "fp16"):
        if note := _decode_speed_note(results):
            out.append(note)
    o = d.options.get("vllm")
    if d.engine == "llama.cpp" and d.device == "gpu" and o and o.kv and d.concurrency > 1:
        vllm_type = "fp16" if o.kv == "fp16" else o.kv_type  # as _label names it
        out.append(
            "llama.cpp was chosen on the worst case, every sequence at the full context at once: "
            f"vLLM's {vllm_type} guarantees {o.sequences} of {d.concurrency} there, and its paged "
            "cache admits more when conversations are shorter, where each llama.cpp slot "
            "reserves the full context; give the typical length (typical_context) to compare "
            "the two on your traffic"
        )
    if d.eviction is not None:
        out.append(
            "token eviction by engine — "
            + "; ".join(f"{e}: {what}" for e, what in engines.TOKEN_EVICTION.items())
        )
    return tuple(out)


#: Engines as the plan's prose names them.
_ENGINE_NAMES = {"transformers": "transformers", "vllm": "vLLM", "llama.cpp": "llama.cpp"}

#: How each engine gets the plan's lower-bit weights (:mod:`kvlib.plan.settings` gives the flags).
#: transformers runs an FP8 checkpoint as FP8 only from compute capability 8.9 (Ada, Hopper) and
#: dequantizes it to bf16 below (its ``quantizer_finegrained_fp8``), which doubles the weights'
#: memory; vLLM's ``--quantization fp8`` runs weight-only through Marlin kernels on Ampere.
WEIGHTS_BY_ENGINE: dict[tuple[str, int], str] = {
    ("transformers", 8): (
        "an FP8 checkpoint on a GPU of compute capability 8.9 or newer (Ada, Hopper); below that "
        "transformers dequantizes FP8 weights to bf16, twice the memory this plan counts, so load "
        "8-bit integer weights there (bitsandbytes)"
    ),
    ("transformers", 4): "an AWQ or GPTQ int4 checkpoint",
    ("vllm", 8): (
        "--quantization fp8 quantizes a 16-bit checkpoint as it loads (W8A8 on compute "
        "capability 8.9 and newer, weight-only through Marlin kernels on Ampere); a checkpoint "
        "that ships FP8 weights (DeepSeek-V3's, for one) is read as it is"
    ),
    ("vllm", 4): "an AWQ or GPTQ int4 checkpoint (vLLM reads its quantization config)",
    ("llama.cpp", 8): "a Q8_0 GGUF",
    ("llama.cpp", 4): "a Q4_K_M GGUF",
}


#: The row of the kernel run's whole-model decode (``model_decode``) that a plan on transformers
#: with kvlib's cache runs (the torch path, not notebook 10's fused kernel), and its reference.
DECODE_ROW, DECODE_REFERENCE = "kvlib-int4 torch path", "dynamic-bf16"


def _decode_speed_note(results: Mapping[str, Any]) -> str | None:
    """The measured speed of kvlib's cache in transformers against the 16-bit cache (the kernel
    run's ``model_decode``: a whole model decoding on a GPU), or None where it is not measured."""
    run = kvresults.run("kernel", results)
    decode = run.get("model_decode")
    rows = decode.get("rows", {}) if isinstance(decode, Mapping) else {}
    q, ref = rows.get(DECODE_ROW), rows.get(DECODE_REFERENCE)
    if not (isinstance(q, Mapping) and isinstance(ref, Mapping)):
        return None
    return (
        "speed: in transformers kvlib's caches buy memory, not speed: they dequantize every "
        f"block at every step; on {decode['model']}'s shape (random weights) at "
        f"{decode['context']:,} tokens, kvlib-int4 decoded {q['decode_tokens_per_s']:g} tokens/s "
        f"against the bf16 cache's {ref['decode_tokens_per_s']:g}, and its first token came after "
        f"{q['time_to_first_token_s']:.1f} s against {ref['time_to_first_token_s']:.1f} s "
        f"(whole-model decode in transformers on {kvresults.device(run)}, measured "
        f"{run.get('date', '?')} by {run.get('source', '?')})"
    )


def _measured_note(t: EngineKV, results: Mapping[str, Any], *, proxy: bool) -> str | None:
    """The measured cost of one engine's KV type: the engine's own run (llama.cpp's, vLLM's),
    else the registry cache that stands for it in the cache run (``t.measured_as``: always for
    transformers' types, for another engine's only with ``proxy``); None when neither applies."""
    measured = engines.measured_llama_cpp(results) if t.engine == "llama.cpp" else {}
    if t.name in measured:
        return _llama_cpp_note(t, measured, results)
    if t.engine == "vllm" and t.level != "fp16" and t.name in engines.measured_vllm(results):
        return _vllm_note(t, results)
    if t.measured_as is not None and t.level is not None and (proxy or t.engine == "transformers"):
        return quality_note(t.level, results, t.measured_as, label=_label(t))
    return None


def _weights_before_cache(
    d: Decision, weight_bits: int, engine: str, setting: str, results: Mapping[str, Any]
) -> str:
    """The watch line for a plan that fits only below 8-bit KV while lower-bit weights would
    let the whole request fit at a higher KV level: both KV types' measured costs, and the
    weights' cost left to the user (this project does not measure it)."""
    t = plan_rule.kv_types(engine, d.spec, d.device)[setting]
    line = (
        f"{weight_bits}-bit weights would leave the cache more room: with weight_bits="
        f"{weight_bits} the whole request fits at {setting} ({_label(t)} on {engine}) instead of "
        f"{d.kv} ({d.kv_type} on {d.engine})"
    )
    pair = (t, d.kv_storage)
    notes = [n for n in (_measured_note(x, results, proxy=False) for x in pair if x) if n]
    if notes:
        line += ". The KV side of that trade, as measured: " + "; ".join(notes)
    return line + ". Weigh it against the weights' own cost on your model (not measured here)"


def _sequences(n: int) -> str:
    return "sequence" if n == 1 else "sequences"


def suggestions(
    d: Decision, fb: Fallbacks, results: Mapping[str, Any] | None = None
) -> tuple[str, ...]:
    """What would fit a request that does not (``()`` when it does), from :func:`fallbacks
    <kvlib.plan.fallbacks.fallbacks>`, and last, when it would hold the request, token eviction
    with its measured cost from ``results`` (:func:`eviction_note`)."""
    if d.fits:
        return ()
    lowest, n = d.lowest_setting, d.concurrency
    lowest_type = _label(d.types_by_setting[lowest])
    out: list[str] = []
    if d.kv is not None:
        out.append(
            f"{d.sequences_by_setting[lowest]} concurrent "
            f"{_sequences(d.sequences_by_setting[lowest])} at {d.context_len:,} tokens with "
            f"{lowest_type}"
        )
    if fb.context_len > 0:
        cap = " (the model's maximum)" if fb.context_len == d.spec.max_position_embeddings else ""
        out.append(
            f"{n} {_sequences(n)} at up to {fb.context_len:,} tokens{cap} with {lowest_type}"
        )
    if fb.quality:
        out.append(f"quality={fb.quality[0]!r}: the whole request with {fb.quality[1]}")
    if fb.weight_bits:
        out.append(f"weight_bits={fb.weight_bits[0]}: the whole request with {fb.weight_bits[1]}")
    if d.device == "gpu" and d.gpu_memory_gb > 0:
        if fb.num_gpus:
            g, fit = fb.num_gpus
            split = (
                f"vLLM tensor_parallel_size={g}"
                if fit.engine == "vllm"
                else "llama.cpp's layer split"
            )
            out.append(f"num_gpus={g} ({split}): the whole request with {fit}")
        else:
            out.append(
                f"more than {TP_CANDIDATES[-1]} GPUs: pipeline parallelism across nodes "
                "(vLLM pipeline_parallel_size), or a smaller model"
            )
        if fb.num_gpus_and_weight_bits:
            g, wb, fit = fb.num_gpus_and_weight_bits
            out.append(f"num_gpus={g} with weight_bits={wb}: the whole request with {fit}")
    tp = d.tensor_parallel_size
    what = f"{tp} GPUs of" if tp > 1 else ("RAM of" if d.device == "cpu" else "a GPU with")
    out.append(f"{what} at least {fb.memory_gib:.3g} GiB: the whole request with {lowest_type}")
    note = eviction_note(d, {} if results is None else results)
    return tuple(out + ([note] if note else []))


#: The eviction run's families at one budget, preferred first: int4 storage keeps more tokens
#: in the same bytes; ``quality="max"`` allows no quantized storage.
_EVICTION_FAMILIES = {"max": ("eviction",)}
_EVICTION_DEFAULT = ("eviction+int4", "eviction")


def _accuracy(row: Mapping[str, Any], key: str, ci: bool = True) -> str | None:
    """``0.95 [0.76, 0.99]``: a retrieval accuracy (and its interval), when measured."""
    acc, interval = row.get(key), row.get(f"{key}_ci")
    if not isinstance(acc, (int, float)):
        return None
    if ci and isinstance(interval, (list, tuple)) and len(interval) == 2:
        return f"{acc:.2f} [{interval[0]:.2f}, {interval[1]:.2f}]"
    return f"{acc:.2f}"


def _eviction_figures(run: Mapping[str, Any], name: str) -> str:
    """The measured cost of one eviction row: perplexity, then retrieval at every context the
    run measured (single pass key, then several keys), against the uncompressed reference row."""
    rows = run["rows"]
    row = rows[name]
    # the reference: the uncompressed DynamicCache (cache_registry.reference_name: dynamic-fp32 …)
    try:
        ref = rows[str(kvresults.reference(run))]
    except ValueError:  # a run without its reference row: the figures stand alone
        ref = {}
    parts = []
    settings = run.get("settings", {})
    tokens, segs = settings.get("tokens"), row.get("perplexity_delta_pct_segments")
    on = f" on {tokens:,} tokens" if isinstance(tokens, int) else ""
    if isinstance(row.get("perplexity_delta_pct_mean"), (int, float)) and isinstance(segs, list):
        on = f" on {len(segs)} × {tokens:,} tokens" if isinstance(tokens, int) else ""
        parts.append(f"{_fmt_pct(row['perplexity_delta_pct_mean'])} perplexity (mean{on})")
    elif isinstance(row.get("perplexity_delta_pct"), (int, float)):
        parts.append(f"{_fmt_pct(row['perplexity_delta_pct'])} perplexity{on}")
    columns = RetrievalColumn.of(row)
    for multi, label in ((False, "pass-key retrieval"), (True, "multi-key retrieval")):
        at = []
        for c in sorted((c for c in columns if c.multi == multi), key=lambda c: c.context):
            acc, base = _accuracy(row, str(c)), _accuracy(ref, str(c), ci=False)
            if acc:
                vs = f" vs {base} uncompressed" if base else ""
                at.append(f"{acc}{vs} at {c.context:,} tokens")
        if at:
            parts.append(f"{label} {', '.join(at)}")
    return ", ".join(parts) or "no figures"


def eviction_note(d: Decision, results: Mapping[str, Any]) -> str | None:
    """One line when token eviction would hold a request that does not fit
    (:attr:`Decision.eviction <kvlib.plan.rule.Decision.eviction>`), else None: the budget, the
    cache the eviction run found best there (``best["1/k eviction+int4"]``, else
    ``best["1/k eviction"]``; float16 only for ``quality="max"``) with its measured perplexity
    and retrieval, or that the run did not measure that budget — and what eviction costs."""
    o = d.eviction
    if o is None:
        return None
    run = kvresults.run("eviction", results)
    families = _EVICTION_FAMILIES.get(d.quality, _EVICTION_DEFAULT)
    try:  # a run without a best group, or naming a row it lacks, has no figures to cite
        best = kvresults.best(run)
    except ValueError:
        best = {}
    found = (best.get(BestKey(Fraction(1, o.keep), f)) for f in families)
    key = next((k for k in found if k is not None), None)
    where = f"{o.fraction} of the fp16 bytes per sequence"
    if key is not None:
        what = (
            f"kvlib's {key.cache} at {where} ({o.engine} + kvlib's cache; "
            f"{kvresults.citation(run)}: {_eviction_figures(run, str(key))})"
        )
    else:
        cache = "evict-<policy>" + ("-int4" if "eviction+int4" in families else "")
        budgets = run.get("settings", {}).get("budgets") or []
        measured = (
            f"not measured at {o.fraction}: the eviction run has {', '.join(budgets)}"
            if run and budgets
            else "not measured yet (benchmarks/bench_eviction.py)"
        )
        what = f"kvlib's {cache} caches at {where} ({o.engine} + kvlib's cache; {measured})"
    return (
        f"token eviction: the whole request with {what} — only for work that does not need "
        "facts from far back: eviction drops tokens, and a dropped fact is gone"
    )


def alternatives(d: Decision) -> tuple[str, ...]:
    """One line per other engine: the KV type it would run and how many sequences fit at it
    (its :class:`~kvlib.plan.rule.EngineOption`, whose settings the plan also prints)."""
    out = []
    for engine, o in d.options.items():
        if engine == d.engine:
            continue
        if o.kv is None:
            out.append(f"{engine}: not one sequence fits at any KV type it runs")
            continue
        out.append(
            f"{engine}: {o.kv_type} ({o.effective_bits:g} bits per value) fits {o.sequences} of "
            f"{d.concurrency} {_sequences(d.concurrency)} at {d.context_len:,} tokens"
            + (" (one process, no paging)" if engine == "transformers" else "")
        )
    return tuple(out)


def buys(d: Decision) -> str:
    """One line: what the chosen setting buys against fp16 (sequences, or context)."""
    if d.kv is None:
        return "nothing yet: not one sequence fits (see suggestions)"
    ctx, ctx16 = fmt_tokens(d.max_context), fmt_tokens(d.max_context_fp16)
    if d.kv == "fp16":
        return (
            f"fp16 needs no trade: {d.max_concurrency} {_sequences(d.max_concurrency)} fit at "
            f"{d.context_len:,} tokens, or {d.concurrency} at up to {ctx} tokens"
        )
    n, n16 = d.max_concurrency, d.max_concurrency_fp16
    gain = f"{n / n16:.3g}× as many" if n16 else "where fp16 fits none"
    return (
        f"{d.kv_type} fits {n} {_sequences(n)} at {d.context_len:,} tokens against {n16} at fp16 "
        f"({gain}), or {d.concurrency} at up to {ctx} tokens against {ctx16}"
    )


def summary(
    d: Decision,
    reasons: tuple[str, ...] = (),
    watch: tuple[str, ...] = (),
    suggestions: tuple[str, ...] = (),
) -> str:
    """A few lines of plain text: the request, the decision, the budget, what it buys, and the
    reasons, watch-outs and suggestions given."""
    h = memory.human_bytes
    lines = [
        f"{d.model} on {d.num_gpus} × {h(round(d.gpu_memory_gb * memory.GIB))} {d.device.upper()}"
        f", context {d.context_len:,}, {d.concurrency} concurrent, quality "
        f"{d.quality}, {d.weight_bits}-bit weights",
        f"status: {d.status}"
        + (f" ({d.max_concurrency} of {d.concurrency} fit)" if d.status == "reduced" else ""),
    ]
    if d.kv and d.kv_storage:
        lines.append(
            f"KV cache: {d.kv_type} on {d.engine}, {d.kv_storage.effective_bits:g} bits per value"
            + (" with its scales" if d.kv_storage.effective_bits != d.kv_storage.bits else "")
            + (", paged" if d.paging else "")
            + IDLE_SHOWN.get(d.idle_storage, "")
            + (
                f", split over {d.tensor_parallel_size} GPUs"
                + (" (tensor parallel)" if d.engine == "vllm" else " (layers)")
                if d.tensor_parallel_size > 1
                else ""
            )
        )
    lines.append("budget per device: " + ", ".join(f"{k} {h(v)}" for k, v in d.budget.rows()))
    if d.kv:
        lines.append(
            f"KV per sequence: {h(d.kv_bytes_per_sequence)} "
            f"(fp16 {h(d.kv_bytes_per_sequence_fp16)}); sequences at full context: "
            f"{d.max_concurrency} (fp16 {d.max_concurrency_fp16}); max context for "
            f"{d.concurrency}: {fmt_tokens(d.max_context)} (fp16 {fmt_tokens(d.max_context_fp16)})"
        )
    lines.append(f"buys: {buys(d)}")
    lines += [f"why: {r}" for r in reasons]
    lines += [f"watch: {w}" for w in watch]
    lines += [f"would fit: {s}" for s in suggestions]
    lines += [f"also: {a}" for a in alternatives(d)]
    return "\n".join(lines)
