"""PCA of the KV cache: calibration and fitting the basis, KVTC-style (introduced in notebook 06).

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

What they return, :class:`~kvlib.kvtc.basis.KVPCABasis` (the learned transform, saved with
safetensors), lives in :mod:`kvlib.kvtc.basis`.

Tensor shapes follow transformers: a layer's keys/values are ``(batch, kv_heads, seq_len,
head_dim)``. A *feature vector* is one token's keys (or values) of a block of layers, flattened
in the order ``(layer, kv_head, head_dim)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlib import compat, rope
from kvlib.eval import capture
from kvlib.kvtc.basis import KVPCABasis
from kvlib.kvtc.bitalloc import MAX_BITS, calibrate_uniform_quantizer
from kvlib.validate import check_int

__all__ = [
    "KVPCABasis",
    "calibration_kv",
    "fit_basis",
    "fit_kv_pca",
]


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


def _check_fit_args(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    skip_tokens: int,
    max_components: int | None,
    holdout_every: int,
) -> tuple[int, int, int, int]:
    """Check :func:`fit_basis`'s arguments; returns the layers' ``(batch, kv_heads, seq_len, head_dim)``."""
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
    return batch, heads, seq, hd


def _check_coded_layers(coded_layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """The coded layers as a sorted list of distinct indices in ``0..num_layers-1``."""
    if coded_layers is None:
        return list(range(num_layers))
    if isinstance(coded_layers, str | torch.Tensor) or not isinstance(coded_layers, Sequence):
        raise TypeError("coded_layers must be a sequence of layer indices or None")
    coded = [check_int(i, "coded_layers[...]", minimum=0) for i in coded_layers]
    if not coded or len(set(coded)) != len(coded) or max(coded) >= num_layers:
        raise ValueError(
            f"coded_layers must name distinct layers in 0..{num_layers - 1} (got {list(coded_layers)})"
        )
    return sorted(coded)


def _accumulate(
    basis: KVPCABasis,
    pieces: Sequence[tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]],
    held: Sequence[int],
) -> tuple[list[_Moments], list[list[torch.Tensor]]]:
    """Per block, the moments of the fitting pieces' features and the held-out pieces' features
    (each ``(tokens, dim)``)."""
    nblocks = 2 * len(basis.blocks)
    moments = [_Moments() for _ in range(nblocks)]
    val: list[list[torch.Tensor]] = [[] for _ in range(nblocks)]
    for i, (piece, pos) in enumerate(pieces):
        for b, f in enumerate(basis.features(piece, pos)):
            if i in held:
                val[b].append(f)
            else:
                moments[b].add(f)
    return moments, val


def _fit_block(
    moments: _Moments, val: Sequence[torch.Tensor], max_components: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """One block's components, chosen on ``moments`` and ordered and measured on ``val``.

    Returns ``(mean (dim,), components (dim, r), variances (r,) float64, residual variance,
    held-out coefficients normalised by their std (tokens, r))``.
    """
    mean, cov = moments.mean_cov()
    dim = cov.shape[0]
    r = min(dim, moments.n - 1) if moments.n > 1 else 1
    if max_components is not None:
        r = min(r, max_components)
    _, comps = _top_eigh(cov, r)
    xv = torch.cat(val) - mean
    coef = xv @ comps
    var = (coef * coef).mean(dim=0).double()
    total = float((xv.double() ** 2).sum(dim=1).mean())
    order = torch.argsort(var, descending=True)  # by held-out variance
    comps, coef, var = comps[:, order].contiguous(), coef[:, order], var[order]
    residual = max(total - float(var.sum()), 0.0)
    return mean, comps, var, residual, coef / var.float().clamp_min(1e-20).sqrt()


def fit_basis(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    positions: torch.Tensor | None = None,
    cross_layer: bool = True,
    inv_freq: torch.Tensor | None = None,
    attention_scaling: float = 1.0,
    skip_tokens: int = 0,
    max_components: int | None = None,
    holdout_every: int = 4,
    coded_layers: Sequence[int] | None = None,
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
        coded_layers: the layers the basis codes (default all); on a hybrid model the global
            layers, the codec storing the sliding-window layers whole.
    """
    batch, heads, seq, hd = _check_fit_args(layers, skip_tokens, max_components, holdout_every)
    coded = _check_coded_layers(coded_layers, len(layers))
    if positions is None:
        positions = torch.arange(seq)
    if batch == 1 and seq - skip_tokens < 4:
        raise ValueError("one calibration sequence must hold at least 4 tokens after skip_tokens")
    num_layers = len(layers)
    blocks = [coded] if cross_layer else [[i] for i in coded]
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
    moments, val = _accumulate(basis, pieces, held)
    zs, ws = [], []
    for b in range(nblocks):
        mean, comps, var, residual, z = _fit_block(moments[b], val[b], max_components)
        basis.means.append(mean)
        basis.components.append(comps)
        basis.variances.append(var.float())
        basis.residual.append(residual)
        zs.append(z)
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

    On a model that mixes sliding-window and global layers (Gemma 3) the basis codes the
    global layers, with their RoPE, and the codec stores the sliding windows whole: a window
    holds a fixed number of tokens, while the global layers grow with the context.

    Returns:
        A :class:`KVPCABasis` on the CPU.

    Raises:
        ValueError: the model has no full-attention layer, or a layer type kvlib does not
            serve (:func:`kvlib.compat.layer_windows`).
    """
    windows = compat.layer_windows(model.config, owner="kvlib.kvtc")
    coded = [i for i, w in enumerate(windows) if w is None]
    if not coded:
        raise ValueError("kvlib.kvtc codes the global layers: this model has none")
    layers = calibration_kv(model, tokenizer, texts, max_tokens=max_tokens, chunk_len=chunk_len)
    if not undo_rope:
        inv_freq, scaling = None, 1.0
    elif len(coded) < len(windows):  # hybrid: the global layers' own RoPE
        inv_freq, scaling = rope.rope_from_config(model.config, "full_attention")
    else:
        inv_freq, scaling = rope.rope_parameters(model)
    basis = fit_basis(
        layers, cross_layer=cross_layer, inv_freq=inv_freq, attention_scaling=scaling,
        skip_tokens=min(sink_tokens, chunk_len - 1), max_components=max_components,
        coded_layers=coded,
    )  # fmt: skip
    basis.meta["model"] = str(getattr(model.config, "_name_or_path", "")) or model.config.model_type
    return basis
