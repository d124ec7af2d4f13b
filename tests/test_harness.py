"""kvlib.harness: cache factories, the comparison rows, what fits (predicted, and measured with
out-of-memory handled), random models of real architectures, model choice, and the dry run of
scripts/gpu_check.py."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import compat, harness, memory

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: on a shared 2-core machine two threads run these tiny models ~6x
    slower (oversubscription)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- factories --------------------------------------------------------------------------------


def test_cache_info_parses_every_name():
    for name in harness.CACHE_NAMES:
        info = harness.cache_info(name)
        assert info.name == name
        if name == "dynamic":
            assert info.bits is None and info.cache_bits(16) == 16 and info.cache_bits(32) == 32
        else:
            assert info.bits == int(name.rsplit("int", 1)[1])
            assert info.group_size and info.residual_tokens > 0


@pytest.mark.parametrize("bad", ["kvlib-int5", "Dynamic", "", 4, None])
def test_cache_info_rejects_unknown(bad):
    with pytest.raises(ValueError, match="accepted"):
        harness.cache_info(bad)


def test_factories_make_fresh_caches(model):
    dyn = harness.cache_factory("dynamic", model.config)
    a, b = dyn(), dyn()
    assert a is not b and a.get_seq_length() == 0
    assert type(a).__name__ == "DynamicCache"
    q = harness.make_cache("quanto-int4", model.config)
    assert type(q).__name__ == "QuantizedCache" and q.get_seq_length() == 0
    with pytest.raises(ValueError, match="no options"):
        harness.cache_factory("dynamic", model.config, bits=4)


def test_kvlib_factories(model):
    from kvlib.cache import QuantizedKVCache

    for bits in (8, 4, 2):
        cache = harness.make_cache(f"kvlib-int{bits}", model.config)
        assert isinstance(cache, QuantizedKVCache) and cache.get_seq_length() == 0


# -- comparison -------------------------------------------------------------------------------


def test_comparison_rows_on_bundled_model(model, tokenizer, eval_ids):
    prompt, new = 32, 3
    rows = harness.run_cache_comparison(
        model,
        tokenizer,
        ["dynamic", "quanto-int4"],
        prompt_tokens=prompt,
        new_tokens=new,
        eval_ids=eval_ids[:, :96],
        repeats=1,
        chunk_size=32,
        sample_tokens=3,
        warmup=False,
    )
    assert [r.cache for r in rows] == ["dynamic", "quanto-int4"]
    dyn, q4 = rows
    spec = memory.get_spec("smollm2-135m")
    # greedy decoding leaves prompt + new - 1 tokens in the cache; fp32 model -> 32 bits
    assert dyn.bits == 32 and q4.bits == 4
    assert dyn.cache_bytes == memory.kv_cache_bytes(spec, prompt + new - 1, bits=32)
    assert 0 < q4.cache_bytes < dyn.cache_bytes
    assert dyn.memory_kind == "cache bytes" and dyn.memory_bytes == dyn.cache_bytes
    assert dyn.peak_memory_bytes is None
    assert dyn.ppl_delta_pct == 0.0  # the reference is the same DynamicCache computation
    assert math.isfinite(q4.perplexity) and abs(q4.ppl_delta_pct) < 50
    for r in rows:
        assert r.decode_tokens_per_s > 0 and r.time_to_first_token_s > 0
        assert len(r.sample_ids) == 3 and r.sample == tokenizer.decode(r.sample_ids)
    frame = harness.records(rows)
    assert frame[0]["cache"] == "dynamic" and set(frame[0]) == set(rows[0].to_dict())


def test_comparison_rejects_bad_caches(model, tokenizer):
    with pytest.raises(TypeError, match="list of cache names"):
        harness.run_cache_comparison(model, tokenizer, "dynamic")
    with pytest.raises(ValueError, match="unknown cache"):
        harness.run_cache_comparison(model, tokenizer, ["int4"])


# -- what fits --------------------------------------------------------------------------------


@pytest.mark.parametrize("spec_name", ["smollm2-1.7b", "llama-3.2-3b", "qwen2.5-0.5b"])
def test_what_fits_prediction_matches_kvlib_memory(spec_name):
    budget = 15e9
    rows = harness.what_fits(spec_name, budget, ["dynamic", "quanto-int4", "kvlib-int2"])
    spec = memory.get_spec(spec_name)
    for row in rows:
        info = harness.cache_info(row.cache)
        bits = info.cache_bits(16)
        group = info.group_size if bits < 16 else None
        assert row.predicted_max_context == memory.max_context(
            spec, budget, bits=bits, group_size=group
        )
        assert row.predicted_max_batch == memory.max_batch(
            spec, budget, 8192, bits=bits, group_size=group
        )
        assert row.measured_max_context is None and row.measured_max_batch is None
    dyn, q4, q2 = rows
    assert dyn.predicted_max_context < q4.predicted_max_context < q2.predicted_max_context
    assert dyn.predicted_max_batch <= q4.predicted_max_batch <= q2.predicted_max_batch


@settings(max_examples=40, deadline=None)
@given(limit=st.integers(0, 5000), guess=st.integers(1, 20000), step=st.sampled_from([1, 7, 64]))
def test_search_max_finds_the_threshold(limit, guess, step):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= limit

    found, resolution = harness.search_max(fits, guess, step=step, max_probes=64)
    assert found % step == 0 and found <= limit
    assert all(c % step == 0 and c >= step for c in calls)
    if limit >= step:  # a failure above was seen and the gap closed to one step
        assert resolution == step and limit - found < step
    else:
        assert found == 0


def test_oom_is_reported_as_does_not_fit_and_memory_released(monkeypatch):
    """A fake runner raises torch.OutOfMemoryError past a size; what_fits keeps going, every
    failure is followed by a release, and the measured limits are the fake's thresholds."""
    released = []
    monkeypatch.setattr(harness, "release_memory", lambda device=None: released.append(device))
    spec = memory.get_spec("smollm2-135m")
    budget = 2e9
    predicted = memory.max_context(spec, budget, bits=16)
    limit_ctx, limit_batch = predicted - 3000, 3
    calls, failures = [], []

    def runner(name, context, batch):
        calls.append((name, context, batch))
        if (batch == 1 and context > limit_ctx) or batch > limit_batch or name == "quanto-int2":
            failures.append((name, context, batch))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (fake)")
        return 0

    rows = harness.what_fits(
        spec, budget, ["dynamic", "quanto-int2"], runner=runner, context_step=256, max_probes=12
    )
    dyn, q2 = rows
    assert failures and len(released) >= len(calls)
    assert dyn.measured_max_context == (limit_ctx // 256) * 256
    assert dyn.measured_max_batch == limit_batch and dyn.batch_resolution == 1
    assert q2.measured_max_context == 0 and q2.measured_max_batch == 0  # "does not fit"


def test_non_oom_errors_are_not_swallowed():
    def runner(name, context, batch):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        harness.what_fits("smollm2-135m", 1e9, ["dynamic"], runner=runner)
    assert harness.is_oom(torch.OutOfMemoryError("x"))
    assert harness.is_oom(RuntimeError("CUDA error: out of memory"))
    assert not harness.is_oom(ValueError("out of memory"))


def test_measuring_without_cuda_needs_a_runner(model):
    with pytest.raises(ValueError, match="needs CUDA"):
        harness.what_fits(model, 1e9, ["dynamic"], measure=True)
    with pytest.raises(ValueError, match="CUDA"):
        with harness.memory_limit(1e9, "cpu"):
            pass


def test_fill_and_step_and_simulated_budget(model):
    nbytes = harness.fill_and_step(model, harness.cache_factory("dynamic", model.config), 40, 2)
    spec = memory.get_spec("smollm2-135m")
    assert nbytes == memory.kv_cache_bytes(spec, 41, batch_size=2, bits=32)  # + decode token
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = memory.kv_bytes_per_token(spec, bits=32)
    budget = weights + 300 * per_token
    runner = harness.simulated_budget_runner(model, budget)
    rows = harness.what_fits(
        model, budget, ["dynamic"], dtype_bits=32, runner=runner, context_step=64, max_probes=6
    )
    (row,) = rows
    assert row.predicted_max_context == 300
    # the decode step adds one token: 256 + 1 fits, 320 + 1 does not
    assert row.measured_max_context == 256 and row.context_resolution == 64


# -- models -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(harness.ARCHITECTURES))
def test_random_config_matches_registry(name):
    spec = memory.get_spec(name)
    config = harness.random_config(name)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        meta_model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in meta_model.parameters()) == spec.num_params
    got = memory.spec_from_config(config)
    for attr in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size"):
        assert getattr(got, attr) == getattr(spec, attr)


