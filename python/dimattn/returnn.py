"""RETURNN's ``rf.dot_attention`` and relative-position self-attention on dimattn's fused kernels.

    import dimattn.returnn
    dimattn.returnn.enable()              # or: with dimattn.returnn.enabled(): ...
    ...                                   # RETURNN models on the torch backend
    dimattn.returnn.stats()               # {"routed": ..., "fallback": ..., "reasons": {...}, ...}

For a whole RETURNN run, in its config (RETURNN calls ``startup_callback`` at start):

    from dimattn.returnn import startup_callback
    dimattn_attention = True              # or "strict"; DIMATTN_RETURNN=0/1/strict overrides

``rf.dot_attention`` reaches the torch backend through
``TorchBackend.scaled_dot_product_attention``, ``rf.RelPosSelfAttention`` and
``rf.RelPosCausalSelfAttention`` (the Conformer's) through
``TorchBackend.rel_pos_self_attention`` (both inherited from RETURNN's generic
``Backend``); ``enable`` puts dimattn there and ``disable`` restores exactly what was
there. Calls inside ``torch.autocast`` (RETURNN's ``torch_amp``), ``torch.compile`` and
RETURNN's static-traceable regime are routed too. A call dimattn cannot take runs RETURNN's own implementation, counted with
its reason (``stats()``), or raises in strict mode. docs/returnn.md.

RETURNN is called through its public API only; none of its code is copied (its
license forbids distributing modified copies).
"""
from __future__ import annotations

import contextlib
import os
import threading
from numbers import Real
from typing import Dict, List, Optional

import torch
import returnn.frontend as rf
from returnn.config import get_global_config
from returnn.tensor import Dim as RfDim, Tensor as RfTensor
from returnn.torch.frontend import TorchBackend

import dimattn as da
from dimattn._route_counts import RouteCounts
from dimattn._varlen import PackedCall

__all__ = ["enable", "disable", "enabled", "is_enabled", "is_strict", "stats", "reset_stats", "trace", "startup_callback",
           "enable_from_config"]

_ABSENT = object()  # TorchBackend had no attribute of its own (it inherited the generic one)


class _Patch:
    """What enable() replaced on TorchBackend: per attribute (rf.dot_attention's
    ``scaled_dot_product_attention`` and the packed backend's varlen kernel hook
    ``sdpa_varlen_raw``) TorchBackend's own (or _ABSENT) and our descriptor; the
    implementations they resolved to, for fallbacks."""

    def __init__(self, strict: bool):
        self.hooks = {name: (TorchBackend.__dict__.get(name, _ABSENT), ours) for name, ours in (
            ("scaled_dot_product_attention", classmethod(_scaled_dot_product_attention)),
            ("rel_pos_self_attention", classmethod(_rel_pos_self_attention)),
            ("sdpa_varlen_raw", staticmethod(_sdpa_varlen_raw)))}
        self.original = TorchBackend.scaled_dot_product_attention
        self.original_rel_pos = TorchBackend.rel_pos_self_attention
        self.original_varlen = TorchBackend.sdpa_varlen_raw
        self.strict = strict


_patch: Optional[_Patch] = None


def enable(strict: bool = False) -> None:
    """Route ``rf.dot_attention`` on RETURNN's torch backend to dimattn (process-wide),
    packed operands (``rf.pack``) included. ``strict``: a call dimattn cannot take
    raises dimattn.Error instead of running RETURNN's implementation. Enabling again
    only updates ``strict``.

    Args:
        strict: see above.
    """
    global _patch
    if _patch is None:
        _patch = _Patch(strict)
        for name, (_, ours) in _patch.hooks.items():
            setattr(TorchBackend, name, ours)
    _patch.strict = bool(strict)


