"""kvlib.plan.planner: the scenarios of the configuration guide, each with its expected recommendation,
and what ``recommend`` checks and returns (the rule alone: test_plan_rule.py; its words:
test_plan_text.py; engine settings: test_plan_engines.py)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import memory, specs
from kvlib import results as results_mod
from kvlib.caches import layout as cache_layout
from kvlib.caches import registry as cache_registry
from kvlib.plan import budget as plan_budget
from kvlib.plan import engine_support, engines
from kvlib.plan import rule as plan_rule
from kvlib.plan.measured import quality_note
from kvlib.plan.planner import Plan, recommend
from kvlib.results import RESULTS_ENV


def _run(rows, **meta):
    return {
        "source": "benchmarks/bench_cache.py",
        "command": "python benchmarks/bench_cache.py",
        "machine": "test",
        "date": "2026-12-02",
        "model": "SmolLM2-135M",
        **meta,
        "rows": rows,
    }


MEAS = {
    "schema_version": 1,
    "runs": {
        "cache": _run(
            {
                "dynamic-fp32": {"perplexity": 10.0, "perplexity_delta_pct": 0.0},
                "kvlib-int8": {"perplexity": 10.001, "perplexity_delta_pct": 0.01},
                "kvlib-int4": {
                    "perplexity": 10.08,
                    "perplexity_delta_pct": 0.8,
                    "x_smaller_than_fp16": 3.5,
                },
                "hf-fp8": {"perplexity": 10.05, "perplexity_delta_pct": 0.5},
            }
        )
    },
}


@pytest.fixture(params=["measured", "unmeasured"])
def meas(request):
    return MEAS if request.param == "measured" else {}


def _fits(p, bits, group_size=None, group_meta_bits=0, tp=1):
    """Sequences of the plan's context whose cache fits its KV budget, from kvlib.memory's bytes
    (per GPU: ``tp`` GPUs split the KV heads)."""
    one = memory.kv_cache_bytes(
        p.spec, p.context_len, 1, bits, group_size=group_size, group_meta_bits=group_meta_bits
    )
    return max(p.budget.kv_budget_bytes, 0) // -(-one // tp)


def test_8b_on_24gb_at_32k_one_user_keeps_fp16(meas):
    """One user whose fp16 cache fits: a serving engine (vLLM) at its model dtype; every
    engine's own settings keep fp16 too."""
    p = recommend("llama-3.1-8b", 24, 32768, results=meas)
    assert (p.status, p.kv, p.engine, p.kv_type) == ("ok", "fp16", "vllm", "auto")
    assert p.to_transformers() == {"cache": "dynamic-fp16", "batch_size": 1}
    assert p.to_llama_cpp()["--cache-type-k"] == "f16" and p.to_llama_cpp()["-fa"] == "auto"
    assert "kv_cache_dtype" not in p.to_vllm() and p.to_vllm()["max_num_seqs"] == 1  # auto
    assert [o.kv for o in p.options.values()] == ["fp16"] * 3  # every engine keeps fp16


def test_one_sequence_goes_to_transformers_only_where_no_serving_engine_holds_it():
    """One sequence on one GPU: vLLM, then llama.cpp, and transformers (kvlib's cache) only where
    neither holds it; kvlib's int2 goes below llama.cpp's q4_0, so at quality='aggressive' it is
    the one that does."""
    tight = recommend("llama-3.1-8b", 20, 65536, quality="aggressive", results={})
    assert (tight.engine, tight.kv_type, tight.status) == ("transformers", "kvlib-int2", "ok")
    assert tight.options["vllm"].kv is None and tight.options["llama.cpp"].kv is None
    assert any(
        r.startswith("one sequence on one GPU that neither serving engine holds")
        for r in tight.reasons
    )
    # the same request at 'balanced' stops at int4: nothing holds it, and the first engine is named
    balanced = recommend("llama-3.1-8b", 20, 65536, results={})
    assert balanced.status == "impossible" and balanced.kv is None
    # where llama.cpp's q4_0 holds it, llama.cpp serves it
    q4 = recommend("llama-3.1-8b", 24, 131072)
    assert (q4.engine, q4.kv_type) == ("llama.cpp", "q4_0") and q4.options[
        "transformers"
    ].kv == "int4"
    # vLLM's fp8 too, though kvlib-int4 stores fewer bits at a lower measured cost: said why
    fp8 = recommend("llama-3.1-8b", 24, 65536)
    assert (fp8.engine, fp8.kv_type) == ("vllm", "fp8")
    why = next(r for r in fp8.reasons if r.startswith("kvlib-int4 on transformers would store"))
    assert "for one sequence the plan prefers a serving engine" in why


