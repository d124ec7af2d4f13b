"""The planner's decision as each engine's settings: transformers, vLLM and llama.cpp.

Introduced in notebook 08. :class:`kvlib.plan.planner.Plan`'s ``to_transformers()``, ``to_vllm()``,
``to_llama_cpp()`` and ``commands()`` return these. Each engine's settings come from its own
:class:`~kvlib.plan.rule.EngineOption` — the plan's rule run on the KV types that engine has
(:mod:`kvlib.plan.engines`) — so the type each one sets is one it accepts and the number of sequences
it provisions is what fits at that type's bytes: vLLM's ``kv_cache_dtype`` is ``auto`` or
``fp8``, llama.cpp's cache types go down to ``q4_0``, and transformers runs kvlib's cache down
to int2.
"""

from __future__ import annotations

from typing import Any

from kvlib.plan import budget as plan_budget
from kvlib.plan import engines
from kvlib.plan.rule import Decision, EngineOption

__all__ = [
    "GGUF_WEIGHTS",
    "VLLM_QUANTIZATION",
    "checkpoint",
    "commands",
    "llama_cpp_flags",
    "transformers_kwargs",
    "vllm_args",
    "vllm_max_num_seqs",
]

#: vLLM's ``--quantization`` for the plan's weight bits: ``fp8`` quantizes a 16-bit checkpoint
#: while loading it (W8A8 on GPUs of compute capability 8.9 and later, weight-only through
#: Marlin kernels on 8.0-8.6). 4-bit weights come as a pre-quantized AWQ int4 checkpoint
#: (:func:`checkpoint`), which needs no flag: vLLM reads ``quantization_config.quant_method``
#: from it and picks the Marlin kernels (``awq_marlin``) by itself, and a flag that contradicts
#: the checkpoint is an error (vLLM 0.32's ``vllm/engine/arg_utils.py``,
#: ``vllm/model_executor/layers/quantization/__init__.py``).
VLLM_QUANTIZATION: dict[int, str] = {8: "fp8"}
#: The GGUF weight type llama.cpp loads for the plan's weight bits (``-m``): Q8_0 is 8.5 bits
#: per weight, Q4_K_M about 4.9 (the plan prices 4-bit weights at AWQ's 4.16, see
#: :data:`kvlib.plan.budget.QUANTIZED_WEIGHT_BITS`).
GGUF_WEIGHTS: dict[int, str] = {16: "F16", 8: "Q8_0", 4: "Q4_K_M"}

_SEE = "see plan.suggestions"


