"""dot_attention over named dims on torch tensors, with tracing, forcing and explain.

A call is encoded once per call as the op library's call spec (python/csrc/call_spec.h):
the operands' dims become names, unique within the call (two Dims of one name get
"name", "name#2"), dynamic dims send their lengths tensors along, and options
become entries (tensor options, as ALiBi's slopes, the sinks, the bias and the
mask, an aux tensor each). A new option is a keyword here and one entry in ``_encode``.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ._core import Dim, Error, Tensor
from ._ops import ops

_RESERVED = str.maketrans({";": "_", ",": "_", "=": "_", ":": "_"})


class _State(threading.local):
    def __init__(self):
        self.train = False
        self.force: List[str] = []
        self.traces: List["trace"] = []


_state = _State()


# --- run context ---------------------------------------------------------------------

def train_flag() -> bool:
    """Whether dropout acts in calls that pass no ``train=`` (default False)."""
    return _state.train


class train_scope:
    """``with dimattn.train_scope(True):`` dropout acts inside (per thread), as
    RETURNN's run_ctx.train_flag; a call's ``train=`` argument overrides it."""

    def __init__(self, on: bool = True):
        self.on = bool(on)

    def __enter__(self):
        self.saved = _state.train
        _state.train = self.on
        return self

    def __exit__(self, *exc):
        _state.train = self.saved
        return False


class force:
    """``with dimattn.force("reference"):`` or ``force("cpu_flash,aten_flash_cpu")``:
    only these kernels may run calls made inside (per thread, forward and backward);
    "auto" lets selection decide. A forced kernel that cannot run a call is an error
    giving the reason, never a silent fallback. Without a scope the environment
    variable DIMATTN_SDPA (same syntax) applies."""

    def __init__(self, kernels: str):
        unknown = [k for k in kernels.split(",") if k.strip() not in _KERNEL_NAMES and k.strip() != "auto"]
        if unknown:
            raise Error(f"[force] unknown kernel {', '.join(unknown)}; known: auto, {', '.join(kernel_names())}")
        self.kernels = kernels

    def __enter__(self):
        _state.force.append(self.kernels)
        return self

    def __exit__(self, *exc):
        _state.force.pop()
        return False


# Fixed once the library is loaded; read here, not through the op, so that
# force() works inside torch.compile too.
_KERNEL_NAMES = tuple(ops.kernel_names())


def kernel_names() -> List[str]:
    """Every kernel name of the built library: "reference" and its backends' kernels."""
    return list(_KERNEL_NAMES)


@dataclasses.dataclass
class AttentionTrace:
    """One traced call. With capture_tensors, ``energy`` (q·k·scale before masking)
    and ``att_weights`` (after masking, softmax and dropout) are named tensors with
    the call's own dims (the kv side of self-attention is a new dim, ``axis'``)."""
    kernel: str
    output: Tensor
    energy: Optional[Tensor] = None
    att_weights: Optional[Tensor] = None


class trace:
    """``with dimattn.trace() as t:`` records each dot_attention call made inside
    (per thread) in ``t.records``. With ``capture_tensors`` (default) calls run the
    reference path and records hold energy and weights; without, calls run as
    selected and records hold the kernel that ran and the output. Eager mode only:
    inside torch.compile nothing is recorded."""

    def __init__(self, capture_tensors: bool = True):
        self.capture_tensors = capture_tensors
        self.records: List[AttentionTrace] = []

    def __enter__(self):
        _state.traces.append(self)
        return self

    def __exit__(self, *exc):
        _state.traces.remove(self)
        return False


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


# --- encoding a call -----------------------------------------------------------------

