"""The pass-key prompt: a number hidden in filler text at a chosen depth (notebook 11).

The filler is Python's documentation from :mod:`kvlib.data`'s corpus; the prompt states the task
before the text and asks for the key after it, ending with the start of the answer. An
instruction-tuned model gets it through its chat template; a base model, whose tokenizer has
none (Gemma 3 270M's GGUF carries no template), gets the same words as plain text.
:func:`make_trial` builds one such prompt (a :class:`Trial`); ``n_keys > 1`` gives the multi-key
variant, several keys for different named doors, one of them asked.
:mod:`kvlib.eval.retrieval` runs and scores many of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from kvlib.data import load_eval_text
from kvlib.validate import check_int, check_number

__all__ = ["DOORS", "Trial", "make_trial"]

#: Names of the doors in the multi-key variant ("the secret number of the red door is ...").
DOORS: tuple[str, ...] = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple")

_TASK = "A secret number is hidden in the text below. Find it and remember it; you will be asked for it."
_TASK_MULTI = (
    "Secret numbers for several doors are hidden in the text below. Remember them; you "
    "will be asked for one of them."
)


@dataclass(frozen=True)
class Trial:
    """One prompt of the task.

    Attributes:
        input_ids: ``(1, prompt_tokens)`` the prompt (chat-templated where the tokenizer has a
            template), ending with the start of the answer ("The secret number ... is").
        answer: the key asked for (digits).
        context_tokens: the length asked for; ``input_ids`` is within a few tokens of it.
        depth: where the (asked) key sits in the filler, 0 = start, 1 = end.
        key_digits: digits of every key.
        n_keys: keys hidden (1, or more for the multi-key variant).
    """

    input_ids: torch.Tensor
    answer: str
    context_tokens: int
    depth: float
    key_digits: int
    n_keys: int

    def key_positions(self, tokenizer: Any) -> list[range]:
        """Where the asked key sits in :attr:`input_ids`: one ``range`` of token positions per
        occurrence (the single-key needle states it twice), in order.

        A token counts when its decoded text, leading spaces removed, continues the key, so a
        key split into one token per digit (SmolLM2, Gemma) or into several digits per token is
        found alike.

        Raises:
            ValueError: the key is not a run of whole tokens anywhere in the prompt (a tokenizer
                that merged it with its neighbours).
        """
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer must have a decode method (got {type(tokenizer).__name__})")
        pieces = [tokenizer.decode([int(i)]) for i in self.input_ids[0]]
        spans = []
        for start, piece in enumerate(pieces):
            text = piece.lstrip()
            if not text or not self.answer.startswith(text):
                continue
            end = start + 1
            while (
                len(text) < len(self.answer)
                and end < len(pieces)
                and self.answer.startswith(text + pieces[end])
            ):
                text += pieces[end]
                end += 1
            if text == self.answer and not (spans and start < spans[-1].stop):
                spans.append(range(start, end))
        if not spans:
            raise ValueError(
                f"the key {self.answer!r} is not a run of whole tokens in the prompt: this "
                "tokenizer merges it with the text around it"
            )
        return spans


def _check_depth(depth: Any) -> float:
    depth = check_number(depth, "depth")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1] (got {depth})")
    return depth


def _filler(tokenizer: Any, n_tokens: int, rng: random.Random, corpus: str) -> list[str]:
    """About ``n_tokens`` tokens of corpus text from a seeded offset, as whole lines."""
    start = rng.randrange(0, max(1, len(corpus) - 12 * n_tokens - 1))
    start = corpus.find("\n", start) + 1
    ids = tokenizer(corpus[start : start + 8 * n_tokens + 400]).input_ids[:n_tokens]
    text = tokenizer.decode(ids)
    lines = text.split("\n")
    return lines[:-1] if len(lines) > 1 else lines


def make_trial(
    tokenizer: Any,
    context_tokens: int,
    depth: float,
    *,
    key_digits: int = 5,
    n_keys: int = 1,
    rng: random.Random | None = None,
    corpus: str | None = None,
) -> Trial:
    """One pass-key prompt of about ``context_tokens`` tokens.

    Args:
        tokenizer: the model's tokenizer. With a chat template the task and the text are one
            user message and the answer starts the assistant's turn; without one (a base
            model) the prompt is the same words as plain text.
        context_tokens: prompt length to aim for (``>= 128``).
        depth: position of the asked key in the filler, 0 (start) .. 1 (end).
        key_digits: digits per key, 1..20 (no leading zero).
        n_keys: keys hidden (1 .. ``len(DOORS)``); with more than one, each belongs to a named
            door, the others at random depths, and one door is asked.
        rng: the random source (keys, filler offset, other depths); default ``Random(0)``.
        corpus: filler text (default :func:`kvlib.data.load_eval_text`).

    Raises:
        TypeError / ValueError: arguments out of range, or not a transformers tokenizer.
    """
    context_tokens = check_int(context_tokens, "context_tokens", minimum=128)
    depth = _check_depth(depth)
    key_digits = check_int(key_digits, "key_digits", minimum=1)
    if key_digits > 20:
        raise ValueError(f"key_digits must be in 1..20 (got {key_digits})")
    n_keys = check_int(n_keys, "n_keys", minimum=1)
    if n_keys > len(DOORS):
        raise ValueError(f"n_keys must be in 1..{len(DOORS)} (got {n_keys})")
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise TypeError(
            f"tokenizer must be a transformers tokenizer (got {type(tokenizer).__name__})"
        )
    rng = random.Random(0) if rng is None else rng
    corpus = load_eval_text() if corpus is None else corpus

    def key() -> str:
        return str(rng.randint(1, 9)) + "".join(
            str(rng.randint(0, 9)) for _ in range(key_digits - 1)
        )

    keys = []
    while len(keys) < n_keys:
        k = key()
        if k not in keys:
            keys.append(k)
    if n_keys == 1:
        needles = [
            (depth, f"The secret number is {keys[0]}. Remember it. {keys[0]} is the secret number.")
        ]
        question = "What is the secret number?"
        prefix = "The secret number is"
    else:
        doors = rng.sample(DOORS, n_keys)
        depths = [depth] + [rng.random() for _ in range(n_keys - 1)]
        needles = [
            (d, f"The secret number of the {door} door is {k}. Remember it.")
            for d, door, k in zip(depths, doors, keys, strict=True)
        ]
        question = f"What is the secret number of the {doors[0]} door?"
        prefix = f"The secret number of the {doors[0]} door is"
    task = _TASK if n_keys == 1 else _TASK_MULTI

    def prompt(lines: list[str]) -> str:
        body = list(lines)
        for d, needle in sorted(needles, key=lambda x: -x[0]):
            body.insert(round(d * len(lines)), needle)
        content = f"{task}\n\n" + "\n".join(body) + f"\n\n{question}"
        if not getattr(tokenizer, "chat_template", None):
            return f"{content}\n\n{prefix}"
        messages = [{"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + prefix

    overhead = len(tokenizer(prompt([])).input_ids)
    lines = _filler(tokenizer, max(16, context_tokens - overhead), rng, corpus)
    ids = tokenizer(prompt(lines), return_tensors="pt").input_ids
    return Trial(ids, keys[0], context_tokens, depth, key_digits, n_keys)
