"""The defaults of kvlib's quantized cache, as plain numbers (notebooks 03 and 04).

:class:`kvlib.caches.quantized.QuantizedKVCache` takes its defaults from here, and so do the registry's
byte predictions (:mod:`kvlib.caches.registry`) and the planner's KV types (:mod:`kvlib.plan.engines`),
so that one change moves all of them. The module needs no torch: the planner imports it.

Measured on the bundled model (``benchmarks/RESULTS.md``, "Choosing the defaults"): 32-token key
groups at <= 4 bits (one group per block at 8 bits, where finer key groups would cost more bytes
than their error is worth), value groups of up to 64 channels, keys rotated at <= 3 bits (at 4
bits rotation did not change the mean perplexity and slows decoding).
"""

from __future__ import annotations

import math

__all__ = [
    "DEFAULT_KEY_GROUP_TOKENS",
    "DEFAULT_VALUE_GROUP_CHANNELS",
    "RESIDUAL_LENGTH",
    "SINK_TOKENS",
    "default_group_size",
    "default_key_group_size",
    "default_rotate",
    "predicted_group_size",
]

#: Tokens per key group (per channel) at 2-4 bits.
DEFAULT_KEY_GROUP_TOKENS = 32
#: Most channels per value group (per token).
DEFAULT_VALUE_GROUP_CHANNELS = 64
#: Newest tokens kept in full precision: a block is quantized when this many have gathered.
RESIDUAL_LENGTH = 128
#: First tokens kept in full precision (attention sinks).
SINK_TOKENS = 4


def default_key_group_size(key_bits: int, residual_length: int) -> int:
    """Tokens per key group when none is given: ``gcd(32, residual_length)`` at 2-4 bits, the
    whole block (``residual_length``) at 8 bits."""
    if key_bits <= 4:
        return math.gcd(DEFAULT_KEY_GROUP_TOKENS, residual_length)
    return residual_length


def default_group_size(head_dim: int, most: int = DEFAULT_VALUE_GROUP_CHANNELS) -> int:
    """Channels per value group when none is given: the largest divisor of ``head_dim`` <=
    ``most`` (64)."""
    return max(g for g in range(1, min(head_dim, most) + 1) if head_dim % g == 0)


def default_rotate(key_bits: int, head_dim: int) -> bool:
    """Rotate keys when ``rotate`` is not given: at 2 and 3 bits, if head_dim is a power of
    two (the Hadamard matrix exists)."""
    return key_bits <= 3 and head_dim > 0 and not head_dim & (head_dim - 1)


def predicted_group_size(bits: int, residual_length: int = RESIDUAL_LENGTH) -> int:
    """Values per scale and zero point that :mod:`kvlib.memory`'s byte formula counts for the
    default cache at ``bits``: the finer of the key and value groups, so the prediction is an
    upper bound (notebook 04 counts the exact bytes)."""
    return min(default_key_group_size(bits, residual_length), DEFAULT_VALUE_GROUP_CHANNELS)
