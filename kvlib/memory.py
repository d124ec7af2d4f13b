"""KV-cache memory math: model specs, cache bytes, and what fits in a GPU (notebook 01).

During generation every attention layer keeps the keys and values of all earlier tokens, so the
next token can attend to them without recomputing them. For a plain (full-attention) layer that
cache holds, per token, one key and one value vector per KV head::

    bytes = 2 × num_layers × num_kv_heads × head_dim × bytes_per_element × tokens × batch
            ^K and V

Variants change one factor each:

* **MHA** (multi-head attention): ``num_kv_heads == num_heads`` (Llama-2-7B).
* **GQA** (grouped-query attention): ``1 < num_kv_heads < num_heads``; several query heads share
  one K/V head (Llama-3, Qwen2.5, Mistral).
* **MQA** (multi-query attention): ``num_kv_heads == 1`` (Falcon-7B).
* **MLA** (multi-head latent attention, DeepSeek-V2/V3): no per-head K/V at all; each layer caches
  one compressed latent of ``kv_lora_rank`` values plus one shared RoPE key of
  ``qk_rope_head_dim`` values per token (512 + 64 = 576 for DeepSeek-V3), and the heads are
  re-expanded from it at attention time.
* **Sliding-window layers** (Mistral-7B v0.1, Gemma-2, Gemma-3) only attend to the last
  ``sliding_window`` tokens, so their cache stops growing at ``min(tokens, sliding_window)``.

All byte counts are exact integers. Quantized caches (bits < 16) are counted as payload only,
unless ``group_size`` is given, in which case one fp16 scale and one fp16 zero-point per group of
``group_size`` values along ``head_dim`` (or along the MLA latent) are added.
"""

from __future__ import annotations

import difflib
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "ACCEPTED_BITS",
    "GPUS",
    "REGISTRY",
    "UNBOUNDED",
    "ModelSpec",
    "get_spec",
    "human_bytes",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "list_specs",
    "max_batch",
    "max_context",
    "spec_from_config",
]

#: Bit widths accepted for cache elements and weights.
ACCEPTED_BITS: tuple[int, ...] = (2, 3, 4, 8, 16, 32)

#: Returned by :func:`max_context` when memory puts no limit on the context (every layer is
#: sliding-window and the full windows fit).
UNBOUNDED: int = sys.maxsize

#: Bytes of one fp16 scale plus one fp16 zero-point, stored per quantization group.
_GROUP_META_BITS = 2 * 16

_LAYER_KIND_ALIASES = {
    "full": "full",
    "full_attention": "full",
    "global": "full",
    "sliding": "sliding",
    "sliding_attention": "sliding",
    "local": "sliding",
    "chunked_attention": "sliding",
}


