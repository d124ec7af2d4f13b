"""GPU check of the full-model comparison and what-fits probe (notebook 08): one command, offline.

    python scripts/gpu_check.py             # CUDA: random-init SmolLM2-1.7B architecture, 32k context
    python scripts/gpu_check.py --dry-run   # the same code path on CPU at tiny sizes, in seconds

On a CUDA machine it builds a randomly initialised model of a real architecture (no hub
access needed; :func:`kvlib.eval.model_choice.random_model`), then

1. checks every kvlib cache (and transformers' quanto cache, for reference) against
   transformers' DynamicCache after a chunked prefill of ``--context`` random tokens: layer-0
   attention-output error (the cache's error alone), logits error, argmax agreement
   (:func:`kvlib.eval.compare.cache_agreement`), PASS/FAIL against
   :data:`kvlib.eval.compare.AGREEMENT_LIMITS`;
2. measures peak allocated memory, cache bytes, decode tokens/s and time to first token per
   cache at that context (:func:`kvlib.eval.compare.run_cache_comparison`, which times with
   :func:`kvlib.eval.quality.generation_benchmark`: warm-up, medians, ``cuda.synchronize``);
3. finds what fits in an emulated smaller GPU (``--budget-gib``,
   ``torch.cuda.set_per_process_memory_fraction``): longest context and largest batch per
   cache, predicted by kvlib.memory and measured, out-of-memory caught
   (:func:`kvlib.eval.capacity.what_fits`).

Cache names are :data:`kvlib.caches.registry.CACHE_NAMES`; the reference DynamicCache, named
for the model's dtype (``dynamic-bf16`` on most GPUs, ``dynamic-fp32`` in the dry run), always
runs first, so ``--caches`` lists the others.

It prints Markdown tables headed with the date and the device name, and stops starting new
sections once ``--time-limit`` seconds have passed (the default keeps the whole run under
5 minutes on an H100-class GPU). Exit status 1 when a correctness check fails or a section
errors (the other sections still run), 2 when CUDA is missing without ``--dry-run``.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvlib import memory  # noqa: E402
from kvlib.caches.registry import cache_info, reference_name  # noqa: E402
from kvlib.eval.capacity import FitRow, release_memory, simulated_budget_runner, what_fits  # noqa: E402
from kvlib.eval.compare import (  # noqa: E402
    Agreement,
    ComparisonRow,
    cache_agreement,
    run_cache_comparison,
)
from kvlib.eval.model_choice import DEFAULT_RANDOM_SPEC, random_model  # noqa: E402
from kvlib.results import record_run  # noqa: E402
from kvlib.specs import spec_from_config  # noqa: E402

#: Compared with the reference DynamicCache (always run first, named for the model's dtype).
DEFAULT_CACHES = ("kvlib-int8", "kvlib-int4", "kvlib-int2", "quanto-int4")
#: Probed for what fits, next to the reference.
FIT_CACHES = ("kvlib-int8", "kvlib-int4", "kvlib-int2")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, seconds")
    p.add_argument(
        "--spec",
        default=None,
        help=f"kvlib.specs registry name (default {DEFAULT_RANDOM_SPEC}; "
        "smollm2-135m with --dry-run)",
    )
    p.add_argument("--layers", type=int, default=None, help="fewer decoder layers (default: all)")
    p.add_argument("--context", type=int, default=32768, help="prompt tokens (default 32768)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per timed run")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per cache (median)")
    p.add_argument(
        "--caches",
        default=",".join(DEFAULT_CACHES),
        help="comma-separated names, compared with the reference DynamicCache",
    )
    p.add_argument("--budget-gib", type=float, default=8.0, help="emulated GPU size, GiB (2**30 B)")
    p.add_argument("--batch-context", type=int, default=8192, help="context of the batch probe")
    p.add_argument("--no-fits", action="store_true", help="skip the what-fits section")
    p.add_argument("--time-limit", type=float, default=240.0, help="seconds; later sections skip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--record-log",
        metavar="LOG",
        help="write the tables of a saved log into kvlib/results.json (no run)",
    )
    p.add_argument("--run-name", default="gpu_check", help="results run for --record-log")
    args = p.parse_args(argv)
    if args.spec is None:
        args.spec = "smollm2-135m" if args.dry_run else DEFAULT_RANDOM_SPEC
    if args.dry_run:  # tiny: the same code path in seconds on a CPU
        args.layers = args.layers or 2
        args.context = min(args.context, 256)
        args.new_tokens = min(args.new_tokens, 4)
        args.repeats = 1
        args.batch_context = min(args.batch_context, 256)
    return args


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else memory.human_bytes(n)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU"


def correctness_table(rows: list[Agreement]) -> list[str]:
    lines = [
        "| cache | bits | layer-0 attention rel. err | logits rel. err | top-1 agreement "
        "| limit | status |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        status = "reference" if r.passed is None else ("PASS" if r.passed else "FAIL")
        if not r.cache.startswith("kvlib") and r.passed is not None:
            status = f"{status} (peer)"
        limit = "-" if r.limit is None else f"{r.limit:g}"
        lines.append(
            f"| {r.cache} | {r.bits} | {r.attention_rel_err:.4f} | {r.logits_rel_err:.4f} "
            f"| {r.top1_agreement:.3f} | {limit} | {status} |"
        )
    return lines


def speed_table(rows: list[ComparisonRow]) -> list[str]:
    base = next((r for r in rows if cache_info(r.cache).family == "dynamic"), rows[0])
    lines = [
        f"| cache | bits | cache bytes | vs {base.cache} | peak memory | decode tok/s "
        f"| speed vs {base.cache} | TTFT s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.cache} | {r.bits} | {_fmt_bytes(r.cache_bytes)} "
            f"| {base.cache_bytes / r.cache_bytes:.2f}x smaller | {_fmt_bytes(r.peak_memory_bytes)} "
            f"| {r.decode_tokens_per_s:.1f} | {r.decode_tokens_per_s / base.decode_tokens_per_s:.2f}x "
            f"| {r.time_to_first_token_s:.3f} |"
        )
    return lines


def fits_table(rows: list[FitRow]) -> list[str]:
    def measured(value: int | None, resolution: int | None) -> str:
        if value is None:
            return "-"
        if value == 0:
            return "does not fit"
        return f"{value}" + (f" (±{resolution})" if resolution else " (lower bound)")

    lines = [
        "| cache | bits | max context, predicted | measured | max batch @ ctx, predicted "
        "| measured |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.cache} | {r.bits} | {r.predicted_max_context} "
            f"| {measured(r.measured_max_context, r.context_resolution)} "
            f"| {r.predicted_max_batch} | {measured(r.measured_max_batch, r.batch_resolution)} |"
        )
    return lines


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _table_after(text: str, title: str) -> list[list[str]]:
    """Body rows (cells) of the first Markdown table under the ``### title`` heading."""
    section = text.split(f"### {title}", 1)
    if len(section) < 2:
        return []
    lines = [line.strip() for line in section[1].split("\n### ", 1)[0].splitlines()]
    table = [line for line in lines if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]


