"""Every way to shrink the cache at equal bytes: quantization vs token eviction vs both.

For budgets of 1/2, 1/4, 1/8 and 1/16 of the fp16 cache's bytes, one run measures

* quantization: kvlib's ``kvlib-int8`` … ``kvlib-int2`` (their size is fixed by the bit width:
  a row counts at a budget when its bytes fit);
* eviction: every policy of :mod:`kvlib.eviction` (``evict-<policy>``: float16 keys and values)
  given exactly the budget's bytes (``max_bytes``);
* eviction on int4: ``evict-<policy>-int4`` at the same bytes (about 3.5x the tokens);

on two qualities: perplexity on ``kvlib.data``'s text fed in chunks of 64 tokens (as in
``bench_cache.py``: every chunk reads the cache), and pass-key retrieval accuracy
(:mod:`kvlib.retrieval`, Wilson 95 % interval) at ~1k and ~2k tokens, budgets taken from the
fp16 bytes of each context. PCA transform coding (notebook 05) is left out: it stores a cache
between turns, it is not a live cache that attention reads while decoding.

Writes run ``"eviction"`` of ``kvlib/results.json`` (rows keyed
``<registry name>@1/<k>`` for eviction, by registry name for quantization and the reference),
and prints a Markdown table with the best row of each family at each budget.

    .venv/bin/python benchmarks/bench_eviction.py            # 2048 tokens, 1k + 2k retrieval
    .venv/bin/python benchmarks/bench_eviction.py --quick    # 1024 tokens, 1/4 and 1/8, 1k

Peer: kvpress 0.5.5 pins ``transformers<5.3`` and cannot share this environment; it is not run
here (see the run's ``peer`` field).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from fractions import Fraction

import torch
import transformers

import kvlib
from kvlib import cache_registry, eviction, quality, results, retrieval
from kvlib.specs import kv_geometry

QUANT = ("kvlib-int8", "kvlib-int4", "kvlib-int3", "kvlib-int2")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def fp16_bytes(config, tokens: int) -> int:
    g = kv_geometry(config.get_text_config(decoder=True))
    return 2 * g.num_layers * g.num_kv_heads * g.head_dim * 2 * tokens


def measure(model, tok, ids, factory_for, contexts, trials, seed) -> dict:
    """Perplexity (chunked) and retrieval accuracy; ``factory_for(tokens)`` gives a cache
    factory sized for a context of ``tokens`` tokens."""
    t0 = time.perf_counter()
    cache = factory_for(ids.shape[1] - 1)()  # the last token is only a target
    with eviction.capture_queries(model):
        ppl = quality.perplexity(model, ids, cache=cache, chunk_size=64)
    row = {"perplexity": ppl, "nbytes": kvlib.compat.cache_nbytes(cache)}
    row["fp16_fraction"] = row["nbytes"] / fp16_bytes(model.config, ids.shape[1] - 1)
    for ctx in contexts:
        r = retrieval.evaluate_retrieval(
            model,
            tok,
            factory_for(ctx),
            context_tokens=(ctx,),
            depths=DEPTHS,
            trials=trials,
            seed=seed,
        )
        s = r.summary()
        row[f"retrieval_{ctx}"] = s["accuracy"]
        row[f"retrieval_{ctx}_ci"] = [s["ci_low"], s["ci_high"]]
        row[f"retrieval_{ctx}_trials"] = s["trials"]
    row["seconds"] = time.perf_counter() - t0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1024 tokens, budgets 1/4 and 1/8, 1k")
    ap.add_argument("--tokens", type=int, default=None, help="perplexity tokens (default 2048)")
    ap.add_argument("--trials", type=int, default=None, help="retrieval trials per depth")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--contexts", type=int, nargs="*", default=None, help="retrieval lengths")
    ap.add_argument("--policies", nargs="*", default=list(eviction.POLICIES))
    ap.add_argument("--no-json", action="store_true", help="do not write kvlib/results.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kvlib.seed_everything(0)
    tokens = args.tokens or (1024 if args.quick else 2048)
    fractions = (4, 8) if args.quick else (2, 4, 8, 16)
    contexts = tuple(args.contexts or ((1024,) if args.quick else (1024, 2048)))
    trials = args.trials or (1 if args.quick else 4)

    from kvlib.models import load_model

    model, tok = load_model(device="cpu")
    config = model.config
    text = kvlib.data.load_eval_text()[: tokens * 8 + 1000]
    ids = tok(text, return_tensors="pt").input_ids[:, :tokens]
    measured = {}

    def run(name, factory_for):
        row = measure(model, tok, ids, factory_for, contexts, trials, args.seed)
        measured[name] = row
        acc = " ".join(f"{c}: {row[f'retrieval_{c}']:.2f}" for c in contexts)
        log(
            f"{name:28s} ppl {row['perplexity']:.3f}  bytes/fp16 {row['fp16_fraction']:.3f}  "
            f"retrieval {acc}  ({row['seconds']:.0f} s)"
        )

    reference = cache_registry.reference_name(model.dtype)
    run(reference, lambda _t: cache_registry.cache_factory(reference, config))
    for name in QUANT:
        run(name, lambda _t, n=name: cache_registry.cache_factory(n, config))
    for k in fractions:
        for policy in args.policies:
            for suffix in ("", "-int4"):
                name = f"evict-{policy}{suffix}"

                def factory_for(t, n=name, k=k):
                    budget = fp16_bytes(config, t) // k
                    return cache_registry.eviction_factory(n, config, max_bytes=budget)

                run(f"{name}@1/{k}", factory_for)

    ref_ppl = measured[reference]["perplexity"]
    for row in measured.values():
        row["perplexity_delta_pct"] = 100 * (row["perplexity"] / ref_ppl - 1)

    # the best row of each family at each budget (perplexity first, as the lesser harm)
    def family(name: str) -> str:
        if name.startswith("kvlib-"):
            return "quantization"
        if name.startswith("evict-"):
            return "eviction+int4" if "-int4@" in name else "eviction"
        return "reference"

    best = {}
    for k in fractions:
        for fam in ("quantization", "eviction", "eviction+int4"):
            rows = [
                (n, r)
                for n, r in measured.items()
                if family(n) == fam
                and r["fp16_fraction"] <= float(Fraction(1, k)) * 1.001
                and (fam == "quantization" or n.endswith(f"@1/{k}"))
            ]
            if rows:
                n, r = min(
                    rows, key=lambda nr: (-nr[1][f"retrieval_{contexts[0]}"], nr[1]["perplexity"])
                )
                best[f"1/{k} {fam}"] = n

    head = " | ".join(f"retrieval @{c}" for c in contexts)
    print(f"\n| budget | family | best row | Δ ppl % | {head} | bytes / fp16 |")
    print("|---|---|---|---|" + "---|" * len(contexts) + "---|")
    ref = measured[reference]
    accs = " | ".join(f"{ref[f'retrieval_{c}']:.2f}" for c in contexts)
    print(f"| 1 | reference | {reference} | 0 | {accs} | {ref['fp16_fraction']:.2f} |")
    for key, n in best.items():
        budget, fam = key.split(" ")
        r = measured[n]
        accs = " | ".join(
            f"{r[f'retrieval_{c}']:.2f} [{r[f'retrieval_{c}_ci'][0]:.2f}, {r[f'retrieval_{c}_ci'][1]:.2f}]"
            for c in contexts
        )
        print(
            f"| {budget} | {fam} | {n} | {r['perplexity_delta_pct']:+.2f} | {accs} | "
            f"{r['fp16_fraction']:.3f} |"
        )

    if args.no_json:
        return
    run_entry = {
        "source": "benchmarks/bench_eviction.py",
        "command": " ".join(["python", "benchmarks/bench_eviction.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()} {platform.processor() or ''}, {args.threads} threads".strip(),
        "model": "SmolLM2-135M-Instruct (bundled)",
        "settings": {
            "tokens": tokens,
            "chunk": 64,
            "budgets": [f"1/{k}" for k in fractions],
            "retrieval_contexts": list(contexts),
            "retrieval_depths": list(DEPTHS),
            "retrieval_trials_per_depth": trials,
            "seed": args.seed,
            "quick": args.quick,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "rows": {
            n: {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}
            for n, r in measured.items()
        },
        "best": best,
        "peer": "kvpress 0.5.5 not run: it pins transformers<5.3 and needs its own environment "
        "(not built in this run); compared against the published algorithms instead",
    }
    log(f"wrote run 'eviction' to {results.record_run('eviction', run_entry)}")


if __name__ == "__main__":
    main()
