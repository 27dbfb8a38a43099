"""Helpers shared by the Python package's tests."""
import math

import pytest
import torch

import dimattn as da
from dimattn._attention import op_arguments


def named(dims, seed=0, dtype=torch.float32, requires_grad=False):
    """A unit-normal dimattn.Tensor over `dims` (sizes from the dims, or the
    padded extent given as (dim, size) pairs for dynamic dims)."""
    g = torch.Generator().manual_seed(seed)
    shape, ds = [], []
    for d in dims:
        if isinstance(d, tuple):
            d, size = d
        else:
            size = d.size
        shape.append(size)
        ds.append(d)
    raw = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return da.Tensor(raw.requires_grad_(requires_grad), ds)


def masked_attention(q, k, v, mask, scale=None):
    """Plain torch attention on [..., Tq, D] x [..., Tk, D] with a bool mask
    (True = attend) broadcast over [..., Tq, Tk]; rows without any allowed
    position give 0."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    e = (q @ k.transpose(-1, -2)) * scale
    e = e.masked_fill(~mask, float("-inf"))
    w = torch.softmax(e, -1).nan_to_num(0.0)
    return w @ v


def opcheck_call(q, k, v, kwargs, aux_inputs=()):
    """torch.library.opcheck of the dot_attention op on the call that ``dot_attention(q,
    k, v, **kwargs)`` makes (no dropout); each of the dimattn.Tensors ``aux_inputs``
    must reach the op as a tensor argument."""
    op, args, op_kwargs = op_arguments(q, k, v, **kwargs)
    for t in aux_inputs:
        assert any(a is t.raw for a in args)
    torch.library.opcheck(op, args, op_kwargs)


def check_compiled_like_eager(layer, inputs, params, backend):
    """``layer(*inputs)`` under torch.compile(fullgraph=True, backend=backend): one graph
    without a break, and the eager outputs and gradients (of the inputs and of the
    parameters ``params``, each of which must learn) to 1e-12 (float64)."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(layer)(*inputs)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    outs, grads = [], []
    for m in (layer, compiled):
        out = m(*inputs)
        grads.append(torch.autograd.grad(out.sum(), (*inputs, *params)))
        outs.append(out)
    assert (outs[0] - outs[1]).abs().max() <= 1e-12
    for g in grads[0][len(inputs):]:
        assert g.abs().max() > 1e-3  # the parameter learns
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-12


@pytest.fixture(autouse=True)
def _no_env_forcing(monkeypatch):
    monkeypatch.delenv("DIMATTN_SDPA", raising=False)
