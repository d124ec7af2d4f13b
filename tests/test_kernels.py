"""The fused decode kernel (kvlib.kernels.decode) against the torch reference path, on CPU.

Triton runs kernels on CPU tensors only in its interpreter, and only when ``TRITON_INTERPRET=1``
is set before triton is first imported: tests/conftest.py sets it before anything is imported
(transformers may import triton through torch.compile). triton is a requirement: if it cannot
be imported these tests fail, they do not skip.

Tolerance: with float32 inputs the kernel and the reference dequantize to the same float32
values (``code * scale + zero point``) and differ only in the order of their float32 sums and
in ``exp2`` against ``exp``: measured at most 4e-7 on outputs of size ~1 at these sizes. We
assert 1e-5, 25x that, and still 1000x below one int8 quantization step (~1e-2 here), so an
indexing, scale or masking mistake cannot pass. float16 queries: 2e-3 (a float16 unit in the
last place at 1 is 1e-3; both paths round their dot-product inputs to float16).

Sizes are tiny (head_dim 16, blocks of 16 tokens, a few blocks): the interpreter takes about
0.2 s a call.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton  # noqa: F401  -- a requirement: fail loudly when missing
from _tiny_models import tiny_llama as _tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from kvlib import compat
from kvlib.caches.quantized import QuantizedKVCache, QuantizedKVLayer
from kvlib.kernels import decode as kernels
from kvlib.kernels import fused_attention
from kvlib.kernels.decode import PackedKV, decode_attention, decode_attention_reference
from kvlib.quant.rotation import hadamard

ROOT = Path(__file__).resolve().parents[1]
ATOL32 = 1e-5
ATOL16 = 2e-3
D, R = 16, 16  # head_dim, tokens per quantized block


def test_kernels_run_in_the_interpreter() -> None:
    """Set by tests/conftest.py before triton was first imported."""
    assert kernels.triton_available()
    assert kernels.interpreter_mode(), "TRITON_INTERPRET=1 came after triton was imported"


def packed_layer(
    tokens: int,
    *,
    bits: int = 4,
    batch: int = 1,
    kv_heads: int = 2,
    head_dim: int = D,
    residual_length: int = R,
    sinks: int = 2,
    group_size: int = 8,
    key_group_size: int | None = None,
    rotate: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PackedKV:
    """A QuantizedKVLayer fed ``tokens`` random tokens, then one more as this step's token."""
    g = torch.Generator().manual_seed(seed)
    layer = QuantizedKVLayer(
        bits,
        bits,
        group_size=group_size,
        residual_length=residual_length,
        sink_tokens=sinks,
        rotation=hadamard(head_dim) if rotate else None,
        window_dtype=dtype,
        key_group_size=key_group_size,
    )
    shape = (batch, kv_heads, tokens, head_dim)
    if tokens:
        layer.update(
            torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
        )
    else:
        empty = torch.zeros(shape, dtype=dtype)
        layer.lazy_initialization(empty, empty)
    new = (batch, kv_heads, 1, head_dim)
    return layer.packed(
        torch.randn(new, generator=g).to(dtype), torch.randn(new, generator=g).to(dtype)
    )


