"""benchmarks/bench_keys.py's steps on tiny models, and kvlib.eval.capture.channel_spread."""

from __future__ import annotations

import pytest
import torch
from _scripts import load_script
from _tiny_models import gemma3_config, tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Gemma3ForCausalLM

from kvlib.eval.capture import channel_spread


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_keys.py")


@settings(max_examples=40, deadline=None)
@given(scale=st.floats(0.01, 100), boost=st.floats(1.5, 50), seed=st.integers(0, 2**16))
def test_channel_spread_sees_an_outlier_channel_and_no_overall_scale(scale, boost, seed):
    k = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(seed)) + 0.1
    base = channel_spread(k)
    assert base >= 1 and channel_spread(scale * k) == pytest.approx(base, rel=1e-5)
    loud = k.clone()
    loud[..., 3] *= boost * 10  # one channel far above the rest
    assert channel_spread(loud) > base


def test_channel_spread_refuses_bad_input():
    with pytest.raises(ValueError, match="non-empty"):
        channel_spread(torch.ones(3, 4))
    with pytest.raises(ValueError, match="zero"):
        channel_spread(torch.zeros(1, 1, 4, 8))


@pytest.mark.parametrize("hybrid", [False, True])
def test_rows_and_tables_on_a_tiny_model(bench, monkeypatch, hybrid) -> None:
    torch.manual_seed(0)
    model = (
        Gemma3ForCausalLM(gemma3_config(window=16)).eval()
        if hybrid
        else tiny_llama(seed=1, head_dim=64)
    )
    monkeypatch.setattr(bench, "KEY_TOKENS", 48)
    monkeypatch.setattr(bench, "QUERIES", 16)
    monkeypatch.setattr(bench, "TOKENS", 192)
    g = torch.Generator().manual_seed(0)
    segments = [torch.randint(0, model.config.vocab_size, (1, 192), generator=g) for _ in range(2)]
    keys = bench.key_rows(model, segments)
    assert keys["global_layers"] == ([5] if hybrid else [0, 1])
    assert len(keys["channel_spread_segments"]) == 2
    errors = {n: keys[f"attention_error_segments {n}"] for n in bench.RECIPES}
    for s in range(2):  # every recipe measured on every segment, an int4 error
        assert 0 < errors["per-channel"][s] and all(0 < e[s] < 2 for e in errors.values())
    rows = bench.perplexity_rows(model, segments)
    ref = "dynamic-fp32"
    assert list(rows) == [ref, bench.EVICT]
    assert rows[ref]["perplexity_delta_pct_segments"] == [0.0, 0.0]
    twin = rows[bench.EVICT]["not_rotated"]
    assert twin["perplexity_segments"] != rows[bench.EVICT]["perplexity_segments"]
    table = bench.tables(keys, rows)
    assert len(table.splitlines()) == 4 + 1 + 5  # header, rule, 2 segments; blank; the same, 3 rows
    assert "not rotated" in table
