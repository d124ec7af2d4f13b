"""kvlib.plan.text: the decision in words — reasons with their figures, watch-outs, what would
fit, what the setting buys, the summary (memory in GiB)."""

from __future__ import annotations

import re

import pytest

from kvlib import memory, specs
from kvlib.plan import engines
from kvlib.plan import measured as plan_measured
from kvlib.plan import suggestions as plan_suggestions
from kvlib.plan import summary as plan_summary
from kvlib.plan import text as plan_text
from kvlib.plan.fallbacks import fallbacks
from kvlib.plan.rule import decide

LLAMA8 = specs.get_spec("llama-3.1-8b")
MEAS = {
    "schema_version": 1,
    "runs": {
        "cache": {
            "source": "benchmarks/bench_cache.py",
            "command": "python benchmarks/bench_cache.py",
            "machine": "test",
            "model": "TinyTest-1M",
            "date": "2031-01-02",
            "rows": {
                "dynamic-fp32": {"perplexity": 10.0},
                "kvlib-int4": {"perplexity_delta_pct": 0.8},
                "kvlib-int4-rot": {"perplexity_delta_pct": -0.1},
                "kvlib-int2": {"perplexity_delta_pct": 7.25},
                "hf-fp8": {"perplexity_delta_pct": 0.5},
            },
        }
    },
}


def test_reasons_give_the_budget_and_each_settings_count():
    # 16 users: vLLM (fp8) holds fewer than llama.cpp (q4_0), which is reduced at its lowest level
    d = decide(LLAMA8, 24, 32768, 16, model="llama-3.1-8b")
    assert (d.engine, d.kv_type, d.status) == ("llama.cpp", "q4_0", "reduced")
    why = plan_text.reasons(d, MEAS)
    h = memory.human_bytes
    fits = d.sequences_by_setting
    assert why[0] == (
        f"16 × 32,768 tokens need {h(16 * d.kv_bytes_per_sequence_fp16)} at fp16 but only "
        f"{h(d.budget.kv_budget_bytes)} is left; fp16 fits {fits['fp16']}, q8_0 fits "
        f"{fits['int8']}; q4_0 fits {fits['int4']}"
    )
    # q4_0 is not measured: said so, citing kvlib's int4 cache
    assert why[1].startswith("q4_0 (llama.cpp) is not measured")
    assert "(kvlib-int4): +0.8 % perplexity on TinyTest-1M with transformers on a CPU" in why[1]
    assert "measured 2031-01-02" in why[1]
    assert f"only {fits['int4']} of 16 sequences fit" in why[2]  # reduced
    vllm = d.options["vllm"]
    assert why[3].startswith(
        f"vllm cannot hold the whole request ({vllm.kv_type} fits {vllm.sequences} of 16)"
    )
    assert f"llama.cpp serves them in {fits['int4']} parallel slots" in why[4]
    assert "PCA" in why[5] and len(why) == 6
    # one user whose cache fits only at 4 bits: transformers with kvlib-int4, and its rotation
    t = decide(LLAMA8, 24, 98304, 1, allowed=["transformers"])
    tfits = t.sequences_by_setting
    assert (t.engine, t.kv_type) == ("transformers", "kvlib-int4")
    twhy = plan_text.reasons(t, MEAS)
    assert twhy[0].endswith(
        f"fp16 fits {tfits['fp16']}, kvlib-int8 fits {tfits['int8']}; kvlib-int4 fits "
        f"{tfits['int4']}"
    )
    assert twhy[1].startswith("kvlib-int4: +0.8 % perplexity on TinyTest-1M with transformers")
    assert "measured 2031-01-02" in twhy[1]
    assert twhy[2].startswith("int4 with a Hadamard rotation (kvlib-int4-rot): -0.1 % perplexity")
    assert "transformers generate()" in twhy[-1]
    solo = plan_text.reasons(decide(LLAMA8, 80, 8192, 1), {})
    assert "no need to quantize" in solo[0] and solo[1].startswith("fp16: the reference")
    assert solo[-1].startswith("one sequence: a serving engine (vLLM) serves it over HTTP")
    none = plan_text.reasons(decide(specs.get_spec("qwen2.5-7b"), 16, 8192), {})
    assert none == (none[0],) and "nothing is left for the KV cache" in none[0]
    tight = decide(LLAMA8, 20, 131072, 1, allowed=["transformers"])  # weights fit, 128k does not
    assert tight.kv is None and tight.budget.kv_budget_bytes > 0
    lowest = engines.planned(tight.engine)[tight.lowest_setting].name
    assert (tight.engine, lowest) == ("transformers", "kvlib-int4")
    assert "even at kvlib-int4" in plan_text.reasons(tight, {})[0]


