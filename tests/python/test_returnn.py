"""dimattn.returnn against the real RETURNN package (pinned by scripts/bootstrap).

Each case builds a RETURNN model or call and runs it twice on the same inputs:
with RETURNN's own implementation of TorchBackend.scaled_dot_product_attention
and routed to dimattn (strict: a fallback would raise), comparing outputs,
their dims and feature_dim, and the gradients of the inputs (and parameters),
and asserting that each routed call ran a fused kernel. The counts of routed
and fallen-back calls of the module are printed at its end."""
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import returnn.frontend as rf
import returnn.frontend.packed as packed
from returnn.config import Config
from returnn.tensor import Dim, Tensor, batch_dim, single_step_dim
from returnn.torch.frontend import TorchBackend
from returnn.util.debug import PyTracer

import dimattn as da
import dimattn.returnn as dr

rf.select_backend_torch()

# RETURNN's own implementation, as TorchBackend resolves it without dimattn.
GENERIC = TorchBackend.scaled_dot_product_attention.__func__

GENERIC_VARLEN = TorchBackend.sdpa_varlen_raw  # the packed backend's varlen hook: RETURNN's returns None

_totals = {"routed": 0, "fallback": 0, "reference": 0, "reasons": {}, "kernels": {}}


@pytest.fixture(autouse=True)
def _each_case():
    dr.disable()
    dr.reset_stats()
    yield
    dr.disable()
    s = dr.stats()
    for k in ("routed", "fallback", "reference"):
        _totals[k] += s[k]
    for k in ("reasons", "kernels"):
        for name, n in s[k].items():
            _totals[k][name] = _totals[k].get(name, 0) + n


@pytest.fixture(scope="module", autouse=True)
def _print_counts(request):
    yield
    line = (f"dimattn.returnn over {Path(__file__).name}: routed {_totals['routed']} {_totals['kernels']}, "
            f"fallback {_totals['fallback']} (the fallback cases), reference {_totals['reference']}; "
            f"reasons {_totals['reasons']}")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        reporter.write_line("\n" + line)


# --- building RETURNN inputs -------------------------------------------------------------

def dyn(name, lengths, over):
    """A dynamic RETURNN Dim with these lengths over the dims ``over``."""
    raw = torch.tensor(lengths, dtype=torch.int32)
    return Dim(Tensor(f"{name}_lengths", list(over), "int32", raw_tensor=raw), name=name)


def extent(d):
    return d.dimension if d.dimension is not None else int(d.dyn_size_ext.raw_tensor.max())


def rand(dims, seed, dtype=torch.float32, scale=1.0):
    """A unit-normal RETURNN Tensor over ``dims`` whose raw tensor is a leaf that requires grad."""
    g = torch.Generator().manual_seed(seed)
    raw = (torch.randn(*[extent(d) for d in dims], generator=g, dtype=torch.float64) * scale).to(dtype)
    return Tensor(f"x{seed}", list(dims), str(dtype).replace("torch.", ""), raw_tensor=raw.requires_grad_())


def aligned(x, dims):
    """x's raw tensor with its axes in the order of ``dims`` (RETURNN's own transpose)."""
    assert x.dims_set == set(dims), (x.dims, dims)
    return x.copy_compatible_to_dims_raw(list(dims))


TOL = {torch.float32: 2e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2}


def run_both(fn, leaves, *, routed, tol=None):
    """fn() -> RETURNN Tensors; run with RETURNN's implementation, then routed (strict).
    Compares outputs (dims, feature_dim, values) and the gradients of ``leaves`` (raw
    torch tensors) under one random weighting of the outputs; asserts ``routed``
    calls, each on a fused kernel. Returns the routed outputs."""
    def grads(outs, order):
        g = torch.Generator().manual_seed(99)
        loss = 0
        for o, dims in zip(outs, order):
            raw = aligned(o, dims)
            loss = loss + (raw.float() * torch.randn(raw.shape, generator=g)).sum()
        return torch.autograd.grad(loss, leaves, allow_unused=True)

    ref = fn()
    order = [r.dims for r in ref]
    ref_grads = grads(ref, order)
    with dr.enabled(strict=True), da.trace(capture_tensors=False) as t:
        out = fn()
    out_grads = grads(out, order)
    assert dr.stats()["routed"] == routed and dr.stats()["fallback"] == 0, dr.stats()
    assert len(t.records) == routed and all(r.kernel != "reference" for r in t.records), [r.kernel for r in t.records]
    ref_grads = [g if g is None else g.detach() for g in ref_grads]
    for o, r in zip(out, ref):
        assert o.dims_set == r.dims_set and len(o.dims) == len(r.dims), (o, r)
        assert o.feature_dim == r.feature_dim and o.dtype == r.dtype, (o.feature_dim, r.feature_dim)
        a, b = aligned(o, r.dims).detach(), r.raw_tensor.detach()
        atol = (tol or TOL[b.dtype]) * max(1.0, float(b.abs().max()))
        assert (a.double() - b.double()).abs().max() <= atol, (o, (a.double() - b.double()).abs().max())
    for a, b in zip(out_grads, ref_grads):
        assert (a is None) == (b is None)
        if a is not None:
            atol = 2 * (tol or TOL[b.dtype]) * max(1.0, float(b.abs().max()))
            assert (a.double() - b.double()).abs().max() <= atol, (a.double() - b.double()).abs().max()
    return out


# --- rf.dot_attention ----------------------------------------------------------------------

B, H, D = 3, 2, 8


def dims_padded():
    batch, heads, feat = Dim(B, name="batch"), Dim(H, name="heads"), Dim(D, name="feat")
    return batch, heads, feat, dyn("time", [7, 4, 1], [batch])


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention(padded, causal):
    batch, heads, feat, time = dims_padded()
    if not padded:
        time = Dim(7, name="time")
    x = rand([batch, time, heads, feat], 1)
    k = rand([batch, heads, time, feat], 2)
    v = rand([batch, time, heads, feat], 3)
    v.feature_dim = feat
    run_both(lambda: [rf.dot_attention(x, k, v, key_dim=feat, axis=time,
                                       causal_query_spatial_dim=time if causal else None)],
             [x.raw_tensor, k.raw_tensor, v.raw_tensor], routed=1)


