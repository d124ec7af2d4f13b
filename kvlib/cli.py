"""The ``kvlib`` command line: ``memory``, ``plan``, ``models`` and ``caches`` (notebook 09).

::

    python -m kvlib memory --model llama-3.1-8b --context 32k --batch 8 [--bits 4]
    python -m kvlib plan --model llama-3.1-8b --gpu-memory 24 --context 32k --concurrency 16
    python -m kvlib models
    python -m kvlib caches [--family evict]
    kvlib plan --model llama-3.1-70b --gpu H100 --num-gpus 2 --context 128k --json

Every subcommand has ``--help`` and ``--json``. Bad input exits non-zero with one line on stderr:
2 for arguments argparse rejects (unknown option, malformed size), 1 for values the library
rejects (unknown model — with close matches —, unsupported bits).

Units: context lengths are token counts (:func:`parse_size`, ``32k`` = 32,768); memory is in GiB
(:func:`parse_memory`, 2³⁰ bytes), the unit GPUs are labelled in and nvidia-smi, PyTorch and
vLLM report, and every byte figure is printed in binary units (KiB, MiB, GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvlib import memory, specs
from kvlib.memory import GIB
from kvlib.plan import planner as plan
from kvlib.plan.budget import PREFILL_CHUNK_TOKENS
from kvlib.plan.engines import ENGINES
from kvlib.plan.rule import DEVICES, QUALITIES, WEIGHT_BITS
from kvlib.results import RESULTS_ENV
from kvlib.validate import check_int, check_number

__all__ = ["main", "parse_memory", "parse_size", "build_parser"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")
_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2}


def parse_size(text: str) -> int:
    """Token counts as people write them: ``4096``, ``32k`` (32,768), ``128K``, ``1m``, ``1.5k``.

    ``k`` and ``m`` are binary (1024, 1024²), as context lengths are (Llama-3.1's "128k" is
    131,072). Memory sizes are not token counts: they go through :func:`parse_memory`.

    Raises:
        ValueError: anything else (``"80GB"``, a fraction of a token), zero included.
    """
    m = _SIZE_RE.match(str(text).replace("_", "").replace(",", ""))
    if not m:
        raise ValueError(f"invalid size {text!r}: use a token count like 4096, 32k or 1m")
    value = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if value != int(value) or value < 1:
        raise ValueError(f"invalid size {text!r}: must be a whole, positive number of tokens")
    return int(value)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_MEMORY_RE = re.compile(r"^\s*(\S+?)\s*(gib|gb|g)?\s*$", re.IGNORECASE)


def parse_memory(text: str) -> float:
    """GPU (or RAM) memory in GiB: ``"24"``, ``"80GB"``, ``"80 GiB"``, ``"13.5g"`` → 24.0, 80.0,
    80.0, 13.5.

    A bare number is GiB (2³⁰ bytes). A ``GB`` suffix is read as GiB too, as memory is labelled:
    an "80 GB" A100 holds 80 GiB (81,920 MiB in nvidia-smi), a "16 GB" RAM module 16 GiB;
    nvidia-smi, ``torch.cuda.mem_get_info`` and vLLM all count in binary units. For a GPU, give
    what nvidia-smi reports, which can be less than its label (an H100 80GB 79.6 GiB, a T4
    15 GiB: ``--gpu`` looks these up). 0 is accepted (it gives an impossible plan).

    Raises:
        ValueError: not a number with an optional ``GiB``/``GB``/``G`` suffix, negative, or not
            finite.
    """
    m = _MEMORY_RE.match(str(text).replace("_", ""))
    try:
        value = float(m.group(1)) if m else None
    except ValueError:
        value = None
    if value is None:
        raise ValueError(f"invalid memory {text!r}: use a number of GiB like 24, 80GB or 13.5GiB")
    value = check_number(value, "memory")
    if value < 0:
        raise ValueError(f"memory must be >= 0 GiB (got {text!r})")
    return value


def _memory(text: str) -> float:
    try:
        return parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    try:
        return check_int(value, "value", minimum=1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _gpu_key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower())


def gpu_memory_gib(name: str) -> float:
    """Memory in GiB of a GPU in :data:`kvlib.memory.GPUS`, by name, as its driver reports it:
    ``"h100"`` → 79.65 (81,559 MiB), ``"t4"`` → 15.0."""
    return memory.GPUS[gpu_name(name)] / GIB


def gpu_compute_capability(name: str) -> tuple[int, int]:
    """Compute capability of a GPU in :data:`kvlib.memory.GPUS`, by name: ``"t4"`` → (7, 5)."""
    return memory.GPU_COMPUTE_CAPABILITY[gpu_name(name)]


def gpu_name(name: str) -> str:
    """The :data:`kvlib.memory.GPUS` name of a GPU named loosely (``"h100"`` → ``"H100 80GB"``).

    Raises:
        ValueError: no known GPU by that name (the message lists them).
    """
    table = {_gpu_key(k): k for k in memory.GPUS}
    key = _gpu_key(name)
    if key not in table:  # "A100" alone: the first entry that starts with it
        starts = [k for k in table if k.startswith(key)]
        if len(starts) == 1 or (starts and key in ("h100",)):
            key = starts[0]
        else:
            raise ValueError(
                f"unknown GPU {name!r} (known: {', '.join(memory.GPUS)}); or pass --gpu-memory GIB"
            )
    return table[key]


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line (no usage block) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvlib`` argument parser with its four subcommands."""
    parser = _Parser(
        prog="kvlib",
        description="KV-cache memory math and configuration plans (KV Cache Lab).",
    )
    sub = parser.add_subparsers(dest="command", metavar="{memory,plan,models,caches}")
    sub.required = True
    _add_memory(sub)
    _add_plan(sub)
    _add_lists(sub)
    return parser


