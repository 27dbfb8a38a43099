"""``dimattn.scaled_dot_product_attention``: torch's ``F.scaled_dot_product_attention``
signature and semantics on dimattn's kernels, for code without named dims; and
``sdpa_patched()``, which makes existing calls of torch's function run on it.

One kernel path, another door: the positional tensors get named dims (their batch
dims, heads — kv heads and query groups with ``enable_gqa`` —, query and kv positions,
features) and the call is :func:`dimattn.dot_attention`. A bool ``attn_mask`` becomes
its ``mask``, a float one its ``bias`` (with its gradient), each over the dims it does
not broadcast along: never expanded.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Dict, Optional, Tuple

import torch

from ._attention import dot_attention
from ._context import force, trace
from ._core import Dim, Tensor

__all__ = ["scaled_dot_product_attention", "sdpa_patched"]


class _Dims:
    """The Dims of one combination of shapes (kept, so that repeated calls reuse their
    encoding: dimattn caches a call's encoding by its Dims' identities)."""

    def __init__(self, batch: Tuple[int, ...], hq: int, hk: int, L: int, S: int, E: int, Ev: int, gqa: bool):
        self.batch = [Dim(f"n{i}", n) for i, n in enumerate(batch)]
        self.grouped = gqa and hq != hk
        self.heads = Dim("heads", hk)
        self.group = Dim("group", hq // hk) if self.grouped else None
        self.query, self.kv = Dim("l", L), Dim("s", S)
        self.feat, self.vfeat = Dim("e", E), Dim("ev", Ev)
        self.query_heads = [self.heads, self.group] if self.grouped else [self.heads]
        # The operands' dims as tuples (the checked shapes fit them: Tensor._trusted).
        self.q = (*self.batch, *self.query_heads, self.query, self.feat)
        self.k = (*self.batch, self.heads, self.kv, self.feat)
        self.v = (*self.batch, self.heads, self.kv, self.vfeat)
        self.out = [*self.batch, *self.query_heads, self.query, self.vfeat]


_cache = threading.local()
_KEPT = 64


def _dims(key: tuple) -> _Dims:
    table: Dict[tuple, _Dims] = getattr(_cache, "table", None)
    if table is None:
        table = _cache.table = {}
    d = table.get(key)
    if d is None:
        if len(table) >= _KEPT:
            table.pop(next(iter(table)))
        d = table[key] = _Dims(*key)
    return d


def _per_head(x: torch.Tensor, d: _Dims) -> Tensor:
    """A tensor over the query heads ``[Hq]`` (sinks) over the call's head dims."""
    return Tensor(x.unflatten(0, (d.heads.size, d.group.size)) if d.grouped else x, d.query_heads)


