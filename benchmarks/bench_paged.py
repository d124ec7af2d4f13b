"""PagedAttention benchmark: memory waste in a serving simulation, prefix sharing, attention speed.

    .venv/bin/python benchmarks/bench_paged.py           # full (~1 min on a quiet 2-core CPU)
    .venv/bin/python benchmarks/bench_paged.py --quick   # fewer requests, shorter timings

Prints markdown tables:

1. the serving simulation (kvlib.eval.serving) on a seeded ShareGPT-like trace: KV memory wasted
   (reserved but unused), peak / mean concurrent sequences, completed requests per 1000 steps,
   for contiguous max-length reservation, exact-length reservation (oracle) and paging at block
   sizes 8 / 16 / 32;
2. parallel sampling (4 samples of a 1024-token prompt) with and without prefix sharing;
3. paged attention (kvlib.caches.paged.paged_attention, a gather-then-einsum reference) against dense
   ``scaled_dot_product_attention`` over padded contiguous K/V at the same lengths (side by
   side in one run);
4. generation with kvlib.caches.paged.PagedCache vs transformers' DynamicCache on the bundled model.

The same figures, at the precision the tables print, are also written as run ``"paged"`` of
``kvlib/results.json`` (:func:`kvlib.results.record_run`; ``--no-json`` skips it).

Times are medians per call from ``torch.utils.benchmark``'s ``blocked_autorange`` (warm-up
included, ``benchmarks/_timing.py``). A tqdm progress bar on stderr follows the longer loops
(off when stderr is not a terminal); the tables go to stdout.
"""

from __future__ import annotations

import argparse
import sys

import torch
from _machine import machine
from _timing import measure
from tqdm import tqdm

from kvlib import results
from kvlib.caches.paged import PagedKVCache, paged_attention, parallel_sampling
from kvlib.caches.registry import cache_factory, reference_name
from kvlib.eval.serving import SMOLLM2_FP16_BYTES_PER_TOKEN, make_trace, simulate_serving

CAPACITY = 2**30  # 1 GiB of KV memory (~46.6k tokens of SmolLM2-135M in fp16)
MAX_LEN = 2048  # the engine's maximum sequence length (trace and simulation)
SEED = 0