def test_watch_cites_the_measured_int2_cost_and_the_limits():
    d = decide(LLAMA8, 24, 196608, 1, quality="aggressive")  # only kvlib's 2 bits hold 192k
    assert (d.engine, d.kv, d.kv_type) == ("transformers", "int2", "kvlib-int2")
    w = plan_text.watch(d, MEAS)
    assert any("(measured +7.25 % perplexity)" in x for x in w)
    assert any("exceeds the model's trained 131,072 tokens" in x for x in w)
    assert not any("measured" in x for x in plan_text.watch(d, {}) if x.startswith("2-bit"))
    tp16 = decide(LLAMA8, 24, 32768, 16, num_gpus=16)
    assert any("16 > 8 KV heads" in x for x in plan_text.watch(tp16, {}))
    # sliding-window layers: kvlib's quantized cache keeps their windows in fp16 (said where the
    # plan runs one; not for an fp16 plan, nor a CPU plan, which has only llama.cpp)
    gemma = specs.get_spec("gemma-2-9b")
    sliding = "sliding-window layers"
    quantized = decide(gemma, 22, 8192, allowed=["transformers"])
    assert (quantized.engine, quantized.kv_type) == ("transformers", "kvlib-int8")
    assert any(
        sliding in x and "(4,096 tokens) in fp16 and quantizes the 21 global layers" in x
        for x in plan_text.watch(quantized, {})
    )
    assert not any(sliding in x for x in plan_text.watch(decide(gemma, 80, 8192), {}))
    assert not any(sliding in x for x in plan_text.watch(decide(gemma, 48, 8192, device="cpu"), {}))
    assert not any(sliding in x for x in plan_text.watch(d, {}))  # Llama: full attention


def test_suggestions_only_when_it_does_not_fit_and_in_gib():
    ok = decide(LLAMA8, 80, 8192, 1)
    assert plan_suggestions.suggestions(ok, fallbacks(ok)) == ()
    d = decide(specs.get_spec("qwen2.5-7b"), 16, 8192)
    fb = fallbacks(d)
    s = plan_suggestions.suggestions(d, fb)
    assert s[0] == "weight_bits=8: the whole request with fp16 on vllm"
    assert s[1] == "num_gpus=2 (vLLM tensor_parallel_size=2): the whole request with fp16 on vllm"
    # the memory is named at the lowest type of the engine that needs the least (llama.cpp's
    # q4_0 here: below vLLM's fp8, the plan's engine when nothing fits)
    assert d.engine == "vllm" and d.lowest_setting == "int8"
    assert s[-1] == (
        f"a GPU with at least {fb.memory_gib:.3g} GiB: the whole request with q4_0 on llama.cpp"
    )
    cpu = decide(LLAMA8, 8, 32768, 16, device="cpu")
    assert plan_suggestions.suggestions(cpu, fallbacks(cpu))[-1].startswith("RAM of at least")
    assert plan_suggestions.suggestions(cpu, fallbacks(cpu))[-1].endswith("with q4_0 on llama.cpp")
    eight = decide(specs.get_spec("llama-3.1-405b"), 24, 131072, 64, num_gpus=8)
    assert any(
        "pipeline parallelism" in x for x in plan_suggestions.suggestions(eight, fallbacks(eight))
    )


def test_buys_and_an_unbounded_context():
    d = decide(LLAMA8, 24, 32768, 4)
    assert d.kv_type == "q4_0"
    assert plan_summary.buys(d).startswith(f"q4_0 fits {d.max_concurrency} sequences at 32,768")
    assert f"against {d.max_concurrency_fp16} at fp16" in plan_summary.buys(d)
    # Mistral-7B v0.1: every layer slides, so memory sets no limit on the context
    sliding = decide(specs.get_spec("mistral-7b-v0.1"), 24, 4096, 1)
    assert sliding.max_context == memory.UNBOUNDED
    assert "up to unbounded tokens" in plan_summary.buys(sliding)
    assert "max context for 1: unbounded" in plan_summary.summary(sliding)
    assert "nothing yet" in plan_summary.buys(decide(specs.get_spec("qwen2.5-7b"), 16, 8192))


