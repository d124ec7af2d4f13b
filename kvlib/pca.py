"""PCA transform coding of the KV cache, KVTC-style (introduced in notebook 05).

Keys and values of one model are strongly correlated across heads and layers, so a fixed linear
transform learned once on calibration text (PCA) packs most of their energy into few components.
Quantizing the components with a per-component bit budget (many get 0 bits: dropped), then
entropy-coding the codes with a standard-library codec (``lzma`` by default), compresses the
cache far beyond plain integer quantization. This follows NVIDIA's *KV Cache Transform Coding*
(Staniszewski & Łańcucki, arXiv 2511.01815), re-implemented from the paper's description.
It targets storing a conversation's cache between turns or off the GPU, not the per-step path.

Pieces:

* :func:`undo_rope` / :func:`apply_rope` — keys in the cache are post-rotary; the rotation
  depends on the token's position, which spreads a key's energy over the rotated pairs and
  hides the correlation PCA needs. Keys are de-rotated before PCA and re-rotated after decoding.
* :func:`fit_kv_pca` — calibration: capture keys/values on text, fit one basis per layer
  (``cross_layer=False``) or one across all layers and heads (``cross_layer=True``).
* :class:`KVPCABasis` — the learned transform, saved with safetensors (no pickle).
* :class:`KVTCCodec` — ``encode(DynamicCache) -> bytes`` and ``decode(bytes) -> DynamicCache``.
  The first ``sink_tokens`` and the last ``recent_tokens`` stay uncompressed (fp16).
* :func:`prefill_cache`, :func:`continuation_perplexity` — the evaluation protocol: prefill a
  prefix, encode/decode its cache, score the next tokens reading the decoded cache (forward
  passes go through :mod:`kvlib.compat`, captures through :mod:`kvlib.capture`).

Tensor shapes follow transformers: a layer's keys/values are ``(batch, kv_heads, seq_len,
head_dim)``. A *feature vector* is one token's keys (or values) of a block of layers, flattened
in the order ``(layer, kv_head, head_dim)``.
"""

from __future__ import annotations

import json
import lzma
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvlib import capture as _capture
from kvlib import compat
from kvlib.bitalloc import allocate_bits, convexify

__all__ = [
    "KVPCABasis",
    "KVTCCodec",
    "EncodedInfo",
    "apply_rope",
    "undo_rope",
    "rope_parameters",
    "fit_kv_pca",
    "fit_basis",
    "calibration_kv",
    "prefill_cache",
    "clone_cache",
    "cache_tensors",
    "continuation_perplexity",
    "FORMAT_VERSION",
]

