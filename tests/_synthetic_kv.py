"""Synthetic keys/values for the PCA and codec tests (no model needed)."""

from __future__ import annotations

import torch


def correlated_layers(
    batch: int, seq: int, layers: int = 2, heads: int = 2, hd: int = 8, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values)``, each ``(batch, heads, seq, hd)`` float32, whose features
    (all layers and heads of one token) are a fixed rank-6 Gaussian mix plus small noise.

    The mix is the same for every ``seed`` (so a basis fitted on one seed codes another);
    ``seed`` draws the tokens.
    """
    g = torch.Generator().manual_seed(123)
    dim = layers * heads * hd
    mix = torch.randn(6, dim, generator=g) * torch.linspace(3, 0.5, 6)[:, None]
    g2 = torch.Generator().manual_seed(seed)
    feats = [
        torch.randn(batch * seq, 6, generator=g2) @ mix
        + 0.05 * torch.randn(batch * seq, dim, generator=g2)
        for _ in range(2)
    ]
    out = []
    for i in range(layers):
        kv = []
        for f in feats:
            x = f[:, i * heads * hd : (i + 1) * heads * hd].reshape(batch, seq, heads, hd)
            kv.append(x.permute(0, 2, 1, 3).contiguous())
        out.append((kv[0], kv[1]))
    return out
