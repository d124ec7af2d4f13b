"""Fused decode-attention kernel benchmark (kvlib.kernels.decode, notebook 10): needs a CUDA GPU.

    .venv/bin/python benchmarks/bench_kernel.py              # on a GPU (a few minutes)
    .venv/bin/python benchmarks/bench_kernel.py --quick      # shorter timings, fewer contexts
    .venv/bin/python benchmarks/bench_kernel.py --cpu-check  # tiny sizes, Triton's interpreter

Prints markdown tables, all rows of a table measured side by side in one run:

1. one decode step's attention for a Llama-3.1-8B-shaped layer (32 query heads, 8 KV heads,
   head_dim 128, float16) at 1k to 128k tokens of context, batch 1, then the memory-bound
   cases (batch 16 at 16k, batch 1 at 128k): fp16 ``scaled_dot_product_attention`` (flash
   backend) over an fp16 cache; kvlib's torch path (``QuantizedKVLayer`` dequantizes its whole
   past, then SDPA); transformers' ``QuantizedCache`` with quanto int4 (append and read, then
   SDPA); the fused kernel (:func:`kvlib.kernels.decode.decode_attention`) over kvlib-int8/int4/int2
   storage with the cache's defaults. Also: bytes one step must read (fp16 cache vs the int4
   codes, scales, zero points, sinks and window), and the bandwidth achieved as a fraction of
   the GPU's peak (its data-sheet figure where the name is known, else a measured copy);
2. whole-model decode tokens/s at 32k context for a randomly initialised model of a real
   architecture (``kvlib.eval.model_choice.random_model``, default llama-3.1-8b): fp16/bf16
   ``DynamicCache``, kvlib-int4 with the fused kernel, kvlib-int4 on the torch path.

Results go to run ``"kernel"`` of ``kvlib/results.json`` (``--no-json`` skips it,
``--json PATH`` writes elsewhere), with the GPU's name and the date.

Without CUDA the script prints one line saying so and exits with status 0, so that ``make
bench`` goes on. ``--cpu-check`` runs every table at toy sizes on CPU, the kernel in Triton's
interpreter, checks the kernel against the torch reference, and writes no results (its
times are the interpreter's, not a GPU's): it proves the script works (tests/test_bench_kernel.py).

Times are medians per call from ``torch.utils.benchmark``'s ``blocked_autorange`` (warm-up and
CUDA synchronisation included, ``benchmarks/_timing.py``); whole-model decoding uses
:func:`kvlib.eval.quality.generation_benchmark` (fresh cache per repeat).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

CPU_CHECK = "--cpu-check" in sys.argv
if CPU_CHECK:  # before triton is first imported (kvlib imports it lazily)
    os.environ["TRITON_INTERPRET"] = "1"

import torch.nn.functional as F  # noqa: E402
from _timing import measure  # noqa: E402

from kvlib import compat, results  # noqa: E402
from kvlib.caches.quantized import (  # noqa: E402
    QuantizedKVCache,
    QuantizedKVLayer,
    default_group_size,
    default_key_group_size,
    default_rotate,
)
from kvlib.kernels import decode as kernels  # noqa: E402
from kvlib.quant.rotation import hadamard  # noqa: E402
from kvlib.quant.tensor import quantize  # noqa: E402

NO_GPU = (
    "bench_kernel.py: no CUDA GPU on this machine; the fused kernel is timed on a GPU only "
    "(--cpu-check runs the script at toy sizes in Triton's interpreter)"
)

#: Data-sheet memory bandwidth (bytes/s), matched in order against torch's device name.
PEAK_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("A10G", 0.6e12),
    ("L4", 0.3e12),
    ("T4", 0.32e12),
    ("RTX 4090", 1.008e12),
)


@dataclass(frozen=True)
class Shape:
    """One attention layer: query heads, KV heads, head_dim, and the cache's block length."""

    q_heads: int
    kv_heads: int
    head_dim: int
    residual_length: int = 128
    sink_tokens: int = 4


LLAMA_8B = Shape(32, 8, 128)
TOY = Shape(4, 2, 16, residual_length=16, sink_tokens=2)


