"""kvlib.plan.engines: llama.cpp's types chosen from measurements, mixed K/V pairs priced exactly."""

import pytest

from kvlib import memory
from kvlib.plan import engines
from kvlib.plan.planner import recommend
from kvlib.specs import get_spec


def llama_run(deltas: dict[str, float]) -> dict:
    """A results file holding only a llama.cpp run with these mean deltas ("q8_0/q4_0" pairs)."""
    rows = {}
    for name, delta in deltas.items():
        k, _, v = name.partition("/")
        v = v or k
        key = k if k == v else f"k-{k}/v-{v}"
        rows[key] = {"type_k": k, "type_v": v, "perplexity_delta_pct_mean": delta}
    run = {"source": "test", "command": "test", "date": "2026-12-03", "machine": "test"}
    return {
        "schema_version": 1,
        "runs": {"llama.cpp": {**run, "settings": {"segments": 4}, "rows": rows}},
    }


MEASURED = llama_run({"f16": 0.0, "q8_0": 0.15, "q4_0": 7.4, "iq4_nl": 4.5, "q8_0/q4_0": 0.9})


def test_a_pair_is_priced_as_its_halves():
    spec = get_spec("llama-3.1-8b")
    pair = engines.kv_type("llama.cpp", "q8_0/q4_0")
    assert pair.cache_types == ("q8_0", "q4_0") and pair.mixed
    whole = memory.kv_cache_bytes(
        spec, 4096, 1, *pair.storage[:1], group_size=32, group_meta_bits=16
    )
    halves = [
        memory.kv_cache_bytes(spec, 4096, 1, b, group_size=32, group_meta_bits=16) / 2
        for b in (8, 4)
    ]
    assert whole == sum(halves) and pair.effective_bits == 6.5


def test_candidates_follow_the_measurements():
    assert [t.name for t in engines.candidates("llama.cpp", "int4", {})] == ["q4_0"]
    names = [t.name for t in engines.candidates("llama.cpp", "int4", MEASURED, "cpu")]
    assert names == ["q8_0/q4_0", "iq4_nl", "q4_0"]  # best measured first; q8_0 is the int8 level
    # on a GPU, only what llama.cpp's default CUDA build runs natively: iq4_nl's attention would
    # run on the CPU, and the q8_0/q4_0 pair is converted to f16 at every step
    assert [t.name for t in engines.candidates("llama.cpp", "int4", MEASURED)] == ["q4_0"]
    for name in names[:2]:
        assert not engines.runs_well(engines.kv_type("llama.cpp", name), "gpu")
        assert engines.runs_well(engines.kv_type("llama.cpp", name), "cpu")
    assert [t.name for t in engines.candidates("vllm", "int8", MEASURED)] == ["fp8"]
    assert engines.candidates("vllm", "int4", MEASURED) == []


def test_the_plan_takes_the_best_measured_type_that_holds_the_request():
    # 8B on a 24 GiB card, 32k, 4 users: q8_0 does not hold them, q4_0 does
    plain = recommend("llama-3.1-8b", 24, 32768, 4, results={})
    assert (plain.engine, plain.kv_type) == ("llama.cpp", "q4_0")
    gpu = recommend("llama-3.1-8b", 24, 32768, 4, results=MEASURED)
    assert gpu.kv_type == "q4_0"  # the better-measured types do not run natively on CUDA
    # on a CPU (20 GiB of RAM, 8-bit weights) llama.cpp runs them all
    p = recommend("llama-3.1-8b", 20, 32768, 4, weight_bits=8, device="cpu", results=MEASURED)
    flags = p.to_llama_cpp()
    assert p.engine == "llama.cpp" and p.fits
    assert p.kv_type in ("q8_0/q4_0", "iq4_nl")
    assert (flags["--cache-type-k"], flags["--cache-type-v"]) == engines.kv_type(
        "llama.cpp", p.kv_type
    ).cache_types
    # the counts are the chosen type's bytes
    per_seq = p.kv_bytes_per_sequence
    assert per_seq == memory.kv_cache_bytes(
        get_spec("llama-3.1-8b"), 32768, 1, *p.kv_storage.storage[:1],
        group_size=p.kv_storage.group_size, group_meta_bits=p.kv_storage.group_meta_bits,
    )  # fmt: skip
    assert any("llama.cpp's own f16" in r for r in p.reasons)


@pytest.mark.parametrize("gib", [12, 16, 20, 24, 32])
def test_every_better_measured_type_holds_fewer_sequences(gib):
    """The plan's llama.cpp int4 type is the first candidate that holds the request."""
    from kvlib.plan import budget as plan_budget

    p = recommend("llama-3.1-8b", gib + 8, 32768, 4, weight_bits=8, device="cpu", results=MEASURED)
    option = p.options["llama.cpp"]
    if option.kv != "int4":
        return
    spec, budget = get_spec("llama-3.1-8b"), p.budget.kv_budget_bytes
    for t in engines.candidates("llama.cpp", "int4", MEASURED, "cpu"):
        n = plan_budget.sequences_that_fit(spec, budget, 32768, t.storage, 1)
        if t.name == option.kv_type:
            assert n == option.sequences or (n > 4 and option.sequences == 4)
            break
        assert n < 4 or option.status != "ok"
    else:
        pytest.fail(f"{option.kv_type} is not a candidate")


def test_an_unmeasured_q4_0_is_still_offered():
    run = llama_run({"q5_1": 1.0})
    assert [t.name for t in engines.candidates("llama.cpp", "int4", run, "cpu")] == ["q5_1", "q4_0"]
    assert [t.name for t in engines.candidates("llama.cpp", "int4", run)] == ["q4_0"]  # GPU


def test_mla_models_get_no_pairs():
    """A pair is priced at its mean width, exact only where keys and values are equally wide."""
    from kvlib.plan import budget as plan_budget
    from kvlib.plan import rule as plan_rule

    spec = get_spec("deepseek-v3")
    budget = plan_budget.memory_budget(spec, "gpu", 141, 16, 8)
    chosen = plan_rule.types_by_level(spec, budget, 8192, 64, 8, "llama.cpp", MEASURED)
    assert not any(t.mixed for t, _ in chosen.values())
    llama = get_spec("llama-3.1-8b")
    budget = plan_budget.memory_budget(llama, "cpu", 48, 16, 1)
    chosen = plan_rule.types_by_level(llama, budget, 32768, 1, 1, "llama.cpp", MEASURED)
    assert chosen["int4"][0].name == "q8_0/q4_0"  # one sequence: the best measured type fits


def test_the_planners_kvlib_types_are_the_registrys():
    """kvlib.plan.engines prices kvlib's caches without importing the registry (no torch); both read
    kvlib.caches.layout, so they agree."""
    from kvlib.caches import registry as cache_registry

    for t in engines.KV_TYPES:
        if t.engine != "transformers":
            continue
        info = cache_registry.cache_info(t.name)
        assert (t.bits, t.group_size) == (
            info.cache_bits(16),
            info.group_size if t.bits < 16 else None,
        )
