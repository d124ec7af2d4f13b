"""kvlib.eval.retrieval: the pass-key prompts, the Wilson interval, argument checks; one short run
of the bundled model (slow)."""

from __future__ import annotations

import random
import re

import pytest

from kvlib.eval import retrieval

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class CharTokenizer:
    """A stand-in tokenizer: one token per character, a plain chat template."""

    chat_template = "<role>content</role> (a stand-in)"

    def __call__(self, text, return_tensors=None):
        import torch

        ids = [ord(c) % 256 for c in text]

        class Out:
            input_ids = torch.tensor([ids]) if return_tensors == "pt" else ids

        return Out()

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(int(i)) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<a>"


CORPUS = "\n".join(f"Line {i} of the filler text, about the data model." for i in range(3000))


def test_wilson_interval_known_values():
    low, high = retrieval.wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = retrieval.wilson_interval(10, 10)
    assert high == 1.0 and low == pytest.approx(0.7225, abs=1e-4)
    low, high = retrieval.wilson_interval(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-4) and high == pytest.approx(0.7634, abs=1e-4)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((11, 10), ValueError, "successes must be <= trials"),
        ((0, 0), ValueError, "trials must be an int >= 1"),
        ((1.0, 3), TypeError, "successes must be an int"),
    ],
)
def test_wilson_interval_refuses_bad_counts(args, error, match):
    with pytest.raises(error, match=match):
        retrieval.wilson_interval(*args)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_single_key_prompt_states_needle_and_question(depth):
    tok = CharTokenizer()
    trial = retrieval.make_trial(tok, 2000, depth, rng=random.Random(3), corpus=CORPUS)
    text = tok.decode(trial.input_ids[0])
    assert re.fullmatch(r"[1-9]\d{4}", trial.answer)
    needle = text.index(f"The secret number is {trial.answer}.")
    body_start, body_end = text.index("Line "), text.rindex("What is the secret number?")
    assert body_start - 200 < needle if depth == 0 else True
    relative = (needle - body_start) / (body_end - body_start)
    assert abs(relative - depth) < 0.1
    assert text.startswith("<user>A secret number is hidden") and text.endswith(
        "The secret number is"
    )
    assert abs(trial.input_ids.shape[1] - 2000) < 100


def test_base_model_prompt_is_the_same_words_without_a_template():
    """A tokenizer without a chat template (a base model, as Gemma 3 270M's GGUF) gets the task,
    the text and the question as plain text; the needle sits where the templated one does."""

    class NoTemplate(CharTokenizer):
        chat_template = None

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("tokenizer.chat_template is not set")

    rng_args = {"rng": random.Random(3), "corpus": CORPUS}
    plain = NoTemplate().decode(
        retrieval.make_trial(NoTemplate(), 2000, 0.5, **rng_args).input_ids[0]
    )
    templated = CharTokenizer().decode(
        retrieval.make_trial(
            CharTokenizer(), 2000, 0.5, rng=random.Random(3), corpus=CORPUS
        ).input_ids[0]
    )
    assert plain.startswith("A secret number is hidden") and "<user>" not in plain
    assert plain.endswith("What is the secret number?\n\nThe secret number is")
    assert templated.removeprefix("<user>").replace("</user><a>", "\n\n").startswith(plain[:1000])


def test_multi_key_prompt_hides_several_and_asks_one():
    tok = CharTokenizer()
    trial = retrieval.make_trial(
        tok, 3000, 0.5, n_keys=4, key_digits=6, rng=random.Random(1), corpus=CORPUS
    )
    text = tok.decode(trial.input_ids[0])
    found = dict(re.findall(r"The secret number of the (\w+) door is (\d+)\. Remember it\.", text))
    assert len(found) == 4 and len(set(found.values())) == 4
    asked = re.search(r"What is the secret number of the (\w+) door\?", text).group(1)
    assert found[asked] == trial.answer and len(trial.answer) == 6