def query_for(
    kv: PackedKV, gqa: int, dtype: torch.dtype = torch.float32, seed: int = 1
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((kv.batch_size, kv.kv_heads * gqa, 1, kv.head_dim), generator=g).to(dtype)


def ragged_mask(kv: PackedKV, seed: int = 2) -> torch.Tensor:
    """Left padding of a different length per row (row 0 unpadded); the last token visible."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones((kv.batch_size, kv.num_tokens), dtype=torch.bool)
    for row in range(1, kv.batch_size):
        mask[row, : int(torch.randint(0, kv.num_tokens, (1,), generator=g))] = False
    return mask


def check(kv: PackedKV, gqa: int = 2, mask: bool = False, **kw) -> float:
    q = query_for(kv, gqa)
    m = ragged_mask(kv) if mask else None
    ref = decode_attention_reference(q, kv, kv_mask=m)
    out = decode_attention(q, kv, kv_mask=m, backend="triton", **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = float((out - ref).abs().max())
    assert err < ATOL32, err
    return err


# ---------------------------------------------------------------- kernel vs reference

# lengths around the block structure (2 sinks, blocks of 16): no block yet, a block exactly
# filled (window holds only the new token), one token more and one less, several blocks
LENGTHS = [0, 1, 2, 9, 2 + R - 1, 2 + R, 2 + R + 1, 2 + 3 * R - 1, 2 + 3 * R, 2 + 3 * R + 5]


@pytest.mark.parametrize("tokens", LENGTHS)
def test_lengths_at_block_boundaries(tokens: int) -> None:
    check(packed_layer(tokens, bits=4))


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("rotate", [False, True])
def test_bits_and_rotation(bits: int, rotate: bool) -> None:
    check(packed_layer(2 + 2 * R + 3, bits=bits, rotate=rotate, batch=2), mask=True)


@pytest.mark.parametrize("gqa", [1, 3, 4])
def test_gqa_ratios(gqa: int) -> None:
    check(packed_layer(2 + 2 * R + 1, kv_heads=2), gqa=gqa)


@pytest.mark.parametrize(("group_size", "key_group_size"), [(16, 16), (4, 4), (2, 8), (8, 1)])
def test_group_sizes(group_size: int, key_group_size: int) -> None:
    check(packed_layer(2 + 2 * R + 2, group_size=group_size, key_group_size=key_group_size))


def test_head_dim_not_a_power_of_two_and_no_sinks() -> None:
    check(packed_layer(2 * 8 + 3, head_dim=24, residual_length=8, sinks=0, group_size=8))


def test_ragged_batch_and_splits() -> None:
    """Left padding of different lengths per row; more splits than tiles leaves some empty."""
    kv = packed_layer(2 + 4 * R + 7, batch=3, bits=4, rotate=True)
    for splits in (1, 2, 7):
        check(kv, gqa=2, mask=True, num_splits=splits, block_tokens=16)


def test_float16_query() -> None:
    kv = packed_layer(2 + 2 * R + 3, dtype=torch.float16)
    q = query_for(kv, 2, torch.float16)
    out = decode_attention(q, kv, backend="triton")
    ref = decode_attention_reference(q, kv)
    assert out.dtype == torch.float16
    assert float((out.float() - ref.float()).abs().max()) < ATOL16


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    blocks=st.integers(0, 3),
    window=st.integers(0, R - 1),
    gqa=st.sampled_from([1, 2]),
    batch=st.integers(1, 2),
    splits=st.integers(1, 3),
)
def test_kernel_matches_reference_property(bits, blocks, window, gqa, batch, splits) -> None:
    """Any mix of bits, block count, window fill, GQA, batch and splits agrees, padded too."""
    kv = packed_layer(2 + blocks * R + window, bits=bits, batch=batch, seed=blocks * 31 + window)
    check(kv, gqa=gqa, mask=batch > 1, num_splits=splits)


def test_masked_token_is_as_if_absent() -> None:
    """Masking the window's tokens equals a cache that never held them (both paths)."""
    full = packed_layer(2 + R + 4)
    drop = PackedKV(
        full.sink_keys,
        full.sink_values,
        full.key_blocks,
        full.value_blocks,
        full.window_keys[:, :, -1:],
        full.window_values[:, :, -1:],
    )
    mask = torch.ones((1, full.num_tokens), dtype=torch.bool)
    mask[:, -5:-1] = False
    q = query_for(full, 2)
    a = decode_attention(q, full, kv_mask=mask, backend="triton")
    b = decode_attention(q, drop, backend="triton")
    assert float((a - b).abs().max()) < ATOL32


# ---------------------------------------------------------------- errors and sizes


def test_bad_arguments_say_what_is_accepted() -> None:
    kv = packed_layer(2 + R + 1)
    q = query_for(kv, 2)
    with pytest.raises(ValueError, match="one decode step"):
        decode_attention(torch.zeros(1, 4, 2, D), kv)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        decode_attention(torch.zeros(1, 3, 1, D), kv)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(torch.zeros(1, 4, 1, 8), kv)
    with pytest.raises(TypeError, match="floating"):
        decode_attention(torch.zeros(1, 4, 1, D, dtype=torch.int64), kv)
    with pytest.raises(TypeError, match="bool"):
        decode_attention(q, kv, kv_mask=torch.ones(1, kv.num_tokens))
    with pytest.raises(ValueError, match=r"\(batch, T\)"):
        decode_attention(q, kv, kv_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="backend must be one of auto, triton, torch"):
        decode_attention(q, kv, backend="cuda")
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q, kv, backend="triton", block_tokens=24)
    with pytest.raises(ValueError, match="scaling"):
        decode_attention(q, kv, scaling=-1.0)
    with pytest.raises(TypeError, match="PackedKV"):
        decode_attention(q, (kv.window_keys, kv.window_values))
    with pytest.raises(ValueError, match="both be given"):
        PackedKV(
            kv.sink_keys, kv.sink_values, kv.key_blocks, None, kv.window_keys, kv.window_values
        )
    with pytest.raises(ValueError, match="head_dim=16"):
        PackedKV(
            kv.sink_keys[..., :8], kv.sink_values, None, None, kv.window_keys, kv.window_values
        )
    with pytest.raises(ValueError, match="rotation must be"):
        PackedKV(
            *(kv.sink_keys, kv.sink_values, None, None, kv.window_keys, kv.window_values),
            torch.eye(4),
        )


