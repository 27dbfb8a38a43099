"""The attention variants from Python (windows, soft-capping, ALiBi, sinks, bias,
mask, segments, relative positions): against the forced reference path and a plain torch implementation,
gradcheck including the sinks and the bias (summed over the dims it is broadcast
along), opcheck, torch.compile, repeated calls, and bad input."""
import dataclasses
import math

import pytest
import torch

import dimattn as da
from conftest import check_compiled_like_eager, named, opcheck_call

B, H, D, DV = 2, 3, 4, 3
SLOPES, SINKS = [0.5, 0.25, 0.125], [0.3, -1.0, 2.0]

# Each case as data: self-attention over one dim of T positions, or a query dim
# of TQ positions against a kv dim of TK; kv lengths per batch entry, causal
# offsets per entry, and the variants. A bias or mask is given by the roles of
# its dims ("batch", "heads", "q", "kv"; in self-attention "kv" is `axis`, the kv
# position); `empty_row`: a query row the mask leaves no position. Segments: ids
# SEG_SELF over [batch, time] as both sides in self-attention, else SEG_Q (int32)
# over [batch, tq] and SEG_KV over [batch, kv] (row 2 of entry 0 matches no kv id).
T, TQ, TK = 6, 3, 7
SEG_SELF = [[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 2, 2]]
SEG_Q, SEG_KV = [[0, 1, 5], [0, 0, 1]], [[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]]
ROLES = ["batch", "heads", "q", "kv"]
CASES = {
    "window_causal_self": dict(self=True, lengths=[6, 4], causal=True, window=(2, None)),
    "window_two_sided_offset": dict(offset=[2, 0], window=(1, 2)),
    "window_right_only_lengths": dict(lengths=[7, 3], window=(None, 1)),
    "softcap": dict(softcap=0.7),
    "alibi_self": dict(self=True, alibi=True),
    "alibi_causal_offset": dict(causal=True, offset=[4, 2], alibi=True),
    "sinks_lengths_empty_entry": dict(lengths=[7, 0], sinks=True),
    "off_by_one_causal_self": dict(self=True, causal=True, off_by_one=True),
    "bias_heads_q_kv": dict(bias=["kv", "heads", "q"]),
    "bias_kv": dict(bias=["kv"]),
    "bias_over_kv_position_self": dict(self=True, bias=["heads", "kv"]),
    "mask_key_padding": dict(mask=["batch", "kv"]),
    "mask_q_kv_empty_row": dict(mask=["q", "kv"], empty_row=1),
    "bias_mask_lengths": dict(lengths=[7, 4], bias=["heads", "kv"], mask=["batch", "q", "kv"], empty_row=0),
    "segments_causal_self": dict(self=True, lengths=[6, 4], causal=True, segments=True),
    "segments_cross_window": dict(offset=[2, 3], window=(3, 1), segments=True),
    "rel_pos_self_lengths": dict(self=True, lengths=[6, 4], rel_pos=True),
    "rel_pos_causal_offset": dict(causal=True, offset=[4, 2], lengths=[7, 6], rel_pos=True),
    "all": dict(causal=True, offset=[4, 2], lengths=[7, 5], window=(3, None), softcap=1.5, alibi=True, sinks=True,
                bias=["heads", "q", "kv"], mask=["batch", "q", "kv"], empty_row=2, segments=True, rel_pos=True),
}
# Relative positions (rel_pos): a table [heads, rel, feat] of tq + tk - 1 rows (row r
# is j - i = r - (tq - 1)) and pos_bias_u, pos_bias_v over [heads, feat].
LEARNABLE = ("sinks", "bias", "pos_emb", "pos_bias_u", "pos_bias_v")


def aligned(raw, roles):
    """A raw bias or mask whose axes have the roles `roles`, broadcastable to [batch,
    heads, tq, kv] (size 1 where it lacks a role)."""
    perm = sorted(range(len(roles)), key=lambda i: ROLES.index(roles[i]))
    raw, present = raw.permute(perm), [roles[i] for i in perm]
    return raw.reshape([raw.shape[present.index(r)] if r in present else 1 for r in ROLES])


