"""kvlib.plan: the scenarios of the configuration guide, each with its expected recommendation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import memory, plan
from kvlib.plan import recommend

MEAS = {
    "source": "benchmarks/bench_cache.py",
    "date": "2026-12-02",
    "model": "SmolLM2-135M",
    "caches": {
        "fp16-dynamic": {
            "perplexity": 10.0,
            "perplexity_delta_pct": 0.0,
            "bytes_ratio_vs_fp16": 1.0,
        },
        "kvlib-int8": {
            "perplexity": 10.001,
            "perplexity_delta_pct": 0.01,
            "bytes_ratio_vs_fp16": 0.53,
        },
        "kvlib-int4": {
            "perplexity": 10.08,
            "perplexity_delta_pct": 0.8,
            "bytes_ratio_vs_fp16": 0.28,
        },
    },
}


@pytest.fixture(params=["measured", "unmeasured"])
def meas(request):
    return MEAS if request.param == "measured" else {}


def test_8b_on_24gb_at_32k_one_user_keeps_fp16(meas):
    p = recommend("llama-3.1-8b", 24, 32768, measurements=meas)
    assert (p.status, p.kv, p.engine) == ("ok", "fp16", "transformers")
    assert p.to_transformers() == {"cache_implementation": "dynamic"}
    assert p.to_llama_cpp()["--cache-type-k"] == "f16"


def test_8b_on_24gb_at_32k_four_users_int4(meas):
    p = recommend("llama-3.1-8b", 24, 32768, concurrency=4, measurements=meas)
    assert (p.status, p.kv, p.engine, p.paging) == ("ok", "int4", "vllm", True)
    assert p.max_concurrency >= 4 > p.max_concurrency_fp16
    v = p.to_vllm()
    assert v["kv_cache_dtype"] == "fp8" and v["max_model_len"] == 32768 and v["block_size"] == 16
    assert p.to_transformers()["cache_config"]["nbits"] == 4
    ll = p.to_llama_cpp()
    assert ll["--cache-type-v"] == "q4_0" and ll["-fa"] == "on" and ll["-c"] == 4 * 32768
    note = [r for r in p.reasons if r.startswith("int4:")][0]
    if meas:
        assert "+0.8 %" in note and "2026-12-02" in note and "bench_cache" in note
    else:
        assert "not measured" in note


def test_70b_on_2x80gb_tensor_parallel():
    p = recommend("llama-3.1-70b", 80, 32768, concurrency=16, num_gpus=2, measurements={})
    assert p.status == "reduced" and p.kv == "int4" and p.tensor_parallel_size == 2
    assert p.to_vllm()["tensor_parallel_size"] == 2
    assert any(s.startswith("weight_bits=8") for s in p.suggestions)
    p8 = recommend("llama-3.1-70b", 80, 32768, 16, weight_bits=8, num_gpus=2, measurements={})
    assert p8.fits and p8.to_vllm()["quantization"] == "fp8"


def test_1b_on_laptop_cpu():
    p = recommend("llama-3.2-1b", 16, 8192, device="cpu", measurements={})
    assert (p.status, p.kv, p.engine) == ("ok", "fp16", "llama.cpp")
    assert p.to_llama_cpp()["-ngl"] == 0 and p.to_llama_cpp()["-c"] == 8192


def test_long_document_rag_128k():
    p = recommend("llama-3.1-8b", 80, 131072, concurrency=4, measurements={})
    assert (p.status, p.kv) == ("ok", "int8")
    assert p.max_concurrency_fp16 == 3
    v = p.to_vllm()
    assert v["kv_cache_dtype"] == "fp8" and v["max_model_len"] == 131072 and v["max_num_seqs"] == 4


def test_chat_service_64_users():
    p = recommend("llama-3.1-8b", 80, 8192, concurrency=64, measurements={})
    assert (p.kv, p.engine, p.paging, p.idle_storage) == ("int8", "vllm", True, "pca")
    assert p.to_vllm()["max_num_seqs"] == 64
    assert any("pca: storage figures not measured" in r for r in p.reasons)


def test_colab_t4_7b_needs_lower_weight_bits():
    p = recommend("qwen2.5-7b", 16, 8192, measurements={})
    assert p.status == "impossible" and p.kv is None and p.max_concurrency == 0
    assert any(s.startswith("weight_bits=8") for s in p.suggestions)
    with pytest.raises(ValueError, match="does not fit"):
        p.to_vllm()
    p4 = recommend("qwen2.5-7b", 16, 8192, weight_bits=4, measurements={})
    assert p4.fits and p4.kv == "fp16"


def test_deepseek_v3_mla_replicated_latent():
    p = recommend(
        "deepseek-v3", 141, 131072, concurrency=8, weight_bits=8, num_gpus=8, measurements={}
    )
    assert p.fits and p.kv == "int8" and p.to_vllm()["tensor_parallel_size"] == 8
    spec = memory.get_spec("deepseek-v3")
    assert p.kv_bytes_per_sequence_fp16 == memory.kv_cache_bytes(spec, 131072)  # not sharded
    assert any("MLA" in w for w in p.watch)


def test_gemma2_sliding_window_counts_capped_layers():
    p = recommend("gemma-2-9b", 48, 8192, concurrency=8, measurements={})
    spec = memory.get_spec("gemma-2-9b")
    full = memory.ModelSpec("full", 42, 16, 8, 256, num_params=spec.num_params)
    assert p.kv_bytes_per_sequence_fp16 == memory.kv_cache_bytes(spec, 8192)
    assert p.kv_bytes_per_sequence_fp16 < memory.kv_cache_bytes(full, 8192)
    if p.kv != "fp16":
        with pytest.raises(ValueError, match="sliding-window"):
            p.to_transformers()


def test_impossible_and_malformed_input():
    p = recommend("llama-3.1-70b", 24, 8192, measurements={})
    assert p.status == "impossible" and p.max_concurrency == 0 and p.suggestions
    z = recommend("llama-3.1-8b", 0, 8192, measurements={})
    assert z.status == "impossible" and z.max_concurrency >= 0
    with pytest.raises(ValueError, match="did you mean"):
        recommend("llama-3-8", 24, 8192)
    with pytest.raises(ValueError, match="quality"):
        recommend("llama-3.1-8b", 24, 8192, quality="best")
    with pytest.raises(ValueError, match="weight_bits"):
        recommend("llama-3.1-8b", 24, 8192, weight_bits=5)
    with pytest.raises(ValueError, match="gpu_memory_gb"):
        recommend("llama-3.1-8b", -1, 8192)
    with pytest.raises(ValueError, match="context_len"):
        recommend("llama-3.1-8b", 24, 0)
    with pytest.raises(TypeError, match="concurrency"):
        recommend("llama-3.1-8b", 24, 8192, concurrency=1.5)
    with pytest.raises(ValueError, match="num_gpus"):
        recommend("llama-3.1-8b", 24, 8192, num_gpus=3)


def test_quality_levels_are_ordered():
    kvs = [
        recommend("llama-3.1-8b", 24, 32768, 8, quality=q, measurements={}) for q in plan.QUALITIES
    ]
    assert kvs[0].kv == "fp16" and kvs[0].status == "reduced"
    assert [p.max_concurrency for p in kvs] == sorted(p.max_concurrency for p in kvs)


def test_to_dict_is_json():
    import json

    d = recommend("llama-3.1-8b", 24, 32768, 4, measurements=MEAS).to_dict()
    assert json.loads(json.dumps(d))["kv"] == "int4"


def _write(path, data) -> str:
    import json

    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def test_reasons_cite_a_measurements_file_by_path_or_env(tmp_path, monkeypatch):
    data = {
        "model": "TinyTest-1M",
        "date": "2031-01-02",
        "source": "benchmarks/bench_cache.py",
        "caches": {
            "fp16-dynamic": {"perplexity": 20.0},
            # no stored delta: derived from the perplexities (+1.5 %)
            "kvlib-int4": {"perplexity": 20.3, "bytes_ratio_vs_fp16": 0.3},
        },
    }
    path = _write(tmp_path / "m.json", data)
    assert plan.measured_cost("int4", plan.load_measurements(path)) == pytest.approx(
        {"perplexity": 20.3, "perplexity_delta_pct": 1.5, "bytes_ratio_vs_fp16": 0.3}
    )
    by_path = recommend("llama-3.1-8b", 24, 32768, concurrency=4, measurements=path)
    monkeypatch.setenv(plan.MEASUREMENTS_ENV, path)
    by_env = recommend("llama-3.1-8b", 24, 32768, concurrency=4)
    for p in (by_path, by_env):
        note = next(r for r in p.reasons if r.startswith("int4:"))
        assert "+1.5 % perplexity" in note and "0.3× the fp16 bytes" in note
        assert "TinyTest-1M" in note and "2031-01-02" in note
    # int8 is absent from this file: said so, no number invented
    p8 = recommend("llama-3.1-8b", 80, 131072, concurrency=4)
    assert p8.kv == "int8" and any("int8: quality cost not measured" in r for r in p8.reasons)


def test_bad_measurements_files_raise(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not exist"):
        plan.load_measurements(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not valid JSON"):
        plan.load_measurements(bad)
    monkeypatch.setenv(plan.MEASUREMENTS_ENV, _write(tmp_path / "list.json", [1, 2]))
    with pytest.raises(ValueError, match="'caches' mapping"):
        recommend("llama-3.1-8b", 24, 8192)
    with pytest.raises(TypeError, match="measurements"):
        recommend("llama-3.1-8b", 24, 8192, measurements=42)


def test_pca_idle_storage_only_for_many_conversations():
    meas = {**MEAS, "pca": {"compression_vs_fp16": 6.5, "perplexity_delta_pct": 0.4}}
    chat = recommend("llama-3.1-8b", 80, 8192, concurrency=32, measurements=meas)
    assert chat.idle_storage == "pca" and chat.paging
    assert any("6.5× smaller than fp16" in r and "+0.4 %" in r for r in chat.reasons)
    solo = recommend("llama-3.1-8b", 80, 8192, concurrency=1, measurements=meas)
    assert solo.idle_storage is None and not solo.paging and solo.engine == "transformers"
    few = recommend("llama-3.1-8b", 80, 8192, concurrency=4, measurements=meas)
    assert few.idle_storage is None and few.paging  # several sequences: paged engine, no PCA


def test_buys_compares_with_fp16():
    p = recommend("llama-3.1-8b", 24, 32768, concurrency=4, measurements={})
    assert p.kv == "int4" and p.max_concurrency > p.max_concurrency_fp16
    assert (
        f"{p.max_concurrency} sequences" in p.buys and f"against {p.max_concurrency_fp16}" in p.buys
    )
    assert p.max_context > p.max_context_fp16 and f"{p.max_context:,}" in p.buys
    assert "buys: " in p.summary() and p.to_dict()["buys"] == p.buys
    none = recommend("llama-3.1-70b", 24, 8192, measurements={})
    assert "not one sequence fits" in none.buys


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(memory.list_specs()),
    gb=st.floats(0, 400, allow_nan=False),
    ctx=st.integers(1, 1 << 18),
    conc=st.integers(1, 512),
    quality=st.sampled_from(plan.QUALITIES),
    wbits=st.sampled_from(plan.WEIGHT_BITS),
)
def test_plans_are_consistent_and_never_negative(name, gb, ctx, conc, quality, wbits):
    p = recommend(name, gb, ctx, conc, quality=quality, weight_bits=wbits, measurements={})
    assert min(p.max_concurrency, p.max_concurrency_fp16, p.max_context, p.max_context_fp16) >= 0
    if p.status == "ok":
        assert p.kv in plan.QUALITY_LADDER[quality] and p.max_concurrency >= conc
    elif p.status == "reduced":
        assert p.kv == plan.QUALITY_LADDER[quality][-1] and 1 <= p.max_concurrency < conc
    else:
        assert p.status == "impossible" and p.kv is None and p.max_concurrency == 0
    if p.status != "ok":
        assert p.suggestions  # says what would fit
    if p.kv not in (None, "fp16"):
        assert p.max_concurrency_fp16 < conc  # quantized only when fp16 does not fit them all
    more = recommend(name, gb + 8, ctx, conc, quality=quality, weight_bits=wbits, measurements={})
    assert more.max_concurrency_fp16 >= p.max_concurrency_fp16  # more memory never fits fewer


def test_results_tables_reads_markdown_tables(tmp_path):
    text = """# Measured results
