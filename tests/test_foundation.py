"""kvlib.device, kvlib.data and kvlib.models."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlib
from kvlib.data import load_eval_text, segment, split_text
from kvlib.device import get_device, seed_everything
from kvlib.models import (
    BUNDLED_GGUF,
    ModelNotAvailableError,
    bundled_model_path,
    describe,
    load_model,
)


def test_import_from_any_folder(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import kvlib; print(kvlib.__version__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == kvlib.__version__


def test_version_is_pyprojects() -> None:
    """One version: the release tag the Colab cells pin (v<version>) is kvlib's own."""
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert tomllib.loads(pyproject.read_text())["project"]["version"] == kvlib.__version__


def test_get_device_defaults_and_override(monkeypatch) -> None:
    monkeypatch.delenv("KVLIB_DEVICE", raising=False)
    assert get_device().type in {"cpu", "cuda", "mps"}
    assert get_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("KVLIB_DEVICE", "cpu")
    assert get_device() == torch.device("cpu")


@pytest.mark.parametrize("bad", ["tpu", "gpu0", "not a device"])
def test_get_device_rejects_unknown(bad) -> None:
    with pytest.raises(ValueError, match="unknown device"):
        get_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_get_device_cuda_unavailable() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        get_device("cuda")


def test_seed_everything_is_reproducible() -> None:
    seed_everything(123)
    a = torch.randn(5)
    seed_everything(123)
    assert torch.equal(a, torch.randn(5))
    with pytest.raises(ValueError, match="non-negative"):
        seed_everything(-1)


def test_eval_text_is_real_and_deterministic() -> None:
    text = load_eval_text()
    assert len(text) > 200_000
    assert text == load_eval_text()
    assert "assert" in text[:500]
    assert load_eval_text(max_chars=100) == text[:100]
    with pytest.raises(ValueError):
        load_eval_text(max_chars=0)


def test_split_text_disjoint() -> None:
    text = load_eval_text()
    calib, held_out = split_text(text, 0.5)
    assert calib and held_out
    assert len(calib) + len(held_out) <= len(text)
    assert held_out[:200] not in calib
    with pytest.raises(ValueError):
        split_text(text, 1.5)


def test_bundled_model_file_found() -> None:
    path = bundled_model_path()
    assert path.name == BUNDLED_GGUF and path.stat().st_size > 50_000_000


def test_bundled_model_architecture(model) -> None:
    info = describe(model)
    assert (info["num_layers"], info["num_heads"], info["num_kv_heads"], info["head_dim"]) == (
        30,
        9,
        3,
        64,
    )
    assert info["dtype"] == "float32"


def test_bundled_model_generates_sensible_text(model, tokenizer) -> None:
    ids = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text


def test_load_model_is_quiet(capfd) -> None:
    load_model(device="cpu")
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""


def test_unreachable_hub_id_names_offline_default(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailableError, match="bundled offline default"):
        load_model("some-org/definitely-not-a-model-kvlib")


def test_load_model_rejects_bad_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_model(dtype="int8")


def test_offline_models_by_name() -> None:
    from kvlib import results
    from kvlib.models import DEFAULT_MODEL, OFFLINE_MODELS, installed_models, offline_model

    assert offline_model(None) is offline_model(DEFAULT_MODEL) is OFFLINE_MODELS["smollm2-135m"]
    assert DEFAULT_MODEL == results.DEFAULT_MODEL == next(iter(OFFLINE_MODELS))
    assert offline_model(None).locate() == bundled_model_path()
    assert "smollm2-135m" in installed_models()
    with pytest.raises(ValueError, match="unknown offline model 'gemma-3'.*gemma-3-270m"):
        offline_model("gemma-3")
    with pytest.raises(TypeError, match="must be a str"):
        offline_model(3)


def test_a_missing_model_package_says_how_to_install_it(monkeypatch) -> None:
    """Without the chunk packages, loading the second model names the make target."""
    import importlib.util

    from kvlib import models

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("gemma3_270m") else real(name, *a),
    )
    with pytest.raises(ModelNotAvailableError, match="make gemma"):
        models.model_folder("gemma-3-270m")
    assert "gemma-3-270m" not in models.installed_models()


