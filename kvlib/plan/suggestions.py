"""What would fit a request that does not, in words, and whether token eviction would hold it.

Introduced in notebook 08. :func:`suggestions` puts :func:`kvlib.plan.fallbacks.fallbacks` (the
numbers: a shorter context, the next quality level, lower-bit weights, more GPUs, more memory)
into the plan's "would fit" lines; last, when token eviction would hold the request
(:attr:`Decision.eviction <kvlib.plan.rule.Decision.eviction>`), :func:`eviction_note` says so,
with the eviction run's measured perplexity and retrieval: offered there, never chosen.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from kvlib import results as kvresults
from kvlib.keys import BestKey, RetrievalColumn
from kvlib.plan.fallbacks import Fallbacks
from kvlib.plan.measured import fmt_pct, kv_label
from kvlib.plan.rule import TP_CANDIDATES, Decision

__all__ = ["eviction_note", "sequences_word", "suggestions"]


def sequences_word(n: int) -> str:
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
    lowest_type = kv_label(d.types_by_setting[lowest])
    out: list[str] = []
    if d.kv is not None:
        out.append(
            f"{d.sequences_by_setting[lowest]} concurrent "
            f"{sequences_word(d.sequences_by_setting[lowest])} at {d.context_len:,} tokens with "
            f"{lowest_type}"
        )
    if fb.context_len > 0:
        cap = " (the model's maximum)" if fb.context_len == d.spec.max_position_embeddings else ""
        out.append(
            f"{n} {sequences_word(n)} at up to {fb.context_len:,} tokens{cap} with {lowest_type}"
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
    out.append(f"{what} at least {fb.memory_gib:.3g} GiB: the whole request with {fb.memory_fit}")
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
        parts.append(f"{fmt_pct(row['perplexity_delta_pct_mean'])} perplexity (mean{on})")
    elif isinstance(row.get("perplexity_delta_pct"), (int, float)):
        parts.append(f"{fmt_pct(row['perplexity_delta_pct'])} perplexity{on}")
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
    where = (
        f"{o.fraction} of the global layers' fp16 bytes per sequence, the sliding windows kept "
        "whole in fp16"
        if o.window_bytes
        else f"{o.fraction} of the fp16 bytes per sequence"
    )
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
