"""dot_attention over named dims on torch tensors, with tracing and explain
(the run context: _context.py; the op's arguments: _call.py)."""
from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Union

import torch

from . import _call, _context_parallel, _variants
from ._context import AttentionTrace, force, forced, state
from ._core import Dim, Error, Tensor
from ._ops import ops


@dataclasses.dataclass
class Rejection:
    kernel: str
    reason: str


@dataclasses.dataclass
class Decision:
    """Which kernel a call would run and why each candidate before it was rejected."""
    kernel: str
    rejected: List[Rejection]
    text: str

    def __str__(self) -> str:
        return self.text


def _options(key_dim, axis, att_dropout, att_dropout_broadcast, causal_query_spatial_dim, causal_offset, scale,
             train, query_position_dim) -> _call.Options:
    return _call.Options(key_dim, axis, att_dropout, att_dropout_broadcast, causal_query_spatial_dim, causal_offset,
                         scale, state.train if train is None else bool(train), query_position_dim)


def dot_attention(query: Tensor, keys: Tensor, values: Tensor, *, key_dim: Dim, axis: Dim,
                  att_dropout: float = 0.0, att_dropout_broadcast: bool = False,
                  causal_query_spatial_dim: Optional[Dim] = None,
                  causal_offset: Union[None, int, torch.Tensor, Tensor] = None,
                  scale: Optional[float] = None, train: Optional[bool] = None,
                  query_position_dim: Optional[Dim] = None, variants: Optional[_variants.Variants] = None,
                  context_parallel: Optional[_context_parallel.ContextParallel] = None, **variant_fields) -> Tensor:
    """Scaled dot-product attention over named dims (RETURNN's semantics, docs/python.md).

    query ``{..., key_dim}``, keys ``{..., axis, key_dim}``, values ``{..., axis, v_feat...}``;
    returns values' dims without ``axis``, plus the query's own dims. Dims shared by
    query and keys/values are batch dims; query dims the keys lack (beam, query heads)
    are never tiled into the keys. ``axis`` in the query means self-attention.
    Causal: query position i attends kv positions <= i + causal_offset. Dropout acts
    only when ``train`` (default: :func:`train_flag`); ``att_dropout_broadcast`` draws
    one mask over ``axis`` shared by every other dim. ``scale`` defaults to
    1/sqrt(size(key_dim)). ``query_position_dim``: the query's positional dim for
    variants that measure distance without causal attention.

    ``variants=dimattn.Variants(...)`` (window, soft-capping, ALiBi, sinks, bias, mask;
    docs/python.md, "Variants"), or its fields as keywords (``window=(128, None)``),
    which are set on ``variants``.

    ``context_parallel=dimattn.ContextParallel(group, sharding, strategy)``: the
    sequence along ``axis`` (self-attention) is split across the group's ranks; each
    passes its shard and gets its shard of the output (docs/distributed.md).

    Args:
        query, keys, values: named tensors (dimattn.Tensor) as above.
        key_dim: the feature dim reduced in q·k.
        axis: the kv dim attended over; dynamic: its lengths mask the padding.
        att_dropout: dropout probability on the weights (in training only).
        att_dropout_broadcast: one dropout mask over ``axis``, shared by the other dims.
        causal_query_spatial_dim: set for causal attention: the query's spatial dim.
        causal_offset: the history before the query's first position (int, or an
            integer tensor over batch dims); default 0.
        scale: the scores' factor; default 1/sqrt(size(key_dim)).
        train: the train flag for this call; default :func:`train_flag`.
        query_position_dim: the query's positional dim for windows and ALiBi
            without causal attention.
        variants: a :class:`Variants` (fields may also be given as keywords).
        context_parallel: a :class:`ContextParallel` for a sequence sharded over ranks.

    Returns:
        A dimattn.Tensor over the values' dims without ``axis`` plus the query's
        own dims; a query row with no valid kv position gives 0.
    """
    st = state
    if (variants is None and not variant_fields and context_parallel is None and not st.traces
            and type(causal_offset) in _PLAIN_OFFSETS and not _is_compiling()):
        # The common eager call: one lookup of the encoding that the path below
        # cached for the same Dims and options.
        try:
            e = _call.encodings.get(_call.encoding_key(
                query.dims, keys.dims, values.dims, key_dim, axis, att_dropout, att_dropout_broadcast,
                causal_query_spatial_dim, causal_offset, scale, st.train if train is None else bool(train),
                query_position_dim, st.force[-1] if st.force else None, ()))
        except (AttributeError, TypeError):  # not dimattn.Tensors: the path below says so
            e = None
        if e is not None:
            try:
                out = e.forward(query.raw, keys.raw, values.raw, *_call.call_arguments(e, None))
            except RuntimeError as err:
                _call.raise_as_error(err)
            result = _new_tensor(Tensor)  # Tensor._trusted without its call
            result.raw, result.dims = out, e.out_dims
            return result
    var = _variants.merged(variants, variant_fields) if variants is not None or variant_fields else None
    o = _options(key_dim, axis, att_dropout, att_dropout_broadcast, causal_query_spatial_dim, causal_offset, scale,
                 train, query_position_dim)
    for name, x in (("query", query), ("keys", keys), ("values", values)):
        _call.check_operand(name, x)
    if context_parallel is not None:
        if st.traces:
            raise Error("[dot_attention] context_parallel calls cannot be traced (the energies live on every "
                        "rank); trace a single-process call")
        return _context_parallel.attention(query, keys, values, o, var, context_parallel)
    if st.traces and not _is_compiling():
        return _traced_call(query, keys, values, o, var)
    if _is_compiling():  # the graph holds the encoding as constants
        e = _call.encode(query, keys, values, o, var, _call.out_dims(query, keys, values, key_dim, axis))
    else:
        e = _call.cached_encoding(query, keys, values, o, var)
    return Tensor._trusted(_call.run(None, query, keys, values, e, var), e.out_dims)


