"""Scenario-based recommendations: what to turn on for a model, a GPU, a context and a load.

Introduced in notebook 08. ``recommend(...)`` answers the question every reader ends the series
with — "for my model, my GPU, my context length and my traffic, which KV-cache setting?" — and
returns a :class:`Plan`: the memory budget, the chosen KV-cache setting, the reasons (citing the
project's own measured quality cost from ``kvlib/results.json``), what the choice buys against
fp16, what to watch, and the concrete settings for transformers, vLLM and llama.cpp.

Three parts do the work, and this one checks the request and puts their answers together:

* :mod:`kvlib.plan.rule` decides, in numbers: the budget per device, the KV bytes per sequence,
  which setting fits, the engine, the status, and what would fit otherwise (the rules are in its
  docstring; the byte math is :mod:`kvlib.memory`'s);
* :mod:`kvlib.plan.text` says why and what to watch, citing results (:mod:`kvlib.plan.measured`);
  :mod:`kvlib.plan.suggestions` what would fit; :mod:`kvlib.plan.summary` sums it up in a few lines;
* :mod:`kvlib.plan.settings` spells the decision for transformers, vLLM and llama.cpp.

**Units.** GPU memory is given in GiB (2³⁰ bytes), at what the card's driver reports (nvidia-smi,
``torch.cuda.mem_get_info``: the total vLLM's ``gpu_memory_utilization`` multiplies): an "80 GB"
H100 reports 79.6 GiB, a T4 15 GiB, a "24 GB" RTX 4090 24,564 MiB (:data:`kvlib.memory.GPUS`).
The argument keeps its historical name ``gpu_memory_gb``.

**Measurements.** Reasons cite the measured perplexity cost and byte ratio of the chosen setting —
``recommend(..., results=path_or_dict)``, else the file named by ``$KVLIB_RESULTS``,
else the package's ``kvlib/results.json`` — and say "not measured" where a figure is
missing; no number is invented.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlib import results as kvresults
from kvlib.plan import budget as plan_budget
from kvlib.plan import fallbacks as plan_fallbacks
from kvlib.plan import measured as plan_measured
from kvlib.plan import rule as plan_rule
from kvlib.plan import settings as plan_engines
from kvlib.plan import suggestions as plan_suggestions
from kvlib.plan import summary as plan_summary
from kvlib.plan import text as plan_text
from kvlib.plan.engines import ENGINES
from kvlib.plan.rule import Decision
from kvlib.specs import ModelSpec, get_spec, spec_from_config
from kvlib.validate import check_bits, check_int, check_number

__all__ = ["Plan", "recommend"]


@dataclass(frozen=True)
class Plan(Decision):
    """A recommendation: a :class:`~kvlib.plan.rule.Decision` (the numbers, see its fields) and
    its words — ``reasons``, ``watch``, ``suggestions`` (what would fit, when the request does
    not) — plus the results the reasons cite.

    ``status``: ``"ok"`` (all ``concurrency`` sequences fit at the full context), ``"reduced"``
    (fewer fit: ``max_concurrency``), ``"impossible"`` (not one sequence fits; ``kv`` is None and
    ``suggestions`` says what would). Byte figures are per device (per GPU under tensor
    parallelism); ``max_*`` figures are at the chosen setting, ``*_fp16`` at fp16 for comparison.
    """

    reasons: tuple[str, ...] = ()
    watch: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = ()
    results: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def buys(self) -> str:
        """One line: what the chosen setting buys against fp16 (sequences, or context)."""
        return plan_summary.buys(self)

    @property
    def _hint(self) -> str:
        return self.suggestions[0] if self.suggestions else "see plan.suggestions"

    # ---------------------------------------------------------------- engines
    def to_transformers(self) -> dict[str, Any]:
        """``{"cache": registry name, "batch_size": n}`` for transformers' ``generate``
        (:func:`kvlib.plan.settings.transformers_kwargs`): build the cache with
        ``kvlib.caches.registry.make_cache(name, model.config)``, which needs torch; the plan
        itself does not.

        Raises:
            ValueError: not one sequence fits at any level transformers runs, or a CPU plan.
        """
        return plan_engines.transformers_kwargs(self, hint=self._hint)

    def to_vllm(self) -> dict[str, Any]:
        """Engine arguments for ``vllm.LLM(model, **plan.to_vllm())`` / ``vllm serve``
        (:func:`kvlib.plan.settings.vllm_args`: ``auto`` or ``fp8``, with what fits at it)."""
        return plan_engines.vllm_args(self, hint=self._hint)

    def to_llama_cpp(self) -> dict[str, Any]:
        """Flags for ``llama-server`` / ``llama-cli`` (:func:`kvlib.plan.settings.llama_cpp_flags`:
        ``-c`` is context × slots)."""
        return plan_engines.llama_cpp_flags(self, hint=self._hint)

    def commands(self, model_path: str | None = None) -> dict[str, str]:
        """Command lines for each engine (``vllm serve``, ``llama-server``), as strings."""
        return plan_engines.commands(self, model_path)

    # ---------------------------------------------------------------- presentation values
    def summary(self) -> str:
        """A few lines of plain text (the CLI prints it; library code never prints)."""
        return plan_summary.summary(self, self.reasons, self.watch, self.suggestions)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict: every field, the budget, and the engine settings."""
        internal = (
            "spec", "budget", "results", "sequences_by_setting", "options", "types_by_setting",
            "eviction",
        )  # fmt: skip
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in internal
        }
        out["reasons"] = list(self.reasons)
        out["watch"] = list(self.watch)
        out["suggestions"] = list(self.suggestions)
        out["spec"] = dataclasses.asdict(self.spec)
        out["budget"] = dataclasses.asdict(self.budget)
        out["fits"] = self.fits
        out["buys"] = self.buys
        out["sequences_by_setting"] = dict(self.sequences_by_setting)
        out["types_by_setting"] = {k: t.name for k, t in self.types_by_setting.items()}
        out["options"] = {e: dataclasses.asdict(o) for e, o in self.options.items()}
        ev = self.eviction
        out["eviction"] = dataclasses.asdict(ev) | {"fraction": ev.fraction} if ev else None
        settings = {
            "transformers": self.to_transformers,
            "vllm": self.to_vllm,
            "llama_cpp": self.to_llama_cpp,
        }
        for key, settings_of in settings.items():
            try:
                out[key] = settings_of()
            except ValueError as exc:
                out[key] = {"unsupported": str(exc)}
        return out


