"""What would fit a request the planner cannot fully serve (notebook 09).

:func:`kvlib.plan.planner.recommend` calls :func:`fallbacks` for a plan whose status is ``"reduced"`` or
``"impossible"``; :func:`kvlib.plan.suggestions.suggestions` puts the answer into words. Each
change — a shorter context, the next quality level, lower-bit weights, more GPUs, both, or more
memory — is tried alone with :mod:`kvlib.plan.rule`'s own rule, keeping the rest of the request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvlib.memory import GIB
from kvlib.plan.budget import HEADROOM_FRACTION, context_that_fits, kv_sequence_bytes, valid_tp
from kvlib.plan.engines import LEVELS
from kvlib.plan.rule import (
    QUALITIES,
    QUALITY_LADDER,
    TP_CANDIDATES,
    WEIGHT_BITS,
    Decision,
    decide,
    engine_candidates,
    kv_types,
)

__all__ = ["Fallbacks", "Fit", "fallbacks", "lower_weight_bits_upgrade"]


@dataclass(frozen=True)
class Fit:
    """What a changed request gets when all of it fits: the engine, the precision level
    (``"int4"``) and that engine's KV type at it (``"q4_0"``; ``"fp16"`` for the 16-bit ones),
    as the planner would choose them for that request."""

    engine: str
    setting: str
    kv_type: str

    def __str__(self) -> str:
        return f"{self.kv_type} on {self.engine}"


@dataclass(frozen=True)
class Fallbacks:
    """What would fit a request that does not (status ``"reduced"`` or ``"impossible"``).

    Each change is tried alone, keeping the rest of the request; a field is None when that change
    does not make the whole request fit (or was not tried). Each ``(value, fit)`` pair names the
    engine, level and KV type the changed request would get (:class:`Fit`): the planner's own
    decision for it, with the same measurements and typical context.

    Attributes:
        context_len: the longest context at which all ``concurrency`` sequences fit at the lowest
            allowed setting, capped at the model's ``max_position_embeddings`` when known (0:
            none).
        quality: the next quality level, when it fits the whole request.
        weight_bits: the highest lower weight precision that fits the whole request.
        num_gpus: the fewest GPUs of :data:`TP_CANDIDATES` (more than now) that fit; only tried
            on a GPU with memory.
        num_gpus_and_weight_bits: ``(num_gpus, weight_bits, fit)``: the fewest GPUs that fit
            with lower-bit weights; only tried when lower weight bits alone do not fit.
        memory_gib: device memory (GiB) the whole request needs at the lowest setting the
            quality allows, on the engine (of those the traffic calls for) that needs the least.
        memory_fit: that engine, setting and type.
    """

    context_len: int
    quality: tuple[str, Fit] | None = None
    weight_bits: tuple[int, Fit] | None = None
    num_gpus: tuple[int, Fit] | None = None
    num_gpus_and_weight_bits: tuple[int, int, Fit] | None = None
    memory_gib: float = 0.0
    memory_fit: Fit | None = None


def _whole_request_on(
    d: Decision,
    results: Mapping[str, Any] | None = None,
    *,
    quality: str | None = None,
    weight_bits: int | None = None,
    tp: int | None = None,
) -> Fit | None:
    """What the request of ``d`` gets with one or two of its values changed, if all of it then
    fits: the rule's own decision (:func:`kvlib.plan.rule.decide`) for the changed request, with
    ``results`` and ``d``'s typical context; else None (also where the engines the request
    allows cannot serve the change: more GPUs for transformers)."""
    if not engine_candidates(d.device, d.concurrency, tp or d.tensor_parallel_size, d.engines):
        return None
    try:
        changed = _decide_changed(d, results, quality, weight_bits, tp)
    except ValueError:  # the allowed engines cannot run the changed weights on this GPU
        return None
    if changed.status != "ok" or changed.kv is None or changed.kv_type is None:
        return None
    kv_type = "fp16" if changed.kv == "fp16" else changed.kv_type
    return Fit(changed.engine, changed.kv, kv_type)


def _decide_changed(
    d: Decision,
    results: Mapping[str, Any] | None,
    quality: str | None,
    weight_bits: int | None,
    tp: int | None,
) -> Decision:
    """The rule's decision for the request of ``d`` with the given values changed."""
    return decide(
        d.spec,
        d.gpu_memory_gb,
        d.context_len,
        d.concurrency,
        quality or d.quality,
        weight_bits or d.weight_bits,
        tp or d.tensor_parallel_size,
        device=d.device,
        results=results,
        typical_context=d.typical_context,
        allowed=d.engines,
        compute_capability=d.budget.compute_capability,
    )


