"""kvlib.caches.quantized.QuantizedKVCache vs transformers' QuantizedCache (quanto, HQQ, fp8), in one run.

Perplexity on ``kvlib.data.load_eval_text()`` fed in chunks of 64 tokens (so attention reads the
cached, quantized past), % delta vs the fp32 DynamicCache, cache bytes vs fp16 (measured after
the text, and at 4096 tokens by feeding 4096 random states through every layer: bytes depend
only on shapes), wall time; then decode speed (kvlib int4 vs DynamicCache vs quanto int4).
Prints Markdown tables with PASS/FAIL for the issue's targets and writes
run ``"cache"`` of ``kvlib/results.json`` (:mod:`kvlib.results`; read by the planner and notebooks
04 and 09), rows keyed by :mod:`kvlib.caches.registry` names.

    .venv/bin/python benchmarks/bench_cache.py           # 2048 tokens, decode 1024 + 128
    .venv/bin/python benchmarks/bench_cache.py --quick   # 1024 tokens, decode 1024 + 64
    .venv/bin/python benchmarks/bench_cache.py --model gemma-3-270m --caches ...  # second model

``--model`` names one of :data:`kvlib.models.OFFLINE_MODELS`; a run on another model than the
default is written as run ``"cache/<model>"`` (:func:`kvlib.results.run_name`). On a model with
sliding-window layers (Gemma 3) every cache keeps the windows in float16 and quantizes the
global layers only (:mod:`kvlib.caches.registry`), so the rows differ where the quantizer does.
A segment after the first starts with the tokenizer's BOS token when the first one does
(Gemma's tokenizer adds it; SmolLM2's adds none), so that every segment is a document start.

The full run takes ~25 minutes on a 2-core CPU: tqdm progress bars on stderr follow the
perplexity, decode and segment loops (off when stderr is not a terminal; the one-line results
each loop prints still appear).
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _machine import machine
from _progress import bar, log
from _states import fill
from _tables import markdown_table

import kvlib
from kvlib import compat, results
from kvlib.caches import registry as cache_registry
from kvlib.caches.quantized import QuantizedKVCache
from kvlib.eval import quality
from kvlib.memory import kv_cache_bytes
from kvlib.specs import spec_from_config

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 64  # tokens fed per forward pass: every chunk reads the cache
DECODE_PROMPT = 1024  # tokens of the decode benchmark's prompt
#: The issue's targets for kvlib's default caches: the most perplexity cost (% vs the
#: reference, on every segment) and the least × smaller than fp16 at 4,096 tokens (None: none).
TARGETS: dict[str, tuple[float, float | None]] = {
    "kvlib-int8": (0.05, 1.8),
    "kvlib-int4": (0.1, 3.0),
    "kvlib-int3": (0.5, None),
    "kvlib-int2": (10.0, 4.5),
}
#: The caches timed decoding, where the run has them (the reference is added first).
DECODE_CACHES = ("kvlib-int4", "quanto-int4", "kvlib-int4-rot", "kvlib-int2")


#: The caches compared, by their kvlib.caches.registry names (the reference DynamicCache is added
#: first, named for the model's dtype). For each width, kvlib's defaults, the variant with the
#: rotation switched the other way, and the KIVI block layout.
BENCH_CACHES = (
    "quanto-int4",
    "quanto-int2",
    *(f"hqq-int{b}{axis}" for b in (8, 4, 3, 2) for axis in ("", "-axis1")),
    "hf-fp8",
    "kvlib-int8",
    "kvlib-int8-rot",
    "kvlib-int4",
    "kvlib-int4-rot",
    "kvlib-int4-block",
    "kvlib-int3",
    "kvlib-int3-norot",
    "kvlib-int3-block",
    "kvlib-int2",
    "kvlib-int2-norot",
    "kvlib-int2-block",
)


def factories(model, only: list[str] | None = None):
    """name -> (description, cache factory), the reference first, all from the registry
    (``only``: these names instead of :data:`BENCH_CACHES`)."""
    chosen = BENCH_CACHES if only is None else cache_registry.check_names(only)
    names = (cache_registry.reference_name(model.dtype), *chosen)
    return {
        name: (
            cache_registry.cache_info(name).description,
            cache_registry.cache_factory(name, model.config),
        )
        for name in names
    }


def bytes_at(factory, config, tokens: int, chunk: int = 64) -> tuple[int, int]:
    """(bytes held, fp16 bytes) after feeding ``tokens`` random states to every layer."""
    cache = fill(factory(), config, tokens, chunk)
    fp16 = kv_cache_bytes(spec_from_config(config), tokens, bits=16)
    return compat.cache_nbytes(cache), fp16


def segment(ids: torch.Tensor, i: int, tokens: int, bos: int | None) -> torch.Tensor:
    """The ``i``-th run of ``tokens`` tokens of ``ids`` (1, n); when ``ids`` starts with the
    BOS token, a later segment starts with it too (in place of its first token), as a
    document does."""
    return torch.tensor([kvlib.data.segment(ids[0].tolist(), i, tokens, bos)], dtype=ids.dtype)


def _num(x: float, digits: int) -> float | None:
    """Rounded, or None (JSON null) for a figure not measured."""
    return None if math.isnan(x) else round(x, digits)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1024 tokens, 64 decode tokens")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", nargs="*", default=[], help="cache names to leave out")
    ap.add_argument(
        "--caches",
        nargs="*",
        default=None,
        help="only these registry names (the reference is always run first)",
    )
    ap.add_argument(
        "--model",
        default=kvlib.models.DEFAULT_MODEL,
        choices=list(kvlib.models.OFFLINE_MODELS),
        help="the offline model measured",
    )
    ap.add_argument("--hqq-4096", action="store_true", help="also feed HQQ caches 4096 tokens")
    ap.add_argument("--new-tokens", type=int, default=None, help="decode tokens (default 128)")
    ap.add_argument("--repeats", type=int, default=3, help="decode repeats (median)")
    ap.add_argument(
        "--segments",
        type=int,
        default=4,
        help="also evaluate fp16 and every kvlib row on this many consecutive segments of "
        "--tokens tokens (the first is the protocol's); 1: only the protocol segment",
    )
    ap.add_argument("--no-json", action="store_true", help="do not write kvlib/results.json")
    args = ap.parse_args(argv)
    if args.segments < 1:
        ap.error("--segments must be >= 1")
    args.tokens = args.tokens or (1024 if args.quick else 2048)
    args.new_tokens = args.new_tokens or (64 if args.quick else 128)
    return args


def quality_rows(
    model: Any,
    ids: torch.Tensor,
    facs: dict[str, tuple[str, Callable[[], Any]]],
    *,
    hqq_4096: bool = False,
) -> dict[str, dict[str, Any]]:
    """name -> perplexity on ``ids`` (1, tokens), % cost vs the first (reference) cache, wall
    time, bytes held after the text and at 4,096 tokens (NaN for HQQ unless ``hqq_4096``)."""
    config = model.config
    rows = {}
    for name, (desc, fac) in bar(list(facs.items()), desc="perplexity", unit="cache"):
        cache = fac()
        t0 = time.perf_counter()
        ppl = quality.perplexity(model, ids, cache=cache, chunk_size=CHUNK)
        wall = time.perf_counter() - t0
        held = compat.cache_nbytes(cache)
        fp16 = kv_cache_bytes(spec_from_config(config), cache.get_seq_length(), bits=16)
        if cache_registry.cache_info(name).family == "hqq" and not hqq_4096:
            # HQQ re-quantizes (with its optimizer) the whole cache at every flush: feeding
            # 4096 tokens takes many minutes on this CPU, so it is skipped unless asked for
            b4096, fp16_4096 = float("nan"), float("nan")
        else:
            b4096, fp16_4096 = bytes_at(fac, config, 4096)
        rows[name] = dict(
            desc=desc,
            perplexity=ppl,
            wall_s=wall,
            bytes=held,
            ratio=fp16 / held,
            bytes_per_token=held / cache.get_seq_length(),
            ratio_4096=fp16_4096 / b4096,
            bytes_per_token_4096=b4096 / 4096,
        )
        log(f"{name}: ppl {ppl:.4f} ({wall:.1f} s)")
    ref = next(iter(rows.values()))["perplexity"]
    for r in rows.values():
        r["delta_pct"] = 100 * (r["perplexity"] / ref - 1)
    return rows


def decode_speeds(
    model: Any,
    facs: dict[str, tuple[str, Callable[[], Any]]],
    prompt: torch.Tensor,
    new_tokens: int,
    repeats: int,
) -> dict[str, quality.GenerationBenchmark]:
    """name -> greedy decode timing after ``prompt`` (1, n), for the reference (the first of
    ``facs``) and those of :data:`DECODE_CACHES` in ``facs``."""
    reference = next(iter(facs))
    names = [reference, *(n for n in DECODE_CACHES if n in facs)]
    speed = {}
    for name in bar(names, desc="decode", unit="cache"):
        speed[name] = quality.generation_benchmark(
            model,
            None,
            facs[name][1],
            prompt_tokens=prompt.shape[1],
            new_tokens=new_tokens,
            repeats=repeats,
            prompt_ids=prompt,
            name=name,
        )
        log(f"{name}: {speed[name].decode_tokens_per_s:.2f} tok/s")
    return speed


def segment_deltas(
    model: Any,
    segs: list[torch.Tensor],
    facs: dict[str, tuple[str, Callable[[], Any]]],
    first: dict[str, float],
) -> dict[str, list[float]]:
    """name -> % perplexity cost vs the reference (the first of ``facs``) on each segment: the
    protocol segment's (``first``, name -> %) then one per segment of ``segs`` (1, tokens)."""
    reference = next(iter(facs))
    deltas = {n: [first[n]] for n in facs}
    for i, seg in enumerate(bar(segs, desc="segments", unit="segment"), start=2):
        ppl = {
            n: quality.perplexity(model, seg, cache=fac(), chunk_size=CHUNK)
            for n, (_, fac) in bar(list(facs.items()), desc=f"segment {i}", leave=False)
        }
        for n in facs:
            deltas[n].append(100 * (ppl[n] / ppl[reference] - 1))
        log(f"segment {i}: done")
    return deltas


