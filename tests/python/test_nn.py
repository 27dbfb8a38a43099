"""dimattn.nn: the attention modules against plain torch written from their
documented layout (head-major fused weights) and variants, gradcheck in float64,
torch.compile(fullgraph=True) against eager with gradients, state_dict round
trips, causal steps and chunks against the full sequence (padding, windows, every
variant), cross-attention with a beam against tiling it by hand, dropout, and bad
input."""
import io
import math

import pytest
import torch

import dimattn as da
from dimattn import nn

B, IN, OUT = 2, 4, 3
LENS = [5, 3]


def dims():
    batch, inp, out = da.Dim("batch", B), da.Dim("in", IN), da.Dim("out", OUT)
    time = da.Dim.dynamic("time", da.Tensor(torch.tensor(LENS), [batch]))
    return batch, time, inp, out


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# Each module config as data: the keyword arguments of SelfAttention and
# CausalSelfAttention (heads 2, key 2 and value 3 per head).
CONFIGS = {
    "plain": {},
    "window_two_sided": dict(window=(1, 2)),
    "window_causal": dict(window=(2, None)),
    "window0": dict(window=(0, 0)),
    "alibi_softcap_sinks": dict(alibi=True, softcap=0.8, sinks=True),
    "off_by_one": dict(sink_off_by_one=True),
    "relative_position": dict(relative_position=nn.RelativePositionBuckets(6, 4)),
    "all": dict(window=(2, None), alibi=True, softcap=1.5, sinks=True,
                relative_position=nn.RelativePositionBuckets(6, 4)),
}
CAUSAL_CONFIGS = [n for n in CONFIGS if n != "window_two_sided"]  # a causal window looks back only


def make(cls, config="plain", heads=2, dtype=torch.float64, at=None, **extra):
    """A module of `config` and its dims (those of `at`, a former call's, or new ones)."""
    torch.manual_seed(7)
    batch, time, inp, out = at or dims()
    m = cls(inp, out, key_dim_total=2 * heads, value_dim_total=3 * heads, num_heads=heads, dtype=dtype,
            **CONFIGS[config], **extra)
    return m, batch, time, inp, out


def make_cross(dtype=torch.float64, **variants):
    torch.manual_seed(8)
    batch, inp, out, enc_feat = da.Dim("batch", B), da.Dim("in", IN), da.Dim("out", OUT), da.Dim("enc_feat", 5)
    enc = da.Dim.dynamic("enc", da.Tensor(torch.tensor([4, 2]), [batch]))
    m = nn.CrossAttention(inp, out, encoder_dim=enc_feat, key_dim_total=4, value_dim_total=6, num_heads=2,
                          dtype=dtype, **variants)
    return m, batch, enc, enc_feat, inp, out


# --- plain torch from the documented layout -------------------------------------------

def plain_self_attention(m, x, lengths, causal):
    """m's attention on raw x [B, T, IN] in plain torch: the fused qkv weight read
    head-major (per head q, k, v columns), the variants in the documented order."""
    Bx, T, _ = x.shape
    H, K, V = m.num_heads, m.key_dim_per_head.size, m.value_dim_per_head.size
    qkv = (x @ m.qkv.weight.t() + m.qkv.bias).reshape(Bx, T, H, 2 * K + V).transpose(1, 2)
    q, k, v = qkv[..., :K], qkv[..., K:2 * K], qkv[..., 2 * K:]
    e = q @ k.transpose(-1, -2) / math.sqrt(K)
    if m.variants.softcap:
        e = m.variants.softcap * torch.tanh(e / m.variants.softcap)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    rpb = m.relative_position_bias
    if rpb is not None:
        buckets = torch.tensor([[nn.relative_position_bucket(b - a, rpb.config, not causal) for b in range(T)]
                                for a in range(T)])
        e = e + rpb.table[buckets].permute(2, 0, 1)
    if m.alibi_slopes is not None:
        e = e - m.alibi_slopes[:, None, None] * (i - j).abs()
    allowed = (j < torch.tensor(lengths)[:, None, None, None]).expand(Bx, H, T, T)
    if causal:
        allowed = allowed & (j <= i)
    if m.variants.window is not None:
        left, right = m.variants.window
        if left is not None:
            allowed = allowed & (j >= i - left)
        if right is not None:
            allowed = allowed & (j <= i + right)
    e = e.masked_fill(~allowed, float("-inf"))
    if m.sinks is not None or m.variants.sink_off_by_one:
        sink = m.sinks[:, None, None] if m.sinks is not None else torch.zeros(H, 1, 1, dtype=e.dtype)
        w = torch.softmax(torch.cat([e, sink.expand(Bx, H, T, 1)], -1), -1)[..., :T]
    else:
        w = torch.softmax(e, -1).nan_to_num(0.0)
    o = (w @ v).transpose(1, 2).reshape(Bx, T, H * V)
    return o @ m.proj.weight.t() + m.proj.bias


