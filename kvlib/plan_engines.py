"""The planner's decision as each engine's settings: transformers, vLLM and llama.cpp.

Introduced in notebook 08. :class:`kvlib.plan.Plan`'s ``to_transformers()``, ``to_vllm()``,
``to_llama_cpp()`` and ``commands()`` return these for its decision. Each engine spells a KV
setting its own way (:data:`kvlib.plan_rule.KV_SETTINGS` holds the spellings): transformers'
``QuantizedCache`` backends, vLLM's ``kv_cache_dtype`` (``auto`` or ``fp8`` only, so a plan at
int4/int2 is recounted at 8 bits) and llama.cpp's cache types (q8_0, q4_0; no 2-bit type).
"""

from __future__ import annotations

from typing import Any

from kvlib.plan_rule import (
    HEADROOM_FRACTION,
    KV_SETTINGS,
    VLLM_BLOCK_SIZE,
    Decision,
    KVSetting,
    context_that_fits,
    sequences_that_fit,
)

__all__ = ["commands", "llama_cpp_flags", "transformers_kwargs", "vllm_args"]

_SEE = "see plan.suggestions"


def _require_feasible(d: Decision, engine: str, hint: str) -> KVSetting:
    if d.kv is None:
        raise ValueError(f"no {engine} settings: {d.model} does not fit this request ({hint})")
    return KV_SETTINGS[d.kv]


def transformers_kwargs(d: Decision, *, hint: str = _SEE) -> dict[str, Any]:
    """Keyword arguments for ``model.generate(**inputs, **kwargs)``.

    fp16 → ``DynamicCache``; int8 → ``QuantizedCache`` with the per-tensor fp8 backend;
    int4/int2 → ``QuantizedCache`` with optimum-quanto, group size 64, the 128 most recent tokens
    kept in full precision. transformers' ``QuantizedCache`` takes full-attention models only.

    Raises:
        ValueError: the request does not fit (``hint`` says what would), or a quantized setting
            for a model with sliding-window layers (use vLLM, or kvlib's cache from notebook 04).
    """
    s = _require_feasible(d, "transformers", hint)
    if s.name == "fp16":
        return {"cache_implementation": "dynamic"}
    if d.spec.num_sliding_layers > 0:
        raise ValueError(
            f"transformers' QuantizedCache supports full-attention models only and "
            f"{d.model} has sliding-window layers: use to_vllm(), or kvlib's cache "
            "(notebook 04), or kv='fp16'"
        )
    if s.name == "int8":
        return {"cache_implementation": "quantized", "cache_config": {"backend": "fp8"}}
    return {
        "cache_implementation": "quantized",
        "cache_config": {
            "backend": "quanto",
            "nbits": s.bits,
            "q_group_size": 64,
            "residual_length": 128,
        },
    }


def _vllm_max_num_seqs(d: Decision, hint: str) -> tuple[str, int]:
    s = _require_feasible(d, "vLLM", hint)
    dtype = s.vllm_dtype
    if dtype == s.name or (dtype == "auto" and s.name == "fp16"):
        return dtype, d.num_sequences
    # int4/int2 are not vLLM cache dtypes: it runs fp8, so recount what fits at 8 bits
    fit = sequences_that_fit(
        d.spec, d.budget.kv_budget_bytes, d.context_len, (8, None), d.tensor_parallel_size
    )
    return dtype, max(1, min(d.concurrency, fit))


def vllm_args(d: Decision, *, hint: str = _SEE) -> dict[str, Any]:
    """Engine arguments for ``vllm.LLM(model, **args)`` / ``vllm serve``.

    vLLM's KV cache dtypes are ``auto`` (the model dtype) and ``fp8``; a plan at int4/int2 maps
    to ``fp8`` and ``max_num_seqs`` is recounted at 8 bits.

    Raises:
        ValueError: the request does not fit (``hint`` says what would).
    """
    dtype, max_num_seqs = _vllm_max_num_seqs(d, hint)
    out: dict[str, Any] = {
        "kv_cache_dtype": dtype,
        "block_size": VLLM_BLOCK_SIZE,
        "max_model_len": d.context_len,
        "max_num_seqs": max_num_seqs,
        "gpu_memory_utilization": round(1.0 - HEADROOM_FRACTION["gpu"], 2),
        "tensor_parallel_size": d.tensor_parallel_size,
        "enable_prefix_caching": True,
    }
    if d.weight_bits == 8:
        out["quantization"] = "fp8"
    return out


def llama_cpp_flags(d: Decision, *, hint: str = _SEE) -> dict[str, Any]:
    """Flags for ``llama-server`` / ``llama-cli``.

    llama.cpp reserves ``-c`` tokens up front and splits them across ``-np`` parallel slots,
    so ``-c`` is context × slots, and the slot count is what fits at llama.cpp's cache type
    (q8_0 = 8.5, q4_0 = 4.5 bits; it has no 2-bit cache type). A quantized V cache needs flash
    attention (``-fa on``).

    Raises:
        ValueError: the request does not fit (``hint`` says what would).
    """
    s = _require_feasible(d, "llama.cpp", hint)
    llama = (s.llama_cpp_bits, None if s.llama_cpp_bits == 16 else 64)
    kv_budget, tp = d.budget.kv_budget_bytes, d.tensor_parallel_size
    fit = sequences_that_fit(d.spec, kv_budget, d.context_len, llama, tp)
    slots = max(1, min(d.concurrency, fit))
    ctx = d.context_len
    if fit == 0:  # not even one slot at full context: the context that fits
        ctx = context_that_fits(d.spec, kv_budget, 1, llama, tp)
        ctx = max(256, ctx // 256 * 256)
    return {
        "-c": ctx * slots,
        "-np": slots,
        "--cache-type-k": s.llama_cpp_type,
        "--cache-type-v": s.llama_cpp_type,
        "-fa": "on",
        "-ngl": 0 if d.device == "cpu" else 999,
    }


def commands(d: Decision, model_path: str | None = None) -> dict[str, str]:
    """Command lines for each engine (``vllm serve``, ``llama-server``), as strings; ``{}``
    when the request does not fit."""
    name = model_path or d.model
    if d.kv is None:
        return {}
    vllm = " ".join(
        f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')} {v}"
        for k, v in vllm_args(d).items()
    )
    llama = " ".join(f"{k} {v}" for k, v in llama_cpp_flags(d).items())
    return {
        "vllm": f"vllm serve {name} {vllm}",
        "llama.cpp": f"llama-server -m {name}.gguf {llama}",
    }
