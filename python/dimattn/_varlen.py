"""Packed (varlen, "thd") attention: sequences laid end to end in one token dim.

A ``[tokens, heads, D]`` tensor holds several sequences back to back; each
attends only within its own sequence. The raw entry points take the sequence
boundaries as FlashAttention (``cu_seqlens``) or RETURNN's packed backend
(starts and lengths, gaps allowed) give them. Either runs as one dot_attention
call over the token dims as they are, no copy (docs/python.md, "Packed
sequences"): each token's sequence is its segment id (gap tokens match nothing),
and causal masking is causal over the token positions when query and keys share
one packing, else each query row's kv end (its sequence's kv start plus its
causal prefix) as a per-row kv length. The kernel bounds each row to its
sequence's run of kv positions and skips the blocks between sequences.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._core import Dim, Error, Tensor
from ._attention import dot_attention

__all__ = ["varlen_attention", "packed_attention", "PackedCall"]


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     dropout_p: float = 0.0, scale: Optional[float] = None) -> torch.Tensor:
    """Attention over packed sequences given by cumulative lengths (FlashAttention's
    ``flash_attn_varlen_func`` convention): sequence b holds query tokens
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and keys/values ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``.
    See :func:`packed_attention` for shapes and semantics.

    Args:
        query, key, value: ``[tokens, heads, D]``, ``[tokens_k, kv_heads, D]``, ``[tokens_k, kv_heads, Dv]``.
        cu_seqlens_q, cu_seqlens_k: ``[sequences + 1]`` integer offsets, 0 first.
        max_seqlen_q, max_seqlen_k: bounds of the sequences' lengths.
        causal, dropout_p, scale: as :func:`packed_attention`.

    Returns:
        ``[tokens, heads, Dv]``.
    """
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1:
            raise Error(f"[varlen_attention] {name} must be a 1-d integer tensor of sequences + 1 offsets "
                        f"(0 first), got {_describe(cu)}")
    return PackedCall(query, key, value, cu_seqlens_q[:-1], cu_seqlens_q.diff(), cu_seqlens_k[:-1],
                      cu_seqlens_k.diff(), max_seqlen_q, max_seqlen_k, causal=causal, dropout_p=dropout_p,
                      scale=scale, op="varlen_attention").run()


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts_q: torch.Tensor,
                     lens_q: torch.Tensor, starts_k: torch.Tensor, lens_k: torch.Tensor, max_len_q: int,
                     max_len_k: int, *, causal: bool = False, dropout_p: float = 0.0,
                     scale: Optional[float] = None) -> torch.Tensor:
    """Attention over packed sequences given by their starts and lengths (RETURNN's
    ``sdpa_varlen_raw`` convention; tokens between sequences are gaps, which no
    query attends and whose output rows are 0).

    query ``[tokens_q, heads, D]``, key ``[tokens_k, kv_heads, D]``, value
    ``[tokens_k, kv_heads, Dv]`` with ``heads`` a multiple of ``kv_heads`` (query
    head h reads kv head ``h // (heads // kv_heads)``, grouped-query attention);
    returns ``[tokens_q, heads, Dv]``. Sequence b: query tokens ``starts_q[b] +
    [0, lens_q[b])``, kv tokens ``starts_k[b] + [0, lens_k[b])``; ``max_len_q`` and
    ``max_len_k`` bound the lengths. ``causal``: query i of a sequence attends kv
    positions ``j <= i + lens_k[b] - lens_q[b]`` (the last query sees the last key,
    FlashAttention's convention; plain causal when the lengths agree). Dropout acts
    with ``dropout_p > 0`` (RETURNN passes 0 outside training). ``scale`` defaults to
    ``1/sqrt(D)``. A sequence of length 0 gives no rows; a query sequence whose kv
    sequence is empty gives 0.

    Args:
        query, key, value: the packed tokens (shapes above).
        starts_q, lens_q, starts_k, lens_k: ``[sequences]`` integers.
        max_len_q, max_len_k: bounds of the lengths.
        causal, dropout_p, scale: see above.

    Returns:
        ``[tokens_q, heads, Dv]``; gap tokens give 0.
    """
    return PackedCall(query, key, value, starts_q, lens_q, starts_k, lens_k, max_len_q, max_len_k, causal=causal,
                      dropout_p=dropout_p, scale=scale, op="packed_attention").run()


class PackedCall:
    """A packed call as a dot_attention call (``part``: its named operands and keyword
    arguments; None when no token attends) and its output as the packed rows
    (``run``). dimattn.returnn asks the selection about the part before it runs."""

    def __init__(self, query, key, value, starts_q, lens_q, starts_k, lens_k, max_len_q, max_len_k, *, causal,
                 dropout_p, scale, op):
        _check_tokens(op, query, key, value)
        n = _check_sequences(op, starts_q, lens_q, starts_k, lens_k, query.shape[0], key.shape[0], max_len_q,
                             max_len_k)
        if not 0.0 <= dropout_p < 1.0:
            raise Error(f"[{op}] dropout_p must be in [0, 1), got {dropout_p}")
        self.shape = (query.shape[0], query.shape[1], value.shape[2])
        self.inputs = (query, key, value)
        self.part = None
        if query.shape[0] == 0 or n == 0 or key.shape[0] == 0:
            return
        on = dict(device=query.device, dtype=torch.int64)
        self.part = _InPlace(query, key, value, starts_q.to(**on), lens_q.to(**on), starts_k.to(**on),
                             lens_k.to(**on), causal=causal, dropout_p=dropout_p, scale=scale)

    def run(self) -> torch.Tensor:
        """The packed ``[tokens_q, heads, Dv]`` output, 0 in gap rows (all 0, still on
        the autograd graph, when nothing attends)."""
        query, key, value = self.inputs
        part = self.part
        if part is None:
            return query.new_zeros(self.shape) + 0 * (query.sum() + key.sum() + value.sum())
        return part.rows(dot_attention(part.query, part.keys, part.values, **part.kwargs))


def _token_ids(starts: torch.Tensor, lens: torch.Tensor, gap: torch.Tensor):
    """Each token's sequence (``gap``'s ids between sequences), and per real token its
    sequence and its position in it, in order of sequences."""
    seq = torch.arange(lens.numel(), device=starts.device).repeat_interleave(lens)
    first = torch.cumsum(lens, 0) - lens  # each sequence's first token among the real ones
    local = torch.arange(seq.numel(), device=starts.device) - first.repeat_interleave(lens)
    rows = starts.repeat_interleave(lens) + local
    ids = gap.to(torch.int64).index_put((rows,), seq)
    return ids, rows, seq, local


class _InPlace:
    """Query and keys over their token dims as they are, each token's sequence its
    segment id (gap tokens: -1 on the query side, -2 - token on the kv side, so that
    they attend and are attended by nothing). Causal: with one packing, causal over the
    token positions is causal within each sequence; otherwise query token i of
    sequence b at position p attends kv tokens before starts_k[b] + p + lens_k[b] -
    lens_q[b] + 1, its kv dim's length per query row."""

    def __init__(self, query, key, value, starts_q, lq, starts_k, lk, *, causal, dropout_p, scale):
        Tq, Tk, H, Hkv, Dv = query.shape[0], key.shape[0], query.shape[1], key.shape[1], value.shape[2]
        tq, heads, group = Dim("tokens", Tq), Dim("kv_heads", Hkv), Dim("group", H // Hkv)
        feat, vfeat = Dim("feat", query.shape[2]), Dim("vfeat", Dv)
        ids_q, rows, seq, local = _token_ids(starts_q, lq, torch.full((Tq,), -1, device=query.device))
        # Each kv gap token its own id (below -1): every id's kv tokens stay one run.
        ids_k = _token_ids(starts_k, lk, -2 - torch.arange(Tk, device=query.device))[0]
        one_packing = Tq == Tk and torch.equal(lq, lk) and torch.equal(starts_q, starts_k)
        causal_dim = tq if causal and one_packing else None
        if one_packing:
            tk = tq
        elif causal:
            end = torch.zeros(Tq, dtype=torch.int64, device=query.device)
            end[rows] = (starts_k + lk - lq)[seq] + local + 1
            tk = Dim.dynamic("tokens_kv", Tensor(end.clamp(min=0), [tq]))
        else:
            tk = Dim("tokens_kv", Tk)
        self.query = Tensor(query.reshape(Tq, Hkv, H // Hkv, query.shape[2]), [tq, heads, group, feat])
        self.keys = Tensor(key, [tk, heads, feat])
        self.values = Tensor(value, [tk, heads, vfeat])
        self.kwargs = dict(key_dim=feat, axis=tk, att_dropout=dropout_p, causal_query_spatial_dim=causal_dim,
                           scale=scale, train=dropout_p > 0, query_segments=Tensor(ids_q, [tq]),
                           kv_segments=Tensor(ids_k, [tk]))
        self._out_dims = [tq, heads, group, vfeat]
        self._shape = (Tq, H, Dv)

    def rows(self, out: Tensor) -> torch.Tensor:
        return out.raw_in(self._out_dims).reshape(self._shape)


def _check_tokens(op: str, query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise Error(f"[{op}] {name} must be a [tokens, heads, D] torch.Tensor, got {_describe(t)}")
    if key.shape[:2] != value.shape[:2]:
        raise Error(f"[{op}] key {tuple(key.shape)} and value {tuple(value.shape)} must agree in tokens and heads")
    if query.shape[2] != key.shape[2]:
        raise Error(f"[{op}] query's D = {query.shape[2]} differs from key's D = {key.shape[2]}")
    if key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        raise Error(f"[{op}] query's {query.shape[1]} heads must be a multiple of key's {key.shape[1]} heads "
                    f"(grouped-query attention); repeat the kv heads or give as many")


def _check_sequences(op: str, starts_q, lens_q, starts_k, lens_k, total_q: int, total_k: int, max_q: int,
                     max_k: int) -> int:
    """The number of sequences, after checking the boundaries describe sequences
    inside the token dims."""
    n = None
    for side, starts, lens, total, most in (("query", starts_q, lens_q, total_q, max_q),
                                            ("kv", starts_k, lens_k, total_k, max_k)):
        for name, t in (("starts", starts), ("lengths", lens)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
                raise Error(f"[{op}] the {side} sequences' {name} must be a 1-d int32/int64 tensor, "
                            f"got {_describe(t)}")
        if starts.numel() != lens.numel():
            raise Error(f"[{op}] {starts.numel()} {side} starts but {lens.numel()} lengths")
        if n is not None and starts.numel() != n:
            raise Error(f"[{op}] {n} query sequences but {starts.numel()} kv sequences; give each query sequence "
                        f"its kv sequence (length 0 where it has none)")
        n = starts.numel()
        if not isinstance(most, int) or most < 0:
            raise Error(f"[{op}] the {side} sequences' maximal length must be an int >= 0, got {most!r}")
        if n == 0:
            continue
        if bool((lens < 0).any()) or bool((starts < 0).any()):
            raise Error(f"[{op}] {side} starts and lengths must be >= 0, got starts {starts.tolist()}, "
                        f"lengths {lens.tolist()}")
        if int(lens.max()) > most:
            raise Error(f"[{op}] a {side} sequence has length {int(lens.max())} > the given maximum {most}; "
                        f"pass the longest length (or more)")
        end = starts.to(torch.int64) + lens.to(torch.int64)
        if int(end.max()) > total:
            b = int(end.argmax())
            raise Error(f"[{op}] {side} sequence {b} ends at token {int(end[b])}, past the {total} tokens")
        # Each token belongs to one sequence at most (a token's sequence is its segment id).
        real = (lens > 0).nonzero().flatten()
        order = real[torch.argsort(starts[real], stable=True)]
        shared = (starts[order][1:].to(torch.int64) < end[order][:-1]).nonzero().flatten()
        if shared.numel():
            a, b = int(order[shared[0]]), int(order[shared[0] + 1])
            raise Error(f"[{op}] {side} sequences {a} and {b} share tokens (tokens {int(starts[a])}..{int(end[a]) - 1} "
                        f"and {int(starts[b])}..{int(end[b]) - 1}); sequences must not overlap (copy the shared "
                        f"tokens into each)")
    return n


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a tensor of shape {tuple(t.shape)} and dtype {t.dtype}"
    return type(t).__name__