def test_causal_padded_rows_see_padded_keys():
    """RETURNN's causal attention masks j <= i only: a padded query row attends the
    padded kv positions before it too. The routed call matches that on every row."""
    batch, heads, feat, time = dims_padded()
    x = rand([batch, time, heads, feat], 4)
    (out,) = run_both(lambda: [rf.dot_attention(x, x, x, key_dim=feat, axis=time, causal_query_spatial_dim=time)],
                      [x.raw_tensor], routed=1)
    # Entry 2 has length 1: with a kv-length mask its padded row 3 would attend position
    # 0 alone and equal x there; RETURNN's row 3 attends positions 0..3.
    out_raw, x_raw = aligned(out, [batch, time, heads, feat]), aligned(x, [batch, time, heads, feat])
    assert (out_raw[2, 3] - x_raw[2, 0]).abs().max() > 1e-2


def test_causal_separate_query_dim():
    """causal_query_spatial_dim a replace_dim copy of axis (index-aligned)."""
    batch, heads, feat, time = dims_padded()
    x = rand([batch, time, heads, feat], 5)
    qtime = Dim(None, name="qtime")
    q, _ = rf.replace_dim(x, in_dim=time, out_dim=qtime)
    run_both(lambda: [rf.dot_attention(q, x, x, key_dim=feat, axis=time, causal_query_spatial_dim=qtime)],
             [x.raw_tensor], routed=1)


@pytest.mark.parametrize("padded", [False, True])
def test_cross_attention(padded):
    batch, heads, feat = Dim(B, name="batch"), Dim(H, name="heads"), Dim(D, name="feat")
    dec = dyn("dec", [5, 3, 2], [batch]) if padded else Dim(5, name="dec")
    enc = dyn("enc", [6, 9, 2], [batch]) if padded else Dim(9, name="enc")
    vfeat = Dim(5, name="vfeat")
    q = rand([batch, heads, dec, feat], 6)
    k = rand([batch, enc, heads, feat], 7)
    v = rand([batch, heads, enc, vfeat], 8)
    run_both(lambda: [rf.dot_attention(q, k, v, key_dim=feat, axis=enc)],
             [q.raw_tensor, k.raw_tensor, v.raw_tensor], routed=1)


def test_names_do_not_make_dims_equal():
    """Two RETURNN dims with one name (an encoder "time" attended from a decoder
    "time") are two dims: cross-attention, not self-attention. The values carry
    key_dim (keys as values), as in test_self_attention."""
    batch, heads, feat = Dim(B, name="batch"), Dim(H, name="heads"), Dim(D, name="feat")
    dec, enc = dyn("time", [4, 2, 3], [batch]), dyn("time", [6, 5, 1], [batch])
    assert dec != enc
    q = rand([batch, heads, dec, feat], 9)
    kv = rand([batch, heads, enc, feat], 10)
    (out,) = run_both(lambda: [rf.dot_attention(q, kv, kv, key_dim=feat, axis=enc)],
                      [q.raw_tensor, kv.raw_tensor], routed=1)
    assert out.dims_set == {batch, heads, dec, feat}


def test_dims_returnn_treats_as_one_are_one():
    """RETURNN's equality, not identity: two batch dims made separately are one dim to
    RETURNN (a batch dim of the query shared with the keys), and so to dimattn."""
    b1 = Dim(B, name="batch", kind=Dim.Types.Batch)
    b2 = Dim(B, name="batch2", kind=Dim.Types.Batch)
    assert b1 == b2 and b1 is not b2
    heads, feat, dec, enc = Dim(H, name="heads"), Dim(D, name="feat"), Dim(4, name="dec"), Dim(5, name="enc")
    q = rand([b1, heads, dec, feat], 45)
    kv = rand([b2, enc, heads, feat], 46)
    (out,) = run_both(lambda: [rf.dot_attention(q, kv, kv, key_dim=feat, axis=enc)],
                      [q.raw_tensor, kv.raw_tensor], routed=1)
    assert len(out.dims) == 4


def test_one_dim_of_changing_extent():
    """RETURNN's global batch_dim over batches of 3 and then 2 sequences (a last,
    smaller batch): the same Dim object, another extent."""
    heads, feat = Dim(H, name="heads"), Dim(D, name="feat")
    for n, lengths in ((3, [5, 2, 4]), (2, [3, 1])):
        dr.reset_stats()
        time = dyn("time", lengths, [batch_dim])
        x = Tensor("x", [batch_dim, time, heads, feat], "float32",
                   raw_tensor=torch.randn(n, max(lengths), H, D).requires_grad_())
        run_both(lambda: [rf.dot_attention(x, x, x, key_dim=feat, axis=time)], [x.raw_tensor], routed=1)


def test_beam_dims_in_the_query():
    """Beam search: query [batch, beam, dec] and a single step [batch, beam], keys
    without beam (RETURNN merges the query's own dims; keys are never tiled)."""
    batch, heads, feat = Dim(B, name="batch"), Dim(H, name="heads"), Dim(D, name="feat")
    beam, dec, enc = Dim(4, name="beam"), Dim(3, name="dec"), dyn("enc", [6, 2, 5], [batch])
    q = rand([batch, beam, dec, heads, feat], 11)
    step = rand([batch, beam, heads, feat], 12)
    kv = rand([batch, heads, enc, feat], 13)
    outs = run_both(lambda: [rf.dot_attention(q, kv, kv, key_dim=feat, axis=enc),
                             rf.dot_attention(step, kv, kv, key_dim=feat, axis=enc)],
                    [q.raw_tensor, step.raw_tensor, kv.raw_tensor], routed=2)
    assert outs[1].dims_set == {batch, beam, heads, feat}


def test_causal_with_a_beam_dim():
    """Causal self-attention of hypotheses over one shared prefix: the beam is a
    query-only dim beside the causal one."""
    batch, heads, feat, time = dims_padded()
    beam = Dim(2, name="beam")
    q = rand([batch, beam, time, heads, feat], 14)
    kv = rand([batch, time, heads, feat], 15)
    run_both(lambda: [rf.dot_attention(q, kv, kv, key_dim=feat, axis=time, causal_query_spatial_dim=time)],
             [q.raw_tensor, kv.raw_tensor], routed=1)


def test_keys_dims_not_in_the_query():
    """Keys and values over heads the query lacks: the query is broadcast."""
    batch, heads, feat = Dim(B, name="batch"), Dim(H, name="heads"), Dim(D, name="feat")
    dec, enc = Dim(4, name="dec"), dyn("enc", [6, 3, 5], [batch])
    q = rand([batch, dec, feat], 16)
    k = rand([batch, heads, enc, feat], 17)
    v = rand([batch, enc, heads, feat], 18)
    (out,) = run_both(lambda: [rf.dot_attention(q, k, v, key_dim=feat, axis=enc)],
                      [q.raw_tensor, k.raw_tensor, v.raw_tensor], routed=1)
    assert out.dims_set == {batch, dec, heads, feat}