def _number(cell: str) -> float | None:
    """``"0.0226"``, ``"1.19x"``, ``"3.36x smaller"`` -> a float; ``"-"`` -> None."""
    word = cell.split()[0].rstrip("x") if cell.strip() else "-"
    return None if word == "-" else float(word)


def _gib(cell: str) -> float | None:
    """``"6.01 GiB"`` (kvlib.memory.human_bytes) -> GiB as a float; ``"-"`` -> None."""
    if cell.strip() == "-":
        return None
    value, unit = cell.split()
    if unit not in _UNITS:
        raise ValueError(f"unknown byte unit {unit!r} in {cell!r}")
    return float(value) * _UNITS[unit] / 2**30


def _model_name(described: str) -> str:
    """``"random weights of `smollm2-1.7b` (…; 1.711 B params, bfloat16)"`` ->
    ``"smollm2-1.7b architecture, random weights, bfloat16"``; other text as it is."""
    found = re.match(r"random weights of `([^`]+)` \(.*?(\w+)\)$", described.strip())
    if not found:
        return described.strip()
    return f"{found.group(1)} architecture, random weights, {found.group(2)}"


#: The log's tables, by section title: the run's field and parser for each column after
#: ``cache`` and ``bits`` (:func:`correctness_table`, :func:`speed_table`).
_LOG_TABLES: dict[str, tuple[tuple[str, Any], ...]] = {
    "Correctness against DynamicCache": (
        ("layer_0_attention_rel_err", _number),
        ("logits_rel_err", _number),
        ("top_1_agreement", _number),
        ("limit", _number),
        ("status", str),
    ),
    "Memory and speed per cache": (
        ("cache_gib", _gib),
        ("x_smaller_than_reference", _number),
        ("peak_memory_gib", _gib),
        ("decode_tokens_per_s", _number),
        ("speed_vs_reference", _number),
        ("time_to_first_token_s", _number),
    ),
}