def quality_table(rows: dict[str, dict[str, Any]], deltas: dict[str, list[float]]) -> str:
    """The Markdown table of every row, with PASS/FAIL for :data:`TARGETS` (the perplexity
    target read on every segment of ``deltas``, the byte target at 4,096 tokens)."""
    header = ["cache", "perplexity", "Δ vs fp32 %", "bytes/token", "× smaller than fp16"]
    header += ["× at 4096 tok", "wall s", "target", "PASS/FAIL"]
    lines = []
    for name, r in rows.items():
        target, verdict = "", ""
        if name in TARGETS:
            most_ppl, least_x = TARGETS[name]
            checks = [r["delta_pct"] <= most_ppl]
            target = f"Δ ≤ {most_ppl} %"
            if least_x is not None:
                checks.append(r["ratio_4096"] >= least_x)
                target += f", ≥ {least_x}× @4096"
            verdict = "PASS" if all(checks) else "FAIL"
        lines.append(
            [
                name,
                f"{r['perplexity']:.4f}",
                f"{r['delta_pct']:+.3f}",
                f"{r['bytes_per_token']:.0f}",
            ]
            + [f"{r['ratio']:.2f}", f"{r['ratio_4096']:.2f}", f"{r['wall_s']:.1f}", target, verdict]
        )
    return "\n".join(markdown_table(header, lines, "lrrrrrr"))


