"""Retrieval quality: a seeded pass-key task, scored with a confidence interval (notebook 11).

Perplexity is dominated by local context, so it hides the failure that matters most for long
prompts: losing one fact far back. This task measures exactly that. A number (the *pass key*,
"the secret number" in the prompt: the filler is Python's documentation, where ``pass`` is a
keyword, and asked for "the pass key" the bundled model explains the statement) is hidden in
filler text from :mod:`kvlib.data`'s corpus at a chosen depth; the chat-templated prompt states
the task before the text and asks for the key after it, ending with the start of the answer; the
model answers by greedy decoding, and a trial counts as correct when the first number in the
answer is the key.

* :func:`~kvlib.eval.passkey.make_trial` (in :mod:`kvlib.eval.passkey`, importable from here)
  builds one prompt (``n_keys > 1``: the multi-key variant, several keys for different named
  doors, one of them asked);
* :func:`evaluate_retrieval` runs many seeded trials over context lengths, depths and key
  lengths with a given cache, and returns a :class:`RetrievalResult`: accuracy with a Wilson
  interval (:func:`wilson_interval`), per-trial records, breakdowns.

The same seed gives the same trials (keys, depths, filler offsets) on every machine, so two
caches are compared on identical prompts.
"""

from __future__ import annotations

import math
import random
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from kvlib import compat
from kvlib.caches.eviction.cache import EvictionLayer, capture_queries, recorded_queries
from kvlib.data import load_eval_text
from kvlib.eval.passkey import Trial, _check_depth, make_trial
from kvlib.validate import check_int, check_number

__all__ = [
    "RetrievalResult",
    "Trial",
    "compare_retrieval",
    "evaluate_retrieval",
    "make_trial",
    "wilson_interval",
]


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95 % for ``z = 1.96``).

    Unlike the normal approximation it stays inside [0, 1] and is sensible at 0/n and n/n.

    Raises:
        TypeError / ValueError: not ints, ``trials < 1`` or ``successes`` outside
            ``0..trials``, ``z <= 0``.
    """
    successes = check_int(successes, "successes", minimum=0)
    trials = check_int(trials, "trials", minimum=1)
    z = check_number(z, "z", positive=True)
    if successes > trials:
        raise ValueError(f"successes must be <= trials (got {successes} > {trials})")
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class RetrievalResult:
    """Outcome of :func:`evaluate_retrieval`.

    Attributes:
        records: one dict per trial: ``context_tokens``, ``prompt_tokens``, ``depth``,
            ``key_digits``, ``n_keys``, ``answer``, ``output`` (the decoded answer),
            ``correct``.
        z: the interval's normal quantile (1.96: 95 %).
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    z: float = 1.96

    @property
    def trials(self) -> int:
        return len(self.records)

    @property
    def correct(self) -> int:
        return sum(r["correct"] for r in self.records)

    @property
    def accuracy(self) -> float:
        """Fraction correct (``nan`` without trials)."""
        return self.correct / self.trials if self.trials else math.nan

    def interval(self) -> tuple[float, float]:
        """Wilson interval of :attr:`accuracy`."""
        return wilson_interval(self.correct, self.trials, self.z)

    def by(self, key: str) -> dict[Any, tuple[int, int]]:
        """``{value: (correct, trials)}`` grouped by a record field (e.g. ``"depth"``)."""
        out: dict[Any, tuple[int, int]] = {}
        for r in self.records:
            c, n = out.get(r[key], (0, 0))
            out[r[key]] = (c + bool(r["correct"]), n + 1)
        return dict(sorted(out.items()))

    def summary(self) -> dict[str, Any]:
        """Accuracy, interval, counts and the mean prompt length, as plain numbers."""
        low, high = self.interval() if self.trials else (math.nan, math.nan)
        tokens = [r["prompt_tokens"] for r in self.records]
        return {
            "accuracy": self.accuracy,
            "ci_low": low,
            "ci_high": high,
            "correct": self.correct,
            "trials": self.trials,
            "mean_prompt_tokens": sum(tokens) / len(tokens) if tokens else math.nan,
        }


#: The first number of an answer is complete once a non-digit follows it: decoding stops there.
_ANSWERED = re.compile(r"\d\D")


def _first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def _check_values(values: Any, name: str, check: Callable[[Any], Any]) -> list[Any]:
    if isinstance(values, str) or not isinstance(values, Sequence) or not values:
        raise TypeError(f"{name} must be a non-empty list (got {values!r})")
    return [check(v) for v in values]


def _check_grid(
    context_tokens: Sequence[int],
    depths: Sequence[float],
    key_digits: Sequence[int],
    trials: int,
    seed: int,
) -> tuple[list[int], list[float], list[int], int, int]:
    contexts = _check_values(
        context_tokens, "context_tokens", lambda v: check_int(v, "context_tokens", minimum=128)
    )
    depth_list = _check_values(depths, "depths", _check_depth)
    digit_list = _check_values(
        key_digits, "key_digits", lambda v: check_int(v, "key_digits", minimum=1)
    )
    return (
        contexts,
        depth_list,
        digit_list,
        check_int(trials, "trials", minimum=1),
        check_int(seed, "seed"),
    )