MAGIC = b"KVTC"
FORMAT_VERSION = 1
BASIS_FORMAT = "kvlib.pca.KVPCABasis/1"
MAX_BITS = 8
_PREFIX = struct.Struct("<4sHHI")  # magic, version, flags, header length
_CODERS = ("lzma", "zlib", "none")
_WINDOW_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_CACHE_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    # Same arithmetic as transformers' LlamaRotaryEmbedding.forward (float32 angles), so that
    # re-applying reproduces the model's own rotation bit for bit.
    freqs = positions.to(device=device, dtype=torch.float32)[:, None] * inv_freq.to(
        device=device, dtype=torch.float32
    )
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _check_rope_args(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    if not isinstance(keys, torch.Tensor) or keys.ndim != 4:
        raise ValueError(
            "keys must be a 4-D tensor (batch, kv_heads, seq_len, head_dim) "
            f"(got {getattr(keys, 'shape', type(keys).__name__)})"
        )
    if not isinstance(positions, torch.Tensor) or positions.ndim != 1:
        raise ValueError("positions must be a 1-D tensor of token positions, one per seq_len entry")
    if positions.numel() != keys.shape[2]:
        raise ValueError(
            f"positions has {positions.numel()} entries but keys have seq_len {keys.shape[2]}"
        )
    rot = 2 * inv_freq.numel()
    if inv_freq.ndim != 1 or rot == 0 or rot > keys.shape[-1]:
        raise ValueError(
            f"inv_freq must be 1-D with 2 * len <= head_dim {keys.shape[-1]} (got {tuple(inv_freq.shape)})"
        )


def apply_rope(
    keys: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
) -> torch.Tensor:
    """Rotate keys as the model does (``k·cos + rotate_half(k)·sin``, scaled).

    Args:
        keys: ``(batch, kv_heads, seq_len, head_dim)``.
        positions: ``(seq_len,)`` absolute position of each token.
        inv_freq: ``(rot_dim // 2,)`` rotary inverse frequencies; only the first ``rot_dim``
            channels of each head are rotated (partial rotary models), the rest pass through.
        attention_scaling: the rotary ``attention_scaling`` (1.0 for default RoPE).

    Returns:
        Rotated keys, same shape and dtype.
    """
    _check_rope_args(keys, positions, inv_freq)
    rot = 2 * inv_freq.numel()
    cos, sin = _cos_sin(inv_freq, positions, keys.device)
    k = keys[..., :rot].to(torch.float32)
    out = (k * cos + _rotate_half(k) * sin) * attention_scaling
    return torch.cat([out.to(keys.dtype), keys[..., rot:]], dim=-1)


def undo_rope(
    keys: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
) -> torch.Tensor:
    """Inverse of :func:`apply_rope`: rotate each token back by its own angle.

    ``apply_rope`` rotates channel pairs ``(i, i + rot_dim/2)`` by ``position · inv_freq[i]``;
    the inverse rotation uses ``-sin``. Same arguments and shapes as :func:`apply_rope`.
    """
    _check_rope_args(keys, positions, inv_freq)
    if not attention_scaling:
        raise ValueError("attention_scaling must be non-zero")
    rot = 2 * inv_freq.numel()
    cos, sin = _cos_sin(inv_freq, positions, keys.device)
    k = keys[..., :rot].to(torch.float32)
    out = (k * cos - _rotate_half(k) * sin) / attention_scaling
    return torch.cat([out.to(keys.dtype), keys[..., rot:]], dim=-1)


def rope_parameters(model: Any) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of a transformers model's rotary embedding.

    Raises:
        ValueError: the model has no rotary embedding module with an ``inv_freq`` buffer.
    """
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        rotary = next((m for m in model.modules() if hasattr(m, "inv_freq")), None)
    if rotary is None:
        raise ValueError(
            "the model has no rotary embedding (no module with an inv_freq buffer); "
            "pass undo_rope=False for models without RoPE"
        )
    inv = getattr(rotary, "original_inv_freq", None)
    if inv is None:
        inv = rotary.inv_freq
    return inv.detach().float().cpu().clone(), float(getattr(rotary, "attention_scaling", 1.0))


# --------------------------------------------------------------------------------------------
# Capturing caches and scoring continuations
# --------------------------------------------------------------------------------------------


def _check_ids(input_ids: Any, name: str, min_len: int = 1) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of token ids (got {type(input_ids).__name__})"
        )
    if input_ids.ndim != 2 or input_ids.shape[1] < min_len:
        raise ValueError(
            f"{name} must be a (batch, seq_len) tensor of token ids with seq_len >= {min_len} "
            f"(got shape {tuple(input_ids.shape)})"
        )
    return input_ids


def prefill_cache(model: Any, input_ids: torch.Tensor, chunk_size: int | None = None) -> Any:
    """Run ``input_ids`` ``(batch, seq_len)`` through the model; return the filled DynamicCache.

    ``chunk_size`` feeds the prefix in pieces (same cache, less peak memory). Forward passes go
    through :func:`kvlib.compat.forward`.
    """
    ids = _check_ids(input_ids, "input_ids")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0
    ):
        raise ValueError(f"chunk_size must be a positive int or None (got {chunk_size!r})")
    cache = compat.dynamic_cache(model.config)
    step = ids.shape[1] if chunk_size is None else chunk_size
    for start in range(0, ids.shape[1], step):
        compat.forward(model, ids[:, start : start + step], cache)
    return cache


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(keys, values), …]`` per layer of a transformers cache, each ``(batch, kv_heads, seq_len, head_dim)``.

    Raises:
        TypeError: not a transformers ``Cache`` with per-layer ``keys``/``values``.
        ValueError: empty or inconsistent layers.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"cache must be a transformers DynamicCache (got {type(cache).__name__})")
    out = []
    for i, layer in enumerate(layers):
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.ndim != 4:
            raise ValueError(
                f"cache layer {i} holds no (batch, kv_heads, seq_len, head_dim) keys/values; "
                "run a forward pass first"
            )
        if k.shape != v.shape:
            raise ValueError(
                f"cache layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)} differ "
                "(models whose value head_dim differs from the key head_dim are not supported)"
            )
        out.append((k, v))
    if not out:
        raise ValueError("cache is empty (no layers)")
    shape = out[0][0].shape
    for i, (k, _) in enumerate(out):
        if k.shape != shape:
            raise ValueError(
                f"cache layer {i} has shape {tuple(k.shape)}, layer 0 has {tuple(shape)}"
            )
    return out


def clone_cache(cache: Any) -> Any:
    """A deep copy of a DynamicCache (tensors cloned), so scoring one copy leaves the other intact."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in cache_tensors(cache)])


def continuation_perplexity(
    model: Any, cache: Any, next_ids: torch.Tensor, chunk_size: int = 64
) -> float:
    """Perplexity of a continuation given a prefilled cache, feeding it in chunks.

    The cache holds the prefix; ``next_ids`` ``(batch, n)`` is fed ``chunk_size`` tokens at a
    time, every step reading the cache (which grows: pass :func:`clone_cache` to keep the
    original). The tokens scored are ``next_ids[:, 1:]`` — each predicted from everything before
    it, so every prediction reads the prefix cache. (kvlib.eval's ``perplexity`` scores a text
    from scratch; this one starts from a cache, which is what a restored conversation is.)

    Returns:
        ``exp(mean negative log-likelihood)`` over the ``n - 1`` scored tokens.
    """
    ids = _check_ids(next_ids, "next_ids", min_len=2)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int (got {chunk_size!r})")
    nll = torch.zeros((), dtype=torch.float64)
    count = 0
    prev_logits: torch.Tensor | None = None
    for start in range(0, ids.shape[1], chunk_size):
        chunk = ids[:, start : start + chunk_size].to(model.device)
        logits = compat.forward(model, chunk, cache).logits.float()
        if prev_logits is not None:  # the first token of this chunk, predicted by the last one
            logits_all = torch.cat([prev_logits, logits[:, :-1]], dim=1)
            targets = chunk
        else:
            logits_all = logits[:, :-1]
            targets = chunk[:, 1:]
        if targets.numel():
            nll += (
                torch.nn.functional.cross_entropy(
                    logits_all.reshape(-1, logits_all.shape[-1]),
                    targets.reshape(-1),
                    reduction="sum",
                )
                .double()
                .cpu()
            )
            count += targets.numel()
        prev_logits = logits[:, -1:]
    return float(torch.exp(nll / count))


def calibration_kv(
    model: Any,
    tokenizer: Any,
    texts: str | Sequence[str],
    max_tokens: int = 8192,
    chunk_len: int = 512,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys/values of calibration text: ``[(keys, values), …]`` per layer.

    The text is tokenized and cut into chunks of ``chunk_len`` tokens, each run from position 0
    (so positions are ``0..chunk_len-1``) through :func:`kvlib.capture.capture_kv`. Returns per
    layer ``(n_chunks, kv_heads, chunk_len, head_dim)`` float32 tensors on the CPU (keys
    post-RoPE, as the cache holds them).
    """
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, Sequence) or not texts or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a non-empty string or a sequence of strings")
    for name, val in (("max_tokens", max_tokens), ("chunk_len", chunk_len)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name} must be a positive int (got {val!r})")
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
        for i, (k, v) in enumerate(_capture.capture_kv(runner, chunk)):
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
        if (
            isinstance(max_components, bool)
            or not isinstance(max_components, int)
            or max_components <= 0
        ):
            raise ValueError(f"max_components must be a positive int (got {max_components!r})")
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
                k = undo_rope(k, positions, self.inv_freq, self.attention_scaling)
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
                        x = apply_rope(
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


def _quantize(z: torch.Tensor, bits: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
    """Uniform midrise quantizer on ``[-clip_b, clip_b]`` with ``2^b`` levels; ``z`` normalised by σ.

    ``z``: ``(n, r)`` normalised coefficients; ``bits``/``clip``: ``(r,)``. Returns int64 codes.
    """
    levels = (2**bits).to(z.dtype)
    step = 2 * clip / levels
    return torch.clamp(
        torch.floor((z + clip) / step), min=torch.zeros_like(levels), max=levels - 1
    ).long()


def _dequantize(codes: torch.Tensor, bits: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
    levels = (2**bits).to(clip.dtype)
    step = 2 * clip / levels
    return (codes.to(clip.dtype) + 0.5) * step - clip


def _calibrate_quantizer(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip range (in σ) and normalised MSE ``c(b)`` for b = 0..8 bits.

    Args:
        z: ``(n,)`` sample of coefficients, each divided by its component's std.
    """
    z = z.flatten().float()
    grid = torch.linspace(0.5, 10.0, 96)
    clip = torch.zeros(MAX_BITS + 1)
    dist = torch.zeros(MAX_BITS + 1, dtype=torch.float64)
    dist[0] = float((z.double() ** 2).mean())
    for b in range(1, MAX_BITS + 1):
        bb = torch.full((1,), b, dtype=torch.int64)
        a = grid[:, None]  # every clip candidate at once: (grid, n)
        q = _dequantize(_quantize(z[None, :], bb, a), bb, a)
        errs = ((q - z[None, :]) ** 2).double().mean(dim=1)
        i = int(errs.argmin())
        clip[b], dist[b] = grid[i], errs[i]
    # Normalise so that c(0) = 1 exactly (the variance of the coefficient itself).
    return clip, convexify(dist / dist[0])


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
    components are biased low in the tail (with fewer tokens than features, the tail is
    exactly zero), which made the predicted error too optimistic.

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
    if (
        isinstance(skip_tokens, bool)
        or not isinstance(skip_tokens, int)
        or not 0 <= skip_tokens < seq
    ):
        raise ValueError(f"skip_tokens must be an int in 0..{seq - 1} (got {skip_tokens!r})")
    if max_components is not None and (
        isinstance(max_components, bool)
        or not isinstance(max_components, int)
        or max_components <= 0
    ):
        raise ValueError(f"max_components must be a positive int or None (got {max_components!r})")
    if isinstance(holdout_every, bool) or not isinstance(holdout_every, int) or holdout_every < 2:
        raise ValueError(f"holdout_every must be an int >= 2 (got {holdout_every!r})")
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
    basis.clip, basis.unit_distortion = _calibrate_quantizer(_sample_coefficients(zs, ws))
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
        undo_rope: de-rotate keys before PCA (recommended; see notebook 05).

    Returns:
        A :class:`KVPCABasis` on the CPU.
    """
    layers = calibration_kv(model, tokenizer, texts, max_tokens=max_tokens, chunk_len=chunk_len)
    inv_freq, scaling = rope_parameters(model) if undo_rope else (None, 1.0)
    basis = fit_basis(
        layers, cross_layer=cross_layer, inv_freq=inv_freq, attention_scaling=scaling,
        skip_tokens=min(sink_tokens, chunk_len - 1), max_components=max_components,
    )  # fmt: skip
    basis.meta["model"] = str(getattr(model.config, "_name_or_path", "")) or model.config.model_type
    return basis


# --------------------------------------------------------------------------------------------
# The codec
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodedInfo:
    """What :meth:`KVTCCodec.inspect` reads from an encoded cache's header."""

    batch: int
    seq_len: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    sink_tokens: int
    recent_tokens: int
    compressed_tokens: int
    coder: str
    nbytes: int
    window_bytes: int
    code_bytes: int

    @property
    def fp16_bytes(self) -> int:
        """Bytes of the same cache as plain fp16 tensors."""
        return 2 * 2 * self.num_layers * self.batch * self.kv_heads * self.seq_len * self.head_dim

    def compression_ratio(self) -> float:
        """fp16 bytes / encoded bytes (everything counted: header, window, codes, checksum)."""
        return self.fp16_bytes / self.nbytes


def _compress(data: bytes, coder: str) -> bytes:
    if coder == "lzma":
        return lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_NONE, preset=6)
    if coder == "zlib":
        return zlib.compress(data, 9)
    return data


def _decompress(data: bytes, coder: str, expected: int) -> bytes:
    try:
        if coder == "lzma":
            out = lzma.decompress(data, format=lzma.FORMAT_XZ)
        elif coder == "zlib":
            out = zlib.decompress(data)
        else:
            out = data
    except (lzma.LZMAError, zlib.error) as exc:
        raise ValueError(
            f"encoded KV cache is corrupted: {coder} stream does not decode ({exc})"
        ) from None
    if len(out) != expected:
        raise ValueError(
            f"encoded KV cache is corrupted: section holds {len(out)} bytes, header says {expected}"
        )
    return out


class KVTCCodec:
    """Encode a DynamicCache to compact bytes with a PCA basis; decode it back.

    Args:
        basis: a :class:`KVPCABasis` fitted for the model whose caches are coded.
        compression: target ratio against fp16 *for the compressed tokens*, before entropy
            coding: the bit allocation spends ``16 · token_dim / compression`` bits per token.
            Entropy coding then shrinks the codes further; the sink/recent window (fp16) is
            added on top. :meth:`EncodedInfo.compression_ratio` gives the real ratio.
        sink_tokens: first tokens kept uncompressed (attention sinks).
        recent_tokens: most recent tokens kept uncompressed (they are read most).
        coder: ``"lzma"`` (best), ``"zlib"`` (faster) or ``"none"``.
        max_bits: the most bits one component may get (1..8).

    The byte format (version 1)::

        "KVTC" | u16 version | u16 flags | u32 header length | header (JSON) |
        window section | bits section | codes section | u32 crc32 of everything before

    The header holds shapes, dtype, window sizes, coder, section lengths and the basis
    fingerprint; decoding checks every one of them and raises ``ValueError`` on any mismatch.
    """

    def __init__(
        self,
        basis: KVPCABasis,
        compression: float = 8.0,
        sink_tokens: int = 4,
        recent_tokens: int = 128,
        coder: str = "lzma",
        max_bits: int = MAX_BITS,
    ) -> None:
        if not isinstance(basis, KVPCABasis):
            raise TypeError(f"basis must be a KVPCABasis (got {type(basis).__name__})")
        if (
            isinstance(compression, bool)
            or not isinstance(compression, int | float)
            or not (math.isfinite(compression) and compression >= 1.0)
        ):
            raise ValueError(f"compression must be a finite number >= 1 (got {compression!r})")
        for name, val in (("sink_tokens", sink_tokens), ("recent_tokens", recent_tokens)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"{name} must be a non-negative int (got {val!r})")
        if coder not in _CODERS:
            raise ValueError(f"coder must be one of {', '.join(_CODERS)} (got {coder!r})")
        if (
            isinstance(max_bits, bool)
            or not isinstance(max_bits, int)
            or not 1 <= max_bits <= MAX_BITS
        ):
            raise ValueError(f"max_bits must be an int in 1..{MAX_BITS} (got {max_bits!r})")
        self.basis = basis
        self.compression = float(compression)
        self.sink_tokens = sink_tokens
        self.recent_tokens = recent_tokens
        self.coder = coder
        self.max_bits = max_bits
        self.budget_bits = int(16 * basis.token_dim / self.compression)
        self.bits = allocate_bits(
            basis.all_variances, self.budget_bits, max_bits=max_bits,
            unit_distortion=basis.unit_distortion[: max_bits + 1],
        )  # fmt: skip
        self._fingerprint = basis.fingerprint()

    # -- predictions -------------------------------------------------------------------------
    def bits_per_block(self) -> list[torch.Tensor]:
        """The allocation split per block (keys blocks first), each ``(r,)``."""
        return list(torch.split(self.bits, [v.numel() for v in self.basis.variances]))

    def predicted_mse(self) -> float:
        """Expected squared error per element of a compressed token (calibration statistics)."""
        c = self.basis.unit_distortion.double()
        err = float((self.basis.all_variances * c[self.bits]).sum()) + sum(self.basis.residual)
        return err / self.basis.token_dim

    def raw_bits_per_token(self) -> int:
        """Bits per compressed token before entropy coding (``Σ_j b_j``)."""
        return int(self.bits.sum())

    # -- encoding ----------------------------------------------------------------------------
    def _check_cache(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        b = self.basis
        k = layers[0][0]
        if len(layers) != b.num_layers or k.shape[1] != b.kv_heads or k.shape[3] != b.head_dim:
            raise ValueError(
                f"cache has {len(layers)} layers x {k.shape[1]} kv_heads x head_dim {k.shape[3]}, "
                f"the basis was fitted for {b.num_layers} x {b.kv_heads} x {b.head_dim}"
            )
        if k.dtype not in _CACHE_DTYPES.values():
            raise ValueError(
                f"cache dtype must be one of {', '.join(_CACHE_DTYPES)} (got {k.dtype})"
            )

    @torch.no_grad()
    def encode(self, cache: Any) -> bytes:
        """Encode a cache whose tokens sit at positions ``0..seq_len-1``.

        Args:
            cache: a transformers ``DynamicCache``; per layer ``(batch, kv_heads, seq_len, head_dim)``.

        Returns:
            The self-describing byte string (see the class docstring).
        """
        layers = cache_tensors(cache)
        self._check_cache(layers)
        batch, _, seq, _ = layers[0][0].shape
        dtype = layers[0][0].dtype
        device = layers[0][0].device
        sink = min(self.sink_tokens, seq)
        recent = min(self.recent_tokens, seq - sink)
        mid = seq - sink - recent
        wdtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
        if dtype == torch.float64 or any(
            (t.abs().amax() > 65000).item() for kv in layers for t in kv if wdtype == torch.float16
        ):
            wdtype = torch.float32  # fp16 would overflow: keep the window exact
        window = b"".join(
            torch.cat([t[:, :, :sink], t[:, :, seq - recent :]], dim=2)
            .to(wdtype).cpu().contiguous().view(torch.uint8).numpy().tobytes()
            for kv in layers for t in kv
        )  # fmt: skip
        codes_raw = b""
        if mid > 0:
            positions = torch.arange(sink, sink + mid, device=device)
            feats = self.basis.features(
                [(k[:, :, sink : sink + mid], v[:, :, sink : sink + mid]) for k, v in layers],
                positions,
            )
            parts = []
            for f, mean, comps, var, bits in zip(
                feats, self.basis.means, self.basis.components, self.basis.variances,
                self.bits_per_block(), strict=True,
            ):  # fmt: skip
                active = torch.nonzero(bits > 0).flatten()
                if active.numel() == 0:
                    continue
                act = active.to(comps.device)
                coef = (f - mean.to(f.device)) @ comps.to(f.device)[:, act]
                z = coef / var.to(f.device)[act].clamp_min(1e-20).sqrt()
                b = bits[active].to(f.device)
                codes = _quantize(z, b, self.basis.clip.to(f.device)[b])
                parts.append(codes.T.to(torch.uint8).cpu().contiguous())  # component-major
            if parts:
                codes_raw = torch.cat([p.flatten() for p in parts]).numpy().tobytes()
        bits_raw = self.bits.to(torch.uint8).cpu().numpy().tobytes()
        sections = [
            _compress(window, "zlib" if self.coder != "none" else "none"),
            _compress(bits_raw, "zlib" if self.coder != "none" else "none"),
            _compress(codes_raw, self.coder),
        ]
        header = {
            "batch": batch, "seq_len": seq, "num_layers": len(layers),
            "kv_heads": self.basis.kv_heads, "head_dim": self.basis.head_dim,
            "dtype": str(dtype).replace("torch.", ""), "window_dtype": str(wdtype).replace("torch.", ""),
            "sink": sink, "recent": recent, "coder": self.coder,
            "window_coder": "zlib" if self.coder != "none" else "none",
            "raw": [len(window), len(bits_raw), len(codes_raw)],
            "sections": [len(s) for s in sections], "basis": self._fingerprint,
            "compression": self.compression,
        }  # fmt: skip
        hbytes = json.dumps(header, separators=(",", ":")).encode()
        body = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(hbytes)) + hbytes + b"".join(sections)
        return body + struct.pack("<I", zlib.crc32(body))

    # -- decoding ----------------------------------------------------------------------------
    @staticmethod
    def _parse(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"data must be bytes (got {type(data).__name__})")
        data = bytes(data)
        if len(data) < _PREFIX.size + 4:
            raise ValueError(
                f"encoded KV cache is truncated ({len(data)} bytes, too short for a header)"
            )
        magic, version, _flags, hlen = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise ValueError(f"not a KVTC-encoded cache (magic {magic!r}, expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"unsupported KVTC format version {version} (this kvlib reads {FORMAT_VERSION})"
            )
        (crc,) = struct.unpack_from("<I", data, len(data) - 4)
        if zlib.crc32(data[:-4]) != crc:
            raise ValueError("encoded KV cache is corrupted or truncated (crc32 checksum mismatch)")
        end = _PREFIX.size + hlen
        try:
            header = json.loads(data[_PREFIX.size : end])
            sizes = [int(s) for s in header["sections"]]
        except (ValueError, KeyError, TypeError):
            raise ValueError("encoded KV cache has an unreadable header") from None
        if end + sum(sizes) != len(data) - 4:
            raise ValueError("encoded KV cache is corrupted: section lengths do not add up")
        sections, pos = [], end
        for s in sizes:
            sections.append(data[pos : pos + s])
            pos += s
        return header, sections

    def inspect(self, data: bytes) -> EncodedInfo:
        """Header facts and byte counts of an encoded cache (validates the checksum)."""
        h, sections = self._parse(data)
        return EncodedInfo(
            batch=h["batch"], seq_len=h["seq_len"], num_layers=h["num_layers"],
            kv_heads=h["kv_heads"], head_dim=h["head_dim"], dtype=h["dtype"],
            sink_tokens=h["sink"], recent_tokens=h["recent"],
            compressed_tokens=h["seq_len"] - h["sink"] - h["recent"], coder=h["coder"],
            nbytes=len(data), window_bytes=len(sections[0]), code_bytes=len(sections[2]),
        )  # fmt: skip

    @torch.no_grad()
    def decode(self, data: bytes, device: str | torch.device | None = None) -> Any:
        """Rebuild a ``DynamicCache`` from :meth:`encode`'s bytes.

        Args:
            data: the encoded bytes.
            device: where to put the tensors (default: where the basis lives).

        Raises:
            ValueError: wrong magic/version, bad checksum, truncated data, or bytes encoded with
                a different basis or model shape.
        """
        from transformers import DynamicCache

        h, sections = self._parse(data)
        b = self.basis
        try:
            batch, seq, nl = int(h["batch"]), int(h["seq_len"]), int(h["num_layers"])
            heads, hd, sink, recent = (
                int(h["kv_heads"]),
                int(h["head_dim"]),
                int(h["sink"]),
                int(h["recent"]),
            )
            dtype, wdtype = _CACHE_DTYPES[h["dtype"]], _WINDOW_DTYPES[h["window_dtype"]]
            coder, wcoder = h["coder"], h["window_coder"]
            raw = [int(r) for r in h["raw"]]
            fingerprint = int(h["basis"])
        except (KeyError, TypeError, ValueError):
            raise ValueError("encoded KV cache has an incomplete or invalid header") from None
        if fingerprint != self._fingerprint:
            raise ValueError(
                "encoded KV cache was made with a different PCA basis (fingerprint mismatch); "
                "decode it with the codec's own basis"
            )
        if (nl, heads, hd) != (b.num_layers, b.kv_heads, b.head_dim):
            raise ValueError("encoded KV cache shape does not match the basis")
        if coder not in _CODERS or wcoder not in _CODERS:
            raise ValueError(f"encoded KV cache names an unknown coder {coder!r}")
        if min(batch, seq) < 1 or sink < 0 or recent < 0 or sink + recent > seq:
            raise ValueError("encoded KV cache header has inconsistent sizes")
        mid = seq - sink - recent
        win_tokens = sink + recent
        wsize = torch.tensor([], dtype=wdtype).element_size()
        expect_window = 2 * nl * batch * heads * win_tokens * hd * wsize
        if raw[0] != expect_window or raw[1] != sum(v.numel() for v in b.variances):
            raise ValueError("encoded KV cache header sizes do not match its shapes")
        window = _decompress(sections[0], wcoder, raw[0])
        bits = torch.frombuffer(
            bytearray(_decompress(sections[1], wcoder, raw[1])), dtype=torch.uint8
        ).long()
        if (bits > MAX_BITS).any():
            raise ValueError("encoded KV cache holds invalid bit widths")
        blocks_bits = list(torch.split(bits, [v.numel() for v in b.variances]))
        n_active = int((bits > 0).sum())
        expect_codes = n_active * batch * mid if mid > 0 else 0
        if raw[2] != expect_codes:
            raise ValueError("encoded KV cache code section size does not match its shapes")
        codes_all = _decompress(sections[2], coder, raw[2])
        dev = torch.device(device) if device is not None else b.components[0].device

        # window tensors, in the order written by encode: layer by layer, keys then values
        wt = (
            torch.frombuffer(bytearray(window), dtype=torch.uint8)
            if window
            else torch.zeros(0, dtype=torch.uint8)
        )
        per = batch * heads * win_tokens * hd
        wins = wt.view(wdtype).reshape(2 * nl, per) if per else None

        mid_layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if mid > 0:
            codes_t = (
                torch.frombuffer(bytearray(codes_all), dtype=torch.uint8) if codes_all else None
            )
            feats, pos = [], 0
            ntok = batch * mid
            for mean, comps, var, bb in zip(
                b.means, b.components, b.variances, blocks_bits, strict=True
            ):
                active = torch.nonzero(bb > 0).flatten()
                base = mean.to(dev).float().expand(ntok, -1)
                if active.numel():
                    assert codes_t is not None
                    n = active.numel() * ntok
                    codes = codes_t[pos : pos + n].reshape(active.numel(), ntok).T.to(dev).long()
                    pos += n
                    bbits = bb[active].to(dev)
                    if (codes >= (2**bbits)).any():
                        raise ValueError(
                            "encoded KV cache holds codes out of range for their bit widths"
                        )
                    act = active.to(dev)
                    z = _dequantize(codes, bbits, b.clip.to(dev)[bbits])
                    coef = z * var.to(dev)[act].clamp_min(1e-20).sqrt()
                    base = base + coef @ comps.to(dev)[:, act].T
                feats.append(base)
            positions = torch.arange(sink, sink + mid, device=dev)
            mid_layers = b.unfeatures(feats, batch, positions, dtype)

        data_layers = []
        for layer in range(nl):
            kv = []
            for kind in (0, 1):
                parts = []
                w = (
                    wins[2 * layer + kind].reshape(batch, heads, win_tokens, hd).to(dev, dtype)
                    if wins is not None
                    else None
                )
                if w is not None and sink:
                    parts.append(w[:, :, :sink])
                if mid_layers is not None:
                    parts.append(mid_layers[layer][kind])
                if w is not None and recent:
                    parts.append(w[:, :, sink:])
                kv.append(torch.cat(parts, dim=2).contiguous())
            data_layers.append((kv[0], kv[1]))
        return DynamicCache(ddp_cache_data=data_layers)