def test_8b_on_24gb_at_32k_four_users_int4(meas):
    """Four users at 32k: vLLM's lowest type (fp8, it has no 4-bit one) holds only two, so the
    plan takes the next engine, llama.cpp, at the lowest level that fits all four: q4_0."""
    p = recommend("llama-3.1-8b", 24, 32768, concurrency=4, results=meas)
    assert (p.status, p.kv, p.kv_type, p.engine, p.paging) == (
        "ok",
        "int4",
        "q4_0",
        "llama.cpp",
        False,
    )
    n_q8, n_q4 = _fits(p, 8, 32, 16), _fits(p, 4, 32, 16)  # ggml blocks of 32, one fp16 scale
    n_fp16, n_fp8 = _fits(p, 16), _fits(p, 8)
    assert n_fp16 < n_q8 < 4 <= n_q4  # int4 is the highest level that fits all four
    assert p.max_concurrency == n_q4 and p.max_concurrency_fp16 == n_fp16
    assert dict(p.sequences_by_setting) == {"fp16": n_fp16, "int8": n_q8, "int4": n_q4}
    ll = p.to_llama_cpp()
    assert ll["--cache-type-k"] == ll["--cache-type-v"] == "q4_0" and ll["-fa"] == "on"
    assert ll["-np"] == 4 and ll["-c"] == 4 * 32768
    # vLLM, the first choice for several sequences, holds only what fits at fp8
    assert p.options["vllm"].status == "reduced" and n_fp8 < 4
    v = p.to_vllm()
    assert v["kv_cache_dtype"] == "fp8" and v["max_model_len"] == 32768
    # the ceiling on vLLM's batch is the traffic: paging admits what fits as sequences grow
    assert v["max_num_seqs"] == 4 and v["kv_cache_memory_bytes"] == p.budget.kv_budget_bytes
    # a typical length sizes it by what the paged cache admits there (whole 16-token blocks)
    typical = recommend("llama-3.1-8b", 24, 32768, concurrency=4, typical_context=9000)
    admitted = _fits(dataclasses.replace(typical, context_len=9008), 8)
    assert typical.to_vllm()["max_num_seqs"] == min(4, admitted)
    assert any(
        r.startswith(f"vllm cannot hold the whole request (fp8 fits {n_fp8} of 4)")
        for r in p.reasons
    )
    n_kvlib4 = _fits(p, 4, 32, 32)  # kvlib-int4: groups of 32, fp16 scale + zero point
    assert p.to_transformers() == {"cache": "kvlib-int4", "batch_size": min(4, n_kvlib4)}
    # q4_0 is not measured: the reason says so and cites kvlib's int4 cache
    note = next(r for r in p.reasons if r.startswith("q4_0 (llama.cpp) is not measured"))
    if meas:
        assert "(kvlib-int4): +0.8 % perplexity" in note
        assert "2026-12-02" in note and "bench_cache" in note
    else:
        assert "int4 (kvlib-int4): quality cost not measured" in note and "%" not in note


def test_a_4_bit_cache_plan_says_when_8_bit_weights_would_keep_8_bit_kv():
    """Four users at 32k on 24 GiB fit only at int4 with 16-bit weights; with 8-bit weights the
    whole request fits at int8. The plan keeps the user's weights and says so in a watch line,
    with both KV types' measured costs, and the 8-bit-weight plan agrees with the line."""
    p = recommend("llama-3.1-8b", 24, 32768, concurrency=4)
    line = next(w for w in p.watch if w.startswith("8-bit weights would leave the cache"))
    eight = recommend("llama-3.1-8b", 24, 32768, concurrency=4, weight_bits=8)
    assert (eight.status, eight.kv) == ("ok", "int8")
    assert (
        f"at int8 ({eight.kv_type} on {eight.engine}) instead of int4 (q4_0 on llama.cpp)" in line
    )
    measured = engines.measured_llama_cpp()
    assert f"{measured['q4_0']:+.3g} %" in line and "bench_engines.py" in line
    assert "not measured here" in line
    # nothing to say where the plan already keeps 8 bits, or the weights are already 8-bit
    assert not any(w.startswith("8-bit weights would") for w in eight.watch)
    chat = recommend("llama-3.1-8b", 79.65, 8192, concurrency=64)
    assert chat.kv == "int8" and not any("would leave the cache" in w for w in chat.watch)
    # with no measurements the line still names the trade and cites nothing
    bare = recommend("llama-3.1-8b", 24, 32768, concurrency=4, results={})
    line = next(w for w in bare.watch if w.startswith("8-bit weights would leave the cache"))
    assert "as measured" not in line and "%" not in line


def test_70b_on_2x80gb_tensor_parallel():
    # worst case (every sequence at 32k): llama.cpp's layer split at q4_0 guarantees more
    worst = recommend("llama-3.1-70b", 80, 32768, concurrency=16, num_gpus=2, results={})
    assert (worst.engine, worst.kv_type) == ("llama.cpp", "q4_0")
    assert worst.options["llama.cpp"].sequences > worst.options["vllm"].sequences == 1
    # conversations of ~2k tokens: vLLM's paged cache admits all 16 at fp8, so vLLM serves them
    p = recommend(
        "llama-3.1-70b", 80, 32768, concurrency=16, num_gpus=2, typical_context=2048, results={}
    )
    assert p.status == "reduced" and (p.kv, p.kv_type) == ("int8", "fp8")
    assert p.tensor_parallel_size == 2 and p.engine == "vllm" and p.options["vllm"].holds
    assert list(p.options) == ["vllm", "llama.cpp"]  # llama.cpp splits the layers
    with pytest.raises(ValueError, match="no transformers settings"):
        p.to_transformers()
    # each GPU holds 4 of the 8 KV heads: half of every sequence's cache
    assert p.kv_bytes_per_sequence == memory.kv_cache_bytes(p.spec, 32768, 1, 8) // 2
    assert p.max_concurrency == _fits(p, 8, tp=2) == 1
    v = p.to_vllm()
    assert v["tensor_parallel_size"] == 2 and v["kv_cache_dtype"] == "fp8"
    assert v["max_num_seqs"] == 16 and "quantization" not in v
    # with 8-bit weights vLLM guarantees 14 of the 16 at the full context, with 4-bit weights all
    # of them: the suggestion names the engine and KV type that request's own plan gets
    assert "weight_bits=4: the whole request with fp8 on vllm" in p.suggestions
    again = recommend(
        "llama-3.1-70b", 80, 32768, 16, weight_bits=4, num_gpus=2, typical_context=2048, results={}
    )
    assert (again.status, again.engine, again.kv_type) == ("ok", "vllm", "fp8")
    p4 = recommend("llama-3.1-70b", 80, 32768, 16, weight_bits=4, num_gpus=2, results={})
    assert p4.fits and p4.to_vllm()["max_num_seqs"] == 16
    p8 = recommend("llama-3.1-70b", 80, 32768, 16, weight_bits=8, num_gpus=2, results={})
    assert p8.options["vllm"].sequences == _fits(p8, 8, tp=2) > p.max_concurrency
    assert p8.to_vllm()["quantization"] == "fp8"


