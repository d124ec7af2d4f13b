"""Why per-token int4 keys cost one model more than another: its keys' channels, and eviction on
int4 with and without the Hadamard rotation.

    .venv/bin/python benchmarks/bench_keys.py                        # SmolLM2-135M
    .venv/bin/python benchmarks/bench_keys.py --model gemma-3-270m   # after `make gemma`

At half of the global layers' fp16 bytes, eviction on int4 keeps every token, so its cost is
the per-token storage alone: +0.37 % on SmolLM2-135M, +1.5 % on Gemma 3 270M (run ``eviction``
and ``eviction/gemma-3-270m``), where kvlib-int4's per-channel keys cost either model nothing.
This benchmark measures, on each model's global (full-attention) layers:

1. **The keys** (:func:`kvlib.eval.capture.capture_qkv`) of the first 1,024 tokens of each
   perplexity segment: how far a head's strongest channel stands out over its median channel,
   head-wide (:func:`kvlib.eval.capture.channel_spread`, averaged over the global layers), and the attention-output error (the newest 256
   queries; :func:`kvlib.eval.capture.evaluate_recipes`) of three 4-bit recipes of notebook 03:
   keys per token in groups of 32 channels (what eviction stores), the same after a Hadamard
   rotation of the keys (eviction's default), and per channel in groups of 32 tokens (KIVI's
   keys, which eviction cannot store). Values are stored per token in groups of 32 channels,
   unrotated, in all three, so the recipes differ in the keys only. No float16 window (eviction
   keeps its newest tokens in float16): every measured token is quantized.
2. **Perplexity** of ``evict-h2o-int4`` at 1/2 of the global layers' fp16 bytes, with the
   rotation (kvlib's default) and without (``rotate=False``), chunked on the three 2,048-token
   segments of ``bench_eviction.py``, against the model's own DynamicCache.

Writes run ``"keys"`` (``"keys/<model>"`` for another model) of ``kvlib/results.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from _machine import machine
from _progress import log
from _tables import markdown_table
from bench_eviction import budget_bytes, perplexity_row, text_segments

import kvlib
from kvlib import compat, results
from kvlib.caches import registry as cache_registry
from kvlib.eval.capture import capture_qkv, channel_spread, evaluate_recipes
from kvlib.models import DEFAULT_MODEL, OFFLINE_MODELS, load_model, offline_model
from kvlib.quant.recipes import KVRecipe

#: Notebook 03's 4-bit recipes, by the name the results file keys them by, in groups of 32 as
#: eviction stores its tokens (``default_group``): keys per token (32 channels), the same after
#: a Hadamard rotation of the keys (values unrotated, as eviction does), or per channel (32
#: tokens); values per token (32 channels) in all three. No float16 window: every token of the
#: measured 1,024 is quantized (eviction keeps its newest tokens in float16).
RECIPES = {
    "per-token": KVRecipe(4, key_axis=-1, value_axis=-1, key_group_size=32, value_group_size=32),
    "per-token, rotated": KVRecipe(
        4,
        key_axis=-1,
        value_axis=-1,
        key_group_size=32,
        value_group_size=32,
        rotate=True,
        rotate_values=False,
    ),  # fmt: skip
    "per-channel": KVRecipe(4, key_axis=-2, value_axis=-1, key_group_size=32, value_group_size=32),
}
KEY_TOKENS, QUERIES, SEGMENTS, TOKENS = 1024, 256, 3, 2048
EVICT = "evict-h2o-int4@1/2"  # at half the global bytes int4 eviction keeps every token


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=list(OFFLINE_MODELS))
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--no-json", action="store_true", help="do not write kvlib/results.json")
    return ap.parse_args(argv)


def key_rows(model: Any, segments: list[torch.Tensor]) -> dict[str, Any]:
    """Per segment, over the global layers: the mean channel spread of the keys, and each
    recipe's attention-output error (mean over layers). ``(segment, layers)`` lists."""
    glob = [i for i, w in enumerate(compat.layer_windows(model.config)) if w is None]
    spread: list[float] = []
    errors: dict[str, list[float]] = {name: [] for name in RECIPES}
    for ids in segments:
        captured = capture_qkv(model, ids[:, :KEY_TOKENS])
        layers = [captured[i] for i in glob]
        spread.append(sum(channel_spread(layer.k) for layer in layers) / len(layers))
        measured = evaluate_recipes(layers, list(RECIPES.values()), QUERIES)
        for name, r in zip(RECIPES, measured, strict=True):
            errors[name].append(r.error)
    return {"global_layers": glob, "channel_spread_segments": spread} | {
        f"attention_error_segments {name}": e for name, e in errors.items()
    }