def test_auto_backend_is_torch_on_cpu() -> None:
    kv = packed_layer(2 + R + 1)
    q = query_for(kv, 2)
    assert torch.equal(decode_attention(q, kv), decode_attention_reference(q, kv))


def test_step_bytes_counts_codes_metadata_and_window() -> None:
    kv = packed_layer(2 + 2 * R + 3, bits=4)
    window = sum(
        t.numel() * t.element_size()
        for t in (kv.sink_keys, kv.sink_values, kv.window_keys, kv.window_values)
    )
    blocks = kv.key_blocks.nbytes + kv.value_blocks.nbytes
    q_and_out = 2 * 1 * 4 * D * 4  # float32 query and output, 4 query heads
    assert kernels.step_bytes(kv, query_heads=4) == window + blocks + q_and_out
    # 4-bit codes of 2 blocks: 2 * (keys + values) * b * h * R * D / 2 bytes
    assert kv.key_blocks.code_nbytes == 2 * 2 * R * D // 2


# ---------------------------------------------------------------- the cache and generate()


def tiny_llama(kv_heads: int = 2, seed: int = 0) -> LlamaForCausalLM:
    return _tiny_llama(seed, num_key_value_heads=kv_heads, intermediate_size=32, vocab_size=64)


def run_generate(model, cache, ids, mask):
    return compat.generate(
        model,
        ids,
        cache=cache,
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )


