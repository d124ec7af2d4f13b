"""Tests for kvlib.plot (drawn on the Agg backend, nothing shown): every plot helper the
notebooks use, from the trade-off scatter to the paging maps of notebook 06."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from kvlib import plot  # noqa: E402
from kvlib.caches.blocks import BlockAllocator  # noqa: E402
from kvlib.eval.serving import make_trace, simulate_serving  # noqa: E402


def test_tradeoff_accepts_mapping_and_rows_and_groups():
    ax = plot.tradeoff({"fp16": (4096, 0.0), "int4": (1200, 0.08)})
    assert len(ax.collections) == 2 and len(ax.texts) == 2
    ax = plot.tradeoff(
        [("a", 1, 2), ("b", 3, 4), ("c", 5, 6)], groups={"a": "kvlib", "b": "kvlib", "c": "HF"}
    )
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["kvlib", "HF"]
    plt.close("all")


def test_tradeoff_rejects_bad_points():
    with pytest.raises(ValueError, match="at least one point"):
        plot.tradeoff({})
    with pytest.raises(ValueError, match="each point"):
        plot.tradeoff([("a", 1, 2, 3)])


def test_memory_lines_and_bytes_formatter():
    ax = plot.memory_lines({"T4": 16e9, "H100": 80e9})
    assert len(ax.lines) == 2
    assert plot.bytes_formatter()(2**30, 0) == "1 GiB"
    plt.close("all")


@pytest.mark.parametrize(
    ("value", "expected"), [("1", False), ("true", False), ("0", True), ("", True)]
)
def test_interactive_follows_headless_env(monkeypatch, value: str, expected: bool) -> None:
    """make run / make test set KVLIB_HEADLESS=1: notebooks then build no widgets."""
    monkeypatch.setenv(plot.HEADLESS_ENV_VAR, value)
    assert plot.interactive() is expected  # ipywidgets is installed in the test environment


def test_interactive_without_ipywidgets(monkeypatch) -> None:
    import sys

    monkeypatch.delenv(plot.HEADLESS_ENV_VAR, raising=False)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import fails
    assert plot.interactive() is False


def test_series_lines() -> None:
    ax = plot.series_lines({"a": ([1, 2], [3, 4]), "b": ([1, 2], [5, 6])}, bytes_y=True, logx=True)
    assert [line.get_label() for line in ax.get_lines()] == ["a", "b"]
    with pytest.raises(ValueError, match="x values"):
        plot.series_lines({"a": ([1, 2], [3])})
    with pytest.raises(ValueError, match="at least one"):
        plot.series_lines({})
    plt.close("all")


# --- paging helpers for notebook 07 -----------------------------------------------------------


def test_reservation_map() -> None:
    ax = plot.reservation_map([(3, 8), (8, 8), (0, 4)], block_size=4)
    img = ax.images[0].get_array()
    assert img.shape == (3, 8) and img[0].tolist() == [2, 2, 2, 1, 1, 1, 1, 1]
    assert img[2].tolist() == [1] * 4 + [0] * 4
    assert "45.0 %" in ax.get_title()  # 11 of 20 reserved slots hold a token: 9 unused
    with pytest.raises(ValueError, match="used <= reserved"):
        plot.reservation_map([(5, 4)])
    plt.close("all")


def test_block_map_shows_shared_blocks() -> None:
    a = BlockAllocator(6, 4)
    a.allocate("p", 6)
    a.fork("p", "c")
    a.append_slots("c", 1)
    ax = plot.block_map(a, ncols=3)
    texts = sorted(t.get_text() for t in ax.texts)
    assert texts == ["c\n3/4", "p\n2/4", "p+c\n4/4"]
    assert ax.get_title() == "3/6 blocks used, 9/12 slots filled"
    plt.close("all")


def test_serving_panels() -> None:
    trace = make_trace(20, seed=0)
    stats = {p: simulate_serving(trace, 2**28, p) for p in ("contiguous-max", "paged")}
    axes = plot.serving_panels(stats)
    assert len(axes[1].lines) == 2 and len(axes[2].lines) == 2
    assert axes[2].lines[1].get_ydata()[-1] == 20
    with pytest.raises(ValueError, match="at least one"):
        plot.serving_panels({})
    plt.close("all")


def test_tradeoff_labels_do_not_overlap():
    """Clustered points (as notebook 04's 20 caches are) get labels that do not overlap."""

    points = {f"cache-{i}": (1000 + 15 * i, 0.1 + 0.01 * (i % 3)) for i in range(8)}
    points["far"] = (40000, 5.0)
    fig, ax = plt.subplots(figsize=(6, 4))
    plot.tradeoff(points, ax=ax, logy=True)
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(boxes) == len(points)
    overlaps = [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :] if a.overlaps(b)]
    assert not overlaps
    plt.close(fig)