def test_random_model_shapes_and_cache():
    model = harness.random_model(
        "smollm2-1.7b", device="cpu", num_layers=2, vocab_size=256, intermediate_size=64
    )
    spec = memory.get_spec("smollm2-1.7b")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        2,
        spec.num_heads,
        spec.num_kv_heads,
    )
    assert next(model.parameters()).dtype == torch.float32
    ids = torch.randint(0, 256, (1, 10))
    out = compat.forward(model, ids, compat.dynamic_cache(cfg))
    keys = compat.output_cache(out).layers[0].keys
    assert keys.shape == (1, spec.num_kv_heads, 10, spec.head_dim)
    with pytest.raises(ValueError, match="no architecture"):
        harness.random_config("falcon-7b")


def test_choose_model():
    cpu = harness.choose_model("cpu")
    assert cpu.kind == "bundled" and cpu.real_weights
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        assert harness.choose_model("cuda", hub=True).model_id == harness.DEFAULT_HUB_MODEL
        random_choice = harness.choose_model("cuda", hub=False)
        assert random_choice.kind == "random" and not random_choice.real_weights
    with pytest.raises(ValueError, match="kind"):
        harness.load_choice(harness.ModelChoice("weird", None, None, "cpu", ""))


# -- the GPU script's dry run -----------------------------------------------------------------


def _load_gpu_check():
    path = ROOT / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_gpu_check_dry_run(capsys):
    gpu_check = _load_gpu_check()
    rc = gpu_check.main(["--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| cache |" in out and "FAIL" not in out and "Traceback" not in out
    for title in ("Correctness against DynamicCache", "Memory and speed", "What fits"):
        assert f"### {title}" in out
    assert out.count("| PASS |") >= 3  # kvlib int8 / int4 / int2 against DynamicCache
    assert "| dynamic | 32 | 0.0000 | 0.0000 | 1.000 | - | reference |" in out


def test_series_lines_plot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlib.plot import series_lines

    ax = series_lines({"a": ([1, 2], [3, 4]), "b": ([1, 2], [5, 6])}, bytes_y=True, logx=True)
    assert [line.get_label() for line in ax.get_lines()] == ["a", "b"]
    with pytest.raises(ValueError, match="x values"):
        series_lines({"a": ([1, 2], [3])})
    with pytest.raises(ValueError, match="at least one"):
        series_lines({})
    plt.close("all")


def test_fill_or_none_catches_oom(model, monkeypatch):
    assert harness.fill_or_none(model, "dynamic", 8, 1) == memory.kv_cache_bytes(
        memory.get_spec("smollm2-135m"), 9, bits=32
    )

    def boom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    monkeypatch.setattr(harness, "fill_and_step", boom)
    assert harness.fill_or_none(model, "dynamic", 8, 1) is None