def lower_weight_bits_upgrade(d: Decision) -> tuple[int, str, str] | None:
    """For a plan that fits only with a KV cache below 8 bits: ``(weight_bits, engine,
    setting)`` with the highest lower weight precision at which the whole request fits at a
    higher KV level (a serving engineer quantizes the weights to 8 bits before the cache to 4),
    else None."""
    if not d.fits or d.kv not in ("int4", "int2"):
        return None
    order = list(LEVELS)
    for wb in (b for b in WEIGHT_BITS if b < d.weight_bits):
        found = _whole_request_on(d, weight_bits=wb)
        if found and order.index(found.setting) < order.index(d.kv):
            return wb, found.engine, found.setting
    return None


def fallbacks(d: Decision, results: Mapping[str, Any] | None = None) -> Fallbacks:
    """What would fit the request of ``d``: a shorter context, the next quality level, lower
    weight bits, more GPUs, both, or more memory (see :class:`Fallbacks`). ``results`` are the
    measurements the plan cites, so that a changed request gets the KV type its own plan would."""
    lowest = d.lowest_setting
    tp = d.tensor_parallel_size
    by_quality = by_bits = by_gpus = by_both = None
    if d.quality != QUALITIES[-1]:
        nxt = QUALITIES[QUALITIES.index(d.quality) + 1]
        fit = _whole_request_on(d, results, quality=nxt)
        by_quality = (nxt, fit) if fit else None
    lower_bits = [b for b in WEIGHT_BITS if b < d.weight_bits]
    for wb in lower_bits:
        if fit := _whole_request_on(d, results, weight_bits=wb):
            by_bits = (wb, fit)
            break
    if d.device == "gpu" and d.gpu_memory_gb > 0:
        more_gpus = [n for n in TP_CANDIDATES if n > tp and valid_tp(d.spec, n)]
        for n in more_gpus:
            if fit := _whole_request_on(d, results, tp=n):
                by_gpus = (n, fit)
                break
        both = [(n, wb) for n in more_gpus for wb in reversed(lower_bits)] if not by_bits else []
        for n, wb in both:
            if fit := _whole_request_on(d, results, tp=n, weight_bits=wb):
                by_both = (n, wb, fit)
                break
    store = (
        d.types_by_setting.get(lowest)
        or kv_types(d.engine, d.spec, d.device, d.budget.compute_capability)[lowest]
    ).storage
    need, memory_fit = _least_memory(d)
    shorter = context_that_fits(d.spec, d.budget.kv_budget_bytes, d.concurrency, store, tp)
    if d.spec.max_position_embeddings:  # memory may allow more than the model was trained on
        shorter = min(shorter, d.spec.max_position_embeddings)
    return Fallbacks(
        context_len=shorter,
        quality=by_quality,
        weight_bits=by_bits,
        num_gpus=by_gpus,
        num_gpus_and_weight_bits=by_both,
        memory_gib=need / (1 - HEADROOM_FRACTION[d.device]) / GIB,
        memory_fit=memory_fit,
    )


def _least_memory(d: Decision) -> tuple[int, Fit]:
    """Bytes per device the whole request of ``d`` needs (weights, runtime, every sequence's
    cache) at each candidate engine's lowest setting that ``d.quality`` allows, the least of
    them, and that engine's :class:`Fit` (the earlier engine on a tie)."""
    best: tuple[int, Fit] | None = None
    tp = d.tensor_parallel_size
    for engine in engine_candidates(d.device, d.concurrency, tp, d.engines):
        if engine not in d.options:  # it cannot run the request's weights on this GPU
            continue
        types = kv_types(engine, d.spec, d.device, d.budget.compute_capability)
        level = [n for n in QUALITY_LADDER[d.quality] if n in types][-1]
        t = d.types_by_setting[level] if engine == d.engine else types[level]
        per_seq = kv_sequence_bytes(d.spec, d.context_len, t.storage, tp)
        need = d.budget.weights_bytes + d.budget.overhead_bytes + per_seq * d.concurrency
        if best is None or need < best[0]:
            best = (need, Fit(engine, level, "fp16" if level == "fp16" else t.name))
    assert best is not None  # the request's engines were checked to serve it
    return best
