"""Scenario-based recommendations: what to turn on for a model, a GPU, a context and a load.

Introduced in notebook 08. ``recommend(...)`` answers the question every reader ends the series
with — "for my model, my GPU, my context length and my traffic, which KV-cache setting?" — and
returns a :class:`Plan`: the memory budget, the chosen KV-cache setting, the reasons (citing the
project's own measured quality cost from ``kvlib/measurements.json``), what the choice buys against
fp16, what to watch, and the concrete settings for transformers, vLLM and llama.cpp.

The byte math is :mod:`kvlib.memory`'s; this module only decides. The rules, in order:

1. **Budget per device** (per GPU under tensor parallelism)::

       usable   = memory × (1 − headroom)          headroom: 10 % on a GPU (vLLM's default
                                                    gpu_memory_utilization=0.9), 25 % of RAM on CPU
       weights  = num_params × weight_bits / 8 / tensor_parallel_size
       overhead = runtime + activations            runtime: 1 GiB per GPU (CUDA context, kernel
                                                    workspaces, allocator slack), 0.5 GiB on CPU;
                                                    activations: one 2048-token prefill chunk ×
                                                    hidden size × 16 live fp16 values per token
       KV budget = usable − weights − overhead

2. **KV per sequence** at the requested context, from ``kvlib.memory.kv_cache_bytes`` (sliding
   windows and MLA included), scaled to each setting's *effective* bits per element — the codes
   plus their metadata: fp16 16, int8 8.5, int4 4.5, int2 2.5 (one fp16 scale and one fp16 zero
   point per group of 64 = +0.5 bit, the same as llama.cpp's q8_0/q4_0). Under tensor parallelism
   each GPU holds ``ceil(kv_heads / tp)`` of the KV heads (at least one: heads are replicated
   when tp > kv_heads); an MLA latent is replicated on every GPU.

3. **Setting**: the highest-precision setting, among those the ``quality`` level allows, whose
   cache for ``concurrency`` sequences at the full context fits the KV budget:
   ``"max"`` fp16 only; ``"balanced"`` fp16 → int8 → int4; ``"aggressive"`` … → int2.
   If none fits all sequences, the lowest allowed setting and the number of sequences it does fit
   (status ``"reduced"``); if not even one sequence fits, or the weights alone do not, status
   ``"impossible"`` with what would fit (fewer tokens, lower weight bits, more GPUs, or both).

4. **Engine and extras**: more than one sequence or more than one GPU → a serving engine with
   paging (vLLM: continuous batching, PagedAttention, tensor parallelism); CPU → llama.cpp; one
   sequence on one GPU → transformers. Eight or more concurrent conversations → also store idle
   conversations compressed (PCA transform coding, :mod:`kvlib.pca`) rather than holding their
   fp16 cache or recomputing it.

**Measurements.** Reasons cite the measured perplexity cost and byte ratio of the chosen setting
from :func:`load_measurements` — ``recommend(..., measurements=path_or_dict)``, else the file
named by ``$KVLIB_MEASUREMENTS``, else the package's ``kvlib/measurements.json`` — and say "not
measured" where a figure is missing; no number is invented.

The plan is worst-case: every sequence at the full context at once. Real traffic is shorter, and
a paged engine admits more sequences than this count; the count is what is *guaranteed*.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvlib import memory

__all__ = [
    "QUALITIES",
    "WEIGHT_BITS",
    "DEVICES",
    "KV_SETTINGS",
    "KVSetting",
    "MemoryBudget",
    "Plan",
    "recommend",
    "load_measurements",
    "measured_cost",
    "measured_caches",
    "MEASUREMENTS_ENV",
    "quality_note",
    "results_tables",
    "load_results",
]

GIB = 1024**3
#: ``gpu_memory_gb`` is the card's label, and GPU memory is labelled in binary units: an
#: "80 GB" A100/H100 holds 80 GiB, a "24 GB" RTX 4090 24 GiB (the driver reports 24,564 MiB).
GB = GIB

QUALITIES = ("max", "balanced", "aggressive")
WEIGHT_BITS = (16, 8, 4)
DEVICES = ("gpu", "cpu")

#: Fraction of memory never planned for (vLLM's default ``gpu_memory_utilization`` is 0.9).
HEADROOM_FRACTION = {"gpu": 0.10, "cpu": 0.25}
#: Fixed runtime allowance per device: CUDA context, kernel workspaces, allocator slack.
RUNTIME_OVERHEAD_BYTES = {"gpu": 1 * GIB, "cpu": GIB // 2}
#: Activations: one prefill chunk of this many tokens ...
PREFILL_CHUNK_TOKENS = 2048
#: ... times hidden size times this many live fp16 values per token (residual, norm, q/k/v,
#: attention output, and the MLP's gate/up/activation at ~3.5× hidden — one layer at a time).
ACTIVATION_VALUES_PER_HIDDEN = 16
#: Conversations at or above this count get the idle-storage (PCA) recommendation.
IDLE_STORAGE_MIN_SESSIONS = 8
#: vLLM's default block size on CUDA (tokens per KV block).
VLLM_BLOCK_SIZE = 16
#: Candidate tensor-parallel sizes when a plan looks for "how many GPUs would fit".
TP_CANDIDATES = (2, 4, 8)
#: Upper end of the context search (tokens).
_MAX_CONTEXT_SEARCH = 1 << 24


@dataclass(frozen=True)
class KVSetting:
    """One KV-cache precision and how each engine stores it.

    Bytes come from :func:`kvlib.memory.kv_cache_bytes` with ``(bits, group_size)``: group-wise
    integer codes keep one fp16 scale and one fp16 zero point per group of 64 values (+0.5 bit
    per value) — the same size as llama.cpp's q8_0 / q4_0 (one fp16 scale per 32 values).
    vLLM's fp8 cache has one scale per tensor (no per-group metadata).
    """

    name: str
    bits: int
    group_size: int | None
    measurement_key: str
    vllm_dtype: str
    llama_cpp_type: str
    llama_cpp_bits: int
    description: str

    @property
    def effective_bits(self) -> float:
        """Bits per cached value including the per-group scale and zero point."""
        return self.bits + (32 / self.group_size if self.group_size else 0)

    @property
    def vllm_bits(self) -> int:
        return 16 if self.vllm_dtype == "auto" else 8


KV_SETTINGS: dict[str, KVSetting] = {
    "fp16": KVSetting(
        "fp16", 16, None, "fp16-dynamic", "auto", "f16", 16, "full precision (fp16/bf16)"
    ),
    "int8": KVSetting("int8", 8, 64, "kvlib-int8", "fp8", "q8_0", 8, "8-bit (int8 / fp8 / q8_0)"),
    "int4": KVSetting(
        "int4",
        4,
        64,
        "kvlib-int4",
        "fp8",
        "q4_0",
        4,
        "4-bit, keys per channel, values per token (KIVI recipe)",
    ),
    "int2": KVSetting(
        "int2",
        2,
        64,
        "kvlib-int2",
        "fp8",
        "q4_0",
        4,
        "2-bit, keys per channel, values per token (KIVI recipe)",
    ),
}

#: Which settings each quality level may use, highest precision first.
QUALITY_LADDER: dict[str, tuple[str, ...]] = {
    "max": ("fp16",),
    "balanced": ("fp16", "int8", "int4"),
    "aggressive": ("fp16", "int8", "int4", "int2"),
}


# --------------------------------------------------------------------------------------------
# measured quality costs (package data written by benchmarks/bench_cache.py)


#: Environment variable naming a measurements file to use instead of the package's own.
MEASUREMENTS_ENV = "KVLIB_MEASUREMENTS"

#: Keys a cache may be stored under in ``measurements["caches"]``, tried in order.
_CACHE_KEYS: dict[str, tuple[str, ...]] = {
    "fp16": ("fp16-dynamic", "fp16", "dynamic", "DynamicCache"),
    "int8": ("kvlib-int8", "int8", "kvlib_int8"),
    "int4": ("kvlib-int4", "int4", "kvlib_int4"),
    "int2": ("kvlib-int2", "int2", "kvlib_int2"),
}


def _read_measurements(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("caches", {}), dict):
        raise ValueError(f"{where} must be a JSON object with a 'caches' mapping")
    return data


def load_measurements(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The project's measured cache results, as a dict (``{}`` when none are packaged).

    Read from ``path`` if given, else from the file named by ``$KVLIB_MEASUREMENTS``, else from
    the package's ``kvlib/measurements.json`` (written by ``benchmarks/bench_cache.py``). A
    missing package file gives ``{}``; a missing file that was asked for by name raises.

    Raises:
        ValueError: the named file does not exist, or a file is not a JSON object with a
            ``"caches"`` mapping.
    """
    if path is None and os.environ.get(MEASUREMENTS_ENV):
        path = os.environ[MEASUREMENTS_ENV]
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"measurements file {str(path)!r} does not exist")
        return _read_measurements(
            file.read_text(encoding="utf-8"), f"measurements file {file.name}"
        )
    try:
        text = resources.files("kvlib").joinpath("measurements.json").read_text(encoding="utf-8")
    except (FileNotFoundError, OSError):
        return {}
    return _read_measurements(text, "kvlib/measurements.json")


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


