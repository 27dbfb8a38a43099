"""Attention over a KV cache in FlashAttention's and vLLM's terms (docs/python.md,
"KV caches"): contiguous caches ``[batch, seqlen, kv_heads, D]`` or paged pools of
blocks addressed through a block table, read in place, and appending new keys
and values to a pool in place through a slot mapping.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ._context import forced
from ._core import Error
from ._call import raise_as_error
from ._ops import ops

__all__ = ["kv_cache_attention", "kv_cache_append"]


def kv_cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                       block_table: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None, *,
                       causal: bool = True, softmax_scale: Optional[float] = None,
                       window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                       alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
                       kv_layout: str = "NHD") -> torch.Tensor:
    """Attention of new query positions over a KV cache, read in place
    (FlashAttention's ``flash_attn_with_kvcache`` without the append; append
    with :func:`kv_cache_append` first).

    Args:
        q: ``[batch, new, heads, D]``, or ``[tokens, heads, D]`` with ``cu_seqlens_q``
            (continuous batching: sequence b's new positions are rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``).
        k_cache, v_cache: without ``block_table``, ``[batch, seqlen, kv_heads, D]``;
            with it, pools ``[num_blocks, block_size, kv_heads, D]`` (``kv_layout="NHD"``)
            or ``[num_blocks, kv_heads, block_size, D]`` (``"HND"``). ``heads`` must be
            a multiple of ``kv_heads`` (grouped-query attention).
        cache_seqlens: ``[batch]`` integers: each sequence's cached positions, its new
            ones included (vLLM's ``seq_lens``).
        block_table: ``[batch, max_blocks]`` int32: sequence b's position j lies in
            block ``block_table[b, j // block_size]``; entries past its blocks are not read.
        cu_seqlens_q: ``[batch + 1]`` offsets of the packed ``q``'s sequences.
        causal: the new positions are the last of their sequence: new row i of
            sequence b attends positions ``j <= cache_seqlens[b] - new_b + i``.
        softmax_scale: default ``1/sqrt(D)``.
        window_size: ``(left, right)``; ``left >= 0`` limits each row to the ``left``
            positions before its diagonal (``right`` must be -1 or 0 with causal).
        softcap: scores become ``softcap * tanh(score / softcap)`` when > 0.
        alibi_slopes: ``[heads]`` or ``[batch, heads]``: scores lose ``slope * |i' - j|``,
            ``i'`` the row's position in its sequence (FlashAttention's convention).
        sinks: ``[heads]`` or ``[batch, heads]`` logits joining each row's softmax
            denominator (GPT-OSS's ``s_aux``); with a gradient, the gathered path runs.

    Returns:
        ``[batch, new, heads, Dv]`` (``[tokens, heads, Dv]`` with ``cu_seqlens_q``);
        rows past a sequence's new positions are 0.

    On the CPU dimattn's kernel reads the cache in place (its decode path for up to
    16 new positions); elsewhere, or when ``q`` needs a gradient, the pages are
    gathered and dot_attention runs on them.
    """
    return _run(q, k_cache, v_cache, cache_seqlens, block_table, cu_seqlens_q, causal, softmax_scale, window_size,
                softcap, alibi_slopes, sinks, kv_layout)[0]


def _run(q, k_cache, v_cache, cache_seqlens, block_table, cu_seqlens_q, causal, softmax_scale, window_size, softcap,
         alibi_slopes, sinks, kv_layout):
    """kv_cache_attention's output and the kernel that ran."""
    op = "[kv_cache_attention]"
    if kv_layout not in ("NHD", "HND"):
        raise Error(f"{op} kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    if block_table is None and kv_layout != "NHD":
        raise Error(f"{op} a contiguous cache is [batch, seqlen, kv_heads, D] (kv_layout='NHD')")
    if window_size[1] not in (-1, 0) and causal:
        raise Error(f"{op} window_size={window_size}: the right side must be -1 or 0 with causal")
    if window_size[1] > 0:
        raise Error(f"{op} window_size={window_size}: only a left window is supported here")
    if window_size[0] < -1:
        raise Error(f"{op} window_size={window_size}: the left side must be -1 (no window) or >= 0")
    if not (softcap >= 0 and math.isfinite(softcap)):
        raise Error(f"{op} softcap={softcap} must be finite and >= 0 (0: no soft-capping)")
    if softmax_scale is not None and not math.isfinite(softmax_scale):
        raise Error(f"{op} softmax_scale={softmax_scale} must be finite; leave it None for 1/sqrt(head_dim)")
    if q.shape[-1] == 0:
        raise Error(f"{op} q {tuple(q.shape)} has head_dim 0: scores need at least one feature")
    packed = cu_seqlens_q is not None
    seqlens_q = None
    if packed:
        if q.dim() != 3 or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() != cache_seqlens.numel() + 1:
            raise Error(f"{op} with cu_seqlens_q, q must be [tokens, heads, D] and cu_seqlens_q [batch + 1]; got q "
                        f"{tuple(q.shape)}, cu_seqlens_q {tuple(cu_seqlens_q.shape)}, batch {cache_seqlens.numel()}")
        _check_offsets(op, cu_seqlens_q, q.shape[0])
        seqlens_q = cu_seqlens_q.diff()
        rows, q = _pad(q, cu_seqlens_q, seqlens_q)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    allowed = forced()
    args = (q, k_cache, v_cache, cache_seqlens, block_table, seqlens_q, causal, scale, window_size[0], softcap,
            alibi_slopes, sinks, kv_layout == "HND", ",".join(allowed) if allowed else "auto")
    if torch.compiler.is_compiling():
        # torch.compile traces the opaque form (its fake gives the shape); the
        # gathered path's gradient needs the composite op, eager.
        if torch.is_grad_enabled() and q.requires_grad:
            raise Error(f"{op} a gradient of q under torch.compile is not supported: call it eagerly "
                        "(torch.compiler.disable) or under torch.no_grad()")
        out, kernel = kv_cache_attention_opaque(*args), None
    else:
        # Inline, not shared with kv_cache_attention_opaque through a helper:
        # after the graph break of a gradient call dynamo would trace the
        # helper as a frame of its own, into the composite op.
        try:
            out, kernel = ops.kv_cache_attention(*args)
        except RuntimeError as err:
            raise_as_error(err)
    if packed:
        out = out.reshape(-1, *out.shape[2:])[rows]
    return out, kernel


@torch.library.custom_op("dimattn::kv_cache_attention_opaque", mutates_args=())
def kv_cache_attention_opaque(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor],
                              seqlens_q: Optional[torch.Tensor], causal: bool, scale: float, window_left: int,
                              softcap: float, alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                              heads_outer: bool, force: str) -> torch.Tensor:
    """The op dimattn::kv_cache_attention's output (python/csrc/kv_cache_ops.cpp
    has the arguments) as one opaque op with a fake kernel: what torch.compile
    traces, for calls without a gradient. Python, so that bad input inside a
    compiled graph still raises dimattn.Error (a C++ op's error reaches the
    caller as torch's RuntimeError there)."""
    try:
        out, _ = ops.kv_cache_attention(q, k_cache, v_cache, cache_seqlens, block_table, seqlens_q, causal, scale,
                                        window_left, softcap, alibi_slopes, sinks, heads_outer, force)
    except RuntimeError as err:
        raise_as_error(err)
    return out.contiguous()


@kv_cache_attention_opaque.register_fake
def _kv_cache_attention_fake(q, k_cache, v_cache, *args):
    # [batch, new, heads, Dv]; a q of another rank gets its error from the op itself, at run time.
    return q.new_empty(*q.shape[:-1], v_cache.shape[-1])


def _check_offsets(op: str, cu: torch.Tensor, tokens: int) -> None:
    """cu_seqlens_q must be integer offsets from 0 to the packed q's tokens, never decreasing."""
    if cu.is_floating_point() or cu.dtype == torch.bool:
        raise Error(f"{op} cu_seqlens_q must be an integer tensor, got {cu.dtype}")
    ends = cu.tolist()
    if ends[0] != 0 or ends[-1] != tokens or any(b < a for a, b in zip(ends, ends[1:])):
        raise Error(f"{op} cu_seqlens_q {ends} must rise from 0 to q's {tokens} tokens, never decreasing")


def _pad(q: torch.Tensor, cu: torch.Tensor, lens: torch.Tensor):
    """The packed rows as [batch, max new, heads, D] (a copy of the few query rows)
    and the index of each packed row in the padded rows."""
    batch, most = lens.numel(), int(lens.max()) if lens.numel() else 0
    seq = torch.repeat_interleave(torch.arange(batch, device=q.device), lens)
    within = torch.arange(q.shape[0], device=q.device) - cu[:-1].repeat_interleave(lens)
    rows = seq * most + within
    padded = q.new_zeros(batch * most, *q.shape[1:])
    padded[rows] = q
    return rows, padded.view(batch, most, *q.shape[1:])


def kv_cache_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor, *, kv_layout: str = "NHD") -> None:
    """Writes new keys and values into the pools in place (vLLM's
    ``reshape_and_cache``): token t goes to block ``slot_mapping[t] // block_size``,
    position ``slot_mapping[t] % block_size``; a negative slot skips its token.

    Args:
        k_cache, v_cache: pools as for :func:`kv_cache_attention` (a contiguous
            ``[batch, seqlen, kv_heads, D]`` cache is a pool of ``batch`` blocks of
            ``seqlen``: slot ``b * seqlen + j``).
        k, v: ``[tokens, kv_heads, D]`` and ``[tokens, kv_heads, Dv]``.
        slot_mapping: ``[tokens]`` integers.
    """
    op = "[kv_cache_append]"
    if kv_layout not in ("NHD", "HND"):
        raise Error(f"{op} kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    hnd = kv_layout == "HND"
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise Error(f"{op} k_cache and v_cache must be 4-d pools alike but for their last dim; got "
                    f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    block_size, kv_heads = (k_cache.shape[2], k_cache.shape[1]) if hnd else (k_cache.shape[1], k_cache.shape[2])
    capacity = k_cache.shape[0] * block_size
    if k.dim() != 3 or v.dim() != 3 or slot_mapping.shape != (k.shape[0],) or v.shape[0] != k.shape[0]:
        raise Error(f"{op} k, v must be [tokens, kv_heads, D] and slot_mapping [tokens]; got k {tuple(k.shape)}, "
                    f"v {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)}")
    if k.shape[1:] != (kv_heads, k_cache.shape[3]) or v.shape[1:] != (kv_heads, v_cache.shape[3]):
        raise Error(f"{op} k {tuple(k.shape)} and v {tuple(v.shape)} must be [tokens, {kv_heads}, {k_cache.shape[3]}] "
                    f"and [tokens, {kv_heads}, {v_cache.shape[3]}] for pools {tuple(k_cache.shape)} "
                    f"(kv_layout={kv_layout!r})")
    if slot_mapping.is_floating_point() or slot_mapping.dtype == torch.bool:
        raise Error(f"{op} slot_mapping must be an integer tensor, got {slot_mapping.dtype}")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    used, counts = slots.unique(return_counts=True)
    if bool((counts > 1).any()):
        raise Error(f"{op} slot_mapping gives slot {int(used[counts > 1][0])} to {int(counts[counts > 1][0])} tokens: which "
                    "one would stay is undefined; give each token its own slot")
    if slots.numel() and int(slots.max()) >= capacity:
        raise Error(f"{op} slot {int(slots.max())} is past the pools' {capacity} slots "
                    f"({k_cache.shape[0]} blocks of {block_size})")
    blocks, within = slots // block_size, slots % block_size
    for cache, x in ((k_cache, k), (v_cache, v)):
        if hnd:
            cache[blocks, :, within] = x[keep].to(cache.dtype)
        else:
            cache[blocks, within] = x[keep].to(cache.dtype)