def segments_table(deltas: dict[str, list[float]]) -> str:
    """The Markdown table of each row's % cost on every segment (the reference left out)."""
    k = len(next(iter(deltas.values())))
    header = ["cache", *(f"seg {i + 1}" for i in range(k)), "mean", "worst", "target"]
    lines = []
    for n, d in list(deltas.items())[1:]:
        target, verdict = "", ""
        if n in TARGETS:
            target = f"Δ ≤ {TARGETS[n][0]} %"
            verdict = "yes" if max(d) <= TARGETS[n][0] else "no"
        cells = [f"{x:+.3f}" for x in (*d, statistics.mean(d), max(d))]
        lines.append([n, *cells, target, verdict])
    header.append("met on every segment")
    return "\n".join(markdown_table(header, lines, "l" + "r" * (k + 2)))


def decode_table(speed: dict[str, quality.GenerationBenchmark]) -> str:
    """The Markdown table of decode speeds against the first (reference) row, with the int4
    target: at most 1.5× slower than the reference and at least quanto int4's speed."""
    base = next(iter(speed.values()))
    header = ["cache", "decode tok/s", "slowdown vs Dynamic", "TTFT s", "target", "PASS/FAIL"]
    lines = []
    for name, res in speed.items():
        slow = res.slowdown_vs(base)
        target, verdict = "", ""
        if name == "kvlib-int4" and "quanto-int4" in speed:
            q = speed["quanto-int4"]
            ok = slow <= 1.5 and res.decode_tokens_per_s >= q.decode_tokens_per_s
            target, verdict = "≤ 1.5× Dynamic and ≥ quanto int4", "PASS" if ok else "FAIL"
        lines.append(
            [name, f"{res.decode_tokens_per_s:.2f}", f"{slow:.2f}"]
            + [f"{res.time_to_first_token_s:.2f}", target, verdict]
        )
    return "\n".join(markdown_table(header, lines, "lrrr"))