@pytest.mark.parametrize("causal,config", [(False, c) for c in CONFIGS] + [(True, c) for c in CAUSAL_CONFIGS])
def test_modules_equal_plain_torch_from_the_head_major_layout(config, causal):
    cls = nn.CausalSelfAttention if causal else nn.SelfAttention
    m, batch, time, inp, out = make(cls, config, heads=4)
    x = rand(B, 5, IN, seed=1)
    y = m(da.Tensor(x, [batch, time, inp]), time)
    assert [d for d in y.dims] == [batch, time, out]
    want = plain_self_attention(m, x, LENS, causal)
    assert (y.raw - want).abs().max() <= 1e-12


@pytest.mark.parametrize("variants", [{}, dict(softcap=0.5, sinks=True), dict(sink_off_by_one=True)])
def test_cross_attention_equals_plain_torch_from_the_head_major_layout(variants):
    m, batch, enc, enc_feat, inp, out = make_cross(**variants)
    beam = da.Dim("beam", 3)
    e, x = rand(B, 4, 5, seed=2), rand(B, 3, IN, seed=3)
    y = m(da.Tensor(x, [batch, beam, inp]), m.transform_encoder(da.Tensor(e, [batch, enc, enc_feat]), enc))
    assert list(y.dims) == [batch, beam, out]
    H, K, V = 2, 2, 3
    q = (x @ m.query.weight.t() + m.query.bias).reshape(B, 3, H, K).transpose(1, 2)
    kv = (e @ m.kv.weight.t() + m.kv.bias).reshape(B, 4, H, K + V).transpose(1, 2)  # per head k, then v
    k, v = kv[..., :K], kv[..., K:]
    energy = q @ k.transpose(-1, -2) / math.sqrt(K)
    if variants.get("softcap"):
        energy = variants["softcap"] * torch.tanh(energy / variants["softcap"])
    energy = energy.masked_fill(torch.arange(4) >= torch.tensor([4, 2])[:, None, None, None], float("-inf"))
    if m.sinks is not None or m.variants.sink_off_by_one:
        sink = m.sinks[:, None, None] if m.sinks is not None else torch.zeros(H, 1, 1, dtype=energy.dtype)
        w = torch.softmax(torch.cat([energy, sink.expand(B, H, 3, 1)], -1), -1)[..., :4]
    else:
        w = torch.softmax(energy, -1)
    want = (w @ v).transpose(1, 2).reshape(B, 3, H * V) @ m.proj.weight.t() + m.proj.bias
    assert (y.raw - want).abs().max() <= 1e-12