def test_alternatives_give_each_other_engines_type_and_count():
    d = decide(LLAMA8, 24, 32768, 4)
    alt = plan_summary.alternatives(d)
    others = [e for e in engines.ENGINES if e != d.engine]
    assert [a.split(":")[0] for a in alt] == others
    for engine, line in zip(others, alt, strict=True):
        o = d.options[engine]
        bits = engines.kv_type(engine, o.kv_type).effective_bits
        assert line.startswith(
            f"{engine}: {o.kv_type} ({bits:g} bits per value) fits {o.sequences} of 4 sequences"
        )
    summary = plan_summary.summary(d)
    assert all(f"also: {a}" in summary for a in alt)
    none = plan_summary.alternatives(decide(specs.get_spec("qwen2.5-7b"), 16, 8192))
    assert none and all(a.endswith("not one sequence fits at any KV type it runs") for a in none)
    assert plan_summary.alternatives(decide(LLAMA8, 24, 8192, device="cpu")) == ()  # llama.cpp only
    (split,) = plan_summary.alternatives(decide(LLAMA8, 24, 8192, 4, num_gpus=2))
    assert split.startswith("llama.cpp: ")  # vLLM's tensor parallelism, llama.cpp's layers


def test_summary_says_gib():
    d = decide(LLAMA8, 80, 8192, 64, model="llama-3.1-8b")
    text = plan_summary.summary(d, ("a reason",), ("a risk",), ())
    first = text.splitlines()[0]
    assert first.startswith("llama-3.1-8b on 1 × 80 GiB GPU, context 8,192, 64 concurrent")
    assert "device memory 80 GiB" in text and "why: a reason" in text and "watch: a risk" in text
    assert not re.search(r"\bGB\b", text)


def test_results_to_cite(tmp_path, monkeypatch):
    assert plan_measured.results_to_cite({}) == {}
    assert plan_measured.results_to_cite(MEAS) == MEAS
    with pytest.raises(TypeError, match="results must be"):
        plan_measured.results_to_cite(42)
    with pytest.raises(ValueError, match="does not exist"):
        plan_measured.results_to_cite(tmp_path / "missing.json")


def test_segment_ranges_decide_what_is_called_measurable():
    """A delta whose segments straddle zero is no measurable cost, and a rotation whose
    segments overlap the plain cache's is no measurable difference, whatever one segment says."""
    seg = {
        "schema_version": 1,
        "runs": {
            "cache": {
                "source": "benchmarks/bench_cache.py",
                "model": "TinyTest-1M",
                "date": "2031-01-02",
                "rows": {
                    "kvlib-int4": {
                        "perplexity_delta_pct": 0.25,
                        "perplexity_delta_pct_segments": [0.25, -0.15, 0.1, 0.1],
                    },
                    "kvlib-int4-rot": {
                        "perplexity_delta_pct": -0.11,
                        "perplexity_delta_pct_segments": [-0.11, 0.2, 0.3, -0.05],
                    },
                    "kvlib-int2": {
                        "perplexity_delta_pct": 7.2,
                        "perplexity_delta_pct_segments": [7.2, 6.0, 5.5, 6.2],
                    },
                },
            }
        },
    }
    t = decide(LLAMA8, 24, 98304, 1, allowed=["transformers"])
    assert t.kv_type == "kvlib-int4"
    why = plan_text.reasons(t, seg)
    assert "4 segments -0.15 % … +0.25 %: no measurable cost" in why[1]
    assert why[2].startswith(
        "int4 with a Hadamard rotation (kvlib-int4-rot): mean +0.085 % perplexity against "
        "+0.075 % without, over 4 segments; no measurable difference"
    )
    int2 = plan_measured.quality_note("int2", seg)
    assert "4 segments +5.5 % … +7.2 %" in int2 and "no measurable" not in int2
    seg["runs"]["cache"]["rows"]["kvlib-int4-rot"]["perplexity_delta_pct_segments"] = [-1, -0.9]
    rot = plan_text.reasons(t, seg)[2]
    assert "over 2 segments" in rot and "no measurable difference" not in rot


def _llama_cpp_run(model: str, q4_0: float) -> dict:
    rows = {
        t: {"type_k": t, "type_v": t, "perplexity_delta_pct_mean": d}
        for t, d in (("f16", 0.0), ("q8_0", 0.1), ("q4_0", q4_0))
    }
    return {
        "source": "benchmarks/bench_engines.py",
        "command": "python benchmarks/bench_engines.py",
        "machine": "test CPU, no GPU",
        "model": model,
        "date": "2031-01-02",
        "settings": {"segments": 4},
        "rows": rows,
    }


TWO_MODELS = {
    "schema_version": 1,
    "runs": {
        "llama.cpp": _llama_cpp_run("SmolTest", 6.5),
        "llama.cpp/gemma-3-270m": _llama_cpp_run("GemmaTest", 2.5),
    },
}


