"""Model specs: the shape facts of a decoder that size its KV cache, and where to read them (notebook 01).

A :class:`ModelSpec` holds what the KV-cache memory math (:mod:`kvlib.memory`) needs about a
model: layers, query and KV heads, ``head_dim``, sliding-window layers, the MLA latent, and the
parameter count for the weights. Specs come from three places:

* **the registry** of published models (``get_spec("llama-3.1-8b")``, :func:`list_specs`),
  each figure with its source (the model's ``config.json`` on the Hugging Face hub, or its
  paper); the table is the data section at the bottom of this module;
* **a transformers config** (or its ``config.json`` as a dict): :func:`spec_from_config`;
* **by hand**: ``ModelSpec("toy", num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64)``.

:func:`kv_geometry` is the one reader of a config's KV shape (layers, query heads, KV heads,
``head_dim``) for the whole package: caches size their tensors
``(batch, num_kv_heads, seq_len, head_dim)`` from it, and :func:`spec_from_config` builds on it.

Attention variants, by what they cache per layer and token:

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
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from kvlib.validate import PRICED_BITS, check_bits, check_int

__all__ = [
    "REGISTRY",
    "KVGeometry",
    "ModelSpec",
    "get_spec",
    "kv_geometry",
    "list_specs",
    "spec_from_config",
]

_LAYER_KIND_ALIASES = {
    "full": "full",
    "full_attention": "full",
    "global": "full",
    "sliding": "sliding",
    "sliding_attention": "sliding",
    "local": "sliding",
    "chunked_attention": "sliding",
}


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
        head_dim: size of one key vector (and of one value vector unless ``value_head_dim``
            says otherwise). For MLA models: the per-head value size (DeepSeek's
            ``v_head_dim``), used only for the "what would it cost without MLA" comparison.
        num_params: total parameter count (all experts for MoE), for weights memory.
        sliding_window: attention window of the sliding-window layers, or ``None``.
        layer_types: per-layer ``"full"`` / ``"sliding"`` (transformers' ``"full_attention"`` /
            ``"sliding_attention"`` are accepted and normalised). ``None`` means: every layer
            is sliding if ``sliding_window`` is set (Mistral-7B v0.1), else every layer is full.
        kv_lora_rank: MLA latent size cached per layer per token (512 for DeepSeek-V3).
        qk_rope_head_dim: MLA decoupled RoPE key size cached per layer per token (64).
        vocab_size, hidden_size, max_position_embeddings: optional context facts.
        value_head_dim: size of one value vector when it differs from the key's ``head_dim``
            (DeepSeek's keys are 192 wide, 128 + 64 RoPE, its values 128), else ``None``.
        tied_embeddings: the output head shares the input embedding's matrix
            (``tie_word_embeddings``), so the model stores one ``vocab_size × hidden_size``
            matrix instead of two (:meth:`embedding_params`).
        checkpoint_weight_bits: bits per weight of the checkpoint the model is released as: 16,
            or 8 for a model that ships FP8 weights (DeepSeek-V3), which an engine loads as
            they are rather than quantizing them.
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
    value_head_dim: int | None = None
    tied_embeddings: bool = field(default=False, repr=False)  # a weights fact: not in the repr
    checkpoint_weight_bits: int = field(default=16, repr=False)  # a weights fact too
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a string (got {type(self.name).__name__})")
        for attr in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            object.__setattr__(self, attr, check_int(getattr(self, attr), attr, minimum=1))
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
            "value_head_dim",
        ):
            value = getattr(self, attr)
            if value is not None:
                object.__setattr__(self, attr, check_int(value, attr, minimum=1))
        if self.checkpoint_weight_bits not in (16, 8):
            raise ValueError(
                f"checkpoint_weight_bits must be 16 or 8 (got {self.checkpoint_weight_bits!r})"
            )
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
    def queries_per_kv_head(self) -> int:
        """Query heads that share one KV head (``num_heads // num_kv_heads``): 1 for MHA, 4 for
        Llama-3.1-8B's GQA, ``num_heads`` for MQA."""
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
    def v_head_dim(self) -> int:
        """Size of one value vector: ``value_head_dim`` if set, else ``head_dim``."""
        return self.value_head_dim if self.value_head_dim is not None else self.head_dim

    @property
    def elements_per_token_per_layer(self) -> int:
        """Cached values per token in one layer: ``num_kv_heads × (head_dim + v_head_dim)``
        (K and V; ``2 × num_kv_heads × head_dim`` when they are equally wide), or
        ``kv_lora_rank + qk_rope_head_dim`` for MLA."""
        if self.is_mla:
            assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)

    def tokens_cached(self, seq_len: int) -> tuple[int, ...]:
        """Tokens each layer holds after ``seq_len`` tokens: ``seq_len`` for full layers,
        ``min(seq_len, sliding_window)`` for sliding ones."""
        seq_len = check_int(seq_len, "seq_len", minimum=0)
        window = self.sliding_window
        return tuple(
            min(seq_len, window) if kind == "sliding" and window is not None else seq_len
            for kind in self.layer_kinds
        )

    def weights_bytes(self, bits: int = 16) -> int:
        """Memory of the weights stored at ``bits`` per parameter: ``ceil(num_params × bits / 8)``.

        Raises:
            ValueError: ``num_params`` is unknown, or ``bits`` is not one of
                :data:`kvlib.validate.PRICED_BITS`.
        """
        bits = check_bits(bits, "bits", allowed=PRICED_BITS)
        if self.num_params is None:
            raise ValueError(f"num_params is unknown for {self.name!r}; set it to size weights")
        return -(-self.num_params * bits // 8)

    @property
    def embedding_params(self) -> int:
        """Parameters of the input embedding and the output head: ``vocab_size × hidden_size``,
        twice unless :attr:`tied_embeddings`; 0 when either size is unknown. Quantized
        checkpoints (AWQ, GPTQ, FP8, GGUF's Q4_K_M) keep these at 16 bits or close to it."""
        if self.vocab_size is None or self.hidden_size is None:
            return 0
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def hub_id(self) -> str | None:
        """The Hugging Face hub id the figures come from (``"meta-llama/Llama-3.1-8B"``), read
        from ``source``; None when the source names none (a custom spec)."""
        match = re.search(r"Hugging Face hub: ([\w.-]+/[\w.-]+)", self.source)
        return match.group(1) if match else None

    def without_mla(self) -> ModelSpec:
        """The same model with plain per-head K/V instead of the MLA latent: what the cache
        would cost without MLA.

        Each of the ``num_kv_heads`` heads then caches a key of ``head_dim + qk_rope_head_dim``
        values (DeepSeek-V3: 128 + 64 = 192, the RoPE part included) and a value of
        ``head_dim`` (128): the expanded keys and values attention reads.

        Raises:
            ValueError: the model does not use MLA.
        """
        if not self.is_mla:
            raise ValueError(f"{self.name} does not use MLA: it already caches plain K/V")
        assert self.qk_rope_head_dim is not None
        return replace(
            self,
            name=f"{self.name} (no MLA)",
            head_dim=self.head_dim + self.qk_rope_head_dim,
            value_head_dim=self.head_dim,
            kv_lora_rank=None,
            qk_rope_head_dim=None,
        )


# -- reading a transformers config ----------------------------------------------------------


class KVGeometry(NamedTuple):
    """The KV shape of a decoder, as read from its config by :func:`kv_geometry`.

    A full-attention cache layer holds keys and values of shape
    ``(batch, num_kv_heads, seq_len, head_dim)``, one pair per each of ``num_layers`` layers;
    ``num_heads`` query heads read them (``num_heads // num_kv_heads`` per KV head).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


def _config_get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _first(config: Any, *keys: str) -> Any:
    """The first of ``keys`` that ``config`` sets to something other than ``None``."""
    for key in keys:
        value = _config_get(config, key)
        if value is not None:
            return value
    return None


def _as_text_config(config: Any) -> Any:
    """The decoder part of a (possibly multimodal) config, as an object or a dict."""
    if isinstance(config, Mapping):
        if "text_config" in config and isinstance(config["text_config"], Mapping):
            return config["text_config"]
        model_type = config.get("model_type")
        if model_type:  # let transformers fill in its defaults (layer_types, sliding...)
            try:
                from transformers import AutoConfig

                from kvlib.device import quiet

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


def _read_geometry(cfg: Any) -> KVGeometry:
    """:func:`kv_geometry` of an already resolved text config."""
    num_layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    num_heads = _first(cfg, "num_attention_heads", "n_head")
    if num_layers is None or num_heads is None:
        raise ValueError(
            "config needs num_hidden_layers and num_attention_heads "
            f"(got num_hidden_layers={num_layers}, num_attention_heads={num_heads})"
        )
    if _config_get(cfg, "multi_query") and not _config_get(cfg, "new_decoder_architecture"):
        num_kv_heads = 1  # Falcon-7B: one K/V head, whatever num_kv_heads says
    else:
        num_kv_heads = _first(cfg, "num_key_value_heads", "n_head_kv", "num_kv_heads")
        if num_kv_heads is None:
            num_kv_heads = num_heads
    if _config_get(cfg, "kv_lora_rank") is not None:  # MLA: the per-head value size
        head_dim = _first(cfg, "v_head_dim", "qk_nope_head_dim")
    else:
        head_dim = _first(cfg, "head_dim")
    if head_dim is None:
        hidden_size = _first(cfg, "hidden_size", "n_embd", "d_model")
        if hidden_size is None:
            raise ValueError("config has neither head_dim nor hidden_size")
        head_dim = int(hidden_size) // int(num_heads)
    return KVGeometry(
        num_layers=check_int(int(num_layers), "num_hidden_layers", minimum=1),
        num_heads=check_int(int(num_heads), "num_attention_heads", minimum=1),
        num_kv_heads=check_int(int(num_kv_heads), "num_key_value_heads", minimum=1),
        head_dim=check_int(int(head_dim), "head_dim", minimum=1),
    )


def kv_geometry(config: Any) -> KVGeometry:
    """Layers, query heads, KV heads and ``head_dim`` of a model, from its config.

    The one reader of these four figures in kvlib. Reads the decoder's text config of a
    multimodal config (``get_text_config(decoder=True)``, or a ``"text_config"`` dict), then:

    * ``num_hidden_layers`` and ``num_attention_heads`` (required);
    * ``num_key_value_heads``, missing → ``num_attention_heads`` (MHA);
    * ``head_dim``, missing or ``None`` → ``hidden_size // num_attention_heads``.

    Falcon's ``n_layer`` / ``n_head`` / ``multi_query`` names are understood too. For an MLA
    config (``kv_lora_rank`` set) ``head_dim`` is the per-head value size ``v_head_dim``, as in
    :class:`ModelSpec`.

    Args:
        config: a transformers ``PretrainedConfig``, its ``config.json`` as a dict, or any
            object with those attributes.

    Returns:
        A :class:`KVGeometry`; a cache layer holds keys and values of shape
        ``(batch, num_kv_heads, seq_len, head_dim)``.

    Raises:
        ValueError: a required field is missing, or a figure is not a positive integer.
    """
    return _read_geometry(_as_text_config(config))


def _checkpoint_weight_bits(config: Any) -> int:
    """8 when ``config``'s ``quantization_config`` says the checkpoint ships FP8 weights
    (``"quant_method": "fp8"``, as DeepSeek-V3's config.json does), else 16."""
    quant = _config_get(config, "quantization_config")
    if quant is None:
        return 16
    method = (
        quant.get("quant_method")
        if isinstance(quant, dict)
        else getattr(quant, "quant_method", None)
    )
    return 8 if str(method).lower() == "fp8" else 16


def spec_from_config(
    config: Any, name: str | None = None, num_params: int | None = None
) -> ModelSpec:
    """Build a :class:`ModelSpec` from a transformers config (or its ``config.json`` as a dict).

    Layers, heads, KV heads and ``head_dim`` are read by :func:`kv_geometry`; on top of them
    ``sliding_window`` and ``layer_types`` (``use_sliding_window: false`` turns the window off,
    as in Qwen2), and the MLA fields ``kv_lora_rank`` / ``qk_rope_head_dim``.

    Args:
        config: a transformers ``PretrainedConfig`` or its ``config.json`` as a dict.
        name: the spec's name; ``None`` → the config's ``model_type``.
        num_params: parameter count, for weights memory (a config does not say it).

    Raises:
        ValueError: a required field is missing or invalid, or the config has layer types
            kvlib does not model (linear attention, state-space layers).
    """
    cfg = _as_text_config(config)
    geometry = _read_geometry(cfg)
    kv_lora_rank = _config_get(cfg, "kv_lora_rank")
    qk_rope_head_dim = _config_get(cfg, "qk_rope_head_dim") if kv_lora_rank is not None else None

    sliding_window = _config_get(cfg, "sliding_window")
    if _config_get(cfg, "use_sliding_window") is False:
        sliding_window = None
    layer_types = _config_get(cfg, "layer_types")
    if layer_types is not None:
        layer_types = tuple(layer_types)
        known = [t for t in layer_types if t in _LAYER_KIND_ALIASES]
        if len(known) != len(layer_types):  # e.g. linear-attention hybrids: not modelled
            unknown = sorted({t for t in layer_types if t not in _LAYER_KIND_ALIASES})
            raise ValueError(f"layer types {unknown} are not supported by kvlib.specs")
        if all(_LAYER_KIND_ALIASES[t] == "full" for t in layer_types):
            layer_types = None
            sliding_window = None
        elif sliding_window is None:
            sliding_window = _config_get(cfg, "attention_chunk_size")
    elif sliding_window is not None:
        layer_types = None  # every layer slides (Mistral-7B v0.1, Phi-3-mini-4k)

    if name is None:
        # (not _name_or_path: that is often a local folder)
        name = str(_config_get(cfg, "model_type") or _config_get(config, "model_type") or "model")
    return ModelSpec(
        name=name,
        num_layers=geometry.num_layers,
        num_heads=geometry.num_heads,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        num_params=num_params,
        sliding_window=None if sliding_window is None else int(sliding_window),
        layer_types=layer_types,
        kv_lora_rank=None if kv_lora_rank is None else int(kv_lora_rank),
        qk_rope_head_dim=None if qk_rope_head_dim is None else int(qk_rope_head_dim),
        vocab_size=_config_get(cfg, "vocab_size"),
        hidden_size=_first(cfg, "hidden_size", "n_embd", "d_model"),
        max_position_embeddings=_first(cfg, "max_position_embeddings", "n_positions"),
        tied_embeddings=bool(_config_get(cfg, "tie_word_embeddings", False)),
        checkpoint_weight_bits=_checkpoint_weight_bits(config),
        source="spec_from_config",
    )


# -- looking up the registry (the table is the data section below) -------------------------


def _key(name: str) -> str:
    """Normalised lookup key: lower case, ``-``/``_``/``.``/spaces dropped, org prefix dropped."""
    name = name.strip().lower().rsplit("/", 1)[-1]
    for suffix in ("-instruct", "-chat", "-hf", "-it", "-base"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return re.sub(r"[-_.\s]", "", name)


def list_specs() -> list[str]:
    """Canonical names of every registered model, in registry order."""
    return list(REGISTRY)


def get_spec(name: str) -> ModelSpec:
    """The registered :class:`ModelSpec` called ``name``.

    Lookup ignores case, ``-``, ``_``, ``.`` and spaces, an ``org/`` prefix and an
    ``-Instruct``/``-chat``/``-hf`` suffix: ``"Llama_3.1_8B"``, ``"meta-llama/Llama-3.1-8B-Instruct"``
    and ``"llama-3.1-8b"`` are the same model.

    Raises:
        TypeError: ``name`` is not a string.
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


# == data: the registry of published models =================================================
#
# Figures from each model's config.json on the Hugging Face hub (or its paper), named in the
# comment above each entry and in ``source``. Positional fields: name, num_layers, num_heads,
# num_kv_heads, head_dim.


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
        tied_embeddings=True,
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
        tied_embeddings=True,
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
        tied_embeddings=True,
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
        tied_embeddings=True,
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
        tied_embeddings=True,
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
        checkpoint_weight_bits=8,  # released as FP8 weights (block-wise scales)
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
        tied_embeddings=True,
        max_position_embeddings=8192,
        source=_HF + "HuggingFaceTB/SmolLM2-135M",
    ),
    # Gemma-3-270M: google/gemma-3-270m (18 layers, 4 q, 1 kv, head_dim 256, hidden 640,
    # sliding_window 512, 5 local : 1 global, 32k positions); 268,098,176 params (counted on
    # the offline model, `make gemma`). The series' second measured model.
    ModelSpec(
        "gemma-3-270m",
        18,
        4,
        1,
        256,
        num_params=268_098_176,
        sliding_window=512,
        layer_types=_alternating(18, 5, 1),
        vocab_size=262_144,
        hidden_size=640,
        tied_embeddings=True,
        max_position_embeddings=32_768,
        source=_HF + "google/gemma-3-270m; arXiv:2503.19786",
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
        tied_embeddings=True,
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

_BY_KEY: dict[str, str] = {_key(n): n for n in REGISTRY} | {
    _key(alias): target for alias, target in _ALIASES.items()
}