class Case:
    """One case's operands and dot_attention keywords; `plain()` computes it with
    plain torch."""

    def __init__(self, name, dtype=torch.float32, requires_grad=False):
        c = self.c = CASES[name]
        self.batch, self.heads, self.feat, self.vfeat = (da.Dim("batch", B), da.Dim("heads", H), da.Dim("feat", D),
                                                         da.Dim("vfeat", DV))
        batch, heads, feat, vfeat = self.batch, self.heads, self.feat, self.vfeat
        lens = c.get("lengths")
        if c.get("self"):
            self.tq = self.kv = (da.Dim.dynamic("time", da.Tensor(torch.tensor(lens), [batch])) if lens
                                 else da.Dim("time", T))
            tq_size = tk_size = T
        else:
            self.tq = da.Dim("tq", TQ)
            self.kv = da.Dim.dynamic("kv", da.Tensor(torch.tensor(lens), [batch])) if lens else da.Dim("kv", TK)
            tq_size, tk_size = TQ, TK
        self.q = named([batch, heads, (self.tq, tq_size), feat], 1, dtype, requires_grad)
        self.k = named([batch, heads, (self.kv, tk_size), feat], 2, dtype, requires_grad)
        self.v = named([batch, heads, (self.kv, tk_size), vfeat], 3, dtype, requires_grad)
        self.slopes = da.Tensor(torch.tensor(SLOPES, dtype=dtype), [heads]) if c.get("alibi") else None
        self.sinks = (da.Tensor(torch.tensor(SINKS, dtype=dtype, requires_grad=requires_grad), [heads])
                      if c.get("sinks") else None)
        dims = {"batch": (batch, B), "heads": (heads, H), "q": (self.tq, tq_size), "kv": (self.kv, tk_size)}
        self.bias = named([dims[r] for r in c["bias"]], 4, dtype, requires_grad) if c.get("bias") else None
        self.mask = None
        if c.get("mask"):
            raw = torch.rand(*[dims[r][1] for r in c["mask"]], generator=torch.Generator().manual_seed(5)) >= 0.3
            if "empty_row" in c:
                raw.select(c["mask"].index("q"), c["empty_row"]).fill_(False)
            self.mask = da.Tensor(raw, [dims[r][0] for r in c["mask"]])
        self.qseg = self.kvseg = None
        if c.get("segments") and c.get("self"):  # one tensor as both sides
            self.qseg = self.kvseg = da.Tensor(torch.tensor(SEG_SELF), [batch, self.tq])
        elif c.get("segments"):
            self.qseg = da.Tensor(torch.tensor(SEG_Q, dtype=torch.int32), [batch, self.tq])
            self.kvseg = da.Tensor(torch.tensor(SEG_KV), [batch, self.kv])
        self.pos_emb = self.pos_bias_u = self.pos_bias_v = None
        if c.get("rel_pos"):
            rows = tq_size + tk_size - 1
            self.pos_emb = named([heads, (da.Dim("rel", rows), rows), feat], 6, dtype, requires_grad)
            self.pos_bias_u = named([heads, feat], 7, dtype, requires_grad)
            self.pos_bias_v = named([heads, feat], 8, dtype, requires_grad)
        kw = dict(key_dim=feat, axis=self.kv, window=c.get("window"), softcap=c.get("softcap"),
                  alibi_slopes=self.slopes, sinks=self.sinks, sink_off_by_one=c.get("off_by_one", False),
                  bias=self.bias, mask=self.mask, query_segments=self.qseg, kv_segments=self.kvseg,
                  pos_emb=self.pos_emb, pos_bias_u=self.pos_bias_u, pos_bias_v=self.pos_bias_v)
        if c.get("causal"):
            kw["causal_query_spatial_dim"] = self.tq
        elif c.get("window") or c.get("alibi") or c.get("rel_pos"):
            kw["query_position_dim"] = self.tq
        if c.get("offset"):
            kw["causal_offset"] = da.Tensor(torch.tensor(c["offset"]), [batch])
        self.kwargs = kw

    def learnable(self):
        """The case's learnable tensors, in the order call() takes them (LEARNABLE's)."""
        return [t for t in (getattr(self, name) for name in LEARNABLE) if t is not None]

    def call(self, q=None, k=None, v=None, *learned):
        """dot_attention, the result as raw [batch, heads, tq, vfeat]; q, k, v and the
        learnable tensors may be raw replacements (for gradcheck)."""
        kw = dict(self.kwargs)
        for key, raw in zip([name for name in LEARNABLE if kw[name] is not None], learned):
            kw[key] = da.Tensor(raw, kw[key].dims)
        out = da.dot_attention(self.q if q is None else da.Tensor(q, self.q.dims),
                               self.k if k is None else da.Tensor(k, self.k.dims),
                               self.v if v is None else da.Tensor(v, self.v.dims), **kw)
        return out.raw_in([self.batch, self.heads, self.tq, self.vfeat])

    def plain(self, bias=None, rel=None):
        """The documented semantics in plain torch, in the documented order: scale (of
        the content and relative-position terms) -> softcap -> + bias + ALiBi -> masks
        (padding, causal, window, mask, segments) -> softmax with the sink. `bias`, `rel`
        (table, u, v): raw replacements of the case's (for their gradients)."""
        c = self.c
        q, k, v = self.q.raw.detach(), self.k.raw.detach(), self.v.raw.detach()
        if c.get("rel_pos"):  # scale * ((q + u) . k_j + (q + v) . table[tq - 1 + j - i])
            table, u, pv = rel or (self.pos_emb.raw.detach(), self.pos_bias_u.raw.detach(),
                                   self.pos_bias_v.raw.detach())
            tq, tk = q.shape[2], k.shape[2]
            table = table[:, tq - 1 + torch.arange(tk)[None, :] - torch.arange(tq)[:, None]]
            e = ((q + u[None, :, None]) @ k.transpose(-1, -2)
                 + torch.einsum("bhid,hijd->bhij", q + pv[None, :, None], table)) / math.sqrt(D)
        else:
            e = q @ k.transpose(-1, -2) / math.sqrt(D)
        if c.get("softcap"):
            e = c["softcap"] * torch.tanh(e / c["softcap"])
        if c.get("bias"):
            e = e + aligned(self.bias.raw.detach() if bias is None else bias, c["bias"])
        i, j = torch.arange(q.shape[2]), torch.arange(k.shape[2])
        off = torch.tensor(c.get("offset", [0] * B))
        dist = (i[None, :, None] + off[:, None, None] - j[None, None, :])[:, None]  # i + offset - j, [B, 1, Tq, Tk]
        if c.get("alibi"):
            e = e - torch.tensor(SLOPES, dtype=e.dtype)[None, :, None, None] * dist.abs()
        allowed = torch.ones_like(e, dtype=torch.bool)
        if c.get("lengths"):
            allowed = allowed & (j < torch.tensor(c["lengths"])[:, None, None, None])
        if c.get("causal"):
            allowed = allowed & (dist >= 0)
        left, right = c.get("window") or (None, None)
        if left is not None:
            allowed = allowed & (dist <= left)
        if right is not None:
            allowed = allowed & (dist >= -right)
        if c.get("mask"):
            allowed = allowed & aligned(self.mask.raw, c["mask"])
        if c.get("segments"):
            qs, ks = self.qseg.raw.long(), self.kvseg.raw.long()
            allowed = allowed & (qs[:, None, :, None] == ks[:, None, None, :])
        e = e.masked_fill(~allowed, float("-inf"))
        if c.get("sinks") or c.get("off_by_one"):
            sink = torch.tensor(SINKS if c.get("sinks") else [0.0] * H, dtype=e.dtype)
            logits = torch.cat([e, sink[None, :, None, None].expand(*e.shape[:3], 1)], -1)
            w = torch.softmax(logits, -1)[..., :-1]  # the sink's share carries no value
        else:
            w = torch.softmax(e, -1).nan_to_num(0.0)
        return w @ v


