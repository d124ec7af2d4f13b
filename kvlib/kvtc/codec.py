"""KV Cache Transform Coding: a DynamicCache to compact bytes and back (introduced in notebook 06).

Given a :class:`kvlib.kvtc.basis.KVPCABasis` fitted for a model, :class:`KVTCCodec` projects each
token's keys and values on the basis's components, quantizes every component with the bits a
budget allocates to it (:func:`kvlib.kvtc.bitalloc.allocate_bits`; many get 0 bits: dropped), then
entropy-codes the codes with a standard-library codec (``lzma`` by default). The first
``sink_tokens`` and the last ``recent_tokens`` stay uncompressed (fp16). This follows NVIDIA's
*KV Cache Transform Coding* (Staniszewski & Łańcucki, arXiv 2511.01815), re-implemented from the
paper's description. It targets storing a conversation's cache between turns or off the GPU,
not the per-step path.

The byte format (:data:`MAGIC`, :data:`FORMAT_VERSION`) is self-describing and checked on
decoding; :class:`EncodedInfo` is what its header tells without decoding. Caches are read and
built through :mod:`kvlib.compat`. Tensor shapes follow transformers: a layer's keys/values are
``(batch, kv_heads, seq_len, head_dim)``.

On a model that mixes sliding-window and global layers (Gemma 3), the basis codes the global
layers (:attr:`KVPCABasis.coded_layers`), and each sliding layer's window is stored whole in
the window's dtype: it holds a fixed number of tokens, while the global layers grow with the
context. The decoded cache has the same sliding layers as the encoded one.
"""

from __future__ import annotations

import json
import lzma
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvlib import compat
from kvlib.kvtc.basis import KVPCABasis
from kvlib.kvtc.bitalloc import MAX_BITS, allocate_bits, uniform_dequantize, uniform_quantize
from kvlib.validate import check_int, check_number

__all__ = ["KVTCCodec", "EncodedInfo", "MAGIC", "FORMAT_VERSION", "READABLE_VERSIONS"]

MAGIC = b"KVTC"
FORMAT_VERSION = 2
#: Versions :meth:`KVTCCodec.decode` reads: version 1 (before 2026-12-07) had no whole layers.
READABLE_VERSIONS = (1, 2)
_CODERS = ("lzma", "zlib", "none")  # entropy coders of the codes section
_PREFIX = struct.Struct("<4sHHI")  # magic, version, flags, header length
_WINDOW_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_CACHE_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


# --------------------------------------------------------------------------------------------
# The byte format
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
    layer_tokens: tuple[int, ...]
    coded_layers: tuple[int, ...]
    whole_bytes: int

    def _fp16(self, layers: Iterable[int]) -> int:
        per_token = 2 * 2 * self.batch * self.kv_heads * self.head_dim  # keys + values, fp16
        return per_token * sum(self.layer_tokens[i] for i in layers)

    @property
    def fp16_bytes(self) -> int:
        """Bytes of the same cache as plain fp16 tensors (every layer, as many tokens as it holds)."""
        return self._fp16(range(self.num_layers))

    @property
    def coded_fp16_bytes(self) -> int:
        """fp16 bytes of the layers the basis codes (all of them on a full-attention model)."""
        return self._fp16(self.coded_layers)

    def compression_ratio(self) -> float:
        """fp16 bytes / encoded bytes (everything counted: header, window, codes, whole layers,
        checksum)."""
        return self.fp16_bytes / self.nbytes

    def coded_compression_ratio(self) -> float:
        """The ratio over the coded layers: their fp16 bytes / the encoded bytes less the
        layers stored whole. On a hybrid model this is what the growing part of the cache
        shrinks by; on a full-attention model it equals :meth:`compression_ratio`."""
        return self.coded_fp16_bytes / (self.nbytes - self.whole_bytes)