def disable() -> None:
    """Restore what TorchBackend's attributes were before enable()."""
    global _patch
    if _patch is None:
        return
    for name, (_, ours) in _patch.hooks.items():
        if TorchBackend.__dict__.get(name) is not ours:
            raise da.Error(f"[dimattn.returnn] TorchBackend.{name} was replaced by someone else after enable(); "
                           f"restoring it would drop their change: undo theirs first")
    for name, (saved, _) in _patch.hooks.items():
        if saved is _ABSENT:
            delattr(TorchBackend, name)
        else:
            setattr(TorchBackend, name, saved)
    _patch = None


def is_enabled() -> bool:
    """Whether routing is on.

    Returns:
        True between enable() and disable().
    """
    return _patch is not None


def is_strict() -> bool:
    """Whether routing is on in strict mode.

    Returns:
        True when enabled with ``strict``.
    """
    return _patch is not None and _patch.strict


@contextlib.contextmanager
def enabled(strict: bool = False):
    """``with dimattn.returnn.enabled():`` routes inside, and leaves the routing as it
    was before (on or off, strict or not) afterwards.

    Args:
        strict: as :func:`enable`'s.
    """
    before = None if _patch is None else _patch.strict
    enable(strict)
    try:
        yield
    finally:
        if before is None:
            disable()
        else:
            _patch.strict = before


# --- a whole run: RETURNN's config ---------------------------------------------------

def _mode(value, where: str) -> Optional[bool]:
    """None: off; False: on; True: strict."""
    text = str(value).strip().lower()
    if value is None or value is False or text in ("", "0", "false", "off", "no"):
        return None
    if value is True or text in ("1", "true", "on", "yes"):
        return False
    if text == "strict":
        return True
    raise da.Error(f"[dimattn.returnn] {where} must be True, False or \"strict\", got {value!r}")


def enable_from_config(config=None) -> bool:
    """Enable as the RETURNN config's option ``dimattn_attention`` says (True, False or
    "strict"; default: the global config), unless the environment variable
    DIMATTN_RETURNN (1, 0 or strict) overrides it.

    Args:
        config: a RETURNN config; None: the global one.

    Returns:
        Whether routing is on.
    """
    env = os.environ.get("DIMATTN_RETURNN")
    if env is not None:
        mode = _mode(env, "DIMATTN_RETURNN")
    else:
        if config is None:
            config = get_global_config(raise_exception=False)
        value = config.opt_typed_value("dimattn_attention", False) if config is not None else False
        mode = _mode(value, "the RETURNN config option dimattn_attention")
    if mode is None:
        disable()
        return False
    enable(strict=mode)
    return True


def startup_callback(*, config, **_kwargs) -> None:
    """RETURNN's ``startup_callback`` config option (called once at start, before the
    engine): ``from dimattn.returnn import startup_callback`` in a config enables
    routing as its ``dimattn_attention`` option says. A config with a startup callback
    of its own calls :func:`enable_from_config` from it instead.

    Args:
        config: the RETURNN config RETURNN passes (other arguments are ignored).
    """
    enable_from_config(config)


# --- counts ----------------------------------------------------------------------------

_counts = RouteCounts(("routed", "fallback", "reference"))
_count = _counts.count


def stats() -> dict:
    """Counts since the last reset_stats(): ``routed`` (ran on dimattn; ``kernels`` counts
    the kernels), ``fallback`` (ran RETURNN's implementation because dimattn cannot take
    the call) and ``reference`` (ran RETURNN's implementation because dimattn's
    selection chose its reference path: forced with DIMATTN_SDPA or dimattn.force, or no
    fused kernel takes the call); ``reasons`` counts why for both.

    Returns:
        ``{"routed": int, "fallback": int, "reference": int, "reasons": {...}, "kernels": {...}}``.
    """
    return _counts.stats()


def reset_stats() -> None:
    _counts.reset()


# --- tracing ---------------------------------------------------------------------------

class _Traces(threading.local):
    def __init__(self):
        self.active: List["trace"] = []


_traces = _Traces()


