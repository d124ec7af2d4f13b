"""One decoder layer of :class:`~kvlib.caches.eviction.cache.EvictionCache` (notebook 11).

:class:`EvictionLayer` keeps at most ``budget`` tokens per KV head, in float or quantized per
token, with their positions and the policy's scores, and evicts down to the budget at the end
of every forward pass (the cache's module docstring, :mod:`kvlib.caches.eviction.cache`, says
what it holds and why the positions it reports are those seen). The policies it runs are
looked up by name in :data:`POLICIES`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvlib.caches.base import (
    BatchRows,
    check_states,
    fp16_layer_nbytes,
    held_nbytes,
    row_indices,
    select_rows,
)
from kvlib.caches.eviction import scores as es
from kvlib.caches.eviction.h2o import H2O
from kvlib.caches.eviction.knorm import KNorm
from kvlib.caches.eviction.policy import Observation, Policy
from kvlib.caches.eviction.snapkv import SnapKV
from kvlib.caches.eviction.streaming import StreamingLLM
from kvlib.caches.eviction.tova import TOVA
from kvlib.caches.eviction_settings import GROUP_SIZE
from kvlib.caches.quantized import default_group_size
from kvlib.quant.rotation import rotate, unrotate
from kvlib.quant.tensor import QuantizedTensor, quantize
from kvlib.validate import check_bits, check_int

__all__ = ["GROUP_SIZE", "POLICIES", "EvictionLayer", "check_policy", "default_group"]

#: Eviction policies by name, one module and one :class:`~kvlib.caches.eviction.policy.Policy`
#: each, in the order of :data:`kvlib.caches.eviction_settings.POLICY_LINES` (the registry's).
POLICIES: dict[str, Policy] = {
    p.name: p for p in (StreamingLLM(), SnapKV(), H2O(), TOVA(), KNorm())
}


#: What a layer stores, batch first: float keys and values (or the float residual and the
#: per-token QuantizedTensors), positions and scores; unused ones are ``None``.
_HELD = ("keys", "values", "rkeys", "rvalues", "positions", "scores", "qkeys", "qvalues")


def check_policy(policy: Any) -> str:
    """``policy`` as a name of :data:`POLICIES`."""
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a str (got {type(policy).__name__})")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; accepted: {', '.join(POLICIES)}")
    return policy


def default_group(head_dim: int) -> int:
    """Channels per scale of a quantized kept token: the largest divisor of ``head_dim`` up to
    :data:`GROUP_SIZE`."""
    return default_group_size(head_dim, GROUP_SIZE)


def _gather_rows(q: QuantizedTensor, index: torch.Tensor) -> QuantizedTensor:
    """Rows ``index`` ``(batch, kv_heads, k)`` of a per-token QuantizedTensor laid out with
    rows ``(batch, kv_heads, n)``: codes and metadata move together, nothing re-quantized."""

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        idx = index.view(*index.shape, *([1] * (t.dim() - 3))).expand(*index.shape, *t.shape[3:])
        return t.gather(2, idx.to(t.device))

    shape = (*q.shape[:2], index.shape[2], *q.shape[3:])
    return dataclasses.replace(
        q,
        packed=pick(q.packed).contiguous(),
        scale=pick(q.scale),
        offset=pick(q.offset),
        shape=torch.Size(shape),
    )


class EvictionLayer(BatchRows, CacheLayerMixin):
    """One decoder layer of :class:`~kvlib.caches.eviction.cache.EvictionCache` (see
    :mod:`kvlib.caches.eviction.cache`).

    State after ``seen`` tokens, ``n = min(seen, budget)``: ``keys``/``values``
    ``(batch, kv_heads, n, head_dim)`` in ``dtype`` (or ``qkeys``/``qvalues``, per-token
    QuantizedTensors with rows ``(batch, kv_heads, n)``), ``positions`` ``(batch, kv_heads, n)``
    int32 (increasing along ``n``), ``scores`` ``(batch, kv_heads, n)`` float32 for ``h2o`` and
    ``snapkv``.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        policy: str,
        budget: int,
        *,
        sinks: int | None = None,
        window: int | None = None,
        bits: int | None = None,
        residual: int = 0,
        dtype: torch.dtype | None = None,
        group_size: int | None = None,
        rotation: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.policy = check_policy(policy)
        self.scorer = POLICIES[policy]
        self.needs_queries, self.keeps_scores = self.scorer.needs_queries, self.scorer.keeps_scores
        self.budget = check_int(budget, "budget", minimum=1)
        self.sinks = (
            self.scorer.default_sinks if sinks is None else check_int(sinks, "sinks", minimum=0)
        )
        if self.sinks >= self.budget:
            raise ValueError(
                f"budget must exceed sinks (got budget {self.budget}, sinks {self.sinks})"
            )
        room = self.budget - self.sinks
        if window is not None:
            window = check_int(window, "window", minimum=0)
        self.window = self.scorer.window(self.budget, self.sinks, window)
        self.bits = None if bits is None else check_bits(bits)
        self.residual = check_int(residual, "residual", minimum=0)
        if self.residual and self.bits is None:
            raise ValueError("residual (tokens kept unquantized) needs bits")
        self.residual = min(self.residual, room // 2)  # at most half the free budget
        self.window = max(self.window, self.residual)  # the float tokens are never evicted
        self.dtype_option, self.group_size, self.rotation = dtype, group_size, rotation
        self.pending: tuple[torch.Tensor, float] | None = None
        self._clear()

    def _clear(self) -> None:
        self.keys = self.values = None
        self.qkeys: QuantizedTensor | None = None
        self.qvalues: QuantizedTensor | None = None
        self.rkeys = self.rvalues = None  # the float residual (quantized storage only)
        self.positions: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        self.seen = 0
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_states(key_states, value_states)
        b, h, _, d = key_states.shape
        self.device, self.model_dtype = key_states.device, key_states.dtype
        self.dtype = self.dtype_option or key_states.dtype
        if self.bits is not None:
            self.group_size = self.group_size or default_group(d)
            if d % self.group_size:
                raise ValueError(f"group_size must divide head_dim {d} (got {self.group_size})")
        self.batch_size, self.num_heads, self.head_dim = b, h, d
        self.positions = torch.zeros((b, h, 0), dtype=torch.int32, device=self.device)
        self.is_initialized = True

    # ------------------------------------------------------------------ storage

    def kept(self) -> int:
        """Tokens kept per KV head."""
        return 0 if self.positions is None else self.positions.shape[2]

    def _quantize(self, x: torch.Tensor, keys: bool) -> QuantizedTensor:
        if keys and self.rotation is not None:
            x = rotate(x, self.rotation)
        q = quantize(x.contiguous(), self.bits, axis=3, group_size=self.group_size)
        return q.with_rows(3)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the kept tokens as attention reads them, ``(batch, kv_heads, n,
        head_dim)`` in the model's dtype (dequantized when ``bits`` is set)."""
        if not self.is_initialized or self.kept() == 0:
            empty = torch.zeros(0)
            if self.is_initialized:
                b, h, d = self.batch_size, self.num_heads, self.head_dim
                empty = torch.zeros((b, h, 0, d), dtype=self.model_dtype, device=self.device)
            return empty, empty
        if self.bits is None:
            return self.keys.to(self.model_dtype), self.values.to(self.model_dtype)
        keys, values = [], []
        if self.qkeys is not None and self.qkeys.shape[2]:
            k = self.qkeys.dequantize(torch.float32)
            if self.rotation is not None:
                k = unrotate(k, self.rotation)
            keys.append(k.to(self.model_dtype))
            values.append(self.qvalues.dequantize(self.model_dtype))
        if self.rkeys is not None:
            keys.append(self.rkeys.to(self.model_dtype))
            values.append(self.rvalues.to(self.model_dtype))
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append the new tokens to the stored ones. Quantized storage keeps the ``residual``
        newest in float and quantizes the tokens that leave it, each once."""
        if self.bits is None:
            k, v = key_states.to(self.dtype), value_states.to(self.dtype)
            self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
            self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
            return
        k, v = key_states, value_states
        if self.residual:
            k, v = k.to(self.dtype), v.to(self.dtype)
            if self.rkeys is not None:
                k, v = torch.cat([self.rkeys, k], dim=2), torch.cat([self.rvalues, v], dim=2)
            out = max(0, k.shape[2] - self.residual)
            self.rkeys, self.rvalues = k[:, :, out:].contiguous(), v[:, :, out:].contiguous()
            k, v = k[:, :, :out], v[:, :, :out]
        if k.shape[2]:
            qk, qv = self._quantize(k, keys=True), self._quantize(v, keys=False)
            self.qkeys = qk if self.qkeys is None else self.qkeys.cat(qk, dim=2)
            self.qvalues = qv if self.qvalues is None else self.qvalues.cat(qv, dim=2)

    def _keep(self, index: torch.Tensor) -> None:
        """Keep tokens ``index`` ``(batch, kv_heads, k)`` of every stored tensor."""
        full = index.unsqueeze(-1).expand(-1, -1, -1, self.head_dim)
        if self.bits is None:
            self.keys = self.keys.gather(2, full).contiguous()
            self.values = self.values.gather(2, full).contiguous()
        else:  # the float residual is the newest and protected: the quantized rows come first
            nq = index.shape[2] - (0 if self.rkeys is None else self.rkeys.shape[2])
            rows = index[:, :, :nq]
            self.qkeys, self.qvalues = (
                _gather_rows(self.qkeys, rows),
                _gather_rows(self.qvalues, rows),
            )
        self.positions = self.positions.gather(2, index).contiguous()
        if self.scores is not None:
            self.scores = self.scores.gather(2, index).contiguous()

    # ------------------------------------------------------------------ scoring

    def set_queries(self, queries: torch.Tensor, scaling: float) -> None:
        """The queries ``(batch, heads, q_len, head_dim)`` (after RoPE) of the forward pass
        about to call :meth:`update`, and the softmax scale (set by :func:`capture_queries`)."""
        self.pending = (queries, float(scaling))

    def _score(self, keys: torch.Tensor, q_len: int) -> torch.Tensor | None:
        """The policy's scores of every token held after this pass (old + new), or None when
        it keeps the previous ones (SnapKV while decoding)."""
        queries = scaling = None
        if self.needs_queries:
            if self.pending is None:
                raise RuntimeError(
                    f"policy {self.policy!r} scores tokens by attention, which needs the model's "
                    "queries: run the model inside "
                    "`with kvlib.caches.eviction.cache.capture_queries(model):`"
                )
            (queries, scaling), self.pending = self.pending, None
            if queries.shape[2] != q_len:
                raise RuntimeError("the captured queries do not match this update's tokens")
        seen = Observation(
            keys, self.positions, q_len, self.seen, self.window, self.scores, queries, scaling
        )
        return self.scorer.score(seen)

    # ------------------------------------------------------------------ CacheLayerMixin API

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the kept past followed by ``key_states``/``value_states``
        ``(batch, kv_heads, q, head_dim)``, then store the new tokens and evict down to
        ``budget``.

        Returns:
            keys, values: ``(batch, kv_heads, n + q, head_dim)``, what this pass attends to.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q_len, d = key_states.shape
        if (b, h, d) != (self.batch_size, self.num_heads, self.head_dim):
            raise ValueError(
                f"key_states must be (batch={self.batch_size}, kv_heads={self.num_heads}, "
                f"seq_len, head_dim={self.head_dim}) (got {tuple(key_states.shape)})"
            )
        past_k, past_v = self.stored()
        keys = torch.cat([past_k, key_states], dim=2) if self.kept() else key_states
        values = torch.cat([past_v, value_states], dim=2) if self.kept() else value_states
        new_pos = torch.arange(self.seen, self.seen + q_len, device=self.device, dtype=torch.int32)
        self.positions = torch.cat([self.positions, new_pos.expand(b, h, q_len)], dim=2)
        self.seen += q_len
        self._store(key_states, value_states)
        scores = self._score(keys, q_len)
        if self.keeps_scores:
            if scores is None:  # SnapKV decoding: new tokens join the protected window
                top = math.inf
                fill = torch.full((b, h, q_len), top, dtype=torch.float32, device=self.device)
                old = self.scores if self.scores is not None else fill[:, :, :0]
                scores = torch.cat([old, fill], dim=2)
            self.scores = scores.float()
        if self.kept() > self.budget:
            index = es.keep_indices(scores, self.positions, self.budget, self.sinks, self.window)
            self._keep(index)
        return keys, values

    def get_seq_length(self) -> int:
        """Tokens SEEN (not kept): the next token's position, which is what transformers
        computes its positions (RoPE) from."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the kept tokens plus the query; the offset places the
        kept tokens before the query's positions, so that all of them are visible."""
        kept = self.kept()
        return kept + query_length, self.seen - kept

    def get_max_length(self) -> int:
        """No maximum length of the sequence (-1): the budget bounds the tokens kept."""
        return -1

    def reset(self) -> None:
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "EvictionCache cannot crop (assisted decoding needs a DynamicCache)"
        )

    def _select_rows(self, rows: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        rows = row_indices(rows, self.device)
        select_rows(self, _HELD, rows)
        self.batch_size = self.positions.shape[0]

    def offload(self) -> None:  # the kept tokens are small; they stay where they are
        pass

    def prefetch(self) -> None:
        pass

    # ------------------------------------------------------------------ bytes

    def nbytes(self) -> int:
        """Exact bytes held: keys and values (codes, scales, zero points), positions, scores."""
        if not self.is_initialized:
            return 0
        return held_nbytes(*(getattr(self, name) for name in _HELD))

    def fp16_nbytes(self) -> int:
        """Bytes an fp16 DynamicCache layer would hold for every token seen."""
        if not self.is_initialized:
            return 0
        return fp16_layer_nbytes(self, self.seen)
