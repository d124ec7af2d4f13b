"""One figure per claim across the notebooks: a perplexity cost quoted next to a cache's
registry name is a figure the results file holds for that cache, at the quoted precision.

A cache's canonical cost is the mean over a run's segments. A single segment's figure may be
quoted only where the sentence says so ("segment"), and a run that measured one segment only
is quoted as it is. So two notebooks cannot give the same cache two costs without one of them
being a recorded figure of another run, which the prose must then name (the tests of each
notebook check what its cells print; this one checks what its prose says).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from kvlib import results as kvresults
from kvlib.caches import registry as cache_registry

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
_NAMES = "|".join(re.escape(n) for n in sorted(cache_registry.CACHE_NAMES, key=len, reverse=True))
#: ``kvlib-int4 +0.08 %``, ``kvlib-int4's +0.22 %``, ``kvlib-int2: +6.2 %``, ``(kvlib-int8 −0.01 %``
QUOTE = re.compile(
    rf"(?<![\w-])(?P<name>{_NAMES})(?![\w-])(?:'s)?[^%\n.;]{{0,12}}?"
    r"(?P<value>[+\-−]\d+(?:\.\d+)?)\s?%"
)

#: kvlib's caches as prose names them: "kvlib's int4", "kvlib int4" (read as ``kvlib-int4``)
ALIAS = re.compile(r"\bkvlib(?:'s)? int(\d)\b")


def quotes(text: str) -> Iterator[tuple[str, str, str]]:
    """``(cache name, quoted value, the sentence around it)`` for every cost quoted in ``text``."""
    flat = ALIAS.sub(r"kvlib-int\1", " ".join(text.split()))
    for m in QUOTE.finditer(flat):
        start = max(flat.rfind(". ", 0, m.start()), 0)
        end = flat.find(". ", m.end())
        yield m["name"], m["value"], flat[start : end if end >= 0 else len(flat)]


def recorded(name: str, data: Mapping[str, Any]) -> tuple[list[float], list[float]]:
    """The costs the results file holds for one cache: ``(canonical, per segment)``: each run's
    mean over segments (or its one figure where it measured one segment), and the single
    segments' figures."""
    canonical, segments = [], []
    for entry in data.get("runs", {}).values():
        rows = entry.get("rows") if isinstance(entry, Mapping) else None
        row = rows.get(name) if isinstance(rows, Mapping) else None
        if not isinstance(row, Mapping):
            continue
        if "perplexity_delta_pct_mean" in row:  # the cache and turboquant runs
            canonical.append(float(row["perplexity_delta_pct_mean"]))
            segments += [float(x) for x in row.get("perplexity_delta_pct_segments", [])]
            if "perplexity_delta_pct" in row:  # the cache run's protocol segment
                segments.append(float(row["perplexity_delta_pct"]))
        elif "perplexity_delta_pct" in row:
            canonical.append(float(row["perplexity_delta_pct"]))
    return canonical, segments


def matches(value: str, figures: list[float]) -> bool:
    """``value`` (as quoted, ``−`` allowed) equals one of ``figures`` at its precision."""
    number = float(value.replace("−", "-"))
    decimals = len(value.split(".")[1]) if "." in value else 0
    return any(round(f, decimals) == number for f in figures)


def problems(text: str, data: Mapping[str, Any]) -> list[str]:
    """Quoted costs the results file does not hold, with the sentence they are in."""
    out = []
    for name, value, sentence in quotes(text):
        canonical, segments = recorded(name, data)
        allowed = canonical + (segments if "segment" in sentence else [])
        if not matches(value, allowed):
            out.append(f"{name} {value} %: not a recorded cost ({sentence!r})")
    return out


def _markdown(path: Path) -> str:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return "\n\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


@pytest.fixture(scope="module")
def data() -> Mapping[str, Any]:
    return kvresults.load_results(ROOT / "kvlib" / "results.json")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_quoted_cache_cost_is_a_recorded_one(path: Path, data) -> None:
    assert problems(_markdown(path), data) == []


def test_the_notebooks_quote_costs_the_check_reads(data) -> None:
    found = [q for path in NOTEBOOKS for q in quotes(_markdown(path))]
    assert len(found) >= 4, found  # the check reads real quotes, not none
    assert {name for name, _, _ in found} >= {"kvlib-int4", "kvlib-int2"}


def test_a_stale_or_segment_figure_is_caught(data) -> None:
    canonical, segments = recorded("kvlib-int4", data)
    mean, first = canonical[0], segments[-1]
    assert f"{mean:+.2f}" != f"{first:+.2f}"  # the cache run's mean and first segment differ
    assert problems(f"kvlib-int4 costs {mean:+.2f} % here.", data) == []
    assert problems(f"kvlib-int4 costs {first:+.2f} % here.", data)  # a segment, unlabelled
    assert problems(f"kvlib-int4 costs {first:+.2f} % on its first segment.", data) == []
    assert problems("kvlib-int4 costs +9.99 % here.", data)  # never measured
    assert problems("kvlib-int2: −6.22 %.", data)  # the sign is read


def test_quotes_find_registry_names_only() -> None:
    text = "kvlib-int4 +0.08 %, quanto int4 +0.5 %, kvlib-int4-rot +1.0 %, kvlib's int3 (+0.9 %"
    text += ", (kvlib-int8 −0.01 %)."
    assert [(n, v) for n, v, _ in quotes(text)] == [
        ("kvlib-int4", "+0.08"),
        ("kvlib-int4-rot", "+1.0"),
        ("kvlib-int3", "+0.9"),
        ("kvlib-int8", "−0.01"),
    ]


def test_runs_without_a_protocol_segment_are_read(data) -> None:
    """The turboquant runs record means and segments only (no ``perplexity_delta_pct``): their
    caches' costs are recorded too, one per model, and a figure off them is caught."""
    canonical, segments = recorded("kvquant-2bit", data)
    runs = kvresults.model_runs("turboquant", data)
    assert len(canonical) == len(runs) >= 1 and len(segments) == 4 * len(runs)
    assert problems(f"kvquant-2bit costs {canonical[0]:+.2f} % here.", data) == []
    assert problems(f"kvquant-2bit costs {max(canonical) + 1:+.2f} % here.", data)