def test_multi_query_dims():
    """Grouped queries: [batch, kv_heads, group, dec] against keys over [batch,
    kv_heads, enc] (RETURNN merges group and dec; the keys are not repeated)."""
    batch, kv_heads, feat = Dim(B, name="batch"), Dim(2, name="kv_heads"), Dim(D, name="feat")
    group, dec, enc = Dim(3, name="group"), dyn("dec", [4, 2, 3], [batch]), dyn("enc", [5, 4, 1], [batch])
    q = rand([batch, kv_heads, group, dec, feat], 21)
    kv = rand([batch, enc, kv_heads, feat], 22)
    run_both(lambda: [rf.dot_attention(q, kv, kv, key_dim=feat, axis=enc)], [q.raw_tensor, kv.raw_tensor], routed=1)


@pytest.mark.parametrize("chan_in_query", [True, False])
def test_lengths_over_several_dims(chan_in_query):
    """kv lengths over [batch, chan]: chan a batch dim of the call, or a keys-only dim
    (the query broadcast over it)."""
    batch, chan, feat = Dim(B, name="batch"), Dim(2, name="chan"), Dim(D, name="feat")
    enc = dyn("enc", [[5, 1], [3, 4], [2, 2]], [batch, chan])
    dec = Dim(3, name="dec")
    q = rand([batch, chan, dec, feat] if chan_in_query else [batch, dec, feat], 23)
    kv = rand([batch, chan, enc, feat], 24)
    run_both(lambda: [rf.dot_attention(q, kv, kv, key_dim=feat, axis=enc)], [q.raw_tensor, kv.raw_tensor], routed=1)


def test_padded_entries_of_lengths_mean_what_returnn_means():
    """Lengths over [batch, chunk], chunk itself dynamic: the lengths tensor's padded
    entries (chunk >= its length) hold 0 here; RETURNN's get_mask reads them as the
    full extent, and the routed call must too."""
    batch, feat = Dim(B, name="batch"), Dim(D, name="feat")
    chunk = dyn("chunk", [3, 2, 1], [batch])
    win = dyn("win", [[4, 2, 1], [3, 1, 0], [2, 0, 0]], [batch, chunk])
    dec = Dim(2, name="dec")
    q = rand([batch, chunk, dec, feat], 25)
    kv = rand([batch, chunk, win, feat], 26)
    run_both(lambda: [rf.dot_attention(q, kv, kv, key_dim=feat, axis=win)], [q.raw_tensor, kv.raw_tensor], routed=1)


def test_scale_and_float64_and_bfloat16():
    batch, heads, feat, time = dims_padded()
    for dtype in (torch.float64, torch.bfloat16):
        dr.reset_stats()
        x = rand([batch, time, heads, feat], 27, dtype=dtype)
        run_both(lambda: [rf.dot_attention(x, x, x, key_dim=feat, axis=time, causal_query_spatial_dim=time,
                                           scale=0.7)], [x.raw_tensor], routed=1)


# --- RETURNN's attention layers --------------------------------------------------------------

def layer_dims():
    batch, model = Dim(B, name="batch"), Dim(32, name="model")
    return batch, model, dyn("time", [9, 6, 2], [batch])


def params(layer):
    """The trainable parameters' raw tensors (not, e.g., batch norm's running statistics)."""
    return [p.raw_tensor for _, p in layer.named_parameters() if p.raw_tensor.requires_grad]


def test_self_attention_layer():
    batch, model, time = layer_dims()
    rf.set_random_seed(1)
    layer = rf.SelfAttention(model, model, key_dim_total=model, value_dim_total=model, num_heads=4, att_dropout=0.1)
    x = rand([batch, time, model], 30)
    (out,) = run_both(lambda: [layer(x, axis=time)], [x.raw_tensor, *params(layer)], routed=1)
    assert out.dims_set == {batch, time, model}


def steps(layer, x, batch, time):
    """A causal layer over x one position at a time (single_step_dim) with its state."""
    state = layer.default_initial_state(batch_dims=[batch])
    outs = []
    for t in range(extent(time)):
        y, state = layer(rf.gather(x, axis=time, indices=t), axis=single_step_dim, state=state)
        outs.append(y)
    return outs


def test_causal_self_attention_layer_steps_match_the_sequence():
    """rf.CausalSelfAttention over a padded sequence, and step by step with its state
    (rf.cum_concat_step): both routed, each equal to RETURNN's, the steps equal to
    the sequence at every position (padded ones too: causal attention includes them)."""
    batch, model, time = layer_dims()
    rf.set_random_seed(2)
    layer = rf.CausalSelfAttention(model, model, key_dim_total=model, value_dim_total=model, num_heads=4,
                                   att_dropout=0.1)
    x = rand([batch, time, model], 31)
    (full,) = run_both(lambda: [layer(x, axis=time)[0]], [x.raw_tensor, *params(layer)], routed=1)
    dr.reset_stats()
    stepped = run_both(lambda: steps(layer, x, batch, time), [x.raw_tensor, *params(layer)], routed=extent(time))
    full_raw = aligned(full, [batch, time, model])
    for t, y in enumerate(stepped):
        assert (aligned(y, [batch, model]) - full_raw[:, t]).abs().max() < 1e-5


def chunked_causal_self_attention():
    """rf.CausalSelfAttention over a sequence in two chunks, the second with the
    first's state (rf.concat of the history): returns (layer, input, time, chunk
    dims, the chunks' call)."""
    batch, model = Dim(B, name="batch"), Dim(32, name="model")
    time, c1, c2 = Dim(7, name="time"), Dim(4, name="c1"), Dim(3, name="c2")
    rf.set_random_seed(3)
    layer = rf.CausalSelfAttention(model, model, key_dim_total=model, value_dim_total=model, num_heads=4,
                                   att_dropout=0.0)
    x = rand([batch, time, model], 32)

    def chunks():
        x1, _ = rf.slice(x, axis=time, start=0, end=4, out_dim=c1)
        x2, _ = rf.slice(x, axis=time, start=4, end=7, out_dim=c2)
        y1, state = layer(x1, axis=c1)
        y2, _ = layer(x2, axis=c2, state=state)
        return [y1, y2]

    return layer, x, (batch, model, time, c1, c2), chunks


