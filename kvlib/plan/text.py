"""The planner's decision in words: why it chose what it chose, and what to watch.

Introduced in notebook 08. :func:`kvlib.plan.planner.recommend` builds a :class:`~kvlib.plan.planner.Plan` from
a :class:`~kvlib.plan.rule.Decision` (the numbers) and these sentences. Reasons cite the
project's measured perplexity cost and byte ratio of the chosen setting
(:mod:`kvlib.plan.measured`) and say "not measured" where a figure is missing; no number is
invented. What would fit a request that does not, token eviction included, is
:mod:`kvlib.plan.suggestions`; the few lines the CLI and the notebooks print,
:mod:`kvlib.plan.summary`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvlib import memory
from kvlib import results as kvresults
from kvlib.plan import engine_support, engines
from kvlib.plan import rule as plan_rule
from kvlib.plan.budget import VLLM_BLOCK_SIZE
from kvlib.plan.engines import EngineKV
from kvlib.plan.fallbacks import lower_weight_bits_upgrade
from kvlib.plan.measured import (
    decode_speed_note,
    fmt_pct,
    kv_label,
    measured_note,
    quality_note,
    segment_deltas,
)
from kvlib.plan.rule import QUALITY_LADDER, Decision, engine_candidates
from kvlib.specs import get_spec

__all__ = ["NOISE_PCT", "dominating", "reasons", "watch"]


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
            f"even at {kv_label(d.types_by_setting[d.lowest_setting])}, but only "
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
        + ", ".join(f"{kv_label(types[n])} fits {fits[n]}" for n in higher)
        + f"; {kv_label(types[d.kv])} fits {fits[d.kv]}"
    ]


def _why_measured(d: Decision, results: Mapping[str, Any]) -> list[str]:
    """The measured cost of the chosen setting (and of its rotated variant, when measured)."""
    t = d.kv_storage
    if t is None:
        return []
    note = measured_note(t, results, proxy=True)
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
        seg_r, seg_p = segment_deltas(rot), segment_deltas(plain)
        if seg_r and seg_p:
            overlap = min(seg_r) <= max(seg_p) and min(seg_p) <= max(seg_r)
            out.append(
                head + f"mean {fmt_pct(sum(seg_r) / len(seg_r))} perplexity against "
                f"{fmt_pct(sum(seg_p) / len(seg_p))} without, over {len(seg_r)} segments"
                + ("; no measurable difference" if overlap else "")
                + f" {where}"
            )
        elif "perplexity_delta_pct" in rot:
            out.append(head + f"{fmt_pct(rot['perplexity_delta_pct'])} perplexity {where}")
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


def _why_engine(d: Decision, results: Mapping[str, Any]) -> list[str]:
    """Why this engine, and idle storage (no engine advice for a request that does not fit)."""
    if d.kv is None:
        return []
    tp = d.tensor_parallel_size
    if d.engine == "vllm":
        served = (
            "several sequences or GPUs: a serving engine (vLLM) with paged KV blocks of "
            f"{VLLM_BLOCK_SIZE} tokens wastes under 4 % of the cache (the vLLM paper) instead of reserving "
            "max-length buffers, batches continuously"
            + (f", and splits the model over {tp} GPUs (tensor parallelism)" if tp > 1 else "")
            if d.concurrency > 1 or tp > 1
            else "one sequence: a serving engine (vLLM) serves it over HTTP with attention "
            "kernels that read its KV types directly, where transformers' generate() is a "
            "library call; its paged cache leaves room for more conversations"
        )
        out = [
            served
            + "; the plan keeps its KV cache at auto or fp8, "
            + _vllm_unmeasured()
            + _turboquant_measured(results)
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
        restricted = d.engines is not None and not {"vllm", "llama.cpp"} <= set(d.engines)
        out = [
            (
                "one sequence on one GPU, on the engine the request allows"
                if restricted
                else "one sequence on one GPU that neither serving engine holds"
            )
            + ": transformers generate() with kvlib's cache below, whose types go down to "
            "int2; it buys memory, not speed, and serves no one (no server, no batching): a "
            "lab's or a single script's setting"
        ]
    preferred = [
        e for e in engine_candidates(d.device, d.concurrency, tp, d.engines) if e in d.options
    ]
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
        for level in plan_rule.kv_types(engine, d.spec, d.device, d.budget.compute_capability):
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
        f"{t.effective_bits:g}) at a lower measured cost ({fmt_pct(cu or 0)} against "
        f"{fmt_pct(ct or 0)} perplexity, each against its own engine's unquantized cache on a small "
        "model, so the two compare only roughly)"
    )
    if u.engine == d.engine:
        why = "it takes the highest precision level that holds the request"
    elif o.status != "ok":
        why = f"{u.engine} does not hold the whole request ({o.sequences} of {d.concurrency} fit)"
    elif d.concurrency == 1 and d.tensor_parallel_size == 1:
        why = (
            "for one sequence the plan prefers a serving engine and keeps transformers for what "
            "neither serving engine holds (in transformers kvlib's caches buy memory, not speed: "
            "notebook 10)"
        )
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
    ]  # (the 16-bit names restate auto)
    wrong = set(engine_support.vllm_cpu_wrong())
    checked = [n for n in others if n in wrong]
    unchecked = [n for n in others if n not in wrong]
    version = engine_support.source("vllm").split(":")[0].split()[-1]
    return (
        f"the measured ones: vLLM {version} also accepts {', '.join(others)} on GPUs "
        "(kvlib.plan.engine_support), none run in vLLM here"
        + (
            f"; its CPU build runs {', '.join(checked)} but computes them wrongly"
            if checked
            else ""
        )
        + (f"; {', '.join(unchecked)} were not run here (they need a GPU)" if unchecked else "")
    )


def _turboquant_measured(results: Mapping[str, Any]) -> str:
    """vLLM's TurboQuant dtypes as kvlib's re-implementation of their layout measured them (run
    ``"turboquant"`` of the model closest in build, :func:`kvlib.results.for_model`): each
    dtype's mean perplexity cost and bits per value, cited with model, engine and device, and
    why that does not make them the plan's choice; ``""`` without the run."""
    tq = kvresults.run("turboquant", results)
    rows = tq.get("rows", {})
    if not isinstance(rows, Mapping):
        return ""
    figures = []
    for dtype in engine_support.vllm_kv_dtypes():
        row = rows.get(dtype.replace("_", "-"))  # the registry's name of vLLM's layout
        if not dtype.startswith("turboquant") or not isinstance(row, Mapping):
            continue
        delta, bits = row.get("perplexity_delta_pct_mean"), row.get("bits_per_value_at_4096")
        if isinstance(delta, int | float) and isinstance(bits, int | float):
            figures.append(f"{dtype} {delta:+.2f} % at {bits:.2f} bits per value")
    if not figures:
        return ""
    segments = tq.get("settings", {}).get("segments")
    mean = f" (mean of {segments} segments)" if isinstance(segments, int) else ""
    return (
        "; kvlib's re-implementation of the TurboQuant layouts (notebook 05) costs "
        + ", ".join(figures)
        + f" in perplexity{mean}, {kvresults.citation(tq)}: a measure of the codecs, not of "
        "vLLM's TURBOQUANT attention backend (CUDA), whose speed and output were not checked "
        "here, so the plan does not set them"
    )


