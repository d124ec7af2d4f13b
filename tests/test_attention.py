"""Tests for kvlib.attention: the dense reference attention (causal, GQA, padded rows)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.attention import dense_attention, pad_sequences


def _loop_attention(q, k, v, causal=True):
    """Plain loop over heads: softmax(q kᵀ/√d) v, query head h uses kv head h // rep; queries
    are the last positions of the keys."""
    rep = q.shape[1] // k.shape[1]
    sq, sk, d = q.shape[2], k.shape[2], q.shape[3]
    outs = []
    for h in range(q.shape[1]):
        s = q[:, h] @ k[:, h // rep].transpose(-1, -2) / d**0.5
        if causal:
            future = torch.arange(sk)[None, :] > torch.arange(sk - sq, sk)[:, None]
            s = s.masked_fill(future, float("-inf"))
        outs.append(torch.softmax(s, -1) @ v[:, h // rep])
    return torch.stack(outs, 1)


def test_matches_a_loop_reference_gqa_and_decode():
    q, k, v = torch.randn(2, 6, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    full = dense_attention(q, k, v)
    assert full.shape == (2, 6, 10, 8) and full.dtype == torch.float32
    assert torch.allclose(full, _loop_attention(q, k, v), atol=1e-5)
    last = dense_attention(q[:, :, -3:], k, v)  # decode-style: last 3 queries vs all keys
    assert torch.allclose(last, full[:, :, -3:], atol=1e-5)
    every = dense_attention(q, k, v, causal=False)
    assert torch.allclose(every, _loop_attention(q, k, v, causal=False), atol=1e-5)
    assert not torch.allclose(every[:, :, :-1], full[:, :, :-1], atol=1e-3)
    # the last query sees every key either way
    assert torch.allclose(every[:, :, -1], full[:, :, -1], atol=1e-6)


def test_causal_mask_keeps_the_newest_value_from_earlier_queries():
    q, k, v = torch.randn(1, 3, 16, 8), torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8)
    v2 = v.clone()
    v2[:, :, -1] += 1.0
    changed = dense_attention(q, k, v2) != dense_attention(q, k, v)
    assert not bool(changed[:, :, :-1].any()) and bool(changed[:, :, -1].all())


def test_one_sequence_equals_sdpa_with_builtin_gqa():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 1, 64, generator=g)
    k, v = torch.randn(1, 3, 37, 64, generator=g), torch.randn(1, 3, 37, 64, generator=g)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(dense_attention(q, k, v), sdpa, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(3, 30), min_size=1, max_size=4),
    q_len=st.integers(1, 3),
    causal=st.booleans(),
    group=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**16),
)
def test_padded_rows_equal_each_row_alone(lens, q_len, causal, group, seed):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(2, n, 8, generator=g) for n in lens]
    values = [torch.randn(2, n, 8, generator=g) for n in lens]
    k, lengths = pad_sequences(keys)
    v, _ = pad_sequences(values)
    for i, n in enumerate(lens):  # large padding: it must not count
        k[i, :, n:] = 1e4
        v[i, :, n:] = -1e4
    q = torch.randn(len(lens), 2 * group, q_len, 8, generator=g)
    out = dense_attention(q, k, v, causal=causal, lengths=lengths)
    for i in range(len(lens)):
        alone = dense_attention(q[i : i + 1], keys[i][None], values[i][None], causal=causal)
        torch.testing.assert_close(out[i : i + 1], alone, atol=1e-5, rtol=1e-5)


def test_scale_and_dtypes():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    torch.testing.assert_close(
        dense_attention(q, k, v, scale=1.0), dense_attention(q * 8**0.5, k, v), atol=1e-5, rtol=0
    )
    half = dense_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert half.dtype == torch.float32
    assert dense_attention(q.double(), k, v).dtype == torch.float64


@pytest.mark.parametrize(
    "shapes, msg",
    [
        (((1, 3, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), "multiple of kv heads"),
        (((1, 2, 5, 8), (1, 1, 4, 8), (1, 1, 4, 8)), "more queries"),
        (((1, 2, 4, 8), (1, 1, 4, 8), (1, 1, 3, 8)), "same shape"),
        (((2, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8)), "4-d"),
        (((1, 2, 4, 8), (1, 1, 4, 4), (1, 1, 4, 4)), "head_dim must agree"),
    ],
)
def test_bad_shapes(shapes, msg):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=msg):
        dense_attention(q, k, v)


def test_bad_lengths_and_dtypes():
    q, k, v = torch.randn(2, 2, 3, 8), torch.randn(2, 1, 6, 8), torch.randn(2, 1, 6, 8)
    with pytest.raises(ValueError, match=r"lengths must be in \[3, kv_len = 6\]"):
        dense_attention(q, k, v, lengths=[2, 6])  # a causal row must hold its 3 queries
    with pytest.raises(ValueError, match=r"lengths must be in \[1, kv_len = 6\]"):
        dense_attention(q, k, v, causal=False, lengths=[7, 6])
    with pytest.raises(ValueError, match="one per row"):
        dense_attention(q, k, v, lengths=[6])
    with pytest.raises(TypeError, match="floating-point"):
        dense_attention(q, k.long(), v)
    out = dense_attention(q, k, v, causal=False, lengths=torch.tensor([1, 6]))
    torch.testing.assert_close(out[0], v[0, :, :1].expand(2, 3, 8))  # one key: its value


def test_pad_sequences():
    a, b = torch.randn(3, 2, 4), torch.randn(3, 5, 4)
    padded, lengths = pad_sequences([a, b])
    assert padded.shape == (2, 3, 5, 4) and lengths.tolist() == [2, 5]
    assert lengths.dtype == torch.int64
    assert torch.equal(padded[0, :, :2], a) and torch.equal(padded[1], b)
    assert not bool(padded[0, :, 2:].any())
    with pytest.raises(ValueError, match="at least one"):
        pad_sequences([])
    with pytest.raises(ValueError, match="kv_heads, seq_len, head_dim"):
        pad_sequences([a, torch.randn(2, 5, 4)])
