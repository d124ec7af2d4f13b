#!/usr/bin/env python
"""Notebook tooling for KV Cache Lab.

    python scripts/nb.py run --out build/notebooks notebooks/*.ipynb   # `make run`
    python scripts/nb.py execute notebooks/03_x.ipynb                   # re-execute in place
    python scripts/nb.py from-py src.py notebooks/NN_name.ipynb         # percent-format -> ipynb
    python scripts/nb.py to-py notebooks/NN_name.ipynb src.py           # ipynb -> percent-format

``run`` executes each notebook top to bottom in the current Python environment, writes the
executed copy under ``--out`` and prints one line per notebook (name, seconds, ok/failed); it
exits non-zero if any failed. ``execute`` does the same but writes back over the input, which
is how notebooks are committed (executed, with outputs and execution counts, for nbval).

Percent format: ``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell whose lines
are prefixed with ``# `` (the prefix is removed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

CELL_TIMEOUT_S = 600

# The numeric path notebooks are executed and nbval-checked on (the Makefile's NB_ENV holds the
# same values): AVX2 ATen kernels, MKL's reproducible AVX2 mode, two threads. Values already in
# the environment win, so `ATEN_CPU_CAPABILITY=avx512 python scripts/nb.py ...` still works.
REFERENCE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "OMP_NUM_THREADS": "2"}


def execute_notebook(path: Path, out: Path) -> tuple[bool, float, str]:
    """Execute ``path`` with its folder as working directory; write the result to ``out``."""
    nb = nbformat.read(path, as_version=4)
    for key, value in REFERENCE_ENV.items():
        os.environ.setdefault(key, value)  # inherited by the kernel process
    env_before = os.environ.get("PYDEVD_DISABLE_FILE_VALIDATION")
    os.environ["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"  # silences a debugger warning on stderr
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    start = time.perf_counter()
    ok, message = True, ""
    try:
        # The kernel process's own log (e.g. a transport notice) is not notebook output.
        client.execute(stderr=subprocess.DEVNULL)
    except CellExecutionError as exc:
        ok, message = False, str(exc).strip().splitlines()[-1][:300]
    except Exception as exc:  # kernel died, timeout, ...
        ok, message = False, f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if env_before is None:
            os.environ.pop("PYDEVD_DISABLE_FILE_VALIDATION", None)
    seconds = time.perf_counter() - start
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return ok, seconds, message


def _run(paths: list[Path], out_dir: Path | None) -> int:
    failed = 0
    width = max((len(p.name) for p in paths), default=10)
    for path in paths:
        out = (out_dir / path.name) if out_dir is not None else path
        ok, seconds, message = execute_notebook(path, out)
        status = "ok" if ok else "failed"
        print(f"{path.name:<{width}}  {seconds:7.1f} s  {status}", flush=True)
        if not ok:
            failed += 1
            print(f"    {message}", flush=True)
    total = len(paths)
    print(f"{total - failed} ok, {failed} failed")
    return 1 if failed else 0


def from_py(src: Path, dst: Path) -> None:
    """Convert a percent-format script to a notebook (outputs empty; run ``execute`` next)."""
    cells: list[nbformat.NotebookNode] = []
    kind, lines = None, []

    def flush() -> None:
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(
                ln[2:] if ln.startswith("# ") else ("" if ln.strip() == "#" else ln)
                for ln in body.splitlines()
            )
            cells.append(nbformat.v4.new_markdown_cell(body))
        elif body:
            cells.append(nbformat.v4.new_code_cell(body))

    for line in src.read_text().splitlines():
        if line.startswith("# %%"):
            flush()
            kind = "markdown" if "[markdown]" in line else "code"
            lines = []
        elif kind is not None:
            lines.append(line)
    flush()
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    nb.metadata["language_info"] = {"name": "python"}
    dst.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dst)


def to_py(src: Path, dst: Path) -> None:
    """Convert a notebook to percent format (outputs dropped)."""
    nb = nbformat.read(src, as_version=4)
    parts = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            body = "\n".join(f"# {ln}" if ln else "#" for ln in cell.source.splitlines())
            parts.append(f"# %% [markdown]\n{body}\n")
        elif cell.cell_type == "code":
            parts.append(f"# %%\n{cell.source}\n")
    dst.write_text("\n".join(parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="execute notebooks into --out, one line per notebook")
    p_run.add_argument("--out", type=Path, default=Path("build/notebooks"))
    p_run.add_argument("notebooks", nargs="+", type=Path)
    p_exe = sub.add_parser("execute", help="execute notebooks in place (for committing)")
    p_exe.add_argument("notebooks", nargs="+", type=Path)
    p_from = sub.add_parser("from-py", help="percent-format script -> notebook")
    p_from.add_argument("src", type=Path)
    p_from.add_argument("dst", type=Path)
    p_to = sub.add_parser("to-py", help="notebook -> percent-format script")
    p_to.add_argument("src", type=Path)
    p_to.add_argument("dst", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "run":
        return _run(args.notebooks, args.out)
    if args.cmd == "execute":
        return _run(args.notebooks, None)
    if args.cmd == "from-py":
        from_py(args.src, args.dst)
        return 0
    to_py(args.src, args.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
