"""dimattn.nn's modules against the C++ modules of dimattn/modules.h: each case builds
a Python module, hands its parameters (by state_dict name) to the same module in C++
(tests/python/module_parity_ops.cpp, a torch op on the torch backend) and compares the
outputs and, through torch's autograd, the gradients of the input and of every
parameter, in float64 over a dynamic time dim (padding excluded). The two
implementations share no code (ALiBi slopes, T5 buckets, head splitting, the
relative-position table are written in each); this is what keeps them equal."""
import os

import pytest
import torch

import dimattn as da
from dimattn import nn

LIB = os.environ.get("DIMATTN_MODULE_PARITY_OPS")
if not LIB:
    pytest.skip("DIMATTN_MODULE_PARITY_OPS is unset: run through scripts/pytest, which points it at the build",
                allow_module_level=True)
torch.ops.load_library(LIB)

B, IN, OUT, ENC_FEAT = 2, 6, 5, 7
LENS, ENC_LENS = [5, 3], [4, 6]
BUCKETS = nn.RelativePositionBuckets(6, 4)

# (id, class, keyword arguments); heads 2, key 3 and value 4 per head unless given.
CASES = [
    ("self_plain", nn.SelfAttention, {}),
    ("self_window_two_sided", nn.SelfAttention, dict(window=(1, 2))),
    ("self_alibi_softcap_sinks", nn.SelfAttention, dict(alibi=True, softcap=0.8, sinks=True)),
    ("self_alibi_3_heads", nn.SelfAttention, dict(alibi=True, heads=3)),
    ("self_off_by_one", nn.SelfAttention, dict(sink_off_by_one=True)),
    ("self_relative_position", nn.SelfAttention, dict(relative_position=BUCKETS)),
    ("causal_plain", nn.CausalSelfAttention, {}),
    ("causal_window", nn.CausalSelfAttention, dict(window=(2, None))),
    ("causal_alibi_6_heads", nn.CausalSelfAttention, dict(alibi=True, heads=6)),
    ("causal_relative_position", nn.CausalSelfAttention, dict(relative_position=BUCKETS)),
    ("causal_all", nn.CausalSelfAttention, dict(window=(2, None), alibi=True, softcap=1.5, sinks=True,
                                                relative_position=BUCKETS)),
    ("cross_plain", nn.CrossAttention, {}),
    ("cross_softcap_sinks", nn.CrossAttention, dict(softcap=2.0, sinks=True)),
    ("relpos_default", nn.RelPosSelfAttention, {}),
    ("relpos_no_bias", nn.RelPosSelfAttention, dict(with_bias=False)),
    ("relpos_learned_clipped", nn.RelPosSelfAttention, dict(with_linear_pos=False, learnable_pos_emb=True,
                                                            learnable_pos_emb_clipping=2)),
    ("relpos_shaw", nn.RelPosSelfAttention, dict(with_linear_pos=False, with_pos_bias=False, learnable_pos_emb=True,
                                                 learnable_pos_emb_clipping=3)),
    ("relpos_shared_table", nn.RelPosSelfAttention, dict(separate_pos_emb_per_head=False)),
]
KIND = {nn.SelfAttention: "self", nn.CausalSelfAttention: "causal", nn.CrossAttention: "cross",
        nn.RelPosSelfAttention: "relpos"}


