"""TurboQuant (vLLM's codebook caches) and KVQuant against kvlib's KIVI caches and transformers'
own, at equal bits, in one run.

For every cache: perplexity on ``--segments`` consecutive 2048-token segments of
``kvlib.data.load_eval_text()`` fed in chunks of 64 tokens (attention reads the cached past), as
the % delta against the fp32 DynamicCache per segment and their mean; bits per cached value with
everything counted (codes, norms, scales, zero points, block means, sinks, windows, boundary
layers) after 4096 tokens; pass-key retrieval at 1024 tokens (:mod:`kvlib.eval.retrieval`,
Wilson 95 % interval); and the cost on this CPU of one decode step at 4096 tokens (every
layer's ``update`` for one token: reading the past back and storing the new token), as a ratio
to kvlib-int4's timed just before it (:func:`decode_steps`), and of storing a 4096-token
prompt, per token. Prints Markdown tables and
writes run ``"turboquant"`` of ``kvlib/results.json`` (``"turboquant/<model>"`` for another
model), rows keyed by :mod:`kvlib.caches.registry` names.

    .venv/bin/python benchmarks/bench_turboquant.py               # ~40 minutes on 2 cores
    .venv/bin/python benchmarks/bench_turboquant.py --segments 2 --trials 2 --no-json
    .venv/bin/python benchmarks/bench_turboquant.py --costs-only  # re-time the costs, ~12 minutes
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _machine import machine
from _progress import bar, log
from _states import fill
from _timing import median_seconds
from transformers import AutoConfig

import kvlib
from kvlib import compat, results
from kvlib.caches import registry
from kvlib.eval import quality, retrieval
from kvlib.specs import kv_geometry

#: The caches compared (the fp32 reference is added first): kvlib's KIVI caches (with the default
#: 128-token window and with a 64-token one), transformers' quanto, HQQ and fp8 caches, vLLM's four TurboQuant dtypes, the same codec in kvlib's layout,
#: and KVQuant's codec in kvlib's layout.
CACHES = (
    "kvlib-int4",
    "kvlib-int3",
    "kvlib-int2",
    *(n for n in registry.CACHE_NAMES if n.startswith("kvlib-") and n.endswith("-w64")),
    "quanto-int4",
    "quanto-int2",
    "hqq-int4",
    "hqq-int2",
    "hf-fp8",
    *(n for n in registry.CACHE_NAMES if registry.cache_info(n).family == "turboquant"),
    *(n for n in registry.CACHE_NAMES if registry.cache_info(n).family == "kvquant"),
)
#: What ran the caches: vLLM's TurboQuant layout re-implemented in kvlib, inside transformers
#: (vLLM runs its TurboQuant dtypes on GPUs only).
ENGINE = "transformers, with kvlib's re-implementations of vLLM's TurboQuant layout and of KVQuant"
CONTEXT = 4096  # tokens at which bytes and the decode step are measured
STEP_ROUNDS = 5  # rounds of decode-step timings: kvlib-int4 then each cache, per round
CHUNK = 64


def bits_and_store(factory: Callable[[], Any], config: Any) -> dict[str, float]:
    """Bits per value after :data:`CONTEXT` tokens, and the median cost of storing them, per
    token (s). On a model with sliding-window layers, also ``"bits_global"``: the bits per
    value of its full-attention layers alone, where the codes decide the bytes (the quantized
    caches keep the windows in float16)."""
    cache = fill(factory(), config, CONTEXT, 256)
    out = {"bits": 16 * compat.cache_nbytes(cache) / cache_fp16(config)}
    windows = compat.layer_windows(config, "bench_turboquant")
    full = [i for i, window in enumerate(windows) if window is None]
    if len(full) < len(windows):
        if len(cache.layers) != len(windows):
            raise ValueError(f"{type(cache).__name__} does not hold one layer per model layer")
        _, _, heads, d = kv_geometry(config)
        fp16 = len(full) * CONTEXT * 2 * heads * d * 2
        out["bits_global"] = 16 * sum(compat.layer_nbytes(cache.layers[i]) for i in full) / fp16
    store_s, _ = median_seconds(lambda: fill(factory(), config, CONTEXT, 256), min_run_time=0.1)
    return {**out, "store_s_per_token": store_s / CONTEXT}


def decode_steps(
    factories: dict[str, Callable[[], Any]], config: Any, rounds: int = STEP_ROUNDS
) -> dict[str, dict[str, Any]]:
    """One decode step at :data:`CONTEXT` tokens (every layer's ``update`` for one token:
    reading the past back and storing the new token) for every cache, as a ratio to
    kvlib-int4's measured just before it.

    Every cache is filled once; then each of ``rounds`` rounds times, for every cache in turn,
    kvlib-int4's step and then the cache's (median of ``blocked_autorange`` each), so that the
    two steps of a ratio are timed seconds apart. A shared machine's load moves single timings
    by half and more; the ratio is the median over rounds, with its range.

    Returns:
        ``{name: {"step_s", "decode_step_vs_kvlib_int4", "decode_step_vs_kvlib_int4_range"}}``.
    """
    if "kvlib-int4" not in factories:
        raise ValueError("decode steps are ratios to kvlib-int4: include it")
    layers, _, heads, d = kv_geometry(config)
    g = torch.Generator().manual_seed(1)
    k1, v1 = torch.randn(1, heads, 1, d, generator=g), torch.randn(1, heads, 1, d, generator=g)

    def stepper(cache: Any) -> Callable[[], None]:
        def step() -> None:
            with torch.inference_mode():
                for i in range(layers):
                    cache.update(k1, v1, i)

        return step

    steps = {name: stepper(fill(f(), config, CONTEXT, 256)) for name, f in factories.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    base: dict[str, list[float]] = {name: [] for name in steps}
    for _ in bar(range(rounds), desc="decode steps"):
        for name, step in steps.items():
            base[name].append(median_seconds(steps["kvlib-int4"], min_run_time=0.2)[0])
            times[name].append(median_seconds(step, min_run_time=0.2)[0])
    out = {}
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base[name], strict=True)]
        if name == "kvlib-int4":  # timed against itself: the ratio of two timings of one step
            ratios = [1.0] * len(ts)
        out[name] = {
            "step_s": statistics.median(ts),
            "decode_step_vs_kvlib_int4": statistics.median(ratios),
            "decode_step_vs_kvlib_int4_range": [min(ratios), max(ratios)],
        }
    return out


def cache_fp16(config: Any) -> int:
    """Bytes of an fp16 cache of :data:`CONTEXT` tokens (sliding layers: their window)."""
    return registry.fp16_bytes(config, CONTEXT)


def perplexities(model: Any, segments: list[torch.Tensor], names: list[str]) -> dict[str, list]:
    """``{name: [perplexity per segment]}``, the reference first."""
    out: dict[str, list[float]] = {}
    with bar(total=len(names) * len(segments), desc="perplexity") as progress:
        for name in names:
            factory = registry.cache_factory(name, model.config)
            out[name] = []
            for seg in segments:
                out[name].append(quality.perplexity(model, seg, factory(), chunk_size=CHUNK))
                progress.update()
            log(f"{name}: " + ", ".join(f"{p:.4f}" for p in out[name]))
    return out


def measure_all(model: Any, tok: Any, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every row of the run: perplexity deltas, bits, retrieval and costs."""
    ids = tok(kvlib.data.load_eval_text(), return_tensors="pt").input_ids[0].tolist()
    bos = tok.bos_token_id if ids and ids[0] == tok.bos_token_id else None
    segments = [
        torch.tensor([kvlib.data.segment(ids, i, args.tokens, bos)]) for i in range(args.segments)
    ]
    reference = registry.reference_name(model.dtype)
    chosen = CACHES if args.caches is None else registry.check_names(args.caches)
    names = [reference, *chosen, *(() if "kvlib-int4" in chosen else ("kvlib-int4",))]
    ppl = perplexities(model, segments, names)
    found = retrieval.compare_retrieval(
        model,
        tok,
        {n: registry.cache_factory(n, model.config) for n in names},
        context_tokens=(1024,),
        trials=args.trials,
        progress=True,
    )
    factories = {n: registry.cache_factory(n, model.config) for n in names}
    steps = decode_steps(factories, model.config)
    rows: dict[str, dict[str, Any]] = {}
    for name in bar(names, desc="bits and storing"):
        deltas = [100 * (p / r - 1) for p, r in zip(ppl[name], ppl[reference], strict=True)]
        summary = found[name].summary()
        rows[name] = {
            "perplexity_segments": [round(p, 5) for p in ppl[name]],
            "perplexity_delta_pct_segments": [round(x, 4) for x in deltas],
            "perplexity_delta_pct_mean": round(statistics.mean(deltas), 4),
            "retrieval_1024": round(summary["accuracy"], 4),
            "retrieval_1024_correct": summary["correct"],
            "retrieval_1024_trials": summary["trials"],
            **bits_and_store(factories[name], model.config),
            **steps[name],
        }
    return rows


