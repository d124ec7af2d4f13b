"""PCA of the KV cache: calibration and the learned basis, KVTC-style (introduced in notebook 06).

Keys and values of one model are strongly correlated across heads and layers, so a fixed linear
transform learned once on calibration text (PCA) packs most of their energy into few components.
This module learns that transform; :mod:`kvlib.kvtc.codec` quantizes the components with a bit budget
and entropy-codes them (NVIDIA's *KV Cache Transform Coding*, Staniszewski & Łańcucki, arXiv
2511.01815, re-implemented from the paper's description).

Pieces:

* :func:`calibration_kv` — keys/values of calibration text, captured through
  :func:`kvlib.eval.capture.capture_kv`.
* :func:`fit_basis` — one basis per layer (``cross_layer=False``) or one across all layers and
  heads (``cross_layer=True``), with component variances and the quantizer's distortion table
  measured on held-out calibration sequences. Keys are de-rotated first (:mod:`kvlib.rope`):
  RoPE's position-dependent rotation hides the correlation PCA needs.
* :func:`fit_kv_pca` — both steps for a transformers model.
* :class:`KVPCABasis` — the learned transform, saved with safetensors (no pickle).

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
from kvlib.eval import capture
from kvlib.kvtc.bitalloc import MAX_BITS, calibrate_uniform_quantizer
from kvlib.validate import check_int

__all__ = [
    "BASIS_FORMAT",
    "KVPCABasis",
    "calibration_kv",
    "fit_basis",
    "fit_kv_pca",
]

#: Format tag stored in a saved basis's metadata.
BASIS_FORMAT = "kvlib.kvtc.pca.KVPCABasis/1"


# --------------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------------


def calibration_kv(
    model: Any,
    tokenizer: Any,
    texts: str | Sequence[str],
    max_tokens: int = 8192,
    chunk_len: int = 512,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys/values of calibration text: ``[(keys, values), …]`` per layer.

    The text is tokenized and cut into chunks of ``chunk_len`` tokens, each run from position 0
    (so positions are ``0..chunk_len-1``) through :func:`kvlib.eval.capture.capture_kv`. Returns per
    layer ``(n_chunks, kv_heads, chunk_len, head_dim)`` float32 tensors on the CPU (keys
    post-RoPE, as the cache holds them).
    """
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, Sequence) or not texts or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a non-empty string or a sequence of strings")
    max_tokens = check_int(max_tokens, "max_tokens", minimum=1)
    chunk_len = check_int(chunk_len, "chunk_len", minimum=1)
    pieces = [tokenizer(t, return_tensors="pt").input_ids[0] for t in texts if t.strip()]
    if not pieces:
        raise ValueError("calibration texts are empty")
    ids = torch.cat(pieces)[:max_tokens]
    n_chunks = ids.numel() // chunk_len
    if n_chunks == 0:
        raise ValueError(
            f"calibration text gives {ids.numel()} tokens, fewer than one chunk of {chunk_len}"
        )
    # The decoder stack alone (no lm_head over the vocabulary) gives the same keys and values.
    base = getattr(model, "model", None)
    runner = base if isinstance(base, torch.nn.Module) else model
    per_layer: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    for c in range(n_chunks):
        chunk = ids[c * chunk_len : (c + 1) * chunk_len][None]
        for i, (k, v) in enumerate(capture.capture_kv(runner, chunk)):
            if len(per_layer) <= i:
                per_layer.append(([], []))
            per_layer[i][0].append(k.cpu())
            per_layer[i][1].append(v.cpu())
    return [(torch.cat(ks), torch.cat(vs)) for ks, vs in per_layer]


# --------------------------------------------------------------------------------------------
# The basis
# --------------------------------------------------------------------------------------------