@dataclass(frozen=True)
class _Header:
    """The sizes, dtypes and coders of an encoded cache, as :meth:`KVTCCodec.decode` reads them."""

    batch: int
    seq: int
    num_layers: int
    heads: int
    head_dim: int
    sink: int
    recent: int
    dtype: torch.dtype
    wdtype: torch.dtype
    coder: str
    wcoder: str
    raw: list[int]
    coded: tuple[int, ...]
    layer_tokens: tuple[int, ...]
    windows: tuple[int | None, ...]

    @property
    def mid(self) -> int:
        """Compressed tokens, between the sinks and the recent tokens."""
        return self.seq - self.sink - self.recent

    @property
    def win_tokens(self) -> int:
        """Tokens of a coded layer kept uncompressed (sinks and recent)."""
        return self.sink + self.recent

    @property
    def whole(self) -> list[int]:
        """The layers stored whole (sliding windows): every layer the basis does not code."""
        return [i for i in range(self.num_layers) if i not in self.coded]


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


def _pack(header: dict[str, Any], sections: list[bytes]) -> bytes:
    """``prefix | header (JSON) | sections | crc32`` (see :class:`KVTCCodec`)."""
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(hbytes)) + hbytes + b"".join(sections)
    return body + struct.pack("<I", zlib.crc32(body))