@pytest.mark.parametrize("name", CASES)
def test_agrees_with_reference_path_and_plain_torch(name):
    case = Case(name)
    selected = case.call()
    with da.force("reference"):
        reference = case.call()
    assert not selected.isnan().any() and not reference.isnan().any()
    assert (selected - reference).abs().max() <= 1e-5
    assert (reference - case.plain()).abs().max() <= 1e-5
    if "empty_row" in case.c:  # the row the mask leaves no position gives 0
        assert selected[:, :, case.c["empty_row"]].abs().max() == 0
    # The variant acts: without it the result differs.
    plain_kwargs = dict(key_dim=case.feat, axis=case.kv)
    if case.c.get("causal"):
        plain_kwargs.update(causal_query_spatial_dim=case.tq, causal_offset=case.kwargs.get("causal_offset"))
    without = da.dot_attention(case.q, case.k, case.v, **plain_kwargs).raw_in(
        [case.batch, case.heads, case.tq, case.vfeat])
    assert (selected - without).abs().max() > 1e-3


def test_cpu_flash_runs_the_variants():
    case = Case("all")
    with da.trace(capture_tensors=False) as t:
        case.call()
    assert t.records[0].kernel == "cpu_flash"
    d = da.explain(case.q, case.k, case.v, **case.kwargs)
    assert d.kernel == "cpu_flash"
    with da.force("aten_flash_cpu,reference"):
        d = da.explain(case.q, case.k, case.v, **case.kwargs)
    # The first variant ATen's kernel lacks: the bias.
    assert d.kernel == "reference" and "bias" in {r.kernel: r.reason for r in d.rejected}["aten_flash_cpu"]


