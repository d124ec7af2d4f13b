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
from pathlib import Path

import torch
from _machine import machine
from _states import fill
from tqdm import tqdm

import kvlib
from kvlib import compat, results
from kvlib.caches import registry as cache_registry
from kvlib.caches.quantized import QuantizedKVCache
from kvlib.eval import quality
from kvlib.memory import kv_cache_bytes
from kvlib.specs import spec_from_config

ROOT = Path(__file__).resolve().parents[1]
TARGET_PPL = {8: 0.05, 4: 0.1, 3: 0.5, 2: 10.0}
TARGET_BYTES = {8: 1.8, 4: 3.0, 2: 4.5}


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


def log(line: str) -> None:
    """Print a progress line to stdout at once, above the progress bars (which are on stderr)."""
    tqdm.write(line)
    sys.stdout.flush()


def _num(x: float, digits: int) -> float | None:
    """Rounded, or None (JSON null) for a figure not measured."""
    return None if math.isnan(x) else round(x, digits)


def main() -> None:
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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokens = args.tokens or (1024 if args.quick else 2048)
    new_tokens = args.new_tokens or (64 if args.quick else 128)
    repeats = args.repeats
    chunk = 64

    warnings.filterwarnings("ignore")
    offline = kvlib.models.offline_model(args.model)
    model, tok = kvlib.models.load_model(args.model)
    config = model.config
    if args.segments < 1:
        raise SystemExit("--segments must be >= 1")
    text = kvlib.data.load_eval_text()[: tokens * args.segments * 8 + 1000]
    all_ids = tok(text, return_tensors="pt").input_ids
    if all_ids.shape[1] < tokens * args.segments:
        raise SystemExit(f"the evaluation text holds only {all_ids.shape[1]} tokens")
    ids = all_ids[:, :tokens]
    facs = factories(model, args.caches)
    reference = cache_registry.reference_name(model.dtype)

    # warm-up
    quality.perplexity(model, ids[:, :96], cache=QuantizedKVCache(config, 4), chunk_size=chunk)

    rows = {}
    for name, (desc, fac) in tqdm(
        list(facs.items()), desc="perplexity", unit="cache", file=sys.stderr, disable=None
    ):
        if name in args.skip:
            continue
        cache = fac()
        t0 = time.perf_counter()
        ppl = quality.perplexity(model, ids, cache=cache, chunk_size=chunk)
        wall = time.perf_counter() - t0
        held = compat.cache_nbytes(cache)
        fp16 = kv_cache_bytes(spec_from_config(config), cache.get_seq_length(), bits=16)
        if cache_registry.cache_info(name).family == "hqq" and not args.hqq_4096:
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
    ref = rows[reference]["perplexity"]
    for r in rows.values():
        r["delta_pct"] = 100 * (r["perplexity"] / ref - 1)

    # decode speed, same run
    speed = {}
    prompt = tok(kvlib.data.load_eval_text()[:20000], return_tensors="pt").input_ids[:, :1024]
    decode_names = [
        n
        for n in (reference, "kvlib-int4", "quanto-int4", "kvlib-int4-rot", "kvlib-int2")
        if n in facs
    ]
    for name in tqdm(decode_names, desc="decode", unit="cache", file=sys.stderr, disable=None):
        res = quality.generation_benchmark(
            model,
            tok,
            facs[name][1],
            prompt_tokens=1024,
            new_tokens=new_tokens,
            repeats=repeats,
            prompt_ids=prompt,
            name=name,
        )
        speed[name] = res
        log(f"{name}: {res.decode_tokens_per_s:.2f} tok/s")

    # robustness: every row on further segments of the same text (the means are what the
    # notebooks and the planner quote: one 2,048-token segment moves by about 0.2 points)
    seg_names = list(rows)
    segments = {n: [rows[n]["delta_pct"]] for n in seg_names}
    for i in tqdm(
        range(1, args.segments), desc="segments", unit="segment", file=sys.stderr, disable=None
    ):
        seg = segment(all_ids, i, tokens, tok.bos_token_id)
        ppl = {
            n: quality.perplexity(model, seg, cache=facs[n][1](), chunk_size=chunk)
            for n in tqdm(
                seg_names, desc=f"segment {i + 1}", leave=False, file=sys.stderr, disable=None
            )
        }
        for n in seg_names:
            segments[n].append(100 * (ppl[n] / ppl[reference] - 1))
        log(f"segment {i + 1}: done")

    where = machine(args.threads)
    date = datetime.date.today().isoformat()
    cmd = "python benchmarks/bench_cache.py " + " ".join(sys.argv[1:])
    print(f"\nCommand: `{cmd}`; {tokens} tokens, chunk {chunk}; {where}; {date}\n")
    print(
        "| cache | perplexity | Δ vs fp32 % | bytes/token | × smaller than fp16 | "
        "× at 4096 tok | wall s | target | PASS/FAIL |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for name, r in rows.items():
        target, verdict = "", ""
        if name in {f"kvlib-int{b}" for b in TARGET_PPL}:
            b = int(name.split("int")[1])
            checks = [r["delta_pct"] <= TARGET_PPL[b]]
            target = f"Δ ≤ {TARGET_PPL[b]} %"
            if b in TARGET_BYTES:
                checks.append(r["ratio_4096"] >= TARGET_BYTES[b])
                target += f", ≥ {TARGET_BYTES[b]}× @4096"
            verdict = "PASS" if all(checks) else "FAIL"
        print(
            f"| {name} | {r['perplexity']:.4f} | {r['delta_pct']:+.3f} | "
            f"{r['bytes_per_token']:.0f} | {r['ratio']:.2f} | {r['ratio_4096']:.2f} | "
            f"{r['wall_s']:.1f} | {target} | {verdict} |"
        )
    if args.segments > 1:
        k = args.segments
        print(f"\nRobustness: Δ vs fp32 % on {k} consecutive {tokens}-token segments\n")
        heads = " | ".join(f"seg {i + 1}" for i in range(k))
        print(f"| cache | {heads} | mean | worst | target | met on every segment |")
        print("|---|" + "---:|" * (k + 2) + "---|---|")
        for n in seg_names[1:]:
            d = segments[n]
            target, verdict = "", ""
            if n in {f"kvlib-int{b}" for b in TARGET_PPL}:
                b = int(n.split("int")[1])
                target = f"Δ ≤ {TARGET_PPL[b]} %"
                verdict = "yes" if max(d) <= TARGET_PPL[b] else "no"
            cells = " | ".join(f"{x:+.3f}" for x in d)
            print(
                f"| {n} | {cells} | {statistics.mean(d):+.3f} | {max(d):+.3f} | {target} "
                f"| {verdict} |"
            )
    base = speed[reference]
    print(f"\nDecode: {new_tokens} tokens after a 1024-token prompt, median of {repeats}\n")
    print("| cache | decode tok/s | slowdown vs Dynamic | TTFT s | target | PASS/FAIL |")
    print("|---|---:|---:|---:|---|---|")
    for name, res in speed.items():
        slow = res.slowdown_vs(base)
        target, verdict = "", ""
        if name == "kvlib-int4":
            q = speed["quanto-int4"]
            ok = slow <= 1.5 and res.decode_tokens_per_s >= q.decode_tokens_per_s
            target, verdict = "≤ 1.5× Dynamic and ≥ quanto int4", "PASS" if ok else "FAIL"
        print(
            f"| {name} | {res.decode_tokens_per_s:.2f} | {slow:.2f} | "
            f"{res.time_to_first_token_s:.2f} | {target} | {verdict} |"
        )

    if not args.no_json:
        run = {
            "source": "benchmarks/bench_cache.py",
            "command": cmd,
            "date": date,
            "machine": where,
            "model": offline.title,
            "settings": {
                "tokens": tokens,
                "chunk_size": chunk,
                "segments": args.segments,
                "decode_prompt_tokens": 1024,
                "decode_new_tokens": new_tokens,
                "model_dtype": str(model.dtype).removeprefix("torch."),
            },
            "rows": {
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
                            "perplexity_delta_pct_segments": [round(x, 4) for x in segments[name]],
                            "perplexity_delta_pct_mean": round(statistics.mean(segments[name]), 4),
                            "perplexity_delta_pct_worst": round(max(segments[name]), 4),
                        }
                        if name in segments and args.segments > 1
                        else {}
                    ),
                }
                for name, r in rows.items()
            },
            "decode": {
                name: {
                    "decode_tokens_per_s": round(res.decode_tokens_per_s, 3),
                    "slowdown_vs_reference": round(res.slowdown_vs(base), 3),
                    "time_to_first_token_s": round(res.time_to_first_token_s, 2),
                }
                for name, res in speed.items()
            },
        }
        name = results.run_name("cache", args.model)
        log(f"wrote run {name!r} to {results.record_run(name, run)}")


if __name__ == "__main__":
    main()
