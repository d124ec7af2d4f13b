"""Tests for kvlib.specs: ModelSpec, the registry of published models, and reading configs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kvlib import compat
from kvlib.specs import (
    REGISTRY,
    KVGeometry,
    ModelSpec,
    get_spec,
    kv_geometry,
    list_specs,
    spec_from_config,
)

# -- ModelSpec ------------------------------------------------------------------------------


def test_attention_type_and_queries_per_kv_head():
    base = dict(name="x", num_layers=4, num_heads=8, head_dim=64)
    mha = ModelSpec(num_kv_heads=8, **base)
    gqa = ModelSpec(num_kv_heads=2, **base)
    mqa = ModelSpec(num_kv_heads=1, **base)
    assert [s.attention_type for s in (mha, gqa, mqa)] == ["MHA", "GQA", "MQA"]
    assert [s.queries_per_kv_head for s in (mha, gqa, mqa)] == [1, 4, 8]
    assert ModelSpec("one-head", 2, 1, 1, 8).attention_type == "MHA"
    mla = ModelSpec("mla", 3, 8, 8, 32, kv_lora_rank=100, qk_rope_head_dim=12)
    assert mla.attention_type == "MLA" and mla.elements_per_token_per_layer == 112
    plain = mla.without_mla()
    # expanded: keys of head_dim + qk_rope_head_dim, values of head_dim, per KV head
    assert (plain.head_dim, plain.v_head_dim) == (32 + 12, 32)
    assert plain.attention_type == "MHA" and plain.elements_per_token_per_layer == 8 * (44 + 32)
    assert plain.name == "mla (no MLA)"
    with pytest.raises(ValueError, match="does not use MLA"):
        mha.without_mla()


def test_layer_kinds_and_tokens_cached():
    all_sliding = ModelSpec("s", 4, 4, 2, 16, sliding_window=10)
    assert all_sliding.layer_kinds == ("sliding",) * 4 and all_sliding.num_full_layers == 0
    assert all_sliding.tokens_cached(25) == (10,) * 4
    hybrid = ModelSpec(
        "h", 4, 4, 2, 16, sliding_window=10, layer_types=("sliding", "full", "local", "global")
    )
    assert hybrid.layer_types == ("sliding", "full", "sliding", "full")  # aliases normalised
    assert (hybrid.num_sliding_layers, hybrid.num_full_layers) == (2, 2)
    assert hybrid.tokens_cached(1000) == (10, 1000, 10, 1000)
    assert hybrid.tokens_cached(5) == (5, 5, 5, 5)
    # transformers' layer names are accepted and normalised
    hf_names = ModelSpec(
        "h", 2, 4, 2, 16, sliding_window=3, layer_types=["sliding_attention", "full_attention"]
    )
    assert hf_names.layer_types == ("sliding", "full")
    assert ModelSpec("f", 3, 4, 2, 16).layer_kinds == ("full",) * 3


def test_weights_bytes():
    spec = ModelSpec("w", 1, 1, 1, 1, num_params=1001)
    assert spec.weights_bytes() == 2002
    assert spec.weights_bytes(bits=4) == 501  # 500.5 bytes, rounded up
    assert spec.weights_bytes(bits=3) == 376  # 3003 bits
    with pytest.raises(ValueError, match="num_params is unknown"):
        ModelSpec("x", 1, 1, 1, 1).weights_bytes()
    with pytest.raises(ValueError, match="bits must be one of 2, 3, 4, 5, 6, 8, 16, 32"):
        spec.weights_bytes(bits=7)


def test_numpy_integers_are_accepted_as_ints():
    spec = ModelSpec("np", np.int64(2), np.int32(4), 2, 8, num_params=np.int64(10))
    assert type(spec.num_layers) is int and type(spec.num_params) is int
    assert spec == ModelSpec("np", 2, 4, 2, 8, num_params=10)


@pytest.mark.parametrize("field", ["num_layers", "num_heads", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [0, -3])
def test_zero_or_negative_sizes_rejected(field, value):
    kwargs = dict(name="x", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    kwargs[field] = value
    with pytest.raises(ValueError, match=rf"{field} must be an int >= 1 \(got {value}\)"):
        ModelSpec(**kwargs)


def test_bad_specs_rejected():
    with pytest.raises(ValueError, match="divisible"):
        ModelSpec("x", 2, 6, 4, 8)
    with pytest.raises(TypeError, match="num_layers must be an int"):
        ModelSpec("x", 2.5, 4, 2, 8)
    with pytest.raises(TypeError, match="name must be a string"):
        ModelSpec(3, 2, 4, 2, 8)
    with pytest.raises(ValueError, match="sliding_window"):
        ModelSpec("x", 2, 4, 2, 8, sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window is None"):
        ModelSpec("x", 2, 4, 2, 8, layer_types=("sliding", "full"))
    with pytest.raises(ValueError, match="entries but num_layers is 2"):
        ModelSpec("x", 2, 4, 2, 8, sliding_window=4, layer_types=("sliding",))
    with pytest.raises(ValueError, match=r"layer_types\[1\] must be one of"):
        ModelSpec("x", 2, 4, 2, 8, sliding_window=4, layer_types=("sliding", "mamba"))
    with pytest.raises(TypeError, match="sequence of strings"):
        ModelSpec("x", 2, 4, 2, 8, sliding_window=4, layer_types="sliding")
    with pytest.raises(ValueError, match="both kv_lora_rank and qk_rope_head_dim"):
        ModelSpec("x", 2, 4, 4, 8, kv_lora_rank=16)
    with pytest.raises(ValueError, match=r"seq_len must be an int >= 0"):
        ModelSpec("x", 2, 4, 4, 8).tokens_cached(-1)


# -- the registry ---------------------------------------------------------------------------

#: What each registry model's config.json says beyond the spec (model_type and the fields that
#: size the MLP / experts / embeddings): with them, transformers builds the architecture and
#: its parameter count must reproduce the registry's published ``num_params``.
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama-2-7b": ("llama", dict(intermediate_size=11008, tie_word_embeddings=False)),
    "llama-3.1-8b": ("llama", dict(intermediate_size=14336, tie_word_embeddings=False)),
    "llama-3.1-70b": ("llama", dict(intermediate_size=28672, tie_word_embeddings=False)),
    "llama-3.1-405b": ("llama", dict(intermediate_size=53248, tie_word_embeddings=False)),
    "llama-3.2-1b": ("llama", dict(intermediate_size=8192, tie_word_embeddings=True)),
    "llama-3.2-3b": ("llama", dict(intermediate_size=8192, tie_word_embeddings=True)),
    "mistral-7b-v0.1": ("mistral", dict(intermediate_size=14336, tie_word_embeddings=False)),
    "mistral-7b-v0.3": ("mistral", dict(intermediate_size=14336, tie_word_embeddings=False)),
    "mixtral-8x7b": (
        "mixtral",
        dict(intermediate_size=14336, num_local_experts=8, tie_word_embeddings=False),
    ),
    "qwen2.5-0.5b": ("qwen2", dict(intermediate_size=4864, tie_word_embeddings=True)),
    "qwen2.5-7b": ("qwen2", dict(intermediate_size=18944, tie_word_embeddings=False)),
    "qwen2.5-72b": ("qwen2", dict(intermediate_size=29568, tie_word_embeddings=False)),
    "gemma-2-9b": ("gemma2", dict(intermediate_size=14336)),
    "gemma-3-27b": ("gemma3_text", dict(intermediate_size=21504)),  # text part (no vision)
    "gemma-3-270m": ("gemma3_text", dict(intermediate_size=2048)),
    "phi-3-mini": ("phi3", dict(intermediate_size=8192, tie_word_embeddings=False)),
    "falcon-7b": (
        "falcon",
        dict(
            multi_query=True,
            new_decoder_architecture=False,
            parallel_attn=True,
            bias=False,
            tie_word_embeddings=False,
        ),
    ),
    "deepseek-v3": (
        "deepseek_v3",
        dict(
            intermediate_size=18432,
            moe_intermediate_size=2048,
            n_routed_experts=256,
            n_shared_experts=1,
            first_k_dense_replace=3,
            q_lora_rank=1536,
            qk_nope_head_dim=128,
            v_head_dim=128,
            tie_word_embeddings=False,
        ),
    ),
    "deepseek-v2-lite": (
        "deepseek_v2",
        dict(
            intermediate_size=10944,
            moe_intermediate_size=1408,
            n_routed_experts=64,
            n_shared_experts=2,
            first_k_dense_replace=1,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            v_head_dim=128,
            tie_word_embeddings=False,
        ),
    ),
    "smollm2-135m": ("llama", dict(intermediate_size=1536, tie_word_embeddings=True)),
    "smollm2-1.7b": ("llama", dict(intermediate_size=8192, tie_word_embeddings=True)),
}


def _config_of(spec: ModelSpec, num_layers: int | None = None):
    """A transformers config for ``spec`` (with ``num_layers`` layers if given)."""
    from transformers import AutoConfig

    model_type, extra = ARCHITECTURES[spec.name]
    fields = dict(
        num_hidden_layers=num_layers or spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        hidden_size=spec.hidden_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        sliding_window=spec.sliding_window,
        tie_word_embeddings=spec.tied_embeddings,
    )
    if spec.is_mla:
        fields.update(kv_lora_rank=spec.kv_lora_rank, qk_rope_head_dim=spec.qk_rope_head_dim)
    if spec.checkpoint_weight_bits == 8:  # as DeepSeek-V3's config.json says it
        fields["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        }
    if model_type == "falcon":  # no such fields: one KV head comes from multi_query
        del fields["num_key_value_heads"], fields["head_dim"]
    return AutoConfig.for_model(model_type, **(fields | extra))


def test_every_registry_model_has_an_architecture_check():
    assert set(ARCHITECTURES) == set(REGISTRY)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_registry_reproduces_published_parameter_counts(name):
    """The registry's shapes, built into the real transformers architecture, give the model's
    published parameter count (within 2 %: Gemma-3-27B's figure includes its vision tower)."""
    from transformers import AutoModelForCausalLM

    spec = get_spec(name)

    def count(num_layers: int) -> int:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_config_of(spec, num_layers))
        return sum(p.numel() for p in model.parameters())

    # every layer after the first dense ones has the same size: count two, extrapolate
    first = ARCHITECTURES[name][1].get("first_k_dense_replace", 0) + 1
    one, two = count(first), count(first + 1)
    total = one + (spec.num_layers - first) * (two - one)
    assert total == pytest.approx(spec.num_params, rel=0.02)
    assert spec.source  # every figure names where it comes from


