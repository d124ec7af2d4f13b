"""kvlib.eval.model_choice: random models of real architectures, and which model a machine runs."""

from __future__ import annotations

import pytest
import torch

from kvlib import compat
from kvlib.eval import model_choice
from kvlib.specs import get_spec, spec_from_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", sorted(model_choice.ARCHITECTURES))
def test_random_config_matches_registry(name):
    spec = get_spec(name)
    config = model_choice.random_config(name)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        meta_model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in meta_model.parameters()) == spec.num_params
    got = spec_from_config(config)
    for attr in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size"):
        assert getattr(got, attr) == getattr(spec, attr)


def test_random_model_shapes_and_cache():
    model = model_choice.random_model(
        "smollm2-1.7b", device="cpu", num_layers=2, vocab_size=256, intermediate_size=64
    )
    spec = get_spec("smollm2-1.7b")
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
        model_choice.random_config("falcon-7b")


def test_choose_model():
    cpu = model_choice.choose_model("cpu")
    assert cpu.kind == "bundled" and cpu.real_weights
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        chosen = model_choice.choose_model("cuda", hub=True)
        assert chosen.model_id == model_choice.DEFAULT_HUB_MODEL
        random_choice = model_choice.choose_model("cuda", hub=False)
        assert random_choice.kind == "random" and not random_choice.real_weights
    with pytest.raises(ValueError, match="kind"):
        model_choice.load_choice(model_choice.ModelChoice("weird", None, None, "cpu", ""))