def test_a_plan_cites_the_measured_model_closest_in_build_and_says_so():
    """Gemma 2 9B (half its layers sliding, heads of 256) reads the Gemma run's figures, and a
    reason names that model and why; Llama 3.1 8B reads the default model's, with no such line."""
    from kvlib.plan.planner import recommend

    g = recommend("gemma-2-9b", 24, 8192, 4, results=TWO_MODELS)
    assert (g.engine, g.kv_type) == ("llama.cpp", "q4_0")
    assert any(r.startswith("q4_0 (llama.cpp): +2.5 %") and "GemmaTest" in r for r in g.reasons)
    note = [r for r in g.reasons if r.startswith("the llama.cpp figures above were measured on")]
    assert len(note) == 1
    assert "GemmaTest (15/18 sliding-window layers, 1 KV head of 256 channels)" in note[0]
    assert "closest in build to gemma-2-9b (21/42 sliding-window layers, 8 KV heads" in note[0]
    l8 = recommend("llama-3.1-8b", 24, 32768, 4, results=TWO_MODELS)
    assert (l8.engine, l8.kv_type) == ("llama.cpp", "q4_0")
    assert any(r.startswith("q4_0 (llama.cpp): +6.5 %") for r in l8.reasons)
    assert not any("were measured on" in r for r in l8.reasons)
    # a plan that cites no multi-model run names no model, even for a Gemma
    fp16 = recommend("gemma-2-9b", 24, 8192, 1, results=TWO_MODELS)
    assert fp16.kv == "fp16" and not any("were measured on" in r for r in fp16.reasons)


def _turboquant_run(model: str, k8v4: float) -> dict:
    return {
        "source": "benchmarks/bench_turboquant.py",
        "engine": "transformers, with kvlib's re-implementations",
        "machine": "test, 2 CPUs, no GPU",
        "model": model,
        "date": "2031-01-03",
        "settings": {"segments": 4},
        "rows": {
            "dynamic-fp32": {"perplexity_delta_pct_mean": 0.0, "bits_per_value_at_4096": 32.0},
            "turboquant-k8v4": {
                "perplexity_delta_pct_mean": k8v4,
                "bits_per_value_at_4096": 7.55,
            },
            "turboquant-4bit-nc": {"perplexity_delta_pct_mean": 0.9},  # no bits: left out
        },
    }


def test_vllm_reasons_cite_turboquant_from_the_closest_model_but_do_not_set_it():
    """vLLM's why line names the TurboQuant dtypes' cost in kvlib's re-implementation, from the
    measured model closest in build and citing it, says why the plan does not set them, and
    says nothing of them without the run."""
    from kvlib.plan.planner import recommend

    runs = {
        "turboquant": _turboquant_run("TinyTest-1M", 0.15),
        "turboquant/gemma-3-270m": _turboquant_run("GemmaTest", 0.61),
    }
    data = {"schema_version": 1, "runs": runs}

    def vllm_line(model: str, results) -> str:
        plan = recommend(model, 80, 32768, 8, results=results)
        assert plan.engine == "vllm" and plan.kv in ("fp16", "fp8")
        (line,) = [r for r in plan.reasons if "a serving engine (vLLM)" in r]
        return line

    llama = vllm_line("llama-3.1-8b", data)
    assert (
        "turboquant_k8v4 +0.15 % at 7.55 bits per value in perplexity (mean of 4 segments)" in llama
    )
    assert "on TinyTest-1M" in llama
    assert "turboquant_4bit_nc +" not in llama  # a row without its bits is not cited
    assert "not of vLLM's TURBOQUANT attention backend" in llama and "does not set them" in llama
    gemma = vllm_line("gemma-2-9b", data)
    assert "turboquant_k8v4 +0.61 %" in gemma and "on GemmaTest" in gemma
    assert "re-implementation" not in vllm_line("llama-3.1-8b", {"schema_version": 1, "runs": {}})


def test_an_mla_plan_over_several_gpus_names_data_parallel_attention():
    """DeepSeek-V3 split over 8 GPUs: the plan is priced with the latent replicated (tensor
    parallelism) and says so, naming vLLM's data-parallel attention flags; a GQA model split
    the same way gets no such line."""
    from kvlib.plan.planner import recommend

    ds = recommend("deepseek-v3", 141, 131072, 8, weight_bits=8, num_gpus=8, results={})
    assert ds.engine == "vllm" and ds.to_vllm()["tensor_parallel_size"] == 8
    (line,) = [w for w in ds.watch if w.startswith("MLA latent cache")]
    assert "--data-parallel-size 8 in place of --tensor-parallel-size 8" in line
    assert "read this plan as the tensor-parallel one" in line
    llama = recommend("llama-3.1-70b", 80, 32768, 16, num_gpus=2, results={})
    assert not any("data-parallel" in w for w in llama.watch)