def run_from_log(text: str) -> dict[str, Any]:
    """A ``kvlib/results.json`` run from the Markdown this script printed (a saved log).

    The header gives the date, device, command, versions and model; the "Correctness" and
    "Memory and speed" tables give one row per cache (errors, agreement, limit and status;
    cache bytes and peak memory in GiB, decode tokens/s, speed against the reference and time
    to first token). A section the log skipped is left out and said so in ``note``.

    Raises:
        ValueError: the text is not a GPU-check log (no header or no table).
    """
    head = re.search(
        r"^## GPU check(?: \(dry run, CPU\))? · (\d{4}-\d{2}-\d{2}) [^·]*· (.+)$", text, re.M
    )
    command = re.search(r"^Command: `([^`]*)` · torch (\S+) · transformers (\S+)$", text, re.M)
    model = re.search(
        r"^Model: (.+?); context (\d+) random tokens, (\d+) new tokens, median of (\d+)\.",
        text,
        re.M,
    )
    if not (head and command and model):
        raise ValueError("not a scripts/gpu_check.py log: its header lines are missing")
    # logs from before 2026-12-07 have no attention line
    attention = re.search(
        r"^Attention: (\S+); kvlib's quantized caches decode through (.+)\.$", text, re.M
    )
    rows: dict[str, dict[str, Any]] = {}
    for title, fields in _LOG_TABLES.items():
        for cache, bits, *cells in _table_after(text, title):
            row = rows.setdefault(cache, {"bits": int(bits)})
            row.update(
                {name: parse(cell) for (name, parse), cell in zip(fields, cells, strict=True)}
            )
    if not rows:
        raise ValueError("the log holds no result table")
    skipped = re.findall(r"^### (.+)\n+_skipped: ([^_]+)_", text, re.M)
    errors = re.findall(r"^- (\S+): (.+)$", text, re.M)
    device = head.group(2).strip()
    return {
        "source": "scripts/gpu_check.py",
        "command": f"python {command.group(1).removeprefix('python ')}",
        "date": head.group(1),
        "machine": f"{device}; torch {command.group(2)}, transformers {command.group(3)}",
        "engine": "transformers",
        "model": _model_name(model.group(1)),
        "settings": {
            "context": int(model.group(2)),
            "new_tokens": int(model.group(3)),
            "repeats": int(model.group(4)),
            **(
                {"attention": attention.group(1), "kvlib_decode_path": attention.group(2)}
                if attention
                else {}
            ),
        },
        "rows": rows,
        "note": "; ".join(
            [f"{title} skipped ({why.strip()})" for title, why in skipped]
            + [f"{cache}: {what.strip()}" for cache, what in errors]
        ),
    }


