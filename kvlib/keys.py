"""Names with a budget, taken apart in one place: the keys of the results file's rows and the
cache names of :mod:`kvlib.caches.registry` (``"evict-h2o-int4@1/4"``).

A row of a run (:mod:`kvlib.results`) is named for the cache it measured, and, where the cache
ran at a budget, for that budget as a share of the fp16 cache's bytes: ``"kvlib-int4"``,
``"evict-h2o-int4@1/4"``, ``"kvtc@1/16"``. :class:`RowKey` is that name as data; its
:meth:`~RowKey.parse` also reads the forms earlier runs and the peers wrote (``"snapkv@0.25"``,
kvpress's ratio; ``"PCA cross-layer, target 16x"``, transform coding's target), so no reader
splits a name by hand. :class:`BestKey` is a key of a run's ``best`` group
(``"1/4 eviction+int4"``: the best row of one family at one budget), and
:class:`RetrievalColumn` a row's retrieval figure (``"retrieval_multi_1024"``).

Torch-free: the planner and the results reader import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = ["BestKey", "RetrievalColumn", "RowKey"]

#: ``"<cache>@<budget>"``: a cache run at a share of the fp16 bytes, as ``1/4`` or ``0.25``.
_AT_BUDGET = re.compile(r"(?P<cache>[^@]+)@(?P<budget>\d+(?:/\d+|\.\d+)?)")
#: ``"<technique>, target <N>x"``: a transform-coding row aiming at N times fewer bytes than fp16.
_TARGET = re.compile(r"(?P<cache>.+), target (?P<ratio>\d+(?:\.\d+)?)x")
#: ``"<budget> <family>"``: a ``best`` group's key, the best row of one family at one budget.
_BEST = re.compile(r"(?P<budget>\d+(?:/\d+)?) (?P<family>\S.*)")


def _budget(text: str, name: str) -> Fraction:
    """``"1/4"`` or ``"0.25"`` as a fraction in (0, 1]; a ``ValueError`` naming ``name`` else."""
    try:
        budget = Fraction(text).limit_denominator(1 << 16)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"row {name!r}: budget {text!r} is not a number") from None
    if not 0 < budget <= 1:
        raise ValueError(f"row {name!r}: budget {text} is not a share of the fp16 bytes in (0, 1]")
    return budget


def _check_key_text(name: Any, what: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str (got {type(name).__name__})")
    if not name or name != name.strip():
        raise ValueError(f"{what} must be non-empty, without surrounding spaces (got {name!r})")
    return name


@dataclass(frozen=True)
class RowKey:
    """A row's name in a run: the cache (a :mod:`kvlib.caches.registry` name where the run is
    keyed by them, else the run's own label) and the budget it ran at, as a share of the fp16
    cache's bytes (``None``: the cache has no budget of its own).

    ``str(key)`` is the canonical name, ``"<cache>@<num>/<den>"``; :meth:`parse` also reads the
    forms older runs and peers wrote (``"snapkv@0.25"``, ``"PCA cross-layer, target 16x"``).
    """

    cache: str
    budget: Fraction | None = None

    def __post_init__(self) -> None:
        _check_key_text(self.cache, "cache name")
        if "@" in self.cache:
            raise ValueError(f"cache name {self.cache!r} holds '@': pass the budget separately")
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, Fraction):
                raise TypeError(
                    f"budget must be a Fraction or None (got {type(self.budget).__name__})"
                )
            if not 0 < self.budget <= 1:
                raise ValueError(f"budget {self.budget} is not a share of the fp16 bytes in (0, 1]")

    @classmethod
    def parse(cls, name: str) -> RowKey:
        """The key of row ``name``: ``"kvlib-int4"``, ``"evict-h2o-int4@1/4"``,
        ``"snapkv@0.25"`` or ``"PCA cross-layer, target 16x"`` (budget 1/16).

        Raises:
            TypeError: ``name`` is not a string.
            ValueError: an empty name, or a budget that is not a number in (0, 1].
        """
        _check_key_text(name, "row name")
        if (m := _AT_BUDGET.fullmatch(name)) is not None:
            return cls(m["cache"], _budget(m["budget"], name))
        if "@" in name:
            raise ValueError(
                f"row {name!r}: expected '<cache>@<budget>' with a budget like 1/4 or 0.25"
            )
        if (m := _TARGET.fullmatch(name)) is not None:
            ratio = Fraction(m["ratio"])
            if ratio < 1:
                raise ValueError(f"row {name!r}: a target under 1x is not a compression")
            return cls(m["cache"], 1 / ratio)
        return cls(name)

    def __str__(self) -> str:
        return self.cache if self.budget is None else f"{self.cache}@{self.budget}"


@dataclass(frozen=True)
class BestKey:
    """A key of a run's ``best`` group: the best row of one ``family`` of caches
    (``"eviction+int4"``) at one ``budget`` (a share of the fp16 bytes)."""

    budget: Fraction
    family: str

    def __post_init__(self) -> None:
        _check_key_text(self.family, "family")
        if isinstance(self.budget, bool) or not isinstance(self.budget, Fraction):
            raise TypeError(f"budget must be a Fraction (got {type(self.budget).__name__})")
        if not 0 < self.budget <= 1:
            raise ValueError(f"budget {self.budget} is not a share of the fp16 bytes in (0, 1]")

    @classmethod
    def parse(cls, name: str) -> BestKey:
        """``"1/4 eviction+int4"`` → ``BestKey(Fraction(1, 4), "eviction+int4")``.

        Raises:
            TypeError: ``name`` is not a string.
            ValueError: a name of another form, or a budget outside (0, 1].
        """
        _check_key_text(name, "best-row key")
        if (m := _BEST.fullmatch(name)) is None:
            raise ValueError(
                f"best-row key {name!r}: expected '<budget> <family>', e.g. '1/4 eviction'"
            )
        return cls(_budget(m["budget"], name), m["family"])

    def __str__(self) -> str:
        return f"{self.budget} {self.family}"


#: ``"retrieval_<context>"`` / ``"retrieval_multi_<context>"``: a row's retrieval accuracy.
_RETRIEVAL = re.compile(r"retrieval_(?P<multi>multi_)?(?P<context>[1-9]\d*)")


@dataclass(frozen=True)
class RetrievalColumn:
    """A retrieval figure of a row (``kvlib.eval.retrieval``): the accuracy at ``context``
    tokens of the pass-key task, or of its multi-key variant (``multi``). The row keeps it under
    ``str(column)`` (``"retrieval_1024"``, ``"retrieval_multi_1024"``), with its interval under
    ``"<column>_ci"`` and its bytes under ``"<column>_fp16_fraction"``."""

    context: int
    multi: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.context, bool) or not isinstance(self.context, int):
            raise TypeError(f"context must be an int (got {type(self.context).__name__})")
        if self.context < 1:
            raise ValueError(f"context must be >= 1 (got {self.context})")
        if not isinstance(self.multi, bool):
            raise TypeError(f"multi must be a bool (got {type(self.multi).__name__})")

    @classmethod
    def parse(cls, name: str) -> RetrievalColumn:
        """``"retrieval_multi_1024"`` → ``RetrievalColumn(1024, multi=True)``.

        Raises:
            TypeError: ``name`` is not a string.
            ValueError: a name of another form (``"retrieval_1024_ci"`` is the interval of a
                column, not a column).
        """
        _check_key_text(name, "retrieval column")
        if (m := _RETRIEVAL.fullmatch(name)) is None:
            raise ValueError(
                f"retrieval column {name!r}: expected 'retrieval_<tokens>' or "
                "'retrieval_multi_<tokens>'"
            )
        return cls(int(m["context"]), m["multi"] is not None)

    @classmethod
    def of(cls, row: Any) -> list[RetrievalColumn]:
        """The retrieval columns of a row (a mapping of figures), in the row's order; the
        other figures (``"perplexity"``, ``"retrieval_1024_ci"`` …) are not columns."""
        return [cls.parse(k) for k in row if isinstance(k, str) and _RETRIEVAL.fullmatch(k)]

    def __str__(self) -> str:
        return f"retrieval_{'multi_' if self.multi else ''}{self.context}"