def cost_fields(r: dict[str, Any]) -> dict[str, Any]:
    """A row's costs as the results file keeps them (from :func:`bits_and_store` and
    :func:`decode_steps`)."""
    low, high = r["decode_step_vs_kvlib_int4_range"]
    global_bits = {}
    if "bits_global" in r:
        global_bits = {"bits_per_value_global_layers_at_4096": round(r["bits_global"], 3)}
    return {
        "bits_per_value_at_4096": round(r["bits"], 3),
        **global_bits,
        "decode_step_ms_at_4096": round(1e3 * r["step_s"], 2),
        "decode_step_vs_kvlib_int4": round(r["decode_step_vs_kvlib_int4"], 2),
        "decode_step_vs_kvlib_int4_range": [round(low, 2), round(high, 2)],
        "store_us_per_token": round(1e6 * r["store_s_per_token"], 1),
    }


#: Keys of a measured row that :func:`cost_fields` turns into the recorded ones.
COST_KEYS = (
    "bits",
    "bits_global",
    "step_s",
    "store_s_per_token",
    "decode_step_vs_kvlib_int4",
    "decode_step_vs_kvlib_int4_range",
)


def step_protocol() -> str:
    """How the decode steps were timed, for the results file."""
    return (
        f"one decode step at {CONTEXT} tokens, every cache filled once, then {STEP_ROUNDS} "
        "rounds timing, for every cache in turn, kvlib-int4's step and then the cache's (median "
        "of blocked_autorange, >= 0.2 s each); the ratio to kvlib-int4 is the median over "
        "rounds of the ratio of those two timings"
    )


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    """The equal-bits table from a run's recorded rows, sorted by bits per value."""
    print(
        f"\n| cache | bits/value at {CONTEXT} | perplexity Δ % (mean) | segments | "
        "pass-key @1024 | decode step vs kvlib-int4 | store µs/token |"
    )
    print("|---|---:|---:|---|---:|---:|---:|")
    for name, r in sorted(rows.items(), key=lambda kv: kv[1]["bits_per_value_at_4096"]):
        segs = " ".join(f"{x:+.2f}" for x in r["perplexity_delta_pct_segments"])
        print(
            f"| {name} | {r['bits_per_value_at_4096']:.2f} | "
            f"{r['perplexity_delta_pct_mean']:+.3f} | {segs} | "
            f"{r['retrieval_1024_correct']}/{r['retrieval_1024_trials']} | "
            f"{r['decode_step_vs_kvlib_int4']:.2f} | {r['store_us_per_token']:.1f} |"
        )


