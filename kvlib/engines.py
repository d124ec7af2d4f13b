"""What each engine can keep in its KV cache, as data (notebook 08).

The planner (:mod:`kvlib.plan_rule`) chooses an engine first, then the highest precision level
that the engine can run and that fits, so a plan never names a cache type its engine lacks, and
every count it prints is the bytes of the type its flags set. A level is the planner's quality
ladder (``fp16``, ``int8``, ``int4``, ``int2``); each engine spells it its own way:

================  ===========================  ================  ===============================
level             transformers (kvlib's cache)  vLLM              llama.cpp
================  ===========================  ================  ===============================
fp16              ``dynamic-fp16``             ``auto``          ``f16``
int8              ``kvlib-int8``               ``fp8``           ``q8_0``
int4              ``kvlib-int4``               —                 ``q4_0``
int2              ``kvlib-int2``               —                 —
================  ===========================  ================  ===============================

**Bytes.** Each type is priced by :func:`kvlib.memory.kv_cache_bytes` with its ``(bits,
group_size, group_meta_bits)``:

* kvlib's caches (:mod:`kvlib.cache_registry`): one fp16 scale and one fp16 zero point per group,
  at the registry's group size (the finer of the key and value groups, so an upper bound);
* vLLM's ``fp8`` (``fp8_e4m3``, ``fp8_e5m2``): 8 bits per value, scales per tensor (no per-group
  metadata);
* llama.cpp (ggml's block formats): ``q8_0``, ``q4_0``, ``iq4_nl``, ``q5_0`` keep one fp16 scale
  per block of 32 values; ``q4_1``, ``q5_1`` add a per-block fp16 minimum. A quantized V cache
  needs flash attention (``-fa on``).

vLLM has no 4- or 2-bit KV cache and llama.cpp no 2-bit one: the planner's ladder skips those
levels for those engines. Sources: vLLM's ``--kv-cache-dtype`` choices, llama.cpp's
``--cache-type-k/-v`` list and ggml's block layouts (``ggml-common.h``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlib import cache_registry
from kvlib.memory import GROUP_META_BITS

__all__ = ["ENGINES", "KV_TYPES", "LEVELS", "EngineKV", "accepts", "kv_type", "planned"]

#: The engines a plan gives settings for, in the order plans list them.
ENGINES: tuple[str, ...] = ("transformers", "vllm", "llama.cpp")
#: The planner's precision levels, highest first.
LEVELS: tuple[str, ...] = ("fp16", "int8", "int4", "int2")

_GGML_BLOCK = 32  # values per ggml quantization block
_FP16 = 16


@dataclass(frozen=True)
class EngineKV:
    """One KV-cache type an engine accepts.

    Attributes:
        engine: one of :data:`ENGINES`.
        name: the engine's own spelling (a registry name for transformers, vLLM's
            ``kv_cache_dtype``, llama.cpp's ``--cache-type-k/-v``).
        level: the planner level it serves (one of :data:`LEVELS`), or None for a type the
            engine accepts but the planner does not choose (llama.cpp's q5_0, …).
        bits: bits per stored code.
        group_size: values per scale group, or None (per-tensor scale, or no quantization).
        group_meta_bits: metadata bits per group (16: an fp16 scale; 32: scale and zero point).
        needs_flash_attention: llama.cpp's quantized V cache runs only with ``-fa on``.
        measured_as: the :mod:`kvlib.cache_registry` cache whose measured quality a plan cites
            for it, when one is the same format; None when it is not measured.
    """

    engine: str
    name: str
    level: str | None
    bits: int
    group_size: int | None = None
    group_meta_bits: int = 0
    needs_flash_attention: bool = False
    measured_as: str | None = None

    @property
    def effective_bits(self) -> float:
        """Bits per cached value, metadata included: ``q4_0`` 4.5, ``fp8`` 8."""
        if self.group_size is None:
            return float(self.bits)
        return self.bits + self.group_meta_bits / self.group_size

    @property
    def storage(self) -> tuple[int, int | None, int]:
        """``(bits, group_size, group_meta_bits)`` as :func:`kvlib.memory.kv_cache_bytes` takes
        them."""
        return (self.bits, self.group_size, self.group_meta_bits)


def _kvlib(level: str, name: str) -> EngineKV:
    info = cache_registry.cache_info(name)
    bits = info.cache_bits(16)
    group = info.group_size if bits < 16 else None
    meta = GROUP_META_BITS if group else 0
    return EngineKV("transformers", name, level, bits, group, meta, measured_as=name)


def _ggml(name: str, level: str | None, bits: int, meta_bits: int) -> EngineKV:
    return EngineKV("llama.cpp", name, level, bits, _GGML_BLOCK, meta_bits, True)


#: Every KV type each engine accepts.
KV_TYPES: tuple[EngineKV, ...] = (
    _kvlib("fp16", "dynamic-fp16"),
    _kvlib("int8", "kvlib-int8"),
    _kvlib("int4", "kvlib-int4"),
    _kvlib("int2", "kvlib-int2"),
    EngineKV("vllm", "auto", "fp16", 16, measured_as="dynamic-fp16"),
    EngineKV("vllm", "fp8", "int8", 8, measured_as="hf-fp8"),
    EngineKV("vllm", "fp8_e4m3", None, 8, measured_as="hf-fp8"),
    EngineKV("vllm", "fp8_e5m2", None, 8),
    EngineKV("llama.cpp", "f16", "fp16", 16, measured_as="dynamic-fp16"),
    _ggml("q8_0", "int8", 8, _FP16),
    _ggml("q4_0", "int4", 4, _FP16),
    _ggml("iq4_nl", None, 4, _FP16),
    _ggml("q4_1", None, 4, 2 * _FP16),
    _ggml("q5_0", None, 5, _FP16),
    _ggml("q5_1", None, 5, 2 * _FP16),
)


def _check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)} (got {engine!r})")
    return engine


def accepts(engine: str, name: str) -> bool:
    """Whether ``engine`` runs a KV cache of type ``name``."""
    _check_engine(engine)
    return any(t.engine == engine and t.name == name for t in KV_TYPES)


def kv_type(engine: str, name: str) -> EngineKV:
    """The :class:`EngineKV` ``engine`` calls ``name``.

    Raises:
        ValueError: an unknown engine, or a type the engine does not accept.
    """
    _check_engine(engine)
    for t in KV_TYPES:
        if t.engine == engine and t.name == name:
            return t
    accepted = ", ".join(t.name for t in KV_TYPES if t.engine == engine)
    raise ValueError(f"{engine} has no KV cache type {name!r} (it accepts {accepted})")


def planned(engine: str) -> dict[str, EngineKV]:
    """The type the planner uses at each level ``engine`` can run, highest precision first:
    ``planned("vllm") == {"fp16": <auto>, "int8": <fp8>}``."""
    _check_engine(engine)
    by_level = {t.level: t for t in KV_TYPES if t.engine == engine and t.level is not None}
    return {level: by_level[level] for level in LEVELS if level in by_level}