class trace(da.trace):
    """``with dimattn.returnn.trace() as t:`` records each routed call made inside (per
    thread) in ``t.records``, as dimattn.trace does, with RETURNN Tensors over RETURNN
    Dims: ``kernel``, ``output`` and, with ``capture_tensors`` (default; calls then run
    dimattn's reference path), ``energy`` (scaled, before masking) and ``att_weights``
    (after masking, softmax and dropout). The kv side of self-attention is a new Dim
    named ``<axis>:kv``. Calls that run RETURNN's implementation are not recorded: trace
    those with RETURNN's own tools (force the reference path, docs/returnn.md)."""

    def _scopes(self) -> list:
        return _traces.active


# --- one call --------------------------------------------------------------------------

class _Fallback(Exception):
    """A call dimattn cannot take; the message is the reason."""


# dimattn Dims made for RETURNN dims in recent calls, keyed by the RETURNN Dim's
# identity and what the Dim was made of (a static extent, or the mask its lengths
# came from); the entry holds both, so their ids stay unique. Calls over the same
# dims (the layers of one step, decoding steps) then reach dimattn with the same
# Dims, whose call encoding dimattn keeps.
_made: Dict[tuple, tuple] = {}
_MADE_KEPT = 256


def _made_dim(d: RfDim, of, make) -> da.Dim:
    key = (id(d), of if isinstance(of, int) else id(of))
    hit = _made.get(key)
    if hit is None:
        if len(_made) >= _MADE_KEPT:
            _made.pop(next(iter(_made)))
        hit = _made[key] = (d, of, make())
    return hit[2]


class _Call:
    """One call's RETURNN dims as dimattn Dims. RETURNN's equality decides which dims
    are one dim (a dict keyed by RETURNN Dims uses it): two dims RETURNN tells apart
    stay two, whatever their names."""

    def __init__(self):
        self.to_da: Dict[RfDim, da.Dim] = {}
        self.to_rf: Dict[int, RfDim] = {}

    def _add(self, d: RfDim, m: da.Dim) -> da.Dim:
        self.to_da[d] = m
        self.to_rf[id(m)] = d
        return m

    def dim(self, d: RfDim, extent: int) -> da.Dim:
        m = self.to_da.get(d)
        if m is None:
            return self._add(d, _made_dim(d, extent, lambda: da.Dim(d.name or "dim", extent)))
        if m.size is not None and m.size != extent:
            raise _Fallback(f"dim {d} has extents {m.size} and {extent}")
        return m

    def dynamic(self, d: RfDim, mask: RfTensor) -> da.Dim:
        """d with the lengths of RETURNN's mask of it (over its other dims, all mapped)."""
        def make():
            lengths = mask.raw_tensor.sum(dim=mask.dims.index(d), dtype=torch.int64)
            return da.Dim.dynamic(d.name or "dim", da.Tensor(lengths, [self.to_da[e] for e in mask.dims if e != d]))
        return self._add(d, _made_dim(d, mask.raw_tensor, make))

    def tensor(self, x: RfTensor, skip: Optional[RfDim]) -> None:
        """Maps x's dims but ``skip`` (mapped after the others)."""
        for d, extent in zip(x.dims, x.raw_tensor.shape):
            if d != skip:
                self.dim(d, extent)

    def named(self, x: RfTensor) -> da.Tensor:
        dims = [self.to_da[d] for d in x.dims]
        if len({id(d) for d in dims}) < len(dims):
            raise _Fallback(f"{x} has two dims that RETURNN treats as one")
        return da.Tensor(x.raw_tensor, dims)

    def back(self, x: da.Tensor) -> List[RfDim]:
        return [self.to_rf[id(d)] for d in x.dims]


