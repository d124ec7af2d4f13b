"""The run environment every notebook sets up first: device, seeds, quiet output (notebook 00).

- :func:`get_device` picks ``cuda`` → ``mps`` → ``cpu`` (or ``$KVLIB_DEVICE``);
- :func:`seed_everything` seeds Python, NumPy and torch;
- :func:`quiet` silences transformers' logging, warnings and progress bars, which notebooks
  must not print (nbval compares stderr).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import random
import sys
import warnings
from collections.abc import Iterator

import numpy as np
import torch

DEVICE_ENV_VAR = "KVLIB_DEVICE"
_VALID = ("cuda", "mps", "cpu")


def get_device(prefer: str | None = None) -> torch.device:
    """Return the best available device: ``cuda`` → ``mps`` → ``cpu``.

    Args:
        prefer: force a device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``). When ``None``,
            the environment variable ``KVLIB_DEVICE`` is read, then the automatic order applies.

    Raises:
        ValueError: the requested device type is unknown or not available on this machine.
    """
    choice = prefer if prefer is not None else os.environ.get(DEVICE_ENV_VAR) or None
    if choice is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(str(choice).strip().lower())
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"unknown device {choice!r}; expected one of {', '.join(_VALID)} (e.g. 'cuda:0')"
        ) from exc
    if device.type not in _VALID:
        raise ValueError(f"unknown device {choice!r}; expected one of {', '.join(_VALID)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {choice!r} requested but CUDA is not available on this machine")
    if device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ValueError(
                f"device {choice!r} requested but MPS is not available on this machine"
            )
    return device


def seed_everything(seed: int = 0, deterministic: bool = False) -> int:
    """Seed Python, NumPy and torch (all devices); return the seed.

    Args:
        seed: a non-negative integer.
        deterministic: also ask torch for deterministic kernels where it has them
            (``warn_only``: ops without a deterministic version still run, with a warning).
            CPU results are already reproducible without it; it matters on CUDA.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int (got {seed!r})")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if torch.backends.cudnn.is_available():
            torch.backends.cudnn.benchmark = False
    return seed


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence transformers' progress bars, warnings and logging (nbval compares stderr)."""
    import transformers

    tlog = transformers.utils.logging
    old_level = tlog.get_verbosity()
    bars = tlog.is_progress_bar_enabled()
    hub_logger = logging.getLogger("huggingface_hub")
    hub_level = hub_logger.level
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    hub_logger.setLevel(logging.CRITICAL)
    # The GGUF converter calls tqdm.auto directly (not transformers' switchable bar); in a
    # notebook that is a widget on stdout, which redirecting stderr does not catch.
    gguf_utils = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf_utils is None:
        try:
            import transformers.modeling_gguf_pytorch_utils as gguf_utils
        except ImportError:  # gguf not installed: nothing to silence
            gguf_utils = None
    gguf_bar = getattr(gguf_utils, "tqdm", None)
    if gguf_bar is not None:
        gguf_utils.tqdm = functools.partial(gguf_bar, disable=True)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        tlog.set_verbosity(old_level)
        hub_logger.setLevel(hub_level)
        if bars:
            tlog.enable_progress_bar()
        if gguf_bar is not None:
            gguf_utils.tqdm = gguf_bar