def reasons(d: Decision, results: Mapping[str, Any]) -> tuple[str, ...]:
    """Why the plan chose what it chose: the budget against the need, the measured cost, the
    shortfall when reduced, the engine and idle storage."""
    out = _why_setting(d) + _why_measured(d, results)
    out += _why_model(d, results, out)
    if d.status == "reduced":
        out.append(
            f"even at {kv_label(d.types_by_setting[d.lowest_setting])} (the lowest "
            f"{d.engine} runs that quality={d.quality!r} allows) only "
            f"{d.sequences_by_setting[d.lowest_setting]} of {d.concurrency} sequences fit at "
            "the full context"
        )
    better = dominating(d, results)
    if better:
        out.append(_why_not(d, better[0], results))
    return tuple(out + _why_engine(d, results))


def _paging_note(d: Decision) -> str:
    """The watch line for a paged plan (vLLM): the sequences guaranteed at the full context, and
    what the paged cache admits at the typical length, or that giving it would size
    ``max_num_seqs``."""
    o = d.options["vllm"]
    if d.concurrency == 1 and d.typical_context is None:
        return (
            f"vLLM sizes max_num_seqs to the one sequence asked for; its cache holds "
            f"{o.sequences} at the full context, so a second conversation would fit"
            if o.sequences > 1
            else "vLLM sizes max_num_seqs to the one sequence asked for, which its cache holds "
            "at the full context"
        )
    if d.typical_context is None:
        return (
            f"{o.sequences} of {d.concurrency} sequences fit at the full context at once (the "
            "guarantee); vLLM admits more when conversations are shorter and preempts the "
            "newest when blocks run out — give the typical length (typical_context) to "
            "size max_num_seqs"
        )
    return (
        f"{o.sequences} of {d.concurrency} sequences fit at the full context at once (the "
        f"guarantee); at the typical {d.typical_context:,} tokens the paged cache admits "
        f"{o.admitted}; past that vLLM preempts the newest sequence and recomputes it"
    )


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
            + (f" (measured {fmt_pct(delta)} perplexity)" if delta is not None else "")
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
            "MLA latent cache is replicated on every GPU under tensor parallelism (vLLM), and "
            "this plan prices it so: each GPU holds every sequence's latent. vLLM's "
            f"data-parallel attention (--data-parallel-size {tp} in place of "
            f"--tensor-parallel-size {tp}, with --enable-expert-parallel for a mixture of "
            "experts) keeps each sequence's latent on one GPU, so the same GPUs hold more "
            "sequences; the planner does not model that layout (its weights split "
            "differently), so read this plan as the tensor-parallel one"
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
            f"measure; on {_ENGINE_NAMES[d.engine]}: {_weights_note(d)}"
        )
    if d.paging:
        out.append(_paging_note(d))
    if d.engine == "transformers" and d.kv not in (None, "fp16"):
        if note := decode_speed_note(results):
            out.append(note)
    o = d.options.get("vllm")
    if d.engine == "llama.cpp" and d.device == "gpu" and o and o.kv and d.concurrency > 1:
        vllm_type = "fp16" if o.kv == "fp16" else o.kv_type  # as kv_label names it
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
def _weights_note(d: Decision) -> str:
    """How ``d.engine`` gets the plan's lower-bit weights (:data:`WEIGHTS_BY_ENGINE`), or that the
    model's own checkpoint already has them."""
    if d.spec.checkpoint_weight_bits == d.weight_bits:
        return (
            f"{d.model} ships {d.weight_bits}-bit (FP8) weights, which the engine loads as they "
            "are (no --quantization flag)"
        )
    return WEIGHTS_BY_ENGINE[d.engine, d.weight_bits]


