"""Variants: a call's variants as one value, the Python side of the C++
``AttentionVariants`` (core/include/dimattn/variants.h).

The class is written out (typed and documented fields); a call's variants
reach the op as its typed arguments by the op library's own list of variant
fields (``dimattn::variant_fields``: each field's name and kind), and
tests/python/test_variants.py checks that the class's fields are that list.
Kinds: ``number`` (a float), ``flag`` (a bool), ``window`` (a pair ``(left,
right)`` of ints, ``None`` for an unbounded side), ``tensor`` (a
:class:`dimattn.Tensor` over dims of the call, a constant), ``learnable`` (a
tensor that gets a gradient).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from ._core import Error, Tensor
from ._ops import ops

_FIELDS: Tuple[Tuple[str, str], ...] = tuple(tuple(f.split(":", 1)) for f in ops.variant_fields())
_KINDS = dict(_FIELDS)
TENSOR_FIELDS = tuple(name for name, kind in _FIELDS if kind in ("tensor", "learnable"))
LEARNABLE_FIELDS = tuple(name for name, kind in _FIELDS if kind == "learnable")

@dataclasses.dataclass(frozen=True, eq=False)
class Variants:
    """The variants of a dot_attention call as one value (docs/python.md, "Variants";
    docs/api.md for their exact meaning), passed whole as ``dot_attention(...,
    variants=Variants(...))`` or field by field as keywords of dot_attention. Tensors are
    :class:`dimattn.Tensor` over dims of the call, broadcast by name.

    Attributes:
        window: ``(left, right)`` kv positions around each row's diagonal, ``None`` for an
            unbounded side; measured along the query's positional dim.
        softcap: energies become ``softcap * tanh(energy / softcap)``; > 0.
        alibi_slopes: ALiBi slopes over per-head dims: energy -= slope * |i + offset - j|.
        sinks: a learnable logit over per-head dims in every row's softmax denominator.
        sink_off_by_one: the fixed sink logit 0.
        bias: a learnable additive bias over any of the call's dims but features.
        mask: a bool mask over the same dims, True = may attend.
        query_segments: integer segment ids of the query positions (document masking).
        kv_segments: integer segment ids of the kv positions; equal ids attend.
        pos_emb: relative positions (Transformer-XL): a learnable table over key_dim, one
            relative-position dim and per-head dims (Tq + Tk - 1 rows, or the kv axis).
        pos_bias_u: the content term's learnable bias (Transformer-XL's u) over key_dim.
        pos_bias_v: the positional term's learnable bias (Transformer-XL's v) over key_dim.
    """
    window: Optional[Tuple[Optional[int], Optional[int]]] = None
    softcap: Optional[float] = None
    alibi_slopes: Optional[Tensor] = None
    sinks: Optional[Tensor] = None
    sink_off_by_one: bool = False
    bias: Optional[Tensor] = None
    mask: Optional[Tensor] = None
    query_segments: Optional[Tensor] = None
    kv_segments: Optional[Tensor] = None
    pos_emb: Optional[Tensor] = None
    pos_bias_u: Optional[Tensor] = None
    pos_bias_v: Optional[Tensor] = None


Variants.__module__ = "dimattn"


def merged(variants: Optional["Variants"], keywords: Dict[str, object]) -> Optional["Variants"]:
    """``variants`` with the variant keywords of a call set on it; None when no
    variant is on. Unknown keywords are an error listing the known ones."""
    if variants is not None and not isinstance(variants, Variants):
        raise Error(f"[dot_attention] variants must be a dimattn.Variants, got {type(variants).__name__}")
    unknown = [k for k in keywords if k not in _KINDS]
    if unknown:
        raise Error(f"[dot_attention] unknown option {', '.join(unknown)}; the variants are "
                    f"{', '.join(_KINDS)} (dimattn.Variants)")
    if keywords:
        variants = dataclasses.replace(variants, **keywords) if variants is not None else Variants(**keywords)
    if variants is None or not any(_on(getattr(variants, name)) for name in _KINDS):
        return None
    _check(variants)
    return variants


def _on(value) -> bool:
    return value is not None and value is not False


def _check(v: "Variants") -> None:
    """What the op cannot say itself: the Python types of the fields. Their values
    (window sides >= 0, the range of numbers, the dims of tensors, their dtypes) are the
    C++ library's to check, with its messages."""
    for name, kind in _FIELDS:
        x = getattr(v, name)
        if not _on(x):
            continue
        if kind == "window" and not (isinstance(x, (tuple, list)) and len(x) == 2 and all(
                side is None or (isinstance(side, int) and not isinstance(side, bool)) for side in x)):
            raise Error(f"[dot_attention] {name} must be a pair (left, right) of ints, None for an unbounded side, "
                        f"got {x!r}")
        if kind == "number" and (isinstance(x, bool) or not isinstance(x, (int, float))):
            raise Error(f"[dot_attention] {name} must be a number, got {type(x).__name__}")
        if kind == "flag" and not isinstance(x, bool):
            raise Error(f"[dot_attention] {name} must be a bool, got {type(x).__name__}")
        if kind in ("tensor", "learnable"):
            if not isinstance(x, Tensor):
                raise Error(f"[dot_attention] {name} must be a dimattn.Tensor over dims of the call, "
                            f"got {type(x).__module__}.{type(x).__qualname__}")
            if kind == "tensor" and x.raw.requires_grad and torch.is_grad_enabled():
                raise Error(f"[dot_attention] {name} require grad, but {name} is a constant of the call and gets "
                            f"no gradient; pass {name}.raw.detach() (learnable: {', '.join(LEARNABLE_FIELDS)})")


def structure(v: Optional["Variants"]) -> tuple:
    """What a call's encoding depends on: the fields' values, tensors by their dims."""
    if v is None:
        return ()
    return tuple(x.dims if isinstance(x, Tensor) else tuple(x) if isinstance(x, list) else x
                 for x in (getattr(v, name) for name, _ in _FIELDS))


def op_arguments(v: Optional["Variants"], names) -> dict:
    """The op's variant arguments but the tensors' data: values, and each
    tensor's dim names (``names(dims)``); tensor_arguments gives their data."""
    out = {}
    if v is None:
        return out
    for name, kind in _FIELDS:
        x = getattr(v, name)
        if not _on(x):
            continue
        if kind == "window":
            out[name] = list(x)
        elif kind in ("tensor", "learnable"):
            out[name + "_dims"] = names(x.dims)
        elif kind == "number":
            out[name] = float(x)
        else:
            out[name] = x
    return out


def tensor_arguments(v: Optional["Variants"]) -> dict:
    """The op's variant tensors of this call (their data changes per call)."""
    if v is None:
        return {}
    return {name: x.raw for name in TENSOR_FIELDS if (x := getattr(v, name)) is not None}