def bench_simulation(num_requests: int) -> dict[str, dict[str, dict]]:
    """Print the serving and parallel-sampling tables; return them as the ``"serving"`` and
    ``"parallel_sampling"`` groups of rows (rounded as printed)."""
    trace = make_trace(num_requests, seed=SEED, max_len=MAX_LEN)
    print(f"\n### Serving simulation ({num_requests} requests, seed 0, 1 GiB KV, max_len 2048)\n")
    print(
        "| policy | block | waste % | peak seqs | mean seqs | seqs while queued "
        "| req / 1000 steps | preemptions |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    configs = [("contiguous-max", 16), ("contiguous-exact", 16)]
    configs += [("paged", bs) for bs in (8, 16, 32)]
    serving: dict[str, dict] = {}
    for policy, bs in tqdm(
        configs, desc="serving simulation", leave=False, file=sys.stderr, disable=None
    ):
        s = simulate_serving(trace, CAPACITY, policy, block_size=bs, max_len=MAX_LEN)
        row = s.summary()
        block = bs if policy == "paged" else "-"
        tqdm.write(
            f"| {policy} | {block} | {row['waste_%']:.2f} | {s.peak_concurrent} | "
            f"{s.mean_concurrent:.1f} | {s.busy_concurrent:.1f} | {1000 * s.throughput:.1f} | "
            f"{s.preemptions} |"
        )
        serving[policy if policy != "paged" else f"paged-{bs}"] = {
            **({"block": bs} if policy == "paged" else {}),
            "waste_pct": round(row["waste_%"], 2),
            "peak_seqs": s.peak_concurrent,
            "mean_seqs": round(s.mean_concurrent, 1),
            "seqs_while_queued": round(s.busy_concurrent, 1),
            "req_per_1000_steps": round(1000 * s.throughput, 1),
            "preemptions": s.preemptions,
        }
    trace4 = make_trace(max(num_requests // 4, 50), seed=SEED, max_len=MAX_LEN, num_samples=4)
    print(
        f"\n### Parallel sampling in the simulation ({len(trace4)} requests x 4 samples, paged 16)\n"
    )
    print("| prefix sharing | waste % | seqs while queued | req / 1000 steps | preemptions |")
    print("|---|---:|---:|---:|---:|")
    sampling: dict[str, dict] = {}
    for share in (False, True):
        s = simulate_serving(trace4, CAPACITY, "paged", 16, max_len=MAX_LEN, share_prefix=share)
        print(
            f"| {'yes' if share else 'no'} | {100 * s.waste_fraction:.2f} | "
            f"{s.busy_concurrent:.1f} | {1000 * s.throughput:.1f} | {s.preemptions} |"
        )
        sampling["yes" if share else "no"] = {
            "waste_pct": round(100 * s.waste_fraction, 2),
            "seqs_while_queued": round(s.busy_concurrent, 1),
            "req_per_1000_steps": round(1000 * s.throughput, 1),
            "preemptions": s.preemptions,
        }
    return {"serving": serving, "parallel_sampling": sampling}


def bench_sharing() -> dict[str, dict]:
    """Print the prefix-sharing table; return its rows keyed by output tokens."""
    print("\n### Prefix sharing: 4 parallel samples of a 1024-token prompt (block size 16)\n")
    print("| output tokens | blocks, no sharing | blocks, shared | memory saved | CoW copies |")
    print("|---:|---:|---:|---:|---:|")
    rows: dict[str, dict] = {}
    for out in (128, 512, 1024):
        p = parallel_sampling(1024, 4, out, block_size=16)
        print(
            f"| {out} | {p.blocks_unshared} | {p.blocks_shared} | {100 * p.memory_saved:.1f} % | "
            f"{p.cow_copies} |"
        )
        rows[str(out)] = {
            "blocks_no_sharing": p.blocks_unshared,
            "blocks_shared": p.blocks_shared,
            "memory_saved": round(100 * p.memory_saved, 1),
            "cow_copies": p.cow_copies,
        }
    return rows


def bench_attention(min_run_time: float) -> dict[str, dict]:
    """Print the paged-vs-dense attention table; return its rows keyed ``<seqs>-<lens>``."""
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    print(
        f"\n### Paged attention vs dense SDPA (fp32 CPU, {heads}/{kv_heads} heads, d={dim}, block 16)\n"
    )
    print("| seqs | context lens | dense SDPA ms | paged ms | paged / dense | max abs diff |")
    print("|---:|---|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    cases = ((8, 512), (32, 512), (8, 2048), (32, 2048))
    rows: dict[str, dict] = {}
    for num_seqs, max_len in tqdm(
        cases, desc="paged attention", leave=False, file=sys.stderr, disable=None
    ):
        row = _attention_case(num_seqs, max_len, g, min_run_time, heads, kv_heads, dim, bs)
        rows[f"{num_seqs}-{row['context_lens']}"] = row
    return rows


def _attention_case(
    num_seqs: int,
    max_len: int,
    g: torch.Generator,
    min_run_time: float,
    heads: int,
    kv_heads: int,
    dim: int,
    bs: int,
) -> dict:
    lens = torch.randint(max_len // 4, max_len + 1, (num_seqs,), generator=g)
    cache = PagedKVCache(sum((int(n) + bs - 1) // bs for n in lens) + 1, bs, kv_heads, dim)
    dense_k = torch.zeros(num_seqs, kv_heads, max_len, dim)
    dense_v = torch.zeros(num_seqs, kv_heads, max_len, dim)
    for i, n in enumerate(lens.tolist()):
        k = torch.randn(kv_heads, n, dim, generator=g)
        v = torch.randn(kv_heads, n, dim, generator=g)
        cache.append(i, k, v)
        dense_k[i, :, :n], dense_v[i, :, :n] = k, v
    tables, context = cache.block_tables(range(num_seqs))
    q = torch.randn(num_seqs, heads, dim, generator=g)
    mask = (torch.arange(max_len) < lens[:, None])[:, None, None, :]  # (S, 1, 1, T)

    def dense() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None, :], dense_k, dense_v, attn_mask=mask, enable_gqa=True
        )[:, :, 0]

    def paged() -> torch.Tensor:
        return paged_attention(q, cache.k_pools[0], cache.v_pools[0], tables, context)

    diff = (dense() - paged()).abs().max().item()
    t_dense = 1000 * measure(dense, min_run_time=min_run_time).median
    t_paged = 1000 * measure(paged, min_run_time=min_run_time).median
    tqdm.write(
        f"| {num_seqs} | {max_len // 4}-{max_len} | {t_dense:.2f} | {t_paged:.2f} | "
        f"{t_paged / t_dense:.2f} | {diff:.1e} |"
    )
    return {
        "context_lens": f"{max_len // 4}-{max_len}",
        "dense_sdpa_ms": round(t_dense, 2),
        "paged_ms": round(t_paged, 2),
        "paged_per_dense": round(t_paged / t_dense, 2),
        "max_abs_diff": float(f"{diff:.1e}"),
    }


def bench_generation(new_tokens: int, min_run_time: float) -> dict[str, dict]:
    """Print the generation table; return its rows keyed by cache."""

    from kvlib import compat
    from kvlib.models import load_model

    model, tok = load_model(device="cpu")
    text = "The history of the printing press begins"
    ids = tok(text, return_tensors="pt").input_ids
    print(f"\n### Generation on the bundled SmolLM2-135M ({new_tokens} new tokens, greedy, CPU)\n")
    print("| cache | ms / new token | same tokens as DynamicCache |")
    print("|---|---:|---|")
    ref = compat.generate(
        model,
        ids,
        cache=cache_factory(reference_name(model.dtype), model.config)(),
        max_new_tokens=new_tokens,
        do_sample=False,
    )
    rows = []
    for name, make in (  # the registry's caches, under the row names the results file keeps
        ("DynamicCache", cache_factory(reference_name(model.dtype), model.config)),
        (
            "PagedCache (block 16)",
            cache_factory("paged", model.config, num_blocks=64, block_size=16),
        ),
    ):
        out = {}

        def run(make=make, out=out):
            out["ids"] = compat.generate(
                model, ids, cache=make(), max_new_tokens=new_tokens, do_sample=False
            )

        ms = 1000 * measure(run, min_run_time=min_run_time).median / new_tokens
        rows.append((name, ms, torch.equal(out["ids"], ref)))
    for name, ms, same in rows:
        print(f"| {name} | {ms:.1f} | {same} |")
    return {
        name: {"ms_per_new_token": round(ms, 1), "same_tokens_as_dynamiccache": same}
        for name, ms, same in rows
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, shorter timings")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--no-json", action="store_true", help="do not write kvlib/results.json")
    args = parser.parse_args()
    # One thread: on the shared 2-core machine two threads ran ~10x slower (oversubscription).
    torch.set_num_threads(args.threads)
    num_requests = 300 if args.quick else 1000
    groups = bench_simulation(num_requests)
    groups["prefix_sharing"] = bench_sharing()
    groups["attention"] = bench_attention(0.2 if args.quick else 1.0)  # s per case and kernel
    groups["generation"] = bench_generation(16 if args.quick else 32, 1.0 if args.quick else 3.0)

    if not args.no_json:
        entry = {
            "source": "benchmarks/bench_paged.py",
            "command": ("python benchmarks/bench_paged.py " + " ".join(sys.argv[1:])).strip(),
            "machine": machine(args.threads),
            "model": "SmolLM2-135M",
            "settings": {
                "requests": num_requests,
                "seed": SEED,
                "kv_budget_gib": CAPACITY // 2**30,
                "max_len": MAX_LEN,
                "fp16_bytes_per_token": SMOLLM2_FP16_BYTES_PER_TOKEN,
            },
            **groups,
        }
        print(f"wrote run 'paged' to {results.record_run('paged', entry)}", file=sys.stderr)


if __name__ == "__main__":
    main()
