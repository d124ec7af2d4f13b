"""kvlib's eviction policies against NVIDIA's kvpress, the peer, on the same prompts.

kvpress 0.5.5 pins ``transformers<5.3``, so it cannot share this project's environment. It
runs as a peer in its own virtual environment, the way a user would compare the two:

    make kvpress-peer                           # builds .venv-kvpress (torch CPU, kvpress 0.5.5)
    .venv/bin/python benchmarks/bench_kvpress.py

This script (in the project's environment) builds seeded pass-key prompts
(:mod:`kvlib.eval.retrieval`, ~1k tokens), hands their token ids and the bundled model's
safetensors copy to ``.venv-kvpress/bin/python benchmarks/bench_kvpress.py --peer``, and runs
kvlib's policies on the same ids. For kvpress's ``StreamingLLMPress``, ``SnapKVPress``,
``KnormPress`` and ``TOVAPress`` and kvlib's ``streaming``, ``snapkv``, ``knorm`` and ``tova``
at the same number of kept tokens (``int(n * (1 - compression_ratio))`` per layer and KV head,
all of the prompt prefilled in one pass, as kvlib's retrieval task does), it compares

* which tokens are kept: per layer and KV head, the overlap ``|A ∩ B| / |A|`` of the kept
  positions (kvpress's are found by matching its kept key rows to the full prefill's);
* the answers: greedy decoding after the prefill, with positions continuing from the prompt
  length (kvpress's pipeline does the same), scored as :mod:`kvlib.eval.retrieval` scores them.
  kvpress compresses once, after the prefill, and lets the answer's tokens add to the cache;
  kvlib's caches keep their budget while decoding too, so here each kvlib layer is given room
  for the answer after the prefill (the answers then compare the same computation).

kvlib's SnapKV observation window is set to kvpress's 64 tokens here (its default is 32), so
the two compute the same algorithm. kvpress's TOVA keeps the last token (its score padded
above every other), as kvlib's one-token TOVA window does.

kvlib's H2O has no counterpart in kvpress 0.5.5: its ``ObservedAttentionPress``, which cites
H2O, scores a token by the *mean* attention it received from the queries that could see it
(the sum divided by their count) and keeps no recent half, where H2O sums the attention and
gives half the budget to the newest tokens. Comparing the two would measure that difference,
not either implementation, so H2O is checked against its definition in the unit tests only.

Writes run ``"kvpress"`` of ``kvlib/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _tables import markdown_table

PRESSES = {
    "streaming": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "knorm": "KnormPress",
    "tova": "TOVAPress",
}
SNAPKV_WINDOW = 64  # kvpress's default window_size (kernel 5 in both)
RATIOS = (0.5, 0.75, 0.875)  # kept: 1/2, 1/4, 1/8 of the prompt's tokens
PEER_PYTHON = Path(".venv-kvpress/bin/python")


# ------------------------------------------------------------------ the peer side (kvpress env)


def peer(job_path: str, out_path: str) -> None:
    """Runs in kvpress's environment: no kvlib import (it needs transformers >= 5.3)."""
    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(int(os.environ.get("PEER_THREADS", "1")))
    transformers.utils.logging.disable_progress_bar()
    job = json.loads(Path(job_path).read_text())
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])

    def prefill(ids, press=None):
        cache = DynamicCache()
        with torch.inference_mode():
            if press is None:
                out = model(input_ids=ids, past_key_values=cache)
            else:
                with press(model):
                    out = model(input_ids=ids, past_key_values=cache)
        return out, cache

    def answer(out, cache, n_prompt, max_new):
        tokens = [int(out.logits[0, -1].argmax())]
        with torch.inference_mode():
            while len(tokens) < max_new and tokens[-1] not in eos:
                pos = torch.tensor([[n_prompt + len(tokens) - 1]])
                step = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                             position_ids=pos)  # fmt: skip
                tokens.append(int(step.logits[0, -1].argmax()))
        return tokens

    result = {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
              "transformers": transformers.__version__, "runs": []}  # fmt: skip
    for p_i, prompt in enumerate(job["prompts"]):
        ids = torch.tensor([prompt["ids"]])
        _, full = prefill(ids)
        full_keys = [layer.keys for layer in full.layers]
        for policy, cls in PRESSES.items():
            for ratio in job["ratios"]:
                kwargs = {"window_size": SNAPKV_WINDOW} if policy == "snapkv" else {}
                press = getattr(kvpress, cls)(compression_ratio=ratio, **kwargs)
                out, cache = prefill(ids, press)
                kept = []
                for layer, ref in zip(cache.layers, full_keys, strict=True):
                    d = torch.cdist(  # (heads, k, n), exact: no matmul expansion
                        layer.keys[0], ref[0], compute_mode="donot_use_mm_for_euclid_dist"
                    )
                    if float(d.amin(-1).max()) != 0.0:
                        raise RuntimeError("a kept key row matches no prefill row exactly")
                    kept.append(d.argmin(-1).sort(-1).values.tolist())
                tokens = answer(out, cache, ids.shape[1], prompt["max_new"])
                result["runs"].append({"prompt": p_i, "policy": policy, "ratio": ratio,
                                       "kept": kept if p_i < job["kept_prompts"] else None,
                                       "tokens": tokens})  # fmt: skip
                print(f"peer: prompt {p_i} {cls} {ratio}", file=sys.stderr, flush=True)
    Path(out_path).write_text(json.dumps(result))