def _trials(
    tokenizer: Any,
    grid: tuple[list[int], list[float], list[int], int, int],
    n_keys: int,
) -> Iterator[Trial]:
    """The seeded trials of a grid, in a fixed order (the same seed: the same prompts)."""
    contexts, depth_list, digit_list, trials, seed = grid
    rng = random.Random(seed)
    corpus = load_eval_text()
    for ctx in contexts:
        for digits in digit_list:
            for depth in depth_list:
                for _ in range(trials):
                    yield make_trial(
                        tokenizer, ctx, depth, key_digits=digits, n_keys=n_keys, rng=rng,
                        corpus=corpus,
                    )  # fmt: skip


def _record(trial: Trial, text: str, **extra: Any) -> dict[str, Any]:
    return {
        "context_tokens": trial.context_tokens,
        "prompt_tokens": int(trial.input_ids.shape[1]),
        "depth": trial.depth,
        "key_digits": trial.key_digits,
        "n_keys": trial.n_keys,
        "answer": trial.answer,
        "output": text,
        "correct": _first_number(text) == trial.answer,
        **extra,
    }


def evaluate_retrieval(
    model: Any,
    tokenizer: Any,
    cache_factory: Callable[[], Any] | None = None,
    *,
    context_tokens: Sequence[int] = (1024,),
    depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9),
    key_digits: Sequence[int] = (5,),
    trials: int = 4,
    n_keys: int = 1,
    seed: int = 0,
) -> RetrievalResult:
    """Accuracy of ``model`` on seeded pass-key trials, with a fresh cache per trial.

    Every combination of context length, depth and key length is tried ``trials`` times with
    different keys and filler (``trials * len(context_tokens) * len(depths) *
    len(key_digits)`` prompts in all), by greedy decoding of ``key_digits + 4`` tokens
    (``model.generate``).

    Args:
        cache_factory: zero-argument callable returning a fresh transformers cache (e.g.
            ``kvlib.caches.registry.cache_factory(name, model.config)``); ``None``: the model's
            own DynamicCache. Eviction caches get their queries (:func:`kvlib.caches.eviction.cache.capture_queries`).
        context_tokens, depths, key_digits: the grid (non-empty lists).
        trials: prompts per grid point (``>= 1``).
        n_keys: keys hidden per prompt (see :func:`make_trial`).
        seed: the trials' seed; the same seed gives the same prompts.

    Raises:
        TypeError / ValueError: bad grid values, ``trials < 1``, or ``cache_factory`` not
            callable.
    """
    grid = _check_grid(context_tokens, depths, key_digits, trials, seed)
    if cache_factory is not None and not callable(cache_factory):
        raise TypeError(
            f"cache_factory must be callable or None (got {type(cache_factory).__name__})"
        )
    result = RetrievalResult()
    with capture_queries(model):
        for trial in _trials(tokenizer, grid, n_keys):
            cache = cache_factory() if cache_factory is not None else None
            out = compat.generate(
                model,
                trial.input_ids,
                cache=cache,
                max_new_tokens=trial.key_digits + 4,
                do_sample=False,
            )
            text = tokenizer.decode(out[0, trial.input_ids.shape[1] :], skip_special_tokens=True)
            result.records.append(_record(trial, text))
    return result


def _eos_ids(model: Any) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])}


def _fill(cache: Any, name: str, states: list, queries: dict) -> None:
    """Give ``cache`` the prompt's keys and values layer by layer, as its prefill pass would,
    and check that it returns them unchanged (what makes one shared prefill exact)."""
    for i, (k, v) in enumerate(states):
        layer = cache.layers[i] if hasattr(cache, "layers") and i < len(cache.layers) else None
        if isinstance(layer, EvictionLayer) and layer.needs_queries:
            layer.set_queries(*queries[i])
        keys, values = cache.update(k, v, i)
        if not (torch.equal(keys, k) and torch.equal(values, v)):
            raise ValueError(
                f"cache {name!r} does not attend the prompt's own keys and values in its "
                "prefill pass, so a shared prefill would change its result; use "
                "evaluate_retrieval for it"
            )


def _check_caches(
    caches: Mapping[str, Callable[[], Any] | None],
    restored: dict[str, Callable[[Any], tuple[Any, int]]],
) -> None:
    """Reject a non-mapping, a factory that is not callable, nothing to compare or a name in
    both mappings."""
    if not isinstance(caches, Mapping):
        raise TypeError(
            f"caches must be a mapping of name to factory (got {type(caches).__name__})"
        )
    for name, f in [*caches.items(), *restored.items()]:
        if f is not None and not callable(f):
            raise TypeError(f"the factory of {name!r} must be callable (got {type(f).__name__})")
    if not caches and not restored:
        raise ValueError("caches and restored are both empty: nothing to compare")
    if set(caches) & set(restored):
        raise ValueError(
            f"names in both caches and restored: {sorted(set(caches) & set(restored))}"
        )


