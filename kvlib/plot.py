"""Small plotting helpers shared by the notebooks (matplotlib, imported lazily).

Library code returns values; drawing them lives here so that notebooks do not copy plotting
snippets between each other. Every function draws on an ``Axes`` it is given (or a new one) and
returns it; none calls ``plt.show()`` — the notebook does, so nbval sees one figure per cell.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

HEADLESS_ENV_VAR = "KVLIB_HEADLESS"

__all__ = [
    "interactive",
    "tradeoff",
    "memory_lines",
    "bytes_formatter",
    "reservation_map",
    "block_map",
    "serving_panels",
    "series_lines",
]


def interactive() -> bool:
    """Whether a notebook should build interactive widgets (ipywidgets) here.

    False when ``KVLIB_HEADLESS`` is set to a true value, as ``make run``, ``make test`` and
    ``make notebooks`` do: those runs have no front end to answer widget messages, and the
    executor can wait on them until its cell timeout (jupyter/nbclient#312). False too when
    ipywidgets is not installed. In Jupyter or Colab it is True.
    """
    if os.environ.get(HEADLESS_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


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

    Labels are placed so that they do not overlap each other or the points (adjustText).

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
    texts = []
    for label, x, y in rows:
        group = (groups or {}).get(label, label if groups is None else "other")
        if group not in colours:
            colours[group] = f"C{len(colours) % 10}"
            legend = group if groups is not None else None
        else:
            legend = None
        ax.scatter([x], [y], color=colours[group], label=legend, zorder=3)
        texts.append(ax.text(x, y, label, fontsize=8))
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
    _spread_labels(ax, texts, [r[1] for r in rows], [r[2] for r in rows])
    return ax


def _spread_labels(ax: Any, texts: list[Any], xs: list[float], ys: list[float]) -> None:
    """Move point labels apart so that none overlaps another or a point (adjustText), with a
    thin line back to its point where a label had to move away."""
    from adjustText import adjust_text

    ax.margins(0.08, 0.12)  # room for labels at the edges
    ax.autoscale_view()
    limits = ax.get_xlim(), ax.get_ylim()
    ax.figure.canvas.draw()  # scales and limits are final before the labels move
    adjust_text(
        texts, x=xs, y=ys, ax=ax, expand=(1.15, 1.3),
        arrowprops={"arrowstyle": "-", "color": "0.5", "lw": 0.5},
    )  # fmt: skip
    ax.set_xlim(*limits[0])  # labels move; the data's view does not
    ax.set_ylim(*limits[1])
    ax.set_autoscale_on(True)  # a scale set later (ax.set_yscale("log")) rescales to the data


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


# --- paged attention (notebook 07) ------------------------------------------------------------
#: Colours of :func:`reservation_map`: not reserved, reserved but unused, holding a token.
RESERVATION_COLOURS = ("#ffffff", "#f4a3a3", "#3b6ea8")


def reservation_map(
    rows: Sequence[tuple[int, int]],
    *,
    ax: Any = None,
    width: int | None = None,
    block_size: int | None = None,
    title: str | None = None,
) -> Any:
    """Picture of KV slots per request: one row per request, one column per token slot.

    Args:
        rows: ``(used, reserved)`` token counts per request (``used <= reserved``).
        width: columns drawn (default: the largest ``reserved``).
        block_size: draw a thin line at every block boundary.

    Slots holding a token are blue, reserved-but-unused slots (internal fragmentation and
    over-reservation) red, slots not reserved white.
    """
    import numpy as np
    from matplotlib.colors import ListedColormap

    rows = [(int(u), int(r)) for u, r in rows]
    if not rows:
        raise ValueError("reservation_map() needs at least one (used, reserved) row")
    if any(u < 0 or u > r for u, r in rows):
        raise ValueError(f"each row must be (used, reserved) with 0 <= used <= reserved: {rows}")
    width = width or max(r for _, r in rows)
    grid = np.zeros((len(rows), width), dtype=int)
    for i, (u, r) in enumerate(rows):
        grid[i, : min(r, width)] = 1
        grid[i, : min(u, width)] = 2
    ax = _axes(ax, figsize=(8.0, 0.3 * len(rows) + 1.0))
    ax.imshow(
        grid,
        cmap=ListedColormap(RESERVATION_COLOURS),
        vmin=0,
        vmax=2,
        aspect="auto",
        interpolation="nearest",
    )
    if block_size:
        for x in range(block_size, width, block_size):
            ax.axvline(x - 0.5, color="white", linewidth=0.5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"req {i}" for i in range(len(rows))], fontsize=7)
    ax.set_xlabel("token slot")
    total_r = sum(r for _, r in rows)
    waste = 1 - sum(u for u, _ in rows) / total_r if total_r else 0.0
    ax.set_title(f"{title + ': ' if title else ''}{100 * waste:.1f} % of reserved slots unused")
    return ax


def block_map(
    allocator: Any,
    *,
    ax: Any = None,
    ncols: int | None = None,
    title: str | None = None,
    annotate: bool = True,
) -> Any:
    """The physical blocks of a :class:`kvlib.caches.blocks.BlockAllocator`, drawn as a grid.

    Each cell is one physical block (numbered row by row): coloured by the sequence that holds
    it, grey with ``a+b`` when several sequences share it, white when free. ``annotate`` writes
    the owner and how many of the ``block_size`` slots are filled (``3/4``).
    """
    import numpy as np
    from matplotlib.colors import to_rgba

    n, bs = allocator.num_blocks, allocator.block_size
    ncols = ncols or min(n, 16)
    nrows = -(-n // ncols)
    owners: dict[int, list[Any]] = {}
    fill: dict[int, int] = {}
    for seq in allocator.sequences:
        length = allocator.seq_len(seq)
        for i, block in enumerate(allocator.block_table(seq)):
            owners.setdefault(block, []).append(seq)
            fill[block] = max(fill.get(block, 0), min(bs, length - i * bs))
    seq_colour = {s: f"C{i % 10}" for i, s in enumerate(allocator.sequences)}
    img = np.ones((nrows, ncols, 4))
    for b in range(nrows * ncols):
        r, c = divmod(b, ncols)
        if b >= n:
            img[r, c] = to_rgba("#eeeeee")
        elif b in owners:
            who = owners[b]
            img[r, c] = to_rgba("#9e9e9e" if len(who) > 1 else seq_colour[who[0]])
    ax = _axes(ax, figsize=(0.6 * ncols + 1.0, 0.6 * nrows + 1.0))
    ax.imshow(img, interpolation="nearest")
    ax.set_xticks(np.arange(-0.5, ncols, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, nrows, 1), minor=True)
    ax.grid(which="minor", color="black", linewidth=0.5)
    ax.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
    if annotate:
        for b, who in owners.items():
            r, c = divmod(b, ncols)
            label = "+".join(str(s) for s in who)
            ax.text(c, r, f"{label}\n{fill[b]}/{bs}", ha="center", va="center", fontsize=7)
    used = len(owners)
    ax.set_title(
        f"{title + ': ' if title else ''}{used}/{n} blocks used, "
        f"{sum(fill.values())}/{used * bs} slots filled"
    )
    return ax


def serving_panels(stats: Mapping[str, Any], *, axes: Any = None) -> Any:
    """Three panels for :func:`kvlib.eval.serving.simulate_serving` results, one entry per policy.

    Args:
        stats: ``{label: ServingStats}``.
        axes: three ``Axes`` (default: a new 1 x 3 figure).

    Left: reserved KV memory left unused (``waste_fraction``, %). Middle: sequences running per
    step. Right: requests completed over simulated time.
    """
    if not stats:
        raise ValueError("serving_panels() needs at least one ServingStats")
    if axes is None:
        import matplotlib.pyplot as plt

        _, axes = plt.subplots(1, 3, figsize=(15.0, 4.0))
    waste_ax, conc_ax, done_ax = axes
    labels = list(stats)
    colours = [f"C{i % 10}" for i in range(len(labels))]
    waste = [100.0 * s.waste_fraction for s in stats.values()]
    bars = waste_ax.bar(range(len(labels)), waste, color=colours)
    waste_ax.bar_label(bars, fmt="%.1f", fontsize=8)
    waste_ax.set_xticks(range(len(labels)))
    waste_ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    waste_ax.set_ylabel("reserved but unused (%)")
    waste_ax.set_title("KV memory wasted")
    for (label, s), colour in zip(stats.items(), colours, strict=True):
        conc_ax.plot(s.concurrent, color=colour, label=label, linewidth=1)
        done_ax.plot(s.finished, color=colour, label=label, linewidth=1)
    conc_ax.set_xlabel("step")
    conc_ax.set_ylabel("sequences running")
    conc_ax.set_title("Concurrency")
    done_ax.set_xlabel("step")
    done_ax.set_ylabel("requests completed")
    done_ax.set_title("Completed over time")
    done_ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return axes


def series_lines(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    ax: Any = None,
    xlabel: str = "context (tokens)",
    ylabel: str = "",
    bytes_y: bool = False,
    logx: bool = False,
    logy: bool = False,
    title: str | None = None,
) -> Any:
    """One line with markers per named series, ``{name: (xs, ys)}`` — e.g. memory or tokens/s
    against context length, one line per cache (notebook 08). ``bytes_y`` formats the y axis
    as byte counts (:func:`bytes_formatter`)."""
    if not series:
        raise ValueError("series_lines() needs at least one series")
    ax = _axes(ax)
    for i, (name, (xs, ys)) in enumerate(series.items()):
        if len(xs) != len(ys):
            raise ValueError(f"series {name!r} has {len(xs)} x values but {len(ys)} y values")
        ax.plot(list(xs), list(ys), marker="o", color=f"C{i % 10}", label=str(name))
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    if bytes_y:
        ax.yaxis.set_major_formatter(bytes_formatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax
