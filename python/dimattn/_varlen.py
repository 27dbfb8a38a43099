"""Packed (varlen, "thd") attention: sequences laid end to end in one token dim.

A ``[tokens, heads, D]`` tensor holds several sequences back to back; each
attends only within its own sequence. The raw entry points take the sequence
boundaries as FlashAttention (``cu_seqlens``) or RETURNN's packed backend
(starts and lengths, gaps allowed) give them. Two ways to run it on dot_attention
(docs/python.md, "Packed sequences"):

- query and keys share one packing (self-attention): one call over the token dim
  as it is, no copy, each token's sequence as its segment id (gap tokens match
  nothing); the kernel skips the blocks between sequences.
- otherwise (cross-attention, other packings): calls over ``[seq, time]`` with
  ``time`` dynamic (each sequence its own length), one per power-of-two length
  class; the tokens are gathered into that padded layout and the output scattered
  back, and the kernel skips past each sequence's length.
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
    See :func:`packed_attention` for shapes and semantics."""
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
    """
    return PackedCall(query, key, value, starts_q, lens_q, starts_k, lens_k, max_len_q, max_len_k, causal=causal,
                      dropout_p=dropout_p, scale=scale, op="packed_attention").run()


class PackedCall:
    """A packed call as dot_attention calls (``parts``: named operands and keyword
    arguments; none when no token attends) and their outputs put back in the packed
    rows (``run``). One part over the token dim itself with segment ids when query
    and keys share their packing; else one per bucket of sequences of similar length:
    a bucket holds the sequences whose longer side falls in one power-of-two range,
    padded to its longest (each sequence is padded by less than its own length, so
    the copies stay within twice the tokens whatever the spread of lengths).
    dimattn.returnn asks the selection about the first part before it runs."""

    def __init__(self, query, key, value, starts_q, lens_q, starts_k, lens_k, max_len_q, max_len_k, *, causal,
                 dropout_p, scale, op):
        _check_tokens(op, query, key, value)
        n = _check_sequences(op, starts_q, lens_q, starts_k, lens_k, query.shape[0], key.shape[0], max_len_q,
                             max_len_k)
        if not 0.0 <= dropout_p < 1.0:
            raise Error(f"[{op}] dropout_p must be in [0, 1), got {dropout_p}")
        self.shape = (query.shape[0], query.shape[1], value.shape[2])
        self.inputs = (query, key, value)
        self.parts = []
        if query.shape[0] == 0 or n == 0 or key.shape[0] == 0:
            return
        lq, lk = lens_q.to(torch.int64), lens_k.to(torch.int64)
        if query.shape[0] == key.shape[0] and torch.equal(lq, lk) and torch.equal(starts_q.to(torch.int64),
                                                                                   starts_k.to(torch.int64)):
            self.parts.append(_InPlace(query, key, value, starts_q, lq, causal=causal, dropout_p=dropout_p,
                                       scale=scale))
            return
        longer = torch.maximum(lq, lk)
        size_class = torch.where(longer > 0, torch.ceil(torch.log2(longer.clamp(min=1).double())), -1).long()
        for c in torch.unique(size_class).tolist():
            if c < 0 and (lq[size_class == c] == 0).all():
                continue  # sequences without queries: no rows to compute
            pick = (size_class == c).nonzero().flatten()
            self.parts.append(_Bucket(query, key, value, starts_q[pick], lq[pick], starts_k[pick], lk[pick],
                                        causal=causal, dropout_p=dropout_p, scale=scale))

    def run(self) -> torch.Tensor:
        """The packed ``[tokens_q, heads, Dv]`` output: the buckets' rows scattered
        back, 0 in gap rows (all 0, still on the autograd graph, when nothing attends)."""
        query, key, value = self.inputs
        result = query.new_zeros(self.shape)
        if not self.parts:
            return result + 0 * (query.sum() + key.sum() + value.sum())
        outs = [b.rows(dot_attention(b.query, b.keys, b.values, **b.kwargs)) for b in self.parts]
        if self.parts[0].tokens is None:  # in place: every packed row, in order
            return outs[0]
        tokens = torch.cat([b.tokens for b in self.parts])
        return result.index_copy(0, tokens, torch.cat(outs))


class _InPlace:
    """Query and keys of one packing as they are, over the token dim, each token's
    sequence its segment id (gap tokens: -1 on the query side, -2 on the kv side, so
    they attend and are attended by nothing); causal over token positions is causal
    within each sequence."""

    tokens = None

    def __init__(self, query, key, value, starts, lens, *, causal, dropout_p, scale):
        T, H, Hkv, Dv = query.shape[0], query.shape[1], key.shape[1], value.shape[2]
        tok, heads, group = Dim("tokens", T), Dim("kv_heads", Hkv), Dim("group", H // Hkv)
        feat, vfeat = Dim("feat", query.shape[2]), Dim("vfeat", Dv)
        seq = torch.arange(lens.numel(), device=query.device).repeat_interleave(lens)
        first = torch.cumsum(lens, 0) - lens  # each sequence's first row among the real rows
        rows = starts.to(torch.int64).repeat_interleave(lens) + torch.arange(seq.numel(), device=query.device) \
            - first.repeat_interleave(lens)
        ids_q = torch.full((T,), -1, dtype=torch.int64, device=query.device).index_put((rows,), seq)
        ids_k = torch.full((T,), -2, dtype=torch.int64, device=query.device).index_put((rows,), seq)
        self.query = Tensor(query.reshape(T, Hkv, H // Hkv, query.shape[2]), [tok, heads, group, feat])
        self.keys = Tensor(key, [tok, heads, feat])
        self.values = Tensor(value, [tok, heads, vfeat])
        self.kwargs = dict(key_dim=feat, axis=tok, att_dropout=dropout_p, causal_query_spatial_dim=tok if causal
                           else None, scale=scale, train=dropout_p > 0, query_segments=Tensor(ids_q, [tok]),
                           kv_segments=Tensor(ids_k, [tok]))
        self._out_dims = [tok, heads, group, vfeat]
        self._shape = (T, H, Dv)

    def rows(self, out: Tensor) -> torch.Tensor:
        return out.raw_in(self._out_dims).reshape(self._shape)


class _Bucket:
    """Sequences padded to their longest as named operands, and the packed token of
    each real query row (``tokens``)."""

    def __init__(self, query, key, value, starts_q, lq, starts_k, lk, *, causal, dropout_p, scale):
        n, H, Hkv, Dv = lq.numel(), query.shape[1], key.shape[1], value.shape[2]
        max_q, max_k = int(lq.max()), int(lk.max())
        seq, heads, group = Dim("seq", n), Dim("kv_heads", Hkv), Dim("group", H // Hkv)
        feat, vfeat = Dim("feat", query.shape[2]), Dim("vfeat", Dv)
        # Equal lengths: one time dim for both sides, self-attention over it.
        shared = torch.equal(lq, lk)
        tq = Dim.dynamic("time_q", Tensor(lq, [seq]))
        tk = tq if shared else Dim.dynamic("time_kv", Tensor(lk, [seq]))
        rows_q, valid_q = _padded_rows(starts_q, lq, max_q)
        rows_k, _ = _padded_rows(starts_k, lk, max_k)
        self.query = Tensor(query.reshape(-1, Hkv, H // Hkv, query.shape[2])[rows_q], [seq, tq, heads, group, feat])
        self.keys = Tensor(key[rows_k], [seq, tk, heads, feat])
        self.values = Tensor(value[rows_k], [seq, tk, heads, vfeat])
        self.kwargs = dict(key_dim=feat, axis=tk, att_dropout=dropout_p, causal_query_spatial_dim=tq if causal else None,
                           causal_offset=Tensor(lk - lq, [seq]) if causal and not shared else None, scale=scale,
                           train=dropout_p > 0)
        self._out_dims = [seq, tq, heads, group, vfeat]
        self._shape = (H, Dv)
        self.tokens = rows_q[valid_q]
        self._rows = torch.arange(n * max_q, device=query.device).reshape(n, max_q)[valid_q]

    def rows(self, out: Tensor) -> torch.Tensor:
        """The output rows of the real queries, in the order of ``tokens``."""
        return out.raw_in(self._out_dims).reshape(-1, *self._shape)[self._rows]


def _padded_rows(starts: torch.Tensor, lens: torch.Tensor, max_len: int):
    """The token of each (sequence, position) of the padded layout (token 0 where the
    position is past the sequence's length: read, never attended) and which are real."""
    pos = torch.arange(max_len, device=starts.device)
    valid = pos[None, :] < lens[:, None]
    rows = torch.where(valid, starts.to(torch.int64)[:, None] + pos[None, :], 0)
    return rows, valid


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
    return n


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a tensor of shape {tuple(t.shape)} and dtype {t.dtype}"
    return type(t).__name__
