"""kvlib.plan_text: the decision in words — reasons with their figures, watch-outs, what would
fit, what the setting buys, the summary (memory in GiB)."""

from __future__ import annotations

import re

import pytest

from kvlib import memory, plan_text, specs
from kvlib.plan_rule import decide, fallbacks

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
            },
        }
    },
}


def test_reasons_give_the_budget_and_each_settings_count():
    d = decide(LLAMA8, 24, 32768, 16, model="llama-3.1-8b")
    why = plan_text.reasons(d, MEAS)
    h = memory.human_bytes
    fits = d.sequences_by_setting
    assert why[0] == (
        f"16 × 32,768 tokens need {h(16 * d.kv_bytes_per_sequence_fp16)} at fp16 but only "
        f"{h(d.budget.kv_budget_bytes)} is left; fp16 fits {fits['fp16']}, int8 fits "
        f"{fits['int8']}; int4 fits {fits['int4']}"
    )
    assert why[1].startswith(
        "int4 (kvlib-int4): +0.8 % perplexity on TinyTest-1M, measured 2031-01-02"
    )
    assert why[2].startswith("int4 with a Hadamard rotation (kvlib-int4-rot): -0.1 % perplexity")
    assert f"only {fits['int4']} of 16 sequences fit" in why[3]  # reduced
    assert "vLLM" in why[4] and "PCA" in why[5]
    solo = plan_text.reasons(decide(LLAMA8, 80, 8192, 1), {})
    assert "no need to quantize" in solo[0] and solo[1].startswith("fp16: the reference")
    assert "transformers generate()" in solo[-1]
    none = plan_text.reasons(decide(specs.get_spec("qwen2.5-7b"), 16, 8192), {})
    assert none == (none[0],) and "nothing is left for the KV cache" in none[0]
    tight = decide(LLAMA8, 20, 131072, 1)  # weights fit, one 128k sequence does not
    assert tight.kv is None and tight.budget.kv_budget_bytes > 0
    assert "even at int4" in plan_text.reasons(tight, {})[0]


def test_watch_cites_the_measured_int2_cost_and_the_limits():
    d = decide(LLAMA8, 24, 32768, 16, quality="aggressive")
    assert d.kv == "int2"
    w = plan_text.watch(d, MEAS)
    assert any("(measured +7.25 % perplexity)" in x for x in w)
    assert any("vLLM has no int2 KV cache" in x for x in w)
    assert not any("measured" in x for x in plan_text.watch(d, {}) if x.startswith("2-bit"))
    tp16 = decide(LLAMA8, 24, 32768, 16, num_gpus=16)
    assert any("16 > 8 KV heads" in x for x in plan_text.watch(tp16, {}))
    past = decide(LLAMA8, 80, 1 << 18, 1)  # 256k > Llama-3.1's trained 128k
    assert any("exceeds the model's trained 131,072 tokens" in x for x in plan_text.watch(past, {}))


def test_suggestions_only_when_it_does_not_fit_and_in_gib():
    ok = decide(LLAMA8, 80, 8192, 1)
    assert plan_text.suggestions(ok, fallbacks(ok)) == ()
    d = decide(specs.get_spec("qwen2.5-7b"), 16, 8192)
    fb = fallbacks(d)
    s = plan_text.suggestions(d, fb)
    assert s[0] == "weight_bits=8: the whole request with fp16"
    assert s[1] == "num_gpus=2 (vLLM tensor_parallel_size=2): the whole request with fp16"
    assert s[-1] == f"a GPU with at least {fb.memory_gib:.3g} GiB: the whole request with int4"
    cpu = decide(LLAMA8, 8, 32768, 16, device="cpu")
    assert plan_text.suggestions(cpu, fallbacks(cpu))[-1].startswith("RAM of at least")
    eight = decide(specs.get_spec("llama-3.1-405b"), 24, 131072, 64, num_gpus=8)
    assert any("pipeline parallelism" in x for x in plan_text.suggestions(eight, fallbacks(eight)))


def test_buys_and_an_unbounded_context():
    d = decide(LLAMA8, 24, 32768, 4)
    assert plan_text.buys(d).startswith(f"int4 fits {d.max_concurrency} sequences at 32,768")
    assert f"against {d.max_concurrency_fp16} at fp16" in plan_text.buys(d)
    # Mistral-7B v0.1: every layer slides, so memory sets no limit on the context
    sliding = decide(specs.get_spec("mistral-7b-v0.1"), 24, 4096, 1)
    assert sliding.max_context == memory.UNBOUNDED
    assert "up to unbounded tokens" in plan_text.buys(sliding)
    assert "max context for 1: unbounded" in plan_text.summary(sliding)
    assert "nothing yet" in plan_text.buys(decide(specs.get_spec("qwen2.5-7b"), 16, 8192))


def test_summary_says_gib():
    d = decide(LLAMA8, 80, 8192, 64, model="llama-3.1-8b")
    text = plan_text.summary(d, ("a reason",), ("a risk",), ())
    first = text.splitlines()[0]
    assert first.startswith("llama-3.1-8b on 1 × 80 GiB GPU, context 8,192, 64 concurrent")
    assert "device memory 80 GiB" in text and "why: a reason" in text and "watch: a risk" in text
    assert not re.search(r"\bGB\b", text)


def test_results_to_cite(tmp_path, monkeypatch):
    assert plan_text.results_to_cite({}) == {}
    assert plan_text.results_to_cite(MEAS) == MEAS
    with pytest.raises(TypeError, match="results must be"):
        plan_text.results_to_cite(42)
    with pytest.raises(ValueError, match="does not exist"):
        plan_text.results_to_cite(tmp_path / "missing.json")
