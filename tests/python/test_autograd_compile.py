"""Autograd (gradcheck in float64), torch.library.opcheck and torch.compile
(fullgraph, no graph break) through the op."""
import pytest
import torch

import dimattn as da
from dimattn._attention import op_arguments
from dimattn._call import ARGUMENT_NAMES
from conftest import named

B, H, T, D = 2, 2, 5, 4


def case(dtype=torch.float64, requires_grad=True):
    batch, heads, time, feat, vfeat = (da.Dim("batch", B), da.Dim("heads", H), da.Dim("time", T), da.Dim("feat", D),
                                       da.Dim("vfeat", 3))
    lens = da.Tensor(torch.tensor([5, 3]), [batch])
    kv = da.Dim.dynamic("kv", lens)
    q = named([batch, heads, time, feat], 1, dtype, requires_grad)
    k = named([batch, heads, (kv, T), feat], 2, dtype, requires_grad)
    v = named([batch, heads, (kv, T), vfeat], 3, dtype, requires_grad)
    return q, k, v, feat, kv, time


OPTIONS = {
    "plain": {},
    "causal_padded": {"causal": True},
    "causal_offset": {"causal": True, "offset": True},
    "scale": {"scale": 0.3},
}


def call(q, k, v, feat, kv, time, causal=False, offset=False, scale=None, **extra):
    return da.dot_attention(q, k, v, key_dim=feat, axis=kv, causal_query_spatial_dim=time if causal else None,
                            causal_offset=0 if offset else None, scale=scale, **extra)


@pytest.mark.parametrize("name", OPTIONS)
def test_gradcheck_float64(name):
    q, k, v, feat, kv, time = case()
    opts = OPTIONS[name]

    def f(qr, kr, vr):
        return call(da.Tensor(qr, q.dims), da.Tensor(kr, k.dims), da.Tensor(vr, v.dims), feat, kv, time, **opts).raw

    assert torch.autograd.gradcheck(f, (q.raw, k.raw, v.raw))


@pytest.mark.parametrize("kernel", ["reference", "cpu_flash"])
def test_gradients_with_dropout_match_between_kernels(kernel):
    q, k, v, feat, kv, time = case()
    grads = []
    for force in ("reference", kernel):
        torch.manual_seed(3)
        with da.force(force):
            out = call(q, k, v, feat, kv, time, att_dropout=0.4, train=True)
            g = torch.autograd.grad(out.raw.sin().sum(), (q.raw, k.raw, v.raw))
        grads.append(g)
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-10


@pytest.mark.parametrize("name", OPTIONS)
def test_opcheck(name):
    q, k, v, feat, kv, time = case(torch.float32)
    o = OPTIONS[name]
    op, args, kwargs = op_arguments(q, k, v, key_dim=feat, axis=kv, causal_offset=0 if o.get("offset") else None,
                                    causal_query_spatial_dim=time if o.get("causal") else None, scale=o.get("scale"))
    torch.library.opcheck(op, args, kwargs)


def test_opcheck_with_dropout_seed():
    q, k, v, feat, kv, time = case(torch.float32)
    op, args, kwargs = op_arguments(q, k, v, key_dim=feat, axis=kv, att_dropout=0.25, att_dropout_broadcast=True,
                                    train=True)
    named = dict(zip(("query", "keys", "values", *ARGUMENT_NAMES), args))
    assert named["seed"].dim() == 0 and len(named["lengths"]) == 1  # the seed and the kv lengths
    torch.library.opcheck(op, args, kwargs)


class Block(torch.nn.Module):
    """A module calling dimattn between torch ops, as a model would."""

    def __init__(self, feat, kv, time, heads_dim, batch):
        super().__init__()
        self.feat, self.kv, self.time, self.heads, self.batch = feat, kv, time, heads_dim, batch
        self.proj = torch.nn.Linear(D, D, dtype=torch.float64)

    def forward(self, q, k, v):
        vfeat = da.Dim("vfeat", v.shape[-1])
        qn = da.Tensor(self.proj(q), [self.batch, self.heads, self.time, self.feat])
        kn = da.Tensor(k, [self.batch, self.heads, self.kv, self.feat])
        vn = da.Tensor(v, [self.batch, self.heads, self.kv, vfeat])
        out = da.dot_attention(qn, kn, vn, key_dim=self.feat, axis=self.kv, causal_query_spatial_dim=self.time,
                               causal_offset=0)
        return out.raw_in([self.batch, self.heads, self.time, vfeat]).tanh()