def _add_memory(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``memory`` subcommand's arguments."""
    mem = sub.add_parser(
        "memory",
        help="KV-cache size of a model at a context and batch",
        description="KV-cache bytes per token, per sequence and per batch, at 16/8/4/2 bits "
        "(or fp16 and --bits), next to the weights.",
    )
    mem.add_argument("--model", required=True, help="registry name (see `kvlib models`)")
    mem.add_argument("--context", required=True, type=_size, help="tokens, e.g. 8192, 32k, 1m")
    mem.add_argument("--batch", type=_positive_int, default=1, help="sequences (default 1)")
    mem.add_argument("--bits", type=int, help="one KV precision to show next to fp16")
    mem.add_argument(
        "--group-size",
        type=_positive_int,
        help="count one fp16 scale + zero point per this many values (quantized rows)",
    )
    mem.add_argument("--weight-bits", type=int, default=16, help="bits per weight (default 16)")
    mem.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``plan`` subcommand's arguments."""
    pl = sub.add_parser(
        "plan",
        help="recommend a KV-cache setting and engine flags",
        description="Recommend the KV-cache setting for a model, memory, context and load, with "
        "transformers / vLLM / llama.cpp settings (rules: kvlib.plan.rule's docstring). Memory "
        "is in GiB: --gpu-memory 80 and 80GB both mean 80 GiB; give what nvidia-smi reports "
        "(--gpu looks it up: an H100 80GB reports 79.6 GiB, a T4 15 GiB). A request "
        "that does not fit gets 'would fit:' lines; one says whether token eviction would hold "
        "it, with its measured cost (never chosen as the setting: it drops tokens).",
    )
    pl.add_argument("--model", required=True, help="registry name (see `kvlib models`)")
    where = pl.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--gpu-memory",
        type=_memory,
        metavar="GIB",
        help="GiB per GPU, or of RAM with --device cpu (24, 80GB and 80GiB are all GiB)",
    )
    where.add_argument(
        "--gpu",
        help=f"a GPU by name, at the memory its driver reports: {', '.join(memory.GPUS)}",
    )
    pl.add_argument("--context", required=True, type=_size, help="tokens per sequence, e.g. 32k")
    pl.add_argument("--concurrency", type=_positive_int, default=1, help="sequences at once")
    pl.add_argument(
        "--typical-context",
        type=_size,
        metavar="TOKENS",
        help="tokens most conversations reach (sizes vLLM's --max-num-seqs; the plan still "
        "guarantees --context)",
    )
    pl.add_argument("--quality", choices=QUALITIES, default="balanced")
    pl.add_argument("--weight-bits", type=int, choices=WEIGHT_BITS, default=16)
    pl.add_argument("--num-gpus", type=_positive_int, default=1, help="tensor-parallel GPUs")
    pl.add_argument("--device", choices=DEVICES, default="gpu")
    pl.add_argument(
        "--engine",
        action="append",
        choices=ENGINES,
        dest="engines",
        help="an engine the plan may choose (repeat for several; default: every one)",
    )
    pl.add_argument(
        "--results",
        metavar="PATH",
        help="measured results to cite (JSON, kvlib.results layout; default: "
        f"${RESULTS_ENV}, else the package's kvlib/results.json)",
    )
    pl.add_argument("--json", action="store_true", help="print JSON instead of text")