_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _prepare(query: RfTensor, key: RfTensor, value: RfTensor, *, att_dropout_broadcast: bool, qk_feat_dim: RfDim,
             kv_spatial_dim: RfDim, query_spatial_dim: RfDim, attention_mask=None, att_dropout=0.0, is_causal=False,
             scale=None, v_feat_dim=None, **unknown):
    """The dimattn call for the arguments of RETURNN's hook (with its defaults;
    v_feat_dim is implied by the dims): the call's dims, the operands and the keyword
    arguments of dimattn.dot_attention. Raises _Fallback for what dimattn cannot take,
    checked up front (no error of a call is caught)."""
    if unknown:
        raise _Fallback(f"arguments it does not know: {', '.join(sorted(unknown))}")
    if attention_mask is not None:
        raise _Fallback("attention_mask")
    raws = (query.raw_tensor, key.raw_tensor, value.raw_tensor)
    if not all(isinstance(r, torch.Tensor) for r in raws):
        raise _Fallback("operands are not torch tensors")
    if raws[0].dtype not in _FLOATS or any(r.dtype != raws[0].dtype for r in raws):
        raise _Fallback(f"operand dtypes {', '.join(str(r.dtype) for r in raws)}")
    if any(r.device != raws[0].device for r in raws):
        raise _Fallback("operands on different devices")
    if raws[0].is_cuda and torch.cuda.is_current_stream_capturing():
        # dimattn reads kv lengths on the host, which a CUDA graph cannot capture.
        raise _Fallback("CUDA graph capture")
    if not isinstance(att_dropout, Real) or not 0 <= att_dropout < 1:
        raise _Fallback("att_dropout is not a number in [0, 1)")
    if scale is not None and not isinstance(scale, Real):
        raise _Fallback("scale is not a number")
    train = False
    if att_dropout:
        train = rf.get_run_ctx().is_train_flag_enabled(func=rf.dropout)
        if not isinstance(train, bool):
            raise _Fallback("the train flag is a tensor")
    if qk_feat_dim.dimension is None:
        raise _Fallback("key_dim is dynamic")
    if qk_feat_dim not in query.dims or qk_feat_dim not in key.dims or kv_spatial_dim not in key.dims \
            or kv_spatial_dim not in value.dims:
        raise _Fallback("key_dim or axis missing from an operand")
    if is_causal:
        if query_spatial_dim not in query.dims:
            raise _Fallback("causal, but the query lacks query_spatial_dim")
    elif kv_spatial_dim in query.dims:
        raise _Fallback("axis in the query without is_causal")

    c = _Call()
    for x in (query, key, value):
        c.tensor(x, skip=kv_spatial_dim)
    extent = key.raw_tensor.shape[key.dims.index(kv_spatial_dim)]
    if is_causal or not kv_spatial_dim.need_masking():
        # RETURNN's causal attention masks j <= i and nothing else (padded rows
        # attend padded kv positions too): dimattn's with a static axis.
        axis = c.dim(kv_spatial_dim, extent)
        if is_causal and c.to_da[query_spatial_dim].size != extent:
            raise _Fallback("causal with query and kv extents that differ")
    else:
        axis = c.dynamic(kv_spatial_dim, _mask(kv_spatial_dim, query, key))
    kwargs = dict(key_dim=c.to_da[qk_feat_dim], axis=axis, att_dropout=float(att_dropout),
                  att_dropout_broadcast=bool(att_dropout_broadcast), scale=None if scale is None else float(scale),
                  train=train, causal_query_spatial_dim=c.to_da[query_spatial_dim] if is_causal else None)
    return c, c.named(query), c.named(key), c.named(value), kwargs


def _mask(axis: RfDim, query: RfTensor, key: RfTensor) -> RfTensor:
    """RETURNN's own mask of the axis (Dim.get_mask), from which its lengths are
    counted: padded entries of a lengths tensor then mean what the installed RETURNN
    means. Its other dims must be the keys' or the query's (dims only the query has
    give each query row its own kv length)."""
    if axis.dyn_size_ext is None or axis.dyn_size_ext.raw_tensor is None:
        raise _Fallback("axis without lengths")
    mask = axis.get_mask(device=key.device)
    for d in mask.dims:
        if d != axis and d not in key.dims and d not in query.dims:
            raise _Fallback(f"kv lengths over {d}, which no operand has")
    return mask


