"""Which model to run on this machine, and random-weight models of real architectures (notebook 08).

- :func:`choose_model` / :func:`load_choice` pick the model for the device: an open ~2 B
  instruct model on CUDA with hub access, the bundled SmolLM2-135M offline or on CPU, and a
  randomly initialised model of a real architecture on a GPU without hub access.
- :func:`random_config` / :func:`random_model` build that random model from a registry spec
  (:data:`ARCHITECTURES` holds what the spec lacks): the real shapes, so memory and speed are
  real, and noise for text.

Loading itself is :func:`kvlib.models.load_model`; this module only decides what to load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlib.specs import ModelSpec, get_spec

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_HUB_MODEL",
    "DEFAULT_RANDOM_SPEC",
    "ModelChoice",
    "choose_model",
    "load_choice",
    "random_config",
    "random_model",
]

#: The default model on a CUDA machine with hub access. SmolLM2-1.7B-Instruct is open
#: (Apache-2.0, not gated), shares the bundled model's tokenizer and family, and uses full
#: multi-head attention (32 KV heads): 192 KiB of fp16 cache per token, so the cache outgrows
#: its 3.4 GB of bf16 weights past ~17k tokens — the regime where a quantized cache pays off.
#: (Qwen2.5-1.5B-Instruct keeps only 2 KV heads, 28 KiB per token: its cache barely matters.)
#: Its training context is 8192 tokens; longer contexts are memory and speed figures only.
DEFAULT_HUB_MODEL = "HuggingFaceTB/SmolLM2-1.7B-Instruct"

#: The architecture of the random-weights model used on a GPU without hub access (the same
#: architecture as :data:`DEFAULT_HUB_MODEL`, and its vocabulary matches the bundled tokenizer).
DEFAULT_RANDOM_SPEC = "smollm2-1.7b"

#: Facts a randomly initialised model needs beyond :class:`kvlib.specs.ModelSpec`, per
#: registry name: (model_type, intermediate_size, tie_word_embeddings, rope_theta), from each
#: model's config.json on the hub. With them, :func:`random_config` reproduces the registry's
#: exact parameter count (checked in the tests).
ARCHITECTURES: dict[str, tuple[str, int, bool, float]] = {
    "smollm2-135m": ("llama", 1536, True, 100_000.0),
    "smollm2-1.7b": ("llama", 8192, True, 130_000.0),
    "llama-2-7b": ("llama", 11008, False, 10_000.0),
    "llama-3.2-1b": ("llama", 8192, True, 500_000.0),
    "llama-3.2-3b": ("llama", 8192, True, 500_000.0),
    "llama-3.1-8b": ("llama", 14336, False, 500_000.0),
    "mistral-7b-v0.3": ("llama", 14336, False, 1_000_000.0),
    "qwen2.5-0.5b": ("qwen2", 4864, True, 1_000_000.0),
    "qwen2.5-7b": ("qwen2", 18944, False, 1_000_000.0),
}


def _cuda_half(device: torch.device) -> torch.dtype:
    """bfloat16 on GPUs with native support (compute capability >= 8: A100, L4, H100), float16
    on older ones (T4, V100), where ``torch.cuda.is_bf16_supported()`` may say True only
    because bf16 is emulated, slowly."""
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def random_config(
    spec: ModelSpec | str,
    *,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int | None = None,
) -> Any:
    """A transformers ``LlamaConfig`` / ``Qwen2Config`` with the shapes of a registry model.

    The attention shapes (heads, KV heads, head_dim, hidden size) always follow the spec —
    they decide the KV cache; ``num_layers``, ``vocab_size`` and ``intermediate_size`` may be
    shrunk for quick runs. ``max_position_embeddings`` defaults to at least 131072 so that long
    random-token contexts are accepted.

    Raises:
        ValueError: a spec without a known architecture (see :data:`ARCHITECTURES`), an MLA or
            sliding-window spec.
    """
    spec = get_spec(spec) if isinstance(spec, str) else spec
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec or a registry name (got {type(spec).__name__})")
    arch = ARCHITECTURES.get(spec.name)
    if arch is None:
        raise ValueError(
            f"no architecture recorded for {spec.name!r}; accepted: {', '.join(ARCHITECTURES)}"
        )
    if spec.hidden_size is None or spec.vocab_size is None:
        raise ValueError(f"spec {spec.name!r} needs hidden_size and vocab_size")
    model_type, inter, tie, theta = arch
    kwargs = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=intermediate_size or inter,
        num_hidden_layers=num_layers or spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=vocab_size or spec.vocab_size,
        tie_word_embeddings=tie,
        rope_theta=theta,
        max_position_embeddings=max_position_embeddings
        or max(spec.max_position_embeddings or 0, 131072),
    )
    if model_type == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**kwargs)
    from transformers import LlamaConfig

    return LlamaConfig(**kwargs)


def random_model(
    spec: ModelSpec | str = DEFAULT_RANDOM_SPEC,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    **shrink: int | None,
) -> Any:
    """A randomly initialised causal LM of a real architecture, in eval mode.

    Good for memory and speed (the shapes are the real model's), useless for quality (its
    text is noise). Weights are created directly on ``device``.

    Args:
        spec: a registry name (see :data:`ARCHITECTURES`) or a ModelSpec.
        device: default :func:`kvlib.get_device`.
        dtype: default bfloat16 on CUDA (float16 where bf16 is unsupported), float32 elsewhere.
        seed: torch seed for the initialisation.
        **shrink: ``num_layers``, ``vocab_size``, ``intermediate_size``,
            ``max_position_embeddings`` (see :func:`random_config`).
    """
    from transformers import AutoModelForCausalLM

    from kvlib.device import get_device, quiet

    dev = torch.device(device) if device is not None else get_device()
    if dtype is None:
        if dev.type == "cuda":
            dtype = _cuda_half(dev)
        else:
            dtype = torch.float32
    config = random_config(spec, **shrink)
    torch.manual_seed(seed)
    with quiet(), torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@dataclass(frozen=True)
class ModelChoice:
    """Which model to run: ``kind`` is ``"hub"`` (``model_id``), ``"bundled"`` (SmolLM2-135M)
    or ``"random"`` (random weights of ``spec_name``); ``reason`` says why."""

    kind: str
    model_id: str | None
    spec_name: str | None
    device: str
    reason: str

    @property
    def real_weights(self) -> bool:
        """False for random weights: quality numbers (perplexity, samples) mean nothing then."""
        return self.kind != "random"


def choose_model(
    device: torch.device | str | None = None,
    hub: bool | None = None,
    model_id: str | None = None,
) -> ModelChoice:
    """Pick the model for this machine.

    - CUDA with hub access: ``model_id`` or :data:`DEFAULT_HUB_MODEL`;
    - CPU / MPS (or offline without CUDA): the bundled SmolLM2-135M (fits any laptop, no hub);
    - CUDA without hub access: random weights of :data:`DEFAULT_RANDOM_SPEC`.

    Args:
        hub: whether the hub is reachable; ``None`` asks :func:`kvlib.models.hub_reachable`
            (only on CUDA: a CPU run never touches the network).
    """
    from kvlib.device import get_device

    dev = torch.device(device) if device is not None else get_device()
    if dev.type != "cuda":
        return ModelChoice(
            "bundled",
            None,
            "smollm2-135m",
            str(dev),
            "no CUDA GPU: the bundled SmolLM2-135M runs offline on any CPU at small sizes",
        )
    if hub is None:
        from kvlib.models import hub_reachable

        hub = hub_reachable()
    if hub:
        chosen = model_id or DEFAULT_HUB_MODEL
        why = (
            "CUDA with hub access: an open ~2B instruct model whose multi-head KV cache "
            "(192 KiB/token in fp16) outgrows its weights past ~17k tokens"
            if chosen == DEFAULT_HUB_MODEL
            else "CUDA with hub access: the requested model"
        )
        return ModelChoice("hub", chosen, None, str(dev), why)
    return ModelChoice(
        "random",
        None,
        DEFAULT_RANDOM_SPEC,
        str(dev),
        "CUDA without hub access: random weights of SmolLM2-1.7B's architecture — real "
        "memory and speed, meaningless quality",
    )


def load_choice(choice: ModelChoice, **shrink: int | None) -> tuple[Any, Any]:
    """Load what :func:`choose_model` chose: ``(model, tokenizer)``.

    Random models get the bundled tokenizer (SmolLM2's 49152-token vocabulary, the same as
    :data:`DEFAULT_RANDOM_SPEC`'s). ``shrink`` goes to :func:`random_model`.
    """
    from kvlib.models import load_model

    device = torch.device(choice.device)
    if choice.kind == "bundled":
        return load_model(None, device=device)
    if choice.kind == "hub":
        dtype = None
        if device.type == "cuda":
            dtype = _cuda_half(device)
        return load_model(choice.model_id, device=device, dtype=dtype)
    if choice.kind == "random":
        _, tokenizer = load_model(None, device="cpu")
        model = random_model(choice.spec_name or DEFAULT_RANDOM_SPEC, device=device, **shrink)
        return model, tokenizer
    raise ValueError(f"choice.kind must be 'hub', 'bundled' or 'random' (got {choice.kind!r})")
