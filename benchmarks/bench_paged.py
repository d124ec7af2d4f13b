"""PagedAttention benchmark: memory waste in a serving simulation, prefix sharing, attention speed.

    .venv/bin/python benchmarks/bench_paged.py           # full (~1 min on a quiet 2-core CPU)
    .venv/bin/python benchmarks/bench_paged.py --quick   # fewer requests / repeats

Prints markdown tables:

1. the serving simulation (kvlib.serving) on a seeded ShareGPT-like trace: KV memory wasted
   (reserved but unused), peak / mean concurrent sequences, completed requests per 1000 steps,
   for contiguous max-length reservation, exact-length reservation (oracle) and paging at block
   sizes 8 / 16 / 32;
2. parallel sampling (4 samples of a 1024-token prompt) with and without prefix sharing;
3. paged attention (kvlib.paged.paged_attention, a gather-then-einsum reference) against dense
   ``scaled_dot_product_attention`` over padded contiguous K/V at the same lengths (median of
   repeats after warm-up, side by side in one run);
4. generation with kvlib.paged.PagedCache vs transformers' DynamicCache on the bundled model.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlib.paged import (
    PagedCache,
    PagedKVCache,
    make_trace,
    paged_attention,
    parallel_sampling,
    simulate_serving,
)

CAPACITY = 2**30  # 1 GiB of KV memory (~46.6k tokens of SmolLM2-135M in fp16)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def bench_simulation(num_requests: int) -> None:
    trace = make_trace(num_requests, seed=0)
    print(f"\n### Serving simulation ({num_requests} requests, seed 0, 1 GiB KV, max_len 2048)\n")
    print(
        "| policy | block | waste % | peak seqs | mean seqs | seqs while queued "
        "| req / 1000 steps | preemptions |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    configs = [("contiguous-max", 16), ("contiguous-exact", 16)]
    configs += [("paged", bs) for bs in (8, 16, 32)]
    for policy, bs in configs:
        s = simulate_serving(trace, CAPACITY, policy, block_size=bs)
        row = s.summary()
        block = bs if policy == "paged" else "-"
        print(
            f"| {policy} | {block} | {row['waste_%']:.2f} | {s.peak_concurrent} | "
            f"{s.mean_concurrent:.1f} | {s.busy_concurrent:.1f} | {1000 * s.throughput:.1f} | "
            f"{s.preemptions} |"
        )
    trace4 = make_trace(max(num_requests // 4, 50), seed=0, num_samples=4)
    print(
        f"\n### Parallel sampling in the simulation ({len(trace4)} requests x 4 samples, paged 16)\n"
    )
    print("| prefix sharing | waste % | seqs while queued | req / 1000 steps | preemptions |")
    print("|---|---:|---:|---:|---:|")
    for share in (False, True):
        s = simulate_serving(trace4, CAPACITY, "paged", 16, share_prefix=share)
        print(
            f"| {'yes' if share else 'no'} | {100 * s.waste_fraction:.2f} | "
            f"{s.busy_concurrent:.1f} | {1000 * s.throughput:.1f} | {s.preemptions} |"
        )


def bench_sharing() -> None:
    print("\n### Prefix sharing: 4 parallel samples of a 1024-token prompt (block size 16)\n")
    print("| output tokens | blocks, no sharing | blocks, shared | memory saved | CoW copies |")
    print("|---:|---:|---:|---:|---:|")
    for out in (128, 512, 1024):
        p = parallel_sampling(1024, 4, out, block_size=16)
        print(
            f"| {out} | {p.blocks_unshared} | {p.blocks_shared} | {100 * p.memory_saved:.1f} % | "
            f"{p.cow_copies} |"
        )


def bench_attention(repeats: int) -> None:
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    print(
        f"\n### Paged attention vs dense SDPA (fp32 CPU, {heads}/{kv_heads} heads, d={dim}, block 16)\n"
    )
    print("| seqs | context lens | dense SDPA ms | paged ms | paged / dense | max abs diff |")
    print("|---:|---|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for num_seqs, max_len in ((8, 512), (32, 512), (8, 2048), (32, 2048)):
        _attention_case(num_seqs, max_len, g, repeats, heads, kv_heads, dim, bs)


def _attention_case(
    num_seqs: int,
    max_len: int,
    g: torch.Generator,
    repeats: int,
    heads: int,
    kv_heads: int,
    dim: int,
    bs: int,
) -> None:
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
    t_dense = median_ms(dense, repeats)
    t_paged = median_ms(paged, repeats)
    print(
        f"| {num_seqs} | {max_len // 4}-{max_len} | {t_dense:.2f} | {t_paged:.2f} | "
        f"{t_paged / t_dense:.2f} | {diff:.1e} |"
    )


def bench_generation(new_tokens: int, repeats: int) -> None:
    from transformers import DynamicCache

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
        cache=DynamicCache(config=model.config),
        max_new_tokens=new_tokens,
        do_sample=False,
    )
    rows = []
    for name, make in (
        ("DynamicCache", lambda: DynamicCache(config=model.config)),
        ("PagedCache (block 16)", lambda: PagedCache(model.config, num_blocks=64, block_size=16)),
    ):
        out = {}

        def run(make=make, out=out):
            out["ids"] = compat.generate(
                model, ids, cache=make(), max_new_tokens=new_tokens, do_sample=False
            )

        ms = median_ms(run, repeats) / new_tokens
        rows.append((name, ms, torch.equal(out["ids"], ref)))
    for name, ms, same in rows:
        print(f"| {name} | {ms:.1f} | {same} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    # One thread: on the shared 2-core machine two threads ran ~10x slower (oversubscription).
    torch.set_num_threads(args.threads)
    bench_simulation(300 if args.quick else 1000)
    bench_sharing()
    bench_attention(5 if args.quick else 15)
    bench_generation(16 if args.quick else 32, 2 if args.quick else 3)


if __name__ == "__main__":
    main()