def test_1b_on_laptop_cpu():
    p = recommend("llama-3.2-1b", 16, 8192, device="cpu", results={})
    assert (p.status, p.kv, p.engine) == ("ok", "fp16", "llama.cpp")
    assert p.to_llama_cpp()["-ngl"] == 0 and p.to_llama_cpp()["-c"] == 8192


def test_long_document_rag_128k():
    p = recommend("llama-3.1-8b", 80, 131072, concurrency=4, results={})
    assert (p.status, p.kv) == ("ok", "int8")
    assert p.max_concurrency_fp16 == 3
    v = p.to_vllm()
    assert v["kv_cache_dtype"] == "fp8" and v["max_model_len"] == 131072 and v["max_num_seqs"] == 4


def test_chat_service_64_users():
    p = recommend("llama-3.1-8b", 80, 8192, concurrency=64, results={})
    assert (p.kv, p.engine, p.paging, p.idle_storage) == ("int8", "vllm", True, "prefix-caching")
    assert p.to_vllm()["max_num_seqs"] == 64
    idle = [r for r in p.reasons if r.startswith("64 conversations: between turns")]
    assert len(idle) == 1 and "vLLM's prefix caching" in idle[0]
    assert (
        "pca: storage figures not measured" in idle[0]
        and "vLLM cannot load a PCA-coded cache" in idle[0]
    )


def test_colab_t4_7b_needs_lower_weight_bits():
    p = recommend("qwen2.5-7b", 16, 8192, results={})
    assert p.status == "impossible" and p.kv is None and p.max_concurrency == 0
    assert any(s.startswith("weight_bits=8") for s in p.suggestions)
    with pytest.raises(ValueError, match="not one sequence"):
        p.to_vllm()
    p4 = recommend("qwen2.5-7b", 16, 8192, weight_bits=4, results={})
    assert p4.fits and p4.kv == "fp16"


def test_deepseek_v3_mla_replicated_latent():
    p = recommend("deepseek-v3", 141, 131072, concurrency=8, weight_bits=8, num_gpus=8, results={})
    assert p.fits and p.kv == "int8" and p.to_vllm()["tensor_parallel_size"] == 8
    spec = specs.get_spec("deepseek-v3")
    assert p.kv_bytes_per_sequence_fp16 == memory.kv_cache_bytes(spec, 131072)  # not sharded
    assert any("MLA" in w for w in p.watch)


def test_gemma2_sliding_window_counts_capped_layers():
    p = recommend("gemma-2-9b", 48, 8192, concurrency=8, results={})
    spec = specs.get_spec("gemma-2-9b")
    full = specs.ModelSpec("full", 42, 16, 8, 256, num_params=spec.num_params)
    assert p.kv_bytes_per_sequence_fp16 == memory.kv_cache_bytes(spec, 8192)
    assert p.kv_bytes_per_sequence_fp16 < memory.kv_cache_bytes(full, 8192)
    # kvlib's caches quantize only the global layers of a hybrid model, and the plan prices so
    assert list(plan_rule.kv_types("transformers", spec)) == list(engines.planned("transformers"))
    assert _fits(p, 16) >= 8 and p.to_transformers() == {"cache": "dynamic-fp16", "batch_size": 8}
    # one sequence that fits only below fp16: kvlib's int8 cache, windows in fp16
    # (one sequence goes to a serving engine first: vLLM's fp8, windows priced as vLLM keeps them)
    one = recommend("gemma-2-9b", 22, 8192, results={})
    assert (one.status, one.engine, one.kv_type) == ("ok", "vllm", "fp8")
    assert _fits(one, 16) == 0 < _fits(one, 8)
    assert one.options["transformers"].kv_type == "kvlib-int8"
    # transformers when nothing else holds it: kvlib's int2 cache, windows in fp16
    low = recommend("gemma-2-9b", 26, 131072, quality="aggressive", results={})
    assert (low.status, low.engine, low.kv_type) == ("ok", "transformers", "kvlib-int2")
    int2 = low.kv_storage
    assert int2.window_bits == 16
    assert low.kv_bytes_per_sequence == memory.kv_cache_bytes(
        spec, 131072, bits=2, group_size=int2.group_size, window_bits=16
    )
    assert any("quantizes the 21 global layers only" in w for w in low.watch)


