"""Context parallelism: dot_attention over a sequence split across the ranks of a
torch.distributed process group (docs/distributed.md).

Each rank passes its shard of query, keys and values along ``axis`` (self-attention:
the query's positional dim and the kv axis are one dim, sharded alike) and gets its
shard of the output. Every rank computes its query rows against every rank's keys
and values, one block per pair of chunks, through the op library's block ops
(dimattn::dot_attention_block and its backward: dimattn's CPU kernel, which returns
each row's log-sum-exp); the blocks merge exactly through the lse in float32
(float64 for float64 calls). A block knows where it lies in the sequence
(AttentionOptions::positions), so causal masks, windows and ALiBi see global
positions and dropout keys its mask by global (query row, kv column): the result
and the gradients equal the single-process call's, dropout included.

Strategies: ``ring`` passes each rank's keys and values around the ring
(send/recv, the next transfer in flight while the current block computes; in the
backward pass their gradients travel with them and arrive home at the end);
``all_gather`` gathers every rank's keys and values at once and sums their
gradients with one all-reduce. Shardings: ``contiguous`` (rank r holds one run of
positions, runs in rank order, any sizes) and ``load_balanced`` for causal
attention (the sequence in 2N equal chunks, rank r holding chunks r and 2N-1-r,
so that every rank has the same work); blocks a causal mask leaves empty are
skipped, not computed.
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ._core import Dim, Error, Tensor
from ._ops import ops

_SHARDINGS = ("contiguous", "load_balanced")
_STRATEGIES = ("ring", "all_gather")
_OP = "[dot_attention]"


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """How dot_attention splits a sequence across ranks: ``group`` (a
    torch.distributed process group, None = the default group; Gloo for CPU
    tensors), ``sharding`` ("contiguous" or "load_balanced") and ``strategy``
    ("ring" or "all_gather"); ``timeout`` (seconds) bounds each wait for a peer
    (None: the group's own timeout)."""
    group: object = None
    sharding: str = "contiguous"
    strategy: str = "ring"
    timeout: Optional[float] = None


def shard_ranges(total: int, world: int, rank: int, sharding: str) -> List[Tuple[int, int]]:
    """The [start, end) position ranges a rank holds of a sequence of ``total``
    positions, in the order its shard lays them out."""
    if sharding == "load_balanced":
        if total % (2 * world):
            raise Error(f"{_OP} load_balanced sharding splits the sequence into 2 x {world} equal chunks, but its "
                        f"length {total} is not a multiple of {2 * world}; pad it or use contiguous sharding")
        c = total // (2 * world)
        return [(rank * c, (rank + 1) * c), ((2 * world - 1 - rank) * c, (2 * world - rank) * c)]
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return [(start, start + base + (1 if rank < extra else 0))]


def shard(x: Tensor, dim: Dim, cp: ContextParallel, local_dim: Optional[Dim] = None) -> Tensor:
    """This rank's shard of a full tensor along ``dim`` as ``cp`` lays it out: what
    each rank passes to dot_attention(..., context_parallel=cp). ``local_dim`` names
    the local axis: a static Dim of the shard's size (the same Dim for query, keys
    and values); a dynamic ``dim`` (whose lengths are the whole sequence's) may
    name it itself."""
    if local_dim is None:
        if not dim.is_dynamic:
            raise Error(f"[shard] {dim!r} is static, so its shard needs a Dim of its own size: pass local_dim "
                        "(one Dim for the shards of query, keys and values)")
        local_dim = dim
    group = cp.group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ax = x.axis_of(dim)
    parts = [x.raw.narrow(ax, s, e - s) for s, e in shard_ranges(x.raw.shape[ax], world, rank, cp.sharding)]
    raw = parts[0] if len(parts) == 1 else torch.cat(parts, ax)
    return Tensor(raw, [local_dim if d is dim else d for d in x.dims])


def _unsupported(**options) -> List[str]:
    return [name for name, value in options.items() if value is not None and value is not False]


def attention(query: Tensor, keys: Tensor, values: Tensor, *, key_dim: Dim, axis: Dim, att_dropout: float,
              att_dropout_broadcast: bool, causal_query_spatial_dim: Optional[Dim], causal_offset, scale, train: bool,
              query_position_dim: Optional[Dim], window, softcap, alibi_slopes: Optional[Tensor], sinks, sink_off_by_one,
              bias, mask, cp: ContextParallel) -> Tensor:
    """dot_attention(..., context_parallel=cp): this rank's shard of the output."""
    from . import _attention as a

    if not isinstance(cp, ContextParallel):
        raise Error(f"{_OP} context_parallel must be a dimattn.ContextParallel, got {type(cp).__name__}")
    if cp.sharding not in _SHARDINGS or cp.strategy not in _STRATEGIES:
        raise Error(f"{_OP} context_parallel has sharding {cp.sharding!r} and strategy {cp.strategy!r}; "
                    f"shardings: {', '.join(_SHARDINGS)}; strategies: {', '.join(_STRATEGIES)}")
    if not dist.is_available() or not dist.is_initialized():
        raise Error(f"{_OP} context_parallel needs torch.distributed initialised (init_process_group) in every "
                    "process of the group")
    world = dist.get_world_size(cp.group)
    if world < 2:
        raise Error(f"{_OP} context_parallel over a process group of size {world}: there is nothing to split; "
                    "call dot_attention without context_parallel")
    for name, x in (("query", query), ("keys", keys), ("values", values)):
        a._check_operand(name, x)
        if not x.has(axis):
            raise Error(f"{_OP} context_parallel shards the sequence dim axis {axis!r} of query, keys and values "
                        f"together (self-attention), but {name} {x.dims} lacks it; a dim that is not the query's "
                        "positional dim and the kv axis at once cannot be sharded")
    for name, d in (("causal_query_spatial_dim", causal_query_spatial_dim), ("query_position_dim", query_position_dim)):
        if d is not None and d is not axis:
            raise Error(f"{_OP} context_parallel shards axis {axis!r}, but {name} is {d!r}: the sharded dim must be "
                        "the query's positional dim")
    bad = _unsupported(causal_offset=causal_offset, sinks=sinks, sink_off_by_one=sink_off_by_one or None, bias=bias,
                       mask=mask)
    if bad:
        raise Error(f"{_OP} context_parallel does not take {', '.join(bad)} yet (a bias, mask or sink over the "
                    "whole sequence would have to be split with it); call without them or on one process")
    if a._state.traces:
        raise Error(f"{_OP} context_parallel calls cannot be traced (the energies live on every rank); trace a "
                    "single-process call")
    if query.raw.device.type != "cpu":
        raise Error(f"{_OP} context_parallel runs dimattn's CPU kernel on each block; got tensors on "
                    f"{query.raw.device} (CUDA blocks are not implemented yet)")
    a._check_variants(window, softcap, alibi_slopes, sinks)
    ring = _Ring(query, keys, values, key_dim, axis, att_dropout if train else 0.0, att_dropout_broadcast,
                 causal_query_spatial_dim is not None, scale, train, window, softcap, alibi_slopes, cp, world)
    out = _ContextParallelAttention.apply(ring, query.raw, keys.raw, values.raw)
    return Tensor._trusted(out, ring.out_dims)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ring, q, k, v):
        out, lses = ring.guarded(lambda: ring.forward(q, k, v))
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, *lses)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, *lses = ctx.saved_tensors
        dq, dk, dv = ctx.ring.guarded(lambda: ctx.ring.backward(q, k, v, out, lses, dout))
        return None, dq, dk, dv


