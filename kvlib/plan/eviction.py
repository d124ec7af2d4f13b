"""The planner's fourth family in numbers: would token eviction hold a request that does not fit?

Introduced in notebook 09 (eviction itself is notebook 11's, :mod:`kvlib.caches.eviction.cache`).
Quantization stores every token in fewer bits; eviction keeps fewer tokens, within a byte budget
per sequence. The planner never chooses eviction as a plan's setting: it keeps perplexity close
while it loses facts far back (``benchmarks/bench_eviction.py``'s pass-key retrieval drops), so
:func:`kvlib.plan.rule.decide` only records, as :attr:`Decision.eviction
<kvlib.plan.rule.Decision.eviction>`, whether it *would* hold the request, and
:mod:`kvlib.plan.suggestions` says so next to the measured cost. Pure numbers, no prose.

The rule, :func:`eviction_option`: when a plan does not hold every requested sequence (status
``"reduced"`` or ``"impossible"``) although the weights leave a KV budget, the model's layers are
all full attention and its cache is not an MLA latent (kvlib's
:class:`~kvlib.caches.eviction.cache.EvictionCache` takes ``full_attention`` layers only), and the request
runs on one device (transformers with kvlib's cache: one GPU, or the CPU; no tensor
parallelism) — then for each budget 1/k of the fp16 bytes (k in :data:`EVICTION_KEEP`) each
sequence keeps ``ceil(fp16 bytes / k)`` bytes, and the option is the largest fraction (the least
eviction) at which every requested sequence fits. What the budget holds — float16 tokens
(``evict-<policy>``), or more tokens in int4 (``evict-<policy>-int4``) — is the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        keep: k: each sequence keeps 1/k of its fp16 cache bytes.
        sequences: sequences of the full context that fit at that budget (at least the request).
        bytes_per_sequence: the budget of one sequence, ``ceil(fp16 bytes / keep)``.
        engine: the engine that runs it (:data:`EVICTION_ENGINE`).
    """

    keep: int
    sequences: int
    bytes_per_sequence: int
    engine: str = EVICTION_ENGINE

    @property
    def fraction(self) -> str:
        """``"1/4"``: the budget as the results file's ``settings.budgets`` spell it."""
        return f"1/{self.keep}"


def evictable(spec: ModelSpec) -> bool:
    """Whether kvlib's eviction caches take ``spec``: every layer full attention, no MLA latent."""
    return spec.num_sliding_layers == 0 and not spec.is_mla


def eviction_option(
    spec: ModelSpec,
    kv_budget: int,
    fp16_sequence_bytes: int,
    concurrency: int,
    status: str,
    tp: int = 1,
) -> EvictionOption | None:
    """The largest eviction budget 1/k (k in :data:`EVICTION_KEEP`) at which ``concurrency``
    sequences fit ``kv_budget`` bytes when each keeps ``ceil(fp16_sequence_bytes / k)``; None
    when the plan holds them already (``status == "ok"``), the weights leave no budget, the
    model is not :func:`evictable`, ``tp > 1``, or not even the smallest budget holds them."""
    if status == "ok" or kv_budget <= 0 or tp != 1 or not evictable(spec):
        return None
    for keep in sorted(EVICTION_KEEP):
        per_sequence = -(-fp16_sequence_bytes // keep)
        fits = kv_budget // per_sequence
        if fits >= concurrency:
            return EvictionOption(keep, fits, per_sequence)
    return None