@pytest.mark.parametrize("name", list(REGISTRY))
def test_registry_specs_round_trip_through_spec_from_config(name):
    spec = get_spec(name)
    got = spec_from_config(_config_of(spec), name=name, num_params=spec.num_params)
    assert got == spec


@pytest.mark.parametrize(
    "alias", ["Llama-3.1-8B", "llama_3_1_8b", "LLAMA 3.1 8B", "meta-llama/Llama-3.1-8B-Instruct"]
)
def test_get_spec_is_tolerant(alias):
    assert get_spec(alias) is REGISTRY["llama-3.1-8b"]


def test_aliases_and_canonical_names():
    assert get_spec("mistral-7b") is REGISTRY["mistral-7b-v0.1"]
    assert get_spec("Phi-3-mini-4k-instruct") is REGISTRY["phi-3-mini"]
    names = list_specs()
    assert names == list(REGISTRY)
    for name in names:  # every canonical name finds its own spec (no two collide)
        assert name == name.lower() and get_spec(name).name == name


def test_unknown_model_suggests_close_matches():
    with pytest.raises(ValueError, match=r"unknown model 'llama-3-8' — did you mean llama-3\.1-8b"):
        get_spec("llama-3-8")
    with pytest.raises(ValueError, match="did you mean.*qwen2.5-7b"):
        get_spec("qwen-2.5-7")
    with pytest.raises(TypeError, match="string"):
        get_spec(7)