def retime_costs(args: argparse.Namespace) -> None:
    """``--costs-only``: time bits, decode steps and storing again for every row of the
    recorded run, keep its quality figures, and record when and how the costs were timed."""
    name = results.run_name("turboquant", args.model)
    entry = dict(results.run(name, results.load_results(args.results)))
    if not entry:
        raise SystemExit(f"no run {name!r} in the results file: run the full benchmark first")
    config = AutoConfig.from_pretrained(kvlib.models.model_folder(args.model))
    rows = {n: dict(r) for n, r in entry["rows"].items()}
    factories = {n: registry.cache_factory(n, config) for n in rows}
    steps = decode_steps(factories, config)
    for n in bar(rows, desc="bits and storing"):
        rows[n].update(cost_fields({**bits_and_store(factories[n], config), **steps[n]}))
    entry["rows"] = rows
    entry["costs_timed"] = {
        "command": args.command,
        "date": datetime.date.today().isoformat(),
        "machine": machine(args.threads),
        "protocol": step_protocol(),
    }
    print_table(rows)
    if not args.no_json:
        log(f"wrote run {name!r} to {results.record_run(name, entry, args.results)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", default=kvlib.models.DEFAULT_MODEL, choices=kvlib.models.OFFLINE_MODELS
    )
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per perplexity segment")
    ap.add_argument("--segments", type=int, default=4, help="perplexity segments")
    ap.add_argument("--trials", type=int, default=4, help="pass-key trials per depth (5 depths)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--caches", nargs="*", default=None, help="only these registry names (writes no run)"
    )
    ap.add_argument(
        "--costs-only",
        action="store_true",
        help="time the recorded run's costs again (bits, decode steps, storing), keep the rest",
    )
    ap.add_argument("--no-json", action="store_true", help="do not write kvlib/results.json")
    ap.add_argument(
        "--results", default=None, help="results file to read and update (default: kvlib's)"
    )
    args = ap.parse_args(argv)
    args.command = "python benchmarks/bench_turboquant.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    if args.costs_only:
        retime_costs(args)
        return
    offline = kvlib.models.OFFLINE_MODELS[args.model]
    model, tok = kvlib.models.load_model(args.model)
    measured = measure_all(model, tok, args)
    entry = {
        "source": "benchmarks/bench_turboquant.py",
        "engine": ENGINE,
        "command": args.command,
        "date": datetime.date.today().isoformat(),
        "machine": machine(args.threads),
        "model": offline.title,
        "settings": {
            "tokens": args.tokens,
            "segments": args.segments,
            "chunk_size": CHUNK,
            "bytes_at_tokens": CONTEXT,
            "retrieval_context": 1024,
            "retrieval_trials_per_depth": args.trials,
            "model_dtype": str(model.dtype).removeprefix("torch."),
            "decode_steps": step_protocol(),
        },
        "rows": {
            name: {
                **{k: v for k, v in r.items() if k not in COST_KEYS},
                **cost_fields(r),
            }
            for name, r in measured.items()
        },
    }
    print_table(entry["rows"])
    if args.no_json or args.caches is not None:
        return
    name = results.run_name("turboquant", args.model)
    log(f"wrote run {name!r} to {results.record_run(name, entry, args.results)}")


if __name__ == "__main__":
    main()
