"""kvlib.plan.settings and kvlib.plan.engines: every engine's settings name a KV type that engine
accepts, and provision exactly what fits at that type's bytes (the generate() run with the
transformers cache is in test_plan.py, marked slow)."""

from __future__ import annotations

import itertools

import pytest

from kvlib import memory, specs
from kvlib.plan import engines
from kvlib.plan import planner as plan
from kvlib.plan import rule as plan_rule
from kvlib.plan import settings as plan_engines
from kvlib.plan.budget import sequences_that_fit
from kvlib.plan.rule import decide

LLAMA8 = specs.get_spec("llama-3.1-8b")


# -- the engines' KV types -------------------------------------------------------------------


def test_engine_types_are_priced_as_their_formats():
    q4_0, q4_1 = engines.kv_type("llama.cpp", "q4_0"), engines.kv_type("llama.cpp", "q4_1")
    assert (q4_0.effective_bits, q4_1.effective_bits) == (4.5, 5.0)  # + fp16 scale (+ min) / 32
    assert engines.kv_type("llama.cpp", "q8_0").effective_bits == 8.5
    assert engines.kv_type("vllm", "fp8").effective_bits == 8.0  # per-tensor scale
    assert all(
        t.needs_flash_attention == (t.bits < 16)
        for t in engines.KV_TYPES
        if t.engine == "llama.cpp"
    )
    # q4_0 on a 96-wide head (Phi-3-mini): 3 blocks of 32, one fp16 scale each, per vector
    phi = specs.get_spec("phi-3-mini")
    per_vector_bits = 96 * 4 + 3 * 16
    expected = 2 * phi.num_layers * phi.num_kv_heads * per_vector_bits // 8
    bits, group, meta, _ = q4_0.storage
    assert memory.kv_bytes_per_token(phi, bits, group_size=group, group_meta_bits=meta) == expected


def test_planned_levels_per_engine():
    assert {e: list(engines.planned(e)) for e in engines.ENGINES} == {
        "transformers": ["fp16", "int8", "int4", "int2"],
        "vllm": ["fp16", "int8"],
        "llama.cpp": ["fp16", "int8", "int4"],
    }
    assert [t.name for t in engines.planned("vllm").values()] == ["auto", "fp8"]
    assert [t.name for t in engines.planned("llama.cpp").values()] == ["f16", "q8_0", "q4_0"]
    assert engines.accepts("llama.cpp", "iq4_nl") and not engines.accepts("vllm", "int4")
    with pytest.raises(ValueError, match="vllm has no KV cache type 'q4_0'"):
        engines.kv_type("vllm", "q4_0")
    with pytest.raises(ValueError, match="engine must be one of"):
        engines.planned("tgi")


# -- every scenario: the headline and every engine's flags agree -----------------------------

SCENARIOS = list(
    itertools.product(
        ["llama-3.1-8b", "qwen2.5-7b", "gemma-2-9b", "mistral-7b-v0.1", "deepseek-v2-lite"],
        [16, 24, 80],
        [8192, 32768, 131072],
        [1, 4, 16],
        ["max", "balanced", "aggressive"],
    )
)


def _fits_at(p: plan.Plan, engine: str, type_name: str) -> int:
    """Sequences of the full context that fit the plan's KV budget at an engine type's bytes,
    recomputed from kvlib.memory (not from the plan)."""
    bits, group, meta, window = engines.kv_type(engine, type_name).storage
    budget = p.budget.kv_budget_bytes
    if budget <= 0:
        return 0
    per_seq = memory.kv_cache_bytes(
        p.spec, p.context_len, 1, bits, group_size=group, group_meta_bits=meta, window_bits=window
    )
    return budget // per_seq


