"""One dot_attention call as the op's typed arguments (python/csrc/op_args.h).

Dims become names, unique within the call (two Dims of one name get "name",
"name#2"); only the lengths of ``axis`` reach the op: padding masks the kv axis and
nothing else (a padded query row is computed like any row), so every other dim
crosses as static, its size the operands' padded extent. That also lets the axis's
lengths vary over a dim that is itself dynamic (a history whose length depends on
batch and time). Options and the variants become the op's keyword arguments; the
call's own tensors (lengths, causal offset, variant tensors, dropout seed) are added
per call to an encoding that is cached by the Dims' identities and the options.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _variants
from ._context import forced
from ._core import Dim, Error, Tensor
from ._ops import ops


class Names:
    """A call's Dims as names unique within the call."""

    def __init__(self):
        self.dims: List[Dim] = []
        self.names: List[str] = []

    def __call__(self, d: Dim) -> str:
        for e, n in zip(self.dims, self.names):
            if e is d:
                return n
        base = d.name or "dim"
        name, i = base, 1
        while name in self.names or name == "'":
            i += 1
            name = f"{base}#{i}"
        self.dims.append(d)
        self.names.append(name)
        return name

    def of(self, dims: Sequence[Dim]) -> List[str]:
        return [self(d) for d in dims]

    def has(self, d: Dim) -> bool:
        return any(e is d for e in self.dims)


def _has(dims: Sequence[Dim], d: Dim) -> bool:
    return any(e is d for e in dims)


def out_dims(query: Tensor, keys: Tensor, values: Tensor, key_dim: Dim, axis: Dim) -> List[Dim]:
    """The result's dims: values' dims without axis, plus the query's own dims, in
    the query's order with key_dim replaced by the value features."""
    out: List[Dim] = []

    def add(d):
        if not _has(out, d):
            out.append(d)

    for d in query.dims:
        if d is key_dim:
            for e in values.dims:
                if e is not axis and (e is key_dim or not _has(query.dims, e)):
                    add(e)
        else:
            add(d)
    for d in keys.dims:
        if d is not key_dim and d is not axis:
            add(d)
    for d in values.dims:
        if d is not axis:
            add(d)
    return out


def energy_dims(query: Tensor, keys: Tensor, key_dim: Dim, axis: Dim) -> Tuple[List[Dim], Dim]:
    """The traced energy's dims, and its kv dim (a new dim for self-attention)."""
    dims = [d for d in query.dims if d is not key_dim]
    kv_axis = axis
    if _has(query.dims, axis):
        kv_axis = Dim.dynamic(axis.name + "'", axis.lengths) if axis.is_dynamic else Dim(axis.name + "'", axis.size)
    for d in keys.dims:
        if d is axis:
            dims.append(kv_axis)
        elif d is not key_dim and not _has(dims, d):
            dims.append(d)
    return dims, kv_axis


