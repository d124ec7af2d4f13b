"""How a transformers model reaches the fused decode kernel (notebook 10).

transformers splits a decode step in two calls inside each attention layer::

    keys, values = cache.update(k_new, v_new, layer_idx)         # the cache's part
    out, _ = attention_interface(module, q, keys, values, mask)  # the attention function

A cache can only return keys and values, so dequantizing inside attention needs both halves:

* :class:`kvlib.caches.quantized.QuantizedKVCache` (``fused_decode``), at a single-token step, does *not*
  dequantize: it returns the new token's keys and values tagged with a :class:`FusedStep`
  (:func:`tag`) holding the layer's packed state (:class:`kvlib.kernels.decode.PackedKV`);
* the attention function registered here under :data:`ATTN_IMPLEMENTATION` (``"kvlib_fused"``,
  in transformers' ``AttentionInterface`` and, with sdpa's mask, in its
  ``AttentionMaskInterface``) runs :func:`kvlib.kernels.decode.decode_attention` for tagged keys and
  is exactly transformers' ``sdpa`` attention for everything else (prefill, other caches).

A model selects it with ``attn_implementation="kvlib_fused"`` when loaded (call
:func:`register` first), or ``model.set_attn_implementation("kvlib_fused")``; :func:`use_fused_attention` switches a config
from ``"sdpa"`` in place (what ``QuantizedKVCache`` does by itself on its first fused step). A
tagged step that no attention function consumed is caught at the next fused step
(:meth:`FusedStep.check_consumed`): a model routed elsewhere raises instead of decoding from
the new token alone.

Masks: ``None`` or a boolean ``(batch, 1, 1, T)`` mask (left padding) go to the kernel; any
other mask, and dropout, soft-capping, attention sinks, sliding windows or position biases, take
the reference path (dequantize, then transformers' sdpa with every argument as given).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvlib.kernels.decode import PackedKV, decode_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "FusedStep",
    "attention_forward",
    "register",
    "tag",
    "tagged_step",
    "use_fused_attention",
]

#: The name kvlib's attention function is registered under in transformers.
ATTN_IMPLEMENTATION = "kvlib_fused"
_TAG = "_kvlib_fused_step"
_registered = False
# keyword arguments the kernel does not implement: when given (not None), the reference path runs
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "sliding_window", "position_bias")


@dataclass
class FusedStep:
    """One layer's single-token decode step, handed from the cache to the attention function.

    Attributes:
        kv: the layer's packed state, window including the new token (dropped once read).
        backend: ``"triton"`` or ``"torch"`` (see :func:`kvlib.kernels.decode.decode_attention`).
        consumed: set by :func:`attention_forward` when it has run the step.
    """

    kv: PackedKV | None
    backend: str = "triton"
    consumed: bool = field(default=False)

    def check_consumed(self) -> None:
        """Raise if no kvlib attention function ran this step (the model's attention goes
        elsewhere, so it would have attended to the new token alone)."""
        if not self.consumed:
            raise RuntimeError(
                "a fused decode step of QuantizedKVCache was not read by kvlib's attention "
                f"function: load the model with attn_implementation={ATTN_IMPLEMENTATION!r} "
                "(or call kvlib.kernels.fused_attention.use_fused_attention(model.config)), or build "
                "the cache with fused_decode=False"
            )


def tag(keys: torch.Tensor, step: FusedStep) -> torch.Tensor:
    """A view of ``keys`` carrying ``step`` (what ``QuantizedKVLayer.update`` returns)."""
    out = keys.view_as(keys)
    setattr(out, _TAG, step)
    return out


def tagged_step(keys: Any) -> FusedStep | None:
    """The :class:`FusedStep` carried by ``keys``, or ``None``."""
    return getattr(keys, _TAG, None)


def register() -> None:
    """Register :func:`attention_forward` and sdpa's mask under :data:`ATTN_IMPLEMENTATION`
    (idempotent; called by ``QuantizedKVCache`` and :func:`use_fused_attention`)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    _registered = True


def use_fused_attention(config: Any) -> bool:
    """Route a model's attention through kvlib (registering it first): a config whose
    ``_attn_implementation`` is ``"sdpa"`` is switched to ``"kvlib_fused"``, which computes
    the same for every other cache. Returns whether the config now uses kvlib's function
    (``False`` for eager, flash or flex attention, which are left alone)."""
    register()
    impl = getattr(config, "_attn_implementation", None)
    if impl == "sdpa":
        config._attn_implementation = ATTN_IMPLEMENTATION
        impl = ATTN_IMPLEMENTATION
    return impl == ATTN_IMPLEMENTATION


def _kernel_mask(attention_mask: Any, kv: PackedKV) -> tuple[bool, torch.Tensor | None]:
    """``(usable, kv_mask)``: the kernel's ``(batch, T)`` mask from transformers' sdpa mask."""
    if attention_mask is None:
        return True, None
    b, t = kv.batch_size, kv.num_tokens
    if (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dtype == torch.bool
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and attention_mask.shape[2] == 1
        and attention_mask.shape[3] == t
        and attention_mask.shape[0] in (1, b)
    ):
        return True, attention_mask[:, 0, 0, :].expand(b, t)
    return False, None


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``(batch, q_heads, q_len,
    head_dim)``, ``key``/``value`` ``(batch, kv_heads, kv_len, head_dim)``; returns
    ``(batch, q_len, q_heads, head_dim)`` and no weights.

    Keys tagged by the cache (:func:`tag`) are attended to over the whole packed layer with
    :func:`kvlib.kernels.decode.decode_attention`; untagged ones go to transformers' sdpa attention.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    step = tagged_step(key)
    if step is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    kv, step.kv, step.consumed = step.kv, None, True  # the step's references go with it
    if kv is None:
        raise RuntimeError("this fused decode step was already read")
    usable, kv_mask = _kernel_mask(attention_mask, kv)
    plain = dropout == 0.0 and all(kwargs.get(name) is None for name in _UNSUPPORTED)
    if usable and plain and query.shape[2] == 1:
        out = decode_attention(query, kv, scaling=scaling, kv_mask=kv_mask, backend=step.backend)
        return out.transpose(1, 2).contiguous(), None
    keys, values = kv.dequantize(query.dtype)  # reference path, every argument as given
    return sdpa_attention_forward(
        module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