def layer_with(
    shape: Shape, batch: int, tokens: int, bits: int, device: torch.device, dtype: torch.dtype
) -> QuantizedKVLayer:
    """A ``QuantizedKVLayer`` holding ``tokens`` random tokens with the cache's defaults at
    ``bits``, filled directly: all blocks quantized in one call (equal to block by block, as
    each block has its own statistics), instead of ``update``'s block-by-block append."""
    r, d = shape.residual_length, shape.head_dim
    h, b = shape.kv_heads, batch
    rotation = hadamard(d, device=device) if default_rotate(bits, d) else None
    layer = QuantizedKVLayer(
        bits,
        bits,
        group_size=default_group_size(d),
        residual_length=r,
        sink_tokens=shape.sink_tokens,
        rotation=rotation,
        key_group_size=default_key_group_size(bits, r),
    )
    gen = torch.Generator(device=device).manual_seed(tokens * 8 + bits)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=device)

    empty = torch.zeros((b, h, 0, d), device=device, dtype=dtype)
    layer.lazy_initialization(empty, empty)
    s = min(tokens, shape.sink_tokens)
    n = (tokens - s) // r
    w = tokens - s - n * r
    layer.sink_keys, layer.sink_values = randn(b, h, s, d).to(dtype), randn(b, h, s, d).to(dtype)
    layer.residual_keys = randn(b, h, w, d).to(dtype)
    layer.residual_values = randn(b, h, w, d).to(dtype)
    if n:
        kb = randn(n, b, h, r, d)
        if rotation is not None:
            kb = kb @ rotation
        layer.key_blocks = quantize(kb, bits, axis=3, group_size=layer.key_group_size).with_rows(3)
        del kb
        layer.value_blocks = quantize(
            randn(n, b, h, r, d), bits, axis=4, group_size=layer.group_size
        ).with_rows(3)
        layer.n_blocks = n
    layer.cumulative_length = tokens
    return layer


