"""dimattn.scaled_dot_product_attention against torch's F.scaled_dot_product_attention
(math backend) over a randomised grid of shapes, masks, dtypes, GQA and causal flags,
outputs and gradients (the float mask's too); torch's errors; dropout; torch.compile;
and sdpa_patched() under nn.MultiheadAttention."""
import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import dimattn as da

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def reference(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


def grid(n=60, seed=11):
    """Random calls: leading batch dims (0-2), heads and GQA, query and kv lengths, head
    dims, causal or a mask of a random broadcast shape (bool or float), a scale."""
    rng = random.Random(seed)
    for i in range(n):
        batch = [rng.randint(1, 3) for _ in range(rng.randint(0, 2))]
        hk = rng.choice([1, 2, 3])
        gqa = rng.random() < 0.4
        hq = hk * (rng.choice([2, 4]) if gqa else 1)
        L, S = rng.randint(1, 9), rng.randint(1, 11)
        E, Ev = rng.choice([4, 8, 16]), rng.choice([4, 8, 12])
        dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.bfloat16])
        kind = rng.choice(["none", "causal", "bool", "float"])
        full = [*batch, hq, L, S]
        mask_shape = [s if rng.random() < 0.6 else 1 for s in full][rng.randint(0, len(full) - 2):]
        scale = rng.choice([None, None, 0.25])
        yield pytest.param(dict(batch=batch, hq=hq, hk=hk, L=L, S=S, E=E, Ev=Ev, dtype=dtype, kind=kind, gqa=gqa,
                                mask_shape=mask_shape, scale=scale, seed=i),
                           id=f"{i}-{kind}-{str(dtype).replace('torch.', '')}")


@pytest.mark.parametrize("c", list(grid()))
def test_equals_torch_on_a_random_grid(c):
    g = torch.Generator().manual_seed(c["seed"])
    dt = c["dtype"]

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dt).requires_grad_(True)

    q = randn(*c["batch"], c["hq"], c["L"], c["E"])
    k = randn(*c["batch"], c["hk"], c["S"], c["E"])
    v = randn(*c["batch"], c["hk"], c["S"], c["Ev"])
    kw = dict(scale=c["scale"], enable_gqa=c["gqa"])
    leaves = [q, k, v]
    if c["kind"] == "causal":
        kw["is_causal"] = True
    elif c["kind"] == "bool":
        kw["attn_mask"] = torch.rand(*c["mask_shape"], generator=g) < 0.75
    elif c["kind"] == "float":
        kw["attn_mask"] = randn(*c["mask_shape"])
        leaves.append(kw["attn_mask"])
    ours = da.scaled_dot_product_attention(q, k, v, **kw)
    theirs = reference(q, k, v, **kw)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    # Rows no key may attend: torch gives NaN, dimattn 0 (docs/python.md).
    empty = theirs.isnan().all(-1, keepdim=True)
    assert (ours.masked_select(empty) == 0).all()
    tol = TOL[dt] * max(1.0, float(theirs.detach().nan_to_num().abs().max()))
    assert (ours - theirs).masked_fill(empty, 0).abs().max() <= tol
    w = torch.randn(ours.shape, generator=g, dtype=torch.float64).to(dt).masked_fill(empty, 0)
    got = torch.autograd.grad((ours * w).sum(), leaves)
    want = torch.autograd.grad((theirs.masked_fill(empty, 0) * w).sum(), leaves)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert (a - b.nan_to_num()).abs().max() <= 2 * TOL[dt] * max(1.0, float(b.detach().nan_to_num().abs().max()))


def test_torchs_errors():
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
        da.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.bool), is_causal=True)
    with pytest.raises(RuntimeError, match="same dtype"):
        da.scaled_dot_product_attention(q, q.double(), q)
    kv = torch.randn(2, 2, 5, 8)
    with pytest.raises(RuntimeError, match="pass enable_gqa=True"):
        da.scaled_dot_product_attention(q, kv, kv)
    with pytest.raises(RuntimeError, match="does not broadcast"):
        da.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(3, 5, 5))


def test_two_dim_operands_and_causal_with_more_queries_than_keys():
    q, k, v = torch.randn(6, 8), torch.randn(4, 8), torch.randn(4, 3)
    for kw in (dict(), dict(is_causal=True)):
        a = da.scaled_dot_product_attention(q, k, v, **kw)
        assert (a - reference(q, k, v, **kw)).abs().max() <= 1e-5


def test_dropout_draws_from_torchs_generator():
    q = torch.randn(2, 3, 16, 8)
    torch.manual_seed(5)
    a = da.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
    torch.manual_seed(5)
    b = da.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
    c = da.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
    assert torch.equal(a, b) and not torch.equal(b, c)
    assert not torch.equal(a, da.scaled_dot_product_attention(q, q, q))


def test_compile_fullgraph_equals_eager():
    q, k, v = (torch.randn(2, 4, 7, 8, requires_grad=True) for _ in range(3))
    mask = torch.randn(4, 7, 7, requires_grad=True)

    def f(q, k, v, mask):
        return da.scaled_dot_product_attention(q, k, v, attn_mask=mask).sin()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    outs = [fn(q, k, v, mask) for fn in (f, compiled)]
    grads = [torch.autograd.grad(o.sum(), (q, k, v, mask)) for o in outs]
    assert (outs[0] - outs[1]).abs().max() <= 1e-6
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-6


def test_sdpa_patched_runs_multihead_attention_on_dimattn():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 9, 16)
    padding = torch.tensor([[False] * 9, [False] * 6 + [True] * 3])
    want, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)
    original = F.scaled_dot_product_attention
    with da.sdpa_patched(), da.trace(capture_tensors=False) as t:
        assert F.scaled_dot_product_attention is da.scaled_dot_product_attention
        got, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)
    assert F.scaled_dot_product_attention is original
    assert len(t.records) == 1 and t.records[0].kernel == "cpu_flash"
    assert (got - want).abs().max() <= 1e-5
