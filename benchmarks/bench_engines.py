"""llama.cpp's KV-cache types on the bundled GGUF, measured like kvlib's caches (issue 18).

llama.cpp is the engine most laptop users run, and the bundled model *is* its native format
(``SmolLM2-135M-Instruct.Q4_1.gguf``). This benchmark runs that file through llama-cpp-python
with each KV-cache type llama.cpp offers (``--cache-type-k/-v``: f16, q8_0, q5_1, q5_0, q4_1,
q4_0, iq4_nl, and mixed K/V pairs) and measures, per type:

- perplexity with the protocol of ``benchmarks/bench_cache.py``: the same token ids (kvlib's
  tokenizer), the same consecutive 2,048-token segments of ``kvlib.data.load_eval_text()``,
  fed 64 tokens at a time so that every chunk reads the quantized past; the delta is taken
  against llama.cpp's own f16 cache, segment by segment;
- bytes per token from ggml's block formats (``kvlib.plan.engines``: q8_0 8.5 bits, q4_0 4.5, …);
- decode tokens/s after a 1,024-token prompt (median of ``torch.utils.benchmark`` blocks), and
  its ratio to f16, measured side by side in this run.

What differs from kvlib's rows, and why deltas are compared rather than perplexities:
llama.cpp keeps the Q4_1 weights (transformers de-quantizes them to float32), runs its own
kernels, and has no full-precision window: every cached token, the newest included, is stored
and read in the chosen type. So each engine's rows are read against that engine's own
unquantized cache.

``--model`` names one of :data:`kvlib.models.OFFLINE_MODELS` (its own GGUF file: SmolLM2's
Q4_1, Gemma 3 270M's Q4_K_M, which llama.cpp serves with its interleaved sliding-window cache:
the sliding layers keep their window, as in :func:`kvlib.memory.kv_cache_bytes`). Bytes per token
are therefore given at a length (4,096 tokens), as the cache benchmark gives them.

Needs the peer environment (``make peers``: llama-cpp-python, built from source, ~10 minutes on
2 cores). Writes run ``"llama.cpp"`` of ``kvlib/results.json`` (``"llama.cpp/<model>"`` for a
model other than the default, :func:`kvlib.results.run_name`).

    .venv/bin/python benchmarks/bench_engines.py            # 4 segments of 2,048 tokens
    .venv/bin/python benchmarks/bench_engines.py --quick    # 1 segment of 1,024 tokens
    .venv/bin/python benchmarks/bench_engines.py --model gemma-3-270m   # the second model
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import warnings

import numpy as np
import torch
from _machine import machine
from _progress import bar, log
from _tables import markdown_table
from _timing import measure

import kvlib
from kvlib import results
from kvlib.memory import kv_cache_bytes
from kvlib.plan import engines
from kvlib.specs import spec_from_config

#: (K type, V type) pairs measured: every type alone, then 8-bit keys (the side with outlier
#: channels, notebooks 02-04) next to 4-bit values. About 4 minutes per type on 2 cores.
PAIRS: tuple[tuple[str, str], ...] = (
    ("f16", "f16"),
    ("q8_0", "q8_0"),
    ("q5_1", "q5_1"),
    ("q5_0", "q5_0"),
    ("q4_1", "q4_1"),
    ("iq4_nl", "iq4_nl"),
    ("q4_0", "q4_0"),
    ("q8_0", "q4_0"),
)
CHUNK = 64


def pair_name(k: str, v: str) -> str:
    """Row key: ``"q8_0"`` when K and V agree, ``"k-q8_0/v-q4_0"`` otherwise."""
    return k if k == v else f"k-{k}/v-{v}"


def ggml_type(name: str) -> int:
    import llama_cpp

    return getattr(llama_cpp, f"GGML_TYPE_{name.upper()}")


def open_llama(k: str, v: str, n_ctx: int, threads: int, model: str | None = None):
    """Offline model ``model``'s GGUF (default: the bundled SmolLM2) in llama.cpp with K/V cache
    types ``k``/``v`` (flash attention on: a quantized V cache needs it), logits kept for every
    position. Sliding-window layers keep their window, not the whole context (``swa_full=False``,
    llama-server's default; the library's would keep full-size windows)."""
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(kvlib.models.offline_model(model).locate()),
        n_ctx=n_ctx, n_batch=CHUNK, n_ubatch=CHUNK, n_threads=threads, n_threads_batch=threads,
        logits_all=True, flash_attn=True, type_k=ggml_type(k), type_v=ggml_type(v),
        swa_full=False, verbose=False, seed=0,
    )  # fmt: skip


def chunked_perplexity(llm, ids: list[int]) -> float:
    """``exp`` of the mean NLL of ``ids[1:]``, the text fed ``CHUNK`` tokens at a time."""
    llm.reset()
    llm.eval(ids)
    nll = []
    for start in range(0, len(ids) - 1, CHUNK):  # float64 a chunk at a time: 262k-word vocabularies
        stop = min(start + CHUNK, len(ids) - 1)
        logits = np.asarray(llm.scores[start:stop], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll.append(-logp[np.arange(stop - start), ids[start + 1 : stop + 1]])
    return float(np.exp(np.concatenate(nll).mean()))


def decode_rate(llm, prompt: list[int], steps: list[int], threads: int) -> float:
    """Tokens/s of one-token decode steps after ``prompt`` (median of timed blocks)."""
    llm.reset()
    llm.eval(prompt)

    def decode() -> None:
        llm.n_tokens = len(prompt)  # eval() first drops the cache beyond n_tokens: a rewind
        for t in steps:
            llm.eval([t])

    return len(steps) / measure(decode, min_run_time=1.0, num_threads=threads).median


#: The length at which bytes per token are given: on a model with sliding-window layers the
#: cache is not linear in the length (the windows stop growing), as in the cache benchmark.
BYTES_AT_TOKENS = 4096


def bytes_per_token(config, k: str, v: str, tokens: int = BYTES_AT_TOKENS) -> float:
    """K and V bytes per token of a ``tokens``-token cache from ggml's block formats
    (:mod:`kvlib.plan.engines`; sliding layers hold their window, :func:`kvlib.memory.kv_cache_bytes`)."""
    spec = spec_from_config(config)
    half = []
    for t in (k, v):
        bits, group, meta, _ = engines.kv_type("llama.cpp", t).storage
        nbytes = kv_cache_bytes(spec, tokens, 1, bits, group_size=group, group_meta_bits=meta)
        half.append(nbytes / 2 / tokens)
    return sum(half)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 segment of 1,024 tokens")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per segment (2048)")
    ap.add_argument("--segments", type=int, default=None, help="consecutive segments (4)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--model",
        default=kvlib.models.DEFAULT_MODEL,
        choices=list(kvlib.models.OFFLINE_MODELS),
        help="the offline model measured (its own GGUF file)",
    )
    ap.add_argument("--no-json", action="store_true", help="do not write kvlib/results.json")
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (1024 if args.quick else 2048)
    args.segments = args.segments or (1 if args.quick else 4)
    return args


def measure_types(
    args: argparse.Namespace, segments: list[list[int]], prompt: list[int], steps: list[int]
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """(name -> perplexity on each segment, name -> decode tokens/s after ``prompt``) of every
    cache-type pair of :data:`PAIRS`, each in a llama.cpp context of its own."""
    ppl: dict[str, list[float]] = {}
    speed: dict[str, float] = {}
    for k, v in bar(PAIRS, desc="llama.cpp cache types"):
        name = pair_name(k, v)
        llm = open_llama(
            k, v, n_ctx=max(args.tokens, len(prompt) + len(steps)) + CHUNK, threads=args.threads,
            model=args.model,
        )  # fmt: skip
        ppl[name] = [chunked_perplexity(llm, seg) for seg in segments]
        speed[name] = decode_rate(llm, prompt, steps, args.threads)
        log(f"{name}: perplexity {statistics.mean(ppl[name]):.4f}, {speed[name]:.0f} tok/s")
        del llm
    return ppl, speed


def type_rows(
    config, ppl: dict[str, list[float]], speed: dict[str, float], ref: str
) -> dict[str, dict]:
    """The results file's row of each pair: bits, bytes per token at :data:`BYTES_AT_TOKENS`
    tokens, the perplexity cost on each segment against ``ref``'s and the decode speed."""
    fp16 = kv_cache_bytes(spec_from_config(config), BYTES_AT_TOKENS, 1, 16) / BYTES_AT_TOKENS
    rows = {}
    for k, v in PAIRS:
        name = pair_name(k, v)
        deltas = [100 * (p / r - 1) for p, r in zip(ppl[name], ppl[ref], strict=True)]
        bpt = bytes_per_token(config, k, v)
        bits = tuple(engines.kv_type("llama.cpp", t).effective_bits for t in (k, v))
        rows[name] = {
            "type_k": k,
            "type_v": v,
            "bits_per_element": [round(b, 3) for b in bits],
            "bytes_per_token": round(bpt, 1),
            "x_smaller_than_fp16": round(fp16 / bpt, 3),
            "perplexity_segments": [round(p, 5) for p in ppl[name]],
            "perplexity_delta_pct_segments": [round(d, 4) for d in deltas],
            "perplexity_delta_pct_mean": round(statistics.mean(deltas), 4),
            "decode_tokens_per_s": round(speed[name], 2),
            "slowdown_vs_reference": round(speed[ref] / speed[name], 3),
        }
    return rows


