"""The project's measurements of a KV setting, in words: what a plan cites, and from where.

Introduced in notebook 08. :mod:`kvlib.plan.text` and :mod:`kvlib.plan.suggestions` quote these
lines: the measured perplexity cost and byte ratio of a KV setting (:func:`quality_note`) or of
one engine's KV type, from the engine's own run where there is one (:func:`measured_note`), and
the measured decode speed of kvlib's cache (:func:`decode_speed_note`). A figure that is missing
is said to be "not measured"; no number is invented. :func:`results_to_cite` picks the results
file a plan reads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvlib import results as kvresults
from kvlib.plan import engines
from kvlib.plan.engines import EngineKV
from kvlib.plan.rule import KV_SETTINGS

__all__ = [
    "DECODE_REFERENCE",
    "DECODE_ROWS",
    "decode_speed_note",
    "fmt_pct",
    "kv_label",
    "measured_note",
    "quality_note",
    "results_to_cite",
    "segment_deltas",
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


def kv_label(t: EngineKV) -> str:
    """How a plan names an engine's KV type: ``fp16`` for the full-precision ones (vLLM's
    ``auto``, llama.cpp's ``f16``), else the engine's own name (``fp8``, ``q4_0``)."""
    return "fp16" if t.level == "fp16" else t.name


#: The PCA run's ratio over a hybrid model's global layers (``benchmarks/bench_pca.py``).
GLOBAL_RATIO = "x_smaller_than_fp16_global_layers"


def fmt_pct(x: float) -> str:
    """A signed percentage to three significant figures: ``+2.25 %``."""
    return f"{x:+.3g} %"


def quality_note(
    setting: str,
    results: Mapping[str, Any],
    cache_name: str | None = None,
    label: str | None = None,
) -> str:
    """One line: the measured cost of a KV setting (``cache_name``, else the level's
    :data:`KV_SETTINGS` cache, by registry name, in the cache benchmark's run) or of ``"pca"``
    storage (the cross-layer rows of the PCA run; on a hybrid model's run their ratio over the
    global layers), or that it is not measured; ``label`` names
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
        # a hybrid model's run: the global layers are coded, the sliding windows kept whole,
        # and a short prefix is mostly windows; the ratio over the global layers is the one
        # that holds at long context
        hybrid = any(GLOBAL_RATIO in r for r in rows)
        key = GLOBAL_RATIO if hybrid else "x_smaller_than_fp16"
        ratios = [r[key] for r in rows if key in r]
        deltas = [r["perplexity_delta_pct"] for r in rows if "perplexity_delta_pct" in r]
        if not ratios or not deltas:
            return "pca: storage figures not measured yet (benchmarks/bench_pca.py)"
        where = " over the global layers (sliding windows kept whole)" if hybrid else ""
        return (
            f"pca: {min(ratios):.3g}–{max(ratios):.3g}× smaller than fp16{where} at "
            f"{fmt_pct(min(deltas))} … {fmt_pct(max(deltas))} perplexity "
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
        parts.append(f"{fmt_pct(cost['perplexity_delta_pct'])} perplexity")
    if "perplexity_delta_pct_mean" in cost:
        parts.append(f"{fmt_pct(cost['perplexity_delta_pct_mean'])} on average over segments")
    seg = segment_deltas(cost)
    if seg:
        lo, hi = min(seg), max(seg)
        parts.append(
            f"{len(seg)} segments {fmt_pct(lo)} … {fmt_pct(hi)}"
            + (": no measurable cost" if lo <= 0 <= hi else "")
        )
    if "x_smaller_than_fp16" in cost:
        parts.append(f"{cost['x_smaller_than_fp16']:.3g}× smaller than fp16")
    head = name if label == name else f"{label or setting} ({name})"
    if not parts:
        return f"{head}: quality cost not measured yet (benchmarks/bench_cache.py)"
    return f"{head}: {', '.join(parts)} {kvresults.citation(run)}"


def _llama_cpp_note(t: EngineKV, measured: Mapping[str, float], results: Mapping[str, Any]) -> str:
    """The measured cost of a llama.cpp type against llama.cpp's own f16 cache, next to the
    level's smallest type, q4_0 (why a pair like q8_0/q4_0 can be the better buy)."""
    run = kvresults.run("llama.cpp", results)
    k, v = t.cache_types
    name = f"K {k}, V {v}" if t.mixed else t.name
    line = (
        f"{name} (llama.cpp): {fmt_pct(measured[t.name])} perplexity on average over "
        f"{run.get('settings', {}).get('segments', '?')} segments against llama.cpp's own f16 "
        f"cache, {t.effective_bits:g} bits per value"
    )
    base = engines.planned("llama.cpp")["int4"].name  # q4_0: the level's type without measurements
    if (
        base in measured
        and t.name != base
        and t.effective_bits < engines.kv_type("llama.cpp", "q8_0").effective_bits
    ):
        line += f"; {base}, the level's smallest type, {fmt_pct(measured[base])}"
    return line + f" ({kvresults.citation(run)})"


def _vllm_note(t: EngineKV, results: Mapping[str, Any]) -> str:
    """The measured cost of a vLLM KV dtype against vLLM's own ``auto`` cache, from vLLM's run
    (``benchmarks/bench_vllm.py``), with its per-segment range."""
    run = kvresults.run("vllm", results)
    row = run["rows"][t.name]
    seg = segment_deltas(row)
    spread = f", {len(seg)} segments {fmt_pct(min(seg))} … {fmt_pct(max(seg))}" if seg else ""
    return (
        f"{t.name} (vLLM): {fmt_pct(row['perplexity_delta_pct_mean'])} perplexity on average "
        f"against vLLM's own 16-bit cache{spread}, {t.effective_bits:g} bits per value "
        f"({kvresults.citation(run)})"
    )


def segment_deltas(cost: Mapping[str, Any]) -> list[float]:
    """Per-segment perplexity deltas (%) of a measured cache, when there are two or more."""
    seg = cost.get("perplexity_delta_pct_segments") or []
    return [float(x) for x in seg] if len(seg) >= 2 else []


#: The rows of the kernel run's whole-model decode (``model_decode``) that a plan on transformers
#: with kvlib's cache runs: notebook 10's fused kernel (the cache's default on a CUDA GPU with
#: Triton), then the torch path that dequantizes first (on a CPU, or ``fused_decode=False``),
#: and their reference.
DECODE_ROWS, DECODE_REFERENCE = ("kvlib-int4 fused", "kvlib-int4 torch path"), "dynamic-bf16"


def decode_speed_note(results: Mapping[str, Any]) -> str | None:
    """The measured speed of kvlib's cache in transformers against the 16-bit cache (the kernel
    run's ``model_decode``: a whole model decoding on a GPU), fused kernel and torch path, or
    None where they are not measured."""
    run = kvresults.run("kernel", results)
    decode = run.get("model_decode")
    rows = decode.get("rows", {}) if isinstance(decode, Mapping) else {}
    (fused, torch_path), ref = (rows.get(n) for n in DECODE_ROWS), rows.get(DECODE_REFERENCE)
    if not all(isinstance(r, Mapping) for r in (fused, torch_path, ref)):
        return None
    return (
        "speed: in transformers kvlib's caches buy memory, not speed: on "
        f"{decode['model']}'s shape (random weights) at {decode['context']:,} tokens, kvlib-int4 "
        f"decoded {fused['decode_tokens_per_s']:g} tokens/s with its default fused kernel "
        f"({torch_path['decode_tokens_per_s']:g} on the torch path, which dequantizes every block "
        f"at every step) against the bf16 cache's {ref['decode_tokens_per_s']:g}, and its first "
        f"token came after {fused['time_to_first_token_s']:.1f} s "
        f"({torch_path['time_to_first_token_s']:.1f} s) against "
        f"{ref['time_to_first_token_s']:.1f} s (whole-model decode in transformers on "
        f"{kvresults.device(run)}, measured {run.get('date', '?')} by {run.get('source', '?')})"
    )


def measured_note(t: EngineKV, results: Mapping[str, Any], *, proxy: bool) -> str | None:
    """The measured cost of one engine's KV type: the engine's own run (llama.cpp's, vLLM's),
    else the registry cache that stands for it in the cache run (``t.measured_as``: always for
    transformers' types, for another engine's only with ``proxy``); None when neither applies."""
    measured = engines.measured_llama_cpp(results) if t.engine == "llama.cpp" else {}
    if t.name in measured:
        return _llama_cpp_note(t, measured, results)
    if t.engine == "vllm" and t.level != "fp16" and t.name in engines.measured_vllm(results):
        return _vllm_note(t, results)
    if t.measured_as is not None and t.level is not None and (proxy or t.engine == "transformers"):
        return quality_note(t.level, results, t.measured_as, label=kv_label(t))
    return None
