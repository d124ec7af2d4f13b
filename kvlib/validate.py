"""Argument checks for kvlib's public functions: one message style, one place.

Every public entry point validates its arguments here, so a bad value gives a ``TypeError``
(wrong kind) or ``ValueError`` (right kind, wrong value) that names the argument, instead of
NaN, garbage or a stack trace from deep inside torch.

Bit widths are the one check whose accepted set differs by caller: a *cache* stores codes of
:data:`CODE_BITS` (what :mod:`kvlib.quant.tensor` packs), while the *memory math* also prices
full-precision caches (:data:`PRICED_BITS` adds 16 and 32). Both go through :func:`check_bits`
with their set.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from typing import Any

__all__ = [
    "CODE_BITS",
    "PRICED_BITS",
    "check_bits",
    "check_divisor",
    "check_int",
    "check_number",
]

#: Bit widths kvlib packs into integer codes (:func:`kvlib.quant.packing.pack`).
CODE_BITS: tuple[int, ...] = (2, 3, 4, 8)

#: Bit widths the memory math prices: the codes, 5 (llama.cpp's q5_0/q5_1 caches), 6 (the
#: mean of 8-bit keys and 4-bit values, llama.cpp's ``-ctk q8_0 -ctv q4_0``) and full-precision
#: fp16/bf16 and fp32.
PRICED_BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 8, 16, 32)


def check_int(value: Any, name: str, *, minimum: int | None = None) -> int:
    """``value`` as an ``int`` (numpy integers accepted; bools and floats are not).

    Raises:
        TypeError: not an integer.
        ValueError: below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (got {type(value).__name__} {value!r})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} (got {value})")
    return value


def check_bits(value: Any, name: str = "bits", allowed: Collection[int] = CODE_BITS) -> int:
    """``value`` as a bit width from ``allowed`` (default :data:`CODE_BITS`).

    Raises:
        TypeError: not an integer.
        ValueError: an integer outside ``allowed``.
    """
    accepted = ", ".join(str(b) for b in allowed)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, one of {accepted} (got {value!r})")
    if int(value) not in allowed:
        raise ValueError(f"{name} must be one of {accepted} (got {value})")
    return int(value)


def check_number(value: Any, name: str, *, positive: bool = False) -> float:
    """``value`` as a finite ``float`` (ints accepted; bools, NaN and infinities are not).

    Raises:
        TypeError: not a real number.
        ValueError: not finite, or not > 0 when ``positive``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number (got {type(value).__name__} {value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite (got {value})")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0 (got {value})")
    return value


def check_divisor(value: Any, name: str, length: int, what: str) -> int:
    """``value`` as an int that divides ``length`` (a group size along an axis or a window).

    Raises:
        TypeError: not an int (a bool is refused).
        ValueError: not a positive divisor of ``length``; the message names ``what`` is divided
            and lists the divisors that would do.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None (got {value!r})")
    if value <= 0 or length % value:
        divisors = [d for d in range(1, length + 1) if length % d == 0]
        shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
        raise ValueError(f"{name} must divide {what} (got {value}; accepted: {shown})")
    return value
