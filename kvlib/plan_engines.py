"""The planner's decision as each engine's settings: transformers, vLLM and llama.cpp.

Introduced in notebook 08. :class:`kvlib.plan.Plan`'s ``to_transformers()``, ``to_vllm()``,
``to_llama_cpp()`` and ``commands()`` return these. Each engine's settings come from its own
:class:`~kvlib.plan_rule.EngineOption` — the plan's rule run on the KV types that engine has
(:mod:`kvlib.engines`) — so the type each one sets is one it accepts and the number of sequences
it provisions is what fits at that type's bytes: vLLM's ``kv_cache_dtype`` is ``auto`` or
``fp8``, llama.cpp's cache types go down to ``q4_0``, and transformers runs kvlib's cache down
to int2.
"""

from __future__ import annotations

from typing import Any

from kvlib import engines
from kvlib.plan_rule import HEADROOM_FRACTION, VLLM_BLOCK_SIZE, Decision, EngineOption

__all__ = ["commands", "llama_cpp_flags", "transformers_kwargs", "vllm_args"]

_SEE = "see plan.suggestions"


def _option(d: Decision, engine: str, hint: str) -> EngineOption:
    option = d.options.get(engine)
    if option is None:
        why = (
            "a CPU plan runs llama.cpp"
            if d.device == "cpu"
            else "only vLLM splits a model across GPUs (tensor parallelism)"
        )
        raise ValueError(f"no {engine} settings for this plan: {why}")
    if option.kv is None:
        raise ValueError(
            f"no {engine} settings: not one sequence of {d.model} at {d.context_len:,} tokens "
            f"fits at any KV type {engine} runs ({hint})"
        )
    return option


def transformers_kwargs(d: Decision, *, hint: str = _SEE) -> dict[str, Any]:
    """The cache for transformers' ``generate``: ``{"cache": name, "batch_size": n}``.

    ``name`` is a :mod:`kvlib.cache_registry` name (``"dynamic-fp16"``, ``"kvlib-int4"``, …):
    build it with ``kvlib.cache_registry.make_cache(name, model.config)`` (or
    :meth:`kvlib.plan.Plan.transformers_cache`) and pass it as ``past_key_values=``; ``n`` is
    the batch that fits at its bytes. kvlib's quantized caches take full-attention models only,
    so a model with sliding-window layers gets ``dynamic-fp16``.

    Raises:
        ValueError: not one sequence fits at any level transformers runs (``hint`` says what
            would), or the plan is for a CPU.
    """
    o = _option(d, "transformers", hint)
    return {"cache": o.kv_type, "batch_size": o.sequences}


def vllm_args(d: Decision, *, hint: str = _SEE) -> dict[str, Any]:
    """Engine arguments for ``vllm.LLM(model, **args)`` / ``vllm serve``.

    ``kv_cache_dtype`` is ``auto`` (the model's dtype) or ``fp8`` — vLLM has no 4- or 2-bit KV
    cache — and ``max_num_seqs`` is what fits at it.

    Raises:
        ValueError: not one sequence fits even at fp8 (``hint`` says what would), or the plan is
            for a CPU.
    """
    o = _option(d, "vllm", hint)
    out: dict[str, Any] = {
        "kv_cache_dtype": o.kv_type,
        "block_size": VLLM_BLOCK_SIZE,
        "max_model_len": d.context_len,
        "max_num_seqs": o.sequences,
        "gpu_memory_utilization": round(1.0 - HEADROOM_FRACTION["gpu"], 2),
        "tensor_parallel_size": d.tensor_parallel_size,
        "enable_prefix_caching": True,
    }
    if d.weight_bits == 8:
        out["quantization"] = "fp8"
    return out


def llama_cpp_flags(d: Decision, *, hint: str = _SEE) -> dict[str, Any]:
    """Flags for ``llama-server`` / ``llama-cli``.

    llama.cpp reserves ``-c`` tokens up front and splits them across ``-np`` parallel slots, so
    ``-c`` is context × slots, and the slot count is what fits at the cache types (``f16``,
    ``q8_0`` = 8.5 or ``q4_0`` = 4.5 bits per value, or keys and values apart, ``q8_0/q4_0``;
    it has no 2-bit type). A quantized V cache needs flash attention (``-fa on``).

    Raises:
        ValueError: not one sequence fits even at q4_0 (``hint`` says what would).
    """
    o = _option(d, "llama.cpp", hint)
    assert o.kv_type is not None
    t = engines.kv_type("llama.cpp", o.kv_type)
    key_type, value_type = t.cache_types  # "q8_0/q4_0": keys q8_0, values q4_0
    quantized = t.needs_flash_attention
    return {
        "-c": d.context_len * o.sequences,
        "-np": o.sequences,
        "--cache-type-k": key_type,
        "--cache-type-v": value_type,
        "-fa": "on" if quantized else "auto",
        "-ngl": 0 if d.device == "cpu" else 999,
    }


def commands(d: Decision, model_path: str | None = None) -> dict[str, str]:
    """Command lines (``vllm serve``, ``llama-server``) for each engine that fits at least one
    sequence, as strings. The model is ``model_path``, else the registry model's hub id, else the
    plan's model name; llama.cpp gets a GGUF file named after it (``Llama-3.1-8B.gguf``) unless
    ``model_path`` is one."""
    name = model_path or d.spec.hub_id or d.model
    out: dict[str, str] = {}
    vllm = d.options.get("vllm")
    if vllm is not None and vllm.kv is not None:
        args = " ".join(
            f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')} {v}"
            for k, v in vllm_args(d).items()
        )
        out["vllm"] = f"vllm serve {name} {args}"
    llama = d.options.get("llama.cpp")
    if llama is not None and llama.kv is not None:
        gguf = name if name.endswith(".gguf") else f"{name.rsplit('/', 1)[-1]}.gguf"
        flags = " ".join(f"{k} {v}" for k, v in llama_cpp_flags(d).items())
        out["llama.cpp"] = f"llama-server -m {gguf} {flags}"
    return out
