"""A plan in a few lines of plain text: the request, the decision, the budget, what it buys.

Introduced in notebook 08. :func:`summary` is what the CLI and the notebooks print (library code
never prints): the request and the decision, the budget per device, what the setting buys
against fp16 (:func:`buys`), the reasons and watch-outs (:mod:`kvlib.plan.text`), what would fit
(:mod:`kvlib.plan.suggestions`) and what the other engines would do (:func:`alternatives`).
"""

from __future__ import annotations

from kvlib import memory
from kvlib.plan.rule import Decision
from kvlib.plan.suggestions import sequences_word

__all__ = ["IDLE_SHOWN", "alternatives", "buys", "fmt_tokens", "summary"]


def fmt_tokens(n: int) -> str:
    """A token count with thousands separators, or ``"unbounded"``."""
    return "unbounded" if n >= memory.UNBOUNDED else f"{n:,}"


#: The idle storage (:data:`kvlib.plan.rule.IDLE_STORAGE`) as the plan's "KV cache:" line says it.
IDLE_SHOWN = {
    "pca": ", idle conversations stored with PCA",
    "prefix-caching": ", finished turns kept by prefix caching",
    "slot-reuse": ", each slot's cache reused across turns",
}


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
            f"{d.concurrency} {sequences_word(d.concurrency)} at {d.context_len:,} tokens"
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
            f"fp16 needs no trade: {d.max_concurrency} {sequences_word(d.max_concurrency)} fit at "
            f"{d.context_len:,} tokens, or {d.concurrency} at up to {ctx} tokens"
        )
    n, n16 = d.max_concurrency, d.max_concurrency_fp16
    gain = f"{n / n16:.3g}× as many" if n16 else "where fp16 fits none"
    return (
        f"{d.kv_type} fits {n} {sequences_word(n)} at {d.context_len:,} tokens "
        f"against {n16} at fp16 ({gain}), or {d.concurrency} at up to {ctx} tokens against {ctx16}"
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
        f"{d.quality}, {d.weight_bits}-bit weights"
        + (f", engines {'/'.join(d.engines)} only" if d.engines is not None else "")
        + (
            f", compute capability {d.budget.compute_capability[0]}.{d.budget.compute_capability[1]}"
            if d.budget.compute_capability is not None
            else ""
        ),
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