intro | not a table
## Paged (kvlib.paged)
_Not yet measured._
### Serving simulation (seed 0)

| policy | waste % |
|---|---:|
| contiguous-max | 77.64 |
| paged | 1.61 |

## Empty section
_Not yet measured._
"""
    tables = plan.results_tables(text)
    assert list(tables) == ["Serving simulation (seed 0)"]
    assert tables["Serving simulation (seed 0)"] == [
        [{"policy": "contiguous-max", "waste %": "77.64"}, {"policy": "paged", "waste %": "1.61"}]
    ]
    path = tmp_path / "RESULTS.md"
    path.write_text(text, encoding="utf-8")
    assert plan.load_results(path) == tables
    with pytest.raises(ValueError, match="does not exist"):
        plan.load_results(tmp_path / "missing.md")


def test_to_transformers_settings_run_in_generate(model, eval_ids):
    """Each plan's transformers settings are accepted by generate() on the bundled model; with
    a short prompt (inside the 128-token full-precision window) the tokens match fp16's."""
    import torch

    found: dict[str, plan.Plan] = {}
    for gb in [1.35 + 0.0025 * i for i in range(200)]:
        p = recommend(model, gb, 2048, concurrency=4, measurements={})
        if p.fits and p.kv not in found:
            found[p.kv] = p
    assert set(found) == {"fp16", "int8", "int4"}
    assert found["fp16"].spec.num_params == sum(p.numel() for p in model.parameters())
    ids = eval_ids[:, :16]
    ref = None
    for kv in ("fp16", "int8", "int4"):
        kwargs = found[kv].to_transformers()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=2, do_sample=False, **kwargs)
        ref = out if ref is None else ref
        assert torch.equal(out, ref), kv