_PLAIN_OFFSETS = (type(None), int)  # the causal offsets of calls the fast path takes
_is_compiling = torch.compiler.is_compiling
_new_tensor = object.__new__


def op_arguments(query: Tensor, keys: Tensor, values: Tensor, *, key_dim: Dim, axis: Dim, att_dropout: float = 0.0,
                 att_dropout_broadcast: bool = False, causal_query_spatial_dim: Optional[Dim] = None,
                 causal_offset=None, scale: Optional[float] = None, train: Optional[bool] = None,
                 query_position_dim: Optional[Dim] = None, variants: Optional[_variants.Variants] = None,
                 **variant_fields):
    """The op (a torch.ops.dimattn overload) and its arguments (a tuple and
    keywords) that dot_attention calls for these arguments (tests: opcheck)."""
    var = _variants.merged(variants, variant_fields)
    o = _options(key_dim, axis, att_dropout, att_dropout_broadcast, causal_query_spatial_dim, causal_offset, scale,
                 train, query_position_dim)
    e = _call.encode(query, keys, values, o, var, _call.out_dims(query, keys, values, key_dim, axis))
    return e.forward, (query.raw, keys.raw, values.raw, *_call.call_arguments(e, var)), {}


def _traced_call(query: Tensor, keys: Tensor, values: Tensor, o: _call.Options, var) -> Tensor:
    traces = state.traces
    capture = any(t.capture_tensors for t in traces)
    out_dims = _call.out_dims(query, keys, values, o.key_dim, o.axis)
    # One seed for both calls below: the same dropout mask.
    rng = torch.random.get_rng_state()
    if capture:
        kernels = forced() or tuple(os.environ.get("DIMATTN_SDPA", "auto").split(","))
        if [k.strip() for k in kernels] not in (["auto"], [""]) and "reference" not in [k.strip() for k in kernels]:
            raise Error(f"[dot_attention] a trace capturing energies needs the reference path, but kernels are forced "
                        f"to '{','.join(kernels)}'; use trace(capture_tensors=False) to trace only kernel names")
        energy_dims = _call.energy_dims(query, keys, o.key_dim, o.axis)
        # The output through the reference path (with autograd), energies and
        # weights from the same call traced.
        with force("reference"):
            e = _call.encode(query, keys, values, o, var, out_dims, energy_dims)
        out = _call.run(None, query, keys, values, e, var)
        torch.random.set_rng_state(rng)
        with torch.no_grad():
            energy, weights = _call.run(ops.dot_attention_trace.default, query, keys, values, e, var, e.energy_names)
        kernel = "reference"
        energy, weights = Tensor(energy, energy_dims[0]), Tensor(weights, energy_dims[0])
    else:
        e = _call.encode(query, keys, values, o, var, out_dims)
        kernel = _call.run(ops.explain.default, query, keys, values, e, var)[0]
        torch.random.set_rng_state(rng)
        out = _call.run(None, query, keys, values, e, var)
        energy = weights = None
    result = Tensor(out, out_dims)
    for t in traces:
        t.records.append(AttentionTrace(kernel, result, energy if t.capture_tensors else None,
                                        weights if t.capture_tensors else None))
    return result


def explain(query: Tensor, keys: Tensor, values: Tensor, *, key_dim: Dim, axis: Dim, att_dropout: float = 0.0,
            att_dropout_broadcast: bool = False, causal_query_spatial_dim: Optional[Dim] = None,
            causal_offset: Union[None, int, torch.Tensor, Tensor] = None, scale: Optional[float] = None,
            train: Optional[bool] = None, query_position_dim: Optional[Dim] = None,
            variants: Optional[_variants.Variants] = None, **variant_fields) -> Decision:
    """Which kernel :func:`dot_attention` would run for these arguments, and why each
    candidate before it was rejected. Runs nothing; raises like dot_attention for bad
    input or a forced kernel that cannot run.

    Args:
        query, keys, values, key_dim, axis, ...: as :func:`dot_attention`.

    Returns:
        A :class:`Decision`: ``kernel``, the ``rejected`` candidates with their
        reasons, and ``text`` (what ``dimattn explain`` prints).
    """
    for name, x in (("query", query), ("keys", keys), ("values", values)):
        _call.check_operand(name, x)
    var = _variants.merged(variants, variant_fields)
    o = _options(key_dim, axis, att_dropout, att_dropout_broadcast, causal_query_spatial_dim, causal_offset, scale,
                 train, query_position_dim)
    e = _call.encode(query, keys, values, o, var, _call.out_dims(query, keys, values, key_dim, axis))
    kernel, rejected, reasons, text = _call.run(ops.explain.default, query, keys, values, e, var)
    return Decision(kernel, [Rejection(k, r) for k, r in zip(rejected, reasons)], text)