# -- reading configs ------------------------------------------------------------------------


def test_spec_from_config_dicts():
    # head_dim and num_key_value_heads missing: hidden // heads, MHA
    spec = spec_from_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    assert (spec.head_dim, spec.num_kv_heads, spec.attention_type) == (16, 4, "MHA")
    falcon = spec_from_config(
        {"n_layer": 32, "n_head": 71, "hidden_size": 4544, "multi_query": True}
    )
    assert (falcon.num_kv_heads, falcon.head_dim) == (1, 64)
    # a multimodal config.json: the decoder's text_config is read
    nested = spec_from_config(
        {
            "text_config": {
                "num_hidden_layers": 3,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 8,
            }
        }
    )
    assert (nested.num_layers, nested.num_kv_heads, nested.head_dim) == (3, 1, 8)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        spec_from_config({"hidden_size": 64})
    with pytest.raises(ValueError, match="neither head_dim nor hidden_size"):
        spec_from_config({"num_hidden_layers": 2, "num_attention_heads": 4})


def test_spec_from_config_sliding_and_unsupported_layers():
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    # Qwen2 declares a window but turns it off
    assert spec_from_config({**base, "sliding_window": 4096, "use_sliding_window": False}) == (
        spec_from_config(base)
    )
    assert spec_from_config({**base, "sliding_window": 16}).num_full_layers == 0
    all_full = {**base, "sliding_window": 16, "layer_types": ["full_attention"] * 2}
    assert spec_from_config(all_full).sliding_window is None
    with pytest.raises(ValueError, match=r"layer types \['linear_attention'\] are not supported"):
        spec_from_config({**base, "layer_types": ["linear_attention", "full_attention"]})


