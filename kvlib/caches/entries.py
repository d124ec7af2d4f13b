"""What each cache name of the registry means: one :class:`CacheInfo` per name, its family, bits,
groups and full-precision tokens, with the defaults read from where the classes read theirs,
never copied: :mod:`kvlib.caches.layout` (kvlib's quantized cache, its TurboQuant and KVQuant
layouts), :mod:`kvlib.quant.presets` (vLLM's TurboQuant dtypes and boundary layers, KVQuant's
outliers), :mod:`kvlib.caches.eviction_settings` (the eviction policies' names and lines, the int4
group) and :mod:`kvlib.caches.hf_layout` (transformers' ``QuantizedLayer`` defaults, checked
against its signature by the tests).

The table is plain data: this module imports no torch and no transformers (import-linter's
contract "the planner needs no torch" and ``tests/test_packaging.py`` check it), so a dtype in
an entry's options is its name (``"float16"``), which :mod:`kvlib.caches.registry` turns into the
torch dtype when it builds the cache. :mod:`kvlib.caches.registry` builds the caches these entries
name and documents every name; this module holds the table itself (:data:`ENTRIES`, in display
order).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvlib.caches import eviction_settings, hf_layout
from kvlib.caches import layout as cache_layout
from kvlib.quant import presets

__all__ = [
    "CACHE_NAMES",
    "ENTRIES",
    "EVICTION_NAMES",
    "FAMILIES",
    "INT_RESIDUAL",
    "KVTC_WINDOW",
    "REFERENCE_DTYPES",
    "SHORT_WINDOW",
    "CacheInfo",
]

#: Cache families: who implements the cache, and how (``evict``: kvlib's token eviction,
#: ``paged``: kvlib's block-paged pool, ``kvtc``: kvlib's transform coding of a stored cache).
FAMILIES: tuple[str, ...] = (
    "dynamic",
    "kvlib",
    "quanto",
    "hqq",
    "fp8",
    "turboquant",
    "kvquant",
    "evict",
    "paged",
    "kvtc",
)

#: The reference DynamicCache's dtypes, ``dynamic-<short>``: short name -> (torch's name for the
#: dtype, its bits). :data:`kvlib.caches.registry.DTYPE_NAMES` maps the torch dtypes to these.
REFERENCE_DTYPES: Mapping[str, tuple[str, int]] = MappingProxyType(
    {
        "fp32": ("float32", 32),
        "fp16": ("float16", 16),
        "bf16": ("bfloat16", 16),
    }
)


@dataclass(frozen=True)
class CacheInfo:
    """What a cache name means.

    Attributes:
        name: the registry name (:data:`CACHE_NAMES`).
        family: one of :data:`FAMILIES`.
        bits: bits per cached code (the dtype's width for the reference DynamicCache; 16 for the
            paged cache, which holds whatever the model computes: :meth:`cache_bits`; 16 for
            ``kvtc``'s float16 window, whose codes take the bits its budget leaves).
        group_size: values per scale (and zero point) for the memory prediction: the finer of
            the key and value groups, so the prediction is an upper bound; ``None`` where there
            is no per-group metadata (the reference, fp8's one scale per tensor).
        residual_tokens: most recent tokens per sequence kept in full precision (plus kvlib's
            attention-sink tokens), which :mod:`kvlib.memory`'s formula leaves out.
        description: one line for tables.
        options: the constructor options that make this variant (empty for the defaults); a
            dtype by its torch name (``"float16"``), which the registry's factory converts.
        policy: the eviction policy (:data:`kvlib.caches.eviction.cache.POLICIES`) of an
            ``evict`` cache, else ``None``.
        requires: options the factory cannot do without (``("num_blocks",)`` for the paged
            cache's pool); a budgeted cache's budget is not one (it can be in the name).
    """

    name: str
    family: str
    bits: int
    group_size: int | None
    residual_tokens: int
    description: str
    options: Mapping[str, Any] = field(default_factory=dict)
    policy: str | None = None
    requires: tuple[str, ...] = ()

    @property
    def budgeted(self) -> bool:
        """Whether the cache takes a budget (a share of the fp16 bytes, ``name@1/4``): the
        eviction caches, whose size is a budget rather than a bit width."""
        return self.family in ("evict", "kvtc")

    @property
    def stored(self) -> bool:
        """Whether the name is a stored cache's codec (``kvtc``): encoded between turns and
        decoded before the next, never read while decoding; its factory builds a
        :class:`~kvlib.kvtc.codec.KVTCCodec`, not a transformers ``Cache``."""
        return self.family == "kvtc"

    def cache_bits(self, dtype_bits: int = 16) -> int:
        """Bits per cached value when the model computes in ``dtype_bits``-bit floats.

        Quantized caches hold their codes whatever the model's dtype; the reference holds the
        model's dtype, so its name must match it; the paged cache holds the model's dtype
        whatever it is.

        Raises:
            ValueError: a reference named for another dtype (use :func:`reference_name`); a
                stored cache (``kvtc``), whose bits follow its budget and basis.
        """
        if self.stored:
            raise ValueError(
                f"{self.name!r} has no fixed bits per value: its codes take what the budget "
                "leaves (KVTCCodec.inspect(data) gives a stored cache's bytes)"
            )
        if self.family == "paged":
            return dtype_bits
        if self.family == "dynamic" and dtype_bits != self.bits:
            raise ValueError(
                f"{self.name!r} holds {self.bits}-bit values, but the model computes in "
                f"{dtype_bits}-bit floats: name the reference with reference_name(dtype)"
            )
        return self.bits


#: The float16 window (and key block) of the ``kvlib-int*-w64`` caches, in tokens: at 4096
#: tokens its float16 values take 64 × 16 / 4096 = 0.25 bit per cached value, against 0.5 for
#: the default 128; the key groups double to the block, which saves as much again at 3 bits.
SHORT_WINDOW = 64


def _kvlib_entries() -> list[CacheInfo]:
    residual, sinks = cache_layout.RESIDUAL_LENGTH, cache_layout.SINK_TOKENS
    window = residual + sinks
    values = cache_layout.DEFAULT_VALUE_GROUP_CHANNELS
    out = []
    for bits in (8, 4, 3, 2):
        keys = cache_layout.default_key_group_size(bits, residual)
        group = cache_layout.predicted_group_size(bits, residual)
        layout = f"key groups of {keys} tokens, value groups of up to {values} channels"
        out.append(
            CacheInfo(
                f"kvlib-int{bits}",
                "kvlib",
                bits,
                group,
                window,
                f"kvlib int{bits} defaults: {layout}, {residual}-token window, {sinks} sinks",
            )
        )
        for rotate, suffix in ((True, "rot"), (False, "norot")):
            out.append(
                CacheInfo(
                    f"kvlib-int{bits}-{suffix}",
                    "kvlib",
                    bits,
                    group,
                    window,
                    f"kvlib int{bits} defaults with rotate={rotate}",
                    MappingProxyType({"rotate": rotate}),
                )
            )
        if bits < 8:
            short = {"residual_length": SHORT_WINDOW, "key_group_size": SHORT_WINDOW}
            out.append(
                CacheInfo(
                    f"kvlib-int{bits}-w{SHORT_WINDOW}",
                    "kvlib",
                    bits,
                    min(SHORT_WINDOW, values),
                    SHORT_WINDOW + sinks,
                    f"kvlib int{bits} with a {SHORT_WINDOW}-token window and one key group per "
                    f"{SHORT_WINDOW}-token block (half the default window's bytes), value groups "
                    f"of up to {values} channels, {sinks} sinks",
                    MappingProxyType(short),
                )
            )
            block = {"key_group_size": residual, "group_size": 32, "rotate": False}
            out.append(
                CacheInfo(
                    f"kvlib-int{bits}-block",
                    "kvlib",
                    bits,
                    32,
                    window,
                    f"kvlib int{bits}, one key scale per channel per {residual}-token block "
                    "(coarser than KIVI's 32-token key groups), value groups of 32, no rotation",
                    MappingProxyType(block),
                )
            )
    return out


def _hf_entries() -> list[CacheInfo]:
    group, residual = hf_layout.Q_GROUP_SIZE, hf_layout.RESIDUAL_LENGTH
    axis_key, axis_value = hf_layout.AXIS_KEY, hf_layout.AXIS_VALUE
    out = []
    for bits in (4, 2):
        out.append(
            CacheInfo(
                f"quanto-int{bits}",
                "quanto",
                bits,
                group,
                residual,
                f"transformers QuantizedCache, quanto int{bits}, axes {axis_key}/{axis_value}, "
                f"groups of {group}, {residual}-token window",
            )
        )
    for bits in (8, 4, 3, 2):
        out.append(
            CacheInfo(
                f"hqq-int{bits}",
                "hqq",
                bits,
                group,
                residual,
                f"transformers QuantizedCache, HQQ int{bits}, axes {axis_key}/{axis_value}, "
                f"groups of {group}, {residual}-token window",
            )
        )
        out.append(
            CacheInfo(
                f"hqq-int{bits}-axis1",
                "hqq",
                bits,
                group,
                residual,
                f"transformers QuantizedCache, HQQ int{bits}, axes 1/1 (per token; the axis "
                f"HQQ's README starts weights at), groups of {group}, {residual}-token window",
                MappingProxyType({"axis_key": 1, "axis_value": 1}),
            )
        )
    out.append(
        CacheInfo(
            "hf-fp8",
            "fp8",
            8,
            None,
            0,
            "transformers QuantizedCache, fp8 (float8_e4m3fn, one scale per tensor)",
        )
    )
    return out


def _reference_entries() -> list[CacheInfo]:
    return [
        CacheInfo(
            f"dynamic-{short}",
            "dynamic",
            bits,
            None,
            0,
            f"transformers DynamicCache holding {short} (the reference)",
        )
        for short, (_, bits) in REFERENCE_DTYPES.items()
    ]


#: The memory prediction's group for TurboQuant: its per-vector metadata (a key's norm, a
#: value's scale and zero point) counted as one fp16 scale and zero point per 64 values, an upper
#: bound for any head_dim of 64 or more (the ``bits`` are the wider of keys and values).
_TQ_GROUP = 64


def _turboquant_entries() -> list[CacheInfo]:
    """vLLM 0.32's four TurboQuant dtypes as it runs them, and kvlib's layout of the same
    codec (4 sinks and a 128-token window in float16, block-centred keys)."""
    out = []
    for dtype, (key_bits, value_bits) in presets.VLLM_PRESETS.items():
        keys = "float8 keys" if key_bits == 8 else f"{key_bits}-bit codebook keys"
        out.append(
            CacheInfo(
                dtype.replace("_", "-"),
                "turboquant",
                max(key_bits, value_bits),
                _TQ_GROUP,
                0,
                f"vLLM's {dtype}: {keys}, {value_bits}-bit per-token values, every token "
                f"encoded on arrival, first and last {presets.BOUNDARY_LAYERS} layers of a "
                "dense model in the model's dtype",
                MappingProxyType({"key_bits": key_bits, "value_bits": value_bits}),
            )
        )
    residual, sinks = cache_layout.RESIDUAL_LENGTH, cache_layout.SINK_TOKENS
    for bits in (4, 3, 2):
        options = {
            "key_bits": bits,
            "value_bits": bits,
            "boundary_layers": 0,
            "sink_tokens": sinks,
            "residual_length": residual,
            "center_keys": True,
        }
        out.append(
            CacheInfo(
                f"turboquant-{bits}bit-centered",
                "turboquant",
                bits,
                _TQ_GROUP,
                residual + sinks,
                f"TurboQuant {bits}-bit keys and values in kvlib's layout: {sinks} sinks and a "
                f"{residual}-token window in float16, keys centred per {residual}-token block, "
                "every layer quantized",
                MappingProxyType(options),
            )
        )
    return out


#: The memory prediction's group for KVQuant: a block's per-channel (keys) or per-token
#: (values) minimum and maximum, its levels and its 1 % of outliers (float16 value and int16
#: position each: 0.32 bits per value) come to under 0.9 bits per value for a head_dim of 64 or
#: more; one fp16 scale and zero point per 32 values (1 bit) bounds them.
_KVQ_GROUP = 32


def _kvquant_entries() -> list[CacheInfo]:
    """KVQuant's recipe at 4, 3 and 2 bits in kvlib's layout, with and without its non-uniform
    levels."""
    residual, sinks = cache_layout.RESIDUAL_LENGTH, cache_layout.SINK_TOKENS
    share = presets.OUTLIER_FRACTION
    out = []
    for bits in (4, 3, 2):
        for nuq, suffix, levels in (
            (True, "", "per-block Lloyd levels"),
            (False, "-uniform", "uniform levels"),
        ):
            out.append(
                CacheInfo(
                    f"kvquant-{bits}bit{suffix}",
                    "kvquant",
                    bits,
                    _KVQ_GROUP,
                    residual + sinks,
                    f"KVQuant {bits}-bit: pre-RoPE per-channel keys, per-token values, {levels}, "
                    f"{share:.0%} sparse outliers; {sinks} sinks and a {residual}-token window in "
                    "float16",
                    MappingProxyType({"key_bits": bits, "value_bits": bits, "nuq": nuq}),
                )
            )
    return out


# ---------------------------------------------------------------------- token eviction


#: Newest tokens an ``evict-<policy>-int4`` cache keeps in float16 (its ``residual``): KIVI's
#: smallest residual and SnapKV's observation window. Measured on 1,024 tokens at 1/4 of the
#: fp16 bytes, it takes H2O-int4's perplexity cost from +1.1 % to +0.1 % (bench_eviction.py).
INT_RESIDUAL = 32


def _eviction_entries() -> list[CacheInfo]:
    out = []
    group = eviction_settings.GROUP_SIZE
    for policy, line in eviction_settings.POLICY_LINES.items():
        out.append(
            CacheInfo(
                f"evict-{policy}",
                "evict",
                16,
                None,
                0,
                f"{line}; float16 keys and values",
                MappingProxyType({"dtype": "float16"}),
                policy=policy,
            )
        )
        out.append(
            CacheInfo(
                f"evict-{policy}-int4",
                "evict",
                4,
                group,
                INT_RESIDUAL,
                f"{line}; kept tokens in int4 (per token, {group} channels per "
                f"scale), the newest {INT_RESIDUAL} in float16",
                MappingProxyType({"dtype": "float16", "bits": 4, "residual": INT_RESIDUAL}),
                policy=policy,
            )
        )
    return out


#: The float16 window (sinks, newest tokens) of a ``kvtc`` stored cache: smaller than the
#: codec's default 128 newest tokens, so that a 1/8 budget at 1,024 tokens leaves the codes
#: room (the eviction benchmark's setting).
KVTC_WINDOW = (4, 32)

_KVTC = CacheInfo(
    "kvtc",
    "kvtc",
    16,
    None,
    sum(KVTC_WINDOW),
    f"PCA transform coding of a stored cache (KVTCCodec, lzma): {KVTC_WINDOW[0]} sinks and the "
    f"newest {KVTC_WINDOW[1]} tokens in float16, the rest as PCA codes (basis=, tokens=)",
    MappingProxyType({"sink_tokens": KVTC_WINDOW[0], "recent_tokens": KVTC_WINDOW[1]}),
    requires=("basis",),
)

_PAGED = CacheInfo(
    "paged",
    "paged",
    16,
    None,
    0,
    "kvlib's PagedCache: the model's dtype in blocks of one shared pool (num_blocks=, "
    "block_size=16)",
    requires=("num_blocks",),
)

ENTRIES: dict[str, CacheInfo] = {
    e.name: e
    for e in (
        *_reference_entries(),
        *_kvlib_entries(),
        *_hf_entries(),
        *_turboquant_entries(),
        *_kvquant_entries(),
        *_eviction_entries(),
        _PAGED,
        _KVTC,
    )
}

#: Every cache name, in display order: the references, kvlib's quantized caches, transformers'
#: own, the eviction caches (which take a budget: ``evict-h2o-int4@1/4``), the paged cache, the
#: stored cache's codec (``kvtc@1/4``).
CACHE_NAMES: tuple[str, ...] = tuple(ENTRIES)

#: The eviction caches' names: ``evict-<policy>`` (float16) and ``evict-<policy>-int4``.
EVICTION_NAMES: tuple[str, ...] = tuple(n for n, e in ENTRIES.items() if e.family == "evict")