@dataclasses.dataclass
class _Block:
    """One block: query chunk i (rows at qoff of this rank's shard) against a kv
    chunk (cols at koff of its rank's shard), with its call spec."""
    i: int
    qoff: int
    rows: int
    koff: int
    cols: int
    k: torch.Tensor
    v: torch.Tensor
    spec: str
    aux: list
    feature: list  # per output axis: whether it is a value feature (absent from the lse)


class _Ring:
    """One context-parallel call: its blocks, the exchange of keys and values, and
    the lse merge, forward and backward."""

    def __init__(self, query, keys, values, key_dim, axis, dropout, broadcast, causal, scale, train, window, softcap,
                 alibi_slopes, cp, world):
        self.cp, self.world = cp, world
        self.rank = dist.get_rank(cp.group)
        self.query, self.keys, self.values = query, keys, values
        self.key_dim, self.axis = key_dim, axis
        self.dropout, self.broadcast, self.causal, self.scale, self.train = dropout, broadcast, causal, scale, train
        self.window, self.softcap, self.alibi = window, softcap, alibi_slopes
        self.qa, self.ka, self.va = query.axis_of(axis), keys.axis_of(axis), values.axis_of(axis)
        self.timeout = None if cp.timeout is None else datetime.timedelta(seconds=cp.timeout)
        t_local = query.raw.shape[self.qa]
        seeded = bool(train and dropout)
        seed = torch.randint(0, 2**62, (), dtype=torch.int64) if seeded else torch.zeros((), dtype=torch.int64)

        # One exchange says every rank's shard and call; every rank checks the
        # same numbers, so bad input raises on every rank alike.
        local_error = ""
        if keys.raw.shape[self.ka] != t_local or values.raw.shape[self.va] != t_local:
            local_error = (f"query, keys and values have {t_local}, {keys.raw.shape[self.ka]} and "
                           f"{values.raw.shape[self.va]} positions along {axis.name!r}")
        meta = torch.tensor([t_local, int(seed), _SHARDINGS.index(cp.sharding), _STRATEGIES.index(cp.strategy),
                             int(causal), int(round(dropout * 2**24)), int(broadcast), len(local_error) > 0],
                            dtype=torch.int64)
        gathered = [torch.empty_like(meta) for _ in range(world)]
        self._wait(dist.all_gather(gathered, meta, group=cp.group, async_op=True))
        sizes = [int(g[0]) for g in gathered]
        for r, g in enumerate(gathered):
            if int(g[7]):
                raise Error(f"{_OP} context_parallel: rank {r} passed shards of unequal lengths"
                            + (f" ({local_error})" if r == self.rank else "")
                            + "; every rank passes query, keys and values with its own shard of the sequence")
            if not torch.equal(g[2:7], gathered[0][2:7]):
                raise Error(f"{_OP} context_parallel: rank {r} calls with other options than rank 0 (sharding, "
                            "strategy, causal, dropout); every rank must make the same call")
        if cp.sharding == "load_balanced":
            if len(set(sizes)) != 1 or sizes[0] % 2:
                raise Error(f"{_OP} context_parallel: load_balanced shards hold two equal chunks each, so every "
                            f"rank's shard has one even length; got shard lengths {sizes} along {axis.name!r}")
            total = sum(sizes)
            self.ranges = [shard_ranges(total, world, r, "load_balanced") for r in range(world)]
        else:
            starts = [sum(sizes[:r]) for r in range(world)]
            self.ranges = [[(starts[r], starts[r] + sizes[r])] for r in range(world)]
        self.sizes = sizes
        self.seed = gathered[0][1].clone() if seeded else None
        self._encodings = {}  # per (query range, kv range): _encode's result
        # The output's dims: those of one block with its query chunk named axis.
        qd, *_, block_out = self._block_dims(self.ranges[self.rank][0], self.ranges[self.rank][0])
        self.out_dims = [self.axis if d is qd else d for d in block_out]

    # --- one block ---

    def _chunk_dim(self, name: str, start: int, end: int) -> Dim:
        if not self.axis.is_dynamic:
            return Dim(name, end - start)
        lengths = self.axis.lengths  # the whole sequence's lengths
        return Dim.dynamic(name, Tensor((lengths.raw - start).clamp(0, end - start), lengths.dims))

    def _block_dims(self, q_range, kv_range):
        """A block's query and kv chunk dims, its operands' dims (as empty
        tensors) and its output's dims."""
        from . import _attention as a
        qd = self._chunk_dim(self.axis.name, *q_range)
        kd = self._chunk_dim(self.axis.name + "_kv", *kv_range)
        qt, kt, vt = (Tensor._trusted(torch.empty(0), [new if d is self.axis else d for d in x.dims])
                      for x, new in ((self.query, qd), (self.keys, kd), (self.values, kd)))
        return qd, kd, qt, kt, vt, a._out_dims(qt, kt, vt, self.key_dim, kd)

    def _encode(self, q_range, kv_range):
        """A block's call spec and aux tensors, and which of its output axes are
        value features (absent from the lse); made once per block and call, for
        the forward and the backward pass alike."""
        key = (q_range, kv_range)
        if key not in self._encodings:
            from . import _attention as a
            qd, kd, qt, kt, vt, out_dims = self._block_dims(q_range, kv_range)
            spec, aux = a._encode(qt, kt, vt, self.key_dim, kd, self.dropout, self.broadcast,
                                  qd if self.causal else None, None, self.scale, self.train, out_dims,
                                  query_position_dim=None if self.causal else qd, window=self.window,
                                  softcap=self.softcap, alibi_slopes=self.alibi,
                                  positions=(q_range[0], kv_range[0]), dynamic=(qd,), seed=self.seed)
            feature = [d is self.key_dim or (d is not kd and not qt.has(d) and not kt.has(d)) for d in out_dims]
            self._encodings[key] = (spec, aux, feature)
        return self._encodings[key]

    def _blocks(self, r: int, kr: torch.Tensor, vr: torch.Tensor):
        """The blocks of this rank's query chunks against rank r's keys kr and
        values vr that some element of reaches (the rest are skipped)."""
        for kv_range, koff in self._local_chunks(r):
            cols = kv_range[1] - kv_range[0]
            kc, vc = kr.narrow(self.ka, koff, cols), vr.narrow(self.va, koff, cols)
            for i, (q_range, qoff) in enumerate(self._local_chunks(self.rank)):
                if not self._skipped(q_range, kv_range):
                    spec, aux, feature = self._encode(q_range, kv_range)
                    yield _Block(i, qoff, q_range[1] - q_range[0], koff, cols, kc, vc, spec, aux, feature)

    def _skipped(self, q_range, kv_range) -> bool:
        """Whether every element of the block is masked (no kernel call)."""
        q0, q1 = q_range
        k0, k1 = kv_range
        if q1 <= q0 or k1 <= k0:
            return True
        if self.causal and k0 > q1 - 1:
            return True
        if self.window is not None:
            left, right = self.window
            if left is not None and k1 - 1 < q0 - left:
                return True
            if right is not None and k0 > q1 - 1 + right:
                return True
        return False

    # --- exchange ---

    def guarded(self, fn):
        """fn() on every rank, then one all-reduce of who failed: a rank whose
        peer failed raises too instead of returning (or waiting forever on a
        transfer that never comes: each wait is bounded by the timeout)."""
        failed = torch.zeros(self.world, dtype=torch.int32)
        error = None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 (re-raised below, after the others know)
            error = e
            failed[self.rank] = 1
        try:
            self._wait(dist.all_reduce(failed, group=self.cp.group, async_op=True))
        except Exception:  # noqa: BLE001
            if error is None:
                raise
        if error is not None:
            raise error
        if failed.any():
            ranks = [r for r in range(self.world) if failed[r]]
            raise Error(f"{_OP} context_parallel: rank(s) {ranks} of the group failed in this call (their own "
                        "errors say why); this rank's result would be incomplete")
        return result

    def _peer(self, r: int) -> int:
        return dist.get_global_rank(self.cp.group, r) if self.cp.group is not None else r

    def _wait(self, work):
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)

    def _shift(self, send: torch.Tensor, recv: torch.Tensor, tag: int):
        """Sends to the next rank and receives from the previous one; returns the
        work objects (in flight)."""
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        return [dist.isend(send, self._peer(nxt), group=self.cp.group, tag=tag),
                dist.irecv(recv, self._peer(prv), group=self.cp.group, tag=tag)]

    def _kv_of(self, packed: torch.Tensor, r: int, like_k: torch.Tensor, like_v: torch.Tensor):
        """Rank r's keys and values, unpacked from one flat buffer."""
        ks = list(like_k.shape)
        vs = list(like_v.shape)
        ks[self.ka] = vs[self.va] = self.sizes[r]
        nk = int(torch.Size(ks).numel())
        return packed[:nk].view(ks), packed[nk:].view(vs)

    def _packed_size(self, r: int, k: torch.Tensor, v: torch.Tensor) -> int:
        return (k.numel() // max(k.shape[self.ka], 1) + v.numel() // max(v.shape[self.va], 1)) * self.sizes[r]

    def _local_chunks(self, r: int):
        """Rank r's chunks: (global range, local offset)."""
        out, off = [], 0
        for s, e in self.ranges[r]:
            out.append(((s, e), off))
            off += e - s
        return out

    def _sources(self, k, v):
        """(rank, keys, values) of every rank in the order this rank meets them,
        the exchange of the next already in flight while one computes."""
        if self.cp.strategy == "all_gather":
            n = max(self._packed_size(r, k, v) for r in range(self.world))
            mine = torch.zeros(n, dtype=k.dtype)
            flat = torch.cat([k.reshape(-1), v.reshape(-1)])
            mine[:flat.numel()] = flat
            bufs = [torch.empty_like(mine) for _ in range(self.world)]
            self._wait(dist.all_gather(bufs, mine, group=self.cp.group, async_op=True))
            for step in range(self.world):
                r = (self.rank - step) % self.world
                yield (r, *self._kv_of(bufs[r][:self._packed_size(r, k, v)], r, k, v))
            return
        packed = torch.cat([k.reshape(-1), v.reshape(-1)])
        for step in range(self.world):
            r = (self.rank - step) % self.world
            works, nxt = [], None
            if step < self.world - 1:
                nxt = torch.empty(self._packed_size((r - 1) % self.world, k, v), dtype=k.dtype)
                works = self._shift(packed, nxt, tag=0)
            yield (r, *self._kv_of(packed, r, k, v))
            for w in works:
                self._wait(w)
            packed = nxt

    # --- forward and backward ---

    def _acc_dtype(self, q):
        return torch.float64 if q.dtype == torch.float64 else torch.float32

    def _size(self, d: Dim) -> int:
        for x in (self.query, self.keys, self.values):
            if x.has(d):
                return x.raw.shape[x.axis_of(d)]
        raise Error(f"{_OP} internal error: dim {d!r} of the output is in no operand")

    def _out_axis(self) -> int:
        return [i for i, d in enumerate(self.out_dims) if d is self.axis][0]

    def forward(self, q, k, v):
        """This rank's output rows, and per query chunk their lse (the op's form:
        the output's dims without value features)."""
        q, k, v = q.detach(), k.detach(), v.detach()
        chunks = self._local_chunks(self.rank)
        acc = [None] * len(chunks)  # per query chunk: (output, lse with 1 on the features) merged so far
        feature = None
        for r, kr, vr in self._sources(k.contiguous(), v.contiguous()):
            for b in self._blocks(r, kr, vr):
                o, lse = ops.dot_attention_block(q.narrow(self.qa, b.qoff, b.rows), b.k, b.v, b.aux, b.spec)
                feature = b.feature
                acc[b.i] = self._merge(acc[b.i], o, lse.view([1 if f else s for s, f in zip(o.shape, feature)]))
        outs, lses = [], []
        for i, (q_range, _) in enumerate(chunks):
            if acc[i] is None:  # every block of these rows masked: output 0, lse -inf
                shape = [q_range[1] - q_range[0] if d is self.axis else self._size(d) for d in self.out_dims]
                o = torch.zeros(shape, dtype=q.dtype)
                lse_full = torch.full(shape, float("-inf"), dtype=self._acc_dtype(q))
                feature = self._encode(q_range, q_range)[2]
            else:
                o, lse_full = acc[i][0].to(q.dtype), acc[i][1]
            outs.append(o)
            lses.append(lse_full.reshape([s for s, f in zip(lse_full.shape, feature) if not f]).contiguous())
        return (torch.cat(outs, self._out_axis()) if len(outs) > 1 else outs[0]), lses

    def _merge(self, acc, o, lse):
        """One more block merged into the rows' running result through the lse."""
        o = o.to(lse.dtype)
        if acc is None:
            return o, lse
        out, m = acc
        new = torch.logaddexp(m, lse)
        ref = torch.where(torch.isneginf(new), torch.zeros_like(new), new)  # rows still empty stay 0
        return out * torch.exp(m - ref) + o * torch.exp(lse - ref), new

    def backward(self, q, k, v, out, lses, dout):
        q, k, v = q.detach(), k.detach().contiguous(), v.detach().contiguous()
        dout = dout.contiguous()
        qa_out = self._out_axis()
        acc_dt = self._acc_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc_dt)
        gathered = None  # all_gather: every rank's gradients, summed by one all-reduce at the end
        ring = self.cp.strategy == "ring"
        nxt, prv = self._peer((self.rank + 1) % self.world), self._peer((self.rank - 1) % self.world)
        sending = []  # ring: the previous step's gradients on their way to the next rank
        for step, (r, kr, vr) in enumerate(self._sources(k, v)):
            # Ring: d(keys), d(values) of rank r travel with its keys. This
            # step's blocks add into fresh zeros while the sum of the ranks
            # before arrives; both meet after the blocks, and the sum moves on
            # while the next step computes.
            incoming = None
            if ring and step > 0:
                incoming = torch.empty(self._packed_size(r, k, v), dtype=acc_dt)
                receiving = dist.irecv(incoming, prv, group=self.cp.group, tag=1)
            nk = kr.numel()
            grads = torch.zeros(nk + vr.numel(), dtype=acc_dt)
            dk, dv = grads[:nk].view(kr.shape), grads[nk:].view(vr.shape)
            for b in self._blocks(r, kr, vr):
                gq, gk, gv = ops.dot_attention_block_backward(
                    dout.narrow(qa_out, b.qoff, b.rows).contiguous(), q.narrow(self.qa, b.qoff, b.rows), b.k, b.v,
                    out.narrow(qa_out, b.qoff, b.rows).contiguous(), lses[b.i], b.aux, b.spec)
                dq.narrow(self.qa, b.qoff, b.rows).add_(gq)
                dk.narrow(self.ka, b.koff, b.cols).add_(gk)
                dv.narrow(self.va, b.koff, b.cols).add_(gv)
            if ring:
                if incoming is not None:
                    self._wait(receiving)
                    grads += incoming
                for w in sending:
                    self._wait(w)
                sending = [dist.isend(grads, nxt, group=self.cp.group, tag=1)]
            else:
                if gathered is None:
                    gathered = torch.zeros(self.world, max(self._packed_size(x, k, v) for x in range(self.world)),
                                           dtype=acc_dt)
                gathered[r, :grads.numel()] = grads
                grads = None
        if ring:
            # After the last step this rank's own gradients arrive, summed over
            # every rank.
            grads = torch.empty(self._packed_size(self.rank, k, v), dtype=acc_dt)
            self._wait(dist.irecv(grads, prv, group=self.cp.group, tag=1))
            for w in sending:
                self._wait(w)
        else:
            self._wait(dist.all_reduce(gathered, group=self.cp.group, async_op=True))
            grads = gathered[self.rank, :self._packed_size(self.rank, k, v)]
        nk = k.numel()
        return dq.to(q.dtype), grads[:nk].view(k.shape).to(k.dtype), grads[nk:].view(v.shape).to(v.dtype)
