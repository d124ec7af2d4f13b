"""Every KV cache the project compares, by one name (notebooks 04, 08 and 09, the benchmarks).

A name says what the cache holds, and it is the same everywhere: in the benchmarks, in the
results file (:mod:`kvlib.results` rows are keyed by it), in the planner's settings, in the
notebooks and on the command line.

============================  ===============================================================
name                          cache
============================  ===============================================================
``dynamic-fp32``, ``-fp16``,  transformers' ``DynamicCache``, the reference: it holds what the
``dynamic-bf16``              model computes, so it is named for the model's dtype
                              (:func:`reference_name`)
``kvlib-int8`` … ``-int2``    :class:`kvlib.caches.quantized.QuantizedKVCache` with its defaults
``kvlib-int4-rot``/``-norot`` the same with the Hadamard rotation of the keys on / off
``kvlib-int4-w64`` …         a 64-token window and one key group per 64-token block (half
``-int2-w64``                 the window's bytes)
``kvlib-int4-block``          one key group per 128-token block, value groups of 32, no
                              rotation: the KIVI layout
``quanto-int4``, ``-int2``    transformers' ``QuantizedCache``, quanto backend, default axes
``hqq-int8`` … ``-int2``      the same with the HQQ backend, default axes (0/0)
``hqq-int4-axis1``            HQQ with axes 1/1 (HQQ's recommended axis)
``hf-fp8``                    transformers' fp8 cache (float8_e4m3fn, one scale per tensor)
``turboquant-4bit-nc`` …      :class:`kvlib.caches.turboquant.TurboQuantCache` as vLLM 0.32 runs
                              its ``--kv-cache-dtype turboquant_*`` options (``-k8v4``,
                              ``-4bit-nc``, ``-k3v4-nc``, ``-3bit-nc``)
``turboquant-4bit-centered``  the same codec in kvlib's layout (sinks, a float16 window, keys
… ``-2bit-centered``          centred per block)
``kvquant-4bit`` …            :class:`kvlib.caches.kvquant.KVQuantCache`: KVQuant's pre-RoPE
``-2bit``                     per-channel keys, per-block non-uniform levels and 1 % sparse
                              outliers, in kvlib's layout (sinks, a float16 window)
``kvquant-4bit-uniform`` …    the same with evenly spaced levels (no nuq)
``paged``                     :class:`kvlib.caches.paged.PagedCache` (notebook 07): the model's
                              dtype in fixed-size blocks of one shared pool; pass
                              ``num_blocks=`` (and ``block_size=``, default 16)
``kvtc@<share>``              :class:`kvlib.kvtc.codec.KVTCCodec` (notebook 06): PCA transform
                              coding of a *stored* cache, encoded between turns and decoded
                              before the next; pass ``basis=`` and ``tokens=``
============================  ===============================================================

On a model that mixes sliding-window and global layers (Gemma 2/3), every quantized cache here
keeps each sliding layer's window in float16 (:class:`kvlib.caches.sliding.SlidingWindowLayer`) and
quantizes the global layers only; transformers' own ``QuantizedCache`` refuses such a model, so
its rows get the same windows (:func:`kvlib.compat.hf_quantized_cache`'s ``sliding_layer``) and
differ from kvlib's only where the quantizer does.

Transform coding (family ``kvtc``) is the one entry that is not a live cache: attention never
reads it while decoding. A conversation's cache is encoded to bytes when a turn ends and decoded
into a ``DynamicCache`` before the next, so :func:`make_cache` gives a
:class:`~kvlib.kvtc.codec.KVTCCodec` for it, sized like an eviction budget (``kvtc@1/4`` stores
about a quarter of the fp16 bytes of ``tokens`` tokens; :attr:`CacheInfo.stored`).

Token-eviction caches (:class:`kvlib.caches.eviction.cache.EvictionCache`, notebook 11, family
``evict``) are in the same table; their size is a budget rather than a bit width, given as part
of the name, a share of the fp16 cache's bytes (``evict-h2o-int4@1/4``, with ``tokens=`` the
tokens it will hold), or as ``budget=`` (tokens per layer) or ``max_bytes=``:
``evict-<policy>`` keeps float16 keys and values, ``evict-<policy>-int4`` quantizes the kept
tokens to int4 (:data:`EVICTION_NAMES` lists them). The names are parsed by :mod:`kvlib.keys`,
as the results file's rows are.

Defaults (group sizes, the full-precision window) are read from the classes — kvlib's
:class:`~kvlib.caches.quantized.QuantizedKVCache` and its default functions, transformers'
``QuantizedLayer`` signature — never copied, so a changed default changes every prediction.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Any

import torch

from kvlib import compat, memory
from kvlib.caches import kvquant, paged, turboquant
from kvlib.caches import layout as cache_layout
from kvlib.caches import quantized as kvcache
from kvlib.caches.eviction import cache as eviction
from kvlib.caches.eviction import layer as eviction_layer
from kvlib.caches.sliding import SlidingWindowLayer
from kvlib.keys import RowKey
from kvlib.kvtc import codec as kvtc
from kvlib.quant import turboquant as tq
from kvlib.specs import spec_from_config
from kvlib.validate import check_int

__all__ = [
    "CACHE_NAMES",
    "EVICTION_NAMES",
    "FAMILIES",
    "INT_RESIDUAL",
    "CacheInfo",
    "cache_factory",
    "cache_info",
    "check_names",
    "fp16_bytes",
    "make_cache",
    "reference_name",
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

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
}


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
        options: the constructor options that make this variant (empty for the defaults).
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

    def factory(self, config: Any, **options: Any) -> Callable[[], Any]:
        """A zero-argument function returning a fresh cache of this kind for ``config`` (the
        model's transformers config); ``options`` override this variant's own."""
        if self.family == "evict":
            return _eviction_factory(self, config, None, **options)
        if self.family == "kvtc":
            return _kvtc_factory(self, None, **options)
        merged = {**self.options, **options}
        if self.family == "dynamic":
            if merged:
                raise ValueError(f"{self.name!r} takes no options (got {sorted(merged)})")
            return lambda: compat.dynamic_cache(config)
        if self.family == "kvlib":
            return lambda: kvcache.QuantizedKVCache(config, bits=self.bits, **merged)
        if self.family == "paged":
            missing = [k for k in self.requires if k not in merged]
            if missing:
                raise ValueError(f"{self.name!r} needs {missing[0]}= (the size of its pool)")
            paged.PagedCache(config, **merged)  # bad options fail here, not at first use
            return lambda: paged.PagedCache(config, **merged)
        if self.family == "turboquant":
            turboquant.TurboQuantCache(config, **merged)  # bad options fail here, not at first use
            return lambda: turboquant.TurboQuantCache(config, **merged)
        if self.family == "kvquant":
            kvquant.KVQuantCache(config, **merged)  # bad options fail here, not at first use
            return lambda: kvquant.KVQuantCache(config, **merged)
        if self.family == "fp8":
            if merged:
                raise ValueError(f"{self.name!r} takes no options (got {sorted(merged)})")
            return lambda: compat.hf_quantized_cache(config, "fp8", sliding_layer=_window)
        return lambda: compat.hf_quantized_cache(
            config, self.family, self.bits, sliding_layer=_window, **merged
        )


def _window(sliding_window: int) -> SlidingWindowLayer:
    """The layer every cache of the registry gives a hybrid model's sliding-window layers:
    the window in float16, as :class:`kvlib.caches.quantized.QuantizedKVCache` keeps it, so that
    transformers' quantized caches and kvlib's differ only on the global layers."""
    return SlidingWindowLayer(sliding_window, fp16_if_wider=True)


def _default(func: Callable[..., Any], parameter: str) -> Any:
    return inspect.signature(func).parameters[parameter].default


def _hf_defaults() -> tuple[int, int, int, int]:
    """(group size, residual tokens, key axis, value axis) of transformers' QuantizedLayer."""
    from transformers.cache_utils import QuantizedLayer

    init = QuantizedLayer.__init__
    return (
        _default(init, "q_group_size"),
        _default(init, "residual_length"),
        _default(init, "axis_key"),
        _default(init, "axis_value"),
    )


#: The float16 window (and key block) of the ``kvlib-int*-w64`` caches, in tokens: at 4096
#: tokens its float16 values take 64 × 16 / 4096 = 0.25 bit per cached value, against 0.5 for
#: the default 128; the key groups double to the block, which saves as much again at 3 bits.
SHORT_WINDOW = 64


def _kvlib_entries() -> list[CacheInfo]:
    init = kvcache.QuantizedKVCache.__init__
    residual = _default(init, "residual_length")
    sinks = _default(init, "sink_tokens")
    window = residual + sinks
    values = cache_layout.DEFAULT_VALUE_GROUP_CHANNELS
    out = []
    for bits in (8, 4, 3, 2):
        keys = kvcache.default_key_group_size(bits, residual)
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
                    f"kvlib int{bits}, one key group per {residual}-token block, value groups "
                    "of 32, no rotation (the KIVI layout)",
                    MappingProxyType(block),
                )
            )
    return out