def test_causal_self_attention_layer_chunks_with_state():
    """The second chunk attends a history dim whose lengths vary over the chunk's
    time (each query row its own kv length): dimattn takes such lengths per row, so
    both chunks are routed through a fused kernel, none falls back, and every output
    equals RETURNN's and the full sequence's."""
    layer, x, (batch, model, time, c1, c2), chunks = chunked_causal_self_attention()
    full = aligned(layer(x, axis=time)[0], [batch, time, model])
    ref = chunks()
    with dr.enabled(), da.trace(capture_tensors=False) as t:
        y1, y2 = chunks()
    for a, b in zip((y1, y2), ref):
        assert (aligned(a, b.dims) - b.raw_tensor).abs().max() < 1e-5
    assert (aligned(y1, [batch, c1, model]) - full[:, :4]).abs().max() < 1e-5
    assert (aligned(y2, [batch, c2, model]) - full[:, 4:]).abs().max() < 1e-5
    assert dr.stats()["routed"] == 2 and dr.stats()["fallback"] == 0, dr.stats()
    assert len(t.records) == 2 and all(r.kernel != "reference" for r in t.records), [r.kernel for r in t.records]


# --- rf.RelPosSelfAttention: the Conformer's attention ---------------------------------------

# RETURNN's module options, as its users set them (docs/returnn.md): Transformer-XL (its
# defaults: with_bias, with_linear_pos, with_pos_bias, a table per head, sinusoidal),
# learned clipped encodings, without the linear projection (per head or shared), Shaw et
# al. (learned, shared, no biases), and no pos biases with a shared projection.
REL_POS_CONFIGS = {
    "transformer_xl": {},
    "learned_clipped": dict(learnable_pos_emb=True, learnable_pos_emb_clipping=3),
    "no_linear_pos": dict(with_linear_pos=False),
    "no_linear_pos_shared": dict(with_linear_pos=False, separate_pos_emb_per_head=False),
    "shaw": dict(with_bias=False, with_linear_pos=False, with_pos_bias=False, learnable_pos_emb=True,
                 separate_pos_emb_per_head=False),
    "no_pos_bias_shared": dict(with_pos_bias=False, separate_pos_emb_per_head=False),
}


def rel_pos_layer(cls, config, seed=4):
    batch, model, time = layer_dims()
    rf.set_random_seed(seed)
    layer = cls(model, model, key_dim_total=model, value_dim_total=model, num_heads=4, att_dropout=0.0,
                **REL_POS_CONFIGS[config])
    return layer, batch, model, time


@pytest.mark.parametrize("config", sorted(REL_POS_CONFIGS))
def test_rel_pos_self_attention_module(config):
    """rf.RelPosSelfAttention over a padded batch: one routed call on a fused kernel
    (the positional term inside its tiles), output and the gradients of the input and of
    every parameter (the projection of the table, u, v, a learned table) equal to
    RETURNN's generic rel_pos_self_attention."""
    layer, batch, model, time = rel_pos_layer(rf.RelPosSelfAttention, config)
    x = rand([batch, time, model], 33)
    run_both(lambda: [layer(x, axis=time)], [x.raw_tensor, *params(layer)], routed=1)


@pytest.mark.parametrize("config", ["transformer_xl", "learned_clipped", "shaw"])
def test_rel_pos_causal_self_attention_steps_and_chunks(config):
    """rf.RelPosCausalSelfAttention: the whole sequence (a hist dim whose lengths vary
    per query row), step by step with its state (single_step_dim: a table over the kv
    dim itself, no shift) and in two chunks (the second after the first's history):
    each routed and equal to RETURNN's; the steps equal the sequence at every position."""
    layer, batch, model, time = rel_pos_layer(rf.RelPosCausalSelfAttention, config)
    x = rand([batch, time, model], 34)
    leaves = [x.raw_tensor, *params(layer)]
    (full,) = run_both(lambda: [layer(x, axis=time)[0]], leaves, routed=1)
    dr.reset_stats()
    stepped = run_both(lambda: steps(layer, x, batch, time), leaves, routed=extent(time))
    full_raw = aligned(full, [batch, time, model])
    for t, y in enumerate(stepped):
        assert (aligned(y, [batch, model]) - full_raw[:, t]).abs().max() < 1e-5, t
    dr.reset_stats()
    c1, c2 = Dim(4, name="c1"), Dim(extent(time) - 4, name="c2")
    x_static = rand([batch, Dim(extent(time), name="t"), model], 35)
    t_dim = x_static.dims[1]

    def chunks():
        x1, _ = rf.slice(x_static, axis=t_dim, start=0, end=4, out_dim=c1)
        x2, _ = rf.slice(x_static, axis=t_dim, start=4, end=extent(time), out_dim=c2)
        y1, state = layer(x1, axis=c1)
        y2, _ = layer(x2, axis=c2, state=state)
        return [y1, y2]

    run_both(chunks, [x_static.raw_tensor, *params(layer)], routed=2)