def _option(d: Decision, engine: str, hint: str) -> EngineOption:
    option = d.options.get(engine)
    if option is None:
        why = (
            "a CPU plan runs llama.cpp"
            if d.device == "cpu"
            else "transformers' generate() runs one GPU here; vLLM (tensor parallelism) and "
            "llama.cpp (layer split) serve several"
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

    ``name`` is a :mod:`kvlib.caches.registry` name (``"dynamic-fp16"``, ``"kvlib-int4"``, …):
    build it with ``kvlib.caches.registry.make_cache(name, model.config)`` (or
    the CLI prints that call) and pass it as ``past_key_values=``; ``n`` is
    the batch that fits at its bytes. kvlib's caches keep a sliding-window layer's window in
    fp16 and quantize only the global layers, and the plan prices them so.

    Raises:
        ValueError: not one sequence fits at any level transformers runs (``hint`` says what
            would), or the plan is for a CPU.
    """
    o = _option(d, "transformers", hint)
    return {"cache": o.kv_type, "batch_size": o.sequences}


def vllm_max_num_seqs(d: Decision) -> int:
    """vLLM's ``max_num_seqs`` for a plan: the requested concurrency, or, when the request says
    its typical length, as many as the paged cache admits at that length (at most the
    concurrency, at least one).

    vLLM allocates blocks as sequences grow and admits a request while its blocks fit, so the
    flag is a ceiling on the batch, not a reservation: setting it to the count that fits at
    the *full* context (the plan's guarantee, :attr:`EngineOption.sequences`) would turn away
    conversations that fit. Past what memory holds, vLLM preempts the newest sequence and
    recomputes it later; the plan's reasons state the guarantee.
    """
    o = d.options["vllm"]
    if d.typical_context is None or o.kv_type is None:
        return d.concurrency
    t = engines.kv_type("vllm", o.kv_type)
    admitted = plan_budget.paged_sequences(
        d.spec, d.budget.kv_budget_bytes, d.typical_context, t.storage, d.tensor_parallel_size
    )
    return max(1, min(d.concurrency, admitted))


def vllm_args(d: Decision, *, hint: str = _SEE) -> dict[str, Any]:
    """Engine arguments for ``vllm.LLM(model, **args)`` / ``vllm serve``, only those that differ
    from vLLM's defaults.

    * ``kv_cache_dtype``: the plan's type when it is not ``auto`` (the model's dtype);
    * ``kv_cache_memory_bytes``: the plan's KV budget per GPU, so that vLLM's cache is the one
      the plan counted (vLLM then ignores ``gpu_memory_utilization``);
    * ``max_model_len``: the context; ``max_num_seqs``: :func:`vllm_max_num_seqs`;
    * ``tensor_parallel_size`` when above 1; ``quantization="fp8"`` for 8-bit weights of a 16-bit
      checkpoint (vLLM quantizes it as it loads it; a checkpoint that ships FP8 weights,
      :attr:`~kvlib.specs.ModelSpec.checkpoint_weight_bits`, needs no flag); 4-bit weights are an AWQ checkpoint
      (:func:`checkpoint`) whose own config says so (:data:`VLLM_QUANTIZATION`).

    Raises:
        ValueError: not one sequence fits at any KV type vLLM runs here (``hint`` says what
            would), or the plan is for a CPU.
    """
    o = _option(d, "vllm", hint)
    out: dict[str, Any] = {}
    if o.kv_type != "auto":
        out["kv_cache_dtype"] = o.kv_type
    out["kv_cache_memory_bytes"] = d.budget.kv_budget_bytes
    out["max_model_len"] = d.context_len
    out["max_num_seqs"] = vllm_max_num_seqs(d)
    if d.tensor_parallel_size > 1:
        out["tensor_parallel_size"] = d.tensor_parallel_size
    if d.weight_bits in VLLM_QUANTIZATION and d.spec.checkpoint_weight_bits > d.weight_bits:
        out["quantization"] = VLLM_QUANTIZATION[d.weight_bits]  # not for a checkpoint already FP8
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


def checkpoint(d: Decision, engine: str, model_path: str | None = None) -> str:
    """The weights ``engine`` loads for the plan: ``model_path`` when given; else, for vLLM, the
    registry model's hub id at 16 and 8 bits (``--quantization fp8`` quantizes it as it loads)
    and an AWQ int4 checkpoint of it at 4 bits (named as a placeholder,
    ``<AWQ int4 checkpoint of meta-llama/Llama-3.1-8B>``: vLLM cannot quantize to int4
    itself); for llama.cpp ``model_path`` if it is a GGUF file, else a GGUF file of
    :data:`GGUF_WEIGHTS`' type named after it (``Llama-3.1-8B-Q4_K_M.gguf``)."""
    name = model_path or d.spec.hub_id or d.model
    if engine == "llama.cpp":
        if name.endswith(".gguf"):
            return name
        return f"{name.rsplit('/', 1)[-1]}-{GGUF_WEIGHTS[d.weight_bits]}.gguf"
    if model_path:
        return model_path
    return f"<AWQ int4 checkpoint of {name}>" if d.weight_bits == 4 else name


def commands(d: Decision, model_path: str | None = None) -> dict[str, str]:
    """Command lines (``vllm serve``, ``llama-server``) for each engine that fits at least one
    sequence, as strings, loading :func:`checkpoint`'s weights."""
    out: dict[str, str] = {}
    vllm = d.options.get("vllm")
    if vllm is not None and vllm.kv is not None:
        args = " ".join(
            f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')} {v}"
            for k, v in vllm_args(d).items()
        )
        out["vllm"] = f"vllm serve {checkpoint(d, 'vllm', model_path)} {args}"
    llama = d.options.get("llama.cpp")
    if llama is not None and llama.kv is not None:
        flags = " ".join(f"{k} {v}" for k, v in llama_cpp_flags(d).items())
        out["llama.cpp"] = f"llama-server -m {checkpoint(d, 'llama.cpp', model_path)} {flags}"
    return out
