"""kvlib.plan_engines: a decision as transformers kwargs, vLLM arguments, llama.cpp flags and
command lines (the generate() run with these kwargs is in test_plan.py, marked slow)."""

from __future__ import annotations

import pytest

from kvlib import plan_engines, specs
from kvlib.plan_rule import context_that_fits, decide, sequences_that_fit

LLAMA8 = specs.get_spec("llama-3.1-8b")


def test_transformers_kwargs_per_setting():
    assert plan_engines.transformers_kwargs(decide(LLAMA8, 80, 8192)) == {
        "cache_implementation": "dynamic"
    }
    int8 = decide(LLAMA8, 80, 131072, 4)
    assert int8.kv == "int8"
    assert plan_engines.transformers_kwargs(int8)["cache_config"] == {"backend": "fp8"}
    int4 = plan_engines.transformers_kwargs(decide(LLAMA8, 24, 32768, 4))
    assert int4["cache_config"] == {
        "backend": "quanto",
        "nbits": 4,
        "q_group_size": 64,
        "residual_length": 128,
    }
    gemma = decide(specs.get_spec("gemma-2-9b"), 24, 32768, 8)
    assert gemma.kv not in (None, "fp16")
    with pytest.raises(ValueError, match="sliding-window"):
        plan_engines.transformers_kwargs(gemma)


def test_vllm_recounts_int4_at_fp8():
    d = decide(LLAMA8, 24, 32768, 4)
    v = plan_engines.vllm_args(d)
    at_fp8 = sequences_that_fit(LLAMA8, d.budget.kv_budget_bytes, 32768, (8, None))
    assert v["kv_cache_dtype"] == "fp8" and v["max_num_seqs"] == max(1, min(4, at_fp8)) < 4
    assert v["gpu_memory_utilization"] == 0.9 and v["block_size"] == 16
    assert "quantization" not in v
    fp16 = plan_engines.vllm_args(decide(LLAMA8, 80, 8192, 8))
    assert fp16["kv_cache_dtype"] == "auto" and fp16["max_num_seqs"] == 8
    w8 = plan_engines.vllm_args(decide(LLAMA8, 80, 8192, 8, weight_bits=8, num_gpus=2))
    assert w8["quantization"] == "fp8" and w8["tensor_parallel_size"] == 2


def test_llama_cpp_slots_and_a_context_that_fits():
    d = decide(LLAMA8, 24, 32768, 4)
    flags = plan_engines.llama_cpp_flags(d)
    assert flags["-np"] == 4 and flags["-c"] == 4 * 32768 and flags["--cache-type-k"] == "q4_0"
    # int2 fits one 128k sequence where llama.cpp's lowest type (q4_0) does not: -c shrinks
    for gib in [17 + 0.05 * i for i in range(100)]:
        d = decide(LLAMA8, gib, 131072, 1, quality="aggressive")
        budget = d.budget.kv_budget_bytes
        if d.kv == "int2" and sequences_that_fit(LLAMA8, budget, 131072, (4, 64)) == 0:
            break
    else:
        pytest.fail("no memory size where int2 fits and q4_0 does not")
    flags = plan_engines.llama_cpp_flags(d)
    ctx = context_that_fits(LLAMA8, budget, 1, (4, 64))
    assert flags["-np"] == 1 and flags["-c"] == ctx // 256 * 256 < 131072
    assert plan_engines.llama_cpp_flags(decide(LLAMA8, 32, 8192, device="cpu"))["-ngl"] == 0


def test_commands_and_a_request_that_does_not_fit():
    d = decide(LLAMA8, 80, 131072, 4, model="llama-3.1-8b")
    cmd = plan_engines.commands(d, "meta-llama/Llama-3.1-8B-Instruct")
    assert cmd["vllm"].startswith(
        "vllm serve meta-llama/Llama-3.1-8B-Instruct --kv-cache-dtype fp8"
    )
    assert cmd["vllm"].endswith("--enable-prefix-caching")  # a flag without a value
    assert cmd["llama.cpp"].startswith("llama-server -m meta-llama/Llama-3.1-8B-Instruct.gguf -c ")
    assert plan_engines.commands(d)["vllm"].startswith("vllm serve llama-3.1-8b ")
    none = decide(specs.get_spec("qwen2.5-7b"), 16, 8192, model="qwen2.5-7b")
    assert plan_engines.commands(none) == {}
    with pytest.raises(ValueError, match=r"no vLLM settings: qwen2.5-7b does not fit .*\(try\)"):
        plan_engines.vllm_args(none, hint="try")
    with pytest.raises(ValueError, match="see plan.suggestions"):
        plan_engines.llama_cpp_flags(none)