def _config_like(name: str) -> dict:
    s = get_spec(name)
    return {
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "hidden_size": s.hidden_size,
        "vocab_size": s.vocab_size,
        "max_position_embeddings": s.max_position_embeddings,
    }


def test_spec_from_config_json_dict_gets_transformers_defaults():
    # config.json-style dict with model_type: transformers fills in the layer pattern
    gemma = spec_from_config(
        {"model_type": "gemma2", **_config_like("gemma-2-9b"), "head_dim": 256}
    )
    assert gemma.layer_kinds == get_spec("gemma-2-9b").layer_kinds
    assert gemma.layer_kinds[:4] == ("sliding", "full", "sliding", "full")
    gemma3 = spec_from_config(
        {
            "model_type": "gemma3_text",
            **_config_like("gemma-3-27b"),
            "head_dim": 128,
            "sliding_window": 1024,
        }
    )
    assert gemma3.layer_kinds[:6] == ("sliding",) * 5 + ("full",)
    assert replace(gemma3, name="gemma-3-27b", num_params=get_spec("gemma-3-27b").num_params) == (
        get_spec("gemma-3-27b")
    )


def _tiny_configs():
    from transformers import FalconConfig, Gemma2Config, Gemma3Config, LlamaConfig

    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2)
    return {
        # no head_dim, no num_key_value_heads: hidden // heads, MHA
        "llama-mha": LlamaConfig(**small, intermediate_size=64, num_attention_heads=4),
        # head_dim declared and != hidden // heads
        "gemma2": Gemma2Config(
            **small,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
        ),
        # multi_query: one KV head whatever num_kv_heads says
        "falcon-mqa": FalconConfig(
            **small, num_attention_heads=4, multi_query=True, new_decoder_architecture=False
        ),
        # multimodal: the text config is read
        "gemma3-multimodal": Gemma3Config(
            text_config=dict(
                **small,
                intermediate_size=64,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=8,
            ),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
        ),
    }


@pytest.mark.parametrize("name", ["llama-mha", "gemma2", "falcon-mqa"])
def test_kv_geometry_matches_the_real_cache(name):
    """The shapes kv_geometry reads are the shapes transformers' own cache holds."""
    from transformers import AutoModelForCausalLM

    config = _tiny_configs()[name]
    geometry = kv_geometry(config)
    assert isinstance(geometry, KVGeometry)
    model = AutoModelForCausalLM.from_config(config).eval()
    cache = compat.dynamic_cache(config)
    compat.forward(model, torch.arange(5)[None], cache)
    assert len(cache.layers) == geometry.num_layers
    assert cache.layers[0].keys.shape == (1, geometry.num_kv_heads, 5, geometry.head_dim)
    spec = spec_from_config(config)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == geometry


def test_kv_geometry_reads_the_text_config():
    layers, heads, kv_heads, head_dim = kv_geometry(_tiny_configs()["gemma3-multimodal"])
    assert (layers, heads, kv_heads, head_dim) == (2, 4, 1, 8)
    assert kv_geometry({"num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 8}) == (
        KVGeometry(1, 2, 2, 4)
    )
    with pytest.raises(ValueError, match=r"head_dim must be an int >= 1 \(got 0\)"):
        kv_geometry({"num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 0})


def test_spec_from_bundled_config(model):
    spec = spec_from_config(model.config)
    reg = get_spec("smollm2-135m")
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert kv_geometry(model.config) == (30, 9, 3, 64)
    assert replace(spec, name=reg.name, num_params=reg.num_params) == reg
    assert sum(p.numel() for p in model.parameters()) == reg.num_params


def test_checkpoint_weight_bits_from_the_config_and_checked():
    """A config whose ``quantization_config`` says FP8 (DeepSeek-V3's) is a checkpoint that ships
    8-bit weights; anything else ships 16-bit ones; other values are refused."""
    base = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4}
    base |= {"num_key_value_heads": 2, "hidden_size": 64}
    assert spec_from_config(base).checkpoint_weight_bits == 16
    fp8 = base | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    assert spec_from_config(fp8).checkpoint_weight_bits == 8
    awq = base | {"quantization_config": {"quant_method": "awq", "bits": 4}}
    assert spec_from_config(awq).checkpoint_weight_bits == 16  # (an int4 checkpoint: not modelled)
    assert get_spec("deepseek-v3").checkpoint_weight_bits == 8
    with pytest.raises(ValueError, match="checkpoint_weight_bits must be 16 or 8"):
        ModelSpec("x", 2, 4, 2, 16, checkpoint_weight_bits=4)