@pytest.mark.parametrize("config", ["transformer_xl", "learned_clipped", "no_linear_pos_shared", "shaw"])
def test_nn_rel_pos_self_attention_is_returnns_module(config):
    """dimattn.nn.RelPosSelfAttention with the weights of RETURNN's RelPosSelfAttention
    (same parameters, same layouts) gives RETURNN's output over a padded batch."""
    layer, batch, model, time = rel_pos_layer(rf.RelPosSelfAttention, config, seed=9)
    x = rand([batch, time, model], 40)
    ref = aligned(layer(x, axis=time), [batch, time, model])
    opts = {k: v for k, v in REL_POS_CONFIGS[config].items() if k != "learnable_pos_emb_clipping"}
    if "learnable_pos_emb_clipping" in REL_POS_CONFIGS[config]:
        opts["learnable_pos_emb_clipping"] = REL_POS_CONFIGS[config]["learnable_pos_emb_clipping"]
    d_batch, d_model = da.Dim("batch", B), da.Dim("model", 32)
    d_time = da.Dim.dynamic("time", da.Tensor(time.dyn_size_ext.raw_tensor.long(), [d_batch]))
    ours = da.nn.RelPosSelfAttention(d_model, d_model, key_dim_total=32, value_dim_total=32, num_heads=4,
                                     att_dropout=0.0, **opts)
    theirs = dict(layer.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            src = {"learned_pos_emb": "learned_pos_emb.pos_emb"}.get(name, name)
            raw = theirs[src].raw_tensor
            # RETURNN's Linear weight is [in, out], torch's (and dimattn.nn's) [out, in].
            p.copy_(raw.t() if name.endswith(".weight") else raw)
    assert {n for n, _ in ours.named_parameters()} == {n.replace("learned_pos_emb.pos_emb", "learned_pos_emb")
                                                         for n in theirs}
    out = ours(da.Tensor(x.raw_tensor.detach(), [d_batch, d_time, d_model]), d_time)
    assert (out.raw_in([d_batch, d_time, d_model]) - ref.detach()).abs().max() < 1e-5


def conformer(num_layers=2, seed=5):
    """RETURNN's ConformerEncoder (rf.RelPosSelfAttention in each layer), dropout off."""
    from returnn.frontend.encoder.conformer import ConformerEncoder
    batch, in_dim, model, time = Dim(B, name="batch"), Dim(12, name="in"), Dim(32, name="model"), None
    time = dyn("time", [11, 7, 3], [batch])
    rf.set_random_seed(seed)
    enc = ConformerEncoder(in_dim, model, ff_dim=Dim(64, name="ff"), num_layers=num_layers, input_layer=None,
                           num_heads=4, dropout=0.0, att_dropout=0.0)
    return enc, batch, in_dim, model, time


def test_conformer_encoder_training_step_routed():
    """A 2-layer ConformerEncoder over a padded batch, forward and backward: both
    attention calls routed on a fused kernel; output and every parameter's gradient equal
    to RETURNN's generic path."""
    enc, batch, in_dim, model, time = conformer()
    x = rand([batch, time, in_dim], 36)
    run_both(lambda: [enc(x, in_spatial_dim=time)[0]], [x.raw_tensor, *params(enc)], routed=2)


def test_amp_bfloat16_step_routed():
    """Under torch.autocast (RETURNN's torch_amp = "bfloat16"): the Conformer's calls run
    dimattn's kernels in bfloat16 (the op's autocast rule), none falls back, and the
    step's output and gradients agree with RETURNN's generic path under the same
    autocast within bfloat16's tolerance."""
    enc, batch, in_dim, model, time = conformer()
    x = rand([batch, time, in_dim], 37)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run_both(lambda: [enc(x, in_spatial_dim=time)[0]], [x.raw_tensor, *params(enc)], routed=2, tol=6e-2)
    assert set(dr.stats()["kernels"]) == {"cpu_flash"}, dr.stats()


def test_static_traceable_regime_routed():
    """RETURNN's static-traceable (bound-shape) regime (dims declare a capacity):
    rf.SelfAttention and rf.RelPosSelfAttention routed, equal to RETURNN's there."""
    batch, model = Dim(B, name="batch"), Dim(32, name="model")
    raw = torch.tensor([9, 6, 2], dtype=torch.int32)
    time = Dim(Tensor("time_lengths", [batch], "int32", raw_tensor=raw), name="time", capacity=9)
    rf.set_random_seed(6)
    att = rf.SelfAttention(model, model, key_dim_total=model, value_dim_total=model, num_heads=4, att_dropout=0.0)
    rel = rf.RelPosSelfAttention(model, model, key_dim_total=model, value_dim_total=model, num_heads=4,
                                 att_dropout=0.0)
    x = rand([batch, time, model], 38)
    with rf.set_static_traceable_ctx():
        run_both(lambda: [att(x, axis=time), rel(x, axis=time)], [x.raw_tensor, *params(att), *params(rel)],
                 routed=2)


def test_compiled_module_routed():
    """rf.RelPosSelfAttention inside torch.compile: routed (the op is compile-safe),
    counted as compiled, equal to RETURNN's uncompiled output."""
    layer, batch, model, time = rel_pos_layer(rf.RelPosSelfAttention, "transformer_xl", seed=8)
    x = rand([batch, time, model], 39)
    ref = layer(x, axis=time)
    torch._dynamo.reset()
    with dr.enabled(strict=True):
        out = torch.compile(lambda raw: layer(Tensor("x", x.dims, "float32", raw_tensor=raw), axis=time).raw_tensor,
                            dynamic=False)(x.raw_tensor)
    assert dr.stats()["fallback"] == 0 and dr.stats()["routed"] >= 1, dr.stats()
    assert (out - ref.raw_tensor).abs().max() < 1e-5


# --- dropout -------------------------------------------------------------------------------

def one_hot_values(batch, heads, dec, kv, p):
    """Zero queries (uniform weights) and one-hot values: output * kv * (1 - p) is the
    dropout mask itself, over [batch, heads, dec, kv]."""
    vfeat = Dim(extent(kv), name="vfeat")
    q = Tensor("q", [batch, heads, dec, FEAT], "float32", raw_tensor=torch.zeros(B, H, extent(dec), D))
    k = Tensor("k", [batch, heads, kv, FEAT], "float32", raw_tensor=torch.randn(B, H, extent(kv), D))
    eye = torch.eye(extent(kv)).expand(B, H, -1, -1).contiguous()
    v = Tensor("v", [batch, heads, kv, vfeat], "float32", raw_tensor=eye)

    def mask(out):
        return aligned(out, [batch, heads, dec, vfeat]) * extent(kv) * (1 - p)

    return q, k, v, mask


FEAT = Dim(D, name="feat")


@pytest.mark.parametrize("broadcast", [False, True])
def test_dropout_statistics(broadcast):
    """In training (RETURNN's train flag), routed attention drops weights with
    probability p, as RETURNN's implementation does; with att_dropout_broadcast one
    mask over the kv axis is shared by every other dim, as in RETURNN."""
    batch, heads = Dim(B, name="batch"), Dim(H, name="heads")
    dec, kv = Dim(16, name="dec"), Dim(1024, name="kv")
    p = 0.3
    q, k, v, mask = one_hot_values(batch, heads, dec, kv, p)
    rf.set_random_seed(7)
    with rf.get_run_ctx().train_flag_ctx(True):
        ref = mask(rf.dot_attention(q, k, v, key_dim=FEAT, axis=kv, att_dropout=p, att_dropout_broadcast=broadcast))
        with dr.enabled(strict=True), da.trace(capture_tensors=False) as t:
            out = mask(rf.dot_attention(q, k, v, key_dim=FEAT, axis=kv, att_dropout=p,
                                        att_dropout_broadcast=broadcast))
    assert t.records[0].kernel != "reference" and dr.stats()["routed"] == 1
    for m in (ref, out):
        assert torch.allclose(m, m.round(), atol=1e-4) and set(m.round().unique().tolist()) <= {0.0, 1.0}
        dropped = 1 - m.round().mean().item()
        assert abs(dropped - p) < (0.06 if broadcast else 0.01), dropped
        shared = bool((m.round() == m.round()[:1, :1, :1]).all())
        assert shared == broadcast
    assert not torch.equal(out.round(), ref.round())  # another generator, another mask


def test_dropout_reproducible_with_set_random_seed():
    """rf.set_random_seed reproduces a routed training step exactly (outputs and
    gradients); another seed gives another mask; without RETURNN's train flag no
    dropout acts; and the fused kernel's mask is the reference path's (dimattn's
    trace runs that) for the same seed."""
    batch, model, time = layer_dims()
    rf.set_random_seed(5)
    layer = rf.CausalSelfAttention(model, model, key_dim_total=model, value_dim_total=model, num_heads=4,
                                   att_dropout=0.2, att_dropout_broadcast=False)
    x = rand([batch, time, model], 34)

    def step(seed, train=True, traced=False):
        rf.set_random_seed(seed)
        with rf.get_run_ctx().train_flag_ctx(train), dr.enabled(strict=True):
            if traced:
                with dr.trace():
                    out, _ = layer(x, axis=time)
            else:
                out, _ = layer(x, axis=time)
        raw = aligned(out, [batch, time, model])
        return raw.detach(), torch.autograd.grad(raw.square().sum(), [x.raw_tensor, *params(layer)])

    a, b, c, ref = step(1), step(1), step(2), step(1, traced=True)
    assert torch.equal(a[0], b[0]) and all(torch.equal(g, h) for g, h in zip(a[1], b[1]))
    assert (a[0] - c[0]).abs().max() > 1e-2
    assert (a[0] - ref[0]).abs().max() < 1e-5 and all((g - h).abs().max() < 1e-4 for g, h in zip(a[1], ref[1]))
    # The same call made directly on dimattn with the same seed: the same mask (the
    # integration draws from torch's generator exactly as dimattn.dot_attention does).
    rf.set_random_seed(6)
    with rf.get_run_ctx().train_flag_ctx(True), dr.enabled(strict=True):
        routed = rf.dot_attention(x, x, x, key_dim=model, axis=time, att_dropout=0.5, att_dropout_broadcast=False)
    b_, t_, m_ = da.Dim("b", B), da.Dim("t", extent(time)), da.Dim("m", 32)
    t_ = da.Dim.dynamic("t", da.Tensor(time.dyn_size_ext.raw_tensor, [b_]))
    xd = da.Tensor(aligned(x, [batch, time, model]), [b_, da.Dim("q", extent(time)), m_])
    kd = da.Tensor(aligned(x, [batch, time, model]), [b_, t_, m_])
    torch.manual_seed(6)
    direct = da.dot_attention(xd, kd, kd, key_dim=m_, axis=t_, att_dropout=0.5, train=True)
    assert torch.equal(aligned(routed, [batch, time, model]), direct.raw)
    off = step(1, train=False)[0]
    rf.set_random_seed(1)
    assert (off - aligned(layer(x, axis=time)[0], [batch, time, model])).abs().max() < 1e-5
    assert dr.stats()["kernels"]["reference"] == 1 and dr.stats()["routed"] == 6


# --- fallbacks, strict mode, enabling --------------------------------------------------------

def call_hook(q, k, v, feat, axis, **kwargs):
    """TorchBackend's hook called as rf.dot_attention calls it, with extra arguments."""
    args = dict(att_dropout=0.0, att_dropout_broadcast=False, v_feat_dim=feat, qk_feat_dim=feat,
                kv_spatial_dim=axis, query_spatial_dim=kwargs.pop("query_spatial_dim"))
    args.update(kwargs)
    return TorchBackend.scaled_dot_product_attention(q, k, v, **args)


def test_fallbacks_are_counted_with_their_reason_and_strict_raises():
    batch, heads, feat = Dim(B, name="batch"), Dim(H, name="heads"), Dim(D, name="feat")
    dec, enc = Dim(3, name="dec"), dyn("enc", [4, 2, 3], [batch])
    q = rand([batch, heads, dec, feat], 40)
    kv = rand([batch, heads, enc, feat], 41)
    bias = rand([batch, heads, dec, enc], 42)
    flag = Tensor("train", [], "bool", raw_tensor=torch.tensor(True))
    ref = call_hook(q, kv, kv, feat, enc, query_spatial_dim=dec, attention_mask=bias)
    with dr.enabled():
        out = call_hook(q, kv, kv, feat, enc, query_spatial_dim=dec, attention_mask=bias)
        with rf.get_run_ctx().train_flag_ctx(flag):
            call_hook(q, kv, kv, feat, enc, query_spatial_dim=dec, att_dropout=0.1)
    assert torch.equal(aligned(out, ref.dims), ref.raw_tensor)
    s = dr.stats()
    assert s["routed"] == 0 and s["fallback"] == 2, s
    assert s["reasons"] == {"attention_mask": 1, "the train flag is a tensor": 1}
    with dr.enabled(strict=True), pytest.raises(da.Error, match=r"\[dimattn.returnn\].*attention_mask"):
        call_hook(q, kv, kv, feat, enc, query_spatial_dim=dec, attention_mask=bias)


def test_an_argument_of_a_newer_returnn_falls_back():
    """A hook argument the module does not know (as a newer RETURNN might pass) runs
    what TorchBackend had before: here an override that takes it."""
    batch, feat, dec, enc = Dim(B, name="batch"), Dim(D, name="feat"), Dim(3, name="dec"), Dim(4, name="enc")
    q, kv = rand([batch, dec, feat], 47), rand([batch, enc, feat], 48)
    TorchBackend.scaled_dot_product_attention = classmethod(
        lambda cls, *args, window=None, **kwargs: GENERIC(cls, *args, **kwargs))
    try:
        ref = call_hook(q, kv, kv, feat, enc, query_spatial_dim=dec, window=2)
        with dr.enabled():
            out = call_hook(q, kv, kv, feat, enc, query_spatial_dim=dec, window=2)
    finally:
        del TorchBackend.scaled_dot_product_attention
    assert torch.equal(out.raw_tensor, ref.raw_tensor)
    assert dr.stats()["reasons"] == {"arguments it does not know: window": 1}


def test_enable_disable_restore_exactly_what_was_there():
    assert "scaled_dot_product_attention" not in TorchBackend.__dict__  # inherited from RETURNN's Backend
    with dr.enabled():
        assert dr.is_enabled() and TorchBackend.scaled_dot_product_attention.__func__ is not GENERIC
        with dr.enabled(strict=True):
            assert dr.is_strict()
        assert dr.is_enabled() and not dr.is_strict()  # the outer scope's routing stays
    assert not dr.is_enabled() and "scaled_dot_product_attention" not in TorchBackend.__dict__
    assert TorchBackend.scaled_dot_product_attention.__func__ is GENERIC
    assert "sdpa_varlen_raw" not in TorchBackend.__dict__ and TorchBackend.sdpa_varlen_raw is GENERIC_VARLEN

    own = classmethod(lambda cls, *a, **kw: GENERIC(cls, *a, **kw))  # a backend's own override
    TorchBackend.scaled_dot_product_attention = own
    try:
        dr.enable()
        dr.disable()
        assert TorchBackend.__dict__["scaled_dot_product_attention"] is own
    finally:
        del TorchBackend.scaled_dot_product_attention


# --- packed operands (rf.pack): the packed backend's varlen hook -------------------------------

def packed_dims(lengths, heads=H):
    batch, hd, feat = Dim(len(lengths), name="batch"), Dim(heads, name="heads"), Dim(D, name="feat")
    return batch, hd, feat, dyn("time", lengths, [batch])


def pack_like(x, first, dims):
    """x packed over ``dims`` sharing ``first``'s packing (one packed dim: RETURNN's
    varlen path takes key and value only when they share it)."""
    return rf.pack(x, dims=dims, out_dim=None if first is None else first.raw_tensor.packed_dim)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[7, 4, 1], [1], [5, 0, 9]], ids=["mixed", "one", "with_empty"])
