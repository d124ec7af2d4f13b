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
``kvlib-int4-block``          one key group per 128-token block (coarser than KIVI's
                              32-token key groups), value groups of 32, no rotation
``quanto-int4``, ``-int2``    transformers' ``QuantizedCache``, quanto backend, default axes
``hqq-int8`` … ``-int2``      the same with the HQQ backend, default axes (0/0)
``hqq-int4-axis1``            HQQ with axes 1/1 (the axis HQQ's README starts weights at)
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
about a quarter of the fp16 bytes of ``tokens`` tokens; :attr:`CacheInfo.stored`). On a
hybrid model its basis codes the global layers and the codec stores the sliding windows whole,
so the share is of the global layers' fp16 bytes, the windows on top (as ``share_bytes(...,
of="global")`` counts an eviction budget).

Token-eviction caches (:class:`kvlib.caches.eviction.cache.EvictionCache`, notebook 11, family
``evict``) are in the same table; their size is a budget rather than a bit width, given as part
of the name, a share of the fp16 cache's bytes (``evict-h2o-int4@1/4``, with ``tokens=`` the
tokens it will hold), or as ``budget=`` (tokens per layer) or ``max_bytes=``:
``evict-<policy>`` keeps float16 keys and values, ``evict-<policy>-int4`` quantizes the kept
tokens to int4 (:data:`EVICTION_NAMES` lists them). The names are parsed by :mod:`kvlib.keys`,
as the results file's rows are.

Defaults (group sizes, the full-precision window) are read from where the classes read theirs,
never copied — :mod:`kvlib.caches.layout` (kvlib's :class:`~kvlib.caches.quantized.QuantizedKVCache`
and its default functions), :mod:`kvlib.quant.presets`, :mod:`kvlib.caches.eviction_settings` —
so a changed default changes every prediction; transformers' ``QuantizedLayer`` defaults are kept
in :mod:`kvlib.caches.hf_layout`, and a test checks them against its signature. The table
(:mod:`kvlib.caches.entries`) imports no torch; this module, which builds the caches, does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch

from kvlib import compat, memory
from kvlib.caches import kvquant, paged, turboquant
from kvlib.caches import quantized as kvcache
from kvlib.caches.entries import (
    CACHE_NAMES,
    ENTRIES,
    EVICTION_NAMES,
    FAMILIES,
    INT_RESIDUAL,
    KVTC_WINDOW,
    REFERENCE_DTYPES,
    SHORT_WINDOW,
    CacheInfo,
)
from kvlib.caches.eviction import cache as eviction
from kvlib.caches.sliding import SlidingWindowLayer
from kvlib.keys import RowKey
from kvlib.kvtc import codec as kvtc
from kvlib.specs import ModelSpec, spec_from_config
from kvlib.validate import check_int

__all__ = [
    "CACHE_NAMES",
    "EVICTION_NAMES",
    "FAMILIES",
    "INT_RESIDUAL",
    "KVTC_AIM",
    "KVTC_WINDOW",
    "SHORT_WINDOW",
    "CacheInfo",
    "cache_factory",
    "cache_info",
    "check_names",
    "fp16_bytes",
    "make_cache",
    "reference_name",
    "share_bytes",
    "window_fp16_bytes",
]


#: The reference DynamicCache's name (``dynamic-<name>``) for each torch dtype it is named for.
DTYPE_NAMES: dict[torch.dtype, str] = {
    getattr(torch, dtype): short for short, (dtype, _) in REFERENCE_DTYPES.items()
}


def _options(info: CacheInfo, **options: Any) -> dict[str, Any]:
    """``info``'s own options with ``options`` on top, a dtype named in the table (``"float16"``:
    :mod:`kvlib.caches.entries` imports no torch) as the torch dtype."""
    own: Mapping[str, Any] = info.options
    if isinstance(own.get("dtype"), str):
        own = {**own, "dtype": getattr(torch, own["dtype"])}
    return {**own, **options}


def _window(sliding_window: int) -> SlidingWindowLayer:
    """The layer every cache of the registry gives a hybrid model's sliding-window layers:
    the window in float16, as :class:`kvlib.caches.quantized.QuantizedKVCache` keeps it, so that
    transformers' quantized caches and kvlib's differ only on the global layers."""
    return SlidingWindowLayer(sliding_window, fp16_if_wider=True)