def config_of(m, kind):
    """The module's settings as the op's key=value tokens."""
    c = dict(kind=kind, heads=m.num_heads, key=m.key_dim_total.size, value=m.value_dim_total.size, in_=IN, out=OUT,
             bias=int(m.proj.bias is not None), alibi=int(m.alibi_slopes is not None), sinks=int(m.sinks is not None),
             off_by_one=int(m.variants.sink_off_by_one))
    window = m.variants.window
    if window is not None:
        for side, value in zip(("window_left", "window_right"), window):
            if value is not None:
                c[side] = value
    if m.variants.softcap is not None:
        c["softcap"] = m.variants.softcap
    rpb = getattr(m, "relative_position_bias", None)
    if rpb is not None:
        c["rel_buckets"], c["rel_max"] = rpb.config.num_buckets, rpb.config.max_distance
    if kind == "relpos":
        c.update(linear_pos=int(m.linear_pos is not None), pos_bias=int(m.pos_bias_u is not None),
                 learnable=int(m.learned_pos_emb is not None), clipping=m.clipping,
                 per_head=int(m.separate_pos_emb_per_head))
    if kind == "cross":
        c["enc_feat"] = ENC_FEAT
    return " ".join(f"{k.rstrip('_')}={v}" for k, v in c.items())


@pytest.mark.parametrize("name, cls, kwargs", CASES, ids=[c[0] for c in CASES])
def test_python_and_cpp_modules_agree(name, cls, kwargs):
    kwargs = dict(kwargs)
    heads = kwargs.pop("heads", 2)
    batch, inp, out = da.Dim("batch", B), da.Dim("in", IN), da.Dim("out", OUT)
    lengths = torch.tensor(LENS)
    time = da.Dim.dynamic("time", da.Tensor(lengths, [batch]))
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(11)
    if cls is nn.CrossAttention:
        kwargs["encoder_dim"] = da.Dim("enc_feat", ENC_FEAT)
    m = cls(inp, out, key_dim_total=3 * heads, value_dim_total=4 * heads, num_heads=heads, dtype=torch.float64,
            **kwargs).eval()
    x = torch.randn(B, max(LENS), IN, generator=gen, dtype=torch.float64, requires_grad=True)
    enc = enc_lengths = None
    inputs = [x]
    if cls is nn.CrossAttention:
        enc = torch.randn(B, max(ENC_LENS), ENC_FEAT, generator=gen, dtype=torch.float64, requires_grad=True)
        enc_lengths = torch.tensor(ENC_LENS)
        inputs.append(enc)
        enc_dim = da.Dim.dynamic("enc", da.Tensor(enc_lengths, [batch]))
        state = m.transform_encoder(da.Tensor(enc, [batch, enc_dim, m.encoder_dim]), enc_dim)
        y_py = m(da.Tensor(x, [batch, time, inp]), state)
    else:
        y_py = m(da.Tensor(x, [batch, time, inp]), time)
    y_py = y_py.raw_in([batch, time, out])

    names, params = zip(*m.named_parameters())
    y_cpp = torch.ops.dimattn_parity.run(config_of(m, KIND[cls]), x, lengths, enc, enc_lengths, list(names),
                                         list(params))
    assert y_cpp.shape == y_py.shape

    valid = (torch.arange(max(LENS))[None, :] < lengths[:, None])[..., None]
    torch.testing.assert_close(y_cpp * valid, y_py * valid, rtol=1e-9, atol=1e-10, msg=f"{name}: outputs")

    weight = torch.randn(y_py.shape, generator=gen, dtype=torch.float64) * valid
    wrt = inputs + list(params)
    g_py = torch.autograd.grad((y_py * weight).sum(), wrt)
    g_cpp = torch.autograd.grad((y_cpp * weight).sum(), wrt)
    for what, a, b in zip(["x", "encoder"][:len(inputs)] + list(names), g_cpp, g_py):
        assert b.abs().max() > 0, f"{name}: no gradient reached {what} in Python, nothing to compare"
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"{name}: gradient of {what}")


def test_every_module_class_is_compared():
    """The cases cover each module class and each of their variant flags at least once."""
    assert set(KIND) == {c[1] for c in CASES}
    flags = " ".join(" ".join(c[2]) for c in CASES)
    for flag in ("window", "softcap", "alibi", "sinks", "sink_off_by_one", "relative_position", "with_bias",
                 "with_linear_pos", "with_pos_bias", "learnable_pos_emb", "separate_pos_emb_per_head"):
        assert flag in flags, flag