def test_same_seed_same_trials():
    tok = CharTokenizer()
    a = retrieval.make_trial(tok, 1000, 0.3, rng=random.Random(7), corpus=CORPUS)
    b = retrieval.make_trial(tok, 1000, 0.3, rng=random.Random(7), corpus=CORPUS)
    assert a.answer == b.answer and a.input_ids.equal(b.input_ids)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"context_tokens": 64}, ValueError, "context_tokens must be an int >= 128"),
        ({"depth": 1.5}, ValueError, r"depth must be in \[0, 1\]"),
        ({"key_digits": 0}, ValueError, "key_digits must be an int >= 1"),
        ({"key_digits": 21}, ValueError, "key_digits must be in 1..20"),
        ({"n_keys": 9}, ValueError, "n_keys must be in 1..8"),
        ({"depth": "middle"}, TypeError, "depth must be a number"),
    ],
)
def test_make_trial_refuses_bad_arguments(kwargs, error, match):
    args = {"context_tokens": 1000, "depth": 0.5, **kwargs}
    with pytest.raises(error, match=match):
        retrieval.make_trial(
            CharTokenizer(), args.pop("context_tokens"), args.pop("depth"), **args, corpus=CORPUS
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"context_tokens": 1024}, TypeError, "context_tokens must be a non-empty list"),
        ({"depths": []}, TypeError, "depths must be a non-empty list"),
        ({"trials": 0}, ValueError, "trials must be an int >= 1"),
        ({"cache_factory": 3}, TypeError, "cache_factory must be callable"),
    ],
)
def test_evaluate_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        retrieval.evaluate_retrieval(object(), CharTokenizer(), **kwargs)


def test_result_summary_and_breakdown():
    r = retrieval.RetrievalResult()
    for depth, ok in [(0.1, True), (0.1, False), (0.9, True)]:
        r.records.append({"depth": depth, "correct": ok, "prompt_tokens": 100})
    assert r.by("depth") == {0.1: (1, 2), 0.9: (1, 1)}
    s = r.summary()
    assert s["correct"] == 2 and s["trials"] == 3 and s["ci_low"] < 2 / 3 < s["ci_high"]


def test_the_bundled_model_retrieves_a_short_key(model, tokenizer):
    r = retrieval.evaluate_retrieval(
        model, tokenizer, context_tokens=(256,), depths=(0.2, 0.8), trials=2, seed=1
    )
    assert r.trials == 4 and r.correct >= 3, r.records


def test_one_shared_prefill_answers_as_generate_does(model, tokenizer):
    """compare_retrieval's shortcut (one prefill, each cache filled from it) gives every
    cache the answer its own generate() run gives."""
    from kvlib.caches import registry as cache_registry

    config = model.config
    caches = {
        "dynamic": None,
        "kvlib-int4": cache_registry.cache_factory("kvlib-int4", config),
        "snapkv": cache_registry.cache_factory("evict-snapkv", config, budget=96),
        "h2o-int4": cache_registry.cache_factory("evict-h2o-int4", config, budget=96),
        "tova": cache_registry.cache_factory("evict-tova", config, budget=64),
    }
    grid = {"context_tokens": (300,), "depths": (0.2, 0.7), "trials": 2, "seed": 3}
    shared = retrieval.compare_retrieval(model, tokenizer, caches, **grid)
    assert list(shared) == list(caches)
    for name, factory in caches.items():
        alone = retrieval.evaluate_retrieval(model, tokenizer, factory, **grid)
        for a, b in zip(shared[name].records, alone.records, strict=True):
            # the same answer; decoding stopped once its first number was complete
            assert b["output"].startswith(a["output"]) and a["correct"] == b["correct"], name
            assert retrieval._first_number(a["output"]) == retrieval._first_number(b["output"])
    assert shared["snapkv"].records[0]["nbytes"] < shared["dynamic"].records[0]["nbytes"]
    outputs = {tuple(r["output"] for r in res.records) for res in shared.values()}
    assert len(outputs) > 1 or all(r["correct"] for r in shared["dynamic"].records)


