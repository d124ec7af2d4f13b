"""Caches side by side on a full model: memory, speed, quality and agreement (notebook 08).

- :func:`run_cache_comparison` measures, for each cache
  (:data:`kvlib.caches.registry.CACHE_NAMES`), peak device memory (CUDA) or the bytes the cache
  holds (CPU), decode tokens/s and time to first token
  (:func:`kvlib.eval.quality.generation_benchmark`), the perplexity delta on held-out text against
  the reference DynamicCache (:func:`kvlib.eval.quality.perplexity`, chunked, so the cache is really
  read) and a short greedy sample.
- :func:`cache_agreement` checks each cache against the reference on the same tokens: the
  layer-0 attention-output error (the cache's error alone), the logits error and the argmax
  agreement, with a pass mark per bit width (:data:`AGREEMENT_LIMITS`).
- :func:`records` turns the result rows into dicts for a DataFrame.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvlib import compat
from kvlib.caches.registry import (
    cache_factory,
    cache_info,
    check_names,
    make_cache,
    reference_name,
)
from kvlib.eval.capacity import release_memory

if TYPE_CHECKING:
    from kvlib.eval.quality import GenerationBenchmark

__all__ = [
    "AGREEMENT_LIMITS",
    "Agreement",
    "ComparisonRow",
    "cache_agreement",
    "records",
    "run_cache_comparison",
]


# -- memory, speed and quality ----------------------------------------------------------------


@dataclass
class ComparisonRow:
    """One cache's numbers from :func:`run_cache_comparison`.

    ``memory_bytes`` is peak allocated device memory on CUDA (``memory_kind ==
    "peak allocated"``: weights, cache and activations) and the bytes the cache holds on other
    devices (``memory_kind == "cache bytes"``). ``perplexity`` and ``ppl_delta_pct`` (relative
    to the perplexity of the same text with the reference DynamicCache,
    :func:`kvlib.caches.registry.reference_name`) are ``None`` without ``eval_ids``.
    """

    cache: str
    bits: int
    prompt_tokens: int
    new_tokens: int
    cache_bytes: int
    memory_bytes: int
    memory_kind: str
    peak_memory_bytes: int | None
    decode_tokens_per_s: float
    time_to_first_token_s: float
    perplexity: float | None = None
    ppl_delta_pct: float | None = None
    sample: str = ""
    sample_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _dtype_bits(model: Any) -> int:
    return next(model.parameters()).element_size() * 8


def _reference(model: Any) -> str:
    """The reference cache's name for ``model``'s dtype (``"dynamic-fp32"``, …)."""
    return reference_name(next(model.parameters()).dtype)


def _row(
    name: str,
    dtype_bits: int,
    bench: GenerationBenchmark,
    ppl: float | None,
    delta: float | None,
    tokenizer: Any,
    sample_tokens: int,
) -> ComparisonRow:
    """One cache's :class:`ComparisonRow` from its generation benchmark and perplexity."""
    sample_ids = list(bench.generated_ids[:sample_tokens])
    sample = tokenizer.decode(sample_ids) if tokenizer is not None else ""
    peak = bench.peak_memory_bytes
    return ComparisonRow(
        cache=name,
        bits=cache_info(name).cache_bits(dtype_bits),
        prompt_tokens=bench.prompt_tokens,
        new_tokens=bench.new_tokens,
        cache_bytes=bench.cache_nbytes,
        memory_bytes=peak if peak is not None else bench.cache_nbytes,
        memory_kind="peak allocated" if peak is not None else "cache bytes",
        peak_memory_bytes=peak,
        decode_tokens_per_s=bench.decode_tokens_per_s,
        time_to_first_token_s=bench.time_to_first_token_s,
        perplexity=ppl,
        ppl_delta_pct=delta,
        sample=sample,
        sample_ids=sample_ids,
    )


def run_cache_comparison(
    model: Any,
    tokenizer: Any,
    caches: Sequence[str],
    prompt_tokens: int = 1024,
    new_tokens: int = 32,
    *,
    eval_ids: torch.Tensor | None = None,
    prompt_ids: torch.Tensor | None = None,
    repeats: int = 3,
    chunk_size: int = 64,
    sample_tokens: int = 16,
    warmup: bool = True,
    cache_options: dict[str, dict[str, Any]] | None = None,
) -> list[ComparisonRow]:
    """Generate with each cache and measure memory, speed and quality, side by side.

    Args:
        model, tokenizer: a causal LM and its tokenizer.
        caches: cache names (:data:`kvlib.caches.registry.CACHE_NAMES`).
        prompt_tokens: prompt length (tokens of ``kvlib.data.load_eval_text()``, or of
            ``prompt_ids``).
        new_tokens: greedy tokens generated per timed run (>= 2).
        eval_ids: (batch, seq_len) held-out token ids for the perplexity (chunked by
            ``chunk_size``); ``None`` skips quality.
        prompt_ids: (1, >= prompt_tokens) prompt token ids instead of the evaluation text
            (random models: random ids).
        repeats: timed runs per cache (medians are reported).
        sample_tokens: how many of the generated tokens are decoded into ``sample``.
        cache_options: per-cache keyword options for
            :func:`kvlib.caches.registry.cache_factory`.

    Returns:
        One :class:`ComparisonRow` per cache, in order. Every timed number comes from
        :func:`kvlib.eval.quality.generation_benchmark` (warm-up, median, ``perf_counter``, CUDA
        synchronisation and peak memory).
    """
    from kvlib.eval.quality import generation_benchmark, perplexity

    names = check_names(caches)
    options = cache_options or {}
    dtype_bits = _dtype_bits(model)
    reference_ppl = None
    if eval_ids is not None:
        reference = make_cache(_reference(model), model.config)
        reference_ppl = perplexity(model, eval_ids, cache=reference, chunk_size=chunk_size)
        del reference
    rows = []
    for name in names:
        factory = cache_factory(name, model.config, **options.get(name, {}))
        bench = generation_benchmark(
            model,
            tokenizer,
            factory,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            repeats=repeats,
            name=name,
            prompt_ids=prompt_ids,
            warmup=warmup,
        )
        ppl = delta = None
        if eval_ids is not None and reference_ppl is not None:
            ppl = perplexity(model, eval_ids, cache=factory(), chunk_size=chunk_size)
            delta = 100.0 * (ppl / reference_ppl - 1.0)
        rows.append(_row(name, dtype_bits, bench, ppl, delta, tokenizer, sample_tokens))
        del factory, bench
        device = next(model.parameters()).device
        if device.type == "cuda":
            release_memory(device)
    return rows


