"""What fits in a memory budget: longest context and largest batch per KV cache (notebook 08).

:func:`what_fits` predicts both with :func:`kvlib.memory.max_context` /
:func:`kvlib.memory.max_batch` (capped at the model's maximum context) and, on CUDA, confirms
them by really filling a cache and running a decode step (:func:`fill_and_step`) under an
emulated budget (:func:`memory_limit`, ``torch.cuda.set_per_process_memory_fraction``).
Out-of-memory is caught (:func:`is_oom`) and reported as "does not fit"; memory is released
(:func:`release_memory`) and the search (:func:`search_max`) continues, so it never crashes.
Without CUDA, :func:`simulated_budget_runner` runs the same code path against an accounting
budget.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvlib import compat
from kvlib import memory as kvmem
from kvlib.caches.registry import cache_factory, cache_info, check_names
from kvlib.specs import ModelSpec, get_spec, kv_geometry, spec_from_config
from kvlib.validate import check_int

__all__ = [
    "FitRow",
    "fill_and_step",
    "fill_or_none",
    "is_oom",
    "memory_limit",
    "release_memory",
    "search_max",
    "simulated_budget_runner",
    "what_fits",
]


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
    layers, _, kv_heads, head_dim = kv_geometry(model.config)
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
    upper: int | None = None,
) -> tuple[int, int]:
    """Largest ``n`` (a multiple of ``step``, at most ``upper``) with ``fits(n)``, starting
    near ``guess``.

    Probes ``guess`` first, then halves (until something fits) or grows by 1.5× (at most
    ``max_probes`` times, never past ``upper``) until the answer is bracketed, then bisects
    with at most ``max_probes`` more probes. ``fits`` is assumed monotone (if ``n`` fits,
    every smaller ``n`` does).

    Args:
        upper: largest ``n`` worth probing (e.g. the model's maximum context); ``None``: no cap.

    Returns:
        ``(n, resolution)``: the largest multiple of ``step`` confirmed to fit (0 when not even
        ``step`` fits, or ``upper < step``) and the gap to the smallest confirmed failure above
        it (``0`` if no failure was seen within the probes: ``n`` is then only a lower bound,
        or ``upper`` itself).
    """
    step = max(1, int(step))
    top = None if upper is None else check_int(upper, "upper", minimum=0) // step * step
    if top is not None and top < step:
        return 0, 0
    n = max(step, int(guess) // step * step)
    if top is not None:
        n = min(n, top)
    lo, hi = 0, None  # lo fits (0 trivially), hi does not
    probes = 0
    while True:  # bracket the answer: halving always ends (at ``step``), growing is capped
        if fits(n):
            lo = n
            if hi is not None or n == top:
                break
            probes += 1
            if probes >= max_probes:
                break
            n = max(n + step, int(n * 1.5) // step * step)
            if top is not None:
                n = min(n, top)
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


# -- what fits --------------------------------------------------------------------------------


@dataclass
class FitRow:
    """Longest context (batch 1) and largest batch (at ``batch_context``) for one cache.

    ``measured_*`` are ``None`` where nothing was run (not on CUDA); ``0`` means "does not fit"
    (not even the smallest probe). ``*_resolution`` is the gap to the smallest measured
    failure (0: no failure seen, the measured value is a lower bound, or the model's maximum
    context). ``note`` says when the context is capped at the model's maximum, or not limited
    by memory at all (sliding window).
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


def _spec_of(model_or_spec: Any) -> ModelSpec:
    if isinstance(model_or_spec, ModelSpec):
        return model_or_spec
    if isinstance(model_or_spec, str):
        return get_spec(model_or_spec)
    config = getattr(model_or_spec, "config", None)
    if config is None:
        raise TypeError(
            "model_or_spec must be a model, a kvlib.specs.ModelSpec or a registry name "
            f"(got {type(model_or_spec).__name__})"
        )
    n_params = sum(p.numel() for p in model_or_spec.parameters())
    return spec_from_config(config, num_params=n_params)


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
    each quantized cache's full-precision window
    (:attr:`kvlib.caches.registry.CacheInfo.residual_tokens`) and the activations; the
    measurement includes them. The longest context is capped at the model's
    maximum (``max_position_embeddings`` of its config or spec; the row's ``note`` says so):
    memory may allow more tokens than the model was built to attend over.

    Measured (``measure=True``, default: when the model is on CUDA): under
    :func:`memory_limit` ``(budget_bytes)``, :func:`search_max` probes contexts in steps of
    ``context_step`` (up to the model's maximum) and batch sizes, each probe calling
    ``runner(cache_name, context, batch)`` (default :func:`fill_and_step` with the model). A
    probe that raises out-of-memory counts as "does not fit"; memory is released and the
    search goes on, so this never crashes.

    Args:
        model_or_spec: a loaded model (required for measuring), a ModelSpec or a registry name.
        caches: names from :data:`kvlib.caches.registry.CACHE_NAMES`; the reference for a
            16-bit model is ``"dynamic-fp16"`` / ``"dynamic-bf16"``
            (:func:`kvlib.caches.registry.reference_name`).
        dtype_bits: the model's dtype width: the reference cache's bits per value, and the
            weights' unless ``weight_bits`` says otherwise.
        runner: replaces the real probe (tests: a fake that raises ``torch.OutOfMemoryError``).
            With a runner, measuring needs no CUDA and no budget emulation.

    Returns:
        One :class:`FitRow` per cache.
    """
    names = check_names(caches)
    spec = _spec_of(model_or_spec)
    wbits = dtype_bits if weight_bits is None else weight_bits
    model = None if isinstance(model_or_spec, ModelSpec | str) else model_or_spec
    if device is None:
        device = next(model.parameters()).device if model is not None else torch.device("cpu")
    device = torch.device(device)
    if measure is None:
        measure = runner is not None or (model is not None and device.type == "cuda")
    emulate = runner is None  # the real probe runs under the emulated budget
    if measure and runner is None:
        runner = _real_runner(model, device)
    max_ctx = spec.max_position_embeddings
    rows = []
    for name in names:
        row, notes = _predict(
            spec, name, budget_bytes, batch_context, dtype_bits, wbits, overhead_bytes
        )
        if measure:
            assert runner is not None
            with _budget(budget_bytes, device, emulate=emulate):
                _measure(row, notes, runner, device, context_step, max_probes, max_ctx)
        row.note = "; ".join(notes)
        rows.append(row)
    return rows


def _predict(
    spec: ModelSpec,
    name: str,
    budget_bytes: float,
    batch_context: int,
    dtype_bits: int,
    wbits: int,
    overhead_bytes: float,
) -> tuple[FitRow, list[str]]:
    """The predicted row of cache ``name`` (context capped at the model's maximum) and its notes."""
    max_ctx = spec.max_position_embeddings
    info = cache_info(name)
    bits = info.cache_bits(dtype_bits)
    group = info.group_size if bits < 16 else None
    common = dict(bits=bits, weight_bits=wbits, overhead_bytes=overhead_bytes, group_size=group)
    memory_ctx = kvmem.max_context(spec, budget_bytes, batch_size=1, **common)
    p_ctx = memory_ctx if max_ctx is None else min(memory_ctx, max_ctx)
    p_batch = kvmem.max_batch(spec, budget_bytes, batch_context, **common)
    row = FitRow(name, bits, int(budget_bytes), batch_context, p_ctx, p_batch)
    notes = []
    if memory_ctx > p_ctx:
        notes.append(f"context capped at the model's maximum ({max_ctx} tokens)")
    return row, notes


def _real_runner(model: Any, device: torch.device) -> Callable[[str, int, int], Any]:
    """The default :func:`what_fits` probe: :func:`fill_and_step` with ``model`` (CUDA only)."""
    if model is None:
        raise ValueError("measuring what fits needs a loaded model (or a runner)")
    if device.type != "cuda":
        raise ValueError(f"measuring what fits needs CUDA (got {device}); pass a runner")

    def runner(name: str, context: int, batch: int) -> Any:
        return fill_and_step(model, cache_factory(name, model.config), context, batch)

    return runner


def _measure(
    row: FitRow,
    notes: list[str],
    runner: Callable[[str, int, int], Any],
    device: torch.device,
    context_step: int,
    max_probes: int,
    max_ctx: int | None,
) -> None:
    """Search the longest context (batch 1) and the largest batch of ``row``'s cache, in place."""
    probe_ctx = _probe_for(runner, row.cache, batch=1)
    probe_batch = _probe_for(runner, row.cache, context=row.batch_context)
    if row.predicted_max_context >= kvmem.UNBOUNDED:
        notes.append("memory does not limit the context (sliding window)")
    else:
        row.measured_max_context, row.context_resolution = search_max(
            lambda n: _fits(probe_ctx, n, device),
            max(row.predicted_max_context, context_step),
            step=context_step,
            max_probes=max_probes,
            upper=max_ctx,
        )
    row.measured_max_batch, row.batch_resolution = search_max(
        lambda n: _fits(probe_batch, n, device),
        max(row.predicted_max_batch, 1),
        step=1,
        max_probes=max_probes,
    )


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