def _resolve_spec(model: Any) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return get_spec(model)
    if hasattr(model, "num_hidden_layers") or isinstance(model, Mapping):
        return spec_from_config(model)
    if hasattr(model, "config") and callable(getattr(model, "parameters", None)):
        # a loaded transformers model: its config, and its parameters counted
        num_params = sum(int(p.numel()) for p in model.parameters())
        name = getattr(model.config, "name_or_path", None) or None
        return spec_from_config(model.config, name=name, num_params=num_params)
    raise TypeError(
        "model must be a registry name (str), a kvlib.specs.ModelSpec, a transformers config "
        f"or a transformers model (got {type(model).__name__})"
    )


def _check_sizes(
    gpu_memory_gb: Any, context_len: Any, concurrency: Any, num_gpus: Any, weight_bits: Any
) -> tuple[float, int, int, int, int]:
    """The request's numbers, checked: ``(GiB, context_len, concurrency, num_gpus, weight_bits)``.

    Raises:
        TypeError: a value of the wrong kind.
        ValueError: a negative memory, a count below 1 or unsupported weight bits.
    """
    gib = check_number(gpu_memory_gb, "gpu_memory_gb")
    if gib < 0:
        raise ValueError(f"gpu_memory_gb must be a number of GiB >= 0 (got {gpu_memory_gb})")
    context_len = check_int(context_len, "context_len", minimum=1)
    concurrency = check_int(concurrency, "concurrency", minimum=1)
    num_gpus = check_int(num_gpus, "num_gpus", minimum=1)
    weight_bits = check_bits(weight_bits, "weight_bits", allowed=plan_rule.WEIGHT_BITS)
    return gib, context_len, concurrency, num_gpus, weight_bits


