"""What would fit a request the planner cannot fully serve (notebook 09).

:func:`kvlib.plan.planner.recommend` calls :func:`fallbacks` for a plan whose status is ``"reduced"`` or
``"impossible"``; :func:`kvlib.plan.text.suggestions` puts the answer into words. Each change —
a shorter context, the next quality level, lower-bit weights, more GPUs, both, or more memory —
is tried alone with :mod:`kvlib.plan.rule`'s own rule, keeping the rest of the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlib.memory import GIB
from kvlib.plan.engines import LEVELS
from kvlib.plan.rule import (
    HEADROOM_FRACTION,
    QUALITIES,
    TP_CANDIDATES,
    WEIGHT_BITS,
    Decision,
    choose_setting,
    context_that_fits,
    engine_candidates,
    kv_sequence_bytes,
    kv_types,
    memory_budget,
    sequences_by_level,
    valid_tp,
)

__all__ = ["Fallbacks", "fallbacks", "lower_weight_bits_upgrade"]


@dataclass(frozen=True)
class Fallbacks:
    """What would fit a request that does not (status ``"reduced"`` or ``"impossible"``).

    Each change is tried alone, keeping the rest of the request; a field is None when that change
    does not make the whole request fit (or was not tried). ``(value, setting)`` pairs name the
    setting the changed request would get.

    Attributes:
        context_len: the longest context at which all ``concurrency`` sequences fit at the lowest
            allowed setting, capped at the model's ``max_position_embeddings`` when known (0:
            none).
        quality: the next quality level, when it fits the whole request.
        weight_bits: the highest lower weight precision that fits the whole request.
        num_gpus: the fewest GPUs of :data:`TP_CANDIDATES` (more than now) that fit; only tried
            on a GPU with memory.
        num_gpus_and_weight_bits: ``(num_gpus, weight_bits, setting)``: the fewest GPUs that fit
            with lower-bit weights; only tried when lower weight bits alone do not fit.
        memory_gib: device memory (GiB) the whole request needs at the lowest allowed setting.
    """

    context_len: int
    quality: tuple[str, str] | None = None
    weight_bits: tuple[int, str] | None = None
    num_gpus: tuple[int, str] | None = None
    num_gpus_and_weight_bits: tuple[int, int, str] | None = None
    memory_gib: float = 0.0


def _whole_request_on(
    d: Decision,
    *,
    quality: str | None = None,
    weight_bits: int | None = None,
    tp: int | None = None,
) -> tuple[str, str] | None:
    """``(engine, setting)`` the request of ``d`` gets with one or two of its values changed,
    if all of it then fits (engines in the rule's order for the request); else None."""
    tp = tp or d.tensor_parallel_size
    budget = memory_budget(d.spec, d.device, d.gpu_memory_gb, weight_bits or d.weight_bits, tp)
    q = quality or d.quality
    for engine in engine_candidates(d.device, d.concurrency, tp):
        fits = sequences_by_level(d.spec, budget, d.context_len, tp, engine)
        kv, status = choose_setting(fits, q, d.concurrency)
        if status == "ok":
            return engine, kv
    return None


def _whole_request_with(
    d: Decision,
    *,
    quality: str | None = None,
    weight_bits: int | None = None,
    tp: int | None = None,
) -> str | None:
    """The setting the request of ``d`` gets with one or two of its values changed, if all of
    it then fits; else None."""
    found = _whole_request_on(d, quality=quality, weight_bits=weight_bits, tp=tp)
    return found[1] if found else None


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
        if found and order.index(found[1]) < order.index(d.kv):
            return wb, *found
    return None


def fallbacks(d: Decision) -> Fallbacks:
    """What would fit the request of ``d``: a shorter context, the next quality level, lower
    weight bits, more GPUs, both, or more memory (see :class:`Fallbacks`)."""
    lowest = d.lowest_setting
    tp = d.tensor_parallel_size
    by_quality = by_bits = by_gpus = by_both = None
    if d.quality != QUALITIES[-1]:
        nxt = QUALITIES[QUALITIES.index(d.quality) + 1]
        kv = _whole_request_with(d, quality=nxt)
        by_quality = (nxt, kv) if kv else None
    lower_bits = [b for b in WEIGHT_BITS if b < d.weight_bits]
    for wb in lower_bits:
        if kv := _whole_request_with(d, weight_bits=wb):
            by_bits = (wb, kv)
            break
    if d.device == "gpu" and d.gpu_memory_gb > 0:
        more_gpus = [n for n in TP_CANDIDATES if n > tp and valid_tp(d.spec, n)]
        for n in more_gpus:
            if kv := _whole_request_with(d, tp=n):
                by_gpus = (n, kv)
                break
        both = [(n, wb) for n in more_gpus for wb in reversed(lower_bits)] if not by_bits else []
        for n, wb in both:
            if kv := _whole_request_with(d, tp=n, weight_bits=wb):
                by_both = (n, wb, kv)
                break
    store = (d.types_by_setting.get(lowest) or kv_types(d.engine, d.spec, d.device)[lowest]).storage
    per_seq = kv_sequence_bytes(d.spec, d.context_len, store, tp)
    need = d.budget.weights_bytes + d.budget.overhead_bytes + per_seq * d.concurrency
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
    )