def test_standard_alibi_slopes_and_relative_position_buckets():
    # The slopes from the paper's definition (exponents of 2), and T5's buckets
    # hand-computed from theirs (the C++ tests' cases).
    for n, exponents in {1: [-8], 3: [-4, -8, -2], 4: [-2, -4, -6, -8], 6: [-2, -4, -6, -8, -1, -3],
                         12: [-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5, -3.5]}.items():
        assert nn.standard_alibi_slopes(n) == [2.0 ** x for x in exponents]
    t5 = nn.RelativePositionBuckets(32, 128)
    bidirectional = {0: 0, -1: 1, -7: 7, -8: 8, -11: 8, -12: 9, -15: 9, -16: 10, -22: 10, -23: 11, -31: 11, -32: 12,
                     -45: 12, -46: 13, -63: 13, -64: 14, -90: 14, -91: 15, -127: 15, -128: 15, -5000: 15, 1: 17, 7: 23,
                     8: 24, 12: 25, 16: 26, 127: 31, 200: 31}
    causal = {5: 0, 1: 0, 0: 0, -1: 1, -15: 15, -16: 16, -18: 16, -19: 17, -20: 17, -21: 18, -23: 18, -24: 19,
              -30: 20, -31: 21, -32: 21, -58: 25, -59: 26, -64: 26, -127: 31, -128: 31, -1000: 31}
    small = {0: 0, -1: 1, -2: 1, -9: 1, 1: 3, 2: 3, 9: 3}
    for cases, buckets, bidi in ((bidirectional, t5, True), (causal, t5, False),
                                 (small, nn.RelativePositionBuckets(4, 2), True)):
        assert {r: nn.relative_position_bucket(r, buckets, bidi) for r in cases} == cases
    for buckets, bidi, words in (((31, 128), True, "num_buckets must be even and >= 4"),
                                 ((1, 128), False, "num_buckets must be >= 2"),
                                 ((32, 8), True, "max_distance must be > 8, the distances")):
        with pytest.raises(da.Error, match=r"\[relative_position_bucket\] " + words):
            nn.relative_position_bucket(0, nn.RelativePositionBuckets(*buckets), bidi)


def test_relative_position_bias_with_offsets_is_the_gathered_table():
    heads, batch, tq, kv = da.Dim("heads", 2), da.Dim("batch", 2), da.Dim("tq", 3), da.Dim("kv", 6)
    rpb = nn.RelativePositionBias(heads, nn.RelativePositionBuckets(6, 4), bidirectional=False)
    offset = da.Tensor(torch.tensor([0, 3]), [batch])
    bias = rpb(tq, kv, offset)
    assert list(bias.dims) == [batch, tq, kv, heads]
    for b, off in enumerate([0, 3]):
        for i in range(3):
            for j in range(6):
                bucket = nn.relative_position_bucket(j - (i + off), rpb.config, False)
                assert torch.equal(bias.raw[b, i, j], rpb.table[bucket])
    bias.raw.sum().backward()
    assert rpb.table.grad.abs().sum() > 0


# --- autograd and compile --------------------------------------------------------------

class _Call(torch.nn.Module):
    """A function of a module as a module, for torch.func.functional_call."""

    def __init__(self, module, call):
        super().__init__()
        self.m, self.call = module, call

    def forward(self, *raws):
        return self.call(*raws)


def check_gradients(module, call, inputs):
    """gradcheck of ``call(*raw inputs)`` (a raw tensor) over the raw inputs and every
    parameter of ``module``, which reach the call through torch.func.functional_call."""
    names = ["m." + n for n, _ in module.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in module.parameters()]
    wrapped = _Call(module, call)

    def f(*args):
        return torch.func.functional_call(wrapped, dict(zip(names, args[len(inputs):])), args[:len(inputs)])

    assert torch.autograd.gradcheck(f, (*inputs, *params))


@pytest.mark.parametrize("causal,config", [(False, "plain"), (False, "window_two_sided"), (False, "all"),
                                           (True, "plain"), (True, "all")])
def test_gradcheck_self_attention(config, causal):
    m, batch, time, inp, out = make(nn.CausalSelfAttention if causal else nn.SelfAttention, config)
    x = rand(B, 5, IN, seed=1).requires_grad_(True)
    check_gradients(m, lambda raw: m(da.Tensor(raw, [batch, time, inp]), time).raw, (x,))