@pytest.mark.parametrize("name", ["gemma-2-9b", "gemma-3-27b", "gemma-3-270m", "mistral-7b-v0.1"])
@pytest.mark.parametrize("level", ["int8", "int4", "int2"])
def test_the_plan_prices_kvlibs_cache_on_a_hybrid_model_from_above_and_within_8_percent(
    name, level
):
    """The planner's bytes for kvlib's cache on a sliding-window model against the cache's exact
    layout (:func:`kvlib.memory.quantized_cache_bytes`: fp16 windows, sinks and residual,
    per-channel key groups): never below at long contexts, and close."""
    spec = specs.get_spec(name)
    t = plan_rule.kv_types("transformers", spec)[level]
    for ctx in (8192, 32768):
        planned = plan_budget.kv_sequence_bytes(spec, ctx, t.storage)
        exact = memory.quantized_cache_bytes(
            spec,
            ctx,
            key_bits=t.bits,
            value_bits=t.bits,
            group_size=cache_layout.default_group_size(spec.head_dim),
            key_group_size=cache_layout.default_key_group_size(
                t.bits, cache_layout.RESIDUAL_LENGTH
            ),
            residual_length=cache_layout.RESIDUAL_LENGTH,
            sink_tokens=cache_layout.SINK_TOKENS,
        )
        assert exact <= planned <= 1.08 * exact, (ctx, planned, exact)


def test_impossible_and_malformed_input():
    p = recommend("llama-3.1-70b", 24, 8192, results={})
    assert p.status == "impossible" and p.max_concurrency == 0 and p.suggestions
    z = recommend("llama-3.1-8b", 0, 8192, results={})
    assert z.status == "impossible" and z.max_concurrency >= 0
    with pytest.raises(ValueError, match="did you mean"):
        recommend("llama-3-8", 24, 8192)
    with pytest.raises(ValueError, match="quality"):
        recommend("llama-3.1-8b", 24, 8192, quality="best")
    with pytest.raises(ValueError, match="weight_bits must be one of 16, 8, 4"):
        recommend("llama-3.1-8b", 24, 8192, weight_bits=5)
    with pytest.raises(ValueError, match="gpu_memory_gb"):
        recommend("llama-3.1-8b", -1, 8192)
    with pytest.raises(ValueError, match="gpu_memory_gb must be finite"):
        recommend("llama-3.1-8b", float("nan"), 8192)
    with pytest.raises(TypeError, match="gpu_memory_gb"):
        recommend("llama-3.1-8b", "24", 8192)
    with pytest.raises(ValueError, match="context_len"):
        recommend("llama-3.1-8b", 24, 0)
    with pytest.raises(TypeError, match="concurrency"):
        recommend("llama-3.1-8b", 24, 8192, concurrency=1.5)
    with pytest.raises(ValueError, match="num_gpus"):
        recommend("llama-3.1-8b", 24, 8192, num_gpus=3)
    with pytest.raises(ValueError, match="device"):
        recommend("llama-3.1-8b", 24, 8192, device="tpu")
    with pytest.raises(ValueError, match="num_gpus must be 1"):
        recommend("llama-3.1-8b", 24, 8192, num_gpus=2, device="cpu")
    with pytest.raises(TypeError, match="model must be"):
        recommend(3.5, 24, 8192)


def test_quality_levels_are_ordered():
    kvs = [
        recommend("llama-3.1-8b", 24, 32768, 8, quality=q, results={}) for q in plan_rule.QUALITIES
    ]
    assert kvs[0].kv == "fp16" and kvs[0].status == "reduced"
    assert [p.max_concurrency for p in kvs] == sorted(p.max_concurrency for p in kvs)


def test_to_dict_is_json_with_stable_keys():
    """``kvlib plan --json`` prints this dict: its keys, in this order, are an interface."""
    import json

    p = recommend("llama-3.1-8b", 24, 32768, 4, results=MEAS)
    d = json.loads(json.dumps(p.to_dict()))
    assert list(d) == [
        *["model", "device", "gpu_memory_gb", "num_gpus", "context_len", "concurrency"],
        *["quality", "weight_bits", "status", "kv", "kv_type", "engine", "paging"],
        *["idle_storage", "tensor_parallel_size", "kv_bytes_per_sequence"],
        *["kv_bytes_per_sequence_fp16", "max_concurrency", "max_concurrency_fp16"],
        *["max_context", "max_context_fp16", "typical_context", "engines", "reasons", "watch"],
        *["suggestions", "spec"],
        *["budget", "fits", "buys", "sequences_by_setting", "types_by_setting", "options"],
        *["eviction", "transformers", "vllm", "llama_cpp"],
    ]
    assert (d["kv"], d["kv_type"], d["engine"], d["engines"]) == ("int4", "q4_0", "llama.cpp", None)
    assert d["reasons"] == list(p.reasons)
    assert d["vllm"] == p.to_vllm() and d["llama_cpp"] == p.to_llama_cpp()
    assert d["transformers"] == p.to_transformers()
    assert d["budget"]["device_bytes"] == 24 * 2**30  # GiB, as the card is labelled
    assert list(d["sequences_by_setting"]) == list(engines.planned("llama.cpp"))  # fp16 … int4
    assert list(d["options"]) == list(engines.ENGINES)
    for engine, option in d["options"].items():
        assert option["engine"] == engine and engines.accepts(engine, option["kv_type"])
    assert d["options"]["vllm"]["kv_type"] == d["vllm"]["kv_cache_dtype"] == "fp8"
    assert d["options"]["llama.cpp"]["kv_type"] == d["llama_cpp"]["--cache-type-k"] == "q4_0"
    none = recommend("llama-3.1-70b", 24, 8192, results={}).to_dict()
    assert none["suggestions"] and none["fits"] is False
    for key in ("transformers", "vllm", "llama_cpp"):
        assert list(none[key]) == ["unsupported"] and "not one sequence" in none[key]["unsupported"]
    cpu = recommend("llama-3.2-1b", 16, 8192, device="cpu", results={}).to_dict()
    assert list(cpu["options"]) == ["llama.cpp"] and cpu["llama_cpp"]["-ngl"] == 0
    assert "a CPU plan runs llama.cpp" in cpu["vllm"]["unsupported"]
    assert "a CPU plan runs llama.cpp" in cpu["transformers"]["unsupported"]