# ------------------------------------------------------------------ the project side


def kvlib_side(model, tok, prompts, ratios, kept_prompts):
    """kvlib's kept positions and answers for the same prompts and budgets."""
    import torch

    from kvlib import compat
    from kvlib.caches.eviction.cache import capture_queries
    from kvlib.caches.registry import cache_factory
    from kvlib.eval import retrieval

    eos = retrieval._eos_ids(model)
    runs = []
    for p_i, trial in enumerate(prompts):
        n = trial.input_ids.shape[1]
        for policy in PRESSES:
            for ratio in ratios:
                budget = int(n * (1 - ratio))
                window = {"window": min(SNAPKV_WINDOW, budget)} if policy == "snapkv" else {}
                # the registry's float cache in the model's dtype (dtype=None), as kvpress keeps it
                make = cache_factory(
                    f"evict-{policy}", model.config, budget=budget, dtype=None, **window
                )
                cache = make()
                with capture_queries(model):
                    out = compat.forward(model, trial.input_ids, cache)
                    kept = [layer.positions[0].tolist() for layer in cache.layers]
                    for layer in cache.layers:  # kvpress compresses once: room for the answer
                        layer.budget += trial.key_digits + 4
                    tokens = [int(out.logits[0, -1].argmax())]
                    while len(tokens) < trial.key_digits + 4 and tokens[-1] not in eos:
                        step = compat.forward(model, torch.tensor([[tokens[-1]]]), cache)
                        tokens.append(int(step.logits[0, -1].argmax()))
                runs.append({"prompt": p_i, "policy": policy, "ratio": ratio,
                             "kept": kept if p_i < kept_prompts else None, "tokens": tokens})  # fmt: skip
    return runs


