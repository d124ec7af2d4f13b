"""Random keys and values fed to a cache, for what depends on shapes only (bytes held, the cost
of a decode step).

Imported by the scripts in ``benchmarks/`` (run as ``python benchmarks/bench_x.py``, which puts
this folder on ``sys.path``).
"""

from __future__ import annotations

from typing import Any

import torch

from kvlib.specs import kv_geometry


def fill(cache: Any, config: Any, tokens: int, chunk: int = 64) -> Any:
    """``cache`` after ``tokens`` random states ``(1, kv_heads, chunk, head_dim)`` at a time in
    every layer of ``config``'s model (seeded: the same states every call)."""
    layers, _, heads, d = kv_geometry(config)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, heads, tokens, d, generator=g)
    v = torch.randn(1, heads, tokens, d, generator=g)
    with torch.inference_mode():
        for start in range(0, tokens, chunk):
            for i in range(layers):
                cache.update(k[:, :, start : start + chunk], v[:, :, start : start + chunk], i)
    return cache