def test_plan_is_its_decision_plus_words():
    """recommend() = plan_rule.decide() (the numbers) + plan_text (the words)."""
    p = recommend("llama-3.1-8b", 24, 32768, 16, results={})
    d = plan_rule.decide(specs.get_spec("llama-3.1-8b"), 24, 32768, 16, model="llama-3.1-8b")
    assert isinstance(p, plan_rule.Decision)
    for f in dataclasses.fields(plan_rule.Decision):
        assert getattr(p, f.name) == getattr(d, f.name), f.name
    assert p.status == "reduced" and p.reasons and p.watch and p.suggestions


def _write(path, data) -> str:
    import json

    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def test_reasons_cite_a_results_file_by_path_or_env(tmp_path, monkeypatch):
    """Each engine's type cites what measures it: vLLM's fp8 the registry's hf-fp8, kvlib's
    caches themselves; llama.cpp's q4_0 is not measured, which the reason says, citing kvlib's
    cache of the same level."""
    data = {
        "schema_version": 1,
        "runs": {
            "cache": _run(
                {
                    "kvlib-int4": {"perplexity_delta_pct": 1.5, "x_smaller_than_fp16": 3.3},
                    "kvlib-int2": {"perplexity_delta_pct": 6.5, "x_smaller_than_fp16": 5.2},
                    "hf-fp8": {"perplexity_delta_pct": 0.75, "x_smaller_than_fp16": 2.0},
                },
                model="TinyTest-1M",
                date="2031-01-02",
            )
        },
    }
    path = _write(tmp_path / "m.json", data)

    def plans(**kw):
        return (
            recommend("llama-3.1-8b", 24, 16384, concurrency=4, **kw),  # vLLM, fp8
            recommend("llama-3.1-8b", 20, 65536, quality="aggressive", **kw),  # kvlib-int2
            recommend("llama-3.1-8b", 24, 32768, concurrency=4, device="cpu", **kw),  # q4_0
        )

    by_path = plans(results=path)
    monkeypatch.setenv(RESULTS_ENV, path)
    by_env = plans()
    for vllm, hf, cpu in (by_path, by_env):
        assert (vllm.kv_type, hf.kv_type, cpu.kv_type) == ("fp8", "kvlib-int2", "q4_0")
        fp8 = next(r for r in vllm.reasons if "(hf-fp8):" in r)
        assert fp8.startswith("fp8 (hf-fp8): +0.75 % perplexity, 2× smaller than fp16")
        int2 = next(r for r in hf.reasons if r.startswith("kvlib-int2:"))
        assert "+6.5 % perplexity" in int2 and "5.2× smaller than fp16" in int2
        q4 = next(r for r in cpu.reasons if r.startswith("q4_0 (llama.cpp) is not measured"))
        assert "(kvlib-int4): +1.5 % perplexity" in q4
        for note in (fp8, int2, q4):
            assert "TinyTest-1M" in note and "2031-01-02" in note
    # int8 (kvlib-int8, q8_0) is absent from this file: said so, no number invented
    q8 = recommend("llama-3.1-8b", 24, 32768, device="cpu")
    assert q8.kv_type == "q8_0" and any(
        r.startswith("q8_0 (llama.cpp) is not measured")
        and "int8 (kvlib-int8): quality cost not measured" in r
        for r in q8.reasons
    )


def test_the_package_results_are_cited_by_default():
    p = recommend("llama-3.1-8b", 24, 16384, concurrency=4)
    assert p.kv_type == "fp8"
    # vLLM's fp8 is cited from vLLM's own run, naming the engine and the device
    note = next(r for r in p.reasons if r.startswith("fp8 (vLLM):"))
    assert "bench_vllm.py" in note and "with vLLM on a CPU" in note
    assert "not measured" not in " ".join(p.reasons)
    t = recommend("llama-3.1-8b", 20, 65536, quality="aggressive")
    assert t.kv_type == "kvlib-int2"
    note = next(r for r in t.reasons if r.startswith("kvlib-int2:"))
    assert "bench_cache.py" in note and "not measured" not in " ".join(t.reasons)


def test_every_setting_names_a_registry_cache():
    from kvlib.caches import registry as cache_registry

    for setting in plan_rule.KV_SETTINGS.values():
        assert cache_registry.cache_info(setting.cache_name).bits == setting.bits


