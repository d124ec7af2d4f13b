"""The README's code example runs as printed (the front page must not rot)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_shows_the_commands():
    text = README.read_text()
    for cmd in ("make run", "make test", "make lab"):
        assert cmd in text.split("## ")[0], f"README's first screen must show `{cmd}`"


def test_readme_python_example_runs(model):
    blocks = _python_blocks()
    assert blocks, "README has no ```python example"
    out = io.StringIO()
    namespace: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], "README.md", "exec"), namespace)  # noqa: S102
    cache = namespace["cache"]
    assert 0 < cache.nbytes() < cache.fp16_nbytes()
    assert "fp16 would hold" in out.getvalue()