def table(rows: dict[str, dict]) -> str:
    """The Markdown table of :func:`type_rows`' rows."""
    header = ["cache type (K/V)", "bits (K, V)", "bytes/token", "x smaller than f16"]
    header += ["mean delta (%)", "segments (%)", "decode tok/s", "slowdown vs f16"]
    lines = markdown_table(
        header,
        [
            [
                name,
                ", ".join(f"{b:g}" for b in r["bits_per_element"]),
                f"{r['bytes_per_token']:,.0f}",
                f"{r['x_smaller_than_fp16']:.2f}",
                f"{r['perplexity_delta_pct_mean']:+.2f}",
                ", ".join(f"{d:+.2f}" for d in r["perplexity_delta_pct_segments"]),
                f"{r['decode_tokens_per_s']:.0f}",
                f"{r['slowdown_vs_reference']:.2f}",
            ]
            for name, r in rows.items()
        ],
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(
            "llama-cpp-python is not installed: run `make peers` first (it builds llama.cpp "
            "from source, about 10 minutes on 2 cores)"
        ) from None
    tokens, n_seg = args.tokens, args.segments
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    offline = kvlib.models.offline_model(args.model)
    model, tok = kvlib.models.load_model(args.model)
    text = kvlib.data.load_eval_text()[: tokens * n_seg * 8 + 1000]
    all_ids = tok(text, return_tensors="pt").input_ids[0].tolist()
    if len(all_ids) < tokens * n_seg:
        raise SystemExit(f"the evaluation text holds only {len(all_ids)} tokens")
    # a later segment starts with the BOS token where the text does (Gemma), as in bench_cache.py
    segments = [kvlib.data.segment(all_ids, i, tokens, tok.bos_token_id) for i in range(n_seg)]
    decode_prompt, decode_steps = all_ids[:1024], all_ids[1024 : 1024 + 32]
    ppl, speed = measure_types(args, segments, decode_prompt, decode_steps)

    ref = pair_name("f16", "f16")
    where = f"{machine(args.threads)}, llama-cpp-python {llama_cpp.__version__}"
    date = datetime.datetime.now(datetime.UTC).date().isoformat()
    cmd = "python " + " ".join(["benchmarks/bench_engines.py", *(argv or sys.argv[1:])])
    rows = type_rows(model.config, ppl, speed, ref)
    print(
        f"\nCommand: `{cmd}`; {offline.title}; {n_seg} × {tokens} tokens, chunks of {CHUNK}; "
        f"bytes per token at {BYTES_AT_TOKENS} tokens; {where}; {date}\n"
    )
    print(table(rows))
    if args.no_json:
        return
    entry = {
        "source": "benchmarks/bench_engines.py",
        "command": cmd,
        "date": date,
        "machine": where,
        "model": f"{offline.title} ({offline.weights} GGUF weights, llama.cpp)",
        "settings": {
            "engine": "llama.cpp",
            "tokens": tokens,
            "segments": n_seg,
            "chunk_size": CHUNK,
            "flash_attention": True,
            "decode_prompt_tokens": len(decode_prompt),
            "decode_new_tokens": len(decode_steps),
            "reference": ref,
            "bytes_at_tokens": BYTES_AT_TOKENS,
        },
        "rows": rows,
    }
    name = results.run_name("llama.cpp", args.model)
    log(f"wrote run {name!r} to {results.record_run(name, entry)}")


if __name__ == "__main__":
    main()