def test_packed_self_attention_runs_on_dimattn(lengths, causal):
    """rf.dot_attention over packed q, k, v (RETURNN's packed backend) calls
    TorchBackend.sdpa_varlen_raw, which RETURNN's torch backend leaves without a kernel
    (on the CPU it then has no packed path at all). Routed, it runs dimattn's fused
    kernel; unpacked, the output and the gradients equal RETURNN's own attention over
    the padded tensors."""
    batch, heads, feat, time = packed_dims(lengths)
    x, k, v = (rand([batch, time, heads, feat], seed) for seed in (11, 12, 13))
    ref = rf.dot_attention(x, k, v, key_dim=feat, axis=time, causal_query_spatial_dim=time if causal else None)
    leaves = [x.raw_tensor, k.raw_tensor, v.raw_tensor]
    with dr.enabled(strict=True):
        xp = pack_like(x, None, [batch, time])
        kp, vp = pack_like(k, xp, [batch, time]), pack_like(v, xp, [batch, time])
        out = rf.dot_attention(xp, kp, vp, key_dim=feat, axis=time, causal_query_spatial_dim=time if causal else None)
        assert packed.is_packed(out)
        out = packed.unpack(out)
    assert dr.stats()["routed"] == 1 and dr.stats()["kernels"] == {"cpu_flash": 1}, dr.stats()
    order = [batch, time, heads, feat]
    mask = aligned(time.get_mask(), [batch, time])[:, :, None, None]
    a, b = torch.where(mask, aligned(out, order), 0), torch.where(mask, aligned(ref, order), 0)
    assert (a - b).abs().max() <= TOL[torch.float32], (a - b).abs().max()
    g = torch.randn(a.shape, generator=torch.Generator().manual_seed(5))
    for ga, gb in zip(torch.autograd.grad((a * g).sum(), leaves), torch.autograd.grad((b * g).sum(), leaves)):
        # RETURNN's padded attention gives NaN gradients to a sequence of length 0 (a
        # softmax over nothing); dimattn's are 0 there, and finite everywhere.
        defined = torch.isfinite(gb)
        assert torch.isfinite(ga).all() and (ga[~defined] == 0).all()
        assert (ga - gb)[defined].abs().max() <= 2 * TOL[torch.float32]