def overlap(a: list, b: list) -> tuple[float, float]:
    """Mean over layers and heads of |A ∩ B| / |A|, and the share of (layer, head) sets that
    are identical."""
    fractions, same = [], 0
    for la, lb in zip(a, b, strict=True):
        for ha, hb in zip(la, lb, strict=True):
            sa, sb = set(ha), set(hb)
            fractions.append(len(sa & sb) / max(1, len(sa)))
            same += sa == sb
    return sum(fractions) / len(fractions), same / len(fractions)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    ap.add_argument("--context", type=int, default=1024, help="prompt length (tokens)")
    ap.add_argument("--trials", type=int, default=2, help="prompts per depth")
    ap.add_argument(
        "--kept-prompts", type=int, default=2, help="prompts whose kept sets are compared"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-json", action="store_true")
    return ap.parse_args(argv)


def run_peer(peer_python: Path, job: dict, threads: int) -> dict:
    """kvpress's side: ``job`` run by this script in kvpress's environment (``--peer``)."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "job.json").write_text(json.dumps(job))
        env = {**os.environ, "PEER_THREADS": str(threads)}
        subprocess.run(
            [str(peer_python), __file__, "--peer", f"{tmp}/job.json", f"{tmp}/out.json"],
            check=True,
            env=env,
        )
        return json.loads(Path(tmp, "out.json").read_text())


def compare_rows(ours: list[dict], theirs: list[dict], prompts: list, tok) -> dict[str, dict]:
    """``"<policy>@<kept share>"`` -> how the two sides agree at that press: the overlap of
    their kept positions, the share of identical (layer, head) sets, each side's correct
    answers and the prompts answered with the same tokens."""
    from kvlib.eval import retrieval

    def correct(runs: list[dict]) -> int:
        return sum(
            retrieval._first_number(tok.decode(r["tokens"], skip_special_tokens=True))
            == prompts[r["prompt"]].answer
            for r in runs
        )

    rows = {}
    for policy in PRESSES:
        for ratio in RATIOS:
            a = [r for r in ours if (r["policy"], r["ratio"]) == (policy, ratio)]
            b = [r for r in theirs if (r["policy"], r["ratio"]) == (policy, ratio)]
            agree = [overlap(x["kept"], y["kept"]) for x, y in zip(a, b, strict=True) if x["kept"]]
            rows[f"{policy}@{1 - ratio:g}"] = {
                "kept_overlap": sum(o for o, _ in agree) / len(agree),
                "identical_sets": sum(s for _, s in agree) / len(agree),
                "kvlib_correct": correct(a),
                "kvpress_correct": correct(b),
                "same_answer_tokens": sum(
                    x["tokens"] == y["tokens"] for x, y in zip(a, b, strict=True)
                ),
                "prompts": len(a),
            }
    return rows


def table(rows: dict[str, dict]) -> str:
    """The Markdown table of :func:`compare_rows`' rows."""
    counts = ("kvlib_correct", "kvpress_correct", "same_answer_tokens")
    header = ["policy @ kept", "kept overlap", "identical (layer, head) sets", "kvlib correct"]
    header += ["kvpress correct", "same answer"]
    return "\n".join(
        markdown_table(
            header,
            [
                [
                    name,
                    f"{r['kept_overlap']:.3f}",
                    f"{r['identical_sets']:.2f}",
                    *(f"{r[k]}/{r['prompts']}" for k in counts),
                ]
                for name, r in rows.items()
            ],
        )
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.peer:
        peer(*args.peer)
        return
    if not args.peer_python.is_file():
        sys.exit(
            f"{args.peer_python} not found: build kvpress's environment with `make kvpress-peer`"
        )

    import random

    import torch
    from _machine import machine

    import kvlib
    from kvlib import results
    from kvlib.eval import retrieval
    from kvlib.models import load_model, model_folder

    torch.set_num_threads(args.threads)
    model, tok = load_model(device="cpu")
    rng, corpus = random.Random(0), kvlib.data.load_eval_text()
    depths = (0.1, 0.3, 0.5, 0.7, 0.9)
    prompts = [
        retrieval.make_trial(tok, args.context, d, rng=rng, corpus=corpus)
        for d in depths
        for _ in range(args.trials)
    ]
    job = {
        "model": str(model_folder()),
        "ratios": list(RATIOS),
        "kept_prompts": args.kept_prompts,
        "prompts": [{"ids": t.input_ids[0].tolist(), "max_new": t.key_digits + 4} for t in prompts],
    }
    t0 = time.perf_counter()
    theirs = run_peer(args.peer_python, job, args.threads)
    peer_seconds = time.perf_counter() - t0
    ours = kvlib_side(model, tok, prompts, RATIOS, args.kept_prompts)
    rows = compare_rows(ours, theirs["runs"], prompts, tok)
    print(f"\nkvpress {theirs['kvpress']} (transformers {theirs['transformers']}) vs kvlib, "
          f"{len(prompts)} prompts of ~{args.context} tokens\n")  # fmt: skip
    print(table(rows))
    if args.no_json:
        return
    entry = {
        "source": "benchmarks/bench_kvpress.py",
        "command": " ".join(["python", "benchmarks/bench_kvpress.py", *(argv or sys.argv[1:])]),
        "machine": machine(args.threads),
        "model": "SmolLM2-135M-Instruct (bundled)",
        "settings": {
            "context_tokens": args.context,
            "prompts": len(prompts),
            "kept_prompts": args.kept_prompts,
            "ratios": list(RATIOS),
            "snapkv_window": SNAPKV_WINDOW,
            "kvpress": theirs["kvpress"],
            "peer_transformers": theirs["transformers"],
            "peer_seconds": round(peer_seconds),
            "torch": torch.__version__,
        },
        "rows": rows,
    }
    print(f"wrote run 'kvpress' to {results.record_run('kvpress', entry)}", file=sys.stderr)


if __name__ == "__main__":
    main()