@pytest.mark.parametrize("name", ["all", "bias_mask_lengths"])
def test_new_variant_tensors_are_used_on_repeated_calls(name):
    # Eager calls without a causal offset tensor (bias_mask_lengths) reuse the
    # encoding of a call with the same dims; the tensors of slopes, sinks, bias
    # and mask are the call's own.
    case = Case(name)
    first = case.call()
    case.call()
    g = torch.Generator().manual_seed(7)
    for key in ("alibi_slopes", "sinks", "bias", "mask"):
        t = case.kwargs[key]
        if t is not None:
            raw = torch.rand(t.raw.shape, generator=g)
            case.kwargs[key] = da.Tensor(raw >= 0.5 if key == "mask" else raw, t.dims)
    second = case.call()
    with da.force("reference"):
        assert (second - case.call()).abs().max() <= 1e-5
    assert (first - second).abs().max() > 1e-3


def test_trace_energy_is_after_softcap_bias_and_alibi():
    case = Case("alibi_causal_offset")
    case.kwargs["softcap"] = 0.7
    bias = named([case.heads, case.tq, case.kv], 4)
    case.kwargs["bias"] = bias
    with da.trace() as t:
        case.call()
    r = t.records[0]
    kv = r.energy.dims[-1]
    energy = r.energy.raw_in([case.batch, case.heads, case.tq, kv])
    e = 0.7 * torch.tanh(case.q.raw @ case.k.raw.transpose(-1, -2) / math.sqrt(D) / 0.7) + bias.raw
    dist = (torch.arange(TQ)[None, :, None] + torch.tensor([4, 2])[:, None, None] - torch.arange(TK))[:, None]
    e = e - torch.tensor(SLOPES)[None, :, None, None] * dist.abs()
    assert (energy - e).abs().max() <= 1e-5


# Every variant through the selected kernel (cpu_flash); the reference path's
# own backward on the cases with sinks or a bias.
GRAD_CASES = [(name, "auto") for name in ("window_two_sided_offset", "softcap", "alibi_causal_offset",
                                          "sinks_lengths_empty_entry", "off_by_one_causal_self", "bias_heads_q_kv",
                                          "bias_kv", "bias_over_kv_position_self", "mask_q_kv_empty_row",
                                          "bias_mask_lengths", "segments_causal_self", "segments_cross_window",
                                          "rel_pos_self_lengths", "rel_pos_causal_offset", "all")]
