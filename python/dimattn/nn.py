"""Attention modules over named dims as torch.nn.Modules: the C++ library's
SelfAttention, CausalSelfAttention, CrossAttention and RelPosSelfAttention (the
Conformer's, RETURNN's parameters) of frontend/include/dimattn/modules.h, over
:func:`dimattn.dot_attention`. Written twice (here and in C++); with the same
weights both give the same outputs and gradients (tests/python/test_module_parity.py).

The parameters are laid out as torch's are, so that torch and Hugging Face
checkpoints load as they are: a :class:`Linear`'s weight is ``[out_dim, in_dim]``
(torch.nn.Linear's order; the C++ Linear's named weight and RETURNN's are its
transpose), and the fused qkv weight is head-major: per head, its q, then k, then v columns (CrossAttention's kv
weight: per head, k then v). Initialisation follows the C++ modules' distributions
(U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases, U(-1, 1) for sinks and
the relative position table), drawn from torch's generator instead of a seed.
docs/python.md, "Modules".
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence, Tuple, Union

import torch

from . import _variants
from ._attention import dot_attention
from ._variants import Variants
from ._core import Dim, Error, Tensor, _dims_repr

__all__ = ["Linear", "RelativePositionBuckets", "RelativePositionBias", "relative_position_bucket",
           "standard_alibi_slopes", "State", "SelfAttention", "CausalSelfAttention", "CrossAttention",
           "RelPosSelfAttention", "relative_positional_encoding"]



# --- checks and dims ------------------------------------------------------------------

def _has(dims: Sequence[Dim], d: Dim) -> bool:
    return any(e is d for e in dims)


def _static_dim(module: str, what: str, d) -> Dim:
    if not isinstance(d, Dim) or d.size is None:
        raise Error(f"[{module}] {what} must be a static dimattn.Dim (a name and a size), got {d!r}")
    return d


def _size_of(module: str, what: str, d: Union[Dim, int]) -> int:
    """The size of a Dim or an int given for one (key_dim_total, value_dim_total)."""
    if isinstance(d, Dim) and d.size is not None:
        return d.size
    if isinstance(d, int) and not isinstance(d, bool) and d > 0:
        return d
    raise Error(f"[{module}] {what} must be a static dimattn.Dim or a positive int, got {d!r}")


def _per_head(module: str, what: str, total: Union[Dim, int], num_heads: int, name: str) -> Dim:
    size = _size_of(module, what, total)
    if size % num_heads:
        raise Error(f"[{module}] {what} {size} is not divisible by num_heads {num_heads}; give each head "
                    f"{what} / num_heads features")
    return Dim(name, size // num_heads)


def _total_dim(name: str, d: Union[Dim, int]) -> Dim:
    """The Dim given for key_dim_total or value_dim_total, or one of the size given."""
    return d if isinstance(d, Dim) else Dim(name, d)


def _check_input(module: str, what: str, x, *needed: Tuple[str, Dim]) -> None:
    """x must be a dimattn.Tensor holding each (role, dim) of ``needed``."""
    if not isinstance(x, Tensor):
        raise Error(f"[{module}] {what} must be a dimattn.Tensor (a torch tensor and its dims), got "
                    f"{type(x).__module__}.{type(x).__qualname__}; wrap it: dimattn.Tensor(raw, [dims...])")
    for role, d in needed:
        if not isinstance(d, Dim):
            raise Error(f"[{module}] {role} must be a dimattn.Dim, got {type(d).__name__}")
        if not x.has(d):
            namesake = [e for e in x.dims if e.name == d.name]
            hint = (f"; {what}'s {namesake[0]!r} has its name but is another Dim (dims match by identity: "
                    f"use the module's {role} to name that axis)" if namesake else "")
            raise Error(f"[{module}] {role} {d!r} is not in {what} {_dims_repr(x.dims)}{hint}")


def _module_variants(module: str, variants: Optional[Variants], fields: dict, causal: bool) -> Variants:
    """The module's variants (``variants`` with the keyword ``fields`` set on it):
    its scalar ones. The module's own rules: tensors are its own (per call), and a
    causal module's window looks back only (its states keep the last ``left``
    positions). The values are dot_attention's to check."""
    v = _variants.merged(variants, fields) or Variants()
    tensors = [name for name in _variants.TENSOR_FIELDS if getattr(v, name) is not None]
    if tensors:
        raise Error(f"[{module}] the variants hold the tensor(s) {', '.join(tensors)}, but a module makes its own per "
                    "call: pass alibi=, sinks= or relative_position= instead")
    window = v.window
    if causal and window is not None and window[1] not in (None, 0):
        raise Error(f"[{module}] window right is {window[1]!r} but causal attention sees no position after the "
                    f"query; pass window=({window[0]!r}, None)")
    return v


def _twin(axis: Dim, name: str) -> Dim:
    """A dim with axis's size (or lengths), for keys and values of self-attention."""
    return Dim.dynamic(name, axis.lengths) if axis.is_dynamic else Dim(name, axis.size)


def _relabel(x: Tensor, old: Dim, new: Dim) -> Tensor:
    return Tensor(x.raw, [new if d is old else d for d in x.dims])


def _extent(x: Tensor, d: Dim) -> int:
    return x.raw.shape[x.axis_of(d)]


