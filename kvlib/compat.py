"""The one adapter between kvlib and the moving parts of transformers' cache API (notebook 04).

transformers renames things between releases: in 5.x the model ``forward`` and ``generate``
take the cache as ``cache=`` (``past_key_values=`` still works but emits a deprecation
warning, and is scheduled for removal), and model outputs carry it as ``outputs.cache``
(``outputs.past_key_values`` before). Everything in kvlib and in the notebooks goes through
the helpers below, so a rename is fixed here once:

- :func:`cache_kwarg` — the keyword this transformers accepts without warning;
- :func:`forward` / :func:`generate` — call a model with a cache;
- :func:`output_cache` — the cache object returned in a model output;
- :func:`dynamic_cache` / :func:`hf_quantized_cache` — build transformers' own caches;
- :func:`dynamic_cache_from` / :func:`cache_tensors` / :func:`cache_windows` /
  :func:`clone_cache` — a DynamicCache from per-layer tensors, its tensors and sliding windows
  back, a deep copy (notebook 06);
- :func:`prefill_cache` — run a prefix through a model, in chunks if asked, into a cache;
- :func:`layer_types` — the attention layer types a config declares;
- :func:`layer_windows` — each layer's sliding window (``None`` for full attention), for
  the caches that serve full and sliding-window layers only;
- :func:`layer_nbytes` / :func:`cache_nbytes` — bytes really held by a cache (every packed
  code, scale, zero point and full-precision residual), for transformers' layers and kvlib's.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvlib.validate import check_int

HF_BACKENDS = ("quanto", "hqq", "fp8")


@functools.cache
def _kwarg_for(forward: Any) -> str:
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model: Any = None) -> str:
    """The keyword under which ``model.forward`` (and ``generate``) takes the KV cache.

    ``"cache"`` on transformers ≥ 5.2x (where ``past_key_values`` is deprecated),
    ``"past_key_values"`` on older releases. Without a model, the Llama class decides.
    """
    if model is None:
        from transformers import LlamaForCausalLM

        forward = LlamaForCausalLM.forward
    else:
        forward = type(model).forward
    return _kwarg_for(forward)


def _check_ids(input_ids: Any, name: str = "input_ids") -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of token ids (got {type(input_ids).__name__})"
        )
    if input_ids.dim() != 2:
        raise ValueError(
            f"{name} must have shape (batch, seq_len) (got shape {tuple(input_ids.shape)})"
        )
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold integer token ids (got dtype {input_ids.dtype})")
    return input_ids


def forward(model: Any, input_ids: torch.Tensor, cache: Any = None, **kwargs: Any) -> Any:
    """One forward pass of ``model`` over ``input_ids`` (batch, seq_len), reading and extending
    ``cache`` (a transformers ``Cache``; ``None`` lets the model make a fresh DynamicCache).

    Positions continue from ``cache.get_seq_length()``. Runs under ``torch.inference_mode``.
    Returns the model output; its cache is :func:`output_cache` ``(out)``.
    """
    _check_ids(input_ids)
    kwargs.setdefault("use_cache", True)
    if cache is not None:
        kwargs[cache_kwarg(model)] = cache
    with torch.inference_mode():
        return model(input_ids=input_ids.to(model.device), **kwargs)


def output_cache(outputs: Any) -> Any:
    """The cache held by a model output (``outputs.cache``, or ``past_key_values`` on older
    transformers)."""
    for name in ("cache", "past_key_values"):
        value = getattr(outputs, name, None) if not isinstance(outputs, dict) else outputs.get(name)
        if value is not None:
            return value
    return None


def generate(model: Any, input_ids: torch.Tensor, cache: Any = None, **kwargs: Any) -> torch.Tensor:
    """``model.generate(input_ids, <cache keyword>=cache, **kwargs)`` without deprecation noise.

    ``cache=None`` lets ``generate`` make its own DynamicCache. ``kwargs`` go to ``generate``
    (``max_new_tokens``, ``do_sample``, ``attention_mask``, ...). A pad token id is filled in
    from the model's config when missing, so that transformers does not warn about it.
    Returns the (batch, prompt + new) token ids.
    """
    _check_ids(input_ids)
    if cache is not None:
        kwargs[cache_kwarg(model)] = cache
    gen_cfg = getattr(model, "generation_config", None)
    if "pad_token_id" not in kwargs and gen_cfg is not None and gen_cfg.pad_token_id is None:
        eos = gen_cfg.eos_token_id
        kwargs["pad_token_id"] = eos[0] if isinstance(eos, list | tuple) else eos
    if "attention_mask" not in kwargs:
        kwargs["attention_mask"] = torch.ones_like(input_ids, device=model.device)
    with torch.inference_mode():
        return model.generate(input_ids.to(model.device), **kwargs)


def layer_types(config: Any) -> list[str]:
    """Attention type of every decoder layer of ``config`` (``"full_attention"``,
    ``"sliding_attention"``, ...), as transformers' cache classes see them."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text_config = config.get_text_config(decoder=True)
    types, _ = get_layer_types_and_kwargs(text_config)
    return list(types)