def test_packed_hook_fallback_and_strict():
    """A call the varlen hook cannot take (here: heads not a multiple of the kv heads)
    returns what RETURNN's own hook returns (None, so RETURNN takes its other packed
    paths), counted with its reason; strict mode raises instead."""
    args = dict(query=torch.randn(5, 3, 4), key=torch.randn(5, 2, 4), value=torch.randn(5, 2, 4),
                seq_starts_q=torch.tensor([0, 2], dtype=torch.int32), seq_lens_q=torch.tensor([2, 3], dtype=torch.int32),
                seq_starts_kv=torch.tensor([0, 2], dtype=torch.int32), seq_lens_kv=torch.tensor([2, 3], dtype=torch.int32),
                max_len_q=3, max_len_kv=3, is_causal=False, dropout_p=0.0, scale=0.5)
    with dr.enabled():
        assert TorchBackend.sdpa_varlen_raw(**args) is None
    s = dr.stats()
    assert s["fallback"] == 1 and any("multiple of key's 2 heads" in r for r in s["reasons"]), s
    with dr.enabled(strict=True), pytest.raises(da.Error, match="packed attention cannot run on dimattn"):
        TorchBackend.sdpa_varlen_raw(**args)
    args["key"], args["value"] = torch.randn(5, 3, 4), torch.randn(5, 3, 4)
    with dr.enabled(strict=True):
        out = TorchBackend.sdpa_varlen_raw(**args)
    assert out.shape == (5, 3, 4) and dr.stats()["routed"] == 1


# --- forcing and tracing -----------------------------------------------------------------------