def _unpack(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """Inverse of :func:`_pack`: ``(header, sections)``, after checking magic, version, crc32
    and section lengths (``TypeError`` for non-bytes, ``ValueError`` for anything wrong)."""
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
    if version not in READABLE_VERSIONS:
        raise ValueError(
            f"unsupported KVTC format version {version} (this kvlib reads "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
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


# --------------------------------------------------------------------------------------------
# The codec
# --------------------------------------------------------------------------------------------


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

    The byte format (version 2)::

        "KVTC" | u16 version | u16 flags | u32 header length | header (JSON) |
        window section | bits section | codes section | whole-layers section |
        u32 crc32 of everything before

    The header holds shapes, dtype, window sizes, the tokens each layer holds and its sliding
    window, coder, section lengths and the basis fingerprint; decoding checks every one of them
    and raises ``ValueError`` on any mismatch. The whole-layers section holds the layers the
    basis does not code (a hybrid model's sliding windows; empty on a full-attention model).
    Version 1 bytes (no whole-layers section) still decode.
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
        if check_number(compression, "compression") < 1.0:
            raise ValueError(f"compression must be a finite number >= 1 (got {compression!r})")
        sink_tokens = check_int(sink_tokens, "sink_tokens", minimum=0)
        recent_tokens = check_int(recent_tokens, "recent_tokens", minimum=0)
        if coder not in _CODERS:
            raise ValueError(f"coder must be one of {', '.join(_CODERS)} (got {coder!r})")
        if check_int(max_bits, "max_bits", minimum=1) > MAX_BITS:
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
        tokens = {i: layers[i][0].shape[2] for i in b.coded_layers}
        if len(set(tokens.values())) > 1:
            raise ValueError(
                f"the layers the basis codes hold different numbers of tokens {tokens}: was the "
                "basis fitted for a model with sliding-window layers? (kvlib.kvtc.pca.fit_kv_pca "
                "codes the global layers of such a model)"
            )
        if k.dtype not in _CACHE_DTYPES.values():
            raise ValueError(
                f"cache dtype must be one of {', '.join(_CACHE_DTYPES)} (got {k.dtype})"
            )

    @torch.no_grad()
    def encode(self, cache: Any) -> bytes:
        """Encode a cache whose tokens sit at positions ``0..seq_len-1``.

        Args:
            cache: a transformers ``DynamicCache``; per layer ``(batch, kv_heads, seq_len,
                head_dim)``, a sliding layer's ``seq_len`` no more than its window.

        Returns:
            The self-describing byte string (see the class docstring).
        """
        layers = compat.cache_tensors(cache)
        windows = compat.cache_windows(cache)
        self._check_cache(layers)
        coded = self.basis.coded_layers
        whole = [i for i in range(len(layers)) if i not in coded]
        batch, _, seq, _ = layers[coded[0]][0].shape
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
            for i in coded for t in layers[i]
        )  # fmt: skip
        whole_raw = b"".join(
            t.to(wdtype).cpu().contiguous().view(torch.uint8).numpy().tobytes()
            for i in whole for t in layers[i]
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
                codes = uniform_quantize(z, b, self.basis.clip.to(f.device)[b])
                parts.append(codes.T.to(torch.uint8).cpu().contiguous())  # component-major
            if parts:
                codes_raw = torch.cat([p.flatten() for p in parts]).numpy().tobytes()
        bits_raw = self.bits.to(torch.uint8).cpu().numpy().tobytes()
        wcoder = "zlib" if self.coder != "none" else "none"
        sections = [
            _compress(window, wcoder),
            _compress(bits_raw, wcoder),
            _compress(codes_raw, self.coder),
            _compress(whole_raw, wcoder) if whole_raw else b"",  # empty on full attention
        ]
        header = {
            "batch": batch, "seq_len": seq, "num_layers": len(layers),
            "kv_heads": self.basis.kv_heads, "head_dim": self.basis.head_dim,
            "dtype": str(dtype).replace("torch.", ""), "window_dtype": str(wdtype).replace("torch.", ""),
            "sink": sink, "recent": recent, "coder": self.coder,
            "window_coder": wcoder,
            "raw": [len(window), len(bits_raw), len(codes_raw), len(whole_raw)],
            "sections": [len(s) for s in sections], "basis": self._fingerprint,
            "compression": self.compression,
            "layer_tokens": [k.shape[2] for k, _ in layers], "windows": windows,
            "coded_layers": coded,
        }  # fmt: skip
        return _pack(header, sections)

    # -- decoding ----------------------------------------------------------------------------
    def inspect(self, data: bytes) -> EncodedInfo:
        """Header facts and byte counts of an encoded cache (validates the checksum)."""
        h, sections = _unpack(data)
        hdr = self._read_header(h, against_basis=False)
        return EncodedInfo(
            batch=hdr.batch, seq_len=hdr.seq, num_layers=hdr.num_layers,
            kv_heads=hdr.heads, head_dim=hdr.head_dim, dtype=h["dtype"],
            sink_tokens=hdr.sink, recent_tokens=hdr.recent, compressed_tokens=hdr.mid,
            coder=hdr.coder, nbytes=len(data), window_bytes=len(sections[0]),
            code_bytes=len(sections[2]), layer_tokens=hdr.layer_tokens, coded_layers=hdr.coded,
            whole_bytes=len(sections[3]) if len(sections) > 3 else 0,
        )  # fmt: skip

    def _read_header(self, h: dict[str, Any], against_basis: bool = True) -> _Header:
        """The header's sizes and coders, checked against each other and (``against_basis``)
        against the codec's basis."""
        b = self.basis
        try:
            batch, seq, nl = int(h["batch"]), int(h["seq_len"]), int(h["num_layers"])
            heads, hd = int(h["kv_heads"]), int(h["head_dim"])
            sink, recent = int(h["sink"]), int(h["recent"])
            dtype, wdtype = _CACHE_DTYPES[h["dtype"]], _WINDOW_DTYPES[h["window_dtype"]]
            coder, wcoder = h["coder"], h["window_coder"]
            raw = [int(r) for r in h["raw"]]
            fingerprint = int(h["basis"])
            layer_tokens = tuple(int(t) for t in h.get("layer_tokens", [seq] * nl))
            windows = tuple(None if w is None else int(w) for w in h.get("windows", [None] * nl))
            coded = tuple(int(i) for i in h.get("coded_layers", range(nl)))
        except (KeyError, TypeError, ValueError):
            raise ValueError("encoded KV cache has an incomplete or invalid header") from None
        if against_basis and fingerprint != self._fingerprint:
            raise ValueError(
                "encoded KV cache was made with a different PCA basis (fingerprint mismatch); "
                "decode it with the codec's own basis"
            )
        if against_basis and (nl, heads, hd, coded) != (
            b.num_layers, b.kv_heads, b.head_dim, tuple(b.coded_layers),
        ):  # fmt: skip
            raise ValueError("encoded KV cache shape does not match the basis")
        if coder not in _CODERS or wcoder not in _CODERS:
            raise ValueError(f"encoded KV cache names an unknown coder {coder!r}")
        if min(batch, seq) < 1 or sink < 0 or recent < 0 or sink + recent > seq:
            raise ValueError("encoded KV cache header has inconsistent sizes")
        if (
            not coded
            or list(coded) != sorted(set(coded))
            or not 0 <= coded[0] <= coded[-1] < nl
            or len(layer_tokens) != nl
            or len(windows) != nl
            or len(raw) != len(h["sections"])
            or any(layer_tokens[i] != seq for i in coded)
            or any(not 0 < t <= seq for t in layer_tokens)
            or any(w is not None and w < 1 for w in windows)
        ):
            raise ValueError("encoded KV cache header has inconsistent layer sizes")
        return _Header(
            batch, seq, nl, heads, hd, sink, recent, dtype, wdtype, coder, wcoder, raw,
            coded, layer_tokens, windows,
        )  # fmt: skip

    def _read_sections(
        self, hdr: _Header, sections: list[bytes]
    ) -> tuple[bytes, list[torch.Tensor], bytes, bytes]:
        """The decompressed window bytes, the bits per block (each ``(r,)``), the code bytes
        and the whole layers' bytes, their sizes checked against the header."""
        b = self.basis
        batch, heads, hd, raw = hdr.batch, hdr.heads, hdr.head_dim, hdr.raw
        wsize = torch.tensor([], dtype=hdr.wdtype).element_size()
        per_token = 2 * batch * heads * hd * wsize  # keys + values of one layer
        expect_window = len(hdr.coded) * per_token * hdr.win_tokens
        expect_whole = per_token * sum(hdr.layer_tokens[i] for i in hdr.whole)
        if (
            raw[0] != expect_window
            or raw[1] != sum(v.numel() for v in b.variances)
            or (raw[3] if len(raw) > 3 else 0) != expect_whole
        ):
            raise ValueError("encoded KV cache header sizes do not match its shapes")
        window = _decompress(sections[0], hdr.wcoder, raw[0])
        whole = b""
        if len(raw) > 3 and (raw[3] or sections[3]):
            whole = _decompress(sections[3], hdr.wcoder, raw[3])
        bits = torch.frombuffer(
            bytearray(_decompress(sections[1], hdr.wcoder, raw[1])), dtype=torch.uint8
        ).long()
        if (bits > MAX_BITS).any():
            raise ValueError("encoded KV cache holds invalid bit widths")
        blocks_bits = list(torch.split(bits, [v.numel() for v in b.variances]))
        n_active = int((bits > 0).sum())
        expect_codes = n_active * batch * hdr.mid if hdr.mid > 0 else 0
        if raw[2] != expect_codes:
            raise ValueError("encoded KV cache code section size does not match its shapes")
        codes_all = _decompress(sections[2], hdr.coder, raw[2])
        return window, blocks_bits, codes_all, whole

    def _decode_middle(
        self,
        codes_all: bytes,
        blocks_bits: list[torch.Tensor],
        hdr: _Header,
        dev: torch.device,
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """The compressed tokens rebuilt from their codes: per layer ``(keys, values)``,
        ``(batch, kv_heads, mid, head_dim)`` in the cache's dtype, RoPE re-applied (``None``
        for a layer stored whole)."""
        b = self.basis
        batch, sink, mid = hdr.batch, hdr.sink, hdr.mid
        codes_t = torch.frombuffer(bytearray(codes_all), dtype=torch.uint8) if codes_all else None
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
                z = uniform_dequantize(codes, bbits, b.clip.to(dev)[bbits])
                coef = z * var.to(dev)[act].clamp_min(1e-20).sqrt()
                base = base + coef @ comps.to(dev)[:, act].T
            feats.append(base)
        positions = torch.arange(sink, sink + mid, device=dev)
        return b.unfeatures(feats, batch, positions, hdr.dtype)

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
        h, sections = _unpack(data)
        hdr = self._read_header(h)
        window, blocks_bits, codes_all, whole = self._read_sections(hdr, sections)
        dev = torch.device(device) if device is not None else self.basis.components[0].device
        wins = _window_rows(window, hdr)
        mid_layers: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
        if hdr.mid > 0:
            mid_layers = self._decode_middle(codes_all, blocks_bits, hdr, dev)
        layers = _join_layers(hdr, wins, mid_layers, dev) | _whole_layers(whole, hdr, dev)
        in_order = [layers[i] for i in range(hdr.num_layers)]
        if all(w is None for w in hdr.windows):
            return compat.dynamic_cache_from(in_order)
        return compat.dynamic_cache_from(in_order, hdr.windows, seq_len=hdr.seq)


def _window_rows(window: bytes, hdr: _Header) -> torch.Tensor | None:
    """The window tensors flat, ``(2 * coded layers, batch · kv_heads · window · head_dim)`` in
    the order :meth:`KVTCCodec.encode` wrote them (coded layer by layer, keys then values);
    ``None`` when the window is empty."""
    wt = (
        torch.frombuffer(bytearray(window), dtype=torch.uint8)
        if window
        else torch.zeros(0, dtype=torch.uint8)
    )
    per = hdr.batch * hdr.heads * hdr.win_tokens * hdr.head_dim
    return wt.view(hdr.wdtype).reshape(2 * len(hdr.coded), per) if per else None


def _whole_layers(
    whole: bytes, hdr: _Header, dev: torch.device
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The layers stored whole, by layer index: ``(keys, values)``, each ``(batch, kv_heads,
    tokens, head_dim)`` in the cache's dtype."""
    flat = torch.frombuffer(bytearray(whole), dtype=torch.uint8) if whole else None
    out, pos = {}, 0
    for layer in hdr.whole:
        shape = (hdr.batch, hdr.heads, hdr.layer_tokens[layer], hdr.head_dim)
        n = shape[0] * shape[1] * shape[2] * shape[3] * hdr.wdtype.itemsize
        kv = []
        for _ in (0, 1):
            assert flat is not None
            kv.append(flat[pos : pos + n].view(hdr.wdtype).reshape(shape).to(dev, hdr.dtype))
            pos += n
        out[layer] = (kv[0], kv[1])
    return out


def _join_layers(
    hdr: _Header,
    wins: torch.Tensor | None,
    mid_layers: list[tuple[torch.Tensor, torch.Tensor] | None] | None,
    dev: torch.device,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per coded layer, by index, ``(keys, values)``, ``(batch, kv_heads, seq_len, head_dim)``:
    the sinks, the decoded middle and the recent tokens joined in order."""
    batch, heads, hd, dtype = hdr.batch, hdr.heads, hdr.head_dim, hdr.dtype
    sink, recent, win_tokens = hdr.sink, hdr.recent, hdr.win_tokens
    data_layers = {}
    for j, layer in enumerate(hdr.coded):
        kv = []
        for kind in (0, 1):
            parts = []
            w = (
                wins[2 * j + kind].reshape(batch, heads, win_tokens, hd).to(dev, dtype)
                if wins is not None
                else None
            )
            if w is not None and sink:
                parts.append(w[:, :, :sink])
            if mid_layers is not None:
                mid = mid_layers[layer]
                assert mid is not None  # every coded layer has a middle
                parts.append(mid[kind])
            if w is not None and recent:
                parts.append(w[:, :, sink:])
            kv.append(torch.cat(parts, dim=2).contiguous())
        data_layers[layer] = (kv[0], kv[1])
    return data_layers