def _decision(q: da.Tensor, k: da.Tensor, v: da.Tensor, kwargs: dict) -> da.Decision:
    """The kernel dimattn selects for the call and why. Its dropout seed would come from
    torch's generator, so the generator's state is kept: a routed call draws from it
    exactly as a dimattn.dot_attention call does."""
    draws = kwargs["train"] and kwargs["att_dropout"]
    state = torch.random.get_rng_state() if draws else None
    decision = da.explain(q, k, v, **kwargs)
    if draws:
        torch.random.set_rng_state(state)
    return decision


def _scaled_dot_product_attention(cls, query: RfTensor, key: RfTensor, value: RfTensor, **kwargs) -> RfTensor:
    """TorchBackend.scaled_dot_product_attention while routing is enabled."""
    patch = _patch
    return _route("rf.dot_attention", lambda: _prepare(query, key, value, **kwargs), value, kwargs["kv_spatial_dim"],
                  lambda: patch.original(query, key, value, **kwargs))


def _rel_pos_self_attention(cls, query: RfTensor, key: RfTensor, value: RfTensor, pos_emb: RfTensor, *,
                            pos_bias_u: Optional[RfTensor], pos_bias_v: Optional[RfTensor], **kwargs) -> RfTensor:
    """TorchBackend.rel_pos_self_attention while routing is enabled: RETURNN's
    Transformer-XL attention (rf.RelPosSelfAttention, rf.RelPosCausalSelfAttention) as
    dot_attention with pos_emb, pos_bias_u and pos_bias_v; pos_emb over
    pos_emb_spatial_dim (Tq + Tk - 1 rows, or the kv dim itself for a single step)."""
    patch = _patch

    def prepare():
        rel_dim = kwargs.pop("pos_emb_spatial_dim")
        try:
            c, q, k, v, call = _prepare(query, key, value, **kwargs)
        finally:
            kwargs["pos_emb_spatial_dim"] = rel_dim
        tables = [("pos_emb", pos_emb)] + [(n, x) for n, x in (("pos_bias_u", pos_bias_u), ("pos_bias_v", pos_bias_v))
                                           if x is not None]
        for name, x in tables:
            if not isinstance(x.raw_tensor, torch.Tensor) or x.raw_tensor.device != q.raw.device:
                raise _Fallback(f"{name} is not a torch tensor on the operands' device")
            if x.raw_tensor.dtype not in _FLOATS:
                raise _Fallback(f"{name} dtype {x.raw_tensor.dtype}")
            c.tensor(x, skip=None)
        query_dim = kwargs["query_spatial_dim"]
        if rel_dim != kwargs["kv_spatial_dim"]:
            if query_dim not in query.dims:
                raise _Fallback("pos_emb shifted along a query spatial dim the query lacks")
            call["query_position_dim"] = c.to_da[query_dim]
        for name, x in tables:
            call[name] = c.named(x)
        return c, q, k, v, call

    return _route("rf.RelPosSelfAttention", prepare, value, kwargs["kv_spatial_dim"],
                  lambda: patch.original_rel_pos(query, key, value, pos_emb, pos_bias_u=pos_bias_u,
                                                 pos_bias_v=pos_bias_v, **kwargs))