#: The layer types kvlib's own caches serve (:func:`layer_windows`).
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(config: Any, owner: str = "this cache") -> list[int | None]:
    """Per decoder layer of ``config``, its sliding window (``"sliding_attention"`` layers) or
    ``None`` (``"full_attention"``), read as transformers' ``DynamicCache`` reads them.

    Raises:
        ValueError: another layer type (chunked, linear attention, shared "dummy" layers...),
            naming ``owner``.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    text_config = config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(text_config)
    bad = sorted({t for t in types if t not in SERVED_LAYER_TYPES})
    if bad:
        raise ValueError(
            f"{owner} supports full_attention and sliding_attention layers; this config has "
            f"{', '.join(bad)} layers (use a DynamicCache)"
        )
    windows: list[int | None] = []
    for t, kw in zip(types, kwargs, strict=True):
        if t == "sliding_attention":
            window = kw.get("sliding_window")
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise ValueError(
                    f"{owner}: a sliding_attention layer needs sliding_window >= 1 (got {window!r})"
                )
            windows.append(window)
        else:
            windows.append(None)
    return windows


def dynamic_cache(config: Any = None) -> Any:
    """A fresh transformers ``DynamicCache`` (layers laid out for ``config`` when given)."""
    from transformers import DynamicCache

    return DynamicCache(config=config) if config is not None else DynamicCache()


def dynamic_cache_from(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    windows: Sequence[int | None] | None = None,
    seq_len: int | None = None,
) -> Any:
    """A transformers ``DynamicCache`` holding the given tensors.

    Args:
        layers: per decoder layer ``(keys, values)``, each ``(batch, kv_heads, seq_len,
            head_dim)``; a sliding-window layer may hold fewer tokens (its newest ones).
        windows: per layer its sliding window (``None`` for full attention), as
            :func:`cache_windows` or :func:`layer_windows` give them; ``None``: every layer full.
        seq_len: tokens the cache has seen (default: the longest layer's); a sliding layer
            counts them as transformers' ``DynamicSlidingWindowLayer`` does, so the attention
            masks of the next tokens are right.

    Raises:
        TypeError: not a sequence of (keys, values) tensor pairs.
        ValueError: no layers, tensors that are not 4-D, ``windows`` of another length, or
            a layer longer than ``seq_len``.
    """
    from transformers import DynamicCache

    if not isinstance(layers, Sequence) or isinstance(layers, torch.Tensor):
        raise TypeError(
            f"layers must be a list of (keys, values) per layer (got {type(layers).__name__})"
        )
    if not layers:
        raise ValueError("layers must hold at least one (keys, values) pair")
    for i, kv in enumerate(layers):
        if not isinstance(kv, tuple | list) or len(kv) != 2:
            raise TypeError(f"layer {i} must be a (keys, values) pair")
        if not all(isinstance(t, torch.Tensor) for t in kv):
            raise TypeError(f"layer {i}: keys and values must be torch.Tensors")
        if kv[0].ndim != 4 or kv[1].ndim != 4:
            raise ValueError(
                f"layer {i}: keys/values must be (batch, kv_heads, seq_len, head_dim) "
                f"(got {tuple(kv[0].shape)} / {tuple(kv[1].shape)})"
            )
    longest = max(k.shape[2] for k, _ in layers)
    seq_len = longest if seq_len is None else check_int(seq_len, "seq_len", minimum=longest)
    if windows is None:
        return DynamicCache(ddp_cache_data=[(k, v) for k, v in layers])
    if len(windows) != len(layers):
        raise ValueError(f"windows names {len(windows)} layers, layers holds {len(layers)}")
    data = []
    for i, ((k, v), w) in enumerate(zip(layers, windows, strict=True)):
        if w is None:
            if k.shape[2] != seq_len:
                raise ValueError(
                    f"layer {i} is full attention: it must hold all {seq_len} tokens "
                    f"(got {k.shape[2]})"
                )
            data.append((k, v))
        else:
            w = check_int(w, f"windows[{i}]", minimum=1)
            data.append((k, v, torch.tensor(w)))
    cache = DynamicCache(ddp_cache_data=data)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length = seq_len
    return cache


def cache_windows(cache: Any) -> list[int | None]:
    """Per layer of a transformers cache, its sliding window (``None`` for full attention)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"cache must be a transformers DynamicCache (got {type(cache).__name__})")
    return [
        int(layer.sliding_window) if getattr(layer, "is_sliding", False) else None
        for layer in layers
    ]


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(keys, values), …]`` per layer of a transformers cache, each ``(batch, kv_heads, seq_len, head_dim)``.

    The tensors are the cache's own (not copies). A sliding-window layer holds its newest
    tokens only, so its ``seq_len`` can be shorter than the full-attention layers'
    (:func:`cache_windows` tells which layers slide).

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
    windows = cache_windows(cache)
    full = [i for i, w in enumerate(windows) if w is None]
    ref = full[0] if full else 0
    shape = out[ref][0].shape
    for i, (k, _) in enumerate(out):
        same = k.shape == shape
        if windows[i] is not None:  # a sliding layer holds at most the full layers' tokens
            same = k.shape[:2] + k.shape[3:] == shape[:2] + shape[3:] and k.shape[2] <= shape[2]
        if not same:
            raise ValueError(
                f"cache layer {i} has shape {tuple(k.shape)}, layer {ref} has {tuple(shape)}"
            )
    return out


