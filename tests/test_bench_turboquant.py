"""benchmarks/bench_turboquant.py's costs: decode steps timed in rounds as ratios to kvlib-int4,
and ``--costs-only``, which times a recorded run's costs again and keeps its quality figures
(a tiny Llama config stands in for the model; nothing is written to kvlib/results.json)."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from _scripts import load_script
from _tiny_models import gemma3_config
from transformers import LlamaConfig

import kvlib.models
from kvlib import results
from kvlib.caches import registry

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_turboquant.py"


@pytest.fixture()
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The benchmark module, at 256 tokens and 2 rounds (its neighbours on sys.path)."""
    module = load_script("benchmarks/bench_turboquant.py")
    monkeypatch.setattr(module, "CONTEXT", 256)
    monkeypatch.setattr(module, "STEP_ROUNDS", 2)
    yield module


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=64,
        max_position_embeddings=1024,
    )


def test_decode_steps_are_ratios_to_kvlib_int4_within_each_round(bench: ModuleType) -> None:
    config = tiny_config()
    names = ("kvlib-int4", "kvquant-3bit", "dynamic-fp32")
    steps = bench.decode_steps({n: registry.cache_factory(n, config) for n in names}, config)
    assert list(steps) == list(names)
    assert steps["kvlib-int4"]["decode_step_vs_kvlib_int4"] == 1.0
    assert steps["kvlib-int4"]["decode_step_vs_kvlib_int4_range"] == [1.0, 1.0]
    for row in steps.values():
        low, high = row["decode_step_vs_kvlib_int4_range"]
        assert 0 < low <= row["decode_step_vs_kvlib_int4"] <= high
        assert row["step_s"] > 0


def test_decode_steps_need_kvlib_int4(bench: ModuleType) -> None:
    config = tiny_config()
    with pytest.raises(ValueError, match="kvlib-int4"):
        bench.decode_steps({"kvquant-3bit": registry.cache_factory("kvquant-3bit", config)}, config)


def test_costs_only_retimes_costs_and_keeps_quality(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_config()
    monkeypatch.setattr(kvlib.models, "model_folder", lambda name=None: tmp_path)
    monkeypatch.setattr(bench, "AutoConfig", SimpleNamespace(from_pretrained=lambda _: config))
    quality = {
        "perplexity_segments": [12.0, 13.0],
        "perplexity_delta_pct_segments": [0.1, 0.3],
        "perplexity_delta_pct_mean": 0.2,
        "retrieval_1024": 1.0,
        "retrieval_1024_correct": 4,
        "retrieval_1024_trials": 4,
    }
    stale = {"bits_per_value_at_4096": -1.0, "decode_step_vs_kvlib_int4": -1.0}
    run = {
        "source": "benchmarks/bench_turboquant.py",
        "engine": "transformers",
        "command": "python benchmarks/bench_turboquant.py",
        "date": "2026-01-01",
        "machine": "a machine",
        "model": "SmolLM2-135M",
        "rows": {n: {**quality, **stale} for n in ("kvlib-int4", "kvquant-3bit")},
    }
    path = tmp_path / "results.json"
    results.record_run("turboquant", run, path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.main(["--costs-only", "--results", str(path), "--threads", "1"])
    entry = json.loads(path.read_text())["runs"]["turboquant"]
    assert entry["date"] == "2026-01-01" and entry["command"] == run["command"]
    assert entry["costs_timed"]["command"].endswith("--threads 1")
    assert "rounds" in entry["costs_timed"]["protocol"]
    for name, row in entry["rows"].items():
        assert {k: row[k] for k in quality} == quality
        assert 3 < row["bits_per_value_at_4096"] < 16, name  # re-measured, not the stale -1
        assert row["decode_step_vs_kvlib_int4"] > 0
    assert entry["rows"]["kvlib-int4"]["decode_step_vs_kvlib_int4"] == 1.0
    assert "| kvquant-3bit |" in out.getvalue()


def test_costs_only_without_a_recorded_run_says_so(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"schema_version": results.SCHEMA_VERSION, "runs": {}}))
    with pytest.raises(SystemExit, match="no run 'turboquant'"):
        bench.main(["--costs-only", "--results", str(path)])


def test_a_hybrid_model_also_gets_the_bits_of_its_global_layers(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma-like: 5 sliding layers (16-token windows) and one global layer, 1,024 tokens. The
    global layer's bits are the cache's own there: fp32 holds 32, kvlib-int4 its codes plus a
    float16 sink and window; the float16 windows raise the whole cache's figure. A
    full-attention model gets no such field."""
    monkeypatch.setattr(bench, "CONTEXT", 1024)
    config = gemma3_config(window=16)
    fp32 = bench.bits_and_store(registry.cache_factory("dynamic-fp32", config), config)
    int4 = bench.bits_and_store(registry.cache_factory("kvlib-int4", config), config)
    assert fp32["bits_global"] == pytest.approx(32.0)
    assert 4 < int4["bits_global"] < 8 and int4["bits_global"] < int4["bits"]
    llama = tiny_config()
    int4_llama = bench.bits_and_store(registry.cache_factory("kvlib-int4", llama), llama)
    assert "bits_global" not in int4_llama