@pytest.mark.parametrize(("bits", "kv_heads"), [(4, 2), (2, 1)])
def test_generate_fused_matches_torch_path(monkeypatch, bits: int, kv_heads: int) -> None:
    """A padded batch of two through generate(): the same tokens and logits (to 1e-5) with the
    kernel (forced on CPU) as with the torch path; the kernel really ran at every decode step.
    2 bits rotates the keys by default, so the query-rotation path runs too."""
    model = tiny_llama(kv_heads)
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(bits=bits, residual_length=8, sink_tokens=2, window_dtype=torch.float32)
    calls = []
    real = kernels._triton_decode
    monkeypatch.setattr(kernels, "_triton_decode", lambda *a: calls.append(1) or real(*a))
    torch_cache = QuantizedKVCache(model.config, fused_decode=False, **kw)
    ref = run_generate(model, torch_cache, ids, mask)
    assert not calls and model.config._attn_implementation == "sdpa"
    fused_cache = QuantizedKVCache(model.config, fused_decode=True, **kw)
    assert fused_cache.rotate == (bits == 2)
    out = run_generate(model, fused_cache, ids, mask)
    assert model.config._attn_implementation == fused_attention.ATTN_IMPLEMENTATION
    assert len(calls) == 9 * 2  # 9 decode steps (the first token comes from prefill), 2 layers
    assert torch.equal(out.sequences, ref.sequences)
    err = max(float((a - b).abs().max()) for a, b in zip(out.scores, ref.scores, strict=True))
    assert err < ATOL32, err
    assert fused_cache.nbytes() == torch_cache.nbytes()
    # kvlib_fused is sdpa for any other cache
    dyn = run_generate(model, None, ids, mask)
    model.config._attn_implementation = "sdpa"
    dyn_sdpa = run_generate(model, None, ids, mask)
    assert torch.equal(dyn.sequences, dyn_sdpa.sequences)


def test_auto_on_cpu_keeps_the_torch_path() -> None:
    model = tiny_llama()
    cache = QuantizedKVCache(model.config, residual_length=8)
    assert cache.fused_decode is None
    k = torch.randn(1, 2, 12, 16)
    cache.update(k, k, 0)
    keys, _ = cache.update(k[:, :, :1], k[:, :, :1], 0)
    assert keys.shape[2] == 13 and fused_attention.tagged_step(keys) is None
    assert model.config._attn_implementation == "sdpa"


def test_fused_step_returns_tagged_new_states_and_unread_steps_raise() -> None:
    model = tiny_llama()
    cache = QuantizedKVCache(model.config, residual_length=8, fused_decode=True)
    k = torch.randn(1, 2, 12, 16)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    keys, values = cache.update(k[:, :, :1], k[:, :, :1], 0)
    step = fused_attention.tagged_step(keys)
    assert keys.shape[2] == 1 and step is not None and step.kv.num_tokens == 13
    assert cache.get_seq_length(0) == 13
    with pytest.raises(RuntimeError, match="attn_implementation='kvlib_fused'"):
        cache.update(k[:, :, :1], k[:, :, :1], 1)  # layer 0's step was never read


def test_fused_decode_option_errors(monkeypatch) -> None:
    model = tiny_llama()
    with pytest.raises(TypeError, match="fused_decode must be True, False or None"):
        QuantizedKVCache(model.config, fused_decode="yes")
    k = torch.randn(1, 2, 4, 16)
    eager = tiny_llama()
    eager.config._attn_implementation = "eager"
    cache = QuantizedKVCache(eager.config, residual_length=8, fused_decode=True)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="'eager'"):
        cache.update(k[:, :, :1], k[:, :, :1], 0)
    import kvlib.caches.quantized_layer

    monkeypatch.setattr(kvlib.caches.quantized_layer, "interpreter_mode", lambda: False)
    cache = QuantizedKVCache(model.config, residual_length=8, fused_decode=True)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        cache.update(k[:, :, :1], k[:, :, :1], 0)


def test_kvlib_runs_without_triton() -> None:
    """kvlib imports and runs the torch path where triton is absent; the kernel says why not."""
    code = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, NoTriton())
import torch
from transformers import LlamaConfig
from kvlib.kernels import decode as kernels
from kvlib.caches.quantized import QuantizedKVCache
assert not kernels.triton_available()
cfg = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=32, vocab_size=64)
cache = QuantizedKVCache(cfg, residual_length=8)
k = torch.randn(1, 2, 12, 16)
cache.update(k, k, 0)
keys, _ = cache.update(k[:, :, :1], k[:, :, :1], 0)
assert keys.shape[2] == 13
kv = cache.layers[0].packed()
try:
    kernels.decode_attention(torch.randn(1, 4, 1, 16), kv, backend="triton")
except ImportError as e:
    assert "needs triton" in str(e)
    print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