def test_bad_results_files_raise(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not exist"):
        recommend("llama-3.1-8b", 24, 8192, results=tmp_path / "missing.json")
    monkeypatch.setenv(RESULTS_ENV, _write(tmp_path / "list.json", [1, 2]))
    with pytest.raises(ValueError, match="'runs' mapping"):
        recommend("llama-3.1-8b", 24, 8192)
    with pytest.raises(TypeError, match="results"):
        recommend("llama-3.1-8b", 24, 8192, results=42)


def test_pca_idle_storage_only_for_many_conversations():
    pca = _run(
        {
            "PCA cross-layer, target 12x": {
                "x_smaller_than_fp16": 6.5,
                "perplexity_delta_pct": 0.4,
            },
            "PCA cross-layer, target 32x": {
                "x_smaller_than_fp16": 9.3,
                "perplexity_delta_pct": 0.8,
            },
            "PCA per-layer, target 8x": {"x_smaller_than_fp16": 5.3, "perplexity_delta_pct": 1.3},
        },
        source="benchmarks/bench_pca.py",
    )
    meas = {**MEAS, "runs": {**MEAS["runs"], "pca": pca}}
    chat = recommend("llama-3.1-8b", 80, 8192, concurrency=32, results=meas)
    # vLLM cannot load a PCA-coded cache: its own prefix caching keeps idle conversations
    assert chat.idle_storage == "prefix-caching" and chat.paging
    assert any("6.5–9.3× smaller than fp16" in r and "+0.4 % … +0.8 %" in r for r in chat.reasons)
    assert "finished turns kept by prefix caching" in chat.summary()
    # a run on a hybrid model (its rows carry the ratio over the global layers) is read there:
    # its whole-cache ratios are capped by the windows of a short prefix
    hybrid = {
        name: {
            **r,
            "x_smaller_than_fp16": 1.5,
            "x_smaller_than_fp16_global_layers": 2 * r["x_smaller_than_fp16"],
        }
        for name, r in pca["rows"].items()
    }
    note = quality_note("pca", {"runs": {"pca": {**pca, "rows": hybrid}}})
    assert "13–18.6× smaller than fp16 over the global layers (sliding windows kept whole)" in note
    assert "1.5" not in note
    laptop = recommend("llama-3.1-8b", 64, 8192, concurrency=32, device="cpu", results=meas)
    assert laptop.engine == "llama.cpp" and laptop.idle_storage == "slot-reuse"
    assert any("--slot-save-path" in r and "llama.cpp cannot load" in r for r in laptop.reasons)
    solo = recommend("llama-3.1-8b", 80, 8192, concurrency=1, results=meas)
    assert solo.idle_storage is None and solo.engine == "vllm"  # one conversation: none idle
    few = recommend("llama-3.1-8b", 80, 8192, concurrency=4, results=meas)
    assert few.idle_storage is None and few.paging  # several sequences: paged engine, no PCA


def test_buys_compares_with_fp16():
    p = recommend("llama-3.1-8b", 24, 32768, concurrency=4, results={})
    assert p.kv_type == "q4_0" and p.max_concurrency > p.max_concurrency_fp16
    assert p.buys.startswith(f"q4_0 fits {p.max_concurrency} sequences")
    assert f"against {p.max_concurrency_fp16} at fp16" in p.buys
    assert p.max_context > p.max_context_fp16 and f"{p.max_context:,}" in p.buys
    assert f"against {p.max_context_fp16:,}" in p.buys
    assert "buys: " in p.summary() and p.to_dict()["buys"] == p.buys
    none = recommend("llama-3.1-70b", 24, 8192, results={})
    assert "not one sequence fits" in none.buys


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(specs.list_specs()),
    gb=st.floats(0, 400, allow_nan=False),
    ctx=st.integers(1, 1 << 18),
    conc=st.integers(1, 512),
    quality=st.sampled_from(plan_rule.QUALITIES),
    wbits=st.sampled_from(plan_rule.WEIGHT_BITS),
)
def test_plans_are_consistent_and_never_negative(name, gb, ctx, conc, quality, wbits):
    p = recommend(name, gb, ctx, conc, quality=quality, weight_bits=wbits, results={})
    assert min(p.max_concurrency, p.max_concurrency_fp16, p.max_context, p.max_context_fp16) >= 0
    runs = plan_rule.kv_types(p.engine, p.spec)  # the levels the plan's engine runs
    allowed = [level for level in plan_rule.QUALITY_LADDER[quality] if level in runs]
    assert p.lowest_setting == allowed[-1]
    if p.status == "ok":
        assert p.kv in allowed and p.max_concurrency >= conc
    elif p.status == "reduced":
        assert p.kv == allowed[-1] and 1 <= p.max_concurrency < conc
    else:
        assert p.status == "impossible" and p.kv is None and p.max_concurrency == 0
    if p.kv is not None:  # a type the engine accepts, and the plan's engine option agrees
        assert p.kv_type == runs[p.kv].name and engines.accepts(p.engine, p.kv_type)
        o = p.options[p.engine]
        assert (o.kv, o.kv_type, o.status, o.sequences) == (
            p.kv,
            p.kv_type,
            p.status,
            p.num_sequences,
        )
    for engine, o in p.options.items():
        assert o.kv is None or (engines.accepts(engine, o.kv_type) and 1 <= o.sequences <= conc)
    if p.status != "ok":
        assert p.suggestions  # says what would fit
    if p.kv not in (None, "fp16"):
        assert p.max_concurrency_fp16 < conc  # quantized only when fp16 does not fit them all
    more = recommend(name, gb + 8, ctx, conc, quality=quality, weight_bits=wbits, results={})
    assert more.max_concurrency_fp16 >= p.max_concurrency_fp16  # more memory never fits fewer