def _decode_answer(
    model: Any, tokenizer: Any, cache: Any, first: int, max_tokens: int, eos: set[int]
) -> str:
    """Greedy answer from ``first`` on, each step a ``(1, 1)`` token through ``cache``, until
    ``max_tokens`` tokens, an end-of-sequence token or a complete first number; its text."""
    tokens = [first]
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    while len(tokens) < max_tokens and tokens[-1] not in eos and not _ANSWERED.search(text):
        step = compat.forward(model, torch.tensor([[tokens[-1]]]), cache)
        tokens.append(int(step.logits[0, -1].argmax()))
        text = tokenizer.decode(tokens, skip_special_tokens=True)
    return text


def compare_retrieval(
    model: Any,
    tokenizer: Any,
    caches: Mapping[str, Callable[[], Any] | None],
    *,
    restored: Mapping[str, Callable[[Any], tuple[Any, int]]] | None = None,
    context_tokens: Sequence[int] = (1024,),
    depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9),
    key_digits: Sequence[int] = (5,),
    trials: int = 4,
    n_keys: int = 1,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, RetrievalResult]:
    """:func:`evaluate_retrieval` for many caches on the same trials, with one prefill per
    prompt.

    In its prefill pass every cache here returns the prompt's own keys and values (the tokens
    of one pass attend to each other in full, whatever is stored afterwards; kvlib's
    quantized and eviction caches and DynamicCache all do), so the prefill's logits, keys,
    values and queries are the same for every cache. They are computed once, with a
    DynamicCache that stores every layer in full (on a model with sliding-window layers too:
    their prefill pass sees the whole prompt under the sliding mask, and a cache filled with it
    keeps its window, as it would after its own prefill); each cache is then filled from them
    layer by layer (an eviction cache gets each layer's queries first,
    :func:`kvlib.caches.eviction.cache.recorded_queries`) and decodes its answer greedily on its
    own. A cache that returns anything else from its prefill is
    refused with a ``ValueError``, so the shortcut never changes a result (tests check it
    against :func:`evaluate_retrieval`). Decoding stops as soon as the answer's first number is
    complete (a non-digit follows it), which is all a trial is scored on, so ``output`` may be
    a prefix of :func:`evaluate_retrieval`'s.

    Args:
        caches: ``{name: cache factory}`` (``None``: a DynamicCache).
        restored: ``{name: restore}`` for storage between turns (e.g. a KVTC codec):
            ``restore(prompt_cache)`` gets the prompt's DynamicCache, as the model's own cache
            holds it after the prefill (a sliding layer: its window), and returns the cache the
            answer is decoded from and the bytes it was stored in. Restores run in one worker
            thread while the live caches are filled (a codec's entropy coder releases the GIL),
            so they must not share state with the caches; the results are the same.
        progress: a tqdm bar over the prompts (on stderr).
        Other arguments: as :func:`evaluate_retrieval`.

    Returns:
        ``{name: RetrievalResult}`` in the order given (``caches``, then ``restored``); each
        record also holds ``nbytes``, the cache's bytes after the prefill (or the stored
        bytes).

    Raises:
        TypeError / ValueError: as :func:`evaluate_retrieval`; no caches; a name in both
            mappings; a cache whose prefill does not return the prompt's own states.
    """
    grid = _check_grid(context_tokens, depths, key_digits, trials, seed)
    restored = dict(restored or {})
    _check_caches(caches, restored)
    results = {name: RetrievalResult() for name in [*caches, *restored]}
    eos = _eos_ids(model)
    trials_list = list(_trials(tokenizer, grid, n_keys))
    # One worker stores and restores while this thread fills the live caches: a codec's work is
    # mostly its entropy coder (lzma), which releases the GIL, so the two overlap on two cores.
    # Each result is what the sequential order gives; only the wall-clock time changes.
    with capture_queries(model), ThreadPoolExecutor(max_workers=1) as worker:
        for trial in tqdm(trials_list, desc="prompts", disable=not progress, file=sys.stderr):
            with recorded_queries(model) as queries:
                # every layer stored in full: a sliding-window layer's prefill also attends the
                # whole prompt (under the model's sliding mask), and each cache keeps its window
                out = compat.forward(model, trial.input_ids, compat.dynamic_cache())
            prompt_cache = compat.output_cache(out)
            states = compat.cache_tensors(prompt_cache)
            first = int(out.logits[0, -1].argmax())
            stored: dict[str, Future[tuple[Any, int]]] = {}
            for name, restore in restored.items():
                # stored as the model's own cache holds it: each sliding layer's window
                cache = compat.dynamic_cache(model.config)
                _fill(cache, name, states, queries)
                stored[name] = worker.submit(restore, cache)
            for name in results:
                if name in caches:
                    factory = caches[name]
                    cache = factory() if factory is not None else compat.dynamic_cache(model.config)
                    _fill(cache, name, states, queries)
                    nbytes = compat.cache_nbytes(cache)
                else:
                    cache, nbytes = stored[name].result()
                text = _decode_answer(model, tokenizer, cache, first, trial.key_digits + 4, eos)
                results[name].records.append(_record(trial, text, nbytes=int(nbytes)))
    return results