def run_rows(
    rows: dict[str, dict[str, Any]], deltas: dict[str, list[float]]
) -> dict[str, dict[str, Any]]:
    """The results file's rows: each cache's figures, with its segments when there are several."""
    several = len(next(iter(deltas.values()))) > 1
    return {
        name: {
            "perplexity": round(r["perplexity"], 5),
            "perplexity_delta_pct": round(r["delta_pct"], 4),
            "bytes_per_token": round(r["bytes_per_token"]),
            "x_smaller_than_fp16": round(r["ratio"], 2),
            "x_smaller_than_fp16_at_4096": _num(r["ratio_4096"], 2),
            "bytes_per_token_at_4096": _num(r["bytes_per_token_4096"], 1),
            "wall_s": round(r["wall_s"], 1),
            **(
                {
                    "perplexity_delta_pct_segments": [round(x, 4) for x in deltas[name]],
                    "perplexity_delta_pct_mean": round(statistics.mean(deltas[name]), 4),
                    "perplexity_delta_pct_worst": round(max(deltas[name]), 4),
                }
                if several
                else {}
            ),
        }
        for name, r in rows.items()
    }


def decode_rows(speed: dict[str, quality.GenerationBenchmark]) -> dict[str, dict[str, float]]:
    """The results file's decode rows, against the first (reference) row."""
    base = next(iter(speed.values()))
    return {
        name: {
            "decode_tokens_per_s": round(res.decode_tokens_per_s, 3),
            "slowdown_vs_reference": round(res.slowdown_vs(base), 3),
            "time_to_first_token_s": round(res.time_to_first_token_s, 2),
        }
        for name, res in speed.items()
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    model, tok = kvlib.models.load_model(args.model)
    tokens = args.tokens
    text = kvlib.data.load_eval_text()
    all_ids = tok(text[: tokens * args.segments * 8 + 1000], return_tensors="pt").input_ids
    if all_ids.shape[1] < tokens * args.segments:
        raise SystemExit(f"the evaluation text holds only {all_ids.shape[1]} tokens")
    facs = {n: f for n, f in factories(model, args.caches).items() if n not in args.skip}

    # warm-up
    warm = QuantizedKVCache(model.config, 4)
    quality.perplexity(model, all_ids[:, :96], cache=warm, chunk_size=CHUNK)
    rows = quality_rows(model, all_ids[:, :tokens], facs, hqq_4096=args.hqq_4096)
    prompt = tok(text[:20000], return_tensors="pt").input_ids[:, :DECODE_PROMPT]
    speed = decode_speeds(model, facs, prompt, args.new_tokens, args.repeats)
    # robustness: every row on further segments of the same text (the means are what the
    # notebooks and the planner quote: one 2,048-token segment moves by about 0.2 points)
    segs = [segment(all_ids, i, tokens, tok.bos_token_id) for i in range(1, args.segments)]
    deltas = segment_deltas(model, segs, facs, {n: r["delta_pct"] for n, r in rows.items()})

    where = machine(args.threads)
    date = datetime.date.today().isoformat()
    cmd = "python benchmarks/bench_cache.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"\nCommand: `{cmd}`; {tokens} tokens, chunk {CHUNK}; {where}; {date}\n")
    print(quality_table(rows, deltas))
    if args.segments > 1:
        print(f"\nRobustness: Δ vs fp32 % on {args.segments} consecutive {tokens}-token segments\n")
        print(segments_table(deltas))
    print(
        f"\nDecode: {args.new_tokens} tokens after a {DECODE_PROMPT}-token prompt, median of "
        f"{args.repeats}\n"
    )
    print(decode_table(speed))
    if args.no_json:
        return
    run = {
        "source": "benchmarks/bench_cache.py",
        "command": cmd,
        "date": date,
        "machine": where,
        "model": kvlib.models.offline_model(args.model).title,
        "settings": {
            "tokens": tokens,
            "chunk_size": CHUNK,
            "segments": args.segments,
            "decode_prompt_tokens": DECODE_PROMPT,
            "decode_new_tokens": args.new_tokens,
            "model_dtype": str(model.dtype).removeprefix("torch."),
        },
        "rows": run_rows(rows, deltas),
        "decode": decode_rows(speed),
    }
    name = results.run_name("cache", args.model)
    log(f"wrote run {name!r} to {results.record_run(name, run)}")


if __name__ == "__main__":
    main()