def test_measured_cost_reads_harness_field_names():
    meas = {
        "caches": {
            "dynamic": {"ppl": 8.0, "bytes_per_token": 46080},
            "kvlib-int8": {"ppl_delta_pct": 0.05, "bytes_per_token": 12960},
            "kvlib-int2": {"ppl": 9.0, "cache_bytes": 10},
        }
    }
    assert plan.measured_cost("fp16", meas) == {
        "perplexity": 8.0,
        "perplexity_delta_pct": 0.0,
        "bytes_ratio_vs_fp16": 1.0,
    }
    assert plan.measured_cost("int8", meas) == pytest.approx(
        {"perplexity_delta_pct": 0.05, "bytes_ratio_vs_fp16": 12960 / 46080}
    )
    # int2 has cache_bytes but fp16 does not: no ratio is made up
    assert plan.measured_cost("int2", meas) == pytest.approx(
        {"perplexity": 9.0, "perplexity_delta_pct": 12.5}
    )
    assert plan.measured_cost("int4", meas) == {}
    every = plan.measured_caches(meas)
    assert list(every) == ["dynamic", "kvlib-int8", "kvlib-int2"]
    assert every["kvlib-int8"] == plan.measured_cost("int8", meas)
    assert every["dynamic"]["perplexity_delta_pct"] == 0.0 and plan.measured_caches({}) == {}
    assert "int4: quality cost not measured" in plan.quality_note("int4", meas)
    with pytest.raises(ValueError, match="setting must be one of"):
        plan.measured_cost("int5", meas)


def test_measured_byte_ratio_either_way_round():
    """bench_cache.py stores "× smaller than fp16" (> 1); bytes per token of a registry model win."""
    meas = {
        "model": "SmolLM2-135M",  # 23,040 fp16 KV bytes per token
        "caches": {
            "fp16-dynamic": {"perplexity": 10.0, "bytes_per_token": 46080},  # fp32 cache
            "kvlib-int8": {"perplexity_delta_pct": 0.1, "bytes_ratio_vs_fp16": 1.8},
            "kvlib-int4": {"bytes_ratio_vs_fp16": 9.9, "bytes_per_token": 5760},
        },
    }
    assert plan.measured_cost("int8", meas)["bytes_ratio_vs_fp16"] == pytest.approx(1 / 1.8)
    assert plan.measured_cost("int4", meas)["bytes_ratio_vs_fp16"] == pytest.approx(0.25)
    assert plan.measured_caches(meas)["fp16-dynamic"]["bytes_ratio_vs_fp16"] == pytest.approx(2.0)
    assert "0.25× the fp16 bytes" in plan.quality_note("int4", meas)
