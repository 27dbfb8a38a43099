"""Context parallelism: dot_attention over a sequence split across the ranks of a
torch.distributed process group (docs/distributed.md).

Each rank passes its shard of query, keys and values along ``axis`` (self-attention:
the query's positional dim and the kv axis are one dim, sharded alike) and gets its
shard of the output. The op ``dimattn::context_parallel_attention`` runs the whole
call in C++ (``context_parallel_attention``, dimattn/context_parallel.h: blocks merged
through their log-sum-exp, the ring or the all-gather over the c10d group, which it
finds by the group's name in c10d's registry), forward and backward as one autograd
node; here are the spec, the helpers that shard a tensor, and the encoding of a
dynamic axis: its lengths (the whole sequence's) cross as the call's ``cp_lengths``,
the axis itself as a static dim of the shard's size.

Shardings: ``contiguous`` (rank r holds one run of positions, runs in rank order,
any sizes) and ``load_balanced`` for causal attention (the sequence in 2N equal
chunks, rank r holding chunks r and 2N-1-r, so that every rank has the same work).
Strategies: ``ring`` (send/recv, overlapped with compute) and ``all_gather``.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _call, _variants
from ._core import Dim, Error, Tensor

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
    positions, in the order its shard lays them out.

    Args:
        total: the sequence's positions.
        world: the ranks of the group.
        rank: this rank.
        sharding: as :class:`ContextParallel`'s (``"contiguous"`` or ``"load_balanced"``).

    Returns:
        The ranges, each ``(start, end)``.
    """
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
    name it itself.

    Args:
        x: the full tensor.
        dim: the sequence dim to shard.
        cp: the call's :class:`ContextParallel`.
        local_dim: the shard's dim (see above).

    Returns:
        This rank's shard, ``dim`` replaced by the local dim.
    """
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


def attention(query: Tensor, keys: Tensor, values: Tensor, o: _call.Options, variants, cp: ContextParallel) -> Tensor:
    """dot_attention(..., context_parallel=cp): this rank's shard of the output.
    The op checks the call (and says what it does not take yet)."""
    if not isinstance(cp, ContextParallel):
        raise Error(f"{_OP} context_parallel must be a dimattn.ContextParallel, got {type(cp).__name__}")
    if cp.sharding not in _SHARDINGS or cp.strategy not in _STRATEGIES:
        raise Error(f"{_OP} context_parallel has sharding {cp.sharding!r} and strategy {cp.strategy!r}; "
                    f"shardings: {', '.join(_SHARDINGS)}; strategies: {', '.join(_STRATEGIES)}")
    if not dist.is_available() or not dist.is_initialized():
        raise Error(f"{_OP} context_parallel needs torch.distributed initialised (init_process_group) in every "
                    "process of the group")
    group = (cp.group if cp.group is not None else dist.group.WORLD).group_name
    # A dynamic axis holds the whole sequence's lengths; each rank's shard has
    # its own static size.
    axis = o.axis
    local = Dim(axis.name, query.raw.shape[query.axis_of(axis)]) if axis.is_dynamic and query.has(axis) else axis

    def relabel(x: Tensor) -> Tensor:
        return Tensor._trusted(x.raw, [local if d is axis else d for d in x.dims]) if local is not axis and x.has(axis) \
            else x
    q, k, v = relabel(query), relabel(keys), relabel(values)
    if variants is not None:  # segment ids over the axis
        variants = dataclasses.replace(variants, **{n: relabel(getattr(variants, n)) for n in _variants.TENSOR_FIELDS
                                                    if getattr(variants, n) is not None})
    lo = dataclasses.replace(o, axis=local, **{n: local for n in ("causal_query_spatial_dim", "query_position_dim")
                                               if getattr(o, n) is axis})
    out_dims = _call.out_dims(q, k, v, o.key_dim, local)
    e = _call.encode(q, k, v, lo, variants, out_dims, named=[("cp_lengths", axis.lengths)] if local is not axis else [])
    arguments = dict(e.arguments, cp_group=group, cp_sharding=cp.sharding, cp_strategy=cp.strategy)
    if cp.timeout is not None:
        arguments["cp_timeout"] = float(cp.timeout)
    e = dataclasses.replace(e, arguments=arguments)
    call = _call.call_arguments(e, variants, axis.lengths if local is not axis else None)
    try:
        out = e.forward(query.raw, keys.raw, values.raw, *call)
    except RuntimeError as err:
        _call.raise_as_error(err)
    return Tensor._trusted(out, [axis if d is local else d for d in out_dims])
