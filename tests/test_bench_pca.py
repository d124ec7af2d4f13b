"""benchmarks/bench_pca.py's steps on tiny models: the PCA and integer rows, their two ratios
(whole cache, global layers) and the table, on a full-attention model and a hybrid one."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from _scripts import load_script
from _tiny_models import gemma3_config, tiny_llama
from transformers import Gemma3ForCausalLM

from kvlib import compat
from kvlib.eval import capture
from kvlib.kvtc import pca


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_pca.py")


def _measure(bench, model, prefix_len: int = 300):
    """Bases fitted on random-token chunks of ``model``, then the benchmark's PCA rows (target
    4×) and integer rows on a ``prefix_len``-token prefix and 16 scored tokens."""
    g = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    chunks = [
        capture.capture_kv(model.model, torch.randint(0, vocab, (1, 32), generator=g))
        for _ in range(8)
    ]
    layers = [
        (torch.cat([c[i][0] for c in chunks]), torch.cat([c[i][1] for c in chunks]))
        for i in range(len(chunks[0]))
    ]
    coded = [i for i, w in enumerate(compat.layer_windows(model.config)) if w is None]
    bases = {
        cross: pca.fit_basis(layers, cross_layer=cross, coded_layers=coded, skip_tokens=2)
        for cross in (True, False)
    }
    ids = torch.randint(0, vocab, (1, prefix_len + 16), generator=g)
    prefix, nxt = ids[:, :prefix_len], ids[:, prefix_len:]
    args = SimpleNamespace(
        prefix_len=prefix_len, min_run_time=0.01, targets={True: [4], False: [4]}
    )
    cache = compat.prefill_cache(model, prefix)
    progress = SimpleNamespace(update=lambda *a: None)
    rows = bench.pca_rows(model, cache, nxt, bases, args, progress)
    rows += bench.integer_rows(model, prefix, cache, nxt, progress)
    return cache, coded, rows


def test_full_attention_rows_have_one_ratio(bench) -> None:
    model = tiny_llama(seed=1, head_dim=64)
    cache, coded, rows = _measure(bench, model)
    assert coded == [0, 1]
    assert [r.name for r in rows][:2] == ["PCA cross-layer, target 4x", "PCA per-layer, target 4x"]
    for r in rows:
        assert math.isfinite(r.ppl) and r.ratio > 1
        assert r.global_ratio == pytest.approx(r.ratio, rel=1e-9)  # nothing is stored whole
    table = bench.table(rows, rows[0].ppl)
    assert "global layers" not in table and table.count("\n") == len(rows) + 1
    assert "x_smaller_than_fp16_global_layers" not in bench._row(rows[0], rows[0].ppl)


def test_hybrid_rows_read_the_global_layers_apart(bench) -> None:
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(gemma3_config(window=16)).eval()
    cache, coded, rows = _measure(bench, model)
    assert coded == [5] and bench.global_layers(cache) == coded
    fp16, fp16_global = bench.fp16_bytes(cache), bench.fp16_bytes(cache, coded)
    assert fp16_global == 2 * 2 * 300 * 64 and fp16 == fp16_global + 5 * 2 * 2 * 15 * 64
    by_name = {r.name: r for r in rows}
    for name, r in by_name.items():
        # the windows are kept whole in fp16 by every row: only the global layers shrink
        assert r.global_ratio > r.ratio > 1, name
        assert r.ratio < fp16 / (fp16 - fp16_global), name  # the windows bound the whole ratio
    table = bench.table(rows, rows[0].ppl, hybrid=True)
    assert "global layers vs fp16" in table.splitlines()[0]
    row = bench._row(by_name["PCA cross-layer, target 4x"], rows[0].ppl, hybrid=True)
    assert row["x_smaller_than_fp16_global_layers"] > row["x_smaller_than_fp16"]
    assert {"encode_s", "decode_s", "mse_predicted", "mse_measured"} <= set(row)
    lines = bench.target_lines(rows, rows[0].ppl, hybrid=True).splitlines()
    assert lines[0].startswith("Target ≥ 8× at") and "over the global layers" in lines[1]
    assert len(bench.target_lines(rows, rows[0].ppl).splitlines()) == len(lines) - 1


def test_variance_components_count_a_low_rank_cache(bench) -> None:
    from _synthetic_kv import correlated_layers

    basis = pca.fit_basis(correlated_layers(8, 32, layers=3, heads=2, hd=8), cross_layer=True)
    rank = bench.variance_components(basis)
    assert rank["dims"] == 3 * 2 * 8
    assert 1 <= rank["keys"] <= 6 and 1 <= rank["values"] <= 6  # a rank-6 mix plus noise
    assert bench.variance_components(basis, share=0.999)["keys"] >= rank["keys"]


def test_target_options(bench) -> None:
    args = bench.parse_args(["--targets", "4", "6.5", "--per-layer-targets", "8"])
    assert args.targets == {True: ["4", "6.5"], False: ["8"]}
    assert bench.parse_args([]).targets == {
        True: ["12", "16", "24", "32", "48", "64"],
        False: ["8", "16", "32"],
    }
    with pytest.raises(SystemExit):
        bench.parse_args(["--targets", "0.5"])