def test_stored_caches_answer_from_what_their_restore_gives(model, tokenizer):
    """A ``restored`` entry (storage between turns) runs beside the live caches: it gets the
    prompt's cache, its answers are decoded from what it returns, in order, and an error it
    raises reaches the caller unchanged."""
    from kvlib import compat

    calls = []

    def exact(cache):
        calls.append(cache.get_seq_length())
        return cache, compat.cache_nbytes(cache)

    def emptied(cache):  # forgets the prompt: the answer cannot be the key
        return compat.dynamic_cache(model.config), 0

    grid = {"context_tokens": (200,), "depths": (0.3, 0.8), "trials": 1, "seed": 4}
    out = retrieval.compare_retrieval(
        model, tokenizer, {"dynamic": None}, restored={"exact": exact, "empty": emptied}, **grid
    )
    assert list(out) == ["dynamic", "exact", "empty"]
    assert out["exact"].records == out["dynamic"].records and len(calls) == 2
    assert calls[0] == out["dynamic"].records[0]["prompt_tokens"]
    assert [r["nbytes"] for r in out["empty"].records] == [0, 0]
    assert not any(r["correct"] for r in out["empty"].records)

    def broken(cache):
        raise ValueError("stored cache is corrupted")

    with pytest.raises(ValueError, match="stored cache is corrupted"):
        retrieval.compare_retrieval(model, tokenizer, {}, restored={"broken": broken}, **grid)


def test_compare_refuses_a_cache_that_changes_the_prefill(model, tokenizer):
    from transformers.cache_utils import DynamicCache

    class Noisy(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            keys, values = super().update(k, v, layer_idx, *args, **kwargs)
            return keys * 1.001, values

    with pytest.raises(ValueError, match="'noisy' does not attend the prompt's own keys"):
        retrieval.compare_retrieval(
            model, tokenizer, {"noisy": lambda: Noisy(config=model.config)},
            context_tokens=(200,), depths=(0.5,), trials=1,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("caches", "kwargs", "error", "match"),
    [
        ({}, {}, ValueError, "nothing to compare"),
        ([None], {}, TypeError, "caches must be a mapping"),
        ({"a": 3}, {}, TypeError, "the factory of 'a' must be callable"),
        ({"a": None}, {"restored": {"a": lambda c: (c, 0)}}, ValueError, "names in both"),
        ({"a": None}, {"trials": 0}, ValueError, "trials must be an int >= 1"),
    ],
)
def test_compare_refuses_bad_arguments(caches, kwargs, error, match):
    with pytest.raises(error, match=match):
        retrieval.compare_retrieval(object(), CharTokenizer(), caches, **kwargs)


@pytest.mark.parametrize("n_keys", [1, 3])
def test_key_positions_point_at_the_asked_key(n_keys):
    tok = CharTokenizer()
    trial = retrieval.make_trial(tok, 1000, 0.4, n_keys=n_keys, rng=random.Random(5), corpus=CORPUS)
    spans = trial.key_positions(tok)
    ids = trial.input_ids[0]
    assert len(spans) == (2 if n_keys == 1 else 1)  # the single-key needle states it twice
    for span in spans:
        assert tok.decode(ids[span.start : span.stop]) == trial.answer
    text = tok.decode(ids)
    assert [s.start for s in spans] == [m.start() for m in re.finditer(trial.answer, text)]


def test_key_positions_on_the_bundled_tokenizer(tokenizer):
    trial = retrieval.make_trial(tokenizer, 512, 0.5, rng=random.Random(1))
    spans = trial.key_positions(tokenizer)
    ids = trial.input_ids[0]
    assert len(spans) == 2 and all(len(s) >= 1 for s in spans)
    assert all(tokenizer.decode(ids[s.start : s.stop]).strip() == trial.answer for s in spans)
    depth = spans[0].start / ids.shape[0]
    assert 0.3 < depth < 0.7


def test_key_positions_refuses_a_key_merged_with_its_neighbours():
    class Merging(CharTokenizer):
        def decode(self, ids, skip_special_tokens=False):
            return "x" + super().decode(ids)  # no token's text starts the key

    tok = CharTokenizer()
    trial = retrieval.make_trial(tok, 500, 0.5, rng=random.Random(2), corpus=CORPUS)
    with pytest.raises(ValueError, match="not a run of whole tokens"):
        trial.key_positions(Merging())
    with pytest.raises(TypeError, match="decode"):
        trial.key_positions(object())