_PPL_KEYS = ("perplexity", "ppl")
_DELTA_KEYS = ("perplexity_delta_pct", "ppl_delta_pct")
_BYTES_KEYS = ("bytes_per_token", "cache_bytes")


def _first_number(entry: Mapping[str, Any], keys: tuple[str, ...]) -> float | None:
    for key in keys:
        value = _number(entry.get(key))
        if value is not None:
            return value
    return None


def _cache_entry(setting: str, measurements: Mapping[str, Any]) -> Mapping[str, Any] | None:
    caches = measurements.get("caches") if measurements else None
    if not isinstance(caches, Mapping):
        return None
    for key in _CACHE_KEYS.get(setting, (setting,)):
        entry = caches.get(key)
        if isinstance(entry, Mapping):
            return entry
    return None


def _fp16_bytes_per_token(measurements: Mapping[str, Any]) -> float | None:
    """fp16 KV bytes per token of the measured model, when it is in the registry."""
    name = measurements.get("model") if measurements else None
    if not isinstance(name, str):
        return None
    try:
        return float(memory.kv_bytes_per_token(memory.get_spec(name)))
    except (ValueError, TypeError):
        return None


def _entry_cost(
    entry: Mapping[str, Any],
    ref: Mapping[str, Any],
    is_ref: bool,
    fp16_bpt: float | None = None,
) -> dict[str, float]:
    out: dict[str, float] = {}
    ppl = _first_number(entry, _PPL_KEYS)
    if ppl is not None:
        out["perplexity"] = ppl
    delta = _first_number(entry, _DELTA_KEYS)
    ref_ppl = _first_number(ref, _PPL_KEYS)
    if delta is None and ppl is not None and ref_ppl:
        delta = 100.0 * (ppl / ref_ppl - 1.0)
    if delta is not None:
        out["perplexity_delta_pct"] = 0.0 if is_ref else delta
    # the cache's bytes over fp16's: from bytes per token and the model's fp16 formula first
    # (unambiguous), else the stored ratio (either way round: a stored value above 1 is read
    # as "× smaller than fp16", as benchmarks/bench_cache.py writes it), else both entries' bytes
    ratio = None
    bpt = _number(entry.get("bytes_per_token"))
    if bpt is not None and fp16_bpt:
        ratio = bpt / fp16_bpt
    if ratio is None:
        stored = _first_number(entry, ("bytes_ratio_vs_fp16",))
        if stored is not None and stored > 0:
            ratio = 1.0 / stored if stored > 1.0 else stored
    if ratio is None:  # from the bytes of both caches, measured on the same text
        for key in _BYTES_KEYS:
            mine, theirs = _number(entry.get(key)), _number(ref.get(key))
            if mine is not None and theirs:
                ratio = mine / theirs
                break
    if ratio is not None:
        out["bytes_ratio_vs_fp16"] = ratio
    return out