def test_compile_fullgraph_equals_eager_with_gradients():
    q, k, v, feat, kv, time = case()
    block = Block(feat, kv, time, q.dims[1], q.dims[0])
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    outs, grads = [], []
    for m in (block, compiled):
        out = m(q.raw, k.raw, v.raw)
        grads.append(torch.autograd.grad(out.sum(), (q.raw, k.raw, v.raw, block.proj.weight)))
        outs.append(out)
    assert (outs[0] - outs[1]).abs().max() <= 1e-12
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-12


def test_compile_inductor_no_graph_break():
    q, k, v, feat, kv, time = case(torch.float32, requires_grad=False)
    block = Block(feat, kv, time, q.dims[1], q.dims[0]).float()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(q.raw, k.raw, v.raw)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(block, fullgraph=True)
    assert (compiled(q.raw, k.raw, v.raw) - block(q.raw, k.raw, v.raw)).abs().max() <= 1e-5


def test_compile_dynamic_lengths_and_sizes_without_recompiling_and_forcing_inside():
    def f(q, k, v, lens):
        B, T, H, Dh = q.shape
        batch, heads, feat = da.Dim("batch", B), da.Dim("heads", H), da.Dim("feat", Dh)
        time = da.Dim.dynamic("time", da.Tensor(lens, [batch]))
        dims = [batch, time, heads, feat]
        with da.force("reference"):
            out = da.dot_attention(da.Tensor(q, dims), da.Tensor(k, dims), da.Tensor(v, dims), key_dim=feat,
                                   axis=time, causal_query_spatial_dim=time)
        return out.raw_in(dims)

    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for t in (5, 7, 9):
        q = torch.randn(2, t, 3, 4)
        lens = torch.tensor([t, 2])
        assert (compiled(q, q, q, lens) - f(q, q, q, lens)).abs().max() <= 1e-6
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == 1


def test_eager_backward_reuses_the_forward_pass():
    # Eager calls record the torch backend's own autograd node (cpu_flash's,
    # which keeps the output and lse), so backward does not run the forward pass
    # again through the backward op, as traced calls (torch.compile) do.
    q, k, v, feat, kv, time = case(torch.float32)
    q.raw.requires_grad_(True)
    out = da.dot_attention(q, k, v, key_dim=feat, axis=kv)
    names, stack = [], [out.raw.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.append(node.name())
            stack += [n for n, _ in node.next_functions]
    assert any("FlashFunction" in n for n in names), names
    assert not any("DotAttentionFunction" in n for n in names), names
    (g,) = torch.autograd.grad(out.raw.sum(), q.raw)
    assert g.shape == q.raw.shape and g.abs().max() > 0


def test_kv_lengths_per_query_row_compiled_equals_eager_with_gradients():
    # A chunk attending a history whose lengths vary over the chunk's own time
    # dim (each query row its own kv length, one row of length 0): the traced
    # path (torch.compile, the op's own backward) gives eager's output and
    # gradients on cpu_flash, and gradcheck passes through the op.
    def f(q, k, v, lens):
        batch, heads, time, feat = (da.Dim("batch", q.shape[0]), da.Dim("heads", q.shape[1]),
                                    da.Dim("time", q.shape[2]), da.Dim("feat", q.shape[3]))
        hist = da.Dim.dynamic("hist", da.Tensor(lens, [batch, time]))
        with da.force("cpu_flash"):
            out = da.dot_attention(da.Tensor(q, [batch, heads, time, feat]), da.Tensor(k, [batch, heads, hist, feat]),
                                   da.Tensor(v, [batch, heads, hist, feat]), key_dim=feat, axis=hist)
        return out.raw_in([batch, heads, time, feat])

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, t, 3, generator=g, dtype=torch.float64, requires_grad=True) for t in (4, 5, 5))
    lens = torch.tensor([[1, 3, 5, 2], [0, 5, 4, 2]])
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    outs, grads = [], []
    for fn in (f, compiled):
        out = fn(q, k, v, lens)
        grads.append(torch.autograd.grad((out * out).sum(), (q, k, v)))
        outs.append(out)
    assert (outs[0][1, :, 0] == 0).all()  # no kv position: 0, not NaN
    assert (outs[0] - outs[1]).abs().max() <= 1e-12
    for a, b in zip(*grads):
        assert torch.isfinite(a).all() and (a - b).abs().max() <= 1e-12
    assert torch.autograd.gradcheck(lambda q, k, v: f(q, k, v, lens), (q, k, v))