@pytest.mark.parametrize("variants", [{}, dict(softcap=0.7, sinks=True)])
def test_gradcheck_cross_attention(variants):
    m, batch, enc, enc_feat, inp, out = make_cross(**variants)
    beam = da.Dim("beam", 2)
    e, x = rand(B, 4, 5, seed=2).requires_grad_(True), rand(B, 2, IN, seed=3).requires_grad_(True)

    def call(e, x):
        state = m.transform_encoder(da.Tensor(e, [batch, enc, enc_feat]), enc)
        return m(da.Tensor(x, [batch, beam, inp]), state).raw

    check_gradients(m, call, (e, x))


def test_gradcheck_through_chunks_and_a_windowed_state():
    m, batch, time, inp, out = make(nn.CausalSelfAttention, "all")
    x = rand(B, 5, IN, seed=1).requires_grad_(True)
    c1 = da.Dim("c1", 2)
    c2 = da.Dim.dynamic("c2", da.Tensor(torch.tensor([3, 1]), [batch]))

    def call(raw):
        y1, state = m.chunk(da.Tensor(raw[:, :2], [batch, c1, inp]), c1, m.initial_state([batch]))
        y2, _ = m.chunk(da.Tensor(raw[:, 2:], [batch, c2, inp]), c2, state)
        return torch.cat([y1.raw_in([batch, c1, out]), y2.raw_in([batch, c2, out])], 1)

    check_gradients(m, call, (x,))