class _Call:
    """One call's dims as unique names, its auxiliary tensors and its spec entries.

    Only the lengths of ``axis`` reach the op: padding masks the kv axis and
    nothing else (a padded query row is computed like any row), so every other
    dim crosses as static, its size the operands' padded extent. That also lets
    the axis's lengths vary over a dim that is itself dynamic (a history whose
    length depends on batch and time), which dimattn's Dims do not take."""

    def __init__(self, axis: Dim):
        self.axis = axis
        self.dims: List[Dim] = []
        self.names: List[str] = []
        self.aux: List[torch.Tensor] = []
        self.entries: List[str] = []

    def name(self, d: Dim) -> str:
        for e, n in zip(self.dims, self.names):
            if e is d:
                return n
        base = d.name.translate(_RESERVED) or "dim"
        name, i = base, 1
        while name in self.names or name == "'":
            i += 1
            name = f"{base}#{i}"
        self.dims.append(d)
        self.names.append(name)
        if d.lengths is not None and d is self.axis:
            # The lengths' own dims get names first; then the entry.
            over = ",".join(self.name(e) for e in d.lengths.dims)
            self.aux.append(d.lengths.raw)
            self.entries.append(f"dyn.{name}={len(self.aux) - 1}:{over}")
        return name

    def names_of(self, dims: Sequence[Dim]) -> str:
        return ",".join(self.name(d) for d in dims)


def _has(dims: Sequence[Dim], d: Dim) -> bool:
    return any(e is d for e in dims)


def _out_dims(query: Tensor, keys: Tensor, values: Tensor, key_dim: Dim, axis: Dim) -> List[Dim]:
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


def _energy_dims(query: Tensor, keys: Tensor, key_dim: Dim, axis: Dim):
    """The traced energy's dims and their spec names ("'" for the kv side of
    self-attention, a new dim)."""
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