def _hf_entries() -> list[CacheInfo]:
    group, residual, axis_key, axis_value = _hf_defaults()
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
                f"transformers QuantizedCache, HQQ int{bits}, axes 1/1 (HQQ's recommended "
                f"axis), groups of {group}, {residual}-token window",
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
            torch.finfo(dtype).bits,
            None,
            0,
            f"transformers DynamicCache holding {short} (the reference)",
        )
        for dtype, short in _DTYPE_NAMES.items()
    ]


#: The memory prediction's group for TurboQuant: its per-vector metadata (a key's norm, a
#: value's scale and zero point) counted as one fp16 scale and zero point per 64 values, an upper
#: bound for any head_dim of 64 or more (the ``bits`` are the wider of keys and values).
_TQ_GROUP = 64


def _turboquant_entries() -> list[CacheInfo]:
    """vLLM 0.32's four TurboQuant dtypes as it runs them, and kvlib's layout of the same
    codec (4 sinks and a 128-token window in float16, block-centred keys)."""
    out = []
    for dtype, (key_bits, value_bits) in tq.VLLM_PRESETS.items():
        keys = "float8 keys" if key_bits == 8 else f"{key_bits}-bit codebook keys"
        out.append(
            CacheInfo(
                dtype.replace("_", "-"),
                "turboquant",
                max(key_bits, value_bits),
                _TQ_GROUP,
                0,
                f"vLLM's {dtype}: {keys}, {value_bits}-bit per-token values, every token "
                f"encoded on arrival, first and last {turboquant.BOUNDARY_LAYERS} layers of a "
                "dense model in the model's dtype",
                MappingProxyType({"key_bits": key_bits, "value_bits": value_bits}),
            )
        )
    init = kvcache.QuantizedKVCache.__init__
    residual, sinks = _default(init, "residual_length"), _default(init, "sink_tokens")
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
    init = kvquant.KVQuantCache.__init__
    residual, sinks = _default(init, "residual_length"), _default(init, "sink_tokens")
    share = _default(init, "outlier_fraction")
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
    for policy, scorer in eviction.POLICIES.items():
        line = scorer.description
        out.append(
            CacheInfo(
                f"evict-{policy}",
                "evict",
                16,
                None,
                0,
                f"{line}; float16 keys and values",
                MappingProxyType({"dtype": torch.float16}),
                policy=policy,
            )
        )
        out.append(
            CacheInfo(
                f"evict-{policy}-int4",
                "evict",
                4,
                eviction_layer.GROUP_SIZE,
                INT_RESIDUAL,
                f"{line}; kept tokens in int4 (per token, {eviction_layer.GROUP_SIZE} channels per "
                f"scale), the newest {INT_RESIDUAL} in float16",
                MappingProxyType({"dtype": torch.float16, "bits": 4, "residual": INT_RESIDUAL}),
                policy=policy,
            )
        )
    return out