def check_compiled(module, call, inputs, backend):
    """``call(*inputs)`` (a dimattn.Tensor) compiled with fullgraph: one graph, no
    break, and the eager output and gradients of the inputs and parameters to 1e-12."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(call)(*inputs)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(call, fullgraph=True, backend=backend)
    params = list(module.parameters())
    results = []
    for f in (call, compiled):
        y = f(*inputs).raw
        results.append((y, torch.autograd.grad((y * y).sum(), [*[t.raw for t in inputs], *params])))
    (y0, g0), (y1, g1) = results
    assert (y0 - y1).abs().max() <= 1e-12
    for a, b in zip(g0, g1):
        assert a.abs().max() > 0 and (a - b).abs().max() <= 1e-12


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("cls", [nn.SelfAttention, nn.CausalSelfAttention])
def test_compile_fullgraph_self_attention(cls, backend):
    m, batch, time, inp, out = make(cls, "all" if backend == "inductor" else "alibi_softcap_sinks")
    x = da.Tensor(rand(B, 5, IN, seed=1).requires_grad_(True), [batch, time, inp])
    check_compiled(m, lambda x: m(x, time), (x,), backend)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_cross_attention(backend):
    m, batch, enc, enc_feat, inp, out = make_cross(softcap=0.7, sinks=True)
    beam = da.Dim("beam", 2)
    e = da.Tensor(rand(B, 4, 5, seed=2).requires_grad_(True), [batch, enc, enc_feat])
    x = da.Tensor(rand(B, 2, IN, seed=3).requires_grad_(True), [batch, beam, inp])
    check_compiled(m, lambda e, x: m(x, m.transform_encoder(e, enc)), (e, x), backend)


def test_compile_fullgraph_causal_step():
    m, batch, time, inp, out = make(nn.CausalSelfAttention, "all")
    state = m.initial_state([batch])
    with torch.no_grad():  # a history of 3 positions: the window's 2 kept
        for t in range(3):
            state = m.step(da.Tensor(rand(B, IN, seed=t), [batch, inp]), state)[1]
    x = da.Tensor(rand(B, IN, seed=9).requires_grad_(True), [batch, inp])
    check_compiled(m, lambda x: m.step(x, state)[0], (x,), "aot_eager")


# --- state_dict, devices and dtypes ----------------------------------------------------

@pytest.mark.parametrize("which", ["self", "causal", "cross"])
def test_state_dict_round_trip_into_a_fresh_module(which):
    batch, time, inp, out = dims()
    enc, enc_feat = da.Dim("enc", 4), da.Dim("enc_feat", 5)
    kw = dict(key_dim_total=4, value_dim_total=6, num_heads=2, softcap=0.7, sinks=True, dtype=torch.float64)
    if which != "cross":
        kw.update(relative_position=nn.RelativePositionBuckets(6, 4), alibi=True,
                  window=(2, None) if which == "causal" else (1, 2))

    def build(seed):
        torch.manual_seed(seed)
        if which == "cross":
            return nn.CrossAttention(inp, out, encoder_dim=enc_feat, **kw)
        return (nn.CausalSelfAttention if which == "causal" else nn.SelfAttention)(inp, out, **kw)

    def run(m):
        if which == "cross":
            state = m.transform_encoder(da.Tensor(rand(B, 4, 5, seed=2), [batch, enc, enc_feat]), enc)
            return m(da.Tensor(rand(B, IN, seed=3), [batch, inp]), state).raw
        return m(da.Tensor(rand(B, 5, IN, seed=1), [batch, time, inp]), time).raw

    a, b = build(1), build(2)
    keys = set(a.state_dict())
    assert "sinks" in keys and "alibi_slopes" not in keys
    assert which == "cross" or "relative_position_bias.table" in keys
    assert not torch.equal(run(a), run(b))
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b.load_state_dict(torch.load(buffer))
    assert torch.equal(run(a), run(b))


def test_to_moves_parameters_and_buffers_to_another_dtype():
    m, batch, time, inp, out = make(nn.CausalSelfAttention, "all", dtype=torch.float32)
    m64, *_ = make(nn.CausalSelfAttention, "all", dtype=torch.float64, at=(batch, time, inp, out))
    m64.load_state_dict(m.state_dict())
    m.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in m.parameters()) and m.alibi_slopes.dtype == torch.float64
    assert m.relative_position_bias.bucket_of.dtype == torch.int64
    x = da.Tensor(rand(B, 5, IN, seed=1), [batch, time, inp])
    y = m(x, time)
    assert y.raw.dtype == torch.float64 and torch.equal(y.raw, m64(x, time).raw)


def test_reset_parameters_draws_every_parameter_anew():
    m, *_ = make(nn.SelfAttention, "all")
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    m.reset_parameters()
    assert set(before) == {"sinks", "proj.weight", "proj.bias", "qkv.weight", "qkv.bias",
                           "relative_position_bias.table"}
    for n, p in m.named_parameters():
        assert not torch.equal(before[n], p), n
    bound = 1 / math.sqrt(IN)
    assert m.qkv.weight.abs().max() <= bound and m.sinks.abs().max() <= 1


# --- causal steps and chunks ------------------------------------------------------------

STEP_LENS = [9, 6]


def feed_chunks(m, x, batch, inp, out, full, sizes):
    """Feeds x [B, T, IN] to m in chunks: entry b's k-th chunk is its next sizes[b][k]
    positions (a dynamic chunk dim). Checks each chunk's valid rows against
    ``full`` [B, T, OUT] and, with a window, that the state keeps min(seen, left)
    positions per entry on an axis of extent <= left. Returns the rows compared."""
    T = x.shape[1]
    left = m.variants.window[0] if m.variants.window is not None else None
    state = m.initial_state([batch])
    start, compared = [0] * B, 0
    for k in range(len(sizes[0])):
        lens = [sizes[b][k] for b in range(B)]
        extent = max(lens)
        chunk = da.Dim.dynamic("chunk", da.Tensor(torch.tensor(lens), [batch]))
        idx = torch.tensor([[min(start[b] + t, T - 1) for t in range(extent)] for b in range(B)])
        xc = da.Tensor(x.gather(1, idx[..., None].expand(B, extent, IN)), [batch, chunk, inp])
        y, state = m.chunk(xc, chunk, state)
        got = y.raw_in([batch, chunk, out])
        for b in range(B):
            for t in range(lens[b]):
                assert (got[b, t] - full[b, start[b] + t]).abs().max() <= 1e-10, (k, b, start[b] + t)
                compared += 1
            start[b] += lens[b]
        if left is not None:
            assert state.keys.raw.shape[state.keys.axis_of(state.axis)] <= left
            assert state.axis.lengths.raw.tolist() == [min(s, left) for s in start]
    return compared


def even_chunks(size):
    return [[max(0, min(size, n - s)) for s in range(0, max(STEP_LENS), size)] for n in STEP_LENS]


@pytest.mark.parametrize("config", CAUSAL_CONFIGS)
def test_causal_steps_and_chunks_equal_the_full_sequence(config):
    m, batch, _, inp, out = make(nn.CausalSelfAttention, config, heads=4)
    time = da.Dim.dynamic("time", da.Tensor(torch.tensor(STEP_LENS), [batch]))
    x = rand(B, 9, IN, seed=4)
    full = m(da.Tensor(x, [batch, time, inp]), time).raw_in([batch, time, out])
    left = m.variants.window[0] if m.variants.window is not None else None
    # Step by step: every entry takes a position each step (the shorter one
    # padding input past its length, compared only within it).
    state, compared = m.initial_state([batch]), 0
    for t in range(9):
        y, state = m.step(da.Tensor(x[:, t], [batch, inp]), state)
        assert list(y.dims) == [batch, out]
        for b in range(B):
            if t < STEP_LENS[b]:
                assert (y.raw_in([batch, out])[b] - full[b, t]).abs().max() <= 1e-10, (t, b)
                compared += 1
        if left is not None:
            assert state.keys.raw.shape[state.keys.axis_of(state.axis)] == min(t + 1, left)
    assert compared == 15
    for size in (1, 2, 3, 4, 9):
        assert feed_chunks(m, x, batch, inp, out, full, even_chunks(size)) == 15
    # Boundaries that differ per entry, and empty chunks.
    assert feed_chunks(m, x, batch, inp, out, full, [[2, 3, 0, 4], [3, 1, 2, 0]]) == 15


def test_windowed_state_stays_bounded_over_many_steps():
    m, batch, _, inp, out = make(nn.CausalSelfAttention, "plain", window=(4, None))
    time = da.Dim("time", 40)
    x = rand(B, 40, IN, seed=5)
    full = m(da.Tensor(x, [batch, time, inp]), time).raw_in([batch, time, out])
    state = m.initial_state([batch])
    for t in range(40):
        y, state = m.step(da.Tensor(x[:, t], [batch, inp]), state)
        assert state.keys.raw.shape[state.keys.axis_of(state.axis)] == min(t + 1, 4)
        assert state.values.raw.shape[state.values.axis_of(state.axis)] == min(t + 1, 4)
    assert (y.raw_in([batch, out]) - full[:, 39]).abs().max() <= 1e-10


# --- cross-attention with a beam ------------------------------------------------------

def test_cross_attention_with_a_beam_equals_tiling_the_beam_by_hand():
    m, batch, enc, enc_feat, inp, out = make_cross(softcap=0.7, sinks=True)
    beam, dec = da.Dim("beam", 3), da.Dim("dec", 2)
    e = rand(B, 4, 5, seed=2)
    x = rand(B, 3, 2, IN, seed=3)
    state = m.transform_encoder(da.Tensor(e, [batch, enc, enc_feat]), enc)
    assert not state.keys.has(beam) and not state.values.has(beam)
    y = m(da.Tensor(x, [batch, beam, dec, inp]), state)
    assert list(y.dims) == [batch, beam, dec, out]
    # By hand: the encoder tiled over (batch, beam) as one batch dim of 6.
    flat = da.Dim("flat", B * 3)
    lengths = da.Tensor(torch.tensor([4, 2]).repeat_interleave(3), [flat])
    enc_tiled = da.Dim.dynamic("enc_tiled", lengths)
    tiled_state = m.transform_encoder(da.Tensor(e.repeat_interleave(3, 0), [flat, enc_tiled, enc_feat]), enc_tiled)
    want = m(da.Tensor(x.reshape(B * 3, 2, IN), [flat, dec, inp]), tiled_state).raw_in([flat, dec, out])
    assert (y.raw_in([batch, beam, dec, out]).reshape(B * 3, 2, OUT) - want).abs().max() <= 1e-12


# --- dropout ----------------------------------------------------------------------------

@pytest.mark.parametrize("broadcast", [False, True])
def test_dropout_in_train_mode_is_reproducible_with_manual_seed(broadcast):
    m, batch, time, inp, out = make(nn.CausalSelfAttention, "plain", att_dropout=0.5,
                                    att_dropout_broadcast=broadcast)
    plain, *_ = make(nn.CausalSelfAttention, "plain", at=(batch, time, inp, out))
    x = da.Tensor(rand(B, 5, IN, seed=1), [batch, time, inp])
    m.train()
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.append(m(x, time).raw)
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert not torch.equal(runs[0], plain(x, time).raw)
    m.eval()  # no dropout: the module without it
    assert (m(x, time).raw - plain(x, time).raw).abs().max() <= 1e-12


# --- bad input ----------------------------------------------------------------------------

def test_bad_input_is_a_clear_error():
    m, batch, time, inp, out = make(nn.SelfAttention)
    x = da.Tensor(rand(B, 5, IN, seed=1), [batch, time, inp])
    with pytest.raises(da.Error, match=r"\[SelfAttention\] x must be a dimattn.Tensor .*got torch.Tensor; wrap it"):
        m(x.raw, time)
    other_in = da.Dim("in", IN)
    with pytest.raises(da.Error, match=r"\[SelfAttention\] in_dim in\[4\] is not in x \(batch\[2\], "
                                       r"time\[dynamic over batch\], in\[4\]\); x's in\[4\] has its name but is "
                                       r"another Dim .*use the module's in_dim"):
        m(da.Tensor(x.raw, [batch, time, other_in]), time)
    with pytest.raises(da.Error, match=r"\[SelfAttention\] axis other\[5\] is not in x"):
        m(x, da.Dim("other", 5))
    with pytest.raises(da.Error, match=r"\[SelfAttention\] key_dim_total 6 is not divisible by num_heads 4"):
        nn.SelfAttention(inp, out, key_dim_total=6, value_dim_total=8, num_heads=4)
    with pytest.raises(da.Error, match=r"\[SelfAttention\] num_heads must be a positive int, got 0"):
        nn.SelfAttention(inp, out, key_dim_total=6, value_dim_total=8, num_heads=0)
    with pytest.raises(da.Error, match=r"\[CausalSelfAttention\] window right is 1 but causal attention sees no "
                                       r"position after the query; pass window=\(2, None\)"):
        nn.CausalSelfAttention(inp, out, key_dim_total=4, value_dim_total=4, num_heads=2, window=(2, 1))
    with pytest.raises(da.Error, match=r"\[CausalSelfAttention\] in_dim must be a static dimattn.Dim"):
        nn.CausalSelfAttention(4, out, key_dim_total=4, value_dim_total=4, num_heads=2)
    # Values are dot_attention's to check, with its message, at the call.
    bad = nn.SelfAttention(inp, out, key_dim_total=4, value_dim_total=4, num_heads=2, window=(-1, None),
                           dtype=torch.float64)
    with pytest.raises(da.Error, match=r"\[dot_attention\] window.left must be >= 0"):
        bad(x, time)
    with pytest.raises(da.Error, match=r"\[RelativePositionBias\] num_buckets must be even"):
        nn.SelfAttention(inp, out, key_dim_total=4, value_dim_total=4, num_heads=2,
                         relative_position=nn.RelativePositionBuckets(7, 8))


def test_bad_states_and_cross_attention_input_are_clear_errors():
    m, batch, time, inp, out = make(nn.CausalSelfAttention)
    beam = da.Dim("beam", 2)
    state = m.initial_state([batch])
    with pytest.raises(da.Error, match=r"\[CausalSelfAttention\] x \(batch\[2\], beam\[2\], in\[4\]\) has the dims "
                                       r"\(batch\[2\], beam\[2\]\) besides in_dim, but the state "
                                       r"is over \(batch\[2\]\); make the state with initial_state\(\[batch, beam\]\)"):
        m.step(da.Tensor(rand(B, 2, IN), [batch, beam, inp]), state)
    with pytest.raises(da.Error, match=r"\[CausalSelfAttention\] state must be a dimattn.nn.State"):
        m.step(da.Tensor(rand(B, IN), [batch, inp]), (state.keys, state.values))
    with pytest.raises(da.Error, match=r"\[CausalSelfAttention\] each batch dim of initial_state must be a static"):
        m.initial_state([time])
    c, batch, enc, enc_feat, inp, out = make_cross()
    with pytest.raises(da.Error, match=r"\[CrossAttention\] encoder_dim enc_feat\[5\] is not in encoder"):
        c.transform_encoder(da.Tensor(rand(B, 4, IN), [batch, enc, inp]), enc)
    state = c.transform_encoder(da.Tensor(rand(B, 4, 5), [batch, enc, enc_feat]), enc)
    with pytest.raises(da.Error, match=r"\[CrossAttention\] x \(batch\[2\], enc\[dynamic over batch\], in\[4\]\) "
                                       r"has the encoder's axis"):
        c(da.Tensor(rand(B, 4, IN), [batch, enc, inp]), state)
    with pytest.raises(da.Error, match=r"\[CrossAttention\] a window measures the distance between query and key"):
        nn.CrossAttention(inp, out, encoder_dim=enc_feat, key_dim_total=4, value_dim_total=4, num_heads=2,
                          window=(2, None))
    with pytest.raises(da.Error, match=r"\[SelfAttention\] the variants hold the tensor\(s\) bias, but a module makes"):
        nn.SelfAttention(inp, out, key_dim_total=4, value_dim_total=4, num_heads=2,
                         variants=da.Variants(bias=da.Tensor(rand(4), [da.Dim("kv", 4)])))
    with pytest.raises(da.Error, match=r"\[SelfAttention\] sinks and sink_off_by_one are both set"):
        nn.SelfAttention(inp, out, key_dim_total=4, value_dim_total=4, num_heads=2, sinks=True, sink_off_by_one=True)


def test_a_relative_position_bias_shared_between_modules():
    a, batch, time, inp, out = make(nn.SelfAttention, "relative_position")
    b, *_ = make(nn.SelfAttention, "relative_position", at=(batch, time, inp, out))
    with torch.no_grad():
        b.relative_position_bias.table.add_(1.0)
    x = da.Tensor(rand(B, 5, IN, seed=1), [batch, time, inp])
    assert not torch.equal(a(x, time).raw, b(x, time).raw)
    b.relative_position_bias = a.relative_position_bias  # T5: one table for every layer
    assert torch.equal(a(x, time).raw, b(x, time).raw)
    b.relative_position_bias = nn.RelativePositionBias(da.Dim("heads", 3), nn.RelativePositionBuckets(6, 4),
                                                       dtype=torch.float64)
    with pytest.raises(da.Error, match=r"\[SelfAttention\] relative_position_bias has heads heads\[3\], but the "
                                       r"module has 2"):
        b(x, time)


def test_variants_pass_whole_or_as_keywords():
    # A module takes its scalar variants as one dimattn.Variants (as the C++
    # config's AttentionVariants) or as keywords; both give the same module.
    whole, batch, time, inp, out = make(nn.SelfAttention, "plain", variants=da.Variants(window=(1, 2), softcap=0.7))
    keywords, *_ = make(nn.SelfAttention, "plain", at=(batch, time, inp, out), window=(1, 2), softcap=0.7)
    plain, *_ = make(nn.SelfAttention, "plain", at=(batch, time, inp, out))
    x = da.Tensor(rand(B, max(LENS), IN), [batch, time, inp])
    assert torch.equal(whole(x, time).raw, keywords(x, time).raw)
    assert not torch.allclose(whole(x, time).raw, plain(x, time).raw)
    assert whole.variants.window == (1, 2) and "softcap=0.7" in repr(whole)