def perplexity_rows(model: Any, segments: list[torch.Tensor]) -> dict[str, dict]:
    """Rows keyed by registry name: the reference and ``evict-h2o-int4@1/2`` (keys rotated, the
    default), with its ``rotate=False`` twin under ``"not_rotated"``; each with its perplexity
    and its % cost against the reference per segment, and the mean cost."""
    config = model.config
    limit = budget_bytes(config, TOKENS - 1, 2)
    reference = cache_registry.reference_name(model.dtype)
    factories = {
        reference: lambda: compat.dynamic_cache(config),
        EVICT: cache_registry.cache_factory("evict-h2o-int4", config, max_bytes=limit),
        "not_rotated": cache_registry.cache_factory(
            "evict-h2o-int4", config, max_bytes=limit, rotate=False
        ),
    }
    measured = {}
    for name, factory in factories.items():
        row = perplexity_row(model, segments, factory)
        measured[name] = {"perplexity_segments": [round(p, 4) for p in row["perplexity_segments"]]}
        log(f"{name:20s} ppl {measured[name]['perplexity_segments']} ({row['seconds']:.0f} s)")
    ref = measured[reference]["perplexity_segments"]
    for row in measured.values():
        d = [100 * (p / r - 1) for p, r in zip(row["perplexity_segments"], ref, strict=True)]
        row["perplexity_delta_pct_segments"] = [round(x, 2) for x in d]
        row["perplexity_delta_pct_mean"] = round(sum(d) / len(d), 2)
    rows = {reference: measured[reference], EVICT: measured[EVICT]}
    rows[EVICT]["not_rotated"] = measured["not_rotated"]
    return rows


def tables(keys: dict[str, Any], ppl: dict[str, dict]) -> str:
    """Two Markdown tables: the keys per segment, and the perplexity rows."""
    n = len(keys["channel_spread_segments"])
    head = ["segment", "channel spread"] + [f"error, {name}" for name in RECIPES]
    rows = [
        [str(s + 1), f"{keys['channel_spread_segments'][s]:.1f}"]
        + [f"{keys[f'attention_error_segments {name}'][s]:.3f}" for name in RECIPES]
        for s in range(n)
    ]
    out = markdown_table(head, rows, "l" + "r" * (len(head) - 1))
    head = ["cache", "Δ ppl per segment", "mean"]
    named = [(name, r) for name, r in ppl.items()] + [
        (f"{EVICT}, not rotated", ppl[EVICT]["not_rotated"])
    ]
    rows = [
        [name, " / ".join(f"{d:+.2f}" for d in r["perplexity_delta_pct_segments"]),
         f"{r['perplexity_delta_pct_mean']:+.2f} %"]
        for name, r in named
    ]  # fmt: skip
    return "\n".join(out) + "\n\n" + "\n".join(markdown_table(head, rows, "lrr"))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    kvlib.seed_everything(0)
    t0 = time.perf_counter()
    model, tok = load_model(args.model, device="cpu")
    _, evaluation = kvlib.data.split_text(kvlib.data.load_eval_text(), 0.5)
    segments = text_segments(tok, evaluation, TOKENS, SEGMENTS)
    keys = key_rows(model, segments)
    log(f"keys measured in {time.perf_counter() - t0:.0f} s")
    ppl = perplexity_rows(model, segments)
    print(f"\n{offline_model(args.model).title}, global layers {keys['global_layers']}\n")
    print(tables(keys, ppl))
    if args.no_json:
        return
    name = results.run_name("keys", args.model)
    entry = {
        "source": "benchmarks/bench_keys.py",
        "command": "python benchmarks/bench_keys.py " + " ".join(argv or sys.argv[1:]),
        "machine": machine(threads=args.threads),
        "model": offline_model(args.model).title,
        "settings": {
            "key_tokens": KEY_TOKENS,
            "queries": QUERIES,
            "segments": SEGMENTS,
            "tokens": TOKENS,
            "bits": 4,
            "global_layers": keys["global_layers"],
            "minutes": round((time.perf_counter() - t0) / 60, 1),
        },  # fmt: skip
        "keys": {k: v for k, v in keys.items() if k != "global_layers"},
        "rows": ppl,
    }
    log(f"wrote run {name!r} to {results.record_run(name, entry)}")


if __name__ == "__main__":
    main()
