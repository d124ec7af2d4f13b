"""Tests for kvlib.plot (drawn on the Agg backend, nothing shown)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from kvlib import plot  # noqa: E402


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
