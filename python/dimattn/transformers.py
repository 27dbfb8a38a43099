"""Hugging Face transformers on dimattn: ``attn_implementation="dimattn"``.

    import dimattn.transformers
    dimattn.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="dimattn")
    dimattn.transformers.stats()          # {"routed": ..., "fallback": ..., "reasons": {...}, "kernels": {...}}

``register()`` adds ``"dimattn"`` to transformers' ``AttentionInterface`` (the attention
function every model calls) and to its ``AttentionMaskInterface`` (without a mask
function of its own a custom implementation gets no mask at all): the mask is
``sdpa``'s, a bool mask (True = may attend) or None where plain causal attention
(top-left aligned) or none is meant. The attention function takes what the models
pass: ``scaling``, ``dropout`` (given in training), ``softcap`` (Gemma 2), ``s_aux``
(GPT-OSS's sinks, learnable), grouped kv heads (never repeated), keys longer than the
queries (a StaticCache's first pass, decoding over a cache), ``output_attentions`` (the
weights of dimattn's reference path). A sliding window arrives inside the mask. A
query row that may attend nothing gives 0, so padded rows stay finite. Continuous
batching (``generate_batch``) refuses registered implementations in transformers 5.23;
a paged cache that reaches the function anyway runs transformers' ``sdpa``, counted
with the reason. docs/python.md.

transformers is called through its public extension points only.
"""
from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import _sdpa
from ._route_counts import RouteCounts
from ._context import trace

__all__ = ["register", "attention_forward", "stats", "reset_stats", "NAME"]

NAME = "dimattn"

_counts = RouteCounts(("routed", "fallback"))
_count = _counts.count

_tracking = {"kernels": False}


def register(name: str = NAME, *, track_kernels: bool = False) -> None:
    """Make ``attn_implementation=name`` (default "dimattn") run on dimattn, for every
    model of transformers: its attention function and its mask function (sdpa's).
    ``track_kernels``: count each routed call's kernel in ``stats()["kernels"]`` (it
    traces every call, which costs a little; else they count as "dimattn").

    Args:
        name: the ``attn_implementation`` value to register.
        track_kernels: see above.
    """
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    _tracking["kernels"] = bool(track_kernels)


def stats() -> dict:
    """Counts since reset_stats(): ``routed`` (ran on dimattn; ``kernels`` counts the
    kernels) and ``fallback`` (ran transformers' sdpa; ``reasons`` counts why).

    Returns:
        ``{"routed": int, "fallback": int, "reasons": {reason: int}, "kernels": {kernel: int}}``.
    """
    return _counts.stats()


def reset_stats() -> None:
    _counts.reset()


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention function for ``attn_implementation="dimattn"``.

    Args:
        module: the model's attention module (its ``is_causal`` when ``is_causal`` is None).
        query: ``[B, Hq, T, D]``; key, value: ``[B, Hkv, S, D]`` (Hkv dividing Hq).
        attention_mask: sdpa's bool mask, broadcastable to ``[B, Hq, T, S]``, or None.
        dropout: the weights' dropout (transformers passes it in training only).
        scaling: the scores' scale (default 1/sqrt(D)).
        is_causal: without a mask, whether query i attends keys j <= i (top-left).
        **kwargs: ``softcap``, ``s_aux`` (sinks ``[Hq]``), ``output_attentions``; a
            sliding window is in the mask.

    Returns:
        ``(output [B, T, Hq, D], weights [B, Hq, T, S] or None)``.
    """
    if kwargs.get("cache") is not None and type(kwargs["cache"]).__name__ == "PagedAttentionCache":
        _count("fallback", "paged cache (continuous batching)")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if kwargs.get("position_bias") is not None:
        _count("fallback", "position_bias")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and attention_mask is None and query.shape[2] > 1
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)  # an additive float mask (a model's own): dimattn's bias
    want_weights = bool(kwargs.get("output_attentions", False))
    tracing = trace(capture_tensors=False) if _tracking["kernels"] else contextlib.nullcontext()
    with tracing as t:
        result = _sdpa.positional_attention(query, key, value, mask, dropout if module.training else 0.0, causal,
                                            scaling, query.shape[1] != key.shape[1], softcap=kwargs.get("softcap"),
                                            sinks=kwargs.get("s_aux"), weights=want_weights)
    out, weights = result if want_weights else (result, None)
    _count("routed", (t.records[-1].kernel if t.records else "compiled") if t is not None else "dimattn")
    return out.transpose(1, 2).contiguous(), weights