def _mask_tensor(mask: torch.Tensor, d: _Dims, target: Tuple[int, ...]) -> Tensor:
    """attn_mask, broadcastable to target = (N..., Hq, L, S), as a Tensor over the dims
    it does not broadcast along (a size-1 axis is dropped, never expanded); its Hq axis
    splits into (kv heads, group) under GQA."""
    if mask.dim() > len(target):
        raise RuntimeError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {target}")
    names = [*d.batch, "hq", d.query, d.kv][len(target) - mask.dim():]
    raw, dims = mask, []
    for axis, (size, name) in reversed(list(enumerate(zip(mask.shape, names)))):
        want = target[len(target) - mask.dim() + axis]
        if size == 1 and want != 1:
            raw = raw.squeeze(axis)
            continue
        if size != want:
            raise RuntimeError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {target}")
        if name == "hq":
            if d.grouped:
                raw = raw.unflatten(axis, (d.heads.size, d.group.size))
                dims[:0] = [d.heads, d.group]
                continue
            name = d.heads
        dims.insert(0, name)
    return Tensor(raw, dims)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on dimattn's kernels, with
    torch's signature and semantics (torch 2.11).

    Args:
        query: ``(N..., Hq, L, E)``, any number of leading batch dims.
        key: ``(N..., H, S, E)``.
        value: ``(N..., H, S, Ev)``.
        attn_mask: broadcastable to ``(N..., Hq, L, S)``: bool (True = may attend) or
            float (added to the scores; it gets a gradient). Never expanded.
        dropout_p: dropout on the weights whenever > 0 (as torch), its mask drawn from
            torch's default generator through dimattn's Philox stream.
        is_causal: query i attends keys j <= i (top-left aligned, as torch). Not with
            ``attn_mask``.
        scale: default 1/sqrt(E).
        enable_gqa: H may divide Hq: query head h reads kv head h // (Hq / H), the kv
            heads never repeated.

    Returns:
        ``(N..., Hq, L, Ev)`` in the query's dtype. A query row that may attend no key
        gives 0 (torch's math backend gives NaN there; docs/python.md).
    """
    if attn_mask is not None and is_causal:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    return positional_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def positional_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool, scale: Optional[float],
                         enable_gqa: bool, softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                         weights: bool = False):
    """The one positional call behind scaled_dot_product_attention and
    dimattn.transformers: as scaled_dot_product_attention, plus dimattn's variants
    ``softcap`` and ``sinks`` (a logit per query head, ``[Hq]``, learnable); with
    ``weights``, (output, the attention weights ``(N..., Hq, L, S)`` of dimattn's
    reference path) instead of the output."""
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        raise RuntimeError(f"scaled_dot_product_attention: query, key and value need the same rank >= 2, got "
                           f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError(f"Expected query, key, and value to have the same dtype, but got query.dtype: "
                           f"{query.dtype} key.dtype: {key.dtype} and value.dtype: {value.dtype} instead.")
    headless = query.dim() == 2  # (L, E): one head, no batch
    if headless:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    *batch, hq, L, E = query.shape
    hk, S, Ev = key.shape[-3], key.shape[-2], value.shape[-1]
    if list(key.shape[:-3]) != batch or list(value.shape[:-3]) != batch or value.shape[-3] != hk or \
            value.shape[-2] != S or key.shape[-1] != E:
        raise RuntimeError(f"scaled_dot_product_attention: shapes of query {tuple(query.shape)}, key "
                           f"{tuple(key.shape)} and value {tuple(value.shape)} do not fit (N..., Hq, L, E), "
                           f"(N..., H, S, E), (N..., H, S, Ev)")
    if hq != hk and not (enable_gqa and hk > 0 and hq % hk == 0):
        raise RuntimeError(f"scaled_dot_product_attention: the number of query heads {hq} and of key/value heads "
                           f"{hk} differ" + ("; pass enable_gqa=True" if not enable_gqa else
                                             f"; with enable_gqa query heads must be a multiple of key heads"))
    d = _dims((tuple(batch), hq, hk, L, S, E, Ev, bool(enable_gqa)))
    q_raw = query.unflatten(-3, (hk, hq // hk)) if d.grouped else query
    variants = {}
    if attn_mask is not None:
        target = (*batch, hq, L, S)
        m = _mask_tensor(attn_mask, d, target)
        variants["mask" if attn_mask.dtype == torch.bool else "bias"] = m
    if softcap is not None:
        variants["softcap"] = float(softcap)
    if sinks is not None:
        variants["sinks"] = _per_head(sinks, d)

    def call():
        return dot_attention(Tensor._trusted(q_raw, d.q), Tensor._trusted(key, d.k), Tensor._trusted(value, d.v),
                             key_dim=d.feat,
                             axis=d.kv, att_dropout=float(dropout_p), train=dropout_p > 0,
                             causal_query_spatial_dim=d.query if is_causal else None,
                             query_position_dim=None if is_causal else d.query,
                             causal_offset=0 if is_causal and L != S else None, scale=scale, **variants)

    def positional(x: Tensor, last: Dim) -> torch.Tensor:
        raw = x.raw_in([*d.batch, *d.query_heads, d.query, last])
        raw = raw.flatten(-4, -3) if d.grouped else raw
        return raw.squeeze(0) if headless else raw

    if not weights:
        return positional(call(), d.vfeat)
    with force("reference"), trace() as t:
        out = call()
    w = t.records[-1].att_weights
    kv = [x for x in w.dims if x not in (*d.batch, *d.query_heads, d.query)][0]  # the kv dim dot_attention made
    return positional(out, d.vfeat), positional(w, kv)


@contextlib.contextmanager
def sdpa_patched():
    """``with dimattn.sdpa_patched():`` — inside, ``torch.nn.functional.
    scaled_dot_product_attention`` (and so ``nn.MultiheadAttention``, timm, Hugging Face's
    ``sdpa`` attention and any code that calls it) runs on
    :func:`scaled_dot_product_attention`; afterwards torch's function is back. Not
    thread-scoped: the module attribute is replaced for the process.

    Returns:
        A context manager.
    """
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original