GRAD_CASES += [(name, "reference") for name in ("sinks_lengths_empty_entry", "bias_kv", "bias_mask_lengths",
                                                "rel_pos_causal_offset", "all")]


@pytest.mark.parametrize("name,kernel", GRAD_CASES)
def test_gradcheck_float64(name, kernel):
    case = Case(name, torch.float64, requires_grad=True)
    inputs = [case.q.raw, case.k.raw, case.v.raw] + [t.raw for t in case.learnable()]  # d(sinks), d(bias) too
    with da.force(kernel):
        assert torch.autograd.gradcheck(lambda *xs: case.call(*xs), tuple(inputs))


@pytest.mark.parametrize("name", ["all", "bias_kv", "bias_over_kv_position_self", "rel_pos_self_lengths"])
def test_learnable_gradients_agree_between_kernels_and_with_plain_torch(name):
    grads = []
    for kernel in ("reference", "cpu_flash"):
        case = Case(name, torch.float64, requires_grad=True)
        with da.force(kernel):
            out = case.call()
        grads.append(torch.autograd.grad(out.sin().sum(), [t.raw for t in case.learnable()]))
    for reference, flash in zip(*grads):
        assert reference.abs().max() > 1e-3
        assert (reference - flash).abs().max() <= 2e-10
    # The bias's and the relative positions' are plain torch's, in their own
    # shapes (the bias's summed over the dims it is broadcast along).
    names = [n for n in LEARNABLE if getattr(case, n) is not None]
    if case.bias is not None:
        bias = case.bias.raw.detach().clone().requires_grad_(True)
        (want,) = torch.autograd.grad(case.plain(bias).sin().sum(), bias)
        got = grads[0][names.index("bias")]
        assert got.shape == bias.shape and (got - want).abs().max() <= 1e-10
    if case.pos_emb is not None:
        rel = [getattr(case, n).raw.detach().clone().requires_grad_(True) for n in LEARNABLE[2:]]
        want = torch.autograd.grad(case.plain(rel=rel).sin().sum(), rel)
        for name, w in zip(LEARNABLE[2:], want):
            got = grads[0][names.index(name)]
            assert got.shape == w.shape and (got - w).abs().max() <= 1e-10, name


@pytest.mark.parametrize("name", ["all", "window_causal_self", "off_by_one_causal_self", "bias_kv",
                                  "mask_key_padding"])
def test_opcheck(name):
    case = Case(name, requires_grad=True)
    tensors = [case.kwargs[key] for key in ("alibi_slopes", "sinks", "bias", "mask")]
    opcheck_call(case.q, case.k, case.v, case.kwargs, [t for t in tensors if t is not None])


class SinkLayer(torch.nn.Module):
    """A GPT-OSS style layer: learnable per-head sinks and a sliding window."""

    def __init__(self, batch, heads, time, feat):
        super().__init__()
        self.batch, self.heads, self.time, self.feat = batch, heads, time, feat
        self.sinks = torch.nn.Parameter(torch.tensor(SINKS, dtype=torch.float64))

    def forward(self, q, k, v):
        vfeat = da.Dim("vfeat", v.shape[-1])
        dims = [self.batch, self.heads, self.time, self.feat]
        out = da.dot_attention(da.Tensor(q, dims), da.Tensor(k, dims),
                               da.Tensor(v, [self.batch, self.heads, self.time, vfeat]), key_dim=self.feat,
                               axis=self.time, causal_query_spatial_dim=self.time, window=(2, None),
                               sinks=da.Tensor(self.sinks, [self.heads]))
        return out.raw_in([self.batch, self.heads, self.time, vfeat]).tanh()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_window_and_sinks(backend):
    batch, heads, time, feat = da.Dim("batch", B), da.Dim("heads", H), da.Dim("time", T), da.Dim("feat", D)
    layer = SinkLayer(batch, heads, time, feat)
    inputs = tuple(named([batch, heads, time, feat], s, torch.float64, True).raw for s in (1, 2, 3))
    check_compiled_like_eager(layer, inputs, [layer.sinks], backend)