@dataclass
class KVPCABasis:
    """A learned PCA transform for one model's keys and values.

    The feature axis is split into *blocks*: with ``cross_layer=True`` one block for all keys and
    one for all values (feature size ``num_layers · kv_heads · head_dim``); otherwise one key and
    one value block per layer (``kv_heads · head_dim``). ``blocks[i]`` lists the layers of block
    ``i`` (the same for keys and values).

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
        return len(self.blocks) == 1 and self.num_layers > 1

    @property
    def undo_rope(self) -> bool:
        return self.inv_freq is not None

    @property
    def token_dim(self) -> int:
        """Elements of one token's keys + values over all layers."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim

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
            layers: per layer ``(keys, values)``, ``(batch, kv_heads, seq_len, head_dim)``.
            positions: ``(seq_len,)`` positions of the tokens (for undoing RoPE).

        Returns:
            Per block ``(batch · seq_len, dim)`` float32 (tokens on the first axis).
        """
        keys, values = [], []
        for k, v in layers:
            k = k.float()
            if self.inv_freq is not None:
                k = rope.undo_rope(k, positions, self.inv_freq, self.attention_scaling)
            keys.append(k.permute(0, 2, 1, 3).reshape(k.shape[0] * k.shape[2], -1))
            values.append(v.float().permute(0, 2, 1, 3).reshape(v.shape[0] * v.shape[2], -1))
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
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Inverse of :meth:`features`: per layer ``(keys, values)`` with RoPE re-applied."""
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
        return [(k, v) for k, v in per_layer]  # type: ignore[misc]

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


# --------------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------------