def _route(what: str, prepare, value: RfTensor, axis: RfDim, original) -> RfTensor:
    """One call of a routed hook: dimattn's, or ``original()`` (RETURNN's own) where
    dimattn cannot take it (counted with the reason; strict mode raises) or selects
    its reference path."""
    patch = _patch
    try:
        c, q, k, v, call = prepare()
    except _Fallback as why:
        if patch.strict:
            raise da.Error(f"[dimattn.returnn] {what} cannot run on dimattn: {why}; disable strict mode "
                           f"to run RETURNN's own implementation for such calls") from None
        _count("fallback", str(why))
        return original()
    if torch.compiler.is_compiling():
        # Traced: the op itself selects and runs (its selection is no graph input).
        out = da.dot_attention(q, k, v, **call)
        _count("routed", "compiled")
        return _returnn_tensor(out.raw, c.back(out), value)
    decision = _decision(q, k, v, call)
    if decision.kernel == "reference":
        # Forced (DIMATTN_SDPA, dimattn.force), or no fused kernel takes the call:
        # RETURNN's own implementation, whose locals RETURNN's tracers see.
        first = decision.rejected[0] if decision.rejected else None
        _count("reference", "dimattn selected its reference path" + (f" ({first.kernel}: {first.reason})" if first
                                                                      else ""))
        return original()
    traces = _traces.active
    if not traces:
        out = da.dot_attention(q, k, v, **call)
        _count("routed", decision.kernel)
        return _returnn_tensor(out.raw, c.back(out), value)
    with da.trace(capture_tensors=any(t.capture_tensors for t in traces)) as t:
        out = da.dot_attention(q, k, v, **call)
    record = t.records[-1]
    _count("routed", record.kernel)
    result = _returnn_tensor(out.raw, c.back(out), value)
    energy, weights = _traced(record, c, axis)
    for t in traces:
        t.records.append(da.AttentionTrace(record.kernel, result, *((energy, weights) if t.capture_tensors else ())))
    return result


def _sdpa_varlen_raw(**kw) -> Optional[torch.Tensor]:
    """TorchBackend.sdpa_varlen_raw while routing is enabled: RETURNN's packed backend
    hands its packed ``[tokens, heads, D]`` buffers with their sequences' starts and
    lengths (returnn/frontend/_backend.py documents the arguments) to
    dimattn.packed_attention. A call dimattn cannot take returns what RETURNN's own
    hook returns (None: RETURNN then takes its other packed paths), counted with its
    reason; so does a call whose selection is dimattn's reference path. Not recorded
    by trace()."""
    patch = _patch
    try:
        call = PackedCall(kw["query"], kw["key"], kw["value"], kw["seq_starts_q"], kw["seq_lens_q"],
                          kw["seq_starts_kv"], kw["seq_lens_kv"], kw["max_len_q"], kw["max_len_kv"],
                          causal=kw["is_causal"], dropout_p=kw["dropout_p"], scale=kw["scale"],
                          op="dimattn.returnn packed")
    except da.Error as why:
        if patch.strict:
            raise da.Error(f"[dimattn.returnn] RETURNN's packed attention cannot run on dimattn: {why}; disable "
                           f"strict mode to let RETURNN take its own packed paths for such calls") from None
        _count("fallback", f"packed: {why}")
        return patch.original_varlen(**kw)
    part = call.part
    if part is None:  # no token attends: nothing to select
        return call.run()
    decision = _decision(part.query, part.keys, part.values, part.kwargs)
    if decision.kernel == "reference":
        _count("reference", "dimattn selected its reference path (packed)")
        return patch.original_varlen(**kw)
    out = call.run()
    _count("routed", decision.kernel)
    return out


def _returnn_tensor(raw: torch.Tensor, dims: List[RfDim], value: RfTensor) -> RfTensor:
    # The result's own dtype: under torch.autocast the kernels ran in the autocast dtype, as
    # RETURNN's matmuls would.
    out = RfTensor("dot_attention", dims=dims, dtype=str(raw.dtype).replace("torch.", ""), raw_tensor=raw)
    if value.feature_dim is not None and value.feature_dim in dims:
        out.feature_dim = value.feature_dim  # as RETURNN's implementation sets it
    return out


def _traced(record: da.AttentionTrace, c: _Call, axis: RfDim):
    """A trace record's energy and weights as RETURNN Tensors over RETURNN Dims (None
    without captured tensors); the kv side of self-attention becomes a new Dim."""
    if record.energy is None:
        return None, None
    for d in record.energy.dims:
        if id(d) not in c.to_rf:
            c.to_rf[id(d)] = RfDim(record.energy.raw.shape[record.energy.axis_of(d)], name=f"{axis.name}:kv")
    return tuple(RfTensor(name, dims=c.back(x), dtype=str(x.raw.dtype).replace("torch.", ""), raw_tensor=x.raw)
                 for name, x in (("energy", record.energy), ("att_weights", record.att_weights)))