def peak_bandwidth(device: torch.device) -> tuple[float, str]:
    """(bytes/s, where the figure comes from): the data sheet's, or a measured large copy."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for key, bw in PEAK_BANDWIDTH:
        if key in name:
            return bw, f"{name} data sheet"
    x = torch.empty(2**28 if device.type == "cuda" else 2**22, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    t = measure(lambda: y.copy_(x), min_run_time=0.1).median
    return 2 * x.numel() / t, f"{name}, measured copy"


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp16 SDPA, flash backend on CUDA (GQA without copying K/V)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def quanto_step(shape: Shape, batch: int, tokens: int, device: torch.device, dtype: torch.dtype):
    """A zero-argument decode step over transformers' quanto int4 ``QuantizedCache`` (append
    the new token, read everything back, SDPA), or a string saying why it cannot run."""
    try:
        from transformers import LlamaConfig

        config = LlamaConfig(
            num_hidden_layers=1,
            hidden_size=shape.q_heads * shape.head_dim,
            num_attention_heads=shape.q_heads,
            num_key_value_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            vocab_size=128,
        )
        cache = compat.hf_quantized_cache(config, "quanto", nbits=4)
        size = (batch, shape.kv_heads, tokens, shape.head_dim)
        cache.update(
            torch.randn(size, device=device, dtype=dtype),
            torch.randn(size, device=device, dtype=dtype),
            0,
        )
        new = torch.randn((batch, shape.kv_heads, 1, shape.head_dim), device=device, dtype=dtype)
        q = torch.randn((batch, shape.q_heads, 1, shape.head_dim), device=device, dtype=dtype)

        def step() -> torch.Tensor:
            keys, values = cache.update(new, new, 0)
            return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

        step()
        return step
    except Exception as exc:  # optional column: report, never stop the run
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def fp16_case(q, b, h, tokens, d, gen, us) -> tuple[float, int]:
    """(µs, bytes read) of fp16 SDPA over an fp16 cache of ``tokens`` + 1 tokens."""
    k16 = torch.randn((b, h, tokens + 1, d), generator=gen, device=q.device).to(q.dtype)
    v16 = torch.randn((b, h, tokens + 1, d), generator=gen, device=q.device).to(q.dtype)
    t = us(lambda: sdpa_flash(q, k16, v16))
    return t, 2 * k16.numel() * k16.element_size() + 2 * q.numel() * q.element_size()


def bench_case(
    shape: Shape,
    batch: int,
    tokens: int,
    device: torch.device,
    peak: float,
    min_run_time: float,
    quanto: bool,
) -> dict[str, Any]:
    """Every column for one (batch, context): times in microseconds, bytes, bandwidth."""
    dtype = torch.float16
    b, hq, h, d = batch, shape.q_heads, shape.kv_heads, shape.head_dim
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn((b, hq, 1, d), generator=gen, device=device).to(dtype)
    new_k = torch.randn((b, h, 1, d), generator=gen, device=device).to(dtype)
    new_v = torch.randn((b, h, 1, d), generator=gen, device=device).to(dtype)
    row: dict[str, Any] = {"batch": b, "context": tokens}

    def us(fn) -> float:
        return round(measure(fn, min_run_time=min_run_time).median * 1e6, 1)

    row["fp16_sdpa_us"], fp16_bytes = fp16_case(q, b, h, tokens, d, gen, us)
    row["fp16_bytes"] = fp16_bytes
    for bits in (8, 4, 2):
        layer = layer_with(shape, b, tokens, bits, device, dtype)
        kv = layer.packed(new_k, new_v)
        out = kernels.decode_attention(q, kv, backend="triton")
        ref = kernels.decode_attention(q, kv, backend="torch")
        err = float((out.float() - ref.float()).abs().max())
        if not err < 2e-2:  # float16 outputs of size ~1: a wrong kernel is off by ~1
            raise AssertionError(f"fused int{bits} differs from the torch path by {err:.3g}")
        row[f"fused_int{bits}_us"] = us(
            lambda kv=kv: kernels.decode_attention(q, kv, backend="triton")
        )
        row[f"int{bits}_bytes"] = kernels.step_bytes(kv, hq)
        row[f"int{bits}_max_err"] = float(f"{err:.2g}")
        if bits == 4:

            def torch_path(layer=layer) -> torch.Tensor:
                keys, values = layer._read(new_k, new_v)  # the cache's read: dequantize all
                return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

            row["torch_int4_us"] = us(torch_path)
        del layer, kv
    if quanto:
        step = quanto_step(shape, b, tokens, device, dtype)
        if callable(step):
            row["quanto_int4_us"] = us(step)
        else:
            row["quanto_int4_us"] = None
            row["quanto_error"] = step
    t16, t4 = row["fp16_sdpa_us"], row["fused_int4_us"]
    row["speedup_int4"] = round(t16 / t4, 2)
    row["speedup_int2"] = round(t16 / row["fused_int2_us"], 2)
    row["bw_fp16"] = round(fp16_bytes / (t16 * 1e-6) / peak, 3)
    row["bw_int4"] = round(row["int4_bytes"] / (t4 * 1e-6) / peak, 3)
    row["bw_int2"] = round(row["int2_bytes"] / (row["fused_int2_us"] * 1e-6) / peak, 3)
    return row


def print_attention(rows: list[dict[str, Any]], title: str) -> None:
    print(f"\n### {title}\n")
    print(
        "| batch | context | fp16 SDPA µs | torch path int4 µs | quanto int4 µs | fused int8 µs "
        "| fused int4 µs | fused int2 µs | int4 × | int2 × | fp16 MB/step | int4 MB/step "
        "| BW fp16 | BW int4 | BW int2 |"
    )
    print("|---:|---:|" + "---:|" * 13)
    for r in rows:
        quanto = "-" if r.get("quanto_int4_us") is None else f"{r['quanto_int4_us']:.1f}"
        print(
            f"| {r['batch']} | {r['context']} | {r['fp16_sdpa_us']:.1f} | {r['torch_int4_us']:.1f} "
            f"| {quanto} | {r['fused_int8_us']:.1f} | {r['fused_int4_us']:.1f} "
            f"| {r['fused_int2_us']:.1f} | {r['speedup_int4']:.2f} | {r['speedup_int2']:.2f} "
            f"| {r['fp16_bytes'] / 1e6:.1f} | {r['int4_bytes'] / 1e6:.1f} "
            f"| {r['bw_fp16']:.0%} | {r['bw_int4']:.0%} | {r['bw_int2']:.0%} |"
        )
    errors = {r.get("quanto_error") for r in rows} - {None}
    for e in sorted(errors):
        print(f"\nquanto int4 did not run: {e}")


def bench_model(
    spec: str, context: int, new_tokens: int, repeats: int, device: torch.device, cpu: bool
) -> dict[str, Any]:
    """Whole-model decode tokens/s at ``context`` tokens, three caches side by side."""
    from kvlib.caches.registry import reference_name
    from kvlib.eval.model_choice import random_model
    from kvlib.eval.quality import generation_benchmark

    shrink = {"num_layers": 1, "vocab_size": 256, "intermediate_size": 64} if cpu else {}
    # toy blocks on CPU, so that a 40-token context holds quantized blocks
    options: dict[str, Any] = {"residual_length": 16} if cpu else {}
    model = random_model(spec, device=device, **shrink)
    prompt = torch.randint(
        0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0)
    )
    dense = reference_name(model.dtype)
    caches = {
        dense: lambda: compat.dynamic_cache(model.config),
        "kvlib-int4 fused": lambda: QuantizedKVCache(model.config, 4, fused_decode=True, **options),
        "kvlib-int4 torch path": lambda: QuantizedKVCache(
            model.config, 4, fused_decode=False, **options
        ),
    }
    rows = {}
    for name, factory in caches.items():
        r = generation_benchmark(
            model,
            None,
            factory,
            prompt_tokens=context,
            new_tokens=new_tokens,
            repeats=repeats,
            name=name,
            prompt_ids=prompt,
            warmup=True,
        )
        rows[name] = {
            "decode_tokens_per_s": round(r.decode_tokens_per_s, 1),
            "time_to_first_token_s": round(r.time_to_first_token_s, 3),
            "cache_bytes": r.cache_nbytes,
            "peak_memory_bytes": r.peak_memory_bytes,
        }
        del r
    compat_attn = model.config._attn_implementation
    print(f"\n### Whole-model decode, {spec} (random weights, {model.dtype}), {context} tokens\n")
    print("| cache | decode tok/s | vs " + dense + " | cache GB | time to first token s |")
    print("|---|---:|---:|---:|---:|")
    base = rows[dense]["decode_tokens_per_s"]
    for name, r in rows.items():
        print(
            f"| {name} | {r['decode_tokens_per_s']:.1f} | {r['decode_tokens_per_s'] / base:.2f}x "
            f"| {r['cache_bytes'] / 1e9:.2f} | {r['time_to_first_token_s']:.3f} |"
        )
    print(f"\n(attention implementation after the run: {compat_attn})")
    return {"model": spec, "context": context, "new_tokens": new_tokens, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings, fewer contexts")
    parser.add_argument("--cpu-check", action="store_true", help="toy sizes on CPU (interpreter)")
    parser.add_argument("--no-quanto", action="store_true", help="skip the quanto int4 column")
    parser.add_argument("--model", default="llama-3.1-8b", help="architecture for the model run")
    parser.add_argument("--no-json", action="store_true", help="do not write the results file")
    parser.add_argument("--json", type=Path, default=None, help="results file to write")
    args = parser.parse_args(argv)
    if args.cpu_check:
        if not kernels.interpreter_mode():
            print("bench_kernel.py: --cpu-check must be given on the command line", file=sys.stderr)
            return 2
        device, shape = torch.device("cpu"), TOY
        contexts, memory_bound = [2 + 16 + 5], [(3, 2 + 2 * 16)]
        min_run_time, model_context, new_tokens, repeats = 0.01, 40, 3, 1
    else:
        if not torch.cuda.is_available():
            print(NO_GPU)
            return 0
        device, shape = torch.device("cuda"), LLAMA_8B
        contexts = [1024, 4096, 16384, 65536] if args.quick else [2**k for k in range(10, 18)]
        memory_bound = [(16, 16384), (1, 131072)]
        min_run_time = 0.05 if args.quick else 0.2
        model_context, new_tokens, repeats = 32768, 17 if args.quick else 33, 1 if args.quick else 3
    peak, peak_source = peak_bandwidth(device)
    quanto = not args.no_quanto and not args.cpu_check
    sweep = [bench_case(shape, 1, t, device, peak, min_run_time, quanto) for t in contexts]
    note = " (interpreter times, not a GPU's)" if args.cpu_check else ""
    print_attention(
        sweep,
        f"Decode-step attention{note}, batch 1 ({shape}; peak {peak / 1e12:.2f} TB/s, "
        f"{peak_source})",
    )
    bound = [bench_case(shape, b, t, device, peak, min_run_time, quanto) for b, t in memory_bound]
    print_attention(bound, f"Memory-bound decode steps{note}")
    spec = "smollm2-135m" if args.cpu_check else args.model
    model_run = bench_model(spec, model_context, new_tokens, repeats, device, args.cpu_check)
    entry = {
        "source": "benchmarks/bench_kernel.py",
        "command": ("python benchmarks/bench_kernel.py " + " ".join(sys.argv[1:])).strip(),
        "machine": (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
        + f"; torch {torch.__version__}",
        "settings": {
            "layer": asdict(shape),
            "peak_bandwidth_bytes_per_s": peak,
            "peak_source": peak_source,
        },
        "attention": {f"b{r['batch']}-{r['context']}": r for r in sweep + bound},
        "model_decode": model_run,
    }
    if args.cpu_check:  # the entry must be a valid run; written to a scratch file only
        with tempfile.TemporaryDirectory() as tmp:
            results.record_run("kernel", entry, Path(tmp) / "results.json")
        print("\ncpu-check passed: every table ran, the kernel matched the torch path")
    elif not args.no_json:
        path = results.record_run("kernel", entry, args.json)
        print(f"wrote run 'kernel' to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
