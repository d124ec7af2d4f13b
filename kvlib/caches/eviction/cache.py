"""Token eviction: a KV cache that keeps at most a budget of tokens per layer (notebook 11).

Quantization stores every token in fewer bits; eviction keeps fewer tokens. :class:`EvictionCache`
is a transformers ``Cache`` made of one :class:`EvictionLayer` (a ``CacheLayerMixin``) per
decoder layer, so ``generate()`` and a chunked forward loop (``kvlib.eval.quality.perplexity``) use
it unchanged. Policies (:data:`POLICIES`, one module each, on :class:`~kvlib.caches.eviction.policy.Policy`):
``streaming`` (StreamingLLM), ``snapkv``, ``h2o``, ``tova`` and ``knorm``.

**What a layer holds.** Between forward passes, at most ``budget`` tokens per KV head
(every head keeps the same number, possibly different tokens), in position order: keys and
values in ``dtype`` (the model's by default; float16 for an fp16 deployment's bytes) or
quantized per token to ``bits`` (kvlib's :class:`~kvlib.quant.tensor.QuantizedTensor`, packed codes
plus float16 scales and zero points, keys Hadamard-rotated below 8 bits) except the ``residual``
most recent tokens, which stay in ``dtype`` until newer ones push them out (KIVI's and
:class:`~kvlib.caches.quantized.QuantizedKVCache`'s full-precision window; they are never evicted), their positions
(int32), and for ``h2o`` and ``snapkv`` their running scores (float32). :meth:`EvictionCache.nbytes`
counts all of it. The tokens of one forward pass are attended to in full in that pass (the
prompt of a prefill included, as SnapKV and kvpress do) and evicted at its end.

**RoPE.** Keys are cached after RoPE: each one already carries the rotation of its own
position, so dropping rows leaves the kept keys correct. What must not shrink is the position
of the *next* query: transformers computes it as ``cache.get_seq_length()``, so a layer reports
the number of tokens **seen**, not kept; :meth:`EvictionLayer.get_mask_sizes` reports the kept
length plus the query, with ``kv_offset = seen - kept`` so that the causal mask still lets
every kept token be seen and keeps the new tokens causal among themselves. (Rotating keys to
new, contiguous positions, as some StreamingLLM code does, is not needed here.) Batch rows must
not be padded.

**Scores need queries.** ``snapkv``, ``h2o`` and ``tova`` score tokens by attention weights,
which a cache does not see. Run the model inside :func:`capture_queries` ``(model)``: a forward
pre-hook on every attention module recomputes the layer's queries (``q_proj``, RoPE, as
transformers' ``LlamaAttention`` does, like kvpress's hooks) and hands them to the cache layer,
which computes the weights from them and the keys it returns. ``streaming`` and ``knorm`` need
no queries.

**Hybrid models** (Gemma 2/3): eviction happens on the ``full_attention`` layers only. A
``sliding_attention`` layer is a :class:`kvlib.caches.sliding.SlidingWindowLayer`: its last
``sliding_window`` tokens in ``dtype`` (the model's by default; not quantized, whatever
``bits``), no policy inside the window, which is already the most recent tokens. ``budget``
and :meth:`EvictionCache.kept` are those of the full layers; ``max_bytes`` first sets aside
the sliding layers' full windows, then gives the rest to the full layers.

Limits: ``full_attention`` and ``sliding_attention`` layers only (Llama-style attention
modules for the query hook: q_proj, an optional q_norm, RoPE), no ``crop`` (assisted
decoding), batch rows without padding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlib import compat
from kvlib.caches.base import ByteCounts
from kvlib.caches.eviction.layer import POLICIES, EvictionLayer, check_policy, default_group
from kvlib.caches.eviction.queries import capture_queries, recorded_queries
from kvlib.caches.sliding import SlidingWindowLayer
from kvlib.quant.rotation import hadamard
from kvlib.specs import kv_geometry
from kvlib.validate import check_bits, check_int

__all__ = [
    "POLICIES",
    "EvictionCache",
    "EvictionLayer",
    "capture_queries",
    "recorded_queries",
    "token_nbytes",
]


def default_window(policy: str, budget: int) -> int:
    """Recent tokens always kept (:meth:`~kvlib.caches.eviction.policy.Policy.default_window`):
    SnapKV's observation window (``SNAPKV_WINDOW``, at most half the budget), half the budget
    for H2O (its heavy/recent split), the last token for TOVA, none for KNorm; StreamingLLM
    keeps ``budget - sinks``."""
    return POLICIES[check_policy(policy)].default_window(budget)


def token_nbytes(
    head_dim: int,
    kv_heads: int,
    policy: str,
    *,
    bits: int | None = None,
    dtype: torch.dtype = torch.float16,
    group_size: int | None = None,
) -> int:
    """Bytes one kept token costs in one layer (all KV heads): keys + values (codes, float16
    scales and zero points when quantized), its int32 position, and a float32 score for the
    policies that keep one."""
    if bits is None:
        kv = 2 * head_dim * torch.finfo(dtype).bits // 8
    else:
        g = default_group(head_dim) if group_size is None else group_size
        kv = 2 * (math.ceil(head_dim * bits / 8) + 2 * 2 * (head_dim // g))
    state = 4 + (4 if POLICIES[check_policy(policy)].keeps_scores else 0)
    return kv_heads * (kv + state)


def _config_dtype(config: Any) -> torch.dtype:
    """The dtype the model computes in, from its config (float32 when it says nothing)."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _budget_for_bytes(
    max_bytes: int,
    windows: list[int | None],
    geo: Any,
    policy: str,
    bits: int | None,
    residual: int,
    store: dict[str, Any],
) -> tuple[int, int]:
    """``(budget, residual)``: the most tokens per full layer and KV head that fit ``max_bytes``
    after the sliding layers' full ``windows``, and the float residual they leave room for.

    Raises:
        ValueError: ``max_bytes`` holds no token in every full layer.
    """
    n_full = windows.count(None)
    # the sliding layers' full windows first (float keys and values, no state)
    width = torch.finfo(store["dtype"]).bits // 8
    window_bytes = sum(2 * geo.num_kv_heads * geo.head_dim * width * w for w in windows if w)
    room = max_bytes - window_bytes
    per = n_full * token_nbytes(geo.head_dim, geo.num_kv_heads, policy, bits=bits, **store)
    if bits is not None and residual:  # float tokens first, at most half the bytes
        float_per = n_full * token_nbytes(geo.head_dim, geo.num_kv_heads, policy, **store)
        residual = min(residual, max(room, 0) // 2 // float_per)
        budget = residual + (room - residual * float_per) // per
    else:
        budget = room // per
    if budget < 1:
        raise ValueError(
            f"max_bytes {max_bytes} holds no token in every layer; accepted: >= "
            f"{window_bytes + per} ({n_full} full layers x {per // n_full} bytes per "
            f"token" + (f", plus {window_bytes} for the sliding windows)" if window_bytes else ")")
        )
    return budget, residual


def _rotates(rotate: bool | None, bits: int | None, head_dim: int) -> bool:
    """Whether keys are Hadamard-rotated (:class:`EvictionCache`'s ``rotate``)."""
    if rotate is not None and not isinstance(rotate, bool):
        raise TypeError(f"rotate must be True, False or None (got {rotate!r})")
    quantized = bits is not None and bits < 8
    power_of_two = not head_dim & (head_dim - 1)
    if rotate and not (quantized and power_of_two):
        raise ValueError(
            f"rotate=True needs bits below 8 and a power-of-two head_dim (bits={bits}, "
            f"head_dim={head_dim})"
        )
    return quantized and power_of_two if rotate is None else rotate


class EvictionCache(ByteCounts, Cache):
    """A transformers cache that keeps at most ``budget`` tokens per layer and KV head.

    Args:
        config: the model's transformers config; every layer must be ``full_attention``
            (evicted) or ``sliding_attention`` (its window kept, see the module docstring),
            at least one of them full.
        policy: one of :data:`POLICIES`.
        budget: tokens kept per full-attention layer and KV head (``>= 1``, ``> sinks``); or give
        max_bytes: the most bytes the whole cache may hold per sequence; the budget is the
            largest that fits (:func:`token_nbytes` per token and layer).
        sinks: first tokens always kept (default 4 for ``streaming``, else 0).
        window: most recent tokens always kept (default :func:`default_window`).
        bits: store keys and values quantized per token to 2, 3, 4 or 8 bits (``None``: in
            ``dtype``); keys are Hadamard-rotated below 8 bits when head_dim is a power of two.
        residual: with ``bits``, the most recent tokens kept in ``dtype`` (never evicted), at
            most half the budget after the sinks (with ``max_bytes``: at most half the bytes,
            paid at float bytes); default 0.
        dtype: storage dtype when not quantized, and of the residual (``None``: the model's).
        group_size: channels per scale when quantized (default: the largest divisor of
            head_dim up to :data:`~kvlib.caches.eviction.layer.GROUP_SIZE`, 32).
        rotate: Hadamard-rotate the keys before quantizing them below 8 bits: ``None`` (the
            default) when head_dim is a power of two, ``False`` never, ``True`` always (a
            power-of-two head_dim and ``bits`` below 8 required). On Gemma 3 270M the rotation
            helps some text and hurts other text (``benchmarks/bench_keys.py``).

    Raises:
        TypeError / ValueError: unknown policy, a budget that is not an int >= 1 (or does not
            exceed ``sinks``), both or neither of ``budget`` and ``max_bytes``, a byte budget
            too small for one token per layer (after the sliding windows), layer types
            other than full and sliding attention, no full-attention layer.
    """

    def __init__(
        self,
        config: Any,
        policy: str,
        budget: int | None = None,
        *,
        max_bytes: int | None = None,
        sinks: int | None = None,
        window: int | None = None,
        bits: int | None = None,
        residual: int = 0,
        dtype: torch.dtype | None = None,
        group_size: int | None = None,
        rotate: bool | None = None,
    ) -> None:
        if not hasattr(config, "get_text_config"):
            raise TypeError(
                f"config must be a transformers PretrainedConfig (got {type(config).__name__})"
            )
        self.policy = check_policy(policy)
        if bits is not None:
            check_bits(bits)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype or None (got {dtype!r})")
        windows = compat.layer_windows(config, "EvictionCache")
        n_full = windows.count(None)
        if not n_full:
            raise ValueError(
                "EvictionCache needs at least one full_attention layer to evict from (every "
                "layer of this config is sliding_attention: a DynamicCache already bounds it)"
            )
        geo = kv_geometry(config.get_text_config(decoder=True))
        if (budget is None) == (max_bytes is None):
            raise ValueError("give exactly one of budget (tokens per layer) and max_bytes")
        residual = check_int(residual, "residual", minimum=0)
        if max_bytes is not None:
            max_bytes = check_int(max_bytes, "max_bytes", minimum=1)
            store = {"dtype": dtype or _config_dtype(config), "group_size": group_size}
            budget, residual = _budget_for_bytes(
                max_bytes, windows, geo, policy, bits, residual, store
            )
        self.budget, self.bits, self.max_bytes = budget, bits, max_bytes
        self.rotation = hadamard(geo.head_dim) if _rotates(rotate, bits, geo.head_dim) else None
        layers: list[CacheLayerMixin] = [
            EvictionLayer(
                policy,
                budget,
                sinks=sinks,
                window=window,
                bits=bits,
                residual=residual,
                dtype=dtype,
                group_size=group_size,
                rotation=self.rotation,
            )
            if sliding_window is None
            else SlidingWindowLayer(sliding_window, dtype)
            for sliding_window in windows
        ]
        self._first_full = windows.index(None)
        super().__init__(layers=layers)

    def __repr__(self) -> str:
        store = f"int{self.bits}" if self.bits else "float"
        return (
            f"EvictionCache(policy={self.policy!r}, budget={self.budget}, storage={store}, "
            f"layers={len(self.layers)}, seen={self.get_seq_length()}, kept={self.kept()})"
        )

    def kept(self) -> int:
        """Tokens kept per KV head in the first full-attention layer (layer 0 unless the
        model has sliding-window layers)."""
        return self.layers[self._first_full].kept()