class AllVariantsLayer(torch.nn.Module):
    """The "all" case's call as a layer whose sinks and bias are parameters."""

    def __init__(self, case):
        super().__init__()
        self.case = case
        self.sinks = torch.nn.Parameter(case.sinks.raw.detach().clone())
        self.bias = torch.nn.Parameter(case.bias.raw.detach().clone())

    def forward(self, q, k, v):
        return self.case.call(q, k, v, self.sinks, self.bias).tanh()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_every_variant_with_bias_and_mask(backend):
    case = Case("all", torch.float64, requires_grad=True)
    layer = AllVariantsLayer(case)
    check_compiled_like_eager(layer, (case.q.raw, case.k.raw, case.v.raw), [layer.sinks, layer.bias], backend)


def test_bad_variant_input_names_the_option():
    case = Case("window_causal_self")
    kw = dict(case.kwargs)

    def call(**change):
        return da.dot_attention(case.q, case.k, case.v, **{**kw, **change})

    with pytest.raises(da.Error, match=r"\[dot_attention\] window.left must be >= 0 kv positions, got -1"):
        call(window=(-1, None))
    with pytest.raises(da.Error, match=r"window.right must be >= 0 kv positions, got -2"):
        call(window=(2, -2), causal_query_spatial_dim=None, query_position_dim=case.tq)
    with pytest.raises(da.Error, match=r"window.right is 1 but causal attention"):
        call(window=(2, 1))
    with pytest.raises(da.Error, match=r"window has neither left nor right set"):
        call(window=(None, None))
    with pytest.raises(da.Error, match=r"window must be a pair \(left, right\)"):
        call(window=3)
    with pytest.raises(da.Error, match=r"window must be a pair"):
        call(window=(1.5, None))
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(da.Error, match=r"\[dot_attention\] softcap must be finite and > 0"):
            call(softcap=bad)
    with pytest.raises(da.Error, match=r"softcap must be a number"):
        call(softcap="1")
    with pytest.raises(da.Error, match=r"sinks must be a dimattn.Tensor"):
        call(sinks=torch.zeros(H))
    with pytest.raises(da.Error, match=r"alibi_slopes must be a dimattn.Tensor"):
        call(alibi_slopes=[0.5, 0.25, 0.125])
    with pytest.raises(da.Error, match=r"alibi_slopes require grad"):
        call(alibi_slopes=da.Tensor(torch.ones(H, requires_grad=True), [case.heads]))
    with pytest.raises(da.Error, match=r"sinks and sink_off_by_one are both set"):
        call(sinks=da.Tensor(torch.zeros(H), [case.heads]), sink_off_by_one=True)
    with pytest.raises(da.Error, match=r"sinks .* has dim time.* which is not a batch dim"):
        call(sinks=named([(case.tq, T)], 4))
    with pytest.raises(da.Error, match=r"a window measures distance along the query's positional dim"):
        call(causal_query_spatial_dim=None)
    with pytest.raises(da.Error, match=r"window.left must be >= 0"):
        da.explain(case.q, case.k, case.v, **{**kw, "window": (-1, None)})
    # bias and mask
    mask = da.Tensor(torch.ones(B, T, dtype=torch.bool), [case.batch, case.kv])
    with pytest.raises(da.Error, match=r"\[dot_attention\] mask must be a bool tensor \(true = may attend\).*"
                                       r"for an additive float mask pass bias"):
        call(mask=da.Tensor(mask.raw.float(), mask.dims))
    with pytest.raises(da.Error, match=r"\[dot_attention\] bias must be a floating tensor.*pass mask"):
        call(bias=mask)
    other = da.Dim("other", 2)
    with pytest.raises(da.Error, match=r"\[dot_attention\] bias \(heads\[3\], other\[2\]\) has dim other\[2\], "
                                       r"which is not a dim it may vary over"):
        call(bias=named([case.heads, other], 6))
    with pytest.raises(da.Error, match=r"mask \(batch\[2\], feat\[4\]\) has dim feat\[4\].*feature dims never"):
        call(mask=da.Tensor(torch.ones(B, D, dtype=torch.bool), [case.batch, case.feat]))
    with pytest.raises(da.Error, match=r"\[dot_attention\] bias must be a dimattn.Tensor over dims of the call, got "
                                       r"torch.Tensor"):
        call(bias=torch.zeros(H))
    with pytest.raises(da.Error, match=r"\[dot_attention\] mask must be a dimattn.Tensor over dims of the call, got "
                                       r"builtins.list"):
        call(mask=[True, False])
    with pytest.raises(da.Error, match=r"mask must be a bool tensor"):
        da.explain(case.q, case.k, case.v, **{**kw, "mask": da.Tensor(mask.raw.float(), mask.dims)})
    # segments
    ids = da.Tensor(torch.tensor(SEG_SELF), [case.batch, case.tq])
    with pytest.raises(da.Error, match=r"\[dot_attention\] query_segments is set but kv_segments is not.*"
                                       r"in self-attention pass the same \[batch, axis\] tensor as both"):
        call(query_segments=ids)
    with pytest.raises(da.Error, match=r"\[dot_attention\] kv_segments must be an int32 or int64 tensor of segment "
                                       r"ids, got Tensor\(float32.*pass mask"):
        call(query_segments=ids, kv_segments=da.Tensor(ids.raw.float(), ids.dims))
    with pytest.raises(da.Error, match=r"query_segments \(batch\[2\], feat\[4\]\) has dim feat\[4\], which is not a "
                                       r"dim it may vary over"):
        call(query_segments=da.Tensor(torch.zeros(B, D, dtype=torch.long), [case.batch, case.feat]), kv_segments=ids)


