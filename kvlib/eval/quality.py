"""Quality and speed of a KV cache, measured the way a reader cares about (notebook 04).

- :func:`perplexity` feeds the text in chunks, so that every chunk's attention really reads the
  cached (possibly quantized) past. With one big prefill a quantized cache is never read — the
  whole text attends to its own full-precision keys and values — and every method looks
  lossless.
- :func:`continuation_perplexity` scores a continuation from a cache that already holds the
  prefix (a restored conversation, e.g. a cache decoded by :mod:`kvlib.kvtc.codec`; notebook 06).
- :func:`generation_benchmark` times greedy decoding with a given cache: median decode
  tokens/s (prompt excluded), time to first token, bytes held by the cache, after a warm-up,
  with ``time.perf_counter`` (and ``torch.cuda.synchronize`` plus peak memory on a GPU).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvlib import compat
from kvlib.validate import check_int


def _check_token_ids(model: Any, input_ids: Any, min_len: int = 2) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a torch.Tensor of token ids (got {type(input_ids).__name__})"
        )
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must have shape (batch, seq_len) or (seq_len,) (got {tuple(input_ids.shape)})"
        )
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must hold integer token ids (got dtype {input_ids.dtype})")
    if input_ids.shape[1] < min_len:
        raise ValueError(
            f"input_ids must hold at least {min_len} tokens per row (got {input_ids.shape[1]})"
        )
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if input_ids.numel() and (
        int(input_ids.min()) < 0 or (vocab is not None and int(input_ids.max()) >= vocab)
    ):
        raise ValueError(
            f"input_ids must lie in [0, {vocab}) for this model "
            f"(got min {int(input_ids.min())}, max {int(input_ids.max())})"
        )
    return input_ids.long()


def _check_fresh_cache(cache: Any) -> None:
    if not hasattr(cache, "get_seq_length") or not hasattr(cache, "update"):
        raise TypeError(
            f"cache must be a transformers Cache (e.g. DynamicCache, QuantizedCache, "
            f"kvlib.caches.quantized.QuantizedKVCache) or None (got {type(cache).__name__})"
        )
    held = cache.get_seq_length()
    if held:
        raise ValueError(
            f"cache already holds {held} tokens: pass a fresh cache (or call cache.reset())"
        )


@torch.inference_mode()
def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    cache: Any = None,
    chunk_size: int = 64,
    *,
    prefilled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced next-token log-probabilities and argmax predictions, chunk by chunk.

    Args:
        input_ids: (batch, seq_len) token ids.
        cache: a fresh transformers Cache, or ``None`` for a fresh DynamicCache; with
            ``prefilled`` a Cache that already holds a prefix.
        chunk_size: tokens fed per forward pass; every chunk attends to the cached past.
        prefilled: ``input_ids`` continue the text held in ``cache``: positions follow the
            cached ones and every prediction reads the prefix (see
            :func:`continuation_perplexity`).

    Returns:
        ``(logprobs, argmax)``, both (batch, seq_len - 1): the log-probability the model gave
        to token ``t + 1`` and its most likely token, at every position ``t``. The last token
        is only a target, so the cache grows by ``seq_len - 1`` tokens.
    """
    input_ids = _check_token_ids(model, input_ids)
    chunk_size = check_int(chunk_size, "chunk_size", minimum=1)
    if prefilled:
        if not hasattr(cache, "get_seq_length") or not hasattr(cache, "update"):
            raise TypeError(
                "cache must be a transformers Cache holding the prefix (e.g. from "
                f"kvlib.compat.prefill_cache or a decoded cache) (got {type(cache).__name__})"
            )
    else:
        if cache is None:
            cache = compat.dynamic_cache(model.config)
        _check_fresh_cache(cache)
    input_ids = input_ids.to(model.device)
    seq_len = input_ids.shape[1]
    logprobs, argmax = [], []
    for start in range(0, seq_len - 1, chunk_size):
        chunk = input_ids[:, start : min(start + chunk_size, seq_len - 1)]
        targets = input_ids[:, start + 1 : start + 1 + chunk.shape[1]]
        logits = compat.forward(model, chunk, cache).logits.float()
        lp = torch.log_softmax(logits, dim=-1)
        logprobs.append(lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
        argmax.append(logits.argmax(dim=-1))
    return torch.cat(logprobs, dim=1), torch.cat(argmax, dim=1)


def perplexity(
    model: Any, input_ids: torch.Tensor, cache: Any = None, chunk_size: int = 64
) -> float:
    """Perplexity of ``model`` on ``input_ids`` with the text fed ``chunk_size`` tokens at a time.

    Args:
        model: a causal LM (transformers).
        input_ids: (batch, seq_len) or (seq_len,) token ids, seq_len >= 2.
        cache: a fresh transformers Cache that the chunks are written to and read from;
            ``None`` means a fresh DynamicCache (the full-precision reference).
        chunk_size: tokens per forward pass (64 is the project's protocol).

    Returns:
        ``exp(mean negative log-likelihood)`` over all batch rows and the seq_len - 1 predicted
        positions.

    Raises:
        TypeError / ValueError: not a tensor of token ids, ids outside the vocabulary, fewer
            than 2 tokens, ``chunk_size`` < 1, or a cache that already holds tokens.
    """
    logprobs, _ = token_logprobs(model, input_ids, cache=cache, chunk_size=chunk_size)
    return math.exp(-logprobs.double().mean().item())


def continuation_perplexity(
    model: Any, cache: Any, next_ids: torch.Tensor, chunk_size: int = 64
) -> float:
    """Perplexity of a continuation given a prefilled cache, feeding it in chunks.

    The cache holds the prefix; ``next_ids`` ``(batch, n)`` is fed ``chunk_size`` tokens at a
    time through :func:`token_logprobs` (``prefilled=True``), every step reading the cache,
    which grows by ``n - 1`` tokens: pass :func:`kvlib.compat.clone_cache` to keep the
    original. The tokens scored are ``next_ids[:, 1:]`` — each predicted from everything before
    it, so every prediction reads the prefix cache. (:func:`perplexity` scores a text from
    scratch; this one starts from a cache, which is what a restored conversation is.)

    Returns:
        ``exp(mean negative log-likelihood)`` over the ``batch · (n - 1)`` scored tokens.

    Raises:
        TypeError / ValueError: ``cache`` is not a transformers Cache, ``next_ids`` are not
            token ids of this model, ``n < 2``, or ``chunk_size < 1``.
    """
    logprobs, _ = token_logprobs(model, next_ids, cache, chunk_size, prefilled=True)
    return math.exp(-logprobs.double().mean().item())


@dataclass
class GenerationBenchmark:
    """Result of :func:`generation_benchmark` (times in seconds, medians over repeats)."""

    name: str
    prompt_tokens: int
    new_tokens: int
    repeats: int
    decode_tokens_per_s: float
    time_to_first_token_s: float
    cache_nbytes: int
    peak_memory_bytes: int | None = None
    decode_times_s: list[float] = field(default_factory=list)
    generated_ids: list[int] = field(default_factory=list)

    def slowdown_vs(self, other: GenerationBenchmark) -> float:
        """How many times slower this decode is than ``other``'s (>1 means slower)."""
        return other.decode_tokens_per_s / self.decode_tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _greedy(
    model: Any, prompt: torch.Tensor, cache: Any, new_tokens: int
) -> tuple[float, float, list[int]]:
    device = prompt.device
    _sync(device)
    t0 = time.perf_counter()
    out = compat.forward(model, prompt, cache, logits_to_keep=1)
    token = out.logits[:, -1:].argmax(-1)
    _sync(device)
    t1 = time.perf_counter()
    tokens = [int(token[0, 0])]
    for _ in range(new_tokens - 1):
        out = compat.forward(model, token, cache)
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(int(token[0, 0]))
    _sync(device)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, tokens


def generation_benchmark(
    model: Any,
    tokenizer: Any,
    cache_factory: Callable[[], Any],
    prompt_tokens: int = 1024,
    new_tokens: int = 128,
    repeats: int = 3,
    *,
    name: str = "",
    prompt_ids: torch.Tensor | None = None,
    warmup: bool = True,
) -> GenerationBenchmark:
    """Time greedy token-by-token decoding with the caches that ``cache_factory()`` makes.

    Each repeat builds a fresh cache, prefills ``prompt_tokens`` tokens of real text
    (``kvlib.data.load_eval_text()``, or ``prompt_ids``) in one forward pass — that pass also
    yields the first new token, so its time is the time to first token — then decodes
    ``new_tokens - 1`` more tokens one at a time. A short untimed run first warms up kernels
    and allocators.

    Timing is ``time.perf_counter`` with ``torch.cuda.synchronize`` around each phase, not
    ``torch.utils.benchmark.Timer`` (which the benchmarks use for stateless calls): one run
    yields two figures from one cache (the prefill's time to first token, then the decode
    steps that read what it wrote), each repeat needs a fresh cache, and the run's tokens and
    cache bytes are part of the result; Timer times one statement a number of times it picks
    itself, and its warm-up would be a whole extra full-length generation.

    Returns:
        a :class:`GenerationBenchmark`: median decode tokens/s (the ``new_tokens - 1`` decode
        steps only, prompt excluded), median time to first token, bytes the cache holds at the
        end, and on CUDA the peak allocated memory.
    """
    prompt_tokens = check_int(prompt_tokens, "prompt_tokens", minimum=1)
    new_tokens = check_int(new_tokens, "new_tokens", minimum=2)
    repeats = check_int(repeats, "repeats", minimum=1)
    if not callable(cache_factory):
        raise TypeError(
            f"cache_factory must be a callable returning a fresh cache (got {cache_factory!r})"
        )
    if prompt_ids is None:
        from kvlib.data import load_eval_text

        text = load_eval_text()
        ids = tokenizer(text[: prompt_tokens * 8 + 1000], return_tensors="pt").input_ids
        if ids.shape[1] < prompt_tokens:
            raise ValueError(f"the eval text gives only {ids.shape[1]} tokens (< {prompt_tokens})")
        prompt_ids = ids[:, :prompt_tokens]
    prompt = _check_token_ids(model, prompt_ids, min_len=1)[:, :prompt_tokens].to(model.device)
    device = prompt.device

    if warmup:
        _greedy(model, prompt[:, : min(prompt_tokens, 256)], cache_factory(), 4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ttfts, decodes, cache, tokens = [], [], None, []
    for _ in range(repeats):
        cache = cache_factory()
        _check_fresh_cache(cache)
        ttft, decode, tokens = _greedy(model, prompt, cache, new_tokens)
        ttfts.append(ttft)
        decodes.append(decode)
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    median_decode = statistics.median(decodes)
    return GenerationBenchmark(
        name=name,
        prompt_tokens=int(prompt.shape[1]),
        new_tokens=new_tokens,
        repeats=repeats,
        decode_tokens_per_s=(new_tokens - 1) / median_decode,
        time_to_first_token_s=statistics.median(ttfts),
        cache_nbytes=compat.cache_nbytes(cache),
        peak_memory_bytes=peak,
        decode_times_s=decodes,
        generated_ids=tokens,
    )