@pytest.mark.skipif(
    "gemma-3-270m" not in __import__("kvlib.models").models.installed_models(),
    reason="the second model is installed by `make gemma`",
)
def test_second_model_loads_offline_with_its_build() -> None:
    """Gemma 3 270M where it is installed: one KV head of 256 channels, 15 of 18 layers
    sliding (512 tokens), a base model (no chat template) that starts text with BOS."""
    model, tok = load_model("gemma-3-270m", device="cpu")
    info = describe(model)
    assert (info["num_layers"], info["num_heads"], info["num_kv_heads"], info["head_dim"]) == (
        18,
        4,
        1,
        256,
    )
    from kvlib.specs import get_spec, spec_from_config

    measured = spec_from_config(model.config)
    spec = get_spec("gemma-3-270m")  # the registry's entry is this model's build
    assert (measured.layer_kinds, measured.sliding_window) == (
        spec.layer_kinds,
        spec.sliding_window,
    )
    assert info["parameters"] == spec.num_params
    types = model.config.layer_types
    assert types.count("sliding_attention") == 15 and model.config.sliding_window == 512
    assert not tok.chat_template
    ids = tok("The capital of France is", return_tensors="pt")
    assert int(ids.input_ids[0, 0]) == tok.bos_token_id
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True)
    assert "France" in text or "Paris" in text


def test_quiet_silences_the_gguf_converters_own_progress_bar() -> None:
    """The first load converts the GGUF with tqdm.auto, which a notebook shows on stdout."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    from kvlib.device import quiet

    original = gguf_utils.tqdm
    with quiet():
        bar = gguf_utils.tqdm(range(3), desc="converting")
        assert bar.disable
        bar.close()
    assert gguf_utils.tqdm is original


def test_every_module_is_a_lazy_submodule() -> None:
    """``kvlib.<name>`` works for every module and package of kvlib, and ``kvlib.<package>.<name>``
    for every module of each package; nothing else is listed."""
    import importlib
    from pathlib import Path

    def children(package: Path) -> set[str]:
        modules = {p.stem for p in package.glob("*.py") if not p.stem.startswith("_")}
        return modules | {p.parent.name for p in package.glob("*/__init__.py")}

    root = Path(kvlib.__file__).parent
    assert set(kvlib._SUBMODULES) == children(root)
    packages = [(kvlib, root)]
    while packages:
        package, folder = packages.pop()
        names = children(folder)
        if package is not kvlib:
            assert set(package.__all__) == names, package.__name__
        for name in sorted(names):
            child = getattr(package, name)
            assert child.__name__ == f"{package.__name__}.{name}"
            assert child is importlib.import_module(child.__name__)
            if (folder / name / "__init__.py").exists():
                packages.append((child, folder / name))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        kvlib.caches.nothing  # noqa: B018


@given(
    ids=st.lists(st.integers(0, 50), min_size=1, max_size=60),
    tokens=st.integers(1, 12),
    bos=st.one_of(st.none(), st.integers(0, 50)),
)
def test_segments_tile_the_text_and_repeat_its_bos(ids, tokens, bos):
    """Consecutive segments are the text cut in runs of ``tokens``; where the text starts with
    BOS, each later segment starts with it in place of its first token, and only there."""
    n = len(ids) // tokens
    segs = [segment(ids, i, tokens, bos) for i in range(n)]
    for i, seg in enumerate(segs):
        original = ids[i * tokens : (i + 1) * tokens]
        assert len(seg) == tokens and seg[1:] == original[1:]
        starts = bos is not None and ids[0] == bos
        assert seg[0] == (bos if starts else original[0])
    with pytest.raises(ValueError, match="needs"):
        segment(ids, n, tokens, bos)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="segment index"):
            segment(ids, bad, tokens)


@given(st.integers(min_value=1, max_value=512), st.integers(min_value=-4, max_value=600))
def test_check_divisor_accepts_exactly_the_divisors(length, value):
    """kvlib.validate.check_divisor: a positive divisor comes back as it is; anything else is
    refused with the divisors that would do, and a non-int with a TypeError."""
    from kvlib.validate import check_divisor

    if value > 0 and length % value == 0:
        assert check_divisor(value, "group_size", length, f"axis of length {length}") == value
    else:
        with pytest.raises(
            ValueError,
            match=rf"group_size must divide axis of length {length} \(got {value}; accepted: 1",
        ):
            check_divisor(value, "group_size", length, f"axis of length {length}")
    with pytest.raises(TypeError, match="group_size must be an int"):
        check_divisor(float(max(value, 1)), "group_size", length, "it")