@dataclass
class Check:
    """One run of the check: the model, its prompt ``ids`` (1, context) and the caches compared
    (the reference first); each section prints as it completes, and ``failed`` records whether
    any kvlib check failed or raised."""

    args: argparse.Namespace
    model: Any
    ids: torch.Tensor
    caches: list[str]
    device: torch.device
    t_start: float = field(default_factory=time.perf_counter)
    failed: bool = False

    def out_of_time(self) -> bool:
        return time.perf_counter() - self.t_start > self.args.time_limit

    def section(self, title: str, body: Callable[[], tuple[list[str], bool]]) -> None:
        """Print section ``title`` and ``body()``'s lines, or that it was skipped (past
        ``--time-limit``), or its traceback (the other sections still run)."""
        elapsed = time.perf_counter() - self.t_start
        print(f"### {title}\n", flush=True)
        if elapsed > self.args.time_limit:
            print(
                f"_skipped: {elapsed:.0f} s elapsed > --time-limit {self.args.time_limit:.0f} s_\n"
            )
            return
        try:
            lines, ok = body()
        except Exception:  # report and go on: the other sections still run
            self.failed = True
            print("```\n" + traceback.format_exc() + "```\n", flush=True)
            return
        self.failed = self.failed or not ok
        print("\n".join(lines) + "\n", flush=True)

    def per_cache(self, run: Callable[[str], list[Any]]) -> tuple[list[Any], list[str], bool]:
        """``run(name)`` for each cache on its own, so that one cache's error (a peer library
        without its GPU kernels, say) is reported and the others still run."""
        rows, errors, ok = [], [], True
        for name in self.caches:
            if self.out_of_time():
                errors.append(f"- {name}: skipped (--time-limit)")
                continue
            try:
                rows.extend(run(name))
            except Exception as exc:  # noqa: BLE001 - reported, never hidden
                errors.append(f"- {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                ok = ok and not name.startswith(("kvlib", "dynamic"))
            release_memory(self.device)
        return rows, (["", "Errors:", *errors] if errors else []), ok

    def correctness(self) -> tuple[list[str], bool]:
        """Each cache's last tokens against DynamicCache's after a chunked prefill."""
        tail = 32 if self.args.dry_run else 64
        chunk = 64 if self.args.dry_run else 4096

        def run(name: str) -> list[Agreement]:
            return cache_agreement(self.model, self.ids, [name], tail=tail, chunk=chunk)

        rows, errors, ok = self.per_cache(run)
        ok = ok and all(r.passed is not False for r in rows if r.cache.startswith("kvlib"))
        head = [
            f"Chunked prefill of {self.args.context - tail} tokens ({chunk} per step), then the "
            f"last {tail} tokens with each cache vs DynamicCache.",
            "",
        ]
        return head + correctness_table(rows) + errors, ok

    def speed(self) -> tuple[list[str], bool]:
        """Each cache's decode speed, time to first token and peak memory."""
        args = self.args

        def run(name: str) -> list[ComparisonRow]:
            return run_cache_comparison(
                self.model,
                None,
                [name],
                prompt_tokens=args.context,
                new_tokens=args.new_tokens,
                prompt_ids=self.ids,
                repeats=args.repeats,
            )

        rows, errors, ok = self.per_cache(run)
        if not rows:
            return errors, False
        peak = (
            "torch.cuda.max_memory_allocated (weights + cache + activations)"
            if rows[0].memory_kind == "peak allocated"
            else "n/a on CPU"
        )
        head = [
            f"Prompt {args.context} tokens in one prefill, {args.new_tokens} greedy tokens; "
            f"peak memory = {peak}.",
            "",
        ]
        return head + speed_table(rows) + errors, ok

    def fits(self) -> tuple[list[str], bool]:
        """The longest context and the largest batch each cache fits in the budget, measured
        against kvlib.memory's prediction."""
        args, model = self.args, self.model
        budget = args.budget_gib * 2**30
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        dtype_bits = torch.finfo(next(model.parameters()).dtype).bits
        fit_caches = [self.caches[0], *(c for c in FIT_CACHES if c in self.caches)]
        if args.dry_run:  # no allocator to hit: an accounting budget on the same code path
            budget = weights + memory.kv_cache_bytes(
                spec_from_config(model.config), 2 * args.context, bits=dtype_bits
            )
            runner = simulated_budget_runner(model, budget)
            fit_caches = fit_caches[:: max(1, len(fit_caches) - 1)]  # first and last only
            step, how = 64, "simulated (CPU: weights + bytes really held vs budget)"
        else:
            runner, step, how = None, 1024, "torch.cuda.set_per_process_memory_fraction"
        rows = what_fits(
            model,
            budget,
            fit_caches,
            batch_context=args.batch_context,
            dtype_bits=dtype_bits,
            runner=runner,
            measure=True,
            context_step=step,
            max_probes=4,
        )
        head = [
            f"Budget {memory.human_bytes(budget, binary=False)} ({how}), weights "
            f"{memory.human_bytes(weights, binary=False)}; batch probed at {args.batch_context} "
            f"tokens; context steps of {step}. Predicted = kvlib.memory (cache payload + "
            "group metadata, no full-precision window, no activations).",
            "",
        ]
        return head + fits_table(rows), True


def attention_line(model: Any, device: torch.device) -> str:
    """Which attention the run took: the model's implementation, and whether kvlib's quantized
    caches decode through the fused Triton kernel (on CUDA with triton installed and sdpa
    attention: :class:`~kvlib.caches.quantized.QuantizedKVCache`'s ``fused_decode=None``) or
    their torch path (dequantize, then the model's attention)."""
    impl = model.config._attn_implementation
    try:
        import triton

        version = triton.__version__
    except ImportError:
        version = None
    fused = device.type == "cuda" and version is not None and impl in ("sdpa", "kvlib_fused")
    path = f"the fused Triton kernel (triton {version})" if fused else "their torch path"
    return f"Attention: {impl}; kvlib's quantized caches decode through {path}."


def header(args: argparse.Namespace, argv: list[str] | None, model: Any, device) -> list[str]:
    """The report's title, command, versions, model and attention lines."""
    import transformers

    dtype = next(model.parameters()).dtype
    n_params = sum(p.numel() for p in model.parameters())
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(argv if argv is not None else sys.argv[1:])
    return [
        f"## GPU check{' (dry run, CPU)' if args.dry_run else ''} · {now} · {_device_name(device)}",
        "",
        f"Command: `python scripts/gpu_check.py {command}`".rstrip()
        + f" · torch {torch.__version__} · transformers {transformers.__version__}",
        f"Model: random weights of `{args.spec}` ({model.config.num_hidden_layers} layers, "
        f"{model.config.num_attention_heads} heads, {model.config.num_key_value_heads} KV heads, "
        f"head_dim {model.config.head_dim}; {n_params / 1e9:.3f} B params, {str(dtype)[6:]}); "
        f"context {args.context} random tokens, {args.new_tokens} new tokens, "
        f"median of {args.repeats}. Quality numbers need real weights; these check agreement.",
        attention_line(model, device),
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.record_log:
        entry = run_from_log(Path(args.record_log).read_text(encoding="utf-8"))
        path = record_run(args.run_name, entry)
        print(f"run {args.run_name!r} ({len(entry['rows'])} caches) written to {path}")
        return 0
    t_start = time.perf_counter()
    if args.dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("gpu_check: no CUDA device; run with --dry-run for the CPU version", file=sys.stderr)
        return 2
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    for name in caches:
        cache_info(name)  # fail early on a typo
    shrink: dict[str, Any] = {"num_layers": args.layers}
    if args.dry_run:
        shrink.update(vocab_size=512, intermediate_size=256)
    model = random_model(args.spec, device=device, seed=args.seed, **shrink)
    reference = reference_name(next(model.parameters()).dtype)
    caches = [reference, *(c for c in caches if cache_info(c).family != "dynamic")]
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), generator=gen)
    print("\n".join(header(args, argv, model, device)), flush=True)

    check = Check(args, model, ids, caches, device, t_start)
    check.section("Correctness against DynamicCache", check.correctness)
    check.section("Memory and speed per cache", check.speed)
    if not args.no_fits:
        check.section("What fits", check.fits)
    total = time.perf_counter() - t_start
    print(f"_total {total:.0f} s; {'FAILED' if check.failed else 'all checks passed'}_")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