def fp16_bytes(config: Any, tokens: int) -> int:
    """Bytes of an fp16 ``DynamicCache`` holding ``tokens`` tokens of one sequence of a model
    with this transformers ``config`` (sliding-window layers count their window at most, as
    :func:`kvlib.memory.kv_cache_bytes` prices them): what a budget's fraction is a fraction of.

    Raises:
        TypeError / ValueError: not a transformers config, or ``tokens`` not an int >= 1.
    """
    if not hasattr(config, "get_text_config"):
        raise TypeError(f"config must be a transformers config (got {type(config).__name__})")
    check_int(tokens, "tokens", minimum=1)
    return memory.kv_cache_bytes(spec_from_config(config.get_text_config(decoder=True)), tokens)


def _eviction_factory(
    info: CacheInfo,
    config: Any,
    share: Fraction | None,
    *,
    tokens: int | None = None,
    **options: Any,
) -> Callable[[], Any]:
    merged = {**info.options, **options}
    if share is not None:
        if tokens is None:
            raise ValueError(
                f"{info.name}@{share} keeps {share} of the fp16 bytes of the tokens it will "
                "hold: pass tokens=<that many>"
            )
        if "budget" in merged or "max_bytes" in merged:
            raise ValueError(
                f"{info.name}@{share} already has a budget: pass budget=/max_bytes= to the "
                "bare name instead"
            )
        merged["max_bytes"] = fp16_bytes(config, tokens) * share.numerator // share.denominator
    elif tokens is not None:
        raise ValueError(f"tokens= sets a fractional budget: name it, as in {info.name}@1/4")
    tokens_budget = merged.pop("budget", None)
    eviction.EvictionCache(config, info.policy, tokens_budget, **merged)  # bad options fail here
    return lambda: eviction.EvictionCache(config, info.policy, tokens_budget, **merged)