def _lengths_over(module: str, axis: Dim, dims: Sequence[Dim], extent: int, like: torch.Tensor) -> torch.Tensor:
    """axis's lengths as an int64 torch tensor over ``dims`` (in that order,
    broadcast over those its lengths lack); a static axis: ``extent`` everywhere."""
    shape = [d.size for d in dims]
    if not axis.is_dynamic:
        return torch.full(shape, extent, dtype=torch.int64, device=like.device)
    lengths = axis.lengths
    for d in lengths.dims:
        if not _has(dims, d):
            raise Error(f"[{module}] the lengths of {axis!r} vary over {d!r}, which is not a dim of the state "
                        f"{_dims_repr(dims)}; make the state over every dim the lengths vary over")
    raw = lengths.raw_in([d for d in dims if lengths.has(d)]).to(torch.int64)
    return raw.reshape([d.size if lengths.has(d) else 1 for d in dims]).expand(shape)


# --- ALiBi and T5's relative position bias --------------------------------------------

def standard_alibi_slopes(num_heads: int) -> List[float]:
    """ALiBi's slopes for ``num_heads`` heads (Press et al., and BLOOM): for n a power
    of two 2^(-8(k+1)/n), k = 0 .. n-1; otherwise, with p the largest power of two
    below n, the p slopes for p heads, then the first n - p of the slopes for 2p heads
    that lie between those, 2^(-8(2j+1)/(2p)).

    Args:
        num_heads: a positive int.

    Returns:
        The ``num_heads`` slopes, head 0 first.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise Error(f"[standard_alibi_slopes] num_heads must be a positive int, got {num_heads!r}")
    p = 1 << (num_heads.bit_length() - 1)
    return ([2.0 ** (-8.0 * (k + 1) / p) for k in range(p)]
            + [2.0 ** (-8.0 * (2 * j + 1) / (2 * p)) for j in range(num_heads - p)])


@dataclasses.dataclass(frozen=True)
class RelativePositionBuckets:
    """T5's bucketing of relative positions: ``num_buckets`` buckets, exact ones for
    small distances, then logarithmically wider ones up to ``max_distance``."""
    num_buckets: int = 32
    max_distance: int = 128


def _buckets_per_direction(op: str, b: RelativePositionBuckets, bidirectional: bool) -> int:
    if not isinstance(b, RelativePositionBuckets):
        raise Error(f"[{op}] buckets must be a dimattn.nn.RelativePositionBuckets, got {type(b).__name__}")
    if bidirectional and not (b.num_buckets >= 4 and b.num_buckets % 2 == 0):
        raise Error(f"[{op}] num_buckets must be even and >= 4 for bidirectional buckets (half per direction), "
                    f"got {b.num_buckets}")
    if not bidirectional and b.num_buckets < 2:
        raise Error(f"[{op}] num_buckets must be >= 2 for causal buckets, got {b.num_buckets}")
    n = b.num_buckets // 2 if bidirectional else b.num_buckets
    if b.max_distance <= n // 2:
        raise Error(f"[{op}] max_distance must be > {n // 2}, the distances with an exact bucket (the log-spaced "
                    f"buckets lie between the two), got {b.max_distance}")
    return n


def relative_position_bucket(relative: int, buckets: RelativePositionBuckets, bidirectional: bool) -> int:
    """The bucket of a kv position ``relative`` positions after the query (negative:
    before it), as the C++ ``relative_position_bucket`` (docs/api.md, "Modules").

    Args:
        relative: kv position minus query position.
        buckets: the bucketing (:class:`RelativePositionBuckets`).
        bidirectional: half the buckets per direction (T5's encoder), else only
            positions before the query are told apart (its decoder).

    Returns:
        The bucket index in ``[0, buckets.num_buckets)``.
    """
    n = _buckets_per_direction("relative_position_bucket", buckets, bidirectional)
    first, distance = ((n if relative > 0 else 0), abs(relative)) if bidirectional else (0, max(-relative, 0))
    exact = n // 2
    if distance < exact:
        return first + distance
    # The nudge puts a distance on a bucket boundary into the upper bucket,
    # which rounding in log() could miss (as the C++ function does).
    k = math.log(distance / exact) / math.log(buckets.max_distance / exact) * (n - exact)
    return first + min(exact + math.floor(k + 1e-9), n - 1)


class RelativePositionBias(torch.nn.Module):
    """T5's learnable relative position bias: a scalar per (bucket, head), ``table``
    ``[buckets, heads]``, added to the energies by the bucket of the kv position
    relative to the query's. T5 shares one over all layers: assign one module's
    ``relative_position_bias`` to the others."""

    def __init__(self, heads: Dim, buckets: RelativePositionBuckets = RelativePositionBuckets(),
                 bidirectional: bool = True, *, device=None, dtype=None):
        super().__init__()
        self.heads = _static_dim("RelativePositionBias", "heads", heads)
        n = _buckets_per_direction("RelativePositionBias", buckets, bidirectional)
        self.buckets = Dim("buckets", n * (2 if bidirectional else 1))
        self.config, self.bidirectional = buckets, bidirectional
        self.table = torch.nn.Parameter(torch.empty(self.buckets.size, heads.size, device=device, dtype=dtype))
        # bucket(r) for r in [-max_distance, max_distance] (index r + max_distance):
        # every distance beyond shares the bucket of max_distance.
        reach = buckets.max_distance
        self.register_buffer("bucket_of", torch.tensor(
            [relative_position_bucket(r, buckets, bidirectional) for r in range(-reach, reach + 1)],
            dtype=torch.int64, device=device), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.uniform_(self.table, -1.0, 1.0)

    def extra_repr(self) -> str:
        return f"heads={self.heads!r}, {self.config}, bidirectional={self.bidirectional}"

    def forward(self, query_dim: Dim, kv_dim: Dim, query_offset: Optional[Tensor] = None, *,
                extents: Optional[Tuple[int, int]] = None) -> Tensor:
        """The bias ``[query_offset's dims..., query_dim, kv_dim, heads]`` for
        dot_attention's ``bias``: entry (i, j, h) = table[bucket(j - (i + offset)), h].
        ``extents``: the (query, kv) extents, needed where a dim is dynamic."""
        if query_dim is kv_dim:
            raise Error(f"[RelativePositionBias] query and kv positions are one dim {query_dim!r}; give keys and "
                        f"values a kv dim of their own")
        tq, tk = extents if extents is not None else (query_dim.size, kv_dim.size)
        if tq is None or tk is None:
            raise Error(f"[RelativePositionBias] {query_dim!r} or {kv_dim!r} is dynamic; pass extents=(query "
                        f"extent, kv extent)")
        device = self.table.device
        relative = (torch.arange(tk, device=device)[None, :] - torch.arange(tq, device=device)[:, None])
        dims: List[Dim] = [query_dim, kv_dim]
        if query_offset is not None:
            if not isinstance(query_offset, Tensor) or query_offset.raw.dtype not in (torch.int32, torch.int64):
                raise Error(f"[RelativePositionBias] query_offset must be an int32 or int64 dimattn.Tensor over "
                            f"batch dims, got {query_offset!r}")
            relative = relative - query_offset.raw.to(torch.int64)[..., None, None]
            dims = list(query_offset.dims) + dims
        reach = self.config.max_distance
        bucket = self.bucket_of[relative.clamp(-reach, reach) + reach]
        return Tensor(self.table[bucket], dims + [self.heads])


# --- the modules ------------------------------------------------------------------------

class Linear(torch.nn.Module):
    """``x {..., in_dim} -> {..., out_dim}``: ``x · weightᵀ + bias`` with ``weight``
    ``[out_dim, in_dim]`` (torch.nn.Linear's order, so that torch and Hugging Face
    checkpoints load as they are; RETURNN's and the C++ Linear's named weight is its
    transpose) and ``bias`` ``[out_dim]``, both U(-1/sqrt(in), 1/sqrt(in))."""

    def __init__(self, in_dim: Dim, out_dim: Dim, *, with_bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.in_dim = _static_dim("Linear", "in_dim", in_dim)
        self.out_dim = _static_dim("Linear", "out_dim", out_dim)
        self.weight = torch.nn.Parameter(torch.empty(out_dim.size, in_dim.size, device=device, dtype=dtype))
        if with_bias:
            self.bias = torch.nn.Parameter(torch.empty(out_dim.size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(max(self.in_dim.size, 1))
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return f"in_dim={self.in_dim!r}, out_dim={self.out_dim!r}, with_bias={self.bias is not None}"

    def forward(self, x: Tensor) -> Tensor:
        _check_input("Linear", "x", x, ("in_dim", self.in_dim))
        rest = [d for d in x.dims if d is not self.in_dim]
        y = torch.nn.functional.linear(x.raw_in(rest + [self.in_dim]), self.weight, self.bias)
        return Tensor(y, rest + [self.out_dim])


@dataclasses.dataclass
class State:
    """Keys and values ``{batch..., heads, axis, per-head dim}``. CausalSelfAttention's
    history: ``axis`` is dynamic, its lengths over the batch dims (with a window only
    each entry's last ``left`` positions); CrossAttention's encoder: its axis."""
    keys: Tensor
    values: Tensor
    axis: Dim


def _call_variants(m: "_Attention", bias: Optional[Tensor]) -> Variants:
    """The module's variants with its own tensors: ALiBi's slopes, the sinks, the bias."""
    return dataclasses.replace(m.variants, alibi_slopes=None if m.alibi_slopes is None else Tensor(m.alibi_slopes, [m.heads]),
                               sinks=None if m.sinks is None else Tensor(m.sinks, [m.heads]), bias=bias)


class _Attention(torch.nn.Module):
    """What the three modules share: heads, per-head dims, the output projection,
    dropout, the variants and sinks, and the call of dot_attention."""

    def __init__(self, in_dim: Dim, proj_dim: Dim, key_dim_total: Union[Dim, int], value_dim_total: Union[Dim, int],
                 num_heads: int, att_dropout: float, att_dropout_broadcast: bool, variants: Variants, sinks: bool,
                 factory: dict, with_bias: bool = True):
        super().__init__()
        module = type(self).__name__
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
            raise Error(f"[{module}] num_heads must be a positive int, got {num_heads!r}")
        self.in_dim = _static_dim(module, "in_dim", in_dim)
        self.proj_dim = _static_dim(module, "proj_dim", proj_dim)
        self.num_heads = num_heads
        self.heads = Dim("num_heads", num_heads)
        self.key_dim_per_head = _per_head(module, "key_dim_total", key_dim_total, num_heads, "key_dim_per_head")
        self.value_dim_per_head = _per_head(module, "value_dim_total", value_dim_total, num_heads,
                                            "value_dim_per_head")
        self.key_dim_total = _total_dim("key_dim_total", key_dim_total)
        self.value_dim_total = _total_dim("value_dim_total", value_dim_total)
        self.proj = Linear(self.value_dim_total, proj_dim, with_bias=with_bias, **factory)
        self.att_dropout, self.att_dropout_broadcast = att_dropout, att_dropout_broadcast
        self.variants = variants
        if sinks and variants.sink_off_by_one:
            raise Error(f"[{module}] sinks and sink_off_by_one are both set; the off-by-one sink is the fixed logit 0, "
                        "learnable sinks are the module's parameter: choose one")
        self.register_buffer("alibi_slopes", None, persistent=False)
        self.register_parameter("sinks", torch.nn.Parameter(torch.empty(num_heads, **factory)) if sinks else None)

    def reset_parameters(self) -> None:
        """Every parameter anew (submodules' too), from torch's generator."""
        for m in self.children():
            m.reset_parameters()
        if self.sinks is not None:
            torch.nn.init.uniform_(self.sinks, -1.0, 1.0)

    def _split_heads(self, x: Tensor, linear: Linear, parts: Sequence[Dim]) -> List[Tensor]:
        """linear(x) split head-major into {heads, parts...}: per head, each part's
        features in turn."""
        y = linear(x)
        rest = list(y.dims[:-1])
        raw = y.raw.unflatten(-1, (self.num_heads, -1))
        out, start = [], 0
        for p in parts:
            out.append(Tensor(raw[..., start:start + p.size], rest + [self.heads, p]))
            start += p.size
        return out

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, axis: Dim, bias: Optional[Tensor] = None,
                **positions) -> Tensor:
        """dot_attention with the module's dropout and variants, heads merged and projected."""
        att = dot_attention(q, k, v, key_dim=self.key_dim_per_head, axis=axis, att_dropout=self.att_dropout,
                            att_dropout_broadcast=self.att_dropout_broadcast, train=self.training, **positions,
                            variants=_call_variants(self, bias))
        rest = [d for d in att.dims if d is not self.heads and d is not self.value_dim_per_head]
        raw = att.raw_in(rest + [self.heads, self.value_dim_per_head]).flatten(-2)
        return self.proj(Tensor(raw, rest + [self.value_dim_total]))

    def extra_repr(self) -> str:
        s = (f"in_dim={self.in_dim!r}, proj_dim={self.proj_dim!r}, num_heads={self.num_heads}, "
             f"key_dim_per_head={self.key_dim_per_head.size}, value_dim_per_head={self.value_dim_per_head.size}")
        if self.att_dropout:
            s += f", att_dropout={self.att_dropout!r}"
        for f in dataclasses.fields(self.variants):
            if getattr(self.variants, f.name) not in (None, False):
                s += f", {f.name}={getattr(self.variants, f.name)!r}"
        return s + (", alibi=True" if self.alibi_slopes is not None else "")


class SelfAttention(_Attention):
    """Multi-head self-attention over named dims: ``att(x, axis)``, x ``{..., axis,
    in_dim}`` -> ``{..., axis, proj_dim}`` (full, non-causal; the dims of x in x's
    order, ``proj_dim`` last). Parameters: ``qkv`` (a :class:`Linear` ``in_dim ->
    heads * (2 * key + value per head)``, head-major), ``proj``, and with the variants
    ``sinks [heads]`` and ``relative_position_bias``; ``alibi_slopes [heads]`` is a
    buffer (constants, not in the state_dict).

    Variants: ``variants`` (a :class:`dimattn.Variants` with the scalar variants:
    ``window=(left, right)`` in kv positions per query, either side, None unbounded;
    soft-capping; ``sink_off_by_one``, the fixed logit 0), or its fields as
    keywords; the module's own tensors: ``alibi`` (the standard slopes of
    :func:`standard_alibi_slopes`), ``sinks`` (a learnable logit per head),
    ``relative_position`` (T5's bias with these :class:`RelativePositionBuckets`,
    bidirectional here, causal in CausalSelfAttention). Windows and ALiBi measure
    along ``axis``."""

    _causal = False

    def __init__(self, in_dim: Dim, proj_dim: Dim, *, key_dim_total: Union[Dim, int],
                 value_dim_total: Union[Dim, int], num_heads: int, att_dropout: float = 0.0,
                 att_dropout_broadcast: bool = False, variants: Optional[Variants] = None, alibi: bool = False,
                 sinks: bool = False, relative_position: Optional[RelativePositionBuckets] = None, device=None,
                 dtype=None, **variant_fields):
        factory = dict(device=device, dtype=dtype)
        super().__init__(in_dim, proj_dim, key_dim_total, value_dim_total, num_heads, att_dropout,
                         att_dropout_broadcast,
                         _module_variants(type(self).__name__, variants, variant_fields, self._causal), sinks, factory)
        k, v = self.key_dim_per_head.size, self.value_dim_per_head.size
        self.qkv_dim_per_head = Dim("qkv_dim_per_head", 2 * k + v)
        self.qkv = Linear(in_dim, Dim("qkv", num_heads * (2 * k + v)), **factory)
        if alibi:
            self.alibi_slopes = torch.tensor(standard_alibi_slopes(num_heads), **factory)
        self.relative_position_bias = (RelativePositionBias(self.heads, relative_position, not self._causal,
                                                            **factory) if relative_position is not None else None)
        self.reset_parameters()

    def _project_qkv(self, x: Tensor) -> List[Tensor]:
        return self._split_heads(x, self.qkv, [self.key_dim_per_head, self.key_dim_per_head, self.value_dim_per_head])

    def _position_bias(self, query: Tensor, query_dim: Dim, keys: Tensor, values: Tensor, kv_axis: Dim,
                       offset: Optional[Tensor] = None):
        """With a relative position bias: (keys, values, kv axis, bias over {query_dim,
        kv axis, heads}), query row i at kv position i + offset. In self-attention
        (kv_axis is query_dim) keys and values first get a kv dim of their own, so that
        the bias can name both positions. Without: the arguments and no bias."""
        rpb = self.relative_position_bias
        if rpb is None:
            return keys, values, kv_axis, None
        if rpb.heads.size != self.num_heads:
            raise Error(f"[{type(self).__name__}] relative_position_bias has heads {rpb.heads!r}, but the module has "
                        f"{self.num_heads}; share a bias only between modules with as many heads")
        if kv_axis is query_dim:
            kv_axis = _twin(query_dim, query_dim.name + "_kv")
            keys, values = _relabel(keys, query_dim, kv_axis), _relabel(values, query_dim, kv_axis)
        bias = rpb(query_dim, kv_axis, offset, extents=(_extent(query, query_dim), _extent(keys, kv_axis)))
        # A bias shared with another module names that module's heads.
        return keys, values, kv_axis, _relabel(bias, rpb.heads, self.heads)

    def forward(self, x: Tensor, axis: Dim) -> Tensor:
        _check_input(type(self).__name__, "x", x, ("in_dim", self.in_dim), ("axis", axis))
        q, k, v = self._project_qkv(x)
        k, v, kv_axis, bias = self._position_bias(q, axis, k, v, axis)
        positions = self._positions(axis)
        return self._attend(q, k, v, kv_axis, bias, **positions)

    def _positions(self, axis: Dim) -> dict:
        # The query's positions are `axis` (for windows and ALiBi).
        return dict(query_position_dim=axis) if self.variants.window is not None or self.alibi_slopes is not None else {}


class CausalSelfAttention(SelfAttention):
    """Causal multi-head self-attention: ``att(x, axis)`` for a full sequence (each
    position attends itself and before), ``att.step(x, state)`` for one position
    without a spatial dim, ``att.chunk(x, axis, state)`` for a chunk appended to the
    history; ``att.initial_state(batch_dims)`` is an empty history. Steps and chunks
    equal the full sequence. A ``window`` looks back only (``(left, None)``), and the
    states then keep each entry's last ``left`` positions. Otherwise as
    :class:`SelfAttention`."""

    State = State
    _causal = True

    def _positions(self, axis: Dim) -> dict:
        return dict(causal_query_spatial_dim=axis)

    def initial_state(self, batch_dims: Sequence[Dim]) -> State:
        """An empty history over ``batch_dims`` (static dims: the dims of x other than
        its axis and in_dim), on the module's device and dtype."""
        module = type(self).__name__
        batch_dims = list(batch_dims)
        for d in batch_dims:
            _static_dim(module, "each batch dim of initial_state", d)
        like = self.qkv.weight
        sizes = [d.size for d in batch_dims]
        hist = Dim.dynamic("history", Tensor(torch.zeros(sizes, dtype=torch.int64, device=like.device), batch_dims))
        dims = batch_dims + [self.heads, hist]
        return State(Tensor(like.new_zeros(sizes + [self.num_heads, 0, self.key_dim_per_head.size]),
                            dims + [self.key_dim_per_head]),
                     Tensor(like.new_zeros(sizes + [self.num_heads, 0, self.value_dim_per_head.size]),
                            dims + [self.value_dim_per_head]), hist)

    def step(self, x: Tensor, state: State) -> Tuple[Tensor, State]:
        """One position: x ``{batch..., in_dim}`` (no spatial dim) -> ``({batch...,
        proj_dim}, the state with it appended)``: a chunk of one position."""
        _check_input(type(self).__name__, "x", x, ("in_dim", self.in_dim))
        self._check_state(x, None, state)
        one = Dim("step", 1)
        y, state = self.chunk(Tensor(x.raw.unsqueeze(0), (one,) + x.dims), one, state)
        return Tensor(y.raw.select(y.axis_of(one), 0), [d for d in y.dims if d is not one]), state

    def chunk(self, x: Tensor, axis: Dim, state: State) -> Tuple[Tensor, State]:
        """A chunk appended to the history: x ``{batch..., axis, in_dim}``; position i of
        entry b attends the history and chunk positions <= i. A dynamic ``axis``
        appends each entry's own length (its first lengths[b] positions)."""
        _check_input(type(self).__name__, "x", x, ("in_dim", self.in_dim), ("axis", axis))
        batch = self._check_state(x, axis, state)
        q, k, v = self._project_qkv(x)
        keys, values, kv_axis = self._append(state, batch, k, v, axis, _extent(x, axis))
        offset = state.axis.lengths
        # The chunk's rows sit after each entry's history: the offset places them
        # for the causal mask, the window, ALiBi and the relative position bias.
        keys, values, kv_axis, bias = self._position_bias(q, axis, keys, values, kv_axis, offset)
        y = self._attend(q, keys, values, kv_axis, bias, causal_query_spatial_dim=axis, causal_offset=offset)
        window = self.variants.window
        if window is not None and window[0] is not None:
            keys, values, kv_axis = self._keep_last(keys, values, kv_axis, batch, window[0])
        return y, State(keys, values, kv_axis)

    def _check_state(self, x: Tensor, axis: Optional[Dim], state: State) -> List[Dim]:
        """The state's batch dims, which must be x's dims but axis and in_dim."""
        module = type(self).__name__
        if not isinstance(state, State):
            raise Error(f"[{module}] state must be a dimattn.nn.State (from initial_state, step or chunk), got "
                        f"{type(state).__name__}")
        batch = list(state.axis.lengths.dims)
        others = [d for d in x.dims if d is not self.in_dim and d is not axis]
        if len(others) != len(batch) or not all(_has(batch, d) for d in others):
            besides = "in_dim" if axis is None else f"axis {axis!r} and in_dim"
            raise Error(f"[{module}] x {_dims_repr(x.dims)} has the dims {_dims_repr(others)} besides {besides}, "
                        f"but the state is over {_dims_repr(batch)}; make the state with "
                        f"initial_state([{', '.join(d.name for d in others)}])")
        return batch

    def _append(self, state: State, batch: List[Dim], k: Tensor, v: Tensor, axis: Dim, extent: int):
        """The history with the chunk appended per entry: entry b holds its history's
        lengths[b] positions, then its chunk's, then padding."""
        hist = state.axis
        order_k = batch + [self.heads, hist, self.key_dim_per_head]
        order_v = batch + [self.heads, hist, self.value_dim_per_head]
        old_k, old_v = state.keys.raw_in(order_k), state.values.raw_in(order_v)
        new_k = k.raw_in(batch + [self.heads, axis, self.key_dim_per_head])
        new_v = v.raw_in(batch + [self.heads, axis, self.value_dim_per_head])
        held = old_k.shape[-2]
        before = _lengths_over(type(self).__name__, hist, batch, held, old_k)
        added = _lengths_over(type(self).__name__, axis, batch, extent, old_k)
        # Position t of entry b: its history's t while t < before[b], else the chunk's
        # t - before[b] (at `held` in the concatenation); clamped in the padding.
        t = torch.arange(held + extent, device=old_k.device)
        lo = before[..., None]
        idx = torch.where(t < lo, t, held + t - lo).clamp(max=held + extent - 1)
        gather = idx[..., None, :, None]
        keys = torch.cat([old_k, new_k], -2)
        values = torch.cat([old_v, new_v], -2)
        keys = keys.gather(-2, gather.expand(*keys.shape[:-1], keys.shape[-1]))
        values = values.gather(-2, gather.expand(*values.shape[:-1], values.shape[-1]))
        kv_axis = Dim.dynamic("history", Tensor(before + added, batch))
        return (Tensor(keys, batch + [self.heads, kv_axis, self.key_dim_per_head]),
                Tensor(values, batch + [self.heads, kv_axis, self.value_dim_per_head]), kv_axis)

    def _keep_last(self, keys: Tensor, values: Tensor, axis: Dim, batch: List[Dim], left: int):
        """The last ``left`` positions of each entry (all of a shorter one): the next
        query sees no earlier one. The result's axis has extent <= left."""
        held = _extent(keys, axis)
        if held <= left:
            return keys, values, axis
        length = axis.lengths.raw_in(batch).to(torch.int64)
        kept = length.clamp(max=left)
        hist = Dim.dynamic("history", Tensor(kept, batch))
        # Entry b keeps positions length - kept + t, t < left: within the extent,
        # as kept == left where length > left, and held > left otherwise.
        idx = (length - kept)[..., None] + torch.arange(left, device=length.device)
        out = []
        for x, feat in ((keys, self.key_dim_per_head), (values, self.value_dim_per_head)):
            raw = x.raw_in(batch + [self.heads, axis, feat])
            raw = raw.gather(-2, idx[..., None, :, None].expand(*raw.shape[:-2], left, raw.shape[-1]))
            out.append(Tensor(raw, batch + [self.heads, hist, feat]))
        return out[0], out[1], hist


class CrossAttention(_Attention):
    """Multi-head attention of a decoder over an encoder: ``state =
    att.transform_encoder(encoder, axis)`` once per sequence (encoder ``{..., axis,
    encoder_dim}``), then ``att(x, state)`` with x ``{..., in_dim}`` -> ``{...,
    proj_dim}``. x may carry dims the encoder lacks (beam, decoder time): the encoder
    state is never tiled over them. Parameters: ``query`` (``in_dim ->
    key_dim_total``), ``kv`` (``encoder_dim -> heads * (key + value per head)``,
    head-major: per head k, then v), ``proj``, and with ``sinks`` a parameter ``sinks
    [heads]``. Variants: ``variants`` (or its fields as keywords) and ``sinks``, as
    SelfAttention's; windows, ALiBi and relative positions relate query and key
    positions, which cross-attention does not have."""

    State = State

    def __init__(self, in_dim: Dim, proj_dim: Dim, *, encoder_dim: Dim, key_dim_total: Union[Dim, int],
                 value_dim_total: Union[Dim, int], num_heads: int, att_dropout: float = 0.0,
                 att_dropout_broadcast: bool = False, variants: Optional[Variants] = None, sinks: bool = False,
                 device=None, dtype=None, **variant_fields):
        factory = dict(device=device, dtype=dtype)
        v = _module_variants("CrossAttention", variants, variant_fields, False)
        if v.window is not None:
            raise Error("[CrossAttention] a window measures the distance between query and key positions, which "
                        "cross-attention does not relate (decoder vs encoder); leave window unset")
        super().__init__(in_dim, proj_dim, key_dim_total, value_dim_total, num_heads, att_dropout,
                         att_dropout_broadcast, v, sinks, factory)
        self.encoder_dim = _static_dim("CrossAttention", "encoder_dim", encoder_dim)
        k, v = self.key_dim_per_head.size, self.value_dim_per_head.size
        self.kv_dim_per_head = Dim("kv_dim_per_head", k + v)
        self.query = Linear(in_dim, self.key_dim_total, **factory)
        self.kv = Linear(encoder_dim, Dim("kv", num_heads * (k + v)), **factory)
        self.reset_parameters()

    def transform_encoder(self, encoder: Tensor, axis: Dim) -> State:
        """Keys and values of the encoder ``{..., axis, encoder_dim}``, once per sequence."""
        _check_input("CrossAttention", "encoder", encoder, ("encoder_dim", self.encoder_dim), ("axis", axis))
        keys, values = self._split_heads(encoder, self.kv, [self.key_dim_per_head, self.value_dim_per_head])
        return State(keys, values, axis)

    def forward(self, x: Tensor, state: State) -> Tensor:
        _check_input("CrossAttention", "x", x, ("in_dim", self.in_dim))
        if not isinstance(state, State):
            raise Error(f"[CrossAttention] state must be the dimattn.nn.State of transform_encoder, got "
                        f"{type(state).__name__}")
        if x.has(state.axis):
            raise Error(f"[CrossAttention] x {_dims_repr(x.dims)} has the encoder's axis {state.axis!r}; the "
                        f"decoder's positions need a dim of their own (for self-attention use SelfAttention)")
        q, = self._split_heads(x, self.query, [self.key_dim_per_head])
        return self._attend(q, state.keys, state.values, state.axis)


def relative_positional_encoding(query_extent: int, kv_extent: int, feat: int, *, device=None,
                                 dtype=None) -> torch.Tensor:
    """Transformer-XL's sinusoidal table ``[query_extent + kv_extent - 1, feat]``: row r
    encodes the relative position j - i = r - (query_extent - 1), its first half
    sin(pos / 10000^(2c / feat)), its second half the cosines (RETURNN's
    ``rf.relative_positional_encoding``).

    Args:
        query_extent, kv_extent: the positions of the query and of the keys.
        feat: the features, even.
        device, dtype: of the table (default: torch's default dtype).

    Returns:
        The table, ``[query_extent + kv_extent - 1, feat]``.
    """
    if feat % 2:
        raise Error(f"[relative_positional_encoding] feat must be even (sines, then cosines), got {feat}")
    pos = torch.arange(-(query_extent - 1), kv_extent, device=device, dtype=torch.float64)
    div = torch.exp(torch.arange(feat // 2, device=device, dtype=torch.float64) * (-2.0 * math.log(1e4) / feat))
    arg = pos[:, None] * div[None, :]
    return torch.cat([torch.sin(arg), torch.cos(arg)], -1).to(dtype or torch.get_default_dtype())


class RelPosSelfAttention(_Attention):
    """Self-attention with relative positions, Transformer-XL style (the Conformer's),
    with RETURNN's ``rf.RelPosSelfAttention`` parameters and conventions: ``att(x,
    axis)``, x ``{..., axis, in_dim}`` -> ``{..., axis, proj_dim}``; the energy of
    position i and j is scale * ((q_i + u) . k_j + (q_i + v) . p[j - i]), computed in
    dimattn's kernels from the table p (``pos_emb`` of :func:`dot_attention`), never a
    [T, T] or [T, 2T - 1] tensor.

    ``p``: the sinusoidal :func:`relative_positional_encoding` over ``in_dim`` features
    (``learnable_pos_emb``: a parameter ``learned_pos_emb [2 clipping + 1, feat]``,
    relative positions clipped to +-``learnable_pos_emb_clipping``), with
    ``pos_emb_dropout`` in training, projected by ``linear_pos`` (``in_dim ->
    key_dim_total``, or per head, no bias; with ``with_linear_pos``) and split per head
    (``separate_pos_emb_per_head``) or shared by all heads. ``pos_bias_u``,
    ``pos_bias_v`` ``[heads, key_dim_per_head]`` (``with_pos_bias``; Glorot-uniform).
    ``with_bias``: biases of ``qkv`` and ``proj``. Dropout and dims as
    :class:`SelfAttention`'s."""

    def __init__(self, in_dim: Dim, proj_dim: Dim, *, key_dim_total: Union[Dim, int],
                 value_dim_total: Union[Dim, int], num_heads: int, with_bias: bool = True,
                 with_linear_pos: bool = True, with_pos_bias: bool = True, learnable_pos_emb: bool = False,
                 learnable_pos_emb_clipping: int = 16, separate_pos_emb_per_head: bool = True,
                 pos_emb_dropout: float = 0.0, att_dropout: float = 0.1, att_dropout_broadcast: bool = False,
                 device=None, dtype=None):
        factory = dict(device=device, dtype=dtype)
        super().__init__(in_dim, proj_dim, key_dim_total, value_dim_total, num_heads, att_dropout,
                         att_dropout_broadcast, Variants(), False, factory, with_bias=with_bias)
        k, v = self.key_dim_per_head.size, self.value_dim_per_head.size
        self.qkv_dim_per_head = Dim("qkv_dim_per_head", 2 * k + v)
        self.qkv = Linear(in_dim, Dim("qkv", num_heads * (2 * k + v)), with_bias=with_bias, **factory)
        self.separate_pos_emb_per_head = separate_pos_emb_per_head
        pos_feat = self.in_dim if with_linear_pos else self.key_dim_total if separate_pos_emb_per_head \
            else self.key_dim_per_head
        self.pos_emb_feat_dim = pos_feat
        self.linear_pos = (Linear(in_dim, self.key_dim_total if separate_pos_emb_per_head else self.key_dim_per_head,
                                  with_bias=False, **factory) if with_linear_pos else None)
        if isinstance(learnable_pos_emb_clipping, bool) or not isinstance(learnable_pos_emb_clipping, int) or \
                learnable_pos_emb_clipping < 0:
            raise Error(f"[RelPosSelfAttention] learnable_pos_emb_clipping must be an int >= 0, got "
                        f"{learnable_pos_emb_clipping!r}")
        self.clipping = learnable_pos_emb_clipping
        self.learned_pos_emb = (torch.nn.Parameter(torch.empty(2 * self.clipping + 1, pos_feat.size, **factory))
                                if learnable_pos_emb else None)
        shape = (num_heads, k)
        self.pos_bias_u = torch.nn.Parameter(torch.empty(shape, **factory)) if with_pos_bias else None
        self.pos_bias_v = torch.nn.Parameter(torch.empty(shape, **factory)) if with_pos_bias else None
        self.pos_emb_dropout = pos_emb_dropout
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.learned_pos_emb is not None:
            torch.nn.init.uniform_(self.learned_pos_emb, -1.0, 1.0)
        for b in (self.pos_bias_u, self.pos_bias_v):
            if b is not None:
                torch.nn.init.xavier_uniform_(b)

    def _table(self, extent: int, rel: Dim, like: torch.Tensor) -> Tensor:
        """The projected table of a sequence of `extent` positions over rel (2 extent - 1 rows)."""
        if self.learned_pos_emb is None:
            raw = relative_positional_encoding(extent, extent, self.pos_emb_feat_dim.size, device=like.device,
                                               dtype=like.dtype)
        else:
            relative = torch.arange(-(extent - 1), extent, device=like.device)
            raw = self.learned_pos_emb[relative.clamp(-self.clipping, self.clipping) + self.clipping]
        if self.pos_emb_dropout and self.training:
            raw = torch.nn.functional.dropout(raw, self.pos_emb_dropout)
        table = Tensor(raw, [rel, self.pos_emb_feat_dim])
        if self.linear_pos is not None:
            table = self.linear_pos(table)
        if self.separate_pos_emb_per_head:
            return Tensor(table.raw.unflatten(-1, (self.num_heads, -1)).transpose(0, 1),
                          [self.heads, rel, self.key_dim_per_head])
        return Tensor(table.raw, [rel, self.key_dim_per_head])

    def forward(self, x: Tensor, axis: Dim) -> Tensor:
        _check_input("RelPosSelfAttention", "x", x, ("in_dim", self.in_dim), ("axis", axis))
        q, k, v = self._split_heads(x, self.qkv, [self.key_dim_per_head, self.key_dim_per_head,
                                                  self.value_dim_per_head])
        kv_axis = _twin(axis, axis.name + "_kv")
        k, v = _relabel(k, axis, kv_axis), _relabel(v, axis, kv_axis)
        extent = _extent(x, axis)
        rel = Dim("rel_pos", 2 * extent - 1)
        heads = lambda b: None if b is None else Tensor(b, [self.heads, self.key_dim_per_head])
        return self._attend(q, k, v, kv_axis, query_position_dim=axis, pos_emb=self._table(extent, rel, q.raw),
                            pos_bias_u=heads(self.pos_bias_u), pos_bias_v=heads(self.pos_bias_v))

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", linear_pos={self.linear_pos is not None}, "
                f"pos_bias={self.pos_bias_u is not None}, learnable_pos_emb={self.learned_pos_emb is not None}, "
                f"separate_pos_emb_per_head={self.separate_pos_emb_per_head}")
