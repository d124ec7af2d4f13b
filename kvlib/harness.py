"""The full-model run: memory, speed, quality and what fits, per KV cache (notebook 07).

One harness for every device a reader may have:

- :func:`cache_factory` builds caches by name (:data:`CACHE_NAMES`): ``"dynamic"`` (transformers'
  full-precision ``DynamicCache``), ``"kvlib-int8"`` / ``-int4`` / ``-int3`` / ``-int2``
  (:class:`kvlib.cache.QuantizedKVCache`), ``"quanto-int4"`` / ``-int2`` (transformers'
  ``QuantizedCache`` with the quanto backend) and ``"hqq-int4"`` …
- :func:`run_cache_comparison` measures, for each cache, peak device memory (CUDA) or the
  bytes the cache holds (CPU), decode tokens/s and time to first token
  (:func:`kvlib.eval.generation_benchmark`), the perplexity delta on held-out text
  (:func:`kvlib.eval.perplexity`, chunked, so the cache is really read) and a short greedy sample.
- :func:`what_fits` predicts, for a memory budget, the longest context (batch 1) and the largest
  batch (at a given context) each cache allows (:func:`kvlib.memory.max_context` /
  :func:`kvlib.memory.max_batch`) and, on CUDA, confirms it by really filling a cache and
  running a decode step under an emulated budget
  (``torch.cuda.set_per_process_memory_fraction``). Out-of-memory is caught and reported as
  "does not fit"; memory is released and the search continues.
- :func:`choose_model` / :func:`load_choice` pick the model for the device: an open ~2 B
  instruct model on CUDA with hub access, the bundled SmolLM2-135M offline or on CPU, and a
  randomly initialised model of a real architecture (:func:`random_model`) on a GPU without hub.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvlib import compat
from kvlib import memory as kvmem

__all__ = [
    "CACHE_NAMES",
    "DEFAULT_HUB_MODEL",
    "DEFAULT_RANDOM_SPEC",
    "CacheInfo",
    "ComparisonRow",
    "FitRow",
    "ModelChoice",
    "AGREEMENT_LIMITS",
    "ARCHITECTURES",
    "Agreement",
    "cache_agreement",
    "cache_factory",
    "cache_info",
    "choose_model",
    "fill_and_step",
    "fill_or_none",
    "is_oom",
    "load_choice",
    "make_cache",
    "memory_limit",
    "random_config",
    "random_model",
    "records",
    "release_memory",
    "run_cache_comparison",
    "search_max",
    "simulated_budget_runner",
    "what_fits",
]

#: Every cache name :func:`cache_factory` understands.
CACHE_NAMES: tuple[str, ...] = (
    "dynamic",
    "kvlib-int8",
    "kvlib-int4",
    "kvlib-int3",
    "kvlib-int2",
    "quanto-int4",
    "quanto-int2",
    "hqq-int8",
    "hqq-int4",
    "hqq-int2",
)

#: The default model on a CUDA machine with hub access. SmolLM2-1.7B-Instruct is open
#: (Apache-2.0, not gated), shares the bundled model's tokenizer and family, and uses full
#: multi-head attention (32 KV heads): 192 KiB of fp16 cache per token, so the cache outgrows
#: its 3.4 GB of bf16 weights past ~17k tokens — the regime where a quantized cache pays off.
#: (Qwen2.5-1.5B-Instruct keeps only 2 KV heads, 28 KiB per token: its cache barely matters.)
#: Its training context is 8192 tokens; longer contexts are memory and speed figures only.
DEFAULT_HUB_MODEL = "HuggingFaceTB/SmolLM2-1.7B-Instruct"

#: The architecture of the random-weights model used on a GPU without hub access (the same
#: architecture as :data:`DEFAULT_HUB_MODEL`, and its vocabulary matches the bundled tokenizer).
DEFAULT_RANDOM_SPEC = "smollm2-1.7b"

#: Facts a randomly initialised model needs beyond :class:`kvlib.memory.ModelSpec`, per
#: registry name: (model_type, intermediate_size, tie_word_embeddings, rope_theta), from each
#: model's config.json on the hub. With them, :func:`random_config` reproduces the registry's
#: exact parameter count (checked in the tests).
ARCHITECTURES: dict[str, tuple[str, int, bool, float]] = {
    "smollm2-135m": ("llama", 1536, True, 100_000.0),
    "smollm2-1.7b": ("llama", 8192, True, 130_000.0),
    "llama-2-7b": ("llama", 11008, False, 10_000.0),
    "llama-3.2-1b": ("llama", 8192, True, 500_000.0),
    "llama-3.2-3b": ("llama", 8192, True, 500_000.0),
    "llama-3.1-8b": ("llama", 14336, False, 500_000.0),
    "mistral-7b-v0.3": ("llama", 14336, False, 1_000_000.0),
    "qwen2.5-0.5b": ("qwen2", 4864, True, 1_000_000.0),
    "qwen2.5-7b": ("qwen2", 18944, False, 1_000_000.0),
}

#: Quantization group size (values per scale/zero-point) each cache family uses by default,
#: for the :mod:`kvlib.memory` prediction.
_GROUP_SIZES = {"kvlib": 32, "quanto": 64, "hqq": 64}


# -- caches by name ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheInfo:
    """What a cache name means.

    Attributes:
        name: as in :data:`CACHE_NAMES`.
        family: ``"dynamic"``, ``"kvlib"``, ``"quanto"`` or ``"hqq"``.
        bits: bits per cached value (``None`` for ``"dynamic"``: the model's dtype decides).
        group_size: values per scale/zero-point pair, for the memory prediction (``None`` for
            full precision).
        residual_tokens: most recent tokens per sequence the cache keeps in full precision
            (kvlib also keeps 4 attention-sink tokens), which :mod:`kvlib.memory`'s formula
            leaves out.
    """

    name: str
    family: str
    bits: int | None
    group_size: int | None
    residual_tokens: int = 0

    def cache_bits(self, dtype_bits: int = 16) -> int:
        """Bits per cached value, ``dtype_bits`` (the model's dtype) for ``"dynamic"``."""
        return dtype_bits if self.bits is None else self.bits


def cache_info(name: str) -> CacheInfo:
    """Parse a cache name (``"dynamic"``, ``"kvlib-int4"``, ``"quanto-int2"``, …).

    Raises:
        ValueError: the name is not one of :data:`CACHE_NAMES`.
    """
    if not isinstance(name, str) or name not in CACHE_NAMES:
        raise ValueError(f"unknown cache {name!r}; accepted: {', '.join(CACHE_NAMES)}")
    if name == "dynamic":
        return CacheInfo(name, "dynamic", None, None)
    family, kind = name.split("-")
    bits = int(kind.removeprefix("int"))
    residual = 128 + 4 if family == "kvlib" else 128
    return CacheInfo(name, family, bits, _GROUP_SIZES[family], residual)


def _kvlib_cache_class() -> Any:
    try:
        from kvlib.cache import QuantizedKVCache
    except ImportError as exc:  # pragma: no cover - only while kvlib.cache is missing
        raise ImportError(
            f"the kvlib-int* caches need kvlib.cache.QuantizedKVCache ({exc}); "
            "use 'dynamic' or 'quanto-int4' meanwhile"
        ) from exc
    return QuantizedKVCache


def cache_factory(name: str, config: Any, **options: Any) -> Callable[[], Any]:
    """A zero-argument function that returns a fresh cache called ``name`` for ``config``.

    Args:
        name: one of :data:`CACHE_NAMES`.
        config: the model's transformers config (``model.config``).
        **options: passed to the cache class (e.g. ``residual_length=64``, ``rotate=True`` for
            kvlib; ``q_group_size`` for quanto/HQQ).

    Raises:
        ValueError: unknown name.
    """
    info = cache_info(name)
    if info.family == "dynamic":
        if options:
            raise ValueError(f"'dynamic' takes no options (got {sorted(options)})")
        return lambda: compat.dynamic_cache(config)
    if info.family == "kvlib":
        cls = _kvlib_cache_class()
        return lambda: cls(config, bits=info.bits, **options)
    backend = info.family
    return lambda: compat.hf_quantized_cache(config, backend, info.bits, **options)


def make_cache(name: str, config: Any, **options: Any) -> Any:
    """One fresh cache called ``name`` (see :func:`cache_factory`)."""
    return cache_factory(name, config, **options)()


# -- comparison -------------------------------------------------------------------------------


@dataclass
class ComparisonRow:
    """One cache's numbers from :func:`run_cache_comparison`.

    ``memory_bytes`` is peak allocated device memory on CUDA (``memory_kind ==
    "peak allocated"``: weights, cache and activations) and the bytes the cache holds on other
    devices (``memory_kind == "cache bytes"``). ``perplexity`` and ``ppl_delta_pct`` (relative
    to the DynamicCache perplexity of the same text) are ``None`` without ``eval_ids``.
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


def _check_caches(caches: Any) -> list[str]:
    if isinstance(caches, str) or not isinstance(caches, Sequence) or not caches:
        raise TypeError(f"caches must be a non-empty list of cache names (got {caches!r})")
    for name in caches:
        cache_info(name)
    return list(caches)


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
        caches: cache names (:data:`CACHE_NAMES`).
        prompt_tokens: prompt length (tokens of ``kvlib.data.load_eval_text()``, or of
            ``prompt_ids``).
        new_tokens: greedy tokens generated per timed run (>= 2).
        eval_ids: (batch, seq_len) held-out token ids for the perplexity (chunked by
            ``chunk_size``); ``None`` skips quality.
        prompt_ids: (1, >= prompt_tokens) prompt token ids instead of the evaluation text
            (random models: random ids).
        repeats: timed runs per cache (medians are reported).
        sample_tokens: how many of the generated tokens are decoded into ``sample``.
        cache_options: per-cache keyword options for :func:`cache_factory`.

    Returns:
        One :class:`ComparisonRow` per cache, in order. Every timed number comes from
        :func:`kvlib.eval.generation_benchmark` (warm-up, median, ``perf_counter``, CUDA
        synchronisation and peak memory).
    """
    from kvlib.eval import generation_benchmark, perplexity

    names = _check_caches(caches)
    options = cache_options or {}
    dtype_bits = _dtype_bits(model)
    reference_ppl = None
    if eval_ids is not None:
        reference_ppl = perplexity(model, eval_ids, cache=None, chunk_size=chunk_size)
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
        sample_ids = list(bench.generated_ids[:sample_tokens])
        sample = tokenizer.decode(sample_ids) if tokenizer is not None else ""
        peak = bench.peak_memory_bytes
        rows.append(
            ComparisonRow(
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
        )
        del factory, bench
        device = next(model.parameters()).device
        if device.type == "cuda":
            release_memory(device)
    return rows


# -- memory housekeeping ----------------------------------------------------------------------


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` means the device ran out of memory (``torch.OutOfMemoryError``, or the
    ``RuntimeError`` some CUDA libraries raise instead, e.g. cuBLAS' ``ALLOC_FAILED``)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return "out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text
    return False


def release_memory(device: torch.device | str | None = None) -> None:
    """Give freed memory back: on CUDA ``gc.collect()`` and ``torch.cuda.empty_cache()``;
    elsewhere a cheap ``gc.collect(1)``.

    Call it *after* leaving an ``except`` block (the exception's traceback keeps the failed
    step's tensors alive until then).
    """
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
    else:  # host memory: the young generations hold a failed step's cycles; a full pass
        gc.collect(1)  # over a loaded model's heap costs about a second on a slow CPU


@contextlib.contextmanager
def memory_limit(budget_bytes: float, device: torch.device | str = "cuda") -> Iterator[float]:
    """Emulate a smaller GPU: cap this process's CUDA allocator at ``budget_bytes``.

    Uses ``torch.cuda.set_per_process_memory_fraction(budget / total)`` (the weights already
    on the device count against the budget) and restores the full device on exit. Yields the
    fraction applied (1.0 when the budget is larger than the device). CUDA only.

    Raises:
        ValueError: not a CUDA device, or a budget <= 0.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"memory_limit needs a CUDA device (got {dev})")
    if not budget_bytes > 0:
        raise ValueError(f"budget_bytes must be > 0 (got {budget_bytes})")
    total = torch.cuda.get_device_properties(dev).total_memory
    fraction = min(1.0, float(budget_bytes) / total)
    release_memory(dev)
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    try:
        yield fraction
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        release_memory(dev)


# -- really running it: fill a cache, take a decode step --------------------------------------


def _kv_shape(config: Any) -> tuple[int, int, int]:
    spec = kvmem.spec_from_config(config)
    return spec.num_layers, spec.num_kv_heads, spec.head_dim


@torch.inference_mode()
def fill_and_step(
    model: Any,
    factory: Callable[[], Any],
    context: int,
    batch: int = 1,
    *,
    max_elements: int = 2**26,
) -> int:
    """Fill a fresh cache with ``context`` tokens for ``batch`` sequences, then run one real
    decode step of the model over it; return the bytes the cache holds.

    The cache is filled layer by layer, in chunks of tokens, with random keys/values
    ``(batch, kv_heads, chunk, head_dim)`` in the model's dtype (what a prefill writes, without
    the prefill's compute; ``max_elements`` bounds one chunk). The decode step then makes the
    model read the whole cache, with the same transient memory as real generation.

    Raises:
        torch.OutOfMemoryError: when it does not fit (callers catch it, see :func:`search_max`).
    """
    layers, kv_heads, head_dim = _kv_shape(model.config)
    param = next(model.parameters())
    chunk = max(1, min(context, max_elements // max(1, batch * kv_heads * head_dim)))
    cache = factory()
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        for layer in range(layers):
            k = torch.randn(batch, kv_heads, n, head_dim, device=param.device, dtype=param.dtype)
            v = torch.randn_like(k)
            cache.update(k, v, layer)
            del k, v
    token = torch.zeros(batch, 1, dtype=torch.long, device=param.device)
    compat.forward(model, token, cache, logits_to_keep=1)
    if param.device.type == "cuda":
        torch.cuda.synchronize(param.device)
    nbytes = compat.cache_nbytes(cache)
    del cache
    return nbytes


def fill_or_none(model: Any, name: str, context: int, batch: int = 1) -> int | None:
    """:func:`fill_and_step` with a fresh ``name`` cache, or ``None`` when it runs out of
    memory (caught; memory released). For tables that must not crash on a small GPU."""
    factory = cache_factory(name, model.config)
    held: list[int] = []
    ok = _fits(
        lambda n: held.append(fill_and_step(model, factory, n, batch)),
        context,
        next(model.parameters()).device,
    )
    return held[0] if ok else None


def simulated_budget_runner(
    model: Any, budget_bytes: float, *, overhead_bytes: float = 0
) -> Callable[[str, int, int], int]:
    """A :func:`what_fits` runner for machines without CUDA: really fills the cache and takes
    a decode step (:func:`fill_and_step`), then raises ``torch.OutOfMemoryError`` if the
    weights plus ``overhead_bytes`` plus the bytes the cache really holds exceed
    ``budget_bytes`` — an accounting check of the same code path, not an allocator's verdict.
    """
    weights = sum(p.numel() * p.element_size() for p in model.parameters())

    def runner(name: str, context: int, batch: int) -> int:
        held = fill_and_step(model, cache_factory(name, model.config), context, batch)
        if weights + overhead_bytes + held > budget_bytes:
            raise torch.OutOfMemoryError(
                f"simulated: {weights + held} bytes needed, budget {int(budget_bytes)}"
            )
        return held

    return runner


def _fits(probe: Callable[[int], Any], n: int, device: Any) -> bool:
    """Run ``probe(n)``; out-of-memory means False. Memory is released after the except."""
    ok = True
    try:
        probe(n)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not is_oom(exc):
            raise
        ok = False
        del exc
    release_memory(device)
    return ok


def search_max(
    fits: Callable[[int], bool],
    guess: int,
    *,
    step: int = 1,
    max_probes: int = 8,
) -> tuple[int, int]:
    """Largest ``n`` (a multiple of ``step``) with ``fits(n)``, starting near ``guess``.

    Probes ``guess`` first, then halves (until something fits) or grows by 1.5× (at most
    ``max_probes`` times) until the answer is bracketed, then bisects with at most
    ``max_probes`` more probes. ``fits`` is assumed monotone (if ``n`` fits, every smaller
    ``n`` does).

    Returns:
        ``(n, resolution)``: the largest multiple of ``step`` confirmed to fit (0 when not even
        ``step`` fits) and the gap to the smallest confirmed failure above it (``0`` if no
        failure was seen within the probes: ``n`` is then only a lower bound).
    """
    step = max(1, int(step))
    n = max(step, int(guess) // step * step)
    lo, hi = 0, None  # lo fits (0 trivially), hi does not
    probes = 0
    while True:  # bracket the answer: halving always ends (at ``step``), growing is capped
        if fits(n):
            lo = n
            if hi is not None:
                break
            probes += 1
            if probes >= max_probes:
                break
            n = max(n + step, int(n * 1.5) // step * step)
        else:
            hi = n
            if lo > 0 or n <= step:
                break
            n = max(step, n // 2 // step * step)
    while hi is not None and hi - lo > step and probes < max_probes:  # bisect
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        probes += 1
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, (hi - lo) if hi is not None else 0


# -- correctness against DynamicCache ---------------------------------------------------------

#: Largest layer-0 attention-output relative error accepted per cache bit width by
#: :func:`cache_agreement` (int8 must be near-exact; int2 only roughly right).
AGREEMENT_LIMITS: dict[int, float] = {8: 0.02, 4: 0.15, 3: 0.35, 2: 0.7}


@dataclass
class Agreement:
    """How closely a cache reproduces DynamicCache on the last ``tail`` positions of a
    chunked prefill (see :func:`cache_agreement`)."""

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
    """Check caches against transformers' DynamicCache on the same tokens.

    ``input_ids`` ``(batch, seq_len)`` are prefilled in ``chunk``-token pieces (so each piece
    reads the cached, possibly quantized, past), then the last ``tail`` tokens are run once
    with each cache and once with a DynamicCache. Compared there:

    - the layer-0 attention output (input of ``o_proj``): layer 0 sees identical inputs, so
      its error is the cache's error alone;
    - the logits (relative Frobenius error) and the argmax agreement.

    A cache passes when its attention error is within ``limits[bits]`` (default
    :data:`AGREEMENT_LIMITS`); ``passed`` is ``None`` for "dynamic" (the reference itself).
    """
    names = _check_caches(caches)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a (batch, seq_len) tensor of token ids")
    if not 1 <= tail < input_ids.shape[1]:
        raise ValueError(f"tail must be in [1, seq_len) (got {tail} for {input_ids.shape[1]})")
    limits = AGREEMENT_LIMITS if limits is None else limits
    ids = input_ids.to(next(model.parameters()).device)
    dtype_bits = _dtype_bits(model)
    ref_logits, ref_attn = _tail_outputs(
        model, ids, compat.dynamic_cache(model.config), tail, chunk
    )
    ref_top1 = ref_logits.argmax(-1)
    out = []
    for name in names:
        bits = cache_info(name).cache_bits(dtype_bits)
        cache = make_cache(name, model.config)
        logits, attn = _tail_outputs(model, ids, cache, tail, chunk)
        del cache
        limit = None if name == "dynamic" else limits.get(bits)
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


# -- what fits --------------------------------------------------------------------------------


@dataclass
class FitRow:
    """Longest context (batch 1) and largest batch (at ``batch_context``) for one cache.

    ``measured_*`` are ``None`` where nothing was run (not on CUDA); ``0`` means "does not fit"
    (not even the smallest probe). ``*_resolution`` is the gap to the smallest measured
    failure (0: no failure seen, the measured value is a lower bound).
    """

    cache: str
    bits: int
    budget_bytes: int
    batch_context: int
    predicted_max_context: int
    predicted_max_batch: int
    measured_max_context: int | None = None
    measured_max_batch: int | None = None
    context_resolution: int | None = None
    batch_resolution: int | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _spec_of(model_or_spec: Any) -> kvmem.ModelSpec:
    if isinstance(model_or_spec, kvmem.ModelSpec):
        return model_or_spec
    if isinstance(model_or_spec, str):
        return kvmem.get_spec(model_or_spec)
    config = getattr(model_or_spec, "config", None)
    if config is None:
        raise TypeError(
            "model_or_spec must be a model, a kvlib.memory.ModelSpec or a registry name "
            f"(got {type(model_or_spec).__name__})"
        )
    n_params = sum(p.numel() for p in model_or_spec.parameters())
    return kvmem.spec_from_config(config, num_params=n_params)


def what_fits(
    model_or_spec: Any,
    budget_bytes: float,
    caches: Sequence[str],
    *,
    batch_context: int = 8192,
    dtype_bits: int = 16,
    weight_bits: int | None = None,
    overhead_bytes: float = 0,
    measure: bool | None = None,
    runner: Callable[[str, int, int], Any] | None = None,
    context_step: int = 256,
    max_probes: int = 8,
    device: torch.device | str | None = None,
) -> list[FitRow]:
    """For a memory budget, the longest context and the largest batch each cache allows.

    Predicted by :func:`kvlib.memory.max_context` (batch 1) and :func:`kvlib.memory.max_batch`
    (at ``batch_context`` tokens) with the cache's bits and group size, next to the weights at
    ``weight_bits`` (default ``dtype_bits``) plus ``overhead_bytes``. The prediction leaves out
    each quantized cache's full-precision window (:attr:`CacheInfo.residual_tokens`) and the
    activations; the measurement includes them.

    Measured (``measure=True``, default: when the model is on CUDA): under
    :func:`memory_limit` ``(budget_bytes)``, :func:`search_max` probes contexts in steps of
    ``context_step`` and batch sizes, each probe calling ``runner(cache_name, context, batch)``
    (default :func:`fill_and_step` with the model). A probe that raises out-of-memory counts
    as "does not fit"; memory is released and the search goes on, so this never crashes.

    Args:
        model_or_spec: a loaded model (required for measuring), a ModelSpec or a registry name.
        runner: replaces the real probe (tests: a fake that raises ``torch.OutOfMemoryError``).
            With a runner, measuring needs no CUDA and no budget emulation.

    Returns:
        One :class:`FitRow` per cache.
    """
    names = _check_caches(caches)
    spec = _spec_of(model_or_spec)
    wbits = dtype_bits if weight_bits is None else weight_bits
    model = None if isinstance(model_or_spec, kvmem.ModelSpec | str) else model_or_spec
    if device is None:
        device = next(model.parameters()).device if model is not None else torch.device("cpu")
    device = torch.device(device)
    if measure is None:
        measure = runner is not None or (model is not None and device.type == "cuda")
    emulate = runner is None  # the real probe runs under the emulated budget
    if measure and runner is None:
        if model is None:
            raise ValueError("measuring what fits needs a loaded model (or a runner)")
        if device.type != "cuda":
            raise ValueError(f"measuring what fits needs CUDA (got {device}); pass a runner")

        def runner(name: str, context: int, batch: int) -> Any:
            return fill_and_step(model, cache_factory(name, model.config), context, batch)

    rows = []
    for name in names:
        info = cache_info(name)
        bits = info.cache_bits(dtype_bits)
        group = info.group_size if bits < 16 else None
        common = dict(bits=bits, weight_bits=wbits, overhead_bytes=overhead_bytes, group_size=group)
        p_ctx = kvmem.max_context(spec, budget_bytes, batch_size=1, **common)
        p_batch = kvmem.max_batch(spec, budget_bytes, batch_context, **common)
        row = FitRow(name, bits, int(budget_bytes), batch_context, p_ctx, p_batch)
        if measure:
            assert runner is not None
            probe_ctx = _probe_for(runner, name, batch=1)
            probe_batch = _probe_for(runner, name, context=batch_context)
            with _budget(budget_bytes, device, emulate=emulate):
                if p_ctx >= kvmem.UNBOUNDED:
                    row.note = "memory does not limit the context (sliding window)"
                else:
                    row.measured_max_context, row.context_resolution = search_max(
                        lambda n, f=probe_ctx: _fits(f, n, device),
                        max(p_ctx, context_step),
                        step=context_step,
                        max_probes=max_probes,
                    )
                row.measured_max_batch, row.batch_resolution = search_max(
                    lambda n, f=probe_batch: _fits(f, n, device),
                    max(p_batch, 1),
                    step=1,
                    max_probes=max_probes,
                )
        rows.append(row)
    return rows


def _probe_for(runner: Callable[..., Any], name: str, **fixed: int) -> Callable[[int], Any]:
    """``n -> runner(name, context, batch)`` with one of context/batch fixed, the other ``n``."""
    if "batch" in fixed:
        return lambda n: runner(name, n, fixed["batch"])
    return lambda n: runner(name, fixed["context"], n)


@contextlib.contextmanager
def _budget(budget_bytes: float, device: torch.device, emulate: bool) -> Iterator[None]:
    if emulate and device.type == "cuda":
        with memory_limit(budget_bytes, device):
            yield
    else:
        yield


# -- models -----------------------------------------------------------------------------------


def _cuda_half(device: torch.device) -> torch.dtype:
    """bfloat16 on GPUs with native support (compute capability >= 8: A100, L4, H100), float16
    on older ones (T4, V100), where ``torch.cuda.is_bf16_supported()`` may say True only
    because bf16 is emulated, slowly."""
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def random_config(
    spec: kvmem.ModelSpec | str,
    *,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int | None = None,
) -> Any:
    """A transformers ``LlamaConfig`` / ``Qwen2Config`` with the shapes of a registry model.

    The attention shapes (heads, KV heads, head_dim, hidden size) always follow the spec —
    they decide the KV cache; ``num_layers``, ``vocab_size`` and ``intermediate_size`` may be
    shrunk for quick runs. ``max_position_embeddings`` defaults to at least 131072 so that long
    random-token contexts are accepted.

    Raises:
        ValueError: a spec without a known architecture (see :data:`ARCHITECTURES`), an MLA or
            sliding-window spec.
    """
    spec = kvmem.get_spec(spec) if isinstance(spec, str) else spec
    if not isinstance(spec, kvmem.ModelSpec):
        raise TypeError(f"spec must be a ModelSpec or a registry name (got {type(spec).__name__})")
    arch = ARCHITECTURES.get(spec.name)
    if arch is None:
        raise ValueError(
            f"no architecture recorded for {spec.name!r}; accepted: {', '.join(ARCHITECTURES)}"
        )
    if spec.hidden_size is None or spec.vocab_size is None:
        raise ValueError(f"spec {spec.name!r} needs hidden_size and vocab_size")
    model_type, inter, tie, theta = arch
    kwargs = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=intermediate_size or inter,
        num_hidden_layers=num_layers or spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=vocab_size or spec.vocab_size,
        tie_word_embeddings=tie,
        rope_theta=theta,
        max_position_embeddings=max_position_embeddings
        or max(spec.max_position_embeddings or 0, 131072),
    )
    if model_type == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**kwargs)
    from transformers import LlamaConfig

    return LlamaConfig(**kwargs)


def random_model(
    spec: kvmem.ModelSpec | str = DEFAULT_RANDOM_SPEC,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    **shrink: int | None,
) -> Any:
    """A randomly initialised causal LM of a real architecture, in eval mode.

    Good for memory and speed (the shapes are the real model's), useless for quality (its
    text is noise). Weights are created directly on ``device``.

    Args:
        spec: a registry name (see :data:`ARCHITECTURES`) or a ModelSpec.
        device: default :func:`kvlib.get_device`.
        dtype: default bfloat16 on CUDA (float16 where bf16 is unsupported), float32 elsewhere.
        seed: torch seed for the initialisation.
        **shrink: ``num_layers``, ``vocab_size``, ``intermediate_size``,
            ``max_position_embeddings`` (see :func:`random_config`).
    """
    from transformers import AutoModelForCausalLM

    from kvlib.device import get_device
    from kvlib.models import quiet

    dev = torch.device(device) if device is not None else get_device()
    if dtype is None:
        if dev.type == "cuda":
            dtype = _cuda_half(dev)
        else:
            dtype = torch.float32
    config = random_config(spec, **shrink)
    torch.manual_seed(seed)
    with quiet(), torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@dataclass(frozen=True)
class ModelChoice:
    """Which model to run: ``kind`` is ``"hub"`` (``model_id``), ``"bundled"`` (SmolLM2-135M)
    or ``"random"`` (random weights of ``spec_name``); ``reason`` says why."""

    kind: str
    model_id: str | None
    spec_name: str | None
    device: str
    reason: str

    @property
    def real_weights(self) -> bool:
        """False for random weights: quality numbers (perplexity, samples) mean nothing then."""
        return self.kind != "random"


def choose_model(
    device: torch.device | str | None = None,
    hub: bool | None = None,
    model_id: str | None = None,
) -> ModelChoice:
    """Pick the model for this machine.

    - CUDA with hub access: ``model_id`` or :data:`DEFAULT_HUB_MODEL`;
    - CPU / MPS (or offline without CUDA): the bundled SmolLM2-135M (fits any laptop, no hub);
    - CUDA without hub access: random weights of :data:`DEFAULT_RANDOM_SPEC`.

    Args:
        hub: whether the hub is reachable; ``None`` asks :func:`kvlib.models.hub_reachable`
            (only on CUDA: a CPU run never touches the network).
    """
    from kvlib.device import get_device

    dev = torch.device(device) if device is not None else get_device()
    if dev.type != "cuda":
        return ModelChoice(
            "bundled",
            None,
            "smollm2-135m",
            str(dev),
            "no CUDA GPU: the bundled SmolLM2-135M runs offline on any CPU at small sizes",
        )
    if hub is None:
        from kvlib.models import hub_reachable

        hub = hub_reachable()
    if hub:
        chosen = model_id or DEFAULT_HUB_MODEL
        why = (
            "CUDA with hub access: an open ~2B instruct model whose multi-head KV cache "
            "(192 KiB/token in fp16) outgrows its weights past ~17k tokens"
            if chosen == DEFAULT_HUB_MODEL
            else "CUDA with hub access: the requested model"
        )
        return ModelChoice("hub", chosen, None, str(dev), why)
    return ModelChoice(
        "random",
        None,
        DEFAULT_RANDOM_SPEC,
        str(dev),
        "CUDA without hub access: random weights of SmolLM2-1.7B's architecture — real "
        "memory and speed, meaningless quality",
    )


def load_choice(choice: ModelChoice, **shrink: int | None) -> tuple[Any, Any]:
    """Load what :func:`choose_model` chose: ``(model, tokenizer)``.

    Random models get the bundled tokenizer (SmolLM2's 49152-token vocabulary, the same as
    :data:`DEFAULT_RANDOM_SPEC`'s). ``shrink`` goes to :func:`random_model`.
    """
    from kvlib.models import load_model

    device = torch.device(choice.device)
    if choice.kind == "bundled":
        return load_model(None, device=device)
    if choice.kind == "hub":
        dtype = None
        if device.type == "cuda":
            dtype = _cuda_half(device)
        return load_model(choice.model_id, device=device, dtype=dtype)
    if choice.kind == "random":
        _, tokenizer = load_model(None, device="cpu")
        model = random_model(choice.spec_name or DEFAULT_RANDOM_SPEC, device=device, **shrink)
        return model, tokenizer
    raise ValueError(f"choice.kind must be 'hub', 'bundled' or 'random' (got {choice.kind!r})")


def records(rows: Sequence[Any]) -> list[dict[str, Any]]:
    """Rows (dataclasses) as dicts, for ``pandas.DataFrame(records(rows))``."""
    return [asdict(r) for r in rows]