# ------------------------------------------------------------- transform coding (stored)


#: Share of a ``kvtc@<share>`` budget that the codes are sized for: entropy coding lands them at
#: 0.9-1.0 of the bits the allocation spends (notebook 06), so aiming at 95 % keeps the stored
#: bytes within the budget.
KVTC_AIM = 0.95


def _kvtc_factory(
    info: CacheInfo,
    share: Fraction | None,
    *,
    basis: Any = None,
    tokens: int | None = None,
    **options: Any,
) -> Callable[[], Any]:
    """A codec whose stored bytes for ``tokens`` tokens aim at ``KVTC_AIM · share`` of fp16's:
    the float16 window's share is paid first and the codes get the rest. An aim, not a bound:
    where the window takes most of the budget, the codes can land a few per cent over."""
    merged = {**info.options, **options}
    if basis is None:
        raise ValueError(f"{info.name!r} needs basis= (a kvlib.kvtc.pca.KVPCABasis of the model)")
    if share is not None:
        if tokens is None:
            raise ValueError(
                f"{info.name}@{share} stores {share} of the fp16 bytes of the tokens it will "
                "hold: pass tokens=<that many>"
            )
        if "compression" in merged:
            raise ValueError(
                f"{info.name}@{share} already has a budget: pass compression= to the bare name"
            )
        check_int(tokens, "tokens", minimum=1)
        window = (merged["sink_tokens"] + merged["recent_tokens"]) / tokens
        aim = KVTC_AIM * share.numerator / share.denominator
        if aim <= window:
            raise ValueError(
                f"{info.name}@{share}: the float16 window alone ({window:.3f} of the fp16 bytes "
                f"at {tokens} tokens) takes the whole budget; pass more tokens or a larger share"
            )
        merged["compression"] = (1 - window) / (aim - window)
    elif tokens is not None:
        raise ValueError(f"tokens= sets a fractional budget: name it, as in {info.name}@1/4")
    kvtc.KVTCCodec(basis, **merged)  # bad options fail here, not at first use
    return lambda: kvtc.KVTCCodec(basis, **merged)


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

