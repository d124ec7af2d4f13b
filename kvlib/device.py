"""Device selection and seeding, shared by every notebook (introduced in notebook 00)."""

from __future__ import annotations

import os
import random

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
