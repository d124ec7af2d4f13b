"""Quantization kernel throughput: kvlib vs optimum-quanto vs HQQ, against a plain clone().

    .venv/bin/python benchmarks/bench_quant.py            # 30 layers x 3 heads x 4096 x 64
    .venv/bin/python benchmarks/bench_quant.py --quick    # 1024 tokens, shorter measurements

One fp32 tensor shaped like the bundled model's whole key cache at 4096 tokens, flattened over
layers: (layers * batch, kv_heads, seq_len, head_dim) = (30, 3, 4096, 64). Every quantizer uses
per-token groups of head_dim = 64 consecutive elements (kvlib ``axis=-1``; quanto ``axis=0,
group_size=64`` on the (-1, 64) view; HQQ ``axis=1, group_size=64``), asymmetric min/max except
quanto int8 (its only 8-bit weight type is symmetric absmax). kvlib is also run per-channel
(``axis=-2``, statistics over the 4096 tokens). HQQ runs plain round-to-nearest
(``optimize=False``) and with its proximal optimizer (``optimize=True``, what transformers'
``HQQQuantizedLayer`` uses).

GB/s counts the fp32 tensor's bytes (what is produced by dequantize / consumed by quantize).
"x clone" is the time relative to ``x.clone()`` of the same fp32 data, measured in the same run.
Bits/elem counts packed codes plus every scale and zero point kept. rel. RMSE is
``‖x̂ − x‖ / ‖x‖``. Times are medians per call from ``torch.utils.benchmark``'s
``blocked_autorange`` (warm-up included; at least ``--min-run-time`` seconds measured per
quantizer and direction; ``benchmarks/_timing.py``), with the torch thread count the run prints.
A tqdm progress bar on stderr counts the bit widths done (off when stderr is not a terminal).

The table's figures, at the precision it prints, are also written as run ``"quant"`` of
``kvlib/results.json`` (:func:`kvlib.results.record_run`; ``--no-json`` skips it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import warnings
from dataclasses import dataclass

import torch
from _machine import cpu_model, machine
from _timing import median_seconds
from tqdm import tqdm

import kvlib
from kvlib import results
from kvlib.quant.tensor import quantize


@dataclass
class Row:
    impl: str
    bits: int
    quant_s: float
    dequant_s: float
    bits_per_elem: float
    rel_rmse: float


def rel_rmse(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x_hat.float() - x) / torch.linalg.vector_norm(x))


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bench_kvlib(x: torch.Tensor, bits: int, axis: int, min_run_time: float) -> Row:
    tq, q = median_seconds(lambda: quantize(x, bits, axis=axis), min_run_time=min_run_time)
    td, _ = median_seconds(q.dequantize, min_run_time=min_run_time)
    name = "kvlib per-token" if axis == -1 else "kvlib per-channel"
    return Row(name, bits, tq, td, q.bits_per_element, rel_rmse(q.dequantize(), x))


def bench_quanto(x: torch.Tensor, bits: int, min_run_time: float) -> Row | None:
    from optimum.quanto import AbsmaxOptimizer, MaxOptimizer, qint2, qint4, qint8, quantize_weight

    qtypes = {2: qint2, 4: qint4, 8: qint8}
    if bits not in qtypes:
        return None
    qtype = qtypes[bits]
    w = x.reshape(-1, x.shape[-1])

    def run():
        if bits == 8:
            scale = AbsmaxOptimizer()(w, qtype, 0)
            return quantize_weight(w, qtype, 0, scale)
        scale, shift = MaxOptimizer()(w, qtype, 0, w.shape[-1])
        return quantize_weight(w, qtype, 0, scale, shift, w.shape[-1])

    tq, q = median_seconds(run, min_run_time=min_run_time)
    td, _ = median_seconds(q.dequantize, min_run_time=min_run_time)
    data = q._data._data if bits < 8 else q._data
    meta = [q._scale] + ([q._shift] if bits < 8 else [])
    name = "quanto (absmax, sym)" if bits == 8 else "quanto (MaxOptimizer)"
    return Row(
        name,
        bits,
        tq,
        td,
        8 * nbytes(data, *meta) / x.numel(),
        rel_rmse(q.dequantize().view_as(x), x),
    )


def bench_hqq(x: torch.Tensor, bits: int, min_run_time: float, optimize: bool) -> Row:
    from hqq.core.quantize import Quantizer

    w = x.reshape(-1, x.shape[-1])  # HQQ's 3-bit unpacking assumes a 2-d weight

    def run():
        w_q, meta = Quantizer.quantize(
            w,
            nbits=bits,
            group_size=x.shape[-1],
            axis=1,
            optimize=optimize,
            device=x.device.type,
            compute_dtype=x.dtype,
        )
        meta["compute_dtype"] = x.dtype
        return w_q, meta

    # the optimizer is ~100x slower than a clone: blocked_autorange times it once after its
    # warm-up call (one block already exceeds min_run_time)
    tq, (w_q, meta) = median_seconds(run, min_run_time=min_run_time)
    td, _ = median_seconds(lambda: Quantizer.dequantize(w_q, meta), min_run_time=min_run_time)
    name = "HQQ (optimize=True)" if optimize else "HQQ (RTN)"
    bpe = 8 * nbytes(w_q, meta["scale"], meta["zero"]) / x.numel()
    return Row(name, bits, tq, td, bpe, rel_rmse(Quantizer.dequantize(w_q, meta), w))


def json_rows(rows: list[Row], gb: float, t_clone: float) -> dict[str, dict]:
    """The table's rows for the results file, keyed ``<quantizer>-<bits>``, rounded as printed."""
    return {
        f"{r.impl}-{r.bits}": {
            "bits": r.bits,
            "bits_per_elem_incl_metadata": round(r.bits_per_elem, 3),
            "rel_rmse": round(r.rel_rmse, 4),
            "quantize_ms": round(r.quant_s * 1e3, 1),
            "quantize_gb_per_s": round(gb / r.quant_s, 2),
            "quantize_x_clone": round(r.quant_s / t_clone, 2),
            "dequantize_ms": round(r.dequant_s * 1e3, 1),
            "dequantize_gb_per_s": round(gb / r.dequant_s, 2),
            "dequantize_x_clone": round(r.dequant_s / t_clone, 2),
        }
        for r in rows
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1024 tokens, 0.2 s measurements")
    parser.add_argument(
        "--min-run-time",
        type=float,
        default=None,
        help="seconds measured per quantizer and direction, after warm-up (default 1, quick 0.2)",
    )
    parser.add_argument(
        "--no-hqq-optimize", action="store_true", help="skip the slow HQQ optimizer"
    )
    parser.add_argument("--no-json", action="store_true", help="do not write kvlib/results.json")
    args = parser.parse_args()
    seq = 1024 if args.quick else 4096
    min_run_time = args.min_run_time or (0.2 if args.quick else 1.0)

    kvlib.seed_everything(0)
    x = torch.randn(30, 3, seq, 64)
    gb = x.numel() * x.element_size() / 1e9
    t_clone, _ = median_seconds(x.clone, min_run_time=min_run_time)

    rows: list[Row] = []
    # The libraries' own prints and warnings go to the sink; the progress bar keeps the real
    # stderr (created before the redirect; tqdm turns itself off when stderr is not a terminal).
    bar = tqdm(total=4, desc="bit widths", unit="bits", file=sys.stderr, disable=None)
    sink = io.StringIO()
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(sink),
        contextlib.redirect_stderr(sink),
    ):
        warnings.simplefilter("ignore")
        for bits in (8, 4, 3, 2):
            rows.append(bench_kvlib(x, bits, -1, min_run_time))
            rows.append(bench_kvlib(x, bits, -2, min_run_time))
            row = bench_quanto(x, bits, min_run_time)
            if row is not None:
                rows.append(row)
            rows.append(bench_hqq(x, bits, min_run_time, optimize=False))
            if not args.no_hqq_optimize:
                rows.append(bench_hqq(x, bits, min_run_time, optimize=True))
            bar.update()
    bar.close()

    print(
        f"tensor {tuple(x.shape)} float32 ({gb * 1e3:.1f} MB) | {cpu_model()} | "
        f"{torch.get_num_threads()} torch threads | torch {torch.__version__} | "
        f"median per call, torch.utils.benchmark blocked_autorange ≥ {min_run_time:g} s after warm-up"
    )
    print(f"x.clone(): {t_clone * 1e3:.1f} ms = {gb / t_clone:.2f} GB/s (the yardstick, 1.00x)\n")
    print(
        "| quantizer | bits | bits/elem (incl. metadata) | rel. RMSE | quantize ms | quantize GB/s "
        "| quantize × clone | dequantize ms | dequantize GB/s | dequantize × clone |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r.impl} | {r.bits} | {r.bits_per_elem:.3f} | {r.rel_rmse:.4f} "
            f"| {r.quant_s * 1e3:.1f} | {gb / r.quant_s:.2f} | {r.quant_s / t_clone:.2f} "
            f"| {r.dequant_s * 1e3:.1f} | {gb / r.dequant_s:.2f} | {r.dequant_s / t_clone:.2f} |"
        )
    int4 = next(r for r in rows if r.impl == "kvlib per-token" and r.bits == 4)
    ratio = int4.dequant_s / t_clone
    print(
        f"\nGoal: kvlib int4 unpack+dequantize within 4x of clone -> {ratio:.2f}x ({'met' if ratio <= 4 else 'NOT met'})"
    )

    if not args.no_json:
        entry = {
            "source": "benchmarks/bench_quant.py",
            "model": "random Gaussian tensors in SmolLM2-135M's cache shape",
            "command": ("python benchmarks/bench_quant.py " + " ".join(sys.argv[1:])).strip(),
            "machine": machine(),
            "settings": {
                "tensor_shape": list(x.shape),
                "dtype": str(x.dtype).removeprefix("torch."),
                "clone_ms": round(t_clone * 1e3, 1),
                "min_run_time": min_run_time,
            },
            "rows": json_rows(rows, gb, t_clone),
        }
        print(f"wrote run 'quant' to {results.record_run('quant', entry)}", file=sys.stderr)


if __name__ == "__main__":
    main()