def _add_lists(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``models`` and ``caches`` subcommands' arguments."""
    mo = sub.add_parser(
        "models", help="list the model registry", description="The registered model specs."
    )
    mo.add_argument("--json", action="store_true", help="print JSON instead of a table")

    ca = sub.add_parser(
        "caches",
        help="list the cache registry",
        description="Every cache the series compares, by the one name the benchmarks, the "
        "results file, the planner and make_cache() use. Eviction caches take their budget in "
        "the name, as a share of the fp16 bytes: evict-h2o-int4@1/4. (Loads torch.)",
    )
    ca.add_argument("--family", default=None, help="only this family (kvlib, hqq, evict, ...)")
    ca.add_argument("--json", action="store_true", help="print JSON instead of a table")


# ------------------------------------------------------------------------------- rendering


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _params(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _describe(spec: specs.ModelSpec) -> str:
    extra = ""
    if spec.is_mla:
        extra = f", MLA latent {spec.kv_lora_rank}+{spec.qk_rope_head_dim}"
    elif spec.num_sliding_layers:
        extra = f", {spec.num_sliding_layers} sliding-window layers ({spec.sliding_window})"
    return (
        f"{spec.name}: {spec.num_layers} layers, {spec.num_heads} heads, {spec.num_kv_heads} KV "
        f"heads ({spec.attention_type}), head_dim {spec.head_dim}{extra}, "
        f"{_params(spec.num_params)} params"
    )


def _cmd_memory(args: argparse.Namespace) -> tuple[str, Any]:
    spec = specs.get_spec(args.model)
    bits_list = [16, 8, 4, 2] if args.bits is None else list(dict.fromkeys([16, args.bits]))
    weights = spec.weights_bytes(args.weight_bits) if spec.num_params else None
    rows, data = [], []
    for bits in bits_list:
        group = args.group_size if bits < 16 else None
        per_token = memory.kv_bytes_per_token(spec, bits, group_size=group)
        per_seq = memory.kv_cache_bytes(spec, args.context, 1, bits, group_size=group)
        batch = memory.kv_cache_bytes(spec, args.context, args.batch, bits, group_size=group)
        total = batch + weights if weights is not None else None
        data.append(
            {
                "bits": bits,
                "group_size": group,
                "bytes_per_token": per_token,
                "bytes_per_sequence": per_seq,
                "bytes_batch": batch,
                "bytes_with_weights": total,
            }
        )
        rows.append(
            [
                bits,
                memory.human_bytes(per_token),
                memory.human_bytes(per_seq),
                memory.human_bytes(batch),
                memory.human_bytes(total) if total is not None else "?",
            ]
        )
    headers = [
        "KV bits",
        "per token",
        f"per sequence ({args.context:,} tok)",
        f"batch of {args.batch}",
        f"+ weights ({args.weight_bits}-bit: "
        + (memory.human_bytes(weights) if weights is not None else "?")
        + ")",
    ]
    text = _describe(spec) + "\n" + _table(headers, rows)
    if spec.num_sliding_layers:
        text += f"\n(sliding-window layers hold at most {spec.sliding_window:,} tokens)"
    payload = {
        "model": spec.name,
        "context": args.context,
        "batch": args.batch,
        "weight_bits": args.weight_bits,
        "weights_bytes": weights,
        "rows": data,
    }
    return text, payload


def _cmd_plan(args: argparse.Namespace) -> tuple[str, Any]:
    gib = args.gpu_memory if args.gpu_memory is not None else gpu_memory_gib(args.gpu)
    cc = gpu_compute_capability(args.gpu) if args.gpu is not None else None
    p = plan.recommend(
        args.model,
        gib,
        args.context,
        concurrency=args.concurrency,
        quality=args.quality,
        weight_bits=args.weight_bits,
        num_gpus=args.num_gpus,
        device=args.device,
        typical_context=args.typical_context,
        results=args.results,
        engines=args.engines,
        compute_capability=cc,
    )
    lines = [p.summary()]
    if p.kv is not None:
        try:
            t = p.to_transformers()
            lines.append(
                "transformers: cache = kvlib.compat.prefill_cache(model, prompt_ids[:, :-1], "
                f"chunk_size={PREFILL_CHUNK_TOKENS}, cache=kvlib.caches.registry.make_cache("
                f"{t['cache']!r}, model.config)); model.generate(prompt_ids, past_key_values="
                f"cache, ...), batch of {t['batch_size']} (prefilled in chunks: the plan's "
                f"activations allow {PREFILL_CHUNK_TOKENS:,} tokens at a time)"
            )
        except ValueError as exc:
            lines.append(f"transformers: {exc}")
        for engine, cmd in p.commands().items():
            lines.append(f"{engine}: {cmd}")
    return "\n".join(lines), p.to_dict()


def _cmd_models(args: argparse.Namespace) -> tuple[str, Any]:
    rows, data = [], []
    for name in specs.list_specs():
        s = specs.get_spec(name)
        per_token = memory.kv_bytes_per_token(s)
        rows.append(
            [
                name,
                s.attention_type + (" + sliding" if s.num_sliding_layers else ""),
                s.num_layers,
                s.num_heads,
                s.num_kv_heads,
                s.head_dim,
                _params(s.num_params),
                memory.human_bytes(per_token),
                f"{s.max_position_embeddings:,}" if s.max_position_embeddings else "?",
            ]
        )
        data.append(
            {
                "name": name,
                "attention": s.attention_type,
                "num_layers": s.num_layers,
                "num_heads": s.num_heads,
                "num_kv_heads": s.num_kv_heads,
                "head_dim": s.head_dim,
                "num_params": s.num_params,
                "sliding_window": s.sliding_window,
                "num_sliding_layers": s.num_sliding_layers,
                "kv_bytes_per_token_fp16": per_token,
                "max_position_embeddings": s.max_position_embeddings,
            }
        )
    headers = [
        "model",
        "attention",
        "layers",
        "heads",
        "kv",
        "head_dim",
        "params",
        "KV/token fp16",
        "max pos",
    ]
    return _table(headers, rows), data


#: How ``kvlib caches`` shows a required option's value (a count unless named here).
_REQUIRED_VALUE = {"basis": "<KVPCABasis>"}


def _cmd_caches(args: argparse.Namespace) -> tuple[str, Any]:
    # the registry builds caches, so it loads torch: only this command imports it
    from kvlib.caches import registry

    if args.family is not None and args.family not in registry.FAMILIES:
        raise ValueError(
            f"unknown cache family {args.family!r}; accepted: {', '.join(registry.FAMILIES)}"
        )
    infos = [registry.cache_info(n) for n in registry.CACHE_NAMES]
    infos = [i for i in infos if args.family in (None, i.family)]
    rows = [
        [
            i.name
            + ("@<share>" if i.budgeted else "")
            + "".join(f" {k}={_REQUIRED_VALUE.get(k, '<n>')}" for k in i.requires),
            i.family,
            i.bits,
            i.group_size or "-",
            i.residual_tokens or "-",
            i.description,
        ]
        for i in infos
    ]
    data = [
        {
            "name": i.name,
            "family": i.family,
            "bits": i.bits,
            "group_size": i.group_size,
            "residual_tokens": i.residual_tokens,
            "budgeted": i.budgeted,
            "policy": i.policy,
            "requires": list(i.requires),
            "description": i.description,
        }
        for i in infos
    ]
    headers = ["name", "family", "bits", "group", "fp16 tokens", "what it holds"]
    return _table(headers, rows), data


_COMMANDS = {
    "memory": _cmd_memory,
    "plan": _cmd_plan,
    "models": _cmd_models,
    "caches": _cmd_caches,
}


def _one_line(exc: BaseException) -> str:
    msg = str(exc).split(" (registered: ", 1)[0]
    if msg != str(exc):
        msg += " (run `kvlib models` for the list)"
    return " ".join(msg.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 rejected value, 2 bad arguments)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2, already printed)
        return int(exc.code or 0)
    try:
        text, payload = _COMMANDS[args.command](args)
    except (ValueError, TypeError) as exc:
        print(f"kvlib: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(payload, indent=2, ensure_ascii=False) if args.json else text)
        sys.stdout.flush()
    except BrokenPipeError:  # `kvlib models | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0