def _recording_backend(seen):
    """aot_eager that records the dimattn ops of the forward and backward graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(gm, _inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "dimattn" in str(n.target))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


# Traced calls whose kernel gives each row's lse: the forward op returns the
# output and the lse, the backward op takes them (no forward pass again);
# with sinks (a block's lse would count them) or cpu_flash forced away, the
# backward op computes the forward pass again.
LSE_ROUTE = {
    "plain": ({}, True),
    "causal_dropout": ({"causal": True, "att_dropout": 0.3, "train": True}, True),
    "bias_and_rel_pos": ({"bias": "learnable", "rel_pos": True}, True),
    "sinks": ({"sinks": True}, False),
    "forced_reference": ({"force": "reference"}, False),
}


@pytest.mark.parametrize("name", LSE_ROUTE)
def test_compiled_backward_takes_the_forward_lse(name):
    opts, lse = LSE_ROUTE[name]
    q, k, v, feat, kv, time = case()
    heads = q.dims[1]
    extra = {}
    learned = []
    if opts.get("bias"):
        extra["bias"] = named([heads, time, (kv, T)], 7, requires_grad=True)
        learned.append(extra["bias"].raw)
    if opts.get("rel_pos"):
        rel = da.Dim("rel", T + T - 1)
        extra["pos_emb"] = named([heads, rel, feat], 8, requires_grad=True)
        extra["pos_bias_v"] = named([heads, feat], 9, requires_grad=True)
        extra["query_position_dim"] = time
        learned += [extra["pos_emb"].raw, extra["pos_bias_v"].raw]
    if opts.get("sinks"):
        extra["sinks"] = named([heads], 10, requires_grad=True)
        learned.append(extra["sinks"].raw)
    for key in ("att_dropout", "train"):
        if key in opts:
            extra[key] = opts[key]
    inputs = (q.raw, k.raw, v.raw, *learned)

    def f(*raws):
        with da.force(opts.get("force", "auto")):
            out = call(da.Tensor(raws[0], q.dims), da.Tensor(raws[1], k.dims), da.Tensor(raws[2], v.dims), feat, kv,
                       time, causal=opts.get("causal", False), **extra)
        return out.raw.sin()

    torch._dynamo.reset()
    seen = []
    compiled = torch.compile(f, fullgraph=True, backend=_recording_backend(seen))
    outs, grads = [], []
    for fn in (f, compiled):
        torch.manual_seed(4)  # the same dropout seed for both
        out = fn(*inputs)
        grads.append(torch.autograd.grad(out.sum(), inputs))
        outs.append(out)
    assert (outs[0] - outs[1]).abs().max() <= 1e-12
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-12
    want = (["dimattn.dot_attention_lse.default", "dimattn.dot_attention_backward.lse"] if lse else
            ["dimattn.dot_attention.full", "dimattn.dot_attention_backward.default"])
    assert [s for s in seen if "explain" not in s] == want, seen


def test_opcheck_lse_ops():
    # Internal ops, called below autograd (DotAttentionLseFunction): no gradients asked of them.
    q, k, v, feat, kv, time = case(torch.float32, requires_grad=False)
    _, args, kwargs = op_arguments(q, k, v, key_dim=feat, axis=kv, causal_query_spatial_dim=None, scale=0.4)
    lse_op = torch.ops.dimattn.dot_attention_lse.default
    torch.library.opcheck(lse_op, args, kwargs)
    out, lse = lse_op(*args, **kwargs)
    assert lse.dtype == torch.float32 and lse.shape == out.shape[:-1]
    torch.library.opcheck(torch.ops.dimattn.dot_attention_backward.lse, (torch.randn_like(out), out, lse, *args),
                          kwargs)
