"""The learned PCA transform of a model's keys and values, KVTC-style (introduced in notebook 06).

:class:`KVPCABasis` holds what :func:`kvlib.kvtc.pca.fit_basis` learns: per block of layers a mean
feature vector, orthonormal components and their variances, plus the quantizer's distortion
table. It maps a cache to feature matrices and back (undoing and re-applying RoPE on keys,
:mod:`kvlib.rope`), and is saved with safetensors (no pickle). :mod:`kvlib.kvtc.codec` codes with it.

Tensor shapes follow transformers: a layer's keys/values are ``(batch, kv_heads, seq_len,
head_dim)``. A *feature vector* is one token's keys (or values) of a block of layers, flattened
in the order ``(layer, kv_head, head_dim)``.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvlib import rope
from kvlib.validate import check_int

__all__ = ["BASIS_FORMAT", "KVPCABasis"]

#: Format tag stored in a saved basis's metadata (named when the class lived in ``pca``; kept so
#: saved files still load).
BASIS_FORMAT = "kvlib.kvtc.pca.KVPCABasis/1"


@dataclass
class KVPCABasis:
    """A learned PCA transform for one model's keys and values.

    The feature axis is split into *blocks*: with ``cross_layer=True`` one block for all keys and
    one for all values (feature size ``coded layers · kv_heads · head_dim``); otherwise one key
    and one value block per layer (``kv_heads · head_dim``). ``blocks[i]`` lists the layers of
    block ``i`` (the same for keys and values), as indices among the model's ``num_layers``.
    The layers the blocks name are the *coded* layers: every layer on a full-attention model;
    on a hybrid one (Gemma 3) the global layers, whose cache grows with the context, while the
    codec stores each sliding-window layer whole (:mod:`kvlib.kvtc.codec`).

    Attributes:
        means: per block ``[keys..., values...]``, ``(dim,)`` float32 mean feature vector.
        components: per block, ``(dim, r)`` float32 orthonormal columns, by decreasing variance.
        variances: per block, ``(r,)`` float32 calibration variance of each component (reduced
            over calibration tokens).
        residual: per block, variance (summed over features) not captured by the ``r`` kept
            components.
        unit_distortion: ``(9,)`` normalised MSE ``c(b)`` of the per-component quantizer with
            ``b = 0..8`` bits, measured on the calibration coefficients (made convex).
        clip: ``(9,)`` clipping range of the quantizer in units of the component's std
            (``±clip[b]·σ``), chosen on calibration data to minimise ``c(b)``.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    blocks: list[list[int]]
    means: list[torch.Tensor]
    components: list[torch.Tensor]
    variances: list[torch.Tensor]
    residual: list[float]
    unit_distortion: torch.Tensor
    clip: torch.Tensor
    inv_freq: torch.Tensor | None
    attention_scaling: float = 1.0
    calib_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    # -- shape facts -------------------------------------------------------------------------
    @property
    def cross_layer(self) -> bool:
        return len(self.blocks) == 1 and len(self.blocks[0]) > 1

    @property
    def coded_layers(self) -> list[int]:
        """The model's layers the blocks code, in increasing order."""
        return sorted({i for block in self.blocks for i in block})

    @property
    def undo_rope(self) -> bool:
        return self.inv_freq is not None

    @property
    def token_dim(self) -> int:
        """Elements of one token's keys + values over the coded layers."""
        return 2 * len(self.coded_layers) * self.kv_heads * self.head_dim

    def block_dim(self, i: int) -> int:
        return len(self.blocks[i % len(self.blocks)]) * self.kv_heads * self.head_dim

    @property
    def all_variances(self) -> torch.Tensor:
        """``(Σ r,)`` component variances of every block, keys blocks first."""
        return torch.cat([v.double() for v in self.variances])

    def nbytes(self) -> int:
        """Bytes of the tensors (means, components, variances) as stored by :meth:`save`."""
        return sum(
            t.numel() * t.element_size() for t in [*self.means, *self.components, *self.variances]
        )

    def explained_variance(self, kind: str = "keys") -> torch.Tensor:
        """Cumulative explained-variance fraction of one kind, all blocks pooled.

        Returns ``(Σ r,)``: entry ``n`` is the fraction of total variance kept by the ``n+1``
        largest components (components of all blocks sorted together).
        """
        if kind not in ("keys", "values"):
            raise ValueError(f"kind must be 'keys' or 'values' (got {kind!r})")
        nb = len(self.blocks)
        sl = slice(0, nb) if kind == "keys" else slice(nb, 2 * nb)
        var = torch.cat([v.double() for v in self.variances[sl]])
        total = float(var.sum()) + sum(self.residual[sl])
        return torch.cumsum(torch.sort(var, descending=True).values, 0) / total

    def fingerprint(self) -> int:
        """crc32 over shapes and tensor bytes; stored in encoded data to catch basis mismatches."""
        crc = zlib.crc32(
            json.dumps([self.num_layers, self.kv_heads, self.head_dim, self.blocks]).encode()
        )
        for t in [*self.means, *self.components, self.clip]:
            crc = zlib.crc32(t.detach().cpu().contiguous().numpy().tobytes(), crc)
        return crc

    def truncate(self, max_components: int) -> KVPCABasis:
        """A copy keeping at most ``max_components`` components per block (the rest → residual)."""
        max_components = check_int(max_components, "max_components", minimum=1)
        comps, vars_, res = [], [], []
        for c, v, r in zip(self.components, self.variances, self.residual, strict=True):
            comps.append(c[:, :max_components].clone())
            vars_.append(v[:max_components].clone())
            res.append(r + float(v[max_components:].double().sum()))
        return KVPCABasis(
            self.num_layers, self.kv_heads, self.head_dim, [list(b) for b in self.blocks],
            [m.clone() for m in self.means], comps, vars_, res, self.unit_distortion.clone(),
            self.clip.clone(), None if self.inv_freq is None else self.inv_freq.clone(),
            self.attention_scaling, self.calib_tokens, dict(self.meta),
        )  # fmt: skip

    def to(self, device: str | torch.device) -> KVPCABasis:
        """Move the tensors used for coding (means, components) to ``device``, in place; returns self."""
        self.means = [m.to(device) for m in self.means]
        self.components = [c.to(device) for c in self.components]
        return self

    # -- features ----------------------------------------------------------------------------
    def features(
        self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor
    ) -> list[torch.Tensor]:
        """Feature matrices of a cache, one per block (keys blocks, then values blocks).

        Args:
            layers: per layer of the model ``(keys, values)``, ``(batch, kv_heads, seq_len,
                head_dim)``; only the coded layers are read (the others may hold any length).
            positions: ``(seq_len,)`` positions of the tokens (for undoing RoPE).

        Returns:
            Per block ``(batch · seq_len, dim)`` float32 (tokens on the first axis).
        """
        keys: dict[int, torch.Tensor] = {}
        values: dict[int, torch.Tensor] = {}
        for i in self.coded_layers:
            k, v = layers[i]
            k = k.float()
            if self.inv_freq is not None:
                k = rope.undo_rope(k, positions, self.inv_freq, self.attention_scaling)
            keys[i] = k.permute(0, 2, 1, 3).reshape(k.shape[0] * k.shape[2], -1)
            values[i] = v.float().permute(0, 2, 1, 3).reshape(v.shape[0] * v.shape[2], -1)
        out = []
        for src in (keys, values):
            for block in self.blocks:
                out.append(torch.cat([src[i] for i in block], dim=1))
        return out

    def unfeatures(
        self,
        feats: Sequence[torch.Tensor],
        batch: int,
        positions: torch.Tensor,
        dtype: torch.dtype,
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Inverse of :meth:`features`: per layer of the model ``(keys, values)`` with RoPE
        re-applied, ``None`` for a layer the basis does not code."""
        nb = len(self.blocks)
        seq = positions.numel()
        hd = self.kv_heads * self.head_dim
        per_layer: list[list[torch.Tensor | None]] = [[None, None] for _ in range(self.num_layers)]
        for kind in (0, 1):
            for bi, block in enumerate(self.blocks):
                f = feats[kind * nb + bi]
                for j, layer in enumerate(block):
                    x = f[:, j * hd : (j + 1) * hd].reshape(
                        batch, seq, self.kv_heads, self.head_dim
                    )
                    x = x.permute(0, 2, 1, 3)
                    if kind == 0 and self.inv_freq is not None:
                        x = rope.apply_rope(
                            x.contiguous(), positions, self.inv_freq, self.attention_scaling
                        )
                    per_layer[layer][kind] = x.to(dtype).contiguous()
        return [(k, v) if k is not None and v is not None else None for k, v in per_layer]

    # -- persistence -------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the basis as one safetensors file (tensors + JSON metadata; no pickle)."""
        from safetensors.torch import save_file

        nb = len(self.blocks)
        tensors: dict[str, torch.Tensor] = {
            "unit_distortion": self.unit_distortion.double().cpu().contiguous(),
            "clip": self.clip.float().cpu().contiguous(),
        }
        if self.inv_freq is not None:
            tensors["inv_freq"] = self.inv_freq.float().cpu().contiguous()
        for i in range(2 * nb):
            tensors[f"block{i}.mean"] = self.means[i].float().cpu().contiguous()
            tensors[f"block{i}.components"] = self.components[i].float().cpu().contiguous()
            tensors[f"block{i}.variances"] = self.variances[i].float().cpu().contiguous()
        meta = {
            "format": BASIS_FORMAT,
            "num_layers": self.num_layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "blocks": self.blocks,
            "residual": self.residual,
            "attention_scaling": self.attention_scaling,
            "calib_tokens": self.calib_tokens,
            "meta": self.meta,
        }
        save_file(tensors, str(path), metadata={"kvlib": json.dumps(meta)})

    @classmethod
    def load(cls, path: str | Path) -> KVPCABasis:
        """Read a basis written by :meth:`save`.

        Raises:
            ValueError: the file is not a kvlib PCA basis (or is damaged).
        """
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no basis file at {path.name!r}")
        try:
            with safe_open(str(path), framework="pt") as f:
                raw = (f.metadata() or {}).get("kvlib")
            tensors = load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"{path.name!r} is not a readable safetensors file ({exc})") from None
        try:
            meta = json.loads(raw or "")
            if meta.get("format") != BASIS_FORMAT:
                raise KeyError("format")
            nb = len(meta["blocks"])
            return cls(
                num_layers=int(meta["num_layers"]),
                kv_heads=int(meta["kv_heads"]),
                head_dim=int(meta["head_dim"]),
                blocks=[list(map(int, b)) for b in meta["blocks"]],
                means=[tensors[f"block{i}.mean"] for i in range(2 * nb)],
                components=[tensors[f"block{i}.components"] for i in range(2 * nb)],
                variances=[tensors[f"block{i}.variances"] for i in range(2 * nb)],
                residual=[float(r) for r in meta["residual"]],
                unit_distortion=tensors["unit_distortion"],
                clip=tensors["clip"],
                inv_freq=tensors.get("inv_freq"),
                attention_scaling=float(meta["attention_scaling"]),
                calib_tokens=int(meta["calib_tokens"]),
                meta=dict(meta.get("meta", {})),
            )
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"{path.name!r} is not a kvlib PCA basis ({BASIS_FORMAT}); missing or bad {exc}"
            ) from None
