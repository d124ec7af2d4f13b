"""Every plan in a grid of 64 requests runs on its engines' default GPU builds, and says why
when it keeps a type that another measured type beats.

The grid is 4 models (full attention with 128-wide heads, GQA with 4 KV heads, sliding windows
with 256-wide heads, 96-wide MHA heads) × 2 GPU sizes × 2 contexts × 2 concurrencies × 2 weight
widths. What the engines run is :mod:`kvlib.plan.engine_support`'s data, read from llama.cpp's and
vLLM's sources, not restated here.
"""

from __future__ import annotations

import itertools

import pytest

from kvlib.plan import engine_support, engines
from kvlib.plan import planner as plan
from kvlib.plan import settings as plan_engines
from kvlib.plan import text as plan_text

MODELS = ["llama-3.1-8b", "qwen2.5-7b", "gemma-2-9b", "phi-3-mini"]
GRID = list(itertools.product(MODELS, [24, 80], [8192, 32768], [1, 16], [16, 4]))
#: vLLM engine arguments a plan may set (each one of ``vllm serve``'s flags in vLLM 0.32).
VLLM_ARGS = {
    "kv_cache_dtype",
    "kv_cache_memory_bytes",
    "max_model_len",
    "max_num_seqs",
    "tensor_parallel_size",
    "quantization",
}


def test_the_grid_is_64_requests():
    assert len(GRID) == 64


def _check_llama_cpp(p: plan.Plan) -> None:
    flags = p.to_llama_cpp()
    k, v = flags["--cache-type-k"], flags["--cache-type-v"]
    assert engine_support.llama_cpp_cuda_path(k, v) == "native", (k, v)
    assert engine_support.llama_cpp_build_flag_needed(k, v) is None
    if (k, v) != ("f16", "f16"):
        assert p.spec.head_dim in engines.GGML_CUDA_VEC_HEAD_SIZES
        assert flags["-fa"] == "on"  # a quantized V cache needs flash attention
    assert flags["-ngl"] == 999
    gguf = plan_engines.checkpoint(p, "llama.cpp")
    assert gguf.endswith(f"-{plan_engines.GGUF_WEIGHTS[p.weight_bits]}.gguf")


def _check_vllm(p: plan.Plan) -> None:
    args = p.to_vllm()
    assert set(args) <= VLLM_ARGS, set(args) - VLLM_ARGS
    dtype = args.get("kv_cache_dtype", "auto")
    assert dtype in engine_support.vllm_kv_dtypes()
    assert engine_support.vllm_dtype(dtype).runs_on_cuda
    defaults = engine_support.vllm_defaults()
    assert defaults.has_kv_cache_memory_bytes
    assert args["kv_cache_memory_bytes"] == p.budget.kv_budget_bytes > 0
    assert "kv_cache_dtype" not in args or args["kv_cache_dtype"] != "auto"  # no restated default
    assert args.get("tensor_parallel_size", 2) > 1
    model = plan_engines.checkpoint(p, "vllm")
    if p.weight_bits == 4:
        assert "quantization" not in args and model.startswith("<AWQ int4 checkpoint of ")
    elif p.weight_bits == 8:
        assert args["quantization"] in engine_support._data()["vllm"]["quantization_methods"]
    else:
        assert "quantization" not in args and model == p.spec.hub_id


@pytest.mark.parametrize("model, gib, context, users, weight_bits", GRID)
def test_every_plan_runs_on_its_engines_default_gpu_build(model, gib, context, users, weight_bits):
    p = plan.recommend(model, gib, context, users, weight_bits=weight_bits)
    for engine, option in p.options.items():
        if option.kv is None:
            continue
        t = engines.kv_type(engine, option.kv_type)
        assert engines.runs_well(t, "gpu", p.spec.head_dim), (engine, t.name)
        if engine == "llama.cpp":
            _check_llama_cpp(p)
        elif engine == "vllm":
            _check_vllm(p)
    # a type another measured type beats on bytes and quality is kept only with a reason
    better = plan_text.dominating(p, p.results)
    if better:
        assert any(
            r.startswith(f"{better[0].name} on {better[0].engine} would store") for r in p.reasons
        )
