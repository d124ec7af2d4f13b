"""The token-eviction caches' names and numbers, as plain data (no torch).

Each policy's name and one-line description live here (:data:`POLICY_LINES`, in display order):
the policy classes of :mod:`kvlib.caches.eviction` read their ``description`` from this table,
and so does the registry's table (:mod:`kvlib.caches.entries`), which imports no torch. So does
the channels per scale of a quantized kept token (:data:`GROUP_SIZE`), which
:mod:`kvlib.caches.eviction.layer` uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["GROUP_SIZE", "POLICY_LINES"]

#: Each eviction policy's name (as in :data:`kvlib.caches.eviction.cache.POLICIES` and the
#: registry's ``evict-<policy>`` names) and its one line for tables: the method and what it
#: keeps.
POLICY_LINES: Mapping[str, str] = MappingProxyType(
    {
        "streaming": "StreamingLLM: attention sinks plus the most recent tokens",
        "snapkv": "SnapKV: scored once per prefill by the prompt's last queries",
        "h2o": "H2O: accumulated attention (heavy hitters) plus recent tokens",
        "tova": "TOVA: the last query's attention, every step",
        "knorm": "KNorm: lowest key norms",
    }
)

#: The most channels one float16 scale and zero point cover when kept tokens are quantized (each
#: token on its own): the largest divisor of head_dim up to this. Measured at 1/4 of the fp16
#: bytes on 2,048 tokens (RESULTS.md, run "eviction_int4_groups"), groups of 32 cost half the
#: perplexity of groups of 64 (H2O on int4: +0.49 % against +1.00 %) at the same retrieval; at
#: 1/8, where the finer scales' bytes cost tokens, the two are within the noise on retrieval.
GROUP_SIZE = 32