_ENTRIES: dict[str, CacheInfo] = {
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
CACHE_NAMES: tuple[str, ...] = tuple(_ENTRIES)

#: The eviction caches' names: ``evict-<policy>`` (float16) and ``evict-<policy>-int4``.
EVICTION_NAMES: tuple[str, ...] = tuple(n for n, e in _ENTRIES.items() if e.family == "evict")


def _split(name: Any) -> tuple[CacheInfo, Fraction | None]:
    """``name`` (``"kvlib-int4"``, ``"evict-h2o-int4@1/4"``) as its entry and its budget."""
    if not isinstance(name, str):
        raise TypeError(f"cache name must be a str (got {type(name).__name__})")
    try:
        key = RowKey.parse(name)
    except ValueError as e:
        raise ValueError(
            f"bad cache name {name!r} ({e}); accepted: {', '.join(CACHE_NAMES)}, the evict-* "
            "names with a budget as in evict-h2o@1/4"
        ) from None
    if key.cache not in _ENTRIES:
        raise ValueError(f"unknown cache {name!r}; accepted: {', '.join(CACHE_NAMES)}")
    info = _ENTRIES[key.cache]
    if key.budget is not None and not info.budgeted:
        raise ValueError(f"cache {key.cache!r} takes no budget (got {name!r})")
    return info, key.budget


def cache_info(name: str) -> CacheInfo:
    """What ``name`` means: one of :data:`CACHE_NAMES`, with a budget where the cache takes one
    (``"evict-h2o-int4@1/4"`` means ``evict-h2o-int4``).

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: an unknown name (the message lists the known ones), or a budget on a cache
            that takes none.
    """
    return _split(name)[0]


def check_names(names: Any) -> list[str]:
    """``names`` as a list of registry names.

    Raises:
        TypeError: not a non-empty sequence of strings (a lone string is refused).
        ValueError: an unknown name.
    """
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise TypeError(f"caches must be a non-empty list of cache names (got {names!r})")
    for name in names:
        cache_info(name)
    return list(names)


def reference_name(dtype: torch.dtype) -> str:
    """The reference DynamicCache's name for a model computing in ``dtype``.

    Raises:
        ValueError: not fp32, fp16 or bf16.
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"no reference cache for dtype {dtype} (fp32, fp16 or bf16)")
    return f"dynamic-{_DTYPE_NAMES[dtype]}"


def cache_factory(name: str, config: Any, **options: Any) -> Callable[[], Any]:
    """A zero-argument function returning a fresh cache called ``name`` for ``config``.

    Args:
        name: one of :data:`CACHE_NAMES`; an eviction cache with its budget as a share of the
            fp16 bytes, ``"evict-h2o-int4@1/4"`` (then pass ``tokens``), or bare with
            ``budget=`` (tokens per layer and KV head) or ``max_bytes=`` (per sequence).
        config: the model's transformers config (``model.config``).
        **options: constructor options on top of the variant's own (e.g.
            ``residual_length=64`` for kvlib; ``q_group_size`` for quanto/HQQ; ``tokens``,
            ``budget``, ``max_bytes``, ``sinks``, ``window`` for eviction).

    Raises:
        ValueError / TypeError: unknown name, options for a cache that takes none, a missing or
            doubled budget (checked here, not at first use).
    """
    info, budget = _split(name)
    if info.family == "evict":
        return _eviction_factory(info, config, budget, **options)
    if info.family == "kvtc":
        return _kvtc_factory(info, budget, **options)
    return info.factory(config, **options)


def make_cache(name: str, config: Any, **options: Any) -> Any:
    """One fresh cache called ``name`` (see :func:`cache_factory`)."""
    return cache_factory(name, config, **options)()
