"""A RETURNN-style frontend piece: a framework with its own Dim and Tensor types
calling dimattn's dot_attention. This is the integration a framework author writes.

The framework's dims are its own objects (here `FwDim`: a name and a static
size, or lengths over other dims). The adapter maps them to dimattn Dims once per
call, keyed by identity, so two framework dims with one name stay two dims (the op
gives each a unique name), and maps the result's dims back.

    python examples/python/returnn_adapter.py
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

import dimattn as da


class FwDim:
    """The framework's dim: static (`dimension`) or dynamic (`dyn_size_ext`,
    a FwTensor of lengths over other FwDims), as RETURNN's Dim."""

    def __init__(self, name: str, dimension: Optional[int] = None, dyn_size_ext: Optional["FwTensor"] = None):
        self.name, self.dimension, self.dyn_size_ext = name, dimension, dyn_size_ext


class FwTensor:
    def __init__(self, raw_tensor: torch.Tensor, dims: Sequence[FwDim]):
        self.raw_tensor, self.dims = raw_tensor, tuple(dims)


class _CallDims:
    """Framework dims -> dimattn Dims for one call, and back."""

    def __init__(self):
        self.to_da: Dict[int, da.Dim] = {}
        self.to_fw: Dict[int, FwDim] = {}

    def dim(self, d: FwDim) -> da.Dim:
        if id(d) not in self.to_da:
            if d.dyn_size_ext is not None:
                mapped = da.Dim.dynamic(d.name, self.tensor(d.dyn_size_ext))
            else:
                mapped = da.Dim(d.name, d.dimension)
            self.to_da[id(d)] = mapped
            self.to_fw[id(mapped)] = d
        return self.to_da[id(d)]

    def tensor(self, t: FwTensor) -> da.Tensor:
        return da.Tensor(t.raw_tensor, [self.dim(d) for d in t.dims])

    def back(self, t: da.Tensor) -> FwTensor:
        return FwTensor(t.raw, [self.to_fw[id(d)] for d in t.dims])


def dot_attention(query: FwTensor, keys: FwTensor, values: FwTensor, *, key_dim: FwDim, axis: FwDim,
                  att_dropout: float = 0.0, att_dropout_broadcast: bool = True,
                  causal_query_spatial_dim: Optional[FwDim] = None, causal_offset: Optional[FwTensor] = None,
                  train: bool = False) -> FwTensor:
    """The framework's attention op: its own dims in, its own dims out. `train`
    is the framework's train flag (RETURNN: run_ctx.train_flag)."""
    c = _CallDims()
    out = da.dot_attention(
        c.tensor(query), c.tensor(keys), c.tensor(values), key_dim=c.dim(key_dim), axis=c.dim(axis),
        att_dropout=att_dropout, att_dropout_broadcast=att_dropout_broadcast,
        causal_query_spatial_dim=c.dim(causal_query_spatial_dim) if causal_query_spatial_dim else None,
        causal_offset=c.tensor(causal_offset) if causal_offset else None, train=train)
    return c.back(out)


def demo() -> None:
    """What a RETURNN-style frontend passes; each case checked."""
    torch.manual_seed(0)
    B, T, D = 3, 6, 8
    batch, feat = FwDim("batch", B), FwDim("feature", D)
    lens = FwTensor(torch.tensor([6, 4, 1]), [batch])
    time = FwDim("time", dyn_size_ext=lens)

    def rand(*dims_sizes):
        return FwTensor(torch.randn(*[s for _, s in dims_sizes]), [d for d, _ in dims_sizes])

    # Causal self-attention over padded rows; values carry the key feature dim.
    x = rand((batch, B), (time, T), (feat, D))
    out = dot_attention(x, x, x, key_dim=feat, axis=time, causal_query_spatial_dim=time)
    assert out.dims == (batch, time, feat)
    assert torch.isfinite(out.raw_tensor).all()

    # Names collide, identities differ: an encoder "time" attended from a
    # decoder "time" is cross-attention, not self-attention.
    enc_time = FwDim("time", 5)
    enc = rand((batch, B), (enc_time, 5), (feat, D))
    out = dot_attention(x, enc, enc, key_dim=feat, axis=enc_time)
    assert out.dims == (batch, time, feat)

    # Single-step queries (one decoding step: no spatial dim).
    step = rand((batch, B), (feat, D))
    out = dot_attention(step, enc, enc, key_dim=feat, axis=enc_time)
    assert out.dims == (batch, feat)

    # A history dim whose length depends on batch and time (per-step state).
    hist_lens = FwTensor(torch.randint(0, 5, (B, T)), [batch, time])
    hist = FwDim("history", dyn_size_ext=hist_lens)
    mem = rand((batch, B), (time, T), (hist, 4), (feat, D))
    out = dot_attention(x, mem, mem, key_dim=feat, axis=hist)
    assert set(out.dims) == {batch, time, feat}

    # A chunk appended to a history of per-entry length: causal with offsets.
    chunk = FwDim("chunk", 2)
    q = rand((batch, B), (chunk, 2), (feat, D))
    kv_time = FwDim("kv", 7)
    kv = rand((batch, B), (kv_time, 7), (feat, D))
    offset = FwTensor(torch.tensor([5, 3, 0]), [batch])
    out = dot_attention(q, kv, kv, key_dim=feat, axis=kv_time, causal_query_spatial_dim=chunk, causal_offset=offset)
    assert out.dims == (batch, chunk, feat)

    # The train flag decides whether dropout acts.
    a = dot_attention(x, x, x, key_dim=feat, axis=time, att_dropout=0.5, train=False)
    b = dot_attention(x, x, x, key_dim=feat, axis=time, att_dropout=0.5, train=True)
    plain = dot_attention(x, x, x, key_dim=feat, axis=time)
    assert torch.equal(a.raw_tensor, plain.raw_tensor) and not torch.equal(b.raw_tensor, plain.raw_tensor)


if __name__ == "__main__":
    demo()
    print("every case ran")