def _check_operand(name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise Error(f"[dot_attention] {name} must be a dimattn.Tensor (a torch tensor and its dims), "
                    f"got {type(x).__name__}")


def _check_variants(window, softcap, alibi_slopes, sinks, bias=None, mask=None) -> None:
    """What the op cannot say itself: the Python types of the variant options.
    Their values (window sides >= 0, softcap > 0, the dims of slopes, sinks, bias and
    mask, the dtypes of bias and mask) are the C++ library's to check, with its
    messages."""
    if window is not None and not (isinstance(window, (tuple, list)) and len(window) == 2 and all(
            side is None or (isinstance(side, int) and not isinstance(side, bool)) for side in window)):
        raise Error(f"[dot_attention] window must be a pair (left, right) of ints, None for an unbounded side, "
                    f"got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))):
        raise Error(f"[dot_attention] softcap must be a number > 0, got {type(softcap).__name__}")
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None and not isinstance(t, Tensor):
            raise Error(f"[dot_attention] {name} must be a dimattn.Tensor over batch dims (e.g. heads), "
                        f"got {type(t).__name__}")
    for name, t, what in (("bias", bias, "a float"), ("mask", mask, "a bool")):
        if t is not None and not isinstance(t, Tensor):
            raise Error(f"[dot_attention] {name} must be {what} dimattn.Tensor over dims of the call (batch dims, "
                        f"the query's own dims, keys-only dims, axis), got {type(t).__name__}")
    if alibi_slopes is not None and alibi_slopes.raw.requires_grad and torch.is_grad_enabled():
        raise Error("[dot_attention] alibi_slopes require grad, but ALiBi's slopes are constants and get no "
                    "gradient; pass alibi_slopes.raw.detach() (sinks are the learnable variant)")


def _encode(query, keys, values, key_dim, axis, att_dropout, att_dropout_broadcast, causal_query_spatial_dim,
            causal_offset, scale, train, out_dims, energy_dims=None, *, query_position_dim=None, window=None,
            softcap=None, alibi_slopes=None, sinks=None, sink_off_by_one=False, bias=None, mask=None,
            context_parallel=None):
    """context_parallel: the "cp" entry's value and the whole sequence's lengths (a
    dimattn.Tensor or None) for dot_attention(..., context_parallel)."""
    c = _Call(axis)
    e = c.entries
    e.append("q=" + c.names_of(query.dims))
    e.append("k=" + c.names_of(keys.dims))
    e.append("v=" + c.names_of(values.dims))
    e.append("out=" + c.names_of(out_dims))
    for opt in (key_dim, axis, causal_query_spatial_dim, query_position_dim):
        if opt is not None and not any(opt is d for d in c.dims) and opt.size is not None:
            e.append(f"size.{c.name(opt)}={opt.size}")
    e.append("key_dim=" + c.name(key_dim))
    e.append("axis=" + c.name(axis))
    if causal_query_spatial_dim is not None:
        e.append("causal=" + c.name(causal_query_spatial_dim))
    if causal_offset is not None:
        if isinstance(causal_offset, int):
            e.append(f"causal_offset_int={causal_offset}")
        elif isinstance(causal_offset, Tensor):
            c.aux.append(causal_offset.raw)
            i = len(c.aux) - 1
            e.append(f"causal_offset={i}:" + c.names_of(causal_offset.dims))
        elif isinstance(causal_offset, torch.Tensor) and causal_offset.dim() == 0:
            c.aux.append(causal_offset)
            e.append(f"causal_offset={len(c.aux) - 1}:")
        else:
            raise Error("[dot_attention] causal_offset must be an int, a rank-0 torch tensor or a dimattn.Tensor "
                        f"over batch dims, got {type(causal_offset).__name__}")
    if query_position_dim is not None:
        e.append("query_position=" + c.name(query_position_dim))
    if window is not None:
        e.append("window=" + ":".join("" if side is None else str(int(side)) for side in window))
    if softcap is not None:
        e.append(f"softcap={float(softcap)!r}")
    # Slopes, sinks, bias and mask: after every other aux tensor but the seed,
    # so that a cached encoding appends them (and the seed) per call.
    for entry, t in (("alibi", alibi_slopes), ("sinks", sinks), ("bias", bias), ("mask", mask)):
        if t is not None:
            over = c.names_of(t.dims)
            c.aux.append(t.raw)
            e.append(f"{entry}={len(c.aux) - 1}:{over}")
    if sink_off_by_one:
        e.append("sink_off_by_one=1")
    if context_parallel is not None:
        entry, lengths = context_parallel
        if lengths is not None:
            over = c.names_of(lengths.dims)
            c.aux.append(lengths.raw)
            e.append(f"cp_lengths={len(c.aux) - 1}:{over}")
        e.append("cp=" + entry)
    if att_dropout:
        e.append(f"dropout={float(att_dropout)!r}")
    if att_dropout_broadcast:
        e.append("broadcast=1")
    if train:
        e.append("train=1")
        if att_dropout:
            # From torch's generator: torch.manual_seed reproduces the mask.
            c.aux.append(torch.randint(0, 2**62, (), dtype=torch.int64))
            e.append(f"seed={len(c.aux) - 1}")
    if scale is not None:
        e.append(f"scale={float(scale)!r}")
    if _state.force:
        e.append("force=" + _state.force[-1])
    if energy_dims is not None:
        e.append("energy=" + ",".join("'" if d is energy_dims[1] and not any(d is x for x in c.dims) else c.name(d)
                                      for d in energy_dims[0]))
    return ";".join(e), c.aux


_forward = ops.dot_attention.default
# What OpOverload.__call__ calls, minus its Python frame: for the eager fast
# path only (torch.compile traces _forward).
_forward_eager = getattr(_forward, "_op", _forward)

# Encodings of recent eager calls (dims and options -> spec, aux, result dims),
# oldest first. Holds the Dims it was keyed by, so their ids stay unique.
_encodings: dict = {}
_ENCODINGS_KEPT = 256
_PLAIN_OFFSETS = (type(None), int)  # causal_offset types whose calls are cached
_is_compiling = torch.compiler.is_compiling  # one global lookup, not two attributes, per call
_new_tensor = object.__new__


def _raise_as_error(err: RuntimeError):
    msg = str(err)
    if msg.startswith("[") or "[dot_attention]" in msg or "[from_aten]" in msg:
        raise Error(msg) from None
    raise err


def dot_attention(query: Tensor, keys: Tensor, values: Tensor, *, key_dim: Dim, axis: Dim,
                  att_dropout: float = 0.0, att_dropout_broadcast: bool = False,
                  causal_query_spatial_dim: Optional[Dim] = None,
                  causal_offset: Union[None, int, torch.Tensor, Tensor] = None,
                  scale: Optional[float] = None, train: Optional[bool] = None,
                  query_position_dim: Optional[Dim] = None,
                  window: Optional[Tuple[Optional[int], Optional[int]]] = None,
                  softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
                  sinks: Optional[Tensor] = None, sink_off_by_one: bool = False, bias: Optional[Tensor] = None,
                  mask: Optional[Tensor] = None, context_parallel=None) -> Tensor:
    """Scaled dot-product attention over named dims (RETURNN's semantics, docs/python.md).

    query ``{..., key_dim}``, keys ``{..., axis, key_dim}``, values ``{..., axis, v_feat...}``;
    returns values' dims without ``axis``, plus the query's own dims. Dims shared by
    query and keys/values are batch dims; query dims the keys lack (beam, query heads)
    are never tiled into the keys. ``axis`` in the query means self-attention.
    Causal: query position i attends kv positions <= i + causal_offset. Dropout acts
    only when ``train`` (default: :func:`train_flag`); ``att_dropout_broadcast`` draws
    one mask over ``axis`` shared by every other dim. ``scale`` defaults to
    1/sqrt(size(key_dim)).

    Variants: ``window=(left, right)`` (row i sees i + offset - left <= j <= i + offset
    + right; None is unbounded), ``softcap`` (energies -> softcap * tanh(energy /
    softcap)), ``alibi_slopes`` (energy -= slope * |i + offset - j|) and ``sinks`` (a
    logit in every softmax denominator, learnable), each a dimattn.Tensor over batch
    dims, ``sink_off_by_one`` (the fixed sink logit 0). Windows and ALiBi measure along
    the causal dim, else ``query_position_dim`` (``axis`` for self-attention).
    ``bias`` (float, added to the energies, learnable) and ``mask`` (bool, True = may
    attend) are dimattn.Tensors over any dims of the call but features: batch dims,
    the query's own dims, keys-only dims and ``axis`` (the kv position; in
    self-attention give keys and values a dim of their own for a bias over both
    positions).

    ``context_parallel=dimattn.ContextParallel(group, sharding, strategy)``: the
    sequence along ``axis`` (self-attention) is split across the group's ranks; each
    passes its shard and gets its shard of the output (docs/distributed.md).
    """
    state = _state
    if (window is None and softcap is None and alibi_slopes is None and sinks is None and bias is None
            and mask is None and query_position_dim is None and not sink_off_by_one and context_parallel is None
            and not state.traces
            and type(causal_offset) in _PLAIN_OFFSETS and not _is_compiling()):
        # The common eager call (no variant, no trace): one lookup of the
        # encoding that the path below cached for the same Dims and options.
        try:
            hit = _encodings.get((query.dims, keys.dims, values.dims, key_dim, axis, att_dropout,
                                  att_dropout_broadcast, causal_query_spatial_dim, causal_offset, scale,
                                  state.train if train is None else bool(train),
                                  state.force[-1] if state.force else None))
        except (AttributeError, TypeError):  # not dimattn.Tensors: the path below says so
            hit = None
        if hit is not None:
            spec, aux, out_dims, seeded = hit
            if seeded:  # a new seed per call, as _encode draws it
                aux = aux + [torch.randint(0, 2**62, (), dtype=torch.int64)]
            try:
                out = _forward_eager(query.raw, keys.raw, values.raw, aux, spec)
            except RuntimeError as err:
                _raise_as_error(err)
            result = _new_tensor(Tensor)  # Tensor._trusted without its call
            result.raw, result.dims = out, out_dims
            return result
    train = _state.train if train is None else bool(train)
    if context_parallel is not None:
        from ._context_parallel import attention
        return attention(query, keys, values, key_dim=key_dim, axis=axis, att_dropout=att_dropout,
                         att_dropout_broadcast=att_dropout_broadcast, causal_query_spatial_dim=causal_query_spatial_dim,
                         causal_offset=causal_offset, scale=scale, train=train, query_position_dim=query_position_dim,
                         window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                         sink_off_by_one=sink_off_by_one, bias=bias, mask=mask, cp=context_parallel)
    _check_variants(window, softcap, alibi_slopes, sinks, bias, mask)
    variants = dict(query_position_dim=query_position_dim, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                    sinks=sinks, sink_off_by_one=sink_off_by_one, bias=bias, mask=mask)
    if not torch.compiler.is_compiling() and not _state.traces and type(causal_offset) in (type(None), int):
        # Eager: the encoding of a call is a function of its dims' identities
        # and options, so repeated calls with the same Dims reuse it. Slopes,
        # sinks, bias, mask and the dropout seed are the call's own: appended
        # per call.
        per_call = [t for t in (alibi_slopes, sinks, bias, mask) if t is not None]
        try:
            key = (query.dims, keys.dims, values.dims, key_dim, axis, att_dropout, att_dropout_broadcast,
                   causal_query_spatial_dim, causal_offset, scale, train, _state.force[-1] if _state.force else None)
            if per_call or query_position_dim is not None or window is not None or softcap is not None \
                    or sink_off_by_one:  # else the key the fast path above looks up
                key += (query_position_dim, None if window is None else tuple(window), softcap, sink_off_by_one,
                        *(None if t is None else t.dims for t in (alibi_slopes, sinks, bias, mask)))
            hit = _encodings.get(key)
        except (AttributeError, TypeError):  # not dimattn.Tensors: the checks below say so
            key = hit = None
        if hit is None and key is not None:
            for name, x in (("query", query), ("keys", keys), ("values", values)):
                _check_operand(name, x)
            out_dims = _out_dims(query, keys, values, key_dim, axis)
            spec, aux = _encode(query, keys, values, key_dim, axis, att_dropout, att_dropout_broadcast,
                                causal_query_spatial_dim, causal_offset, scale, train, out_dims, **variants)
            seeded = train and bool(att_dropout)
            if len(_encodings) >= _ENCODINGS_KEPT:
                _encodings.pop(next(iter(_encodings)))
            _encodings[key] = (spec, aux[:len(aux) - len(per_call) - seeded], tuple(out_dims), seeded)
        elif hit is not None:
            spec, aux, out_dims, seeded = hit
            aux = aux + [t.raw for t in per_call]
            if seeded:  # a new seed per call, as _encode draws it
                aux.append(torch.randint(0, 2**62, (), dtype=torch.int64))
        if key is not None:
            try:
                out = _forward(query.raw, keys.raw, values.raw, aux, spec)
            except RuntimeError as err:
                _raise_as_error(err)
            return Tensor._trusted(out, out_dims)
    for name, x in (("query", query), ("keys", keys), ("values", values)):
        _check_operand(name, x)
    out_dims = _out_dims(query, keys, values, key_dim, axis)
    args = (query, keys, values, key_dim, axis, att_dropout, att_dropout_broadcast, causal_query_spatial_dim,
            causal_offset, scale, train)
    traces = _state.traces
    if traces and not torch.compiler.is_compiling():
        return _traced_call(traces, args, out_dims, variants)
    spec, aux = _encode(*args, out_dims, **variants)
    try:
        out = _forward(query.raw, keys.raw, values.raw, aux, spec)
    except RuntimeError as err:
        _raise_as_error(err)
    return Tensor(out, out_dims)


def _traced_call(traces, args, out_dims, variants) -> Tensor:
    query, keys, values, key_dim, axis = args[:5]
    capture = any(t.capture_tensors for t in traces)
    energy_dims = _energy_dims(query, keys, key_dim, axis)
    # One seed for both calls below: the same dropout mask.
    state = torch.random.get_rng_state()
    try:
        if capture:
            forced = _state.force[-1] if _state.force else os.environ.get("DIMATTN_SDPA", "auto")
            if forced.strip() not in ("", "auto") and "reference" not in [k.strip() for k in forced.split(",")]:
                raise Error(f"[dot_attention] a trace capturing energies needs the reference path, but kernels are "
                            f"forced to '{forced}'; use trace(capture_tensors=False) to trace only kernel names")
            # The output through the reference path (with autograd), energies
            # and weights from the same call traced.
            with force("reference"):
                spec, aux = _encode(*args, out_dims, energy_dims, **variants)
            out = _forward(query.raw, keys.raw, values.raw, aux, spec)
            with torch.no_grad():
                energy, weights = ops.dot_attention_trace(query.raw, keys.raw, values.raw, aux, spec)
            kernel = "reference"
            energy, weights = Tensor(energy, energy_dims[0]), Tensor(weights, energy_dims[0])
        else:
            spec, aux = _encode(*args, out_dims, **variants)
            kernel = ops.explain(query.raw, keys.raw, values.raw, aux, spec).split("\x1e", 1)[0].split("\x1d")[0]
            torch.random.set_rng_state(state)
            spec, aux = _encode(*args, out_dims, **variants)
            out = _forward(query.raw, keys.raw, values.raw, aux, spec)
            energy = weights = None
    except RuntimeError as err:
        _raise_as_error(err)
    result = Tensor(out, out_dims)
    for t in traces:
        t.records.append(AttentionTrace(kernel, result, energy if t.capture_tensors else None,
                                        weights if t.capture_tensors else None))
    return result


def explain(query: Tensor, keys: Tensor, values: Tensor, *, key_dim: Dim, axis: Dim, att_dropout: float = 0.0,
            att_dropout_broadcast: bool = False, causal_query_spatial_dim: Optional[Dim] = None,
            causal_offset: Union[None, int, torch.Tensor, Tensor] = None, scale: Optional[float] = None,
            train: Optional[bool] = None, query_position_dim: Optional[Dim] = None,
            window: Optional[Tuple[Optional[int], Optional[int]]] = None, softcap: Optional[float] = None,
            alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
            sink_off_by_one: bool = False, bias: Optional[Tensor] = None, mask: Optional[Tensor] = None) -> Decision:
    """Which kernel :func:`dot_attention` would run for these arguments, and why each
    candidate before it was rejected. Runs nothing; raises like dot_attention for bad
    input or a forced kernel that cannot run."""
    for name, x in (("query", query), ("keys", keys), ("values", values)):
        _check_operand(name, x)
    _check_variants(window, softcap, alibi_slopes, sinks, bias, mask)
    train = _state.train if train is None else bool(train)
    out_dims = _out_dims(query, keys, values, key_dim, axis)
    spec, aux = _encode(query, keys, values, key_dim, axis, att_dropout, att_dropout_broadcast,
                        causal_query_spatial_dim, causal_offset, scale, train, out_dims,
                        query_position_dim=query_position_dim, window=window, softcap=softcap,
                        alibi_slopes=alibi_slopes, sinks=sinks, sink_off_by_one=sink_off_by_one, bias=bias, mask=mask)
    try:
        raw = ops.explain(query.raw, keys.raw, values.raw, aux, spec)
    except RuntimeError as err:
        _raise_as_error(err)
    head, _, text = raw.partition("\x1d")
    parts = head.split("\x1e")
    rejected = [Rejection(*p.split("\x1f", 1)) for p in parts[1:]]
    return Decision(parts[0], rejected, text)