def test_to_transformers_settings_run_in_generate(model, eval_ids):
    """Each plan's transformers settings are accepted by generate() on the bundled model; with
    a short prompt (inside the 128-token full-precision window) the tokens match fp16's."""
    import torch

    found: dict[str, Plan] = {}
    for gb in [1.35 + 0.0025 * i for i in range(200)]:
        p = recommend(model, gb, 2048, concurrency=4, quality="aggressive", results={})
        t = p.options["transformers"]
        if t.status == "ok" and t.kv not in found:
            found[t.kv] = p
    assert set(found) == {"fp16", "int8", "int4", "int2"}
    assert found["fp16"].spec.num_params == sum(p.numel() for p in model.parameters())
    ids = eval_ids[:, :16]
    ref = None
    for kv in ("fp16", "int8", "int4", "int2"):
        p = found[kv]
        kwargs = p.to_transformers()
        assert kwargs == {"cache": engines.planned("transformers")[kv].name, "batch_size": 4}
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=2,
                do_sample=False,
                past_key_values=cache_registry.make_cache(kwargs["cache"], model.config),
            )
        ref = out if ref is None else ref
        assert torch.equal(out, ref), kv


def test_transformers_plans_cite_the_measured_decode_speed():
    """A plan on transformers with a quantized kvlib cache says what that costs in speed, from the
    kernel run's whole-model decode; without that run it says nothing it has not measured."""
    p = recommend("llama-3.1-8b", 20, 65536, concurrency=1, quality="aggressive")
    assert p.engine == "transformers" and p.kv not in (None, "fp16")
    speed = [w for w in p.watch if w.startswith("speed:")]
    decode = results_mod.run("kernel")["model_decode"]
    rows = decode["rows"]
    fused, torch_path, ref = (
        rows[n] for n in ("kvlib-int4 fused", "kvlib-int4 torch path", "dynamic-bf16")
    )
    assert len(speed) == 1
    assert f"{fused['decode_tokens_per_s']:g} tokens/s with its default fused kernel" in speed[0]
    assert f"({torch_path['decode_tokens_per_s']:g} on the torch path" in speed[0]
    assert f"against the bf16 cache's {ref['decode_tokens_per_s']:g}" in speed[0]
    assert "GPU (NVIDIA H200)" in speed[0] and "random weights" in speed[0]
    bare = recommend("llama-3.1-8b", 20, 65536, concurrency=1, quality="aggressive", results={})
    assert bare.engine == "transformers" and not any(w.startswith("speed:") for w in bare.watch)
    fp16 = recommend("llama-3.1-8b", 80, 8192, concurrency=1)
    assert fp16.kv == "fp16" and not any(w.startswith("speed:") for w in fp16.watch)


def test_llama_cpp_over_vllm_on_a_gpu_says_it_is_the_worst_case():
    p = recommend("llama-3.1-8b", 24, 32768, concurrency=4)
    assert p.engine == "llama.cpp" and p.device == "gpu"
    line = [w for w in p.watch if w.startswith("llama.cpp was chosen on the worst case")]
    o = p.options["vllm"]
    assert len(line) == 1 and f"vLLM's {o.kv_type} guarantees {o.sequences} of 4" in line[0]
    cpu = recommend("llama-3.2-1b", 16, 8192, concurrency=4, device="cpu")
    assert not any(w.startswith("llama.cpp was chosen") for w in cpu.watch)
    # where vLLM fits not one sequence, there is no trade to weigh and no line
    none = recommend("llama-3.1-8b", 24, 131072, concurrency=4)
    assert none.engine == "llama.cpp" and none.options["vllm"].kv is None
    assert not any(w.startswith("llama.cpp was chosen") for w in none.watch)


def test_lower_bit_weights_are_named_per_engine():
    """Each engine gets its own 8-bit weights: transformers runs FP8 only from compute
    capability 8.9 (it dequantizes below, doubling the weights), llama.cpp loads a Q8_0 GGUF,
    vLLM quantizes a 16-bit checkpoint as it loads (--quantization fp8) and reads one that ships
    FP8 weights as it is (no flag)."""
    gemma = recommend("gemma-3-27b", 34, 131072, weight_bits=8, quality="aggressive", results={})
    assert gemma.engine == "transformers"
    line = next(w for w in gemma.watch if w.startswith("8-bit weights cost quality"))
    assert "compute capability 8.9" in line and "bitsandbytes" in line
    cpu = recommend("llama-3.1-8b", 32, 8192, weight_bits=8, device="cpu", results={})
    line = next(w for w in cpu.watch if w.startswith("8-bit weights cost quality"))
    assert cpu.engine == "llama.cpp" and line.endswith("a Q8_0 GGUF")
    assert cpu.commands()["llama.cpp"].split()[2].endswith("-Q8_0.gguf")
    vllm = recommend(
        "llama-3.1-70b", 80, 32768, 16, weight_bits=8, num_gpus=2, typical_context=2048, results={}
    )
    line = next(w for w in vllm.watch if w.startswith("8-bit weights cost quality"))
    assert vllm.engine == "vllm" and "--quantization fp8" in line
    assert vllm.to_vllm()["quantization"] == "fp8"
    ds = recommend("deepseek-v3", 140, 131072, 8, weight_bits=8, num_gpus=8, results={})
    assert specs.get_spec("deepseek-v3").checkpoint_weight_bits == 8 and ds.engine == "vllm"
    assert "quantization" not in ds.to_vllm() and "--quantization" not in ds.commands()["vllm"]
    line = next(w for w in ds.watch if w.startswith("8-bit weights cost quality"))
    assert "ships 8-bit (FP8) weights" in line and "no --quantization flag" in line