@pytest.mark.parametrize("model, gib, context, users, quality", SCENARIOS)
def test_every_plan_prints_settings_its_engines_accept(model, gib, context, users, quality):
    p = plan.recommend(model, gib, context, users, quality, results={})
    # the engine: the first the traffic prefers that holds everyone, else the one holding most
    order = plan_rule.engine_candidates(p.device, users, p.tensor_parallel_size)
    ok = [e for e in order if p.options[e].status == "ok"]
    most = max(p.options[e].sequences for e in order)
    assert p.engine == (ok[0] if ok else next(e for e in order if p.options[e].sequences == most))
    if p.kv is not None:
        assert engines.accepts(p.engine, p.kv_type), "the headline's type runs on its engine"
        assert p.options[p.engine].kv_type == p.kv_type
        assert p.max_concurrency == _fits_at(p, p.engine, p.kv_type)
        assert f"KV cache: {p.kv_type} on {p.engine}" in p.summary()
    settings = {"transformers": p.to_transformers, "vllm": p.to_vllm, "llama.cpp": p.to_llama_cpp}
    for engine, option in p.options.items():
        if option.kv is None:
            with pytest.raises(ValueError):
                settings[engine]()
            continue
        fits = _fits_at(p, engine, option.kv_type)
        assert option.sequences == min(users, fits) >= 1
        if option.status == "ok":
            assert fits >= users
        s = settings[engine]()
        if engine == "vllm":
            # only what differs from vLLM's defaults; the batch ceiling is the traffic (no
            # typical length given), the KV budget the plan's own
            assert s.get("kv_cache_dtype", "auto") == option.kv_type
            assert s["max_num_seqs"] == users
            assert s["kv_cache_memory_bytes"] == p.budget.kv_budget_bytes
            assert s["max_model_len"] == context
            assert not {"gpu_memory_utilization", "block_size", "enable_prefix_caching"} & set(s)
        elif engine == "llama.cpp":
            assert s["--cache-type-k"] == s["--cache-type-v"] == option.kv_type
            assert (s["-np"], s["-c"]) == (option.sequences, option.sequences * context)
            assert s["-fa"] == ("on" if option.kv_type != "f16" else "auto")
        else:
            assert (s["cache"], s["batch_size"]) == (option.kv_type, option.sequences)
        assert engines.accepts(engine, option.kv_type)


# -- single engines ----------------------------------------------------------------------------


def test_transformers_runs_kvlib_caches_and_fp16_for_sliding_windows():
    assert plan_engines.transformers_kwargs(decide(LLAMA8, 80, 8192)) == {
        "cache": "dynamic-fp16",
        "batch_size": 1,
    }
    one = decide(LLAMA8, 24, 65536, allowed=["transformers"])  # 8 GiB at fp16 > 5.39 GiB left
    assert one.engine == "transformers" and one.kv_type == f"kvlib-{one.kv}"
    # sliding-window layers: kvlib's caches quantize the global layers, windows in fp16
    gemma = decide(specs.get_spec("gemma-2-9b"), 24, 32768)
    assert list(plan_rule.kv_types("transformers", gemma.spec)) == ["fp16", "int8", "int4", "int2"]
    assert plan_engines.transformers_kwargs(gemma) == {"cache": "kvlib-int4", "batch_size": 1}
    small = decide(specs.get_spec("gemma-2-9b"), 80, 8192)
    assert small.options["transformers"].kv_type == "dynamic-fp16"


def test_vllm_has_fp16_and_fp8_only():
    d = decide(LLAMA8, 24, 32768, 16, results={})  # without llama.cpp's measurements: q4_0
    v = plan_engines.vllm_args(d)
    at_fp8 = sequences_that_fit(LLAMA8, d.budget.kv_budget_bytes, 32768, (8, None, 0, None))
    vllm = d.options["vllm"]
    assert (vllm.kv, vllm.kv_type, vllm.status) == ("int8", "fp8", "reduced")
    assert v["kv_cache_dtype"] == "fp8" and at_fp8 < 16 and v["max_num_seqs"] == 16
    assert v["kv_cache_memory_bytes"] == d.budget.kv_budget_bytes
    assert "quantization" not in v and "gpu_memory_utilization" not in v
    # llama.cpp goes lower (q4_0) and fits more of the same request: the plan takes it
    assert d.options["llama.cpp"].kv_type == "q4_0"
    assert d.options["llama.cpp"].sequences > at_fp8
    assert (d.engine, d.kv_type, d.status) == ("llama.cpp", "q4_0", "reduced")
    assert "vllm cannot hold the whole request (fp8 fits 2 of 16)" in " ".join(
        plan.recommend("llama-3.1-8b", 24, 32768, 16, results={}).reasons
    )
    # with them, the best-measured of the types that fit as many sequences as q4_0 does
    measured = decide(LLAMA8, 24, 32768, 16)
    m = measured.options["llama.cpp"]
    assert m.sequences == d.options["llama.cpp"].sequences
    assert engines.measured_llama_cpp()[m.kv_type] <= engines.measured_llama_cpp()["q4_0"]
    fp16 = plan_engines.vllm_args(decide(LLAMA8, 80, 8192, 8))
    assert "kv_cache_dtype" not in fp16 and fp16["max_num_seqs"] == 8  # auto: the default
    w8 = plan_engines.vllm_args(decide(LLAMA8, 80, 8192, 8, weight_bits=8, num_gpus=2))
    assert w8["quantization"] == "fp8" and w8["tensor_parallel_size"] == 2


