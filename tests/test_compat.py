"""kvlib.compat: building DynamicCaches from tensors, reading them back, copying and prefilling.

(The cache-keyword adapter's tests live in test_quality.py next to the forward passes.)
"""

from __future__ import annotations

import pytest
import torch

from kvlib import compat


def _layers(n: int = 3, seq: int = 5, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(2, 4, seq, 8, generator=g).to(dtype),
            torch.randn(2, 4, seq, 8, generator=g).to(dtype),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dynamic_cache_from_and_back(dtype) -> None:
    layers = _layers(dtype=dtype)
    cache = compat.dynamic_cache_from(layers)
    assert type(cache).__name__ == "DynamicCache" and cache.get_seq_length() == 5
    back = compat.cache_tensors(cache)
    assert len(back) == 3
    for (k, v), (k2, v2) in zip(layers, back, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2) and k2.dtype == dtype


def test_clone_cache_is_independent() -> None:
    cache = compat.dynamic_cache_from(_layers())
    copy = compat.clone_cache(cache)
    compat.cache_tensors(copy)[0][0].zero_()
    copy.update(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), 0)
    assert compat.cache_tensors(cache)[0][0].abs().sum() > 0  # the original's tensors untouched
    assert cache.get_seq_length() == 5 and copy.get_seq_length() == 6


def test_bad_cache_inputs() -> None:
    with pytest.raises(ValueError, match="at least one"):
        compat.dynamic_cache_from([])
    with pytest.raises(TypeError, match="list of"):
        compat.dynamic_cache_from(torch.zeros(2, 2, 2, 2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pair"):
        compat.dynamic_cache_from([(torch.zeros(1, 1, 1, 1),)])
    with pytest.raises(ValueError, match="seq_len"):
        compat.dynamic_cache_from([(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))])
    with pytest.raises(TypeError, match="DynamicCache"):
        compat.cache_tensors(torch.zeros(3))
    with pytest.raises(ValueError, match="empty"):
        compat.cache_tensors(compat.dynamic_cache())
    with pytest.raises(TypeError, match="torch.Tensor"):
        compat.prefill_cache(None, [1, 2])  # type: ignore[arg-type]


def test_chunked_prefill_fills_the_same_cache(model, eval_ids) -> None:
    ids = eval_ids[:, :100]
    whole = compat.prefill_cache(model, ids)
    chunked = compat.prefill_cache(model, ids, chunk_size=32)
    assert whole.get_seq_length() == chunked.get_seq_length() == 100
    for (k, v), (k2, v2) in zip(
        compat.cache_tensors(whole), compat.cache_tensors(chunked), strict=True
    ):
        assert torch.allclose(k, k2, atol=1e-4) and torch.allclose(v, v2, atol=1e-4)
    with pytest.raises(ValueError, match="chunk_size"):
        compat.prefill_cache(model, ids, chunk_size=0)


def test_prefill_fills_a_given_cache_and_generate_goes_on_from_it(model, eval_ids) -> None:
    """A cache filled in chunks serves ``generate`` on the whole prompt: the next-token logits
    match one pass over the prompt, and generation adds only the new tokens to it."""
    from kvlib.caches import registry

    ids = eval_ids[:, :80]
    whole = compat.forward(model, ids, compat.dynamic_cache(model.config)).logits[:, -1]
    for name in ("dynamic-fp32", "kvlib-int4"):
        cache = compat.prefill_cache(
            model, ids[:, :-1], chunk_size=32, cache=registry.make_cache(name, model.config)
        )
        assert cache.get_seq_length() == 79
        out = compat.generate(model, ids, cache, max_new_tokens=5, do_sample=False)
        assert out.shape == (1, 85) and torch.equal(out[:, :80], ids)
        assert cache.get_seq_length() == 84  # the prompt's last token and 4 of the 5 new ones
    fp32 = compat.prefill_cache(model, ids[:, :-1], chunk_size=32)
    last = compat.forward(model, ids[:, -1:], fp32).logits[:, -1]
    assert torch.allclose(last, whole, atol=1e-4)
    with pytest.raises(TypeError, match="transformers Cache"):
        compat.prefill_cache(model, ids, cache=object())


def test_hybrid_cache_from_tensors_masks_like_the_one_a_model_fills() -> None:
    """A cache rebuilt from a hybrid model's tensors (sliding layers shorter) continues exactly
    like the original, and its clone keeps its sliding layers."""
    from _tiny_models import gemma3_config
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(gemma3_config(window=16)).eval()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = compat.prefill_cache(model, ids[:, :30])
    windows = compat.cache_windows(cache)
    assert windows == compat.layer_windows(model.config) == [16] * 5 + [None]
    layers = compat.cache_tensors(cache)
    assert [k.shape[2] for k, _ in layers] == [15] * 5 + [30]
    rebuilt = compat.dynamic_cache_from([(k.clone(), v.clone()) for k, v in layers], windows, 30)
    clone = compat.clone_cache(cache)
    assert compat.cache_windows(clone) == windows and clone.get_seq_length() == 30
    with torch.no_grad():
        ref = compat.forward(model, ids[:, 30:], cache).logits
        for other in (rebuilt, clone):
            assert torch.equal(compat.forward(model, ids[:, 30:], other).logits, ref)
    # without the windows or the length, the sliding layers would mask wrongly: refused
    with pytest.raises(ValueError, match="full attention"):
        compat.dynamic_cache_from(layers, [None] * 6)
    with pytest.raises(ValueError, match="windows names 2 layers"):
        compat.dynamic_cache_from(layers, [16, None])
    with pytest.raises(ValueError, match="seq_len"):
        compat.dynamic_cache_from(layers, windows, seq_len=20)
    with pytest.raises(ValueError, match="windows"):
        compat.dynamic_cache_from(layers, [0] * 5 + [None])
    with pytest.raises(TypeError, match="DynamicCache"):
        compat.cache_windows(torch.zeros(2))
