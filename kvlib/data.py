"""Offline evaluation text (introduced in notebook 00).

Every Python ships the text of its own help topics in :mod:`pydoc_data.topics`: hundreds of KB of
real technical English. It needs no download, so perplexity numbers in this series are
reproducible on any machine, offline.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def load_eval_text(max_chars: int | None = None) -> str:
    """Return the standard library's help-topic text, in a fixed (sorted-key) order.

    Args:
        max_chars: if given, cut the text to at most this many characters.

    Returns:
        One string of paragraphs separated by blank lines; identical on every run.
    """
    if max_chars is not None and (
        isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars <= 0
    ):
        raise ValueError(f"max_chars must be a positive int or None (got {max_chars!r})")
    from pydoc_data.topics import topics

    parts = []
    for key in sorted(topics):
        body = re.sub(r"[ \t]+\n", "\n", topics[key]).strip()
        body = re.sub(r"\n{3,}", "\n\n", body)
        if body:
            parts.append(body)
    text = "\n\n".join(parts)
    return text if max_chars is None else text[:max_chars]


def split_text(text: str, fraction: float = 0.5) -> tuple[str, str]:
    """Split ``text`` at a paragraph boundary near ``fraction`` of its length.

    Used to keep calibration text (first part) apart from evaluation text (second part).
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1) (got {fraction!r})")
    if not text:
        raise ValueError("text is empty")
    cut = int(len(text) * fraction)
    boundary = text.find("\n\n", cut)
    if boundary == -1:
        boundary = cut
    return text[:boundary], text[boundary:].lstrip("\n")


def segment(ids: Sequence[int], i: int, tokens: int, bos: int | None = None) -> list[int]:
    """The ``i``-th run of ``tokens`` token ids of ``ids``, for perplexity on consecutive
    segments of one text. When ``ids`` starts with the BOS token ``bos`` (Gemma's tokenizer adds
    one; SmolLM2's adds none), a later segment starts with it too, in place of its first token,
    as a document does.

    Raises:
        ValueError: ``i`` < 0, ``tokens`` < 1, or ``ids`` too short for the segment.
    """
    if isinstance(i, bool) or not isinstance(i, int) or i < 0:
        raise ValueError(f"segment index must be an int >= 0 (got {i!r})")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1 (got {tokens!r})")
    if len(ids) < (i + 1) * tokens:
        raise ValueError(
            f"segment {i} of {tokens} tokens needs {(i + 1) * tokens} ids (got {len(ids)})"
        )
    seg = [int(t) for t in ids[i * tokens : (i + 1) * tokens]]
    if i > 0 and bos is not None and int(ids[0]) == bos:
        seg[0] = bos
    return seg