def _check_choices(spec: ModelSpec, name: str, quality: str, device: str, num_gpus: int) -> None:
    """The request's choices, checked: a known quality and device, and a GPU count that runs.

    Raises:
        ValueError: an unknown quality or device, several GPUs for a CPU plan, or a
            tensor-parallel size that does not divide ``spec``'s attention heads.
    """
    if quality not in plan_rule.QUALITIES:
        accepted = ", ".join(plan_rule.QUALITIES)
        raise ValueError(f"quality must be one of {accepted} (got {quality!r})")
    if device not in plan_rule.DEVICES:
        raise ValueError(f"device must be one of {', '.join(plan_rule.DEVICES)} (got {device!r})")
    if device == "cpu" and num_gpus != 1:
        raise ValueError(
            f"device='cpu' plans for one machine's RAM: num_gpus must be 1 (got {num_gpus})"
        )
    if not plan_budget.valid_tp(spec, num_gpus):
        raise ValueError(
            f"num_gpus={num_gpus} cannot split {name}'s {spec.num_heads} attention heads evenly "
            f"(tensor parallelism needs a divisor of {spec.num_heads})"
        )


def _check_compute_capability(cc: Any, device: str) -> tuple[int, int] | None:
    """``cc`` as ``(major, minor)`` (None stays None).

    Raises:
        TypeError: not a pair of ints.
        ValueError: a negative part, or a compute capability for a CPU plan.
    """
    if cc is None:
        return None
    if (
        isinstance(cc, str)
        or not isinstance(cc, Sequence)
        or len(cc) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in cc)
    ):
        raise TypeError(f"compute_capability must be a (major, minor) pair of ints (got {cc!r})")
    if min(cc) < 0:
        raise ValueError(f"compute_capability must not be negative (got {cc!r})")
    if device != "gpu":
        raise ValueError("compute_capability is a GPU's: leave it out with device='cpu'")
    return (cc[0], cc[1])


def _check_engines(
    engines: Any, device: str, concurrency: int, num_gpus: int
) -> tuple[str, ...] | None:
    """``engines`` as a tuple of engine names (None stays None).

    Raises:
        TypeError: not a sequence of strings (a lone string is refused).
        ValueError: an unknown engine, or none that the rule lets serve this request (a CPU
            plan runs llama.cpp; several sequences or GPUs vLLM or llama.cpp).
    """
    if engines is None:
        return None
    if isinstance(engines, str) or not isinstance(engines, Sequence) or not engines:
        raise TypeError(f"engines must be a non-empty list of engine names (got {engines!r})")
    for e in engines:
        if e not in ENGINES:
            accepted = ", ".join(ENGINES)
            raise ValueError(f"unknown engine {e!r}; accepted: {accepted}")
    allowed = tuple(engines)
    if not plan_rule.engine_candidates(device, concurrency, num_gpus, allowed):
        serving = plan_rule.engine_candidates(device, concurrency, num_gpus)
        raise ValueError(
            f"engines={list(allowed)} cannot serve {concurrency} sequence(s) on {num_gpus} "
            f"{device.upper()}(s): the plan runs {' or '.join(serving)} there "
            "(plan.options gives every engine's count)"
        )
    return allowed


def _check_typical_context(typical_context: Any, context_len: int) -> int | None:
    """``typical_context`` checked against ``context_len`` (None stays None).

    Raises:
        TypeError: not an integer.
        ValueError: below 1 or above ``context_len``.
    """
    if typical_context is not None:
        typical_context = check_int(typical_context, "typical_context", minimum=1)
        if typical_context > context_len:
            raise ValueError(
                f"typical_context ({typical_context:,}) must be at most context_len "
                f"({context_len:,}): it is the length most conversations reach"
            )
    return typical_context


