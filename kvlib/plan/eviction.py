"""The planner's fourth family in numbers: would token eviction hold a request that does not fit?

Introduced in notebook 09 (eviction itself is notebook 11's, :mod:`kvlib.caches.eviction.cache`).
Quantization stores every token in fewer bits; eviction keeps fewer tokens, within a byte budget
per sequence. The planner never chooses eviction as a plan's setting: it keeps perplexity close
while it loses facts far back (``benchmarks/bench_eviction.py``'s pass-key retrieval drops), so
:func:`kvlib.plan.rule.decide` only records, as :attr:`Decision.eviction
<kvlib.plan.rule.Decision.eviction>`, whether it *would* hold the request, and
:mod:`kvlib.plan.suggestions` says so next to the measured cost. Pure numbers, no prose.

The rule, :func:`eviction_option`: when a plan does not hold every requested sequence (status
``"reduced"`` or ``"impossible"``) although the weights leave a KV budget, the model has
full-attention layers and its cache is not an MLA latent (:func:`evictable`), and the request
runs on one device (transformers with kvlib's cache: one GPU, or the CPU; no tensor
parallelism) — then for each budget 1/k (k in :data:`EVICTION_KEEP`) each sequence keeps
``ceil(fp16 bytes / k)`` bytes, and the option is the largest fraction (the least eviction) at
which every requested sequence fits. What the budget holds — float16 tokens
(``evict-<policy>``), or more tokens in int4 (``evict-<policy>-int4``) — is the same bytes.

On a model that mixes sliding-window and global layers (Gemma 2/3), kvlib's
:class:`~kvlib.caches.eviction.cache.EvictionCache` keeps each sliding layer's window whole in
fp16 and evicts in the global layers only, so the budget is 1/k of the global layers' fp16
bytes plus the windows (``window_bytes``, :func:`kvlib.memory.window_bytes`), as
``benchmarks/bench_eviction.py`` measures it (:func:`kvlib.caches.registry.share_bytes`,
``of="global"``); on a model with no sliding layers that is 1/k of the whole fp16 cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from kvlib import memory
from kvlib.specs import ModelSpec

__all__ = ["EVICTION_ENGINE", "EVICTION_KEEP", "EvictionOption", "eviction_option", "evictable"]

#: Budgets offered, as k of "keep 1/k of the fp16 bytes", least eviction first.
EVICTION_KEEP: tuple[int, ...] = (2, 4, 8, 16)
#: The engine that runs kvlib's eviction caches (``generate()`` with kvlib's cache).
EVICTION_ENGINE = "transformers"


@dataclass(frozen=True)
class EvictionOption:
    """Token eviction that would hold a whole request.

    Attributes:
        keep: k: each sequence keeps 1/k of its global layers' fp16 bytes (of its whole fp16
            cache on a model with no sliding layers).
        sequences: sequences of the full context that fit at that budget (at least the request).
        bytes_per_sequence: the budget of one sequence,
            ``window_bytes + ceil((fp16 bytes - window_bytes) / keep)``.
        engine: the engine that runs it (:data:`EVICTION_ENGINE`).
        window_bytes: the sliding layers' fp16 windows, kept whole, per sequence (0 on a model
            with no sliding layers).
    """

    keep: int
    sequences: int
    bytes_per_sequence: int
    engine: str = EVICTION_ENGINE
    window_bytes: int = 0

    @property
    def fraction(self) -> str:
        """``"1/4"``: the budget as the results file's ``settings.budgets`` spell it."""
        return f"1/{self.keep}"


def evictable(spec: ModelSpec) -> bool:
    """Whether kvlib's eviction caches take ``spec``: some full-attention layers (a model whose
    every layer slides has a bounded cache already), no MLA latent."""
    return spec.num_sliding_layers < spec.num_layers and not spec.is_mla


def eviction_option(
    spec: ModelSpec,
    kv_budget: int,
    fp16_sequence_bytes: int,
    concurrency: int,
    status: str,
    tp: int = 1,
    window_bytes: int = 0,
) -> EvictionOption | None:
    """The largest eviction budget 1/k (k in :data:`EVICTION_KEEP`) at which ``concurrency``
    sequences fit ``kv_budget`` bytes when each keeps ``window_bytes + floor((fp16_sequence_bytes
    - window_bytes) / k)`` (:func:`kvlib.memory.budget_bytes`, the budget the cache keeps; ``window_bytes``: the part of ``fp16_sequence_bytes`` the sliding
    layers' windows hold, kept whole); None when the plan holds them already (``status ==
    "ok"``), the weights leave no budget, the model is not :func:`evictable`, ``tp > 1``, or not
    even the smallest budget holds them.

    Raises:
        ValueError: ``window_bytes`` negative or more than ``fp16_sequence_bytes``.
    """
    if not 0 <= window_bytes <= fp16_sequence_bytes:
        raise ValueError(
            f"window_bytes must be in [0, fp16_sequence_bytes={fp16_sequence_bytes}] "
            f"(got {window_bytes})"
        )
    if status == "ok" or kv_budget <= 0 or tp != 1 or not evictable(spec):
        return None
    for keep in sorted(EVICTION_KEEP):
        # the cache's own budget (at least a byte: a sequence holds something)
        per_sequence = max(
            1, memory.budget_bytes(fp16_sequence_bytes, Fraction(1, keep), window_bytes)
        )
        fits = kv_budget // per_sequence
        if fits >= concurrency:
            return EvictionOption(keep, fits, per_sequence, window_bytes=window_bytes)
    return None