def test_variants_value_is_the_library_s_fields_and_equals_the_keywords():
    # da.Variants has exactly the C++ AttentionVariants' fields, in order.
    fields = [f.split(":")[0] for f in torch.ops.dimattn.variant_fields()]
    assert [f.name for f in dataclasses.fields(da.Variants)] == fields
    assert fields[:2] == ["window", "softcap"] and "bias" in fields and "mask" in fields
    case = Case("all", torch.float64)
    kw = dict(case.kwargs)
    variants = da.Variants(**{name: kw.pop(name) for name in fields})
    whole = da.dot_attention(case.q, case.k, case.v, variants=variants, **kw)
    one_by_one = da.dot_attention(case.q, case.k, case.v, variants=da.Variants(), **case.kwargs)
    assert whole.dims == one_by_one.dims and torch.equal(whole.raw, one_by_one.raw)
    # A keyword is set on the value passed whole.
    softer = da.dot_attention(case.q, case.k, case.v, variants=variants, softcap=0.5, **kw)
    assert not torch.equal(softer.raw, whole.raw)
    assert torch.equal(softer.raw, da.dot_attention(case.q, case.k, case.v, variants=dataclasses.replace(
        variants, softcap=0.5), **kw).raw)
    with pytest.raises(da.Error, match=r"unknown option softcapp; the variants are window, softcap"):
        da.dot_attention(case.q, case.k, case.v, softcapp=1.0, **kw)
    with pytest.raises(da.Error, match=r"variants must be a dimattn.Variants, got dict"):
        da.dot_attention(case.q, case.k, case.v, variants={"softcap": 1.0}, **kw)


@pytest.mark.parametrize("learning", ["sinks", "bias"])
def test_sinks_or_bias_alone_or_without_gradient(learning):
    # Only the sinks or the bias learn (a frozen model): the op still records
    # autograd.
    case = Case("all", torch.float64)
    t = getattr(case, learning).raw.requires_grad_(True)
    (g,) = torch.autograd.grad(case.call().sum(), t)
    assert g.abs().max() > 1e-3
    # Fixed sinks and bias, a learning query: no gradient is asked of them.
    case = Case("all", torch.float64)
    case.q.raw.requires_grad_(True)
    (g,) = torch.autograd.grad(case.call().sum(), case.q.raw)
    assert g.shape == case.q.raw.shape and not g.isnan().any()
    assert case.sinks.raw.grad is None and case.bias.raw.grad is None