def _plan(d: Decision, cited: Mapping[str, Any]) -> Plan:
    """The :class:`Plan` for decision ``d``: its numbers, and its words citing ``cited``."""
    would_fit = (
        plan_suggestions.suggestions(d, plan_fallbacks.fallbacks(d, cited), cited)
        if not d.fits
        else ()
    )
    return Plan(
        **{f.name: getattr(d, f.name) for f in dataclasses.fields(Decision)},
        reasons=plan_text.reasons(d, cited),
        watch=plan_text.watch(d, cited),
        suggestions=would_fit,
        results=cited,
    )


def recommend(
    model: Any,
    gpu_memory_gb: float,
    context_len: int,
    concurrency: int = 1,
    quality: str = "balanced",
    weight_bits: int = 16,
    num_gpus: int = 1,
    *,
    device: str = "gpu",
    typical_context: int | None = None,
    results: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    engines: Sequence[str] | None = None,
    compute_capability: tuple[int, int] | None = None,
) -> Plan:
    """Recommend a KV-cache configuration (rules: :mod:`kvlib.plan.rule`).

    Args:
        model: a registry name (``"llama-3.1-8b"``), a :class:`kvlib.specs.ModelSpec`, a
            transformers config (give it a parameter count: ``spec_from_config(config,
            num_params=...)``), or a loaded transformers model (its parameters are counted).
        gpu_memory_gb: memory of one GPU (or of RAM for ``device="cpu"``) in GiB, as the
            driver reports it (an "80 GB" H100 79.6 GiB: :data:`kvlib.memory.GPUS`). 0 gives an
            ``"impossible"`` plan.
        context_len: tokens per sequence (prompt + output) the cache must hold, >= 1.
        concurrency: sequences decoding at the same time, >= 1.
        quality: ``"max"`` (fp16 only), ``"balanced"`` (down to int4), ``"aggressive"`` (int2).
        weight_bits: 16, 8 or 4.
        num_gpus: GPUs used with tensor parallelism (must divide the model's attention heads).
        device: ``"gpu"`` or ``"cpu"`` (RAM, llama.cpp, one device).
        typical_context: the tokens most conversations reach (1 … ``context_len``), when known.
            The plan still guarantees ``context_len`` for the sequences it counts; a paged
            engine (vLLM) admits as many as fit at this length (its ``max_num_seqs``). None:
            not said, and vLLM's ``max_num_seqs`` is the requested concurrency.
        results: measured results to cite: a dict in the :mod:`kvlib.results` layout, a
            path to such a file, or None for the default file (``$KVLIB_RESULTS``, else
            the package's); ``{}`` cites none.
        engines: the engines the plan may choose, for a reader who runs only some of them
            (``("llama.cpp",)``); None: every one. The plan still prices the others (its
            ``also:`` lines and settings).
        compute_capability: the GPU's (``(7, 5)`` for a T4; :data:`kvlib.memory.GPU_COMPUTE_CAPABILITY`),
            where known: vLLM then offers only the KV types a CUDA backend of its runs there
            (fp8 needs 8.0) and no 8-bit weights below 8.0. None: not checked.

    Raises:
        TypeError: a value of the wrong kind (a float count, a string size, ...).
        ValueError: an unknown model (with close matches), a negative memory or a count below
            1, an unknown quality or device, unsupported weight bits, an impossible
            tensor-parallel size, or a results file that is missing or malformed.
    """
    spec = _resolve_spec(model)
    name = model if isinstance(model, str) else (spec.name or "custom model")
    gib, context_len, concurrency, num_gpus, weight_bits = _check_sizes(
        gpu_memory_gb, context_len, concurrency, num_gpus, weight_bits
    )
    _check_choices(spec, name, quality, device, num_gpus)
    typical_context = _check_typical_context(typical_context, context_len)
    allowed = _check_engines(engines, device, concurrency, num_gpus)
    cc = _check_compute_capability(compute_capability, device)
    # runs measured on several models are read from the one closest in build to this one
    cited = kvresults.for_model(spec, plan_measured.results_to_cite(results))

    d = plan_rule.decide(
        spec,
        gib,
        context_len,
        concurrency,
        quality,
        weight_bits,
        num_gpus,
        device=device,
        model=name,
        results=cited,
        typical_context=typical_context,
        allowed=allowed,
        compute_capability=cc,
    )
    return _plan(d, cited)