WEIGHTS_BY_ENGINE: dict[tuple[str, int], str] = {
    ("transformers", 8): (
        "an FP8 checkpoint on a GPU of compute capability 8.9 or newer (Ada, Hopper); below that "
        "transformers dequantizes FP8 weights to bf16, twice the memory this plan counts, so load "
        "8-bit integer weights there (bitsandbytes)"
    ),
    ("transformers", 4): "an AWQ or GPTQ int4 checkpoint",
    ("vllm", 8): (
        "--quantization fp8 quantizes a 16-bit checkpoint as it loads (W8A8 on compute "
        "capability 8.9 and newer, weight-only through Marlin kernels on Ampere)"
    ),
    ("vllm", 4): "an AWQ or GPTQ int4 checkpoint (vLLM reads its quantization config)",
    ("llama.cpp", 8): "a Q8_0 GGUF",
    ("llama.cpp", 4): "a Q4_K_M GGUF",
}


def _weights_before_cache(
    d: Decision, weight_bits: int, engine: str, setting: str, results: Mapping[str, Any]
) -> str:
    """The watch line for a plan that fits only below 8-bit KV while lower-bit weights would
    let the whole request fit at a higher KV level: both KV types' measured costs, and the
    weights' cost left to the user (this project does not measure it)."""
    t = plan_rule.kv_types(engine, d.spec, d.device, d.budget.compute_capability)[setting]
    line = (
        f"{weight_bits}-bit weights would leave the cache more room: with weight_bits="
        f"{weight_bits} the whole request fits at {setting} ({kv_label(t)} on {engine}) instead of "
        f"{d.kv} ({d.kv_type} on {d.engine})"
    )
    pair = (t, d.kv_storage)
    notes = [n for n in (measured_note(x, results, proxy=False) for x in pair if x) if n]
    if notes:
        line += ". The KV side of that trade, as measured: " + "; ".join(notes)
    return line + ". Weigh it against the weights' own cost on your model (not measured here)"