def _build(info: CacheInfo, config: Any, **options: Any) -> Callable[[], Any]:
    """A zero-argument function returning a fresh cache of the kind ``info`` names for
    ``config`` (the model's transformers config); ``options`` override the variant's own."""
    if info.family == "evict":
        return _eviction_factory(info, config, None, **options)
    if info.family == "kvtc":
        return _kvtc_factory(info, None, **options)
    merged = _options(info, **options)
    if info.family == "dynamic":
        if merged:
            raise ValueError(f"{info.name!r} takes no options (got {sorted(merged)})")
        return lambda: compat.dynamic_cache(config)
    if info.family == "kvlib":
        return lambda: kvcache.QuantizedKVCache(config, bits=info.bits, **merged)
    if info.family == "paged":
        missing = [k for k in info.requires if k not in merged]
        if missing:
            raise ValueError(f"{info.name!r} needs {missing[0]}= (the size of its pool)")
        paged.PagedCache(config, **merged)  # bad options fail here, not at first use
        return lambda: paged.PagedCache(config, **merged)
    if info.family == "turboquant":
        turboquant.TurboQuantCache(config, **merged)  # bad options fail here, not at first use
        return lambda: turboquant.TurboQuantCache(config, **merged)
    if info.family == "kvquant":
        kvquant.KVQuantCache(config, **merged)  # bad options fail here, not at first use
        return lambda: kvquant.KVQuantCache(config, **merged)
    if info.family == "fp8":
        if merged:
            raise ValueError(f"{info.name!r} takes no options (got {sorted(merged)})")
        return lambda: compat.hf_quantized_cache(config, "fp8", sliding_layer=_window)
    return lambda: compat.hf_quantized_cache(
        config, info.family, info.bits, sliding_layer=_window, **merged
    )


def _text_spec(config: Any, tokens: int) -> ModelSpec:
    """The spec of a transformers ``config``'s text model, after checking ``tokens`` >= 1."""
    if not hasattr(config, "get_text_config"):
        raise TypeError(f"config must be a transformers config (got {type(config).__name__})")
    check_int(tokens, "tokens", minimum=1)
    return spec_from_config(config.get_text_config(decoder=True))


def fp16_bytes(config: Any, tokens: int) -> int:
    """Bytes of an fp16 ``DynamicCache`` holding ``tokens`` tokens of one sequence of a model
    with this transformers ``config`` (sliding-window layers count their window at most, as
    :func:`kvlib.memory.kv_cache_bytes` prices them): what a budget's fraction is a fraction of.

    Raises:
        TypeError / ValueError: not a transformers config, or ``tokens`` not an int >= 1.
    """
    return memory.kv_cache_bytes(_text_spec(config, tokens), tokens)


def share_bytes(config: Any, tokens: int, share: Fraction, *, of: str = "cache") -> int:
    """The bytes of a budget of ``share`` (``Fraction(1, 4)``) of an fp16 cache of ``tokens``
    tokens of one sequence.

    ``of="cache"`` is what a budgeted name means (``evict-h2o@1/4``): ``share`` of
    :func:`fp16_bytes`. ``of="global"`` is a budget over the full-attention layers: the
    sliding-window layers' fp16 windows whole (they hold what the model reads anyway, and
    :class:`~kvlib.caches.eviction.cache.EvictionCache` sets them aside first), plus ``share`` of
    the full layers' fp16 bytes. On a hybrid model a share of the whole cache can be smaller
    than its windows (Gemma 3 270M at 2,048 tokens: the windows are 56 % of the fp16 cache, so
    no eviction cache can keep a half of it); on a model with no sliding layers the two are
    equal.

    Raises:
        TypeError / ValueError: not a transformers config, ``tokens`` not an int >= 1, a share
            that is not a Fraction in (0, 1], or ``of`` not ``"cache"`` / ``"global"``.
    """
    if not isinstance(share, Fraction) or not 0 < share <= 1:
        raise ValueError(f"share must be a Fraction in (0, 1] (got {share!r})")
    if of not in ("cache", "global"):
        raise ValueError(f"of must be 'cache' or 'global' (got {of!r})")
    whole = fp16_bytes(config, tokens)
    windows = window_fp16_bytes(config, tokens) if of == "global" else 0
    return memory.budget_bytes(whole, share, windows)


def window_fp16_bytes(config: Any, tokens: int) -> int:
    """The part of :func:`fp16_bytes` that the sliding-window layers hold (their last
    ``min(tokens, sliding_window)`` tokens each; 0 on a model with no sliding layers;
    :func:`kvlib.memory.window_bytes`). The rest, ``fp16_bytes(config, tokens) -
    window_fp16_bytes(config, tokens)``, is the full-attention layers' share, which grows with
    the context.

    Raises:
        TypeError / ValueError: not a transformers config, or ``tokens`` not an int >= 1.
    """
    return memory.window_bytes(_text_spec(config, tokens), tokens)


def _eviction_factory(
    info: CacheInfo,
    config: Any,
    share: Fraction | None,
    *,
    tokens: int | None = None,
    **options: Any,
) -> Callable[[], Any]:
    merged = _options(info, **options)
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
        merged["max_bytes"] = share_bytes(config, tokens, share)
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
    merged = _options(info, **options)
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
    if key.cache not in ENTRIES:
        raise ValueError(f"unknown cache {name!r}; accepted: {', '.join(CACHE_NAMES)}")
    info = ENTRIES[key.cache]
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
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"no reference cache for dtype {dtype} (fp32, fp16 or bf16)")
    return f"dynamic-{DTYPE_NAMES[dtype]}"


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
    return _build(info, config, **options)


def make_cache(name: str, config: Any, **options: Any) -> Any:
    """One fresh cache called ``name`` (see :func:`cache_factory`)."""
    return cache_factory(name, config, **options)()
