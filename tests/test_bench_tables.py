"""benchmarks/_tables.py: the one Markdown-table writer of the benchmarks."""

from __future__ import annotations

import pytest
from _scripts import load_script
from hypothesis import given
from hypothesis import strategies as st

tables = load_script("benchmarks/_tables.py")

CELL = st.text(
    st.characters(blacklist_characters="|\n\r", blacklist_categories=("Cs",)), max_size=8
)


@given(
    header=st.lists(CELL, min_size=1, max_size=6),
    n_rows=st.integers(0, 5),
    data=st.data(),
)
def test_every_line_has_the_header_s_cells_and_the_cells_read_back(header, n_rows, data):
    rows = [
        data.draw(st.lists(CELL, min_size=len(header), max_size=len(header))) for _ in range(n_rows)
    ]
    align = data.draw(st.text(alphabet="lr", max_size=len(header)))
    lines = tables.markdown_table(header, rows, align)
    assert len(lines) == n_rows + 2
    assert all(line.count("|") == len(header) + 1 for line in lines)
    rule = lines[1].strip("|").split("|")
    assert rule == ["---:" if a == "r" else "---" for a in align.ljust(len(header))]
    for line, row in zip(lines[2:], rows, strict=True):
        assert line == "| " + " | ".join(row) + " |"
    assert lines[0] == "| " + " | ".join(header) + " |"


def test_cells_are_written_as_str_writes_them():
    assert tables.markdown_table(["a", "b"], [[1, 2.5]], "r") == [
        "| a | b |",
        "|---:|---|",
        "| 1 | 2.5 |",
    ]


@pytest.mark.parametrize(
    ("header", "rows", "align", "match"),
    [
        ([], [], "", "at least one column"),
        (["a"], [], "rr", "align has 2 letters for 1 columns"),
        (["a", "b"], [["x"]], "", "row 0 has 1 cells for 2 columns"),
    ],
)
def test_bad_tables_are_refused(header, rows, align, match):
    with pytest.raises(ValueError, match=match):
        tables.markdown_table(header, rows, align)