@pytest.mark.parametrize("how", ["force", "env"])
def test_forced_reference_runs_returnns_implementation_for_its_tracers(how, monkeypatch):
    """DIMATTN_SDPA=reference or dimattn.force("reference"): the integration calls
    RETURNN's own implementation, so RETURNN's PyTracer sees its energy and weights."""
    batch, heads, feat, time = dims_padded()
    x = rand([batch, time, heads, feat], 43)
    if how == "env":
        monkeypatch.setenv("DIMATTN_SDPA", "reference")
    with dr.enabled(strict=True), (da.force("reference") if how == "force" else _nothing()), \
            PyTracer([GENERIC], Tensor) as tracer:
        rf.dot_attention(x, x, x, key_dim=feat, axis=time, causal_query_spatial_dim=time)
    seen = tracer.captured_locals[GENERIC][0]
    assert "energy" in seen and "att_weights" in seen
    s = dr.stats()
    assert s["reference"] == 1 and s["routed"] == 0 and s["fallback"] == 0
    (reason,) = s["reasons"]
    assert reason.startswith("dimattn selected its reference path (") and "forced" in reason, reason


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_trace_gives_returnn_tensors_over_returnn_dims():
    """dimattn.returnn.trace(): energy and weights of a routed call as RETURNN
    Tensors, equal to what RETURNN's implementation computes (seen by PyTracer)."""
    batch, heads, feat, time = dims_padded()
    x = rand([batch, time, heads, feat], 44)
    with PyTracer([GENERIC], Tensor) as tracer:
        rf.dot_attention(x, x, x, key_dim=feat, axis=time, causal_query_spatial_dim=time)
    seen = tracer.captured_locals[GENERIC][0]
    with dr.enabled(strict=True), dr.trace() as t, dr.trace(capture_tensors=False) as names:
        out = rf.dot_attention(x, x, x, key_dim=feat, axis=time, causal_query_spatial_dim=time)
    (r,), (n,) = t.records, names.records
    assert r.kernel == "reference" and n.kernel == "reference" and n.energy is None and r.output is out
    kv = [d for d in r.energy.dims if d not in (batch, heads, time)]
    assert len(kv) == 1 and kv[0].name == "time:kv" and r.att_weights.dims == r.energy.dims
    for ours, name in ((r.energy, "energy"), (r.att_weights, "att_weights")):
        theirs = seen[name][-1]
        their_kv = [d for d in theirs.dims if d not in (batch, heads, time)][0]
        a = aligned(ours, [batch, heads, time, kv[0]])
        b = aligned(theirs, [batch, heads, time, their_kv])
        assert (a - b).abs().max() < 1e-5, name


# --- a whole run: RETURNN's config ---------------------------------------------------------------

def test_config_option_and_environment(monkeypatch):
    monkeypatch.delenv("DIMATTN_RETURNN", raising=False)
    config = Config()
    config.update({"dimattn_attention": "strict"})
    dr.startup_callback(config=config)
    assert dr.is_strict()
    monkeypatch.setenv("DIMATTN_RETURNN", "0")
    assert not dr.enable_from_config(config) and not dr.is_enabled()
    monkeypatch.setenv("DIMATTN_RETURNN", "1")
    config.update({"dimattn_attention": False})
    assert dr.enable_from_config(config) and dr.is_enabled() and not dr.is_strict()
    monkeypatch.delenv("DIMATTN_RETURNN")
    assert not dr.enable_from_config(config)
    config.update({"dimattn_attention": "sometimes"})
    with pytest.raises(da.Error, match="dimattn_attention must be True, False or \"strict\""):
        dr.enable_from_config(config)


CONFIG = '''
#!rnn.py
import dimattn.returnn
from dimattn.returnn import startup_callback
import returnn.frontend as rf
from returnn.tensor import Dim, batch_dim

backend = "torch"
task = "train"
device = "cpu"
dimattn_attention = "strict"
num_epochs = 1
batch_size = 100
max_seqs = 4
learning_rate = 0.01
optimizer = {"class": "adam"}
behavior_version = 21
log_verbosity = 2
model = "MODEL_DIR/model"
time_dim = Dim(None, name="time")
in_dim, out_dim = Dim(8, name="in"), Dim(5, name="classes")
extern_data = {"data": {"dims": (batch_dim, time_dim, in_dim), "dtype": "float32"},
               "classes": {"dims": (batch_dim, time_dim), "sparse_dim": out_dim, "dtype": "int32"}}
train = {"class": "DummyDataset", "input_dim": 8, "output_dim": 5, "num_seqs": 12, "seq_len": 9}


class Model(rf.Module):
    def __init__(self):
        super().__init__()
        self.model = Dim(16, name="model")
        self.inp = rf.Linear(in_dim, self.model)
        self.att = rf.CausalSelfAttention(self.model, self.model, key_dim_total=self.model,
                                          value_dim_total=self.model, num_heads=2, att_dropout=0.1)
        self.out = rf.Linear(self.model, out_dim)

    def __call__(self, x, spatial_dim):
        y, _ = self.att(self.inp(x), axis=spatial_dim)
        return self.out(y)


class Conformer(rf.Module):
    def __init__(self):
        super().__init__()
        from returnn.frontend.encoder.conformer import ConformerEncoder
        self.enc = ConformerEncoder(in_dim, Dim(16, name="model"), ff_dim=Dim(32, name="ff"), num_layers=2,
                                    input_layer=None, num_heads=2, att_dropout=0.1)
        self.out = rf.Linear(self.enc.out_dim, out_dim)

    def __call__(self, x, spatial_dim):
        y, _ = self.enc(x, in_spatial_dim=spatial_dim)
        return self.out(y)


def get_model(**_kwargs):
    return MODEL_CLASS()


def train_step(*, model, extern_data, **_kwargs):
    data, classes = extern_data["data"], extern_data["classes"]
    logits = model(data, data.dims[1])
    loss = rf.cross_entropy(target=classes, estimated=logits, estimated_type="logits", axis=out_dim)
    loss.mark_as_loss("ce")


def epoch_end(**_kwargs):
    s = dimattn.returnn.stats()
    print("DIMATTN_STATS", s["routed"], s["fallback"], sorted(s["kernels"]))
'''


@pytest.mark.parametrize("model,amp", [("Model", None), ("Conformer", "bfloat16")])
def test_a_returnn_training_run_routes_by_its_config(tmp_path, model, amp):
    """RETURNN's own main (python -m returnn) trains a model for an epoch: one with
    rf.CausalSelfAttention, and a 2-layer Conformer (rf.RelPosSelfAttention) under
    torch_amp = "bfloat16"; the config's startup_callback and dimattn_attention =
    "strict" route every attention call of the run (a fallback would raise)."""
    config = tmp_path / "train.config"
    text = CONFIG.replace("MODEL_DIR", str(tmp_path)) + f"\nMODEL_CLASS = {model}\n"
    if amp:
        text += f"torch_amp = {amp!r}\n"
    config.write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("DIMATTN_RETURNN", "DIMATTN_SDPA")}
    result = subprocess.run([sys.executable, "-m", "returnn", str(config)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("DIMATTN_STATS")]
    assert lines, result.stdout[-3000:]
    routed, fallback, kernels = lines[-1].split(" ", 3)[1:]
    assert int(routed) > 0 and int(fallback) == 0 and "reference" not in kernels, lines[-1]