def clone_cache(cache: Any) -> Any:
    """A deep copy of a DynamicCache (tensors cloned, sliding layers kept sliding), so scoring
    one copy leaves the other intact."""
    layers = [(k.clone(), v.clone()) for k, v in cache_tensors(cache)]
    windows = cache_windows(cache)
    if all(w is None for w in windows):
        return dynamic_cache_from(layers)
    return dynamic_cache_from(layers, windows, seq_len=cache.get_seq_length())


def prefill_cache(
    model: Any, input_ids: torch.Tensor, chunk_size: int | None = None, cache: Any = None
) -> Any:
    """Run ``input_ids`` ``(batch, seq_len)`` through the model; return the filled cache.

    ``chunk_size`` feeds the prefix in pieces (the same cache, less peak memory: activations
    for ``chunk_size`` tokens at a time instead of the whole prompt). ``cache`` is the cache to
    fill (any transformers ``Cache``, e.g. ``kvlib.caches.registry.make_cache(name,
    model.config)``); None fills a new DynamicCache. Generating from the filled cache with the
    whole prompt (``model.generate(input_ids, past_key_values=cache, ...)``) runs only the
    tokens the cache does not hold yet. Forward passes go through :func:`forward`.

    Raises:
        TypeError: ``input_ids`` is not an integer tensor, ``chunk_size`` not an int, or
            ``cache`` not a transformers Cache.
        ValueError: ``input_ids`` not ``(batch, seq_len)`` with ``seq_len >= 1``, or
            ``chunk_size < 1``.
    """
    ids = _check_ids(input_ids)
    if ids.shape[1] < 1:
        raise ValueError("input_ids must hold at least 1 token per row (got 0)")
    step = ids.shape[1] if chunk_size is None else check_int(chunk_size, "chunk_size", minimum=1)
    from transformers.cache_utils import Cache

    if cache is None:
        cache = dynamic_cache(model.config)
    elif not isinstance(cache, Cache):
        raise TypeError(f"cache must be a transformers Cache or None (got {type(cache).__name__})")
    for start in range(0, ids.shape[1], step):
        forward(model, ids[:, start : start + step], cache)
    return cache


