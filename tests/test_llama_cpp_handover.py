"""The plan's llama.cpp settings, handed over to llama.cpp itself (issue 18).

Runs only where the peer environment is built (``make peers`` installs llama-cpp-python, about
10 minutes of compiling); everywhere else it is skipped, and pytest's summary (``-ra``) says why.
"""

import pytest

from kvlib.models import bundled_model_path
from kvlib.plan import engines
from kvlib.plan.planner import recommend

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed: `make peers` builds it (~10 min)"
)

pytestmark = pytest.mark.slow


def ggml(name: str) -> int:
    return getattr(llama_cpp, f"GGML_TYPE_{name.upper()}")


@pytest.mark.parametrize(("memory_gib", "concurrency"), [(16, 1), (1.15, 4)])
def test_the_plans_llama_cpp_flags_load_the_bundled_model_and_generate(memory_gib, concurrency):
    plan = recommend("smollm2-135m", memory_gib, 2048, concurrency, device="cpu", results=None)
    flags = plan.to_llama_cpp()
    for flag in ("--cache-type-k", "--cache-type-v"):
        assert engines.accepts("llama.cpp", flags[flag])
    llm = llama_cpp.Llama(
        model_path=str(bundled_model_path()),
        n_ctx=flags["-c"] // flags["-np"],  # one slot: llama-cpp-python serves one sequence
        type_k=ggml(flags["--cache-type-k"]),
        type_v=ggml(flags["--cache-type-v"]),
        flash_attn=flags["-fa"] == "on",
        n_gpu_layers=flags["-ngl"],
        n_threads=2,
        verbose=False,
    )
    out = llm("The capital of France is", max_tokens=8, temperature=0.0)
    text = out["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] >= 1 and text.strip()
