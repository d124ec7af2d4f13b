"""Every way to shrink the cache at equal bytes: quantization, transform coding, eviction, both.

For budgets of 1/2, 1/4, 1/8 and 1/16 of the fp16 cache's bytes, one run measures

* quantization: kvlib's ``kvlib-int8`` … ``kvlib-int2`` (their size is fixed by the bit width:
  a row counts at a budget when its bytes fit);
* eviction: every policy of :mod:`kvlib.caches.eviction.cache` (``evict-<policy>``: float16 keys and values)
  given exactly the budget's bytes (``max_bytes``);
* eviction on int4: ``evict-<policy>-int4`` at the same bytes (about 3.5x the tokens; the newest
  ``INT_RESIDUAL`` in float16);
* PCA transform coding (``kvtc@1/<k>``, the registry's stored-cache codec, notebook 06) where it applies:
  storage between turns. The prompt's cache is encoded, stored and decoded, and the answer is
  decoded from it, so it has retrieval rows and no perplexity (it is not a live cache that
  attention reads while decoding); its bytes are the stored bytes.

on two qualities: perplexity on ``kvlib.data``'s text fed in chunks of 64 tokens (as in
``bench_cache.py``: every chunk reads the cache) on ``--segments`` consecutive 2,048-token
segments (one segment is noisy, ±0.2 points: the tables read the mean), and pass-key retrieval accuracy
(:mod:`kvlib.eval.retrieval`, Wilson 95 % interval) at ~1k and ~2k tokens, plus the multi-key
variant (4 keys, one asked) at ~1k; budgets are taken from the fp16 bytes of each context.
Every cache answers the same prompts, with one prefill per prompt shared by all of them
(:func:`kvlib.eval.retrieval.compare_retrieval`, exact).

On a model with sliding-window layers (``--model gemma-3-270m``, after ``make gemma``) every
cache keeps the sliding layers' windows whole in float16, and a budget is a share of the
full-attention layers' fp16 bytes (:func:`budget_bytes`): the windows alone are 56 % of Gemma 3
270M's fp16 cache at 2,048 tokens, so a share of the whole could not hold them at 1/2. The
tables then add the global layers' share beside the whole cache's, and rank by it. Transform
coding codes the global layers there (:mod:`kvlib.kvtc`) and stores the windows whole, so its
rows too are sized by a share of the global layers' bytes. ``--add-kvtc`` adds the transform
coding rows to a run recorded without them (the Gemma run was, before :mod:`kvlib.kvtc` coded
hybrid models): it fits the basis, answers the run's own retrieval prompts (same seed and grid;
the reference's answers are checked against the recorded ones) and records when and how.

Writes run ``"eviction"`` of ``kvlib/results.json`` (``"eviction/<model>"`` for another
model; rows keyed ``<registry name>@1/<k>`` for eviction and transform coding, by registry name
for quantization and the reference), and prints a Markdown table with the best row of each
family at each budget.

    .venv/bin/python benchmarks/bench_eviction.py            # 2048 tokens, 1k + 2k retrieval
    .venv/bin/python benchmarks/bench_eviction.py --quick    # 1024 tokens, 1/4 and 1/8, 1k
    .venv/bin/python benchmarks/bench_eviction.py --model gemma-3-270m
    .venv/bin/python benchmarks/bench_eviction.py --model gemma-3-270m --add-kvtc

Peer: kvpress 0.5.5 pins ``transformers<5.3`` and cannot share this environment; it runs in its
own virtual environment (``make kvpress-peer``, ``benchmarks/bench_kvpress.py``, run
``"kvpress"``).
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch
import transformers
from _machine import machine
from _progress import log
from _tables import markdown_table

import kvlib
from kvlib import results
from kvlib.caches import registry as cache_registry
from kvlib.caches.eviction import cache as eviction
from kvlib.eval import quality, retrieval
from kvlib.keys import RetrievalColumn
from kvlib.kvtc import pca

#: The table's family of a row, by its registry family (eviction splits by bits, below).
FAMILY_LABELS = {"kvlib": "quantization", "kvtc": "transform coding", "dynamic": "reference"}
QUANT = ("kvlib-int8", "kvlib-int4", "kvlib-int3", "kvlib-int2")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


MULTI_KEYS = 4
KVTC_CALIBRATION = 4096  # calibration tokens of the transform coding rows' basis


def global_nbytes(cache: Any, config: Any) -> int:
    """Bytes a cache holds in its full-attention layers (one cache layer per model layer)."""
    kinds = kvlib.compat.layer_types(config)
    if len(cache.layers) != len(kinds):
        raise ValueError(f"{type(cache).__name__} does not hold one layer per model layer")
    return sum(
        kvlib.compat.layer_nbytes(layer)
        for layer, kind in zip(cache.layers, kinds, strict=True)
        if kind == "full_attention"
    )


def perplexity_row(model, segments: list[torch.Tensor], factory) -> dict:
    """Chunked perplexity with a fresh cache on each text segment (``[1, tokens]`` ids each),
    and the cache's bytes at the end of the first; on a model with sliding-window layers also
    ``global_fp16_fraction``, the full-attention layers' bytes over their fp16 bytes (what a
    budget over the global layers is a share of: :func:`budget_bytes`)."""
    t0 = time.perf_counter()
    ppl, n, first = [], None, None
    for ids in segments:
        cache = factory()
        with eviction.capture_queries(model):
            ppl.append(quality.perplexity(model, ids, cache=cache, chunk_size=64))
        n, first = (kvlib.compat.cache_nbytes(cache), cache) if n is None else (n, first)
    config, held = model.config, segments[0].shape[1] - 1
    fp16 = cache_registry.fp16_bytes(config, held)
    row = {
        "perplexity": ppl[0],
        "perplexity_segments": ppl,
        "nbytes": n,
        "fp16_fraction": n / fp16,
        "seconds": time.perf_counter() - t0,
    }
    windows = cache_registry.window_fp16_bytes(config, held)
    if windows:
        row["global_fp16_fraction"] = global_nbytes(first, config) / (fp16 - windows)
    return row


def _rounded(v):
    if isinstance(v, float):
        return round(v, 5)
    return [_rounded(x) for x in v] if isinstance(v, list) else v


def kvtc_restore(codec: Any, global_shares: list[float]) -> Callable[[Any], tuple[Any, int]]:
    """Store a prompt's cache with ``codec`` and decode it back (``compare_retrieval``'s
    ``restored``); each call appends to ``global_shares`` the stored bytes of the coded (global)
    layers over their fp16 bytes, the windows stored whole left out."""

    def restore(cache: Any) -> tuple[Any, int]:
        data = codec.encode(cache)
        global_shares.append(1 / codec.inspect(data).coded_compression_ratio())
        return codec.decode(data), len(data)

    return restore


def retrieval_columns(model, tok, config, factories, basis, fractions, column, seed, **grid):
    """One shared-prefill retrieval run of every cache; fills ``column`` of each row."""
    ctx = grid["context_tokens"][0]
    caches = {name: f(ctx) for name, f in factories.items()}
    shares: dict[str, list[float]] = (
        {f"kvtc@1/{k}": [] for k in fractions} if basis is not None else {}
    )
    restored = {
        name: kvtc_restore(cache_registry.make_cache(name, config, basis=basis, tokens=ctx), share)
        for name, share in shares.items()
    }
    t0 = time.perf_counter()
    out = retrieval.compare_retrieval(
        model, tok, caches, restored=restored, seed=seed, progress=True, **grid
    )
    log(f"retrieval {column}: {len(out)} caches in {time.perf_counter() - t0:.0f} s")
    hybrid = cache_registry.window_fp16_bytes(config, ctx) > 0
    rows = {}
    for name, r in out.items():
        s = r.summary()
        fp16 = [cache_registry.fp16_bytes(config, rec["prompt_tokens"]) for rec in r.records]
        frac = sum(rec["nbytes"] / f for rec, f in zip(r.records, fp16, strict=True)) / len(fp16)
        rows[name] = {
            column: s["accuracy"],
            f"{column}_ci": [s["ci_low"], s["ci_high"]],
            f"{column}_trials": s["trials"],
            f"{column}_fp16_fraction": frac,
        }
        if hybrid and name in shares:  # a stored cache: what its budget is a share of
            rows[name][f"{column}_global_fp16_fraction"] = statistics.mean(shares[name])
    return rows


def markdown_tables(run: dict) -> str:
    """The run's two Markdown tables (as in RESULTS.md): the best row of each family at each
    budget, with Wilson 95 % intervals, then every row. Perplexity is the mean cost over the
    run's segments, then each segment's, when it measured more than one."""
    rows, settings = run["rows"], run["settings"]
    columns = RetrievalColumn.of(next(iter(rows.values())))
    cols = [str(c) for c in columns]
    segs = settings.get("segments", 1) > 1
    hybrid = any("global_fp16_fraction" in r for r in rows.values())
    heads = [f"retrieval {'multi ' if c.multi else ''}@{c.context}" for c in columns]
    ppl_head = ["Δ perplexity, mean (%)", "per segment (%)"] if segs else ["Δ perplexity (%)"]
    bytes_head = ["bytes / fp16", "global layers / fp16"] if hybrid else ["bytes / fp16"]

    def ppl(r: dict) -> list[str]:
        if "perplexity" not in r:
            return ["n/a"] * len(ppl_head)
        if not segs:
            return [f"{r['perplexity_delta_pct']:+.3f}"]
        each = " / ".join(f"{d:+.2f}" for d in r["perplexity_delta_pct_segments"])
        return [f"{r['perplexity_delta_pct_mean']:+.3f}", each]

    def fraction(r: dict) -> list[str]:  # bytes over fp16: at the perplexity length if live
        whole = r["fp16_fraction"] if "fp16_fraction" in r else r[f"{cols[0]}_fp16_fraction"]
        glob = r.get("global_fp16_fraction", r.get(f"{cols[0]}_global_fp16_fraction"))
        return [f"{whole:.3f}"] + ([f"{glob:.3f}" if glob is not None else "n/a"] * hybrid)

    def ci(r: dict, c: str) -> str:
        return f"{r[c]:.2f} [{r[f'{c}_ci'][0]:.2f}, {r[f'{c}_ci'][1]:.2f}]"

    reference = str(results.reference(run))
    best = [("1", "reference", reference)] + [
        (str(key.budget), key.family, str(row_key)) for key, row_key in results.best(run).items()
    ]
    best_table = markdown_table(
        ["budget", "family", "best row", *ppl_head, *(f"{h} [95 % CI]" for h in heads)]
        + bytes_head,
        (
            [budget, fam, name, *ppl(rows[name]), *(ci(rows[name], c) for c in cols)]
            + fraction(rows[name])
            for budget, fam, name in best
        ),
    )
    every = markdown_table(
        ["cache", *ppl_head, *heads, *bytes_head],
        ([n, *ppl(r), *(f"{r[c]:.2f}" for c in cols), *fraction(r)] for n, r in rows.items()),
    )
    return "\n".join([*best_table, "", "Every row of the run:", "", *every])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", default=kvlib.models.DEFAULT_MODEL, choices=kvlib.models.OFFLINE_MODELS
    )
    ap.add_argument("--quick", action="store_true", help="1024 tokens, budgets 1/4 and 1/8, 1k")
    ap.add_argument("--tokens", type=int, default=None, help="perplexity tokens (default 2048)")
    ap.add_argument(
        "--segments",
        type=int,
        default=3,
        help="consecutive perplexity segments of --tokens tokens each (their mean is read)",
    )
    ap.add_argument("--trials", type=int, default=None, help="retrieval trials per depth")
    ap.add_argument("--multi-trials", type=int, default=2, help="multi-key trials per depth")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--contexts", type=int, nargs="*", default=None, help="retrieval lengths")
    ap.add_argument("--policies", nargs="*", default=list(eviction.POLICIES))
    ap.add_argument("--no-kvtc", action="store_true", help="leave transform coding out")
    ap.add_argument(
        "--add-kvtc",
        action="store_true",
        help="add the transform coding rows to the recorded run (--model's, or --run-name)",
    )
    ap.add_argument("--budgets", type=int, nargs="*", default=None, help="k of 1/k (2 4 8 16)")
    ap.add_argument(
        "--int4-groups",
        type=int,
        nargs="*",
        default=None,
        help="channels per scale of the -int4 rows (default: the registry's); a row per size",
    )
    ap.add_argument("--only-int4", action="store_true", help="no quantization or float rows")
    ap.add_argument(
        "--run-name",
        default=None,
        help="the run written to results.json (default: 'eviction', 'eviction/<model>')",
    )
    ap.add_argument("--no-json", action="store_true", help="do not write kvlib/results.json")
    ap.add_argument(
        "--print-run",
        metavar="RUN",
        help="print the Markdown tables of a recorded run of kvlib/results.json and exit",
    )
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.segments < 1:
        ap.error(f"--segments must be >= 1 (got {args.segments})")
    if args.add_kvtc and args.no_kvtc:
        ap.error("--add-kvtc and --no-kvtc contradict each other")
    args.tokens = args.tokens or (1024 if args.quick else 2048)
    args.budgets = tuple(args.budgets or ((4, 8) if args.quick else (2, 4, 8, 16)))
    args.int4_groups = args.int4_groups or [None]
    args.contexts = tuple(args.contexts or ((1024,) if args.quick else (1024, 2048)))
    args.trials = args.trials or (2 if args.quick else 4)
    args.run_name = args.run_name or results.run_name("eviction", args.model)
    return args


def cache_factories(
    config: Any,
    reference: str,
    fractions: tuple[int, ...],
    policies: list[str],
    groups: list[int | None],
    *,
    only_int4: bool = False,
) -> dict[str, Callable[[int], Any]]:
    """Row name -> a factory of a fresh cache for a context of ``t`` tokens: the reference
    (None: the model's own DynamicCache) and kvlib's quantized caches unless ``only_int4``,
    then every policy at each budget 1/k of ``fractions`` (:func:`budget_bytes`), in float16
    (unless ``only_int4``) and on int4 (a row per group size of ``groups``; None: the
    registry's). Rows are keyed ``<registry name>@1/<k>``."""
    factories: dict[str, Callable[[int], Any]] = {reference: lambda _t: None}
    for name in () if only_int4 else QUANT:
        factories[name] = lambda _t, n=name: cache_registry.cache_factory(n, config)
    kinds = [("", None)] * (not only_int4) + [("-int4", g) for g in groups]
    for k in fractions:
        for policy in policies:
            for suffix, g in kinds:
                name = f"evict-{policy}{suffix}"
                options = {} if g is None else {"group_size": g}

                def factory_for(t, n=name, k=k, options=options):
                    limit = budget_bytes(config, t, k)
                    return cache_registry.cache_factory(n, config, max_bytes=limit, **options)

                label = name if g is None else f"{name}-g{g}"
                factories[f"{label}@1/{k}"] = factory_for
    return factories


def text_segments(tok, evaluation: str, tokens: int, n: int) -> list[torch.Tensor]:
    """The first ``n`` segments of ``tokens`` token ids (``[1, tokens]`` each) of the
    evaluation text, back to back: the protocol's perplexity segments."""
    all_ids = tok(evaluation[: tokens * n * 8 + 1000], return_tensors="pt").input_ids
    if all_ids.shape[1] < tokens * n:
        raise SystemExit(
            f"the evaluation text holds {all_ids.shape[1]} tokens, fewer than --segments x --tokens"
        )
    return [all_ids[:, i * tokens : (i + 1) * tokens] for i in range(n)]


def budget_bytes(config: Any, tokens: int, k: int) -> int:
    """``max_bytes`` of the budget 1/k at ``tokens`` tokens: a share of the full-attention layers'
    fp16 bytes, the sliding layers' windows kept whole
    (:func:`kvlib.caches.registry.share_bytes`, ``of="global"``). On a model with no sliding
    layers that is 1/k of the whole fp16 cache, the registry's ``evict-<policy>@1/k``; on Gemma
    3 270M the windows alone are 56 % of the fp16 cache at 2,048 tokens, so a share of the
    whole could not hold them at 1/2."""
    return cache_registry.share_bytes(config, tokens, Fraction(1, k), of="global")


def retrieval_grids(
    contexts: tuple[int, ...], trials: int, multi_trials: int
) -> list[tuple[str, dict[str, Any]]]:
    """(column, :func:`kvlib.eval.retrieval.compare_retrieval` grid) of each retrieval column:
    one per context, then the multi-key variant at the first context (if ``multi_trials``)."""
    columns = [(f"retrieval_{c}", {"context_tokens": (c,), "trials": trials}) for c in contexts]
    if multi_trials:
        grid = {"context_tokens": (contexts[0],), "n_keys": MULTI_KEYS, "trials": multi_trials}
        columns.append((f"retrieval_multi_{contexts[0]}", grid))
    return columns


def add_segment_costs(measured: dict[str, dict], reference: str) -> None:
    """Add to each row with a perplexity its % cost against the reference on each segment
    (the first is the protocol's, as in bench_cache.py), their mean (what the tables read)
    and the worst."""
    ref_ppl = measured[reference]["perplexity_segments"]
    for row in measured.values():
        if "perplexity" in row:
            d = [
                100 * (p / r - 1) for p, r in zip(row["perplexity_segments"], ref_ppl, strict=True)
            ]
            row["perplexity_delta_pct"] = d[0]
            row["perplexity_delta_pct_segments"] = d
            row["perplexity_delta_pct_mean"] = statistics.mean(d)
            row["perplexity_delta_pct_worst"] = max(d)


def family(name: str) -> str:
    """The table's family of a row: eviction splits by bits (float16, or on int4)."""
    info = cache_registry.cache_info(name)
    if info.family == "evict":
        return "eviction+int4" if info.bits == 4 else "eviction"
    return FAMILY_LABELS[info.family]


def best_rows(
    measured: dict[str, dict], fractions: tuple[int, ...], first_context: int
) -> dict[str, str]:
    """``"1/<k> <family>"`` -> the best row of each family within each budget: the highest
    retrieval at ``first_context`` tokens, then the lesser mean perplexity cost. Quantization
    rows count at every budget their bytes fit (on a model with sliding-window layers, their
    global layers' bytes: the budget's share, :func:`budget_bytes`); the others only at their
    own."""

    def fraction(row: dict) -> float:  # bytes over fp16: at the perplexity length if live
        stored = f"retrieval_{first_context}"  # a stored cache's, over the retrieval prompts
        for key in ("global_fp16_fraction", f"{stored}_global_fp16_fraction", "fp16_fraction"):
            if key in row:
                return row[key]
        return row[f"{stored}_fp16_fraction"]

    best = {}
    for k in fractions:
        for fam in ("quantization", "transform coding", "eviction", "eviction+int4"):
            rows = [
                (n, r)
                for n, r in measured.items()
                if family(n) == fam
                and fraction(r) <= float(Fraction(1, k)) * 1.001
                and (fam == "quantization" or n.endswith(f"@1/{k}"))
            ]
            if rows:
                n, r = min(
                    rows,
                    key=lambda nr: (
                        -nr[1][f"retrieval_{first_context}"],
                        nr[1].get("perplexity_delta_pct_mean", math.inf),
                    ),
                )
                best[f"1/{k} {fam}"] = n
    return best


def fit_basis(model: Any, tok: Any, calib: str) -> pca.KVPCABasis:
    """The per-layer PCA basis of the ``kvtc`` rows, fitted on :data:`KVTC_CALIBRATION` tokens
    of the calibration half of the text (a hybrid model's: its global layers)."""
    t0 = time.perf_counter()
    basis = pca.fit_kv_pca(model, tok, calib, cross_layer=False, max_tokens=KVTC_CALIBRATION)
    log(f"PCA basis fitted on {KVTC_CALIBRATION} calibration tokens in "
        f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    return basis


def kvtc_settings() -> dict[str, int]:
    """The ``kvtc`` rows' settings as the results file records them."""
    sinks, recent = cache_registry.KVTC_WINDOW
    return {"calibration_tokens": KVTC_CALIBRATION, "sinks": sinks, "recent": recent}


def add_kvtc(args: argparse.Namespace, model: Any, tok: Any, calib: str) -> None:
    """``--add-kvtc``: the transform coding rows of a run recorded without them, on the run's
    own retrieval prompts (its seed, contexts and trials), added to its rows and best rows
    with the command, machine and date that measured them.

    Raises:
        SystemExit: no such run, or it has ``kvtc`` rows already, or the reference's answers
            differ from the recorded ones (then the prompts are not the run's).
    """
    t_start = time.perf_counter()
    entry = dict(results.run(args.run_name))
    if not entry:
        raise SystemExit(f"no run {args.run_name!r} in the results file: run the benchmark first")
    settings = dict(entry["settings"])
    if settings.get("kvtc"):
        raise SystemExit(f"run {args.run_name!r} has transform coding rows already")
    budgets = tuple(int(b.split("/")[1]) for b in settings["budgets"])
    contexts = tuple(settings["retrieval_contexts"])
    basis = fit_basis(model, tok, calib)
    reference = str(results.reference(entry))
    rows = {n: dict(r) for n, r in entry["rows"].items()}
    grids = retrieval_grids(
        contexts,
        settings["retrieval_trials_per_depth"],
        settings["retrieval_multi_trials_per_depth"],
    )
    for column, grid in grids:
        got = retrieval_columns(
            model, tok, model.config, {reference: lambda _: None}, basis, budgets, column,
            settings["seed"], **grid,
        )  # fmt: skip
        if _rounded(got[reference][column]) != rows[reference][column]:
            raise SystemExit(
                f"the reference answered {got[reference][column]:.2f} of {column}'s prompts, "
                f"the run {rows[reference][column]:.2f}: these are not the run's prompts"
            )
        for name, cols in got.items():
            if name != reference:
                rows.setdefault(name, {}).update({k: _rounded(v) for k, v in cols.items()})
    entry["rows"] = rows
    entry["best"] = best_rows(rows, budgets, contexts[0])
    entry["settings"] = {**settings, "kvtc": kvtc_settings()}
    entry["kvtc_added"] = {
        "command": " ".join(["python", "benchmarks/bench_eviction.py", *args.argv]),
        "date": datetime.date.today().isoformat(),
        "machine": machine(args.threads),
        "seconds": round(time.perf_counter() - t_start),
    }
    print(markdown_tables(entry))
    if not args.no_json:
        log(f"wrote run {args.run_name!r} to {results.record_run(args.run_name, entry)}")


def run_settings(args: argparse.Namespace, kvtc: bool, hybrid: bool) -> dict[str, Any]:
    """The run's settings as the results file records them (``seconds`` added at the end)."""
    return {
        "budget_of": (
            "the full-attention layers' fp16 bytes, the sliding windows kept whole in fp16"
            if hybrid
            else "the fp16 cache's bytes"
        ),
        "tokens": args.tokens,
        "segments": args.segments,
        "chunk": 64,
        "budgets": [f"1/{k}" for k in args.budgets],
        "retrieval_contexts": list(args.contexts),
        "retrieval_multi_keys": MULTI_KEYS,
        "retrieval_depths": list(DEPTHS),
        "retrieval_trials_per_depth": args.trials,
        "retrieval_multi_trials_per_depth": args.multi_trials,
        "int4_residual": cache_registry.INT_RESIDUAL,
        "int4_groups": args.int4_groups,
        "kvtc": kvtc_settings() if kvtc else None,
        "seed": args.seed,
        "quick": args.quick,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.print_run:
        print(markdown_tables(results.run(args.print_run)))
        return
    torch.set_num_threads(args.threads)
    kvlib.seed_everything(0)
    t_start = time.perf_counter()
    model, tok = kvlib.models.load_model(args.model, device="cpu")
    config, tokens = model.config, args.tokens
    hybrid = cache_registry.window_fp16_bytes(config, tokens - 1) > 0
    calib, evaluation = kvlib.data.split_text(kvlib.data.load_eval_text(), 0.5)
    segments = text_segments(tok, evaluation, tokens, args.segments)
    if args.add_kvtc:
        add_kvtc(args, model, tok, calib)
        return
    basis = None if args.no_kvtc else fit_basis(model, tok, calib)

    reference = cache_registry.reference_name(model.dtype)
    factories = cache_factories(
        config, reference, args.budgets, args.policies, args.int4_groups, only_int4=args.only_int4
    )
    measured: dict[str, dict] = {}
    for name, factory_for in factories.items():
        f = factory_for(tokens - 1) or (lambda: kvlib.compat.dynamic_cache(config))
        row = measured[name] = perplexity_row(model, segments, f)
        log(f"{name:28s} ppl {row['perplexity']:.3f}  bytes/fp16 {row['fp16_fraction']:.3f}  "
            f"({row['seconds']:.0f} s)")  # fmt: skip
    for column, grid in retrieval_grids(args.contexts, args.trials, args.multi_trials):
        got = retrieval_columns(
            model, tok, config, factories, basis, args.budgets, column, args.seed, **grid
        )
        for name, cols in got.items():
            measured.setdefault(name, {}).update(cols)
    add_segment_costs(measured, reference)
    log(f"total {time.perf_counter() - t_start:.0f} s")

    run_entry = {
        "source": "benchmarks/bench_eviction.py",
        "command": " ".join(["python", "benchmarks/bench_eviction.py", *(argv or sys.argv[1:])]),
        "machine": machine(args.threads),
        "model": kvlib.models.offline_model(args.model).title,
        "settings": {
            **run_settings(args, basis is not None, hybrid),
            "seconds": round(time.perf_counter() - t_start),
        },
        "rows": {n: {k: _rounded(v) for k, v in r.items()} for n, r in measured.items()},
        "best": best_rows(measured, args.budgets, args.contexts[0]),
        "peer": "kvpress 0.5.5 in its own environment: run 'kvpress' (benchmarks/bench_kvpress.py)",
    }
    print(markdown_tables(run_entry))
    if not args.no_json:
        log(f"wrote run {args.run_name!r} to {results.record_run(args.run_name, run_entry)}")


if __name__ == "__main__":
    main()
