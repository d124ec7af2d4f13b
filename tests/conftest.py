"""Shared fixtures: the bundled model is loaded once per test session (it takes ~0.2 s once
kvlib has its converted copy, ~15 s the very first time on a machine)."""

from __future__ import annotations

import os

# Triton runs kernels on CPU tensors only in its interpreter, and only when this is set before
# triton is first imported (test collection imports transformers, which may import it through
# torch.compile): tests/test_kernels.py needs it. It changes nothing for code that uses no Triton.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

import kvlib


@pytest.fixture(scope="session")
def model_and_tokenizer():
    from kvlib.models import load_model

    model, tokenizer = load_model(device="cpu")
    return model, tokenizer


@pytest.fixture(scope="session")
def model(model_and_tokenizer):
    return model_and_tokenizer[0]


@pytest.fixture(scope="session")
def tokenizer(model_and_tokenizer):
    return model_and_tokenizer[1]


@pytest.fixture(scope="session")
def eval_ids(tokenizer) -> torch.Tensor:
    """(1, 2048) token ids of real English from the offline evaluation text."""
    text = kvlib.data.load_eval_text()
    ids = tokenizer(text[:40_000], return_tensors="pt").input_ids
    assert ids.shape[1] >= 2048
    return ids[:, :2048]


@pytest.fixture(autouse=True)
def _seed():
    kvlib.seed_everything(0)


_MODEL_FIXTURES = {"model", "tokenizer", "model_and_tokenizer", "eval_ids"}


def pytest_collection_modifyitems(config, items) -> None:
    """Tests that load or run the bundled model are marked ``slow``:
    ``pytest -m "not slow"`` runs the rest in well under a minute."""
    for item in items:
        if _MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a test module (``pytestmark = pytest.mark.usefixtures(...)``): on a
    shared 2-core machine two threads run tiny models ~6x slower (oversubscription)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