def check_operand(name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise Error(f"[dot_attention] {name} must be a dimattn.Tensor (a torch tensor and its dims), "
                    f"got {type(x).__name__}")


@dataclasses.dataclass(frozen=True)
class Options:
    """A call's options but the variants (dot_attention's keywords)."""
    key_dim: Dim
    axis: Dim
    att_dropout: float = 0.0
    att_dropout_broadcast: bool = False
    causal_query_spatial_dim: Optional[Dim] = None
    causal_offset: object = None  # None, an int, a rank-0 torch tensor or an integer dimattn.Tensor
    scale: Optional[float] = None
    train: bool = False
    query_position_dim: Optional[Dim] = None


# The op's arguments after the operands, in order (python/csrc/op_args.h), in
# three groups: the call's, the full group's (the rarer options and the
# variants: dot_attention.full and the ops that see every call take them) and
# context parallelism's (context_parallel_attention). Every one from the first
# optional on may be None, so a call passes them positionally up to its last
# set one (keywords and each argument an op has cost the caller more per call:
# the common call takes the op with the fewest).
_GROUPS = tuple(tuple(names) for names in ops.argument_names())
ARGUMENT_NAMES = tuple(name for group in _GROUPS for name in group)
_POSITION = {name: i for i, name in enumerate(ARGUMENT_NAMES)}
_ENDS = (len(_GROUPS[0]), len(_GROUPS[0]) + len(_GROUPS[1]), len(ARGUMENT_NAMES))  # of each group
# The call's own tensors, each set where the argument named beside it is.
_PER_CALL = {"lengths": "lengths_of", "causal_offset": "causal_offset_dims", "cp_lengths": "cp_lengths_dims",
             **{name: name + "_dims" for name in _variants.TENSOR_FIELDS}}
# The forward op of each group.
_FORWARD = (ops.dot_attention.default, ops.dot_attention.full, ops.context_parallel_attention.default)


@dataclasses.dataclass(frozen=True)
class Encoding:
    """A call's arguments but its own tensors (call_arguments adds them)."""
    arguments: Dict[str, object]
    out_dims: Tuple[Dim, ...]
    axis: Dim                   # its lengths (if dynamic) reach the op
    offset: Optional[Tensor]    # a dimattn.Tensor causal offset, passed per call
    seeded: bool                # dropout acts: a new seed per call
    energy_names: Optional[List[str]] = None  # the trace op's energy_dims
    template: list = dataclasses.field(init=False, repr=False)  # arguments in order, up to the last set
    forward: object = dataclasses.field(init=False, repr=False)  # the forward op that takes them

    def __post_init__(self):
        set_at = [_POSITION[name] for name in self.arguments]
        set_at += [_POSITION[name] for name, beside in _PER_CALL.items() if beside in self.arguments]
        if self.seeded:
            set_at.append(_POSITION["seed"])
        template = [None] * (max(set_at) + 1)
        for name, value in self.arguments.items():
            template[_POSITION[name]] = value
        object.__setattr__(self, "template", template)
        object.__setattr__(self, "forward", _FORWARD[next(i for i, end in enumerate(_ENDS) if len(template) <= end)])


def encode(query: Tensor, keys: Tensor, values: Tensor, o: Options, variants, out: Sequence[Dim],
           energy: Optional[Tuple[List[Dim], Dim]] = None, named: Sequence[Tuple[str, Tensor]] = ()) -> Encoding:
    """`named`: more tensor arguments, whose dims get the arguments NAME_dims."""
    names = Names()
    # The query's, the keys', the values' and the result's dims, in their orders.
    a: Dict[str, object] = {"dims": names.of(query.dims) + names.of(keys.dims) + names.of(values.dims) + names.of(out)}
    sized = [d for d in (o.key_dim, o.axis, o.causal_query_spatial_dim, o.query_position_dim)
             if d is not None and not names.has(d) and d.size is not None]
    a["key_dim"], a["axis"] = names(o.key_dim), names(o.axis)
    if sized:
        a["size_names"], a["sizes"] = names.of(sized), [d.size for d in sized]
    a["lengths_of"], a["lengths_dims"] = ([a["axis"]], names.of(o.axis.lengths.dims)) if o.axis.is_dynamic else ([], [])
    if o.causal_query_spatial_dim is not None:
        a["causal"] = names(o.causal_query_spatial_dim)
    offset = o.causal_offset
    if isinstance(offset, bool) or not (offset is None or isinstance(offset, (int, Tensor)) or (
            isinstance(offset, torch.Tensor) and offset.dim() == 0)):
        raise Error("[dot_attention] causal_offset must be an int, a rank-0 torch tensor or a dimattn.Tensor "
                    f"over batch dims, got {type(offset).__name__}")
    if isinstance(offset, int):
        a["causal_offset"] = torch.tensor(offset, dtype=torch.int64)
    elif isinstance(offset, torch.Tensor):
        a["causal_offset"] = offset
    elif isinstance(offset, Tensor):
        a["causal_offset_dims"] = names.of(offset.dims)
    if o.query_position_dim is not None:
        a["query_position"] = names(o.query_position_dim)
    a.update(_variants.op_arguments(variants, names.of))
    if o.att_dropout:
        a["dropout"] = float(o.att_dropout)
    if o.att_dropout_broadcast:
        a["dropout_broadcast"] = True
    if o.train:
        a["train"] = True
    if o.scale is not None:
        a["scale"] = float(o.scale)
    if forced() is not None:
        a["force"] = list(forced())
    for name, t in named:
        a[name + "_dims"] = names.of(t.dims)
    energy_names = None
    if energy is not None:  # "'": the kv dim of self-attention, which the op makes
        energy_names = ["'" if d is energy[1] and not names.has(d) else names(d) for d in energy[0]]
    return Encoding(a, tuple(out), o.axis, offset if isinstance(offset, Tensor) else None,
                    bool(o.train and o.att_dropout), energy_names)


def call_arguments(e: Encoding, variants, cp_lengths: Optional[Tensor] = None) -> list:
    """The op's arguments after the operands for one call: the encoding's and the
    call's own tensors."""
    a = list(e.template)
    if e.axis.lengths is not None:
        a[_POSITION["lengths"]] = [e.axis.lengths.raw]
    if e.offset is not None:
        a[_POSITION["causal_offset"]] = e.offset.raw
    if e.seeded:  # from torch's generator: torch.manual_seed reproduces the mask
        a[_POSITION["seed"]] = torch.randint(0, 2**62, (), dtype=torch.int64)
    if variants is not None:
        for name, raw in _variants.tensor_arguments(variants).items():
            a[_POSITION[name]] = raw
    if cp_lengths is not None:
        a[_POSITION["cp_lengths"]] = cp_lengths.raw
    return a


def raise_as_error(err: RuntimeError):
    msg = str(err)
    if msg.startswith("[") or "[dot_attention]" in msg or "[from_aten]" in msg:
        raise Error(msg) from None
    raise err


# Encodings of recent eager calls, oldest first, by encoding_key (dot_attention's
# fast path looks up a plain call's key itself, made by the same function).
encodings: Dict[tuple, Encoding] = {}
_ENCODINGS_KEPT = 256


def encoding_key(query_dims, keys_dims, values_dims, key_dim, axis, att_dropout, att_dropout_broadcast, causal_dim,
                 offset, scale, train, position, force, variant_structure) -> tuple:
    """The one key of `encodings`: the Dims (their identities: the key holds them, so
    their ids stay unique), the options (a causal offset as an int or its Dims), the
    forced kernels and the variants' structure."""
    return (query_dims, keys_dims, values_dims, key_dim, axis, att_dropout, att_dropout_broadcast, causal_dim, offset,
            scale, train, position, force, variant_structure)


def cached_encoding(query: Tensor, keys: Tensor, values: Tensor, o: Options, variants) -> Encoding:
    """encode() of an eager call, cached (a model makes the same few calls every
    step); the caller checks the operands first."""
    offset = o.causal_offset
    if isinstance(offset, torch.Tensor):  # a new tensor per call, as a rule: not cached
        return encode(query, keys, values, o, variants, out_dims(query, keys, values, o.key_dim, o.axis))
    key = encoding_key(query.dims, keys.dims, values.dims, o.key_dim, o.axis, o.att_dropout, o.att_dropout_broadcast,
                       o.causal_query_spatial_dim, offset.dims if isinstance(offset, Tensor) else offset, o.scale,
                       o.train, o.query_position_dim, forced(), _variants.structure(variants))
    hit = encodings.get(key)
    if hit is None:
        hit = encode(query, keys, values, o, variants, out_dims(query, keys, values, o.key_dim, o.axis))
        if len(encodings) >= _ENCODINGS_KEPT:
            encodings.pop(next(iter(encodings)))
        encodings[key] = hit
    return hit


def run(op, query: Tensor, keys: Tensor, values: Tensor, e: Encoding, variants, *trailing):
    """An op (a torch.ops.dimattn overload) on one call, None for its forward
    op; with `trailing` arguments after the call's and its variants' (the trace
    op's energy_dims); dimattn errors as dimattn.Error."""
    a = call_arguments(e, variants)
    if op is None:
        op = e.forward
    else:  # the ops besides the forward ones take the call's and the full group's arguments
        a += [None] * (_ENDS[1] - len(a))
    try:
        return op(query.raw, keys.raw, values.raw, *a, *trailing)
    except RuntimeError as err:
        raise_as_error(err)