def _check_bits(bits: Any, name: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in ACCEPTED_BITS:
        accepted = ", ".join(str(b) for b in ACCEPTED_BITS)
        raise ValueError(f"{name} must be one of {accepted} (got {bits!r})")
    return bits


def _check_int(value: Any, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np  # numpy ints (e.g. from a pandas column) are fine

            if isinstance(value, np.integer):
                value = int(value)
            else:
                raise TypeError
        except (ImportError, TypeError):
            raise TypeError(
                f"{name} must be an integer (got {type(value).__name__} {value!r})"
            ) from None
    if value < minimum:
        what = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {what} (got {value})")
    return value


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ModelSpec:
    """The shape facts of a decoder that decide its KV-cache size.

    Attributes:
        name: registry-style name, e.g. ``"llama-3.1-8b"``.
        num_layers: decoder layers (``num_hidden_layers``).
        num_heads: query heads per layer (``num_attention_heads``).
        num_kv_heads: key/value heads per layer (``num_key_value_heads``); equal to
            ``num_heads`` for MHA, 1 for MQA. For MLA models this is the number of heads the
            latent is expanded into and does not enter the cache size.
        head_dim: size of one key (= value) vector. For MLA models: the per-head value size,
            used only for the "what would it cost without MLA" comparison.
        num_params: total parameter count (all experts for MoE), for weights memory.
        sliding_window: attention window of the sliding-window layers, or ``None``.
        layer_types: per-layer ``"full"`` / ``"sliding"`` (transformers' ``"full_attention"`` /
            ``"sliding_attention"`` are accepted and normalised). ``None`` means: every layer
            is sliding if ``sliding_window`` is set (Mistral-7B v0.1), else every layer is full.
        kv_lora_rank: MLA latent size cached per layer per token (512 for DeepSeek-V3).
        qk_rope_head_dim: MLA decoupled RoPE key size cached per layer per token (64).
        vocab_size, hidden_size, max_position_embeddings: optional context facts.
        source: where the figures come from (config.json on the hub, paper).
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    max_position_embeddings: int | None = None
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a string (got {type(self.name).__name__})")
        for attr in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            _check_int(getattr(self, attr), attr, minimum=1)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                f"({self.num_kv_heads}): each KV head serves a whole group of query heads"
            )
        for attr in (
            "num_params",
            "sliding_window",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "vocab_size",
            "hidden_size",
            "max_position_embeddings",
        ):
            value = getattr(self, attr)
            if value is not None:
                _check_int(value, attr, minimum=1)
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError(
                "MLA needs both kv_lora_rank and qk_rope_head_dim (got "
                f"kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim})"
            )
        if self.layer_types is not None:
            if isinstance(self.layer_types, str):
                raise TypeError("layer_types must be a sequence of strings, one per layer")
            kinds = []
            for i, kind in enumerate(self.layer_types):
                if kind not in _LAYER_KIND_ALIASES:
                    accepted = ", ".join(sorted(_LAYER_KIND_ALIASES))
                    raise ValueError(f"layer_types[{i}] must be one of {accepted} (got {kind!r})")
                kinds.append(_LAYER_KIND_ALIASES[kind])
            if len(kinds) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(kinds)} entries but num_layers is {self.num_layers}"
                )
            if "sliding" in kinds and self.sliding_window is None:
                raise ValueError("layer_types has sliding layers but sliding_window is None")
            object.__setattr__(self, "layer_types", tuple(kinds))

    # -- structure ---------------------------------------------------------------------------

    @property
    def attention_type(self) -> str:
        """``"MLA"``, ``"MQA"`` (1 KV head), ``"MHA"`` (as many KV heads as query heads) or
        ``"GQA"`` (in between)."""
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == 1 and self.num_heads > 1:
            return "MQA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "GQA"

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank is not None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (``num_heads // num_kv_heads``)."""
        return self.num_heads // self.num_kv_heads

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Per-layer ``"full"`` / ``"sliding"``, with the ``layer_types=None`` default resolved."""
        if self.layer_types is not None:
            return self.layer_types
        kind = "sliding" if self.sliding_window is not None else "full"
        return (kind,) * self.num_layers

    @property
    def num_sliding_layers(self) -> int:
        """Layers whose cache is capped at ``sliding_window`` tokens."""
        return self.layer_kinds.count("sliding")

    @property
    def num_full_layers(self) -> int:
        """Layers whose cache grows with every token."""
        return self.num_layers - self.num_sliding_layers

    @property
    def elements_per_token_per_layer(self) -> int:
        """Cached values per token in one layer: ``2 × num_kv_heads × head_dim`` (K and V), or
        ``kv_lora_rank + qk_rope_head_dim`` for MLA."""
        if self.is_mla:
            assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def tokens_cached(self, seq_len: int) -> tuple[int, ...]:
        """Tokens each layer holds after ``seq_len`` tokens: ``seq_len`` for full layers,
        ``min(seq_len, sliding_window)`` for sliding ones."""
        seq_len = _check_int(seq_len, "seq_len", minimum=0)
        window = self.sliding_window
        return tuple(
            min(seq_len, window) if kind == "sliding" and window is not None else seq_len
            for kind in self.layer_kinds
        )

    # -- bytes --------------------------------------------------------------------------------

    def kv_bytes_per_token(self, bits: int = 16, group_size: int | None = None) -> int:
        """Bytes one token adds to the cache while it is inside every window (all layers).

        Same as :func:`kv_bytes_per_token`. Rounded up to whole bytes if ``bits`` makes it
        fractional (3-bit with odd sizes); :func:`kv_cache_bytes` rounds only once, at the end.
        """
        return kv_bytes_per_token(self, bits=bits, group_size=group_size)

    def weights_bytes(self, bits: int = 16) -> int:
        """Memory of the weights stored at ``bits`` per parameter: ``ceil(num_params × bits / 8)``.

        Raises:
            ValueError: ``num_params`` is unknown, or ``bits`` is not accepted.
        """
        bits = _check_bits(bits, "bits")
        if self.num_params is None:
            raise ValueError(f"num_params is unknown for {self.name!r}; set it to size weights")
        return _ceil_div(self.num_params * bits, 8)

    def without_mla(self) -> ModelSpec:
        """The same model with plain per-head K/V (``num_kv_heads × head_dim``) instead of
        the MLA latent: what the cache would cost without MLA."""
        return replace(self, name=f"{self.name} (no MLA)", kv_lora_rank=None, qk_rope_head_dim=None)


# -- the formula ----------------------------------------------------------------------------


def _group_meta_bits_per_vector(length: int, bits: int, group_size: int | None) -> int:
    """Scale + zero-point bits for one cached vector of ``length`` values."""
    if group_size is None or bits >= 16:
        return 0
    return _ceil_div(length, group_size) * _GROUP_META_BITS


def _bits_per_token_per_layer(spec: ModelSpec, bits: int, group_size: int | None) -> int:
    """Bits one token costs in one layer, payload plus optional quantization metadata."""
    payload = spec.elements_per_token_per_layer * bits
    if spec.is_mla:
        assert spec.kv_lora_rank is not None and spec.qk_rope_head_dim is not None
        meta = _group_meta_bits_per_vector(spec.kv_lora_rank, bits, group_size)
        meta += _group_meta_bits_per_vector(spec.qk_rope_head_dim, bits, group_size)
    else:
        # one K vector and one V vector per KV head
        meta = 2 * spec.num_kv_heads * _group_meta_bits_per_vector(spec.head_dim, bits, group_size)
    return payload + meta


def _check_group_size(group_size: Any) -> int | None:
    if group_size is None:
        return None
    return _check_int(group_size, "group_size", minimum=1)


def _check_spec(spec: Any) -> ModelSpec:
    if isinstance(spec, str):
        return get_spec(spec)
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec or a registry name (got {type(spec).__name__})")
    return spec


def kv_cache_bits(
    spec: ModelSpec | str,
    seq_len: int,
    batch_size: int = 1,
    bits: int = 16,
    *,
    group_size: int | None = None,
) -> int:
    """Exact number of bits of the cache (see :func:`kv_cache_bytes`)."""
    spec = _check_spec(spec)
    seq_len = _check_int(seq_len, "seq_len", minimum=0)
    batch_size = _check_int(batch_size, "batch_size", minimum=1)
    bits = _check_bits(bits)
    group_size = _check_group_size(group_size)
    per_layer = _bits_per_token_per_layer(spec, bits, group_size)
    return sum(per_layer * tokens for tokens in spec.tokens_cached(seq_len)) * batch_size


def kv_cache_bytes(
    spec: ModelSpec | str,
    seq_len: int,
    batch_size: int = 1,
    bits: int = 16,
    *,
    group_size: int | None = None,
) -> int:
    """Bytes of the KV cache of ``batch_size`` sequences of ``seq_len`` tokens each.

    For plain layers this is exactly::

        2 × num_layers × num_kv_heads × head_dim × (bits / 8) × seq_len × batch_size

    Sliding-window layers count ``min(seq_len, sliding_window)`` tokens (the tokens attention
    reads at one step; transformers' ``DynamicSlidingWindowLayer`` keeps one fewer between
    steps). MLA layers count ``kv_lora_rank + qk_rope_head_dim`` values per token instead of
    ``2 × num_kv_heads × head_dim`` — what MLA-aware engines (vLLM, SGLang) store; transformers'
    own DeepSeek implementation caches the expanded per-head K/V instead.

    Args:
        spec: a :class:`ModelSpec` or a registry name.
        seq_len: tokens per sequence (prompt + generated so far), >= 0.
        batch_size: sequences held at once, >= 1.
        bits: bits per cached value, one of :data:`ACCEPTED_BITS`.
        group_size: if given (and ``bits < 16``), add one fp16 scale and one fp16 zero-point per
            ``group_size`` values of every cached vector.

    Returns:
        The exact byte count, rounded up once to a whole byte.
    """
    return _ceil_div(kv_cache_bits(spec, seq_len, batch_size, bits, group_size=group_size), 8)


def kv_bytes_per_token(
    spec: ModelSpec | str, bits: int = 16, *, group_size: int | None = None
) -> int:
    """Bytes one token adds to the cache of one sequence while it is inside every window.

    ``2 × num_layers × num_kv_heads × head_dim × bits / 8`` for plain models (rounded up to a
    whole byte if fractional). Sliding-window layers contribute this too until the window is
    full, then nothing: use :func:`kv_cache_bytes` for a given length.
    """
    spec = _check_spec(spec)
    bits = _check_bits(bits)
    group_size = _check_group_size(group_size)
    return _ceil_div(_bits_per_token_per_layer(spec, bits, group_size) * spec.num_layers, 8)


# -- what fits ------------------------------------------------------------------------------


def _kv_budget_bits(
    spec: ModelSpec,
    memory_bytes: Any,
    weight_bits: int,
    overhead_bytes: Any,
    utilization: Any,
) -> int:
    """Bits left for the cache: ``floor(memory × utilization) − weights − overhead`` (may be < 0)."""
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int | float):
        raise TypeError(f"memory_bytes must be a number (got {type(memory_bytes).__name__})")
    if not math.isfinite(memory_bytes) or memory_bytes < 0:
        raise ValueError(f"memory_bytes must be a finite number >= 0 (got {memory_bytes})")
    if isinstance(overhead_bytes, bool) or not isinstance(overhead_bytes, int | float):
        raise TypeError(f"overhead_bytes must be a number (got {type(overhead_bytes).__name__})")
    if not math.isfinite(overhead_bytes) or overhead_bytes < 0:
        raise ValueError(f"overhead_bytes must be a finite number >= 0 (got {overhead_bytes})")
    if isinstance(utilization, bool) or not isinstance(utilization, int | float):
        raise TypeError(f"utilization must be a number (got {type(utilization).__name__})")
    if not (0 < utilization <= 1):
        raise ValueError(f"utilization must be in (0, 1] (got {utilization})")
    weight_bits = _check_bits(weight_bits, "weight_bits")
    usable = math.floor(memory_bytes * utilization)
    return 8 * (usable - spec.weights_bytes(weight_bits) - math.ceil(overhead_bytes))


def max_context(
    spec: ModelSpec | str,
    memory_bytes: float,
    batch_size: int = 1,
    bits: int = 16,
    weight_bits: int = 16,
    *,
    overhead_bytes: float = 0,
    utilization: float = 1.0,
    group_size: int | None = None,
) -> int:
    """Longest context (tokens per sequence) whose cache fits next to the weights.

    The cache budget is ``floor(memory_bytes × utilization) − weights_bytes(weight_bits) −
    overhead_bytes``; the result is the largest ``seq_len`` with
    ``kv_cache_bytes(spec, seq_len, batch_size, bits) <= budget``. ``utilization`` plays the role
    of vLLM's ``gpu_memory_utilization``; ``overhead_bytes`` reserves room for activations and
    the CUDA context. Memory limits only; the model's ``max_position_embeddings`` is not applied.

    Returns:
        The token count; 0 when the weights (plus overhead) alone do not fit, or not even one
        token does; :data:`UNBOUNDED` when every layer is sliding-window and the full windows fit
        (the cache stops growing, so memory sets no limit).

    Raises:
        ValueError / TypeError: negative or non-finite memory, bad bits, unknown ``num_params``.
    """
    spec = _check_spec(spec)
    batch_size = _check_int(batch_size, "batch_size", minimum=1)
    bits = _check_bits(bits)
    group_size = _check_group_size(group_size)
    budget = _kv_budget_bits(spec, memory_bytes, weight_bits, overhead_bytes, utilization)
    if budget < 0:
        return 0

    def fits(n: int) -> bool:
        return kv_cache_bits(spec, n, batch_size, bits, group_size=group_size) <= budget

    if spec.num_full_layers == 0:
        assert spec.sliding_window is not None
        if fits(spec.sliding_window):
            return UNBOUNDED
        hi = spec.sliding_window  # does not fit
    else:
        # past the largest window, only full layers grow: one token costs at least this much
        per_token = _bits_per_token_per_layer(spec, bits, group_size) * spec.num_full_layers
        hi = budget // (per_token * batch_size) + 1  # does not fit
    lo = 0  # fits (the empty cache)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_batch(
    spec: ModelSpec | str,
    memory_bytes: float,
    seq_len: int,
    bits: int = 16,
    weight_bits: int = 16,
    *,
    overhead_bytes: float = 0,
    utilization: float = 1.0,
    group_size: int | None = None,
) -> int:
    """Most sequences of ``seq_len`` tokens whose caches fit next to the weights at once.

    Same budget as :func:`max_context`; the result is the largest ``batch_size`` with
    ``kv_cache_bytes(spec, seq_len, batch_size, bits) <= budget``, i.e.
    ``floor(budget / kv_cache_bytes(spec, seq_len))`` up to the one final byte rounding.
    Each sequence is assumed to hold its whole ``seq_len`` (no paging, no prefix sharing).

    Returns:
        The sequence count; 0 when the weights alone do not fit or one sequence does not.

    Raises:
        ValueError: ``seq_len < 1``, negative memory, bad bits, unknown ``num_params``.
    """
    spec = _check_spec(spec)
    seq_len = _check_int(seq_len, "seq_len", minimum=1)
    bits = _check_bits(bits)
    group_size = _check_group_size(group_size)
    budget = _kv_budget_bits(spec, memory_bytes, weight_bits, overhead_bytes, utilization)
    if budget < 0:
        return 0
    # kv_cache_bytes(b) = ceil(b × per_seq / 8) <= budget/8  ⇔  b × per_seq <= budget
    # (budget is a multiple of 8 bits)
    per_seq = kv_cache_bits(spec, seq_len, 1, bits, group_size=group_size)
    return budget // per_seq


# -- GPUs and formatting --------------------------------------------------------------------

#: Memory of common accelerators in bytes, as marketed (GB = 10⁹ bytes; the usable amount the
#: driver reports is a little lower — see ``torch.cuda.mem_get_info``).
GPUS: dict[str, int] = {
    "T4": 16 * 10**9,  # NVIDIA T4, 16 GB GDDR6
    "L4": 24 * 10**9,  # NVIDIA L4, 24 GB GDDR6
    "RTX 4090": 24 * 10**9,  # GeForce RTX 4090, 24 GB GDDR6X
    "A10G": 24 * 10**9,  # NVIDIA A10G (AWS g5), 24 GB
    "L40S": 48 * 10**9,  # NVIDIA L40S, 48 GB
    "A100 40GB": 40 * 10**9,  # NVIDIA A100 40 GB HBM2
    "A100 80GB": 80 * 10**9,  # NVIDIA A100 80 GB HBM2e
    "H100 80GB": 80 * 10**9,  # NVIDIA H100 SXM/PCIe, 80 GB HBM3
    "H200": 141 * 10**9,  # NVIDIA H200, 141 GB HBM3e
}


def human_bytes(n: float, *, binary: bool = True, digits: int = 3) -> str:
    """Format a byte count: ``human_bytes(131072) == "128 KiB"``, ``human_bytes(1.5e9,
    binary=False) == "1.5 GB"``. ``digits`` significant digits; negative values keep the sign."""
    if isinstance(n, bool) or not isinstance(n, int | float) or not math.isfinite(n):
        raise ValueError(f"human_bytes needs a finite number (got {n!r})")
    base, units = (
        (1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB"))
        if binary
        else (1000, ("B", "kB", "MB", "GB", "TB", "PB"))
    )
    value, i = abs(float(n)), 0
    while value >= base and i < len(units) - 1:
        value /= base
        i += 1
    if round(value) >= base and i < len(units) - 1:  # 1023.9 KiB → 1 MiB
        value /= base
        i += 1
    text = f"{value:.{digits}g}"
    if "e" in text:
        text = f"{value:.0f}"
    sign = "-" if n < 0 else ""
    return f"{sign}{text} {units[i]}"


# -- the registry ---------------------------------------------------------------------------


def _alternating(n: int, local: int, global_: int) -> tuple[str, ...]:
    """``local`` sliding layers then ``global_`` full layers, repeated over ``n`` layers
    (transformers: ``"sliding" if (i + 1) % period else "full"`` for ``global_ == 1``)."""
    period = local + global_
    return tuple("sliding" if i % period < local else "full" for i in range(n))


_HF = "config.json on the Hugging Face hub: "

_SPECS: tuple[ModelSpec, ...] = (
    # Llama-2-7B: MHA (32 KV heads). meta-llama/Llama-2-7b-hf config.json; 6.74B params (card).
    ModelSpec(
        "llama-2-7b",
        32,
        32,
        32,
        128,
        num_params=6_738_415_616,
        vocab_size=32_000,
        hidden_size=4096,
        max_position_embeddings=4096,
        source=_HF + "meta-llama/Llama-2-7b-hf",
    ),
    # Llama-3.1-8B: GQA 32 q / 8 kv. meta-llama/Llama-3.1-8B config.json; 8.03B params.
    ModelSpec(
        "llama-3.1-8b",
        32,
        32,
        8,
        128,
        num_params=8_030_261_248,
        vocab_size=128_256,
        hidden_size=4096,
        max_position_embeddings=131_072,
        source=_HF + "meta-llama/Llama-3.1-8B",
    ),
    # Llama-3.1-70B: meta-llama/Llama-3.1-70B config.json (80 layers, 64 q, 8 kv); 70.6B params.
    ModelSpec(
        "llama-3.1-70b",
        80,
        64,
        8,
        128,
        num_params=70_553_706_496,
        vocab_size=128_256,
        hidden_size=8192,
        max_position_embeddings=131_072,
        source=_HF + "meta-llama/Llama-3.1-70B",
    ),
    # Llama-3.1-405B: meta-llama/Llama-3.1-405B config.json (126 layers, 128 q, 8 kv);
    # 405,853,388,800 params (safetensors metadata on the hub).
    ModelSpec(
        "llama-3.1-405b",
        126,
        128,
        8,
        128,
        num_params=405_853_388_800,
        vocab_size=128_256,
        hidden_size=16_384,
        max_position_embeddings=131_072,
        source=_HF + "meta-llama/Llama-3.1-405B",
    ),
    # Llama-3.2-1B: meta-llama/Llama-3.2-1B config.json (16 layers, 32 q, 8 kv, head_dim 64,
    # tied embeddings); 1.24B params.
    ModelSpec(
        "llama-3.2-1b",
        16,
        32,
        8,
        64,
        num_params=1_235_814_400,
        vocab_size=128_256,
        hidden_size=2048,
        max_position_embeddings=131_072,
        source=_HF + "meta-llama/Llama-3.2-1B",
    ),
    # Llama-3.2-3B: meta-llama/Llama-3.2-3B config.json (28 layers, 24 q, 8 kv, head_dim 128);
    # 3.21B params.
    ModelSpec(
        "llama-3.2-3b",
        28,
        24,
        8,
        128,
        num_params=3_212_749_824,
        vocab_size=128_256,
        hidden_size=3072,
        max_position_embeddings=131_072,
        source=_HF + "meta-llama/Llama-3.2-3B",
    ),
    # Mistral-7B v0.1: mistralai/Mistral-7B-v0.1 config.json (32 layers, 32 q, 8 kv,
    # sliding_window 4096 on every layer); 7.24B params. Mistral 7B paper (arXiv:2310.06825).
    ModelSpec(
        "mistral-7b-v0.1",
        32,
        32,
        8,
        128,
        num_params=7_241_732_096,
        sliding_window=4096,
        vocab_size=32_000,
        hidden_size=4096,
        max_position_embeddings=32_768,
        source=_HF + "mistralai/Mistral-7B-v0.1; arXiv:2310.06825",
    ),
    # Mistral-7B v0.3: mistralai/Mistral-7B-v0.3 config.json (sliding_window null: full
    # attention, vocab 32768); 7.25B params.
    ModelSpec(
        "mistral-7b-v0.3",
        32,
        32,
        8,
        128,
        num_params=7_248_023_552,
        vocab_size=32_768,
        hidden_size=4096,
        max_position_embeddings=32_768,
        source=_HF + "mistralai/Mistral-7B-v0.3",
    ),
    # Mixtral-8x7B: mistralai/Mixtral-8x7B-v0.1 config.json (32 layers, 32 q, 8 kv, 8 experts,
    # sliding_window null); 46.7B params, all resident in memory. arXiv:2401.04088.
    ModelSpec(
        "mixtral-8x7b",
        32,
        32,
        8,
        128,
        num_params=46_702_792_704,
        vocab_size=32_000,
        hidden_size=4096,
        max_position_embeddings=32_768,
        source=_HF + "mistralai/Mixtral-8x7B-v0.1; arXiv:2401.04088",
    ),
    # Qwen2.5-0.5B: Qwen/Qwen2.5-0.5B config.json (24 layers, 14 q, 2 kv, hidden 896 → head_dim
    # 64; use_sliding_window false); 0.49B params.
    ModelSpec(
        "qwen2.5-0.5b",
        24,
        14,
        2,
        64,
        num_params=494_032_768,
        vocab_size=151_936,
        hidden_size=896,
        max_position_embeddings=32_768,
        source=_HF + "Qwen/Qwen2.5-0.5B",
    ),
    # Qwen2.5-7B: Qwen/Qwen2.5-7B config.json (28 layers, 28 q, 4 kv, hidden 3584 → 128);
    # 7.62B params.
    ModelSpec(
        "qwen2.5-7b",
        28,
        28,
        4,
        128,
        num_params=7_615_616_512,
        vocab_size=152_064,
        hidden_size=3584,
        max_position_embeddings=131_072,
        source=_HF + "Qwen/Qwen2.5-7B",
    ),
    # Qwen2.5-72B: Qwen/Qwen2.5-72B config.json (80 layers, 64 q, 8 kv, hidden 8192 → 128);
    # 72.7B params.
    ModelSpec(
        "qwen2.5-72b",
        80,
        64,
        8,
        128,
        num_params=72_706_203_648,
        vocab_size=152_064,
        hidden_size=8192,
        max_position_embeddings=131_072,
        source=_HF + "Qwen/Qwen2.5-72B",
    ),
    # Gemma-2-9B: google/gemma-2-9b config.json (42 layers, 16 q, 8 kv, head_dim 256,
    # sliding_window 4096 on every other layer, starting with layer 0); 9.24B params.
    # Gemma 2 report (arXiv:2408.00118).
    ModelSpec(
        "gemma-2-9b",
        42,
        16,
        8,
        256,
        num_params=9_241_705_984,
        sliding_window=4096,
        layer_types=_alternating(42, 1, 1),
        vocab_size=256_000,
        hidden_size=3584,
        max_position_embeddings=8192,
        source=_HF + "google/gemma-2-9b; arXiv:2408.00118",
    ),
    # Gemma-3-27B: google/gemma-3-27b-pt text_config (62 layers, 32 q, 16 kv, head_dim 128,
    # sliding_window 1024, 5 local : 1 global); ≈27.4B params incl. vision tower.
    # Gemma 3 report (arXiv:2503.19786).
    ModelSpec(
        "gemma-3-27b",
        62,
        32,
        16,
        128,
        num_params=27_400_000_000,
        sliding_window=1024,
        layer_types=_alternating(62, 5, 1),
        vocab_size=262_208,
        hidden_size=5376,
        max_position_embeddings=131_072,
        source=_HF + "google/gemma-3-27b-pt; arXiv:2503.19786",
    ),
    # Phi-3-mini: microsoft/Phi-3-mini-128k-instruct config.json (32 layers, 32 q, 32 kv,
    # hidden 3072 → head_dim 96: MHA); 3.82B params. (The 4k variant declares sliding_window
    # 2047; the layout is otherwise the same.)
    ModelSpec(
        "phi-3-mini",
        32,
        32,
        32,
        96,
        num_params=3_821_079_552,
        vocab_size=32_064,
        hidden_size=3072,
        max_position_embeddings=131_072,
        source=_HF + "microsoft/Phi-3-mini-128k-instruct",
    ),
    # Falcon-7B: tiiuae/falcon-7b config.json (32 layers, 71 q heads, multi_query → 1 KV head,
    # hidden 4544 → head_dim 64); 7,217,189,760 params (safetensors metadata). Classic MQA.
    ModelSpec(
        "falcon-7b",
        32,
        71,
        1,
        64,
        num_params=7_217_189_760,
        vocab_size=65_024,
        hidden_size=4544,
        max_position_embeddings=2048,
        source=_HF + "tiiuae/falcon-7b",
    ),
    # DeepSeek-V3: deepseek-ai/DeepSeek-V3 config.json (61 layers, 128 heads, MLA with
    # kv_lora_rank 512 + qk_rope_head_dim 64 cached per layer per token; v_head_dim and
    # qk_nope_head_dim 128); 671B params (MoE, +14B MTP module not counted).
    # DeepSeek-V3 report (arXiv:2412.19437), MLA from DeepSeek-V2 (arXiv:2405.04434).
    ModelSpec(
        "deepseek-v3",
        61,
        128,
        128,
        128,
        num_params=671_000_000_000,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        vocab_size=129_280,
        hidden_size=7168,
        max_position_embeddings=163_840,
        source=_HF + "deepseek-ai/DeepSeek-V3; arXiv:2412.19437",
    ),
    # DeepSeek-V2-Lite: deepseek-ai/DeepSeek-V2-Lite config.json (27 layers, 16 heads, MLA
    # 512 + 64); 15,706,484,224 params (safetensors metadata). arXiv:2405.04434.
    ModelSpec(
        "deepseek-v2-lite",
        27,
        16,
        16,
        128,
        num_params=15_706_484_224,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        vocab_size=102_400,
        hidden_size=2048,
        max_position_embeddings=163_840,
        source=_HF + "deepseek-ai/DeepSeek-V2-Lite; arXiv:2405.04434",
    ),
    # SmolLM2-135M: HuggingFaceTB/SmolLM2-135M config.json (30 layers, 9 q, 3 kv, hidden 576
    # → 64); 134,515,008 params (counted on the bundled model). The series' default model.
    ModelSpec(
        "smollm2-135m",
        30,
        9,
        3,
        64,
        num_params=134_515_008,
        vocab_size=49_152,
        hidden_size=576,
        max_position_embeddings=8192,
        source=_HF + "HuggingFaceTB/SmolLM2-135M",
    ),
    # SmolLM2-1.7B: HuggingFaceTB/SmolLM2-1.7B config.json (24 layers, 32 q, 32 kv: MHA,
    # hidden 2048 → 64); 1.71B params.
    ModelSpec(
        "smollm2-1.7b",
        24,
        32,
        32,
        64,
        num_params=1_711_376_384,
        vocab_size=49_152,
        hidden_size=2048,
        max_position_embeddings=8192,
        source=_HF + "HuggingFaceTB/SmolLM2-1.7B",
    ),
)

#: All registered specs by canonical name (lower case, as in ``list_specs()``).
REGISTRY: dict[str, ModelSpec] = {spec.name: spec for spec in _SPECS}

#: Extra names accepted by :func:`get_spec`.
_ALIASES: dict[str, str] = {
    "mistral-7b": "mistral-7b-v0.1",
    "llama-3-8b": "llama-3.1-8b",
    "llama-3-70b": "llama-3.1-70b",
    "phi-3-mini-4k": "phi-3-mini",
    "phi-3-mini-128k": "phi-3-mini",
}


def _key(name: str) -> str:
    """Normalised lookup key: lower case, ``-``/``_``/``.``/spaces dropped, org prefix dropped."""
    name = name.strip().lower().rsplit("/", 1)[-1]
    for suffix in ("-instruct", "-chat", "-hf", "-it", "-base"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return re.sub(r"[-_.\s]", "", name)


_BY_KEY: dict[str, str] = {_key(n): n for n in REGISTRY} | {
    _key(alias): target for alias, target in _ALIASES.items()
}


def list_specs() -> list[str]:
    """Canonical names of every registered model, in registry order."""
    return list(REGISTRY)


def get_spec(name: str) -> ModelSpec:
    """The registered :class:`ModelSpec` called ``name``.

    Lookup ignores case, ``-``, ``_``, ``.`` and spaces, an ``org/`` prefix and an
    ``-Instruct``/``-chat``/``-hf`` suffix: ``"Llama_3.1_8B"``, ``"meta-llama/Llama-3.1-8B-Instruct"``
    and ``"llama-3.1-8b"`` are the same model.

    Raises:
        ValueError: unknown name; the message lists the closest registered names.
    """
    if not isinstance(name, str):
        raise TypeError(f"model name must be a string (got {type(name).__name__})")
    canonical = _BY_KEY.get(_key(name))
    if canonical is not None:
        return REGISTRY[canonical]
    names = list(REGISTRY) + list(_ALIASES)
    close = difflib.get_close_matches(name.strip().lower(), names, n=3, cutoff=0.5)
    close_keys = difflib.get_close_matches(_key(name), list(_BY_KEY), n=3, cutoff=0.5)
    canonical_close = [_BY_KEY[_key(n)] for n in close] + [_BY_KEY[k] for k in close_keys]
    suggestions = list(dict.fromkeys(canonical_close))[:3]
    hint = f" — did you mean {', '.join(suggestions)}?" if suggestions else ""
    raise ValueError(
        f"unknown model {name!r}{hint} (registered: {', '.join(REGISTRY)}; "
        "or build one with ModelSpec(...) / spec_from_config(config))"
    )


# -- from a transformers config -------------------------------------------------------------


def _config_get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _as_text_config(config: Any) -> Any:
    """The decoder part of a (possibly multimodal) config, as an object or a dict."""
    if isinstance(config, Mapping):
        if "text_config" in config and isinstance(config["text_config"], Mapping):
            return config["text_config"]
        model_type = config.get("model_type")
        if model_type:  # let transformers fill in its defaults (layer_types, sliding...)
            try:
                from transformers import AutoConfig

                from kvlib.models import quiet

                with quiet():
                    built = AutoConfig.for_model(
                        **{k: v for k, v in config.items() if k != "transformers_version"}
                    )
                return _as_text_config(built)
            except Exception:  # unknown model_type or odd fields: read the dict as it is
                return config
        return config
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        try:
            return get_text_config(decoder=True)
        except TypeError:
            return get_text_config()
    return config


def spec_from_config(
    config: Any, name: str | None = None, num_params: int | None = None
) -> ModelSpec:
    """Build a :class:`ModelSpec` from a transformers config (or its ``config.json`` as a dict).

    Reads ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` (missing →
    MHA), ``head_dim`` (missing → ``hidden_size // num_attention_heads``), ``sliding_window``
    and ``layer_types`` (``use_sliding_window: false`` turns the window off, as in Qwen2), and
    the MLA fields ``kv_lora_rank`` / ``qk_rope_head_dim`` (then ``head_dim`` is
    ``v_head_dim``). Falcon's ``multi_query`` / ``n_head`` names are understood too.

    Raises:
        ValueError: a required field is missing or invalid.
    """
    cfg = _as_text_config(config)

    def get(*keys: str) -> Any:
        for key in keys:
            value = _config_get(cfg, key)
            if value is not None:
                return value
        return None

    num_layers = get("num_hidden_layers", "n_layer", "num_layers")
    num_heads = get("num_attention_heads", "n_head")
    if num_layers is None or num_heads is None:
        raise ValueError(
            "config needs num_hidden_layers and num_attention_heads "
            f"(got num_hidden_layers={num_layers}, num_attention_heads={num_heads})"
        )
    num_kv_heads = get("num_key_value_heads", "n_head_kv", "num_kv_heads")
    if num_kv_heads is None:
        num_kv_heads = 1 if get("multi_query") else num_heads
    hidden_size = get("hidden_size", "n_embd", "d_model")
    kv_lora_rank = get("kv_lora_rank")
    qk_rope_head_dim = get("qk_rope_head_dim") if kv_lora_rank is not None else None
    if kv_lora_rank is not None:
        head_dim = get("v_head_dim", "qk_nope_head_dim")
    else:
        head_dim = get("head_dim")
    if head_dim is None:
        if hidden_size is None:
            raise ValueError("config has neither head_dim nor hidden_size")
        head_dim = hidden_size // num_heads

    sliding_window = get("sliding_window")
    if _config_get(cfg, "use_sliding_window") is False:
        sliding_window = None
    layer_types = get("layer_types")
    if layer_types is not None:
        layer_types = tuple(layer_types)
        known = [t for t in layer_types if t in _LAYER_KIND_ALIASES]
        if len(known) != len(layer_types):  # e.g. linear-attention hybrids: not modelled
            unknown = sorted({t for t in layer_types if t not in _LAYER_KIND_ALIASES})
            raise ValueError(f"layer types {unknown} are not supported by kvlib.memory")
        if all(_LAYER_KIND_ALIASES[t] == "full" for t in layer_types):
            layer_types = None
            sliding_window = None
        elif sliding_window is None:
            sliding_window = get("attention_chunk_size")
    elif sliding_window is not None:
        layer_types = None  # every layer slides (Mistral-7B v0.1, Phi-3-mini-4k)

    if name is None:
        # (not _name_or_path: that is often a local folder)
        name = str(_config_get(cfg, "model_type") or _config_get(config, "model_type") or "model")
    return ModelSpec(
        name=name,
        num_layers=int(num_layers),
        num_heads=int(num_heads),
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        num_params=num_params,
        sliding_window=None if sliding_window is None else int(sliding_window),
        layer_types=layer_types,
        kv_lora_rank=None if kv_lora_rank is None else int(kv_lora_rank),
        qk_rope_head_dim=None if qk_rope_head_dim is None else int(qk_rope_head_dim),
        vocab_size=get("vocab_size"),
        hidden_size=hidden_size,
        max_position_embeddings=get("max_position_embeddings", "n_positions"),
        source="spec_from_config",
    )