def test_a_request_can_name_the_engines_it_runs():
    """``engines=`` restricts what the plan may choose (a reader who runs only transformers or
    only vLLM); the other engines are still priced, and a restriction that leaves no engine for
    the traffic is refused with what would serve it."""
    only = recommend("gemma-3-27b", 40, 131072, weight_bits=8, engines=["transformers"], results={})
    assert (only.engine, only.kv_type, only.engines) == (
        "transformers",
        "kvlib-int8",
        ("transformers",),
    )
    assert only.summary().splitlines()[0].endswith(", engines transformers only")
    assert any(
        r.startswith("one sequence on one GPU, on the engine the request allows")
        for r in only.reasons
    )
    assert only.options["vllm"].kv_type == "fp8"  # still priced: the also: lines
    assert recommend("gemma-3-27b", 40, 131072, weight_bits=8, results={}).engine == "vllm"
    four = recommend("llama-3.1-8b", 24, 32768, concurrency=4, engines=["vllm"], results={})
    assert (four.engine, four.status) == ("vllm", "reduced")  # llama.cpp would hold all four
    assert recommend("llama-3.1-8b", 24, 32768, concurrency=4, results={}).engine == "llama.cpp"
    with pytest.raises(TypeError, match="engines must be a non-empty list"):
        recommend("llama-3.1-8b", 24, 8192, engines="vllm")
    with pytest.raises(ValueError, match="unknown engine 'tgi'; accepted: transformers, vllm"):
        recommend("llama-3.1-8b", 24, 8192, engines=["tgi"])
    with pytest.raises(ValueError, match="cannot serve 4 sequence.*runs vllm or llama.cpp"):
        recommend("llama-3.1-8b", 24, 8192, concurrency=4, engines=["transformers"])
    with pytest.raises(ValueError, match="runs llama.cpp there"):
        recommend("llama-3.1-8b", 24, 8192, device="cpu", engines=["vllm"])


def test_the_gpus_compute_capability_decides_what_vllm_runs():
    """On a T4 (compute capability 7.5) vLLM has no fp8 KV backend and no fp8 weights: the plan
    offers neither, and names what runs there instead; on an H100 (9.0) nothing changes."""
    t4 = memory.GPU_COMPUTE_CAPABILITY["T4"]
    assert t4 == (7, 5) and not engine_support.vllm_dtype("fp8").runs_on(t4)
    assert engine_support.vllm_dtype("fp8").runs_on((9, 0)) and engine_support.vllm_dtype(
        "auto"
    ).runs_on(t4)
    many = recommend("qwen2.5-7b", 15, 8192, 24, weight_bits=4, compute_capability=t4, results={})
    assert many.options["vllm"].kv_type == "auto"  # no fp8 on a T4: vLLM stays at 16 bits
    assert "kv_cache_dtype" not in many.to_vllm() and many.engine == "llama.cpp"
    assert many.summary().splitlines()[0].endswith(", compute capability 7.5")
    unknown = recommend("qwen2.5-7b", 15, 8192, 24, weight_bits=4, results={})
    assert unknown.options["vllm"].kv_type == "fp8"  # not told the GPU: not checked
    eight = recommend("qwen2.5-7b", 15, 8192, weight_bits=8, compute_capability=t4, results={})
    assert "vllm" not in eight.options and eight.engine == "llama.cpp"
    assert eight.commands()["llama.cpp"].split()[2].endswith("-Q8_0.gguf")
    # the 16-bit request's suggestion names what runs there: 8-bit weights on llama.cpp
    sixteen = recommend("qwen2.5-7b", 15, 8192, compute_capability=t4, results={})
    assert "weight_bits=8: the whole request with fp16 on llama.cpp" in sixteen.suggestions
    h100 = memory.GPU_COMPUTE_CAPABILITY["H100 80GB"]
    same = recommend("llama-3.1-8b", 80, 32768, 16, compute_capability=h100, results={})
    assert same.to_vllm() == recommend("llama-3.1-8b", 80, 32768, 16, results={}).to_vllm()
    for bad, error in (
        ("7.5", TypeError),
        ((7,), TypeError),
        ((7.0, 5), TypeError),
        ((-1, 0), ValueError),
    ):
        with pytest.raises(error, match="compute_capability"):
            recommend("qwen2.5-7b", 15, 8192, compute_capability=bad)
    with pytest.raises(ValueError, match="device='cpu'"):
        recommend("llama-3.2-1b", 16, 8192, device="cpu", compute_capability=(8, 0))