def measured_cost(setting: str, measurements: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Measured figures for a KV setting: ``perplexity``, ``perplexity_delta_pct`` (vs fp16) and
    ``bytes_ratio_vs_fp16``, whichever the measurements hold (``{}`` when none).

    The delta is taken as stored (``perplexity_delta_pct`` or ``ppl_delta_pct``), or computed
    from this setting's and fp16's perplexities; the byte ratio as stored, or from both
    entries' ``bytes_per_token`` (else ``cache_bytes``).
    """
    if setting not in KV_SETTINGS:
        raise ValueError(f"setting must be one of {', '.join(KV_SETTINGS)} (got {setting!r})")
    if measurements is None:
        measurements = load_measurements()
    entry = _cache_entry(setting, measurements)
    if entry is None:
        return {}
    ref = _cache_entry("fp16", measurements) or {}
    return _entry_cost(entry, ref, setting == "fp16", _fp16_bytes_per_token(measurements))


def measured_caches(measurements: Mapping[str, Any] | None = None) -> dict[str, dict[str, float]]:
    """:func:`measured_cost` for every cache in ``measurements["caches"]`` (kvlib's and
    transformers' own), by the name it is stored under, in file order."""
    if measurements is None:
        measurements = load_measurements()
    caches = measurements.get("caches") if measurements else None
    if not isinstance(caches, Mapping):
        return {}
    ref = _cache_entry("fp16", measurements) or {}
    fp16_bpt = _fp16_bytes_per_token(measurements)
    return {
        name: _entry_cost(entry, ref, entry is ref, fp16_bpt)
        for name, entry in caches.items()
        if isinstance(entry, Mapping)
    }


def _fmt_pct(x: float) -> str:
    return f"{x:+.3g} %"


def _provenance(measurements: Mapping[str, Any]) -> str:
    model = measurements.get("model", "the bundled model")
    date = measurements.get("date", "an unrecorded date")
    source = measurements.get("source") or measurements.get("command") or "benchmarks/"
    return f"on {model}, measured {date} by {source}"


def quality_note(setting: str, measurements: Mapping[str, Any] | None = None) -> str:
    """One line: the measured perplexity cost of a KV setting, or that it is not measured.

    ``setting`` is a :data:`KV_SETTINGS` name (``"fp16"``, ``"int8"``, ``"int4"``, ``"int2"``) or
    ``"pca"``. Never invents a number: missing entries say "not measured".
    """
    if measurements is None:
        measurements = load_measurements()
    if setting == "pca":
        pca = measurements.get("pca")
        if not isinstance(pca, Mapping) or not pca:
            return "pca: storage figures not measured yet (benchmarks/bench_pca.py)"
        ratio = _number(pca.get("compression_vs_fp16") or pca.get("compression_ratio"))
        delta = _number(pca.get("perplexity_delta_pct"))
        parts = []
        if ratio is not None:
            parts.append(f"{ratio:.3g}× smaller than fp16")
        if delta is not None:
            parts.append(f"{_fmt_pct(delta)} perplexity")
        if not parts:
            return "pca: storage figures not measured yet (benchmarks/bench_pca.py)"
        src = {**measurements, **{k: v for k, v in pca.items() if k in ("model", "date", "source")}}
        return f"pca: {', '.join(parts)} {_provenance(src)}"
    if setting not in KV_SETTINGS:
        raise ValueError(
            f"setting must be one of {', '.join([*KV_SETTINGS, 'pca'])} (got {setting!r})"
        )
    cost = measured_cost(setting, measurements)
    parts = []
    if setting == "fp16":
        if "perplexity" not in cost:
            return "fp16: the reference precision, no quantization error"
        parts.append(f"the reference, perplexity {cost['perplexity']:.4g}")
    else:
        if "perplexity_delta_pct" in cost:
            parts.append(f"{_fmt_pct(cost['perplexity_delta_pct'])} perplexity")
        if "bytes_ratio_vs_fp16" in cost:
            parts.append(f"{cost['bytes_ratio_vs_fp16']:.3g}× the fp16 bytes")
    if not parts:
        return f"{setting}: quality cost not measured yet (benchmarks/bench_cache.py)"
    return f"{setting}: {', '.join(parts)} {_provenance(measurements)}"


def _measured_delta(setting: str, measurements: Mapping[str, Any]) -> float | None:
    return measured_cost(setting, measurements).get("perplexity_delta_pct")


# --------------------------------------------------------------------------------------------
# the spec: what kvlib.memory tells us


def _resolve_spec(model: Any) -> memory.ModelSpec:
    if isinstance(model, memory.ModelSpec):
        return model
    if isinstance(model, str):
        return memory.get_spec(model)
    if hasattr(model, "num_hidden_layers") or isinstance(model, Mapping):
        return memory.spec_from_config(model)
    if hasattr(model, "config") and callable(getattr(model, "parameters", None)):
        # a loaded transformers model: its config, and its parameters counted
        num_params = sum(int(p.numel()) for p in model.parameters())
        name = getattr(model.config, "name_or_path", None) or None
        return memory.spec_from_config(model.config, name=name, num_params=num_params)
    raise TypeError(
        "model must be a registry name (str), a kvlib.memory.ModelSpec, a transformers config "
        f"or a transformers model (got {type(model).__name__})"
    )


def _spec_name(spec: memory.ModelSpec) -> str:
    return spec.name or "custom model"


def _weights_bytes(spec: memory.ModelSpec, weight_bits: int) -> int:
    if spec.num_params is None:
        raise ValueError(
            f"{_spec_name(spec)} has no parameter count: the weights' size is needed to plan "
            "memory — pass spec_from_config(config, num_params=...) or a ModelSpec with num_params"
        )
    return spec.weights_bytes(weight_bits)


def _is_mla(spec: memory.ModelSpec) -> bool:
    return spec.is_mla


def _has_sliding_window(spec: memory.ModelSpec) -> bool:
    return spec.num_sliding_layers > 0


def _hidden_size(spec: memory.ModelSpec) -> int:
    return int(spec.hidden_size or spec.num_heads * spec.head_dim)


# --------------------------------------------------------------------------------------------
# values


@dataclass(frozen=True)
class MemoryBudget:
    """Where one device's memory goes (bytes, per GPU under tensor parallelism).

    ``kv_budget_bytes`` may be negative: the weights and overhead alone do not fit.
    """

    device_bytes: int
    headroom_bytes: int
    weights_bytes: int
    overhead_bytes: int
    kv_budget_bytes: int
    tensor_parallel_size: int = 1

    @property
    def usable_bytes(self) -> int:
        return self.device_bytes - self.headroom_bytes

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) rows in the order they are subtracted, for tables."""
        return [
            ("device memory", self.device_bytes),
            ("headroom", self.headroom_bytes),
            ("weights", self.weights_bytes),
            ("runtime + activations", self.overhead_bytes),
            ("left for the KV cache", self.kv_budget_bytes),
        ]


@dataclass(frozen=True)
class Plan:
    """A recommendation (see the module docstring for the rules).

    ``status``: ``"ok"`` (all ``concurrency`` sequences fit at the full context), ``"reduced"``
    (fewer fit: ``max_concurrency``), ``"impossible"`` (not one sequence fits; ``kv`` is None and
    ``suggestions`` says what would). Byte figures are per device (per GPU under tensor
    parallelism); ``max_*`` figures are at the chosen setting, ``*_fp16`` at fp16 for comparison.
    """

    model: str
    spec: memory.ModelSpec
    device: str
    gpu_memory_gb: float
    num_gpus: int
    context_len: int
    concurrency: int
    quality: str
    weight_bits: int
    status: str
    kv: str | None
    engine: str
    paging: bool
    idle_storage: str | None
    tensor_parallel_size: int
    budget: MemoryBudget
    kv_bytes_per_sequence: int
    kv_bytes_per_sequence_fp16: int
    max_concurrency: int
    max_concurrency_fp16: int
    max_context: int
    max_context_fp16: int
    reasons: tuple[str, ...] = ()
    watch: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = ()
    measurements: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # ---------------------------------------------------------------- derived
    @property
    def fits(self) -> bool:
        """True when every requested sequence fits at the full context."""
        return self.status == "ok"

    @property
    def setting(self) -> KVSetting | None:
        return KV_SETTINGS[self.kv] if self.kv else None

    @property
    def num_sequences(self) -> int:
        """Sequences the plan provisions for: the request, or what fits when reduced."""
        return min(self.concurrency, self.max_concurrency)

    @property
    def buys(self) -> str:
        """One line: what the chosen setting buys against fp16 (sequences, or context)."""
        if self.kv is None:
            return "nothing yet: not one sequence fits (see suggestions)"
        ctx = _fmt_tokens(self.max_context)
        ctx16 = _fmt_tokens(self.max_context_fp16)
        if self.kv == "fp16":
            return (
                f"fp16 needs no trade: {self.max_concurrency} sequences fit at "
                f"{self.context_len:,} tokens, or {self.concurrency} at up to {ctx} tokens"
            )
        n, n16 = self.max_concurrency, self.max_concurrency_fp16
        gain = f"{n / n16:.3g}× as many" if n16 else "where fp16 fits none"
        return (
            f"{self.kv} fits {n} sequences at {self.context_len:,} tokens against {n16} at fp16 "
            f"({gain}), or {self.concurrency} at up to {ctx} tokens against {ctx16}"
        )

    def _require_feasible(self, engine: str) -> KVSetting:
        if self.kv is None:
            hint = self.suggestions[0] if self.suggestions else "see plan.suggestions"
            raise ValueError(
                f"no {engine} settings: {self.model} does not fit this request ({hint})"
            )
        return KV_SETTINGS[self.kv]

    # ---------------------------------------------------------------- engines
    def to_transformers(self) -> dict[str, Any]:
        """Keyword arguments for ``model.generate(**inputs, **plan.to_transformers())``.

        fp16 → ``DynamicCache``; int8 → ``QuantizedCache`` with the per-tensor fp8 backend;
        int4/int2 → ``QuantizedCache`` with optimum-quanto, group size 64, the 128 most recent
        tokens kept in full precision. transformers' ``QuantizedCache`` takes full-attention models
        only; for sliding-window models a quantized setting raises ``ValueError`` (use vLLM, or
        kvlib's own cache from notebook 04).
        """
        s = self._require_feasible("transformers")
        if s.name == "fp16":
            return {"cache_implementation": "dynamic"}
        if _has_sliding_window(self.spec):
            raise ValueError(
                f"transformers' QuantizedCache supports full-attention models only and "
                f"{self.model} has sliding-window layers: use to_vllm(), or kvlib's cache "
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

    def _vllm_max_num_seqs(self) -> tuple[str, int]:
        s = self._require_feasible("vLLM")
        dtype = s.vllm_dtype
        if dtype == s.name or (dtype == "auto" and s.name == "fp16"):
            return dtype, self.num_sequences
        # int4/int2 are not vLLM cache dtypes: it runs fp8, so recount what fits at 8 bits
        per_seq = _kv_seq_bytes(self.spec, self.context_len, (8, None), self.tensor_parallel_size)
        fit = _fit(self.budget.kv_budget_bytes, per_seq)
        return dtype, max(1, min(self.concurrency, fit))

    def to_vllm(self) -> dict[str, Any]:
        """Engine arguments for ``vllm.LLM(model, **plan.to_vllm())`` / ``vllm serve``.

        vLLM's KV cache dtypes are ``auto`` (the model dtype) and ``fp8``; a plan at int4/int2 maps
        to ``fp8`` and ``max_num_seqs`` is recounted at 8 bits.
        """
        dtype, max_num_seqs = self._vllm_max_num_seqs()
        out: dict[str, Any] = {
            "kv_cache_dtype": dtype,
            "block_size": VLLM_BLOCK_SIZE,
            "max_model_len": self.context_len,
            "max_num_seqs": max_num_seqs,
            "gpu_memory_utilization": round(1.0 - HEADROOM_FRACTION["gpu"], 2),
            "tensor_parallel_size": self.tensor_parallel_size,
            "enable_prefix_caching": True,
        }
        if self.weight_bits == 8:
            out["quantization"] = "fp8"
        return out

    def to_llama_cpp(self) -> dict[str, Any]:
        """Flags for ``llama-server`` / ``llama-cli``.

        llama.cpp reserves ``-c`` tokens up front and splits them across ``-np`` parallel slots,
        so ``-c`` is context × slots, and the slot count is what fits at llama.cpp's cache type
        (q8_0 = 8.5, q4_0 = 4.5 bits; it has no 2-bit cache type). A quantized V cache needs flash
        attention (``-fa on``).
        """
        s = self._require_feasible("llama.cpp")
        llama = (s.llama_cpp_bits, None if s.llama_cpp_bits == 16 else 64)
        per_seq = _kv_seq_bytes(self.spec, self.context_len, llama, self.tensor_parallel_size)
        fit = _fit(self.budget.kv_budget_bytes, per_seq)
        slots = max(1, min(self.concurrency, fit))
        ctx = self.context_len
        if fit == 0:  # not even one slot at full context: the context that fits
            ctx = _max_context(
                self.spec,
                self.budget.kv_budget_bytes,
                1,
                llama,
                self.tensor_parallel_size,
            )
            ctx = max(256, ctx // 256 * 256)
        return {
            "-c": ctx * slots,
            "-np": slots,
            "--cache-type-k": s.llama_cpp_type,
            "--cache-type-v": s.llama_cpp_type,
            "-fa": "on",
            "-ngl": 0 if self.device == "cpu" else 999,
        }

    def commands(self, model_path: str | None = None) -> dict[str, str]:
        """Command lines for each engine (``vllm serve``, ``llama-server``), as strings."""
        name = model_path or self.model
        out: dict[str, str] = {}
        if self.kv is None:
            return out
        vllm_args = " ".join(
            f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')} {v}"
            for k, v in self.to_vllm().items()
        )
        out["vllm"] = f"vllm serve {name} {vllm_args}"
        llama = " ".join(f"{k} {v}" for k, v in self.to_llama_cpp().items())
        out["llama.cpp"] = f"llama-server -m {name}.gguf {llama}"
        return out

    # ---------------------------------------------------------------- presentation values
    def summary(self) -> str:
        """A few lines of plain text (the CLI prints it; library code never prints)."""
        h = memory.human_bytes
        lines = [
            f"{self.model} on {self.num_gpus} × {self.gpu_memory_gb:g} GB {self.device.upper()}"
            f", context {self.context_len:,}, {self.concurrency} concurrent, quality "
            f"{self.quality}, {self.weight_bits}-bit weights",
            f"status: {self.status}"
            + (
                f" ({self.max_concurrency} of {self.concurrency} fit)"
                if self.status == "reduced"
                else ""
            ),
        ]
        if self.kv:
            lines.append(
                f"KV cache: {self.kv} — {KV_SETTINGS[self.kv].description}; engine {self.engine}"
                + (", paged" if self.paging else "")
                + (", idle conversations stored with PCA" if self.idle_storage else "")
                + (
                    f", tensor parallel {self.tensor_parallel_size}"
                    if self.tensor_parallel_size > 1
                    else ""
                )
            )
        lines.append(
            "budget per device: " + ", ".join(f"{k} {h(v)}" for k, v in self.budget.rows())
        )
        if self.kv:
            lines.append(
                f"KV per sequence: {h(self.kv_bytes_per_sequence)} "
                f"(fp16 {h(self.kv_bytes_per_sequence_fp16)}); sequences at full context: "
                f"{self.max_concurrency} (fp16 {self.max_concurrency_fp16}); max context for "
                f"{self.concurrency}: {self.max_context:,} (fp16 {self.max_context_fp16:,})"
            )
        lines.append(f"buys: {self.buys}")
        lines += [f"why: {r}" for r in self.reasons]
        lines += [f"watch: {w}" for w in self.watch]
        lines += [f"would fit: {s}" for s in self.suggestions]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict: every field, the budget, and the engine settings."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("spec", "budget", "measurements")
        }
        out["reasons"] = list(self.reasons)
        out["watch"] = list(self.watch)
        out["suggestions"] = list(self.suggestions)
        out["spec"] = dataclasses.asdict(self.spec)
        out["budget"] = dataclasses.asdict(self.budget)
        out["fits"] = self.fits
        out["buys"] = self.buys
        if self.kv is not None:
            out["vllm"] = self.to_vllm()
            out["llama_cpp"] = self.to_llama_cpp()
            try:
                out["transformers"] = self.to_transformers()
            except ValueError as exc:
                out["transformers"] = {"unsupported": str(exc)}
        return out


# --------------------------------------------------------------------------------------------
# the arithmetic (bytes from kvlib.memory; here only scaling, sharding and counting)


def _kv_share(spec: memory.ModelSpec, tp: int) -> float:
    """Fraction of the whole KV cache each of ``tp`` GPUs holds."""
    if tp <= 1 or _is_mla(spec):
        return 1.0
    kv_heads = max(1, int(spec.num_kv_heads))
    return math.ceil(kv_heads / tp) / kv_heads


Storage = tuple[int, "int | None"]  # (bits, group_size) as kvlib.memory.kv_cache_bytes takes them


def _storage(setting: str) -> Storage:
    s = KV_SETTINGS[setting]
    return (s.bits, s.group_size)


def _kv_seq_bytes(spec: memory.ModelSpec, seq_len: int, storage: Storage, tp: int) -> int:
    """Bytes one sequence of ``seq_len`` tokens keeps on each GPU, stored as ``(bits, group)``."""
    if seq_len <= 0:
        return 0
    bits, group = storage
    total = memory.kv_cache_bytes(spec, seq_len, batch_size=1, bits=bits, group_size=group)
    return math.ceil(total * _kv_share(spec, tp))


def _fmt_tokens(n: int) -> str:
    return "unbounded" if n >= memory.UNBOUNDED else f"{n:,}"


def _fit(kv_budget: int, per_seq: int) -> int:
    if kv_budget <= 0:
        return 0
    if per_seq <= 0:
        return 1 << 30
    return int(kv_budget // per_seq)


def _max_context(
    spec: memory.ModelSpec, kv_budget: int, concurrency: int, storage: Storage, tp: int
) -> int:
    """Largest context (tokens) at which ``concurrency`` sequences fit ``kv_budget``; 0 if none."""
    if kv_budget <= 0 or concurrency * _kv_seq_bytes(spec, 1, storage, tp) > kv_budget:
        return 0
    lo, hi = 1, _MAX_CONTEXT_SEARCH
    if concurrency * _kv_seq_bytes(spec, hi, storage, tp) <= kv_budget:
        return memory.UNBOUNDED  # every layer slides: the cache stops growing
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if concurrency * _kv_seq_bytes(spec, mid, storage, tp) <= kv_budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _budget(
    spec: memory.ModelSpec, device: str, gpu_memory_gb: float, weight_bits: int, tp: int
) -> MemoryBudget:
    device_bytes = int(gpu_memory_gb * GB)
    headroom = int(device_bytes * HEADROOM_FRACTION[device])
    weights = math.ceil(_weights_bytes(spec, weight_bits) / tp)
    activations = PREFILL_CHUNK_TOKENS * _hidden_size(spec) * ACTIVATION_VALUES_PER_HIDDEN * 2
    overhead = RUNTIME_OVERHEAD_BYTES[device] + activations
    return MemoryBudget(
        device_bytes=device_bytes,
        headroom_bytes=headroom,
        weights_bytes=weights,
        overhead_bytes=overhead,
        kv_budget_bytes=device_bytes - headroom - weights - overhead,
        tensor_parallel_size=tp,
    )


@dataclass(frozen=True)
class _Eval:
    budget: MemoryBudget
    kv: str | None
    status: str
    fits: dict[str, int]


def _evaluate(
    spec: memory.ModelSpec,
    device: str,
    gpu_memory_gb: float,
    context_len: int,
    concurrency: int,
    quality: str,
    weight_bits: int,
    tp: int,
) -> _Eval:
    budget = _budget(spec, device, gpu_memory_gb, weight_bits, tp)
    ladder = QUALITY_LADDER[quality]
    fits = {
        name: _fit(
            budget.kv_budget_bytes,
            _kv_seq_bytes(spec, context_len, _storage(name), tp),
        )
        for name in KV_SETTINGS
    }
    for name in ladder:
        if fits[name] >= concurrency:
            return _Eval(budget, name, "ok", fits)
    if fits[ladder[-1]] >= 1:
        return _Eval(budget, ladder[-1], "reduced", fits)
    return _Eval(budget, None, "impossible", fits)


def _valid_tp(spec: memory.ModelSpec, tp: int) -> bool:
    return spec.num_heads % tp == 0


# --------------------------------------------------------------------------------------------
# validation


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer (got {type(value).__name__} {value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} (got {value})")
    return value


def _check_memory(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"gpu_memory_gb must be a number of GB (got {type(value).__name__} {value!r})"
        )
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"gpu_memory_gb must be a finite number >= 0 (got {value})")
    return float(value)


# --------------------------------------------------------------------------------------------
# the entry point


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
    measurements: Mapping[str, Any] | str | os.PathLike[str] | None = None,
) -> Plan:
    """Recommend a KV-cache configuration (rules in the module docstring).

    Args:
        model: a registry name (``"llama-3.1-8b"``), a :class:`kvlib.memory.ModelSpec`, a
            transformers config (give it a parameter count: ``spec_from_config(config,
            num_params=...)``), or a loaded transformers model (its parameters are counted).
        gpu_memory_gb: memory of one GPU (or of RAM for ``device="cpu"``) as labelled, in GB;
            GPU labels are binary (an "80 GB" H100 holds 80 GiB), so it is read as GiB.
            0 gives an ``"impossible"`` plan.
        context_len: tokens per sequence (prompt + output) the cache must hold, >= 1.
        concurrency: sequences decoding at the same time, >= 1.
        quality: ``"max"`` (fp16 only), ``"balanced"`` (down to int4), ``"aggressive"`` (int2).
        weight_bits: 16, 8 or 4.
        num_gpus: GPUs used with tensor parallelism (must divide the model's attention heads).
        device: ``"gpu"`` or ``"cpu"`` (RAM, llama.cpp, one device).
        measurements: measured results to cite: a dict in the ``measurements.json`` layout, a
            path to such a file, or None for :func:`load_measurements` (``$KVLIB_MEASUREMENTS``,
            else the package's file); ``{}`` cites none.

    Raises:
        ValueError/TypeError: malformed input (unknown model — with close matches, negative or
            non-integer sizes, unknown quality, unsupported bits, impossible tensor-parallel size).
    """
    spec = _resolve_spec(model)
    name = model if isinstance(model, str) else _spec_name(spec)
    gpu_memory_gb = _check_memory(gpu_memory_gb)
    context_len = _check_int("context_len", context_len)
    concurrency = _check_int("concurrency", concurrency)
    num_gpus = _check_int("num_gpus", num_gpus)
    if quality not in QUALITIES:
        raise ValueError(f"quality must be one of {', '.join(QUALITIES)} (got {quality!r})")
    if weight_bits not in WEIGHT_BITS:
        raise ValueError(
            f"weight_bits must be one of {', '.join(map(str, WEIGHT_BITS))} (got {weight_bits!r})"
        )
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)} (got {device!r})")
    if device == "cpu" and num_gpus != 1:
        raise ValueError(
            f"device='cpu' plans for one machine's RAM: num_gpus must be 1 (got {num_gpus})"
        )
    if not _valid_tp(spec, num_gpus):
        raise ValueError(
            f"num_gpus={num_gpus} cannot split {name}'s {spec.num_heads} attention heads evenly "
            f"(tensor parallelism needs a divisor of {spec.num_heads})"
        )
    if measurements is None or isinstance(measurements, (str, os.PathLike)):
        measurements = load_measurements(measurements)
    elif not isinstance(measurements, Mapping):
        raise TypeError(
            "measurements must be a mapping, a path to a JSON file or None "
            f"(got {type(measurements).__name__})"
        )
    tp = num_gpus

    ev = _evaluate(spec, device, gpu_memory_gb, context_len, concurrency, quality, weight_bits, tp)
    ladder = QUALITY_LADDER[quality]
    kv_for_numbers = ev.kv or ladder[-1]
    eff = _storage(kv_for_numbers)
    kv_budget = ev.budget.kv_budget_bytes

    if device == "cpu":
        engine = "llama.cpp"
    elif concurrency > 1 or tp > 1:
        engine = "vllm"
    else:
        engine = "transformers"
    paging = engine == "vllm"
    idle_storage = "pca" if (concurrency >= IDLE_STORAGE_MIN_SESSIONS and ev.kv) else None

    reasons: list[str] = []
    watch: list[str] = []
    suggestions: list[str] = []
    h = memory.human_bytes
    fp16_seq = _kv_seq_bytes(spec, context_len, (16, None), tp)
    kv_seq = _kv_seq_bytes(spec, context_len, eff, tp)
    per = " per GPU" if tp > 1 else ""

    # --- why this setting
    if ev.budget.kv_budget_bytes <= 0:
        reasons.append(
            f"the weights ({h(ev.budget.weights_bytes)}{per} at {weight_bits} bits) plus runtime "
            f"and activations ({h(ev.budget.overhead_bytes)}) exceed the usable "
            f"{h(ev.budget.usable_bytes)}{per}: nothing is left for the KV cache"
        )
    elif ev.kv is None:
        reasons.append(
            f"one sequence of {context_len:,} tokens needs {h(kv_seq)}{per} even at "
            f"{kv_for_numbers}, but only {h(kv_budget)} is left for the KV cache"
        )
    else:
        need = concurrency * fp16_seq
        if ev.kv == "fp16":
            reasons.append(
                f"{concurrency} × {context_len:,} tokens at fp16 need {h(need)}{per}, within the "
                f"{h(kv_budget)} left for the KV cache: no need to quantize"
            )
        else:
            higher = ladder[: ladder.index(ev.kv)]
            reasons.append(
                f"{concurrency} × {context_len:,} tokens need {h(need)}{per} at fp16 but only "
                f"{h(kv_budget)} is left; "
                + ", ".join(f"{n} fits {ev.fits[n]}" for n in higher)
                + f"; {ev.kv} fits {ev.fits[ev.kv]}"
            )
        reasons.append(quality_note(ev.kv, measurements))
        if ev.kv != "fp16" and ev.kv in ("int4", "int2"):
            rot = measurements.get("caches", {}).get(f"kvlib-{ev.kv}-rot")
            if isinstance(rot, Mapping) and isinstance(
                rot.get("perplexity_delta_pct"), (int, float)
            ):
                reasons.append(
                    f"{ev.kv} with a Hadamard rotation (kvlib-{ev.kv}-rot): "
                    f"{_fmt_pct(rot['perplexity_delta_pct'])} perplexity {_provenance(measurements)}"
                )
    if ev.status == "reduced":
        reasons.append(
            f"even at {kv_for_numbers} (the lowest that quality={quality!r} allows) only "
            f"{ev.fits[kv_for_numbers]} of {concurrency} sequences fit at the full context"
        )
    if ev.kv is None:
        pass  # no engine advice for a request that does not fit
    elif engine == "vllm":
        reasons.append(
            "several sequences or GPUs: a serving engine (vLLM) with paged KV blocks of "
            f"{VLLM_BLOCK_SIZE} tokens wastes under 4 % of the cache instead of reserving "
            "max-length buffers, batches continuously"
            + (f", and splits the model over {tp} GPUs (tensor parallelism)" if tp > 1 else "")
        )
    elif engine == "llama.cpp":
        reasons.append("CPU: llama.cpp (GGUF weights, quantized KV cache types, flash attention)")
    else:
        reasons.append("one sequence on one GPU: transformers generate() with the cache below")
    if idle_storage:
        reasons.append(
            f"{concurrency} conversations: between turns, keep idle caches compressed with PCA "
            f"transform coding (kvlib.pca) instead of fp16 or recomputing — {quality_note('pca', measurements)}"
        )

    # --- what to watch
    delta = _measured_delta(ev.kv, measurements) if ev.kv else None
    if ev.kv == "int4":
        watch.append(
            "4-bit keys need per-channel statistics (outlier channels); check quality on your own "
            "model and task — the measured figure is from a small model"
        )
    if ev.kv == "int2":
        watch.append(
            "2-bit caches lose noticeable quality"
            + (f" (measured {_fmt_pct(delta)} perplexity)" if delta is not None else "")
            + "; keep recent tokens in full precision and evaluate before serving"
        )
    if ev.kv in ("int4", "int2"):
        watch.append(
            f"vLLM has no {ev.kv} KV cache: its flags use fp8 (recounted); llama.cpp's lowest is q4_0"
        )
    if _has_sliding_window(spec) and ev.kv not in (None, "fp16"):
        watch.append(
            "sliding-window layers: transformers' QuantizedCache refuses this model; use vLLM or "
            "kvlib's cache"
        )
    if _is_mla(spec) and tp > 1:
        watch.append(
            "MLA latent cache is replicated on every GPU under tensor parallelism (vLLM); "
            "data-parallel attention avoids that"
        )
    if tp > spec.num_kv_heads and not _is_mla(spec):
        watch.append(
            f"tensor parallel {tp} > {spec.num_kv_heads} KV heads: KV heads are replicated"
        )
    max_pos = spec.max_position_embeddings
    if max_pos and context_len > max_pos:
        watch.append(
            f"context {context_len:,} exceeds the model's trained {max_pos:,} tokens: quality is "
            "not guaranteed (vLLM refuses max_model_len beyond it without an override)"
        )
    if weight_bits < 16:
        watch.append(
            f"{weight_bits}-bit weights cost quality of their own (use a pre-quantized checkpoint: "
            + ("FP8" if weight_bits == 8 else "AWQ/GPTQ for vLLM, Q4_K_M GGUF for llama.cpp")
            + ")"
        )
    if paging:
        watch.append(
            "the count assumes every sequence at full context; with shorter real conversations a "
            "paged engine admits more — measure your length distribution"
        )

    # --- what would fit, when the request does not
    if ev.status != "ok":
        lowest = ladder[-1]
        if ev.kv is not None:
            suggestions.append(
                f"{ev.fits[lowest]} concurrent sequences at {context_len:,} tokens with {lowest}"
            )
        ctx = _max_context(spec, kv_budget, concurrency, _storage(lowest), tp)
        if ctx > 0:
            suggestions.append(f"{concurrency} sequences at up to {ctx:,} tokens with {lowest}")
        if quality != "aggressive":
            nxt = QUALITIES[QUALITIES.index(quality) + 1]
            alt = _evaluate(
                spec, device, gpu_memory_gb, context_len, concurrency, nxt, weight_bits, tp
            )
            if alt.status == "ok":
                suggestions.append(f"quality={nxt!r}: the whole request with {alt.kv}")
        lower_bits = [b for b in WEIGHT_BITS if b < weight_bits]
        weights_alone = False
        for wb in lower_bits:
            alt = _evaluate(spec, device, gpu_memory_gb, context_len, concurrency, quality, wb, tp)
            if alt.status == "ok":
                suggestions.append(f"weight_bits={wb}: the whole request with {alt.kv}")
                weights_alone = True
                break
        if device == "gpu" and gpu_memory_gb > 0:
            more_gpus = [t for t in TP_CANDIDATES if t > tp and _valid_tp(spec, t)]
            for n in more_gpus:
                alt = _evaluate(
                    spec, device, gpu_memory_gb, context_len, concurrency, quality, weight_bits, n
                )
                if alt.status == "ok":
                    suggestions.append(
                        f"num_gpus={n} (vLLM tensor_parallel_size={n}): the whole request with {alt.kv}"
                    )
                    break
            else:
                suggestions.append(
                    f"more than {TP_CANDIDATES[-1]} GPUs: pipeline parallelism across nodes "
                    "(vLLM pipeline_parallel_size), or a smaller model"
                )
            # both at once: the fewest GPUs that fit with lower-bit weights
            combos = [(n, wb) for n in more_gpus for wb in reversed(lower_bits)]
            for n, wb in combos if not weights_alone else ():
                alt = _evaluate(
                    spec, device, gpu_memory_gb, context_len, concurrency, quality, wb, n
                )
                if alt.status == "ok":
                    suggestions.append(
                        f"num_gpus={n} with weight_bits={wb}: the whole request with {alt.kv}"
                    )
                    break
        need = ev.budget.weights_bytes + ev.budget.overhead_bytes + kv_seq * concurrency
        gb = need / (1 - HEADROOM_FRACTION[device]) / GB
        what = f"{tp} GPUs of" if tp > 1 else ("RAM of" if device == "cpu" else "a GPU with")
        suggestions.append(f"{what} at least {gb:.3g} GB: the whole request with {kv_for_numbers}")

    max_conc = ev.fits[kv_for_numbers] if ev.kv else 0
    return Plan(
        model=name,
        spec=spec,
        device=device,
        gpu_memory_gb=gpu_memory_gb,
        num_gpus=num_gpus,
        context_len=context_len,
        concurrency=concurrency,
        quality=quality,
        weight_bits=weight_bits,
        status=ev.status,
        kv=ev.kv,
        engine=engine,
        paging=paging,
        idle_storage=idle_storage,
        tensor_parallel_size=tp,
        budget=ev.budget,
        kv_bytes_per_sequence=kv_seq,
        kv_bytes_per_sequence_fp16=fp16_seq,
        max_concurrency=max_conc,
        max_concurrency_fp16=ev.fits["fp16"],
        max_context=_max_context(spec, kv_budget, concurrency, eff, tp) if ev.kv else 0,
        max_context_fp16=_max_context(spec, kv_budget, concurrency, (16, None), tp),
        reasons=tuple(reasons),
        watch=tuple(watch),
        suggestions=tuple(suggestions),
        measurements=dict(measurements),
    )


# --------------------------------------------------------------------------------------------
# benchmarks/RESULTS.md, for the series summary (notebook 08)


def results_tables(text: str) -> dict[str, list[list[dict[str, str]]]]:
    """The Markdown tables of a results file, by the heading they sit under.

    ``{"PagedAttention (kvlib.paged)": [...], "Serving simulation (...)": [[row, ...], ...]}``:
    each table is a list of rows, each row a dict from column header to cell text (stripped).
    A table belongs to the nearest heading above it (any level); a file without headings puts
    its tables under ``""``. Placeholders such as ``_Not yet measured._`` simply have no tables.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str (got {type(text).__name__})")
    out: dict[str, list[list[dict[str, str]]]] = {}
    heading = ""
    block: list[str] = []

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    def flush() -> None:
        if len(block) >= 2 and set(block[1].replace("|", "").strip()) <= set("-: "):
            headers = cells(block[0])
            rows = [dict(zip(headers, cells(line), strict=False)) for line in block[2:]]
            out.setdefault(heading, []).append(rows)
        block.clear()

    for line in text.splitlines():
        if line.lstrip().startswith("|"):
            block.append(line)
            continue
        flush()
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
    flush()
    return out


def load_results(
    path: str | os.PathLike[str] | None = None,
) -> dict[str, list[list[dict[str, str]]]]:
    """:func:`results_tables` of ``benchmarks/RESULTS.md`` (default: the one next to this package
    in a source checkout); ``{}`` when the default file is absent (e.g. a pip install)."""
    if path is None:
        file = Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md"
        if not file.is_file():
            return {}
    else:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"results file {str(path)!r} does not exist")
    return results_tables(file.read_text(encoding="utf-8"))