def _top_eigh(
    cov: torch.Tensor, k: int, niter: int = 1, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` eigenpairs of a symmetric PSD ``cov`` ``(d, d)``, by decreasing eigenvalue.

    Small or nearly full-rank requests use ``torch.linalg.eigh`` (float64 up to d = 1536,
    float32 above). Otherwise randomized subspace iteration (Halko, Martinsson & Tropp 2011):
    ``niter`` power steps on a ``k + 64`` column block in float32, then an exact Rayleigh–Ritz
    step (a small float64 eigh) — ``O(d² k)`` instead of ``O(d³)``.

    Returns:
        ``(evals (k,), evecs (d, k))``, float64 / float32.
    """
    d = cov.shape[0]
    if k >= d // 2 or d <= 1536:
        work = cov.double() if d <= 1536 else cov.float()
        evals, evecs = torch.linalg.eigh(work)
        order = torch.argsort(evals, descending=True)[:k]
        return evals[order].double(), evecs[:, order].float()
    c32 = cov.float()
    p = min(d, k + 64)
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(c32 @ torch.randn(d, p, generator=g)).Q
    for _ in range(niter):
        q = torch.linalg.qr(c32 @ q).Q
    small = (q.T @ (c32 @ q)).double()
    evals, u = torch.linalg.eigh((small + small.T) / 2)  # eigh reads one triangle only
    order = torch.argsort(evals, descending=True)[:k]
    return evals[order], (q.double() @ u[:, order]).float()


class _Moments:
    """Running mean and covariance of feature rows, accumulated chunk by chunk.

    Rows are shifted by the first chunk's mean; each chunk's ``Xᵀ X`` is added into a float32
    buffer (``addmm``, no temporaries) that is flushed into float64 sums every few chunks, so
    large means cost no precision and no ``(n, d)`` matrix of all calibration tokens is held.
    """

    FLUSH_EVERY = 4

    def __init__(self) -> None:
        self.n = 0
        self.chunks = 0
        self.shift: torch.Tensor | None = None
        self.s1: torch.Tensor | None = None
        self.s2: torch.Tensor | None = None
        self.buf: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        x = x.float()
        if self.shift is None:
            self.shift = x.mean(dim=0)
            self.s1 = torch.zeros(x.shape[1], dtype=torch.float64)
            self.s2 = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
            self.buf = torch.zeros(x.shape[1], x.shape[1])
        assert self.s1 is not None and self.buf is not None
        xc = x - self.shift
        self.s1 += xc.sum(dim=0, dtype=torch.float64)
        self.buf.addmm_(xc.T, xc)
        self.n += x.shape[0]
        self.chunks += 1
        if self.chunks % self.FLUSH_EVERY == 0:
            self._flush()

    def _flush(self) -> None:
        assert self.s2 is not None and self.buf is not None
        self.s2 += self.buf
        self.buf.zero_()

    def mean_cov(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean (d,) float32, covariance (d, d) float64)`` (the biased, 1/n estimate)."""
        if self.shift is None:
            raise ValueError("no calibration rows were added")
        self._flush()
        assert self.s1 is not None and self.s2 is not None
        m = self.s1 / self.n
        cov = self.s2 / self.n
        cov -= torch.outer(m, m)
        return (m + self.shift.double()).float(), cov


def _sample_coefficients(
    zs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], n: int = 20_000
) -> torch.Tensor:
    """``(n,)`` normalised coefficients drawn with probability ∝ their component's variance.

    The codec's total error sums ``σ_j² · c(b_j)`` over components, so the distortion table
    that predicts it best is the variance-weighted one; sampling by weight gives it from a
    small 1-D sample. ``zs``: per block ``(rows, r)``; ``weights``: per block ``(r,)``.
    """
    g = torch.Generator().manual_seed(0)
    w = torch.cat([x.double() for x in weights])
    col = torch.multinomial(w / w.sum(), n, replacement=True, generator=g)
    offsets = torch.cumsum(torch.tensor([0] + [z.shape[1] for z in zs[:-1]]), 0)
    block = torch.searchsorted(offsets, col, right=True) - 1
    out = torch.empty(n)
    for bi, z in enumerate(zs):
        sel = torch.nonzero(block == bi).flatten()
        if sel.numel():
            rows = torch.randint(0, z.shape[0], (sel.numel(),), generator=g)
            out[sel] = z[rows, col[sel] - offsets[bi]].float()
    return out


def _pieces(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor
) -> list[tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]]:
    """Split captured layers into single sequences (halves when there is only one)."""
    batch, seq = layers[0][0].shape[0], layers[0][0].shape[2]
    if batch >= 2:
        return [
            ([(k[i : i + 1], v[i : i + 1]) for k, v in layers], positions) for i in range(batch)
        ]
    half = seq // 2
    return [
        ([(k[:, :, sl], v[:, :, sl]) for k, v in layers], positions[sl])
        for sl in (slice(0, half), slice(half, seq))
    ]


def fit_basis(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    positions: torch.Tensor | None = None,
    cross_layer: bool = True,
    inv_freq: torch.Tensor | None = None,
    attention_scaling: float = 1.0,
    skip_tokens: int = 0,
    max_components: int | None = None,
    holdout_every: int = 4,
) -> KVPCABasis:
    """Fit a :class:`KVPCABasis` on captured keys/values.

    The calibration sequences are split: every ``holdout_every``-th one (the last one when
    there are fewer) is held out. The components come from the covariance of the others; the
    component variances, the residual variance and the quantizer's distortion table are then
    *measured on the held-out sequences*. Variances taken from the same tokens that chose the
    components are optimistic: the leading components are biased high (they were chosen to
    catch the most variance of those very tokens) and the tail low (with fewer tokens than
    features, exactly zero), which made the predicted error too small.

    Args:
        layers: per layer ``(keys, values)``, ``(batch, kv_heads, seq_len, head_dim)`` with
            one calibration sequence per batch row (keys post-RoPE if ``inv_freq`` is given).
            With ``batch == 1`` the sequence is cut in two halves.
        positions: ``(seq_len,)`` positions (default ``0..seq_len-1``).
        cross_layer: one block across all layers and heads, or one block per layer.
        inv_freq: rotary inverse frequencies; if given, keys are de-rotated before PCA and the
            codec re-rotates them after decoding. ``None``: keys are used as they are.
        skip_tokens: leave out the first tokens of every sequence (attention sinks, which the
            codec never compresses; their outlier keys/values would distort the basis).
        max_components: keep at most this many components per block (``None``: all). Below
            half a block's size the top components come from randomized subspace iteration.
        holdout_every: hold out one calibration sequence in this many (>= 2).
    """
    if not isinstance(layers, Sequence) or not layers:
        raise ValueError("layers must be a non-empty list of (keys, values) per layer")
    if not all(isinstance(kv, tuple | list) and len(kv) == 2 for kv in layers):
        raise ValueError("layers must hold one (keys, values) pair per layer")
    k0 = layers[0][0]
    if not isinstance(k0, torch.Tensor) or k0.ndim != 4:
        raise ValueError("keys must be (batch, kv_heads, seq_len, head_dim) tensors")
    batch, heads, seq, hd = k0.shape
    for i, (k, v) in enumerate(layers):
        if k.shape != (batch, heads, seq, hd) or v.shape != k.shape:
            raise ValueError(
                f"layer {i}: keys/values must both have shape {(batch, heads, seq, hd)}"
            )
    if check_int(skip_tokens, "skip_tokens", minimum=0) >= seq:
        raise ValueError(f"skip_tokens must be an int in 0..{seq - 1} (got {skip_tokens!r})")
    if max_components is not None:
        check_int(max_components, "max_components", minimum=1)
    check_int(holdout_every, "holdout_every", minimum=2)
    if positions is None:
        positions = torch.arange(seq)
    if batch == 1 and seq - skip_tokens < 4:
        raise ValueError("one calibration sequence must hold at least 4 tokens after skip_tokens")
    num_layers = len(layers)
    blocks = [list(range(num_layers))] if cross_layer else [[i] for i in range(num_layers)]
    basis = KVPCABasis(
        num_layers=num_layers, kv_heads=heads, head_dim=hd, blocks=blocks, means=[], components=[],
        variances=[], residual=[], unit_distortion=torch.ones(MAX_BITS + 1, dtype=torch.float64),
        clip=torch.ones(MAX_BITS + 1), inv_freq=None if inv_freq is None else inv_freq.float().cpu(),
        attention_scaling=float(attention_scaling),
    )  # fmt: skip
    kept = [(k[:, :, skip_tokens:], v[:, :, skip_tokens:]) for k, v in layers]
    pieces = _pieces(kept, positions[skip_tokens:])
    held = [i for i in range(len(pieces)) if i % holdout_every == holdout_every - 1]
    if not held:
        held = [len(pieces) - 1]
    nblocks = 2 * len(blocks)
    moments = [_Moments() for _ in range(nblocks)]
    val: list[list[torch.Tensor]] = [[] for _ in range(nblocks)]
    for i, (piece, pos) in enumerate(pieces):
        for b, f in enumerate(basis.features(piece, pos)):
            if i in held:
                val[b].append(f)
            else:
                moments[b].add(f)
    zs, ws = [], []
    for b in range(nblocks):
        mean, cov = moments[b].mean_cov()
        dim = cov.shape[0]
        r = min(dim, moments[b].n - 1) if moments[b].n > 1 else 1
        if max_components is not None:
            r = min(r, max_components)
        _, comps = _top_eigh(cov, r)
        xv = torch.cat(val[b]) - mean
        coef = xv @ comps
        var = (coef * coef).mean(dim=0).double()
        total = float((xv.double() ** 2).sum(dim=1).mean())
        order = torch.argsort(var, descending=True)  # by held-out variance
        comps, coef, var = comps[:, order].contiguous(), coef[:, order], var[order]
        basis.means.append(mean)
        basis.components.append(comps)
        basis.variances.append(var.float())
        basis.residual.append(max(total - float(var.sum()), 0.0))
        zs.append(coef / var.float().clamp_min(1e-20).sqrt())
        ws.append(var)
    basis.calib_tokens = sum(m.n for m in moments) // nblocks
    basis.meta["heldout_tokens"] = sum(v.shape[0] for v in val[0])
    basis.clip, basis.unit_distortion = calibrate_uniform_quantizer(
        _sample_coefficients(zs, ws), MAX_BITS
    )
    return basis


def fit_kv_pca(
    model: Any,
    tokenizer: Any,
    texts: str | Sequence[str],
    cross_layer: bool = True,
    max_tokens: int = 8192,
    chunk_len: int = 512,
    sink_tokens: int = 4,
    max_components: int | None = 2048,
    undo_rope: bool = True,
) -> KVPCABasis:
    """Calibrate a PCA basis for ``model``'s keys and values on ``texts``.

    Args:
        texts: calibration text (keep it apart from evaluation text, e.g.
            ``kvlib.data.split_text(load_eval_text(), 0.5)[0]``).
        cross_layer: ``True``: one basis across all layers and heads (what KVTC does);
            ``False``: one per layer.
        max_tokens: calibration tokens used (cut into ``chunk_len`` chunks from position 0);
            one chunk in four is held out to measure variances (see :func:`fit_basis`). Use
            more tokens than features per block (``num_layers · kv_heads · head_dim`` for
            ``cross_layer``) for a well-estimated basis.
        sink_tokens: first tokens of every chunk left out of the fit (they stay uncompressed).
        max_components: cap on components per block (``None``: as many as the data allows).
        undo_rope: de-rotate keys before PCA (recommended; see notebook 06).

    Returns:
        A :class:`KVPCABasis` on the CPU.
    """
    layers = calibration_kv(model, tokenizer, texts, max_tokens=max_tokens, chunk_len=chunk_len)
    inv_freq, scaling = rope.rope_parameters(model) if undo_rope else (None, 1.0)
    basis = fit_basis(
        layers, cross_layer=cross_layer, inv_freq=inv_freq, attention_scaling=scaling,
        skip_tokens=min(sink_tokens, chunk_len - 1), max_components=max_components,
    )  # fmt: skip
    basis.meta["model"] = str(getattr(model.config, "_name_or_path", "")) or model.config.model_type
    return basis