def test_cpu_plans_run_llama_cpp_only():
    d = decide(LLAMA8, 32, 8192, device="cpu")
    assert d.engine == "llama.cpp" and list(d.options) == ["llama.cpp"]
    assert plan_engines.llama_cpp_flags(d)["-ngl"] == 0
    with pytest.raises(
        ValueError, match="no vllm settings for this plan: a CPU plan runs llama.cpp"
    ):
        plan_engines.vllm_args(d)
    tp = decide(specs.get_spec("llama-3.1-70b"), 80, 32768, 16, num_gpus=2)
    assert list(tp.options) == ["vllm", "llama.cpp"]  # llama.cpp splits the layers
    with pytest.raises(ValueError, match=r"transformers' generate\(\) runs one GPU here"):
        plan_engines.transformers_kwargs(tp)


def test_commands_name_hub_ids_and_a_request_that_does_not_fit():
    d = decide(LLAMA8, 80, 131072, 4, model="llama-3.1-8b")
    cmd = plan_engines.commands(d)
    assert cmd["vllm"].startswith("vllm serve meta-llama/Llama-3.1-8B --kv-cache-dtype fp8")
    assert cmd["llama.cpp"].startswith("llama-server -m Llama-3.1-8B-F16.gguf -c ")
    mine = plan_engines.commands(d, "meta-llama/Llama-3.1-8B-Instruct")
    assert mine["vllm"].startswith("vllm serve meta-llama/Llama-3.1-8B-Instruct ")
    assert mine["llama.cpp"].startswith("llama-server -m Llama-3.1-8B-Instruct-F16.gguf ")
    # quantized weights: a checkpoint of that kind and the flag that runs it
    d4 = decide(LLAMA8, 24, 8192, 4, weight_bits=4, model="llama-3.1-8b")
    four = plan_engines.commands(d4)
    assert four["vllm"].startswith("vllm serve <AWQ int4 checkpoint of meta-llama/Llama-3.1-8B> ")
    assert "--quantization" not in four["vllm"]  # the AWQ checkpoint's config says it
    assert four["llama.cpp"].startswith("llama-server -m Llama-3.1-8B-Q4_K_M.gguf ")
    d8 = decide(LLAMA8, 24, 8192, 4, weight_bits=8, model="llama-3.1-8b")
    assert plan_engines.commands(d8)["vllm"].endswith("--quantization fp8")
    assert plan_engines.commands(d, "my.gguf")["llama.cpp"].startswith("llama-server -m my.gguf ")
    none = decide(specs.get_spec("qwen2.5-7b"), 16, 8192, model="qwen2.5-7b")
    assert plan_engines.commands(none) == {}
    with pytest.raises(
        ValueError, match=r"no vllm settings: not one sequence of qwen2.5-7b .*\(try\)"
    ):
        plan_engines.vllm_args(none, hint="try")
    with pytest.raises(ValueError, match="see plan.suggestions"):
        plan_engines.llama_cpp_flags(none)


def test_every_registry_model_names_its_hub_id():
    for name in specs.list_specs():
        hub = specs.get_spec(name).hub_id
        assert hub and hub.count("/") == 1, name
    assert specs.ModelSpec("custom", 2, 2, 2, 8).hub_id is None