def hf_quantized_cache(
    config: Any,
    backend: str = "quanto",
    nbits: int | None = None,
    *,
    axis_key: int | None = None,
    axis_value: int | None = None,
    q_group_size: int | None = None,
    residual_length: int | None = None,
    sliding_layer: Callable[[int], Any] | None = None,
) -> Any:
    """transformers' built-in ``QuantizedCache`` for ``config``.

    transformers refuses a model with sliding-window layers (Gemma 2/3). With ``sliding_layer``
    such a model gets a ``Cache`` of the same quantized layers on its ``full_attention`` layers
    and ``sliding_layer(window)`` on each ``sliding_attention`` one, so that a comparison with
    kvlib's caches (which keep the windows in float16) differs only where the quantizer does.

    Args:
        backend: ``"quanto"`` (nbits 2/4, axes 0/-1), ``"hqq"`` (nbits 1/2/3/4/8, axes 0/1) or
            ``"fp8"`` (per-tensor float8, takes no other option).
        nbits, axis_key, axis_value, q_group_size, residual_length: ``None`` keeps the
            backend's default (4 bits, axis 0 for both, groups of 64, residual 128).
        sliding_layer: builds the layer of a sliding-window layer from its window; ``None``
            leaves a hybrid model to transformers (which raises).

    Raises:
        ValueError: an unknown backend, or a hybrid model without ``sliding_layer``
            (transformers' message), or layer types neither full nor sliding.
    """
    if backend not in HF_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(HF_BACKENDS)} (got {backend!r})")
    from transformers import QuantizedCache

    options = {
        "nbits": nbits,
        "axis_key": axis_key,
        "axis_value": axis_value,
        "q_group_size": q_group_size,
        "residual_length": residual_length,
    }
    options = {k: v for k, v in options.items() if v is not None}
    windows = layer_windows(config, f"transformers' QuantizedCache ({backend})")
    if sliding_layer is None or all(w is None for w in windows):
        return QuantizedCache(backend, config, **options)
    from transformers.cache_utils import (
        Cache,
        Fp8QuantizedLayer,
        HQQQuantizedLayer,
        QuantoQuantizedLayer,
    )

    if backend == "fp8" and options:
        raise ValueError(f"the fp8 backend quantizes per tensor and takes no {sorted(options)}")
    layer_class = {
        "quanto": QuantoQuantizedLayer,
        "hqq": HQQQuantizedLayer,
        "fp8": Fp8QuantizedLayer,
    }[backend]
    return Cache(
        layers=[layer_class(**options) if w is None else sliding_layer(w) for w in windows]
    )


def _tensor_nbytes(obj: Any) -> int:
    """Bytes of a tensor, of a tensor subclass holding inner tensors (quanto), or of a
    (tensor, dict-of-tensors) pair (HQQ); 0 for anything else."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_nbytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_nbytes(v) for v in obj)
    return 0


def layer_nbytes(layer: Any) -> int:
    """Bytes held by one cache layer: kvlib layers report their own exact count; for
    transformers' layers, the keys/values tensors plus any quantized states (packed codes,
    scales, zero points; a scalar per-tensor scale counts too)."""
    own = getattr(layer, "nbytes", None)
    if callable(own):
        return int(own())
    total = _tensor_nbytes(getattr(layer, "keys", None)) + _tensor_nbytes(
        getattr(layer, "values", None)
    )
    total += _tensor_nbytes(getattr(layer, "_quantized_keys", None))
    total += _tensor_nbytes(getattr(layer, "_quantized_values", None))
    return total


def cache_nbytes(cache: Any) -> int:
    """Bytes held by a whole cache (sum of :func:`layer_nbytes` over its layers)."""
    own = getattr(cache, "nbytes", None)
    if callable(own):
        return int(own())
    return sum(layer_nbytes(layer) for layer in getattr(cache, "layers", []))