# -- agreement with the reference DynamicCache ------------------------------------------------

#: Largest layer-0 attention-output relative error accepted per cache bit width by
#: :func:`cache_agreement` (int8 must be near-exact; int2 only roughly right).
AGREEMENT_LIMITS: dict[int, float] = {8: 0.02, 4: 0.15, 3: 0.35, 2: 0.7}


@dataclass
class Agreement:
    """How closely a cache reproduces the reference DynamicCache on the last ``tail``
    positions of a chunked prefill (see :func:`cache_agreement`)."""

    cache: str
    bits: int
    context: int
    tail: int
    attention_rel_err: float
    logits_rel_err: float
    top1_agreement: float
    limit: float | None
    passed: bool | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _first_o_proj(model: Any) -> torch.nn.Module:
    for module in model.modules():
        if all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return module.o_proj
    raise TypeError(
        f"{type(model).__name__} has no Llama-style attention (q/k/v/o_proj) to compare"
    )


@torch.inference_mode()
def _tail_outputs(
    model: Any, ids: torch.Tensor, cache: Any, tail: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``ids[:, :-tail]`` into ``cache`` in chunks, then run the last ``tail`` tokens;
    return their logits ``(batch, tail, vocab)`` and layer-0 attention output (the o_proj
    input, ``(batch, tail, heads * head_dim)``), both float32."""
    captured: list[torch.Tensor] = []
    o_proj = _first_o_proj(model)
    hook = o_proj.register_forward_pre_hook(lambda _m, args: captured.append(args[0].float()))
    try:
        head = ids.shape[1] - tail
        for start in range(0, head, chunk):
            compat.forward(model, ids[:, start : min(start + chunk, head)], cache, logits_to_keep=1)
        captured.clear()
        logits = compat.forward(model, ids[:, head:], cache).logits.float()
    finally:
        hook.remove()
    return logits, captured[0]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    denom = torch.linalg.vector_norm(ref)
    diff = torch.linalg.vector_norm(a - ref)
    return float(diff / denom) if denom > 0 else float(diff)


def cache_agreement(
    model: Any,
    input_ids: torch.Tensor,
    caches: Sequence[str],
    *,
    tail: int = 64,
    chunk: int = 1024,
    limits: dict[int, float] | None = None,
) -> list[Agreement]:
    """Check caches against the reference, transformers' DynamicCache, on the same tokens.

    ``input_ids`` ``(batch, seq_len)`` are prefilled in ``chunk``-token pieces (so each piece
    reads the cached, possibly quantized, past), then the last ``tail`` tokens are run once
    with each cache and once with the reference (:func:`kvlib.caches.registry.reference_name`
    of the model's dtype). Compared there:

    - the layer-0 attention output (input of ``o_proj``): layer 0 sees identical inputs, so
      its error is the cache's error alone;
    - the logits (relative Frobenius error) and the argmax agreement.

    A cache passes when its attention error is within ``limits[bits]`` (default
    :data:`AGREEMENT_LIMITS`); ``limit`` and ``passed`` are ``None`` for a DynamicCache (the
    reference itself).
    """
    names = check_names(caches)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a (batch, seq_len) tensor of token ids")
    if not 1 <= tail < input_ids.shape[1]:
        raise ValueError(f"tail must be in [1, seq_len) (got {tail} for {input_ids.shape[1]})")
    limits = AGREEMENT_LIMITS if limits is None else limits
    ids = input_ids.to(next(model.parameters()).device)
    dtype_bits = _dtype_bits(model)
    ref_logits, ref_attn = _tail_outputs(
        model, ids, make_cache(_reference(model), model.config), tail, chunk
    )
    ref_top1 = ref_logits.argmax(-1)
    out = []
    for name in names:
        info = cache_info(name)
        bits = info.cache_bits(dtype_bits)
        cache = make_cache(name, model.config)
        logits, attn = _tail_outputs(model, ids, cache, tail, chunk)
        del cache
        limit = None if info.family == "dynamic" else limits.get(bits)
        attn_err = _rel(attn, ref_attn)
        out.append(
            Agreement(
                cache=name,
                bits=bits,
                context=int(ids.shape[1]),
                tail=tail,
                attention_rel_err=attn_err,
                logits_rel_err=_rel(logits, ref_logits),
                top1_agreement=float((logits.argmax(-1) == ref_top1).float().mean()),
                limit=limit,
                passed=None if limit is None else attn_err <= limit,
            )
        )
        del logits, attn
    return out


def records(rows: Sequence[Any]) -> list[dict[str, Any]]:
    """Rows (dataclasses) as dicts, for ``pandas.DataFrame(records(rows))``."""
    return [asdict(r) for r in rows]
