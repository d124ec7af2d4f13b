"""Small plotting helpers shared by the notebooks (matplotlib, imported lazily).

Library code returns values; drawing them lives here so that notebooks do not copy plotting
snippets between each other. Every function draws on an ``Axes`` it is given (or a new one) and
returns it; none calls ``plt.show()`` — the notebook does, so nbval sees one figure per cell.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["tradeoff", "memory_lines", "bytes_formatter"]


def _axes(ax: Any = None, figsize: tuple[float, float] = (8.0, 5.0)) -> Any:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=figsize)
    return ax


def bytes_formatter(binary: bool = True) -> Any:
    """A matplotlib tick formatter that prints byte counts as ``1.5 GiB`` (``kvlib.memory``)."""
    from matplotlib.ticker import FuncFormatter

    from kvlib.memory import human_bytes

    return FuncFormatter(lambda x, _pos: human_bytes(x, binary=binary) if x > 0 else "0")


def tradeoff(
    points: Mapping[str, tuple[float, float]] | Iterable[tuple[str, float, float]],
    *,
    ax: Any = None,
    xlabel: str = "bytes per token",
    ylabel: str = "perplexity delta (%)",
    logx: bool = False,
    logy: bool = False,
    groups: Mapping[str, str] | None = None,
    title: str | None = None,
) -> Any:
    """Scatter of quality cost against size, one labelled point per method.

    Args:
        points: ``{label: (x, y)}`` or ``[(label, x, y), ...]`` — e.g. bytes per token and
            perplexity delta for each cache.
        groups: optional ``{label: group}``; points of one group share a colour and legend entry
            (e.g. ``"kvlib"``, ``"HF quanto"``).
    """
    if isinstance(points, Mapping):
        rows = [(str(lab), *_pair(xy)) for lab, xy in points.items()]
    else:
        rows = [(str(p[0]), *_pair(p[1:])) for p in points]
    if not rows:
        raise ValueError("tradeoff() needs at least one point")
    ax = _axes(ax)
    colours: dict[str, Any] = {}
    for label, x, y in rows:
        group = (groups or {}).get(label, label if groups is None else "other")
        if group not in colours:
            colours[group] = f"C{len(colours) % 10}"
            legend = group if groups is not None else None
        else:
            legend = None
        ax.scatter([x], [y], color=colours[group], label=legend, zorder=3)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("symlog", linthresh=0.1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if groups is not None:
        ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax


def _pair(xy: Sequence[Any]) -> tuple[float, float]:
    if len(xy) != 2:
        raise ValueError(f"each point must be (label, x, y) or label -> (x, y), got {xy!r}")
    return float(xy[0]), float(xy[1])


def memory_lines(
    gpus: Mapping[str, float],
    *,
    ax: Any = None,
    unit: float = 2**30,
    style: str = "--",
) -> Any:
    """Horizontal lines at GPU memory sizes, e.g. ``{"T4 16 GB": 16e9}`` (bytes), labelled."""
    ax = _axes(ax)
    for name, nbytes in gpus.items():
        y = float(nbytes) / unit
        ax.axhline(y, color="grey", linestyle=style, linewidth=0.8, alpha=0.7)
        ax.annotate(
            name,
            (0.01, y),
            xycoords=("axes fraction", "data"),
            fontsize=8,
            va="bottom",
            color="grey",
        )
    return ax
