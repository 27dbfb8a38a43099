"""dimattn.kv_cache_attention and kv_cache_append against plain torch attention per
sequence: contiguous and paged caches (both layouts, block sizes 1, 16 and odd, a
shuffled table, shared prefix blocks, lengths 0 and 1), ragged queries, GQA and
multi-query, half precision, window and softcap, the gathered reference path, a
gradient through it, bad input, and seeded random cases over all of these."""
import math

import pytest
import torch

import dimattn as da
from dimattn._kv_cache import _run


def sdpa_per_sequence(q, ks, vs, lens, qlens, scale=None, window=-1, softcap=0.0, slopes=None, sinks=None):
    """q [B, Tq, H, D], ks/vs [B, S, Hkv, D] plain; the new rows are each sequence's last."""
    B, Tq, H, D = q.shape
    out = torch.zeros(B, Tq, H, vs.shape[-1], dtype=torch.float64)
    scale = scale if scale is not None else 1 / math.sqrt(D)
    for b in range(B):
        L, n = int(lens[b]), int(qlens[b])
        if L == 0 or n == 0:
            continue
        g = H // ks.shape[2]
        k = ks[b, :L].double().transpose(0, 1).repeat_interleave(g, 0)
        v = vs[b, :L].double().transpose(0, 1).repeat_interleave(g, 0)
        s = scale * q[b, :n].double().transpose(0, 1) @ k.transpose(1, 2)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(n)[:, None] + L - n
        j = torch.arange(L)[None, :]
        allowed = (j <= i) & ((j >= i - window) if window >= 0 else True)
        if slopes is not None:
            s = s - slopes.double()[:, None, None] * (i - j).abs()
        s = s.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # one more logit in the denominator, no value
            s = torch.cat([s, sinks.double()[:, None, None].expand(-1, n, 1)], -1)
            out[b, :n] = (torch.softmax(s, -1)[..., :-1] @ v).transpose(0, 1)
            continue
        out[b, :n] = (torch.softmax(s, -1) @ v).transpose(0, 1)
    return out


def paged(ks, vs, lens, block_size, hnd=False, shared_prefix=0, seed=0):
    """ks/vs [B, S, Hkv, D] as NaN-filled pools with a shuffled table, written with kv_cache_append;
    sequences b >= 1 point at sequence 0's first shared_prefix // block_size blocks."""
    B, S, Hkv, D = ks.shape
    cap = -(-S // block_size) + 1
    nblocks = B * cap + 2
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(seed))
    table = torch.full((B, cap), -1, dtype=torch.int32)
    used = 0
    for b in range(B):
        for t in range(-(-int(lens[b]) // block_size)):
            if b > 0 and t < shared_prefix // block_size:
                table[b, t] = table[0, t]
            else:
                table[b, t] = perm[used]
                used += 1
    shape = (nblocks, Hkv, block_size, D) if hnd else (nblocks, block_size, Hkv, D)
    kp = torch.full(shape, float("nan"), dtype=ks.dtype)
    vp = torch.full(shape[:-1] + (vs.shape[-1],), float("nan"), dtype=vs.dtype)
    slots = torch.tensor([int(table[b, j // block_size]) * block_size + j % block_size
                          if j < lens[b] and not (b > 0 and j < shared_prefix) else -1
                          for b in range(B) for j in range(S)])
    da.kv_cache_append(kp, vp, ks.reshape(B * S, Hkv, D), vs.reshape(B * S, Hkv, -1), slots,
                       kv_layout="HND" if hnd else "NHD")
    return kp, vp, table


def case(B=4, Tq=1, H=8, Hkv=2, D=32, S=70, lens=(70, 1, 0, 33), dtype=torch.float32, seed=1, shared_prefix=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, H, D, generator=g).to(dtype)
    ks = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    vs = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    ks[1:, :shared_prefix] = ks[0, :shared_prefix]
    vs[1:, :shared_prefix] = vs[0, :shared_prefix]
    return q, ks, vs, torch.tensor(lens)


TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("hnd", [False, True])
@pytest.mark.parametrize("block_size", [1, 16, 7])
def test_paged_equals_plain_attention(block_size, hnd, kernels):
    q, ks, vs, lens = case()
    kp, vp, table = paged(ks, vs, lens, block_size, hnd)
    with da.force(kernels.split(",")) if kernels != "auto" else da.force("auto"):
        got = da.kv_cache_attention(q, kp, vp, lens, table, kv_layout="HND" if hnd else "NHD")
    qlens = torch.where(lens > 0, 1, 0)
    want = sdpa_per_sequence(q, ks, vs, lens, qlens)
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() < TOL[q.dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_contiguous_cache_multi_query_and_half_precision(dtype):
    q, ks, vs, lens = case(H=4, Hkv=1, Tq=3, lens=(70, 3, 5, 33), dtype=dtype)
    got = da.kv_cache_attention(q, ks, vs, lens)
    want = sdpa_per_sequence(q, ks, vs, lens, torch.full((4,), 3))
    assert (got.double() - want).abs().max() < TOL[dtype]


def test_shared_prefix_blocks_and_a_split_cache():
    # One long sequence over one kv head splits its cache over the threads.
    q, ks, vs, lens = case(B=3, S=5000, lens=(5000, 4100, 130), H=4, Hkv=1, D=64, shared_prefix=128 * 30)
    kp, vp, table = paged(ks, vs, lens, 128, shared_prefix=128 * 30)
    assert (table[1, :30] == table[0, :30]).all()
    got = da.kv_cache_attention(q, kp, vp, lens, table)
    want = sdpa_per_sequence(q, ks, vs, lens, torch.ones(3, dtype=torch.long))
    assert (got.double() - want).abs().max() < 2e-5


def test_ragged_queries_continuous_batching():
    q, ks, vs, lens = case(Tq=4, lens=(70, 2, 1, 33))
    qlens = torch.tensor([4, 2, 0, 3])
    kp, vp, table = paged(ks, vs, lens, 16)
    packed = torch.cat([q[b, :int(qlens[b])] for b in range(4)])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)])
    got = da.kv_cache_attention(packed, kp, vp, lens, table, cu_seqlens_q=cu)
    want = sdpa_per_sequence(q, ks, vs, lens, qlens)
    want_packed = torch.cat([want[b, :int(qlens[b])] for b in range(4)])
    assert got.shape == packed.shape
    assert (got.double() - want_packed).abs().max() < 2e-5


def test_window_softcap_and_scale():
    q, ks, vs, lens = case(Tq=2, lens=(70, 9, 2, 33))
    kp, vp, table = paged(ks, vs, lens, 16)
    got = da.kv_cache_attention(q, kp, vp, lens, table, window_size=(5, 0), softcap=2.0, softmax_scale=0.3)
    want = sdpa_per_sequence(q, ks, vs, lens, torch.full((4,), 2), scale=0.3, window=5, softcap=2.0)
    assert (got.double() - want).abs().max() < 2e-5


def test_alibi_and_sinks_in_place():
    q, ks, vs, lens = case(Tq=2, lens=(70, 9, 2, 33))
    kp, vp, table = paged(ks, vs, lens, 16)
    slopes = torch.linspace(0.02, 0.5, 8)
    sinks = torch.linspace(-1.0, 2.0, 8)
    got, kernel = _run(q, kp, vp, lens, table, None, True, None, (-1, -1), 0.0, slopes, sinks, "NHD")
    want = sdpa_per_sequence(q, ks, vs, lens, torch.full((4,), 2), slopes=slopes, sinks=sinks)
    assert (got.double() - want).abs().max() < 2e-5
    assert kernel == "cpu_flash"  # the pools read in place


def test_query_gradient_through_the_gathered_pages():
    q, ks, vs, lens = case(lens=(70, 1, 5, 33))
    kp, vp, table = paged(ks, vs, lens, 16)
    q64 = q.double().requires_grad_()
    got = da.kv_cache_attention(q64, kp.double(), vp.double(), lens, table)
    want = sdpa_per_sequence(q64, ks, vs, lens, torch.ones(4, dtype=torch.long))
    assert (got - want).abs().max() < 1e-10
    gq, = torch.autograd.grad(got.sum(), q64)
    q2 = q.double().requires_grad_()
    gw, = torch.autograd.grad(sdpa_per_sequence(q2, ks, vs, lens, torch.ones(4, dtype=torch.long)).sum(), q2)
    assert (gq - gw).abs().max() < 1e-10


def test_append_writes_in_place_and_bad_input_is_an_error():
    kp = torch.zeros(4, 16, 2, 8)
    vp = torch.zeros(4, 16, 2, 8)
    ptr = kp.data_ptr()
    k = torch.randn(3, 2, 8)
    da.kv_cache_append(kp, vp, k, k, torch.tensor([17, -1, 63]))
    assert kp.data_ptr() == ptr
    assert torch.equal(kp[1, 1], k[0]) and torch.equal(kp[3, 15], k[2]) and kp.count_nonzero() == 32
    with pytest.raises(da.Error, match=r"slot 64 is past the pools' 64 slots"):
        da.kv_cache_append(kp, vp, k, k, torch.tensor([0, 1, 64]))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bad_input_is_an_error(compiled):
    """Eagerly and inside a compiled graph (inductor, fullgraph: the opaque op), bad
    input raises dimattn.Error: a block index out of range and a length past the
    table's capacity (both known only at run time), heads that do not divide."""
    kp, vp = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    q = torch.randn(1, 1, 4, 8)
    table = torch.tensor([[0, 9]], dtype=torch.int32)
    attend = da.kv_cache_attention
    if compiled:
        torch._dynamo.reset()
        attend = torch.compile(da.kv_cache_attention, fullgraph=True)
        assert attend(q, kp, vp, torch.tensor([5]), table).shape == (1, 1, 4, 8)  # a good call first
    with pytest.raises(da.Error, match=r"block_table\[0\]\[1\] = 9 is outside the pool's 4 blocks"):
        attend(q, kp, vp, torch.tensor([20]), table)
    with pytest.raises(da.Error, match="past the block table's capacity"):
        attend(q, kp, vp, torch.tensor([33]), table)
    with pytest.raises(da.Error, match="multiple of the cache's 2 kv heads"):
        attend(torch.randn(1, 1, 3, 8), kp, vp, torch.tensor([20]), table)


def _pools(blocks=4, block_size=16, kv_heads=2, d=8):
    return torch.zeros(blocks, block_size, kv_heads, d), torch.zeros(blocks, block_size, kv_heads, d)


_Q, _TABLE, _LEN = torch.randn(1, 1, 4, 8), torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5])
# Malformed arguments, each with the beginning of its error (after the op's name).
MALFORMED = {
    "negative length": (lambda: da.kv_cache_attention(_Q, *_pools(), torch.tensor([-3]), _TABLE),
                        "cache_seqlens holds -3: a sequence holds 0 or more positions"),
    "float lengths": (lambda: da.kv_cache_attention(_Q, *_pools(), torch.tensor([5.0]), _TABLE),
                      r"cache_seqlens must be \[batch\] = \[1\] integers"),
    "lengths of another batch": (lambda: da.kv_cache_attention(_Q, *_pools(), torch.tensor([5, 6]), _TABLE),
                                 r"cache_seqlens must be \[batch\] = \[1\] integers, got \[2\]"),
    "table of another batch": (lambda: da.kv_cache_attention(_Q, *_pools(), _LEN, _TABLE.repeat(2, 1)),
                               r"block_table must be \[batch, max_blocks\] with batch = 1, got \[2, 2\]"),
    "1-d table": (lambda: da.kv_cache_attention(_Q, *_pools(), _LEN, _TABLE[0]),
                  r"block_table must be \[batch, max_blocks\]"),
    "float table": (lambda: da.kv_cache_attention(_Q, *_pools(), _LEN, _TABLE.float()),
                    "block_table must be an integer tensor"),
    "block size 0": (lambda: da.kv_cache_attention(_Q, *_pools(block_size=0), torch.tensor([0]), _TABLE),
                     r"the slot dim slot\[0\] \(the block size\) holds no position"),
    "query head_dim": (lambda: da.kv_cache_attention(torch.randn(1, 1, 4, 16), *_pools(), _LEN, _TABLE),
                       "q's head_dim 16 must equal the cache's"),
    "head_dim 0": (lambda: da.kv_cache_attention(torch.randn(1, 1, 4, 0), *_pools(d=0), _LEN, _TABLE,
                                                 softmax_scale=1.0),
                   r"q \(1, 1, 4, 0\) has head_dim 0: scores need at least one feature"),
    "no kv heads": (lambda: da.kv_cache_attention(torch.randn(1, 1, 0, 8), *_pools(kv_heads=0), _LEN, _TABLE),
                    "the cache has no kv heads"),
    "contiguous cache of fewer rows than the batch": (lambda: da.kv_cache_attention(_Q.repeat(2, 1, 1, 1),
                                                                                    *_pools(blocks=1), _LEN.repeat(2)),
                                                      r"a contiguous cache holds one sequence per row of its first "
                                                      r"dim, so k_cache \[1, 16, 2, 8\] needs at least q's batch of 2"),
    "pools on meta": (lambda: da.kv_cache_attention(_Q, *(p.to("meta") for p in _pools()), _LEN, _TABLE),
                      "q, k_cache and v_cache must be on one device"),
    "NaN scale": (lambda: da.kv_cache_attention(_Q, *_pools(), _LEN, _TABLE, softmax_scale=float("nan")),
                  "softmax_scale=nan must be finite"),
    "NaN softcap": (lambda: da.kv_cache_attention(_Q, *_pools(), _LEN, _TABLE, softcap=float("nan")),
                    "softcap=nan must be finite and >= 0"),
    "window left -5": (lambda: da.kv_cache_attention(_Q, *_pools(), _LEN, _TABLE, window_size=(-5, 0)),
                       r"window_size=\(-5, 0\): the left side must be -1"),
    "negative softcap": (lambda: da.kv_cache_attention(_Q, *_pools(), _LEN, _TABLE, softcap=-1.0),
                         "softcap=-1.0 must be finite and >= 0"),
    "float cu_seqlens_q": (lambda: da.kv_cache_attention(torch.randn(3, 4, 8), *_pools(), _LEN, _TABLE,
                                                         torch.tensor([0.0, 3.0])),
                           "cu_seqlens_q must be an integer tensor"),
    "cu_seqlens_q past the tokens": (lambda: da.kv_cache_attention(torch.randn(3, 4, 8), *_pools(), _LEN, _TABLE,
                                                                   torch.tensor([0, 5])),
                                     r"cu_seqlens_q \[0, 5\] must rise from 0 to q's 3 tokens"),
    "decreasing cu_seqlens_q": (lambda: da.kv_cache_attention(torch.randn(3, 4, 8), *_pools(), torch.tensor([5, 5]),
                                                              _TABLE.repeat(2, 1), torch.tensor([0, 2, 1])),
                                r"cu_seqlens_q \[0, 2, 1\] must rise from 0 to q's 3 tokens, never decreasing"),
    "append: 3-d pools": (lambda: da.kv_cache_append(*(p[0] for p in _pools()), torch.randn(1, 2, 8),
                                                     torch.randn(1, 2, 8), torch.tensor([0])),
                          "k_cache and v_cache must be 4-d pools alike"),
    "append: kv heads": (lambda: da.kv_cache_append(*_pools(), torch.randn(1, 3, 8), torch.randn(1, 3, 8),
                                                    torch.tensor([0])),
                         r"k \(1, 3, 8\) and v \(1, 3, 8\) must be \[tokens, 2, 8\]"),
    "append: head_dim": (lambda: da.kv_cache_append(*_pools(), torch.randn(1, 2, 4), torch.randn(1, 2, 4),
                                                    torch.tensor([0])),
                         r"k \(1, 2, 4\) and v \(1, 2, 4\) must be \[tokens, 2, 8\]"),
    "append: float slots": (lambda: da.kv_cache_append(*_pools(), torch.randn(1, 2, 8), torch.randn(1, 2, 8),
                                                       torch.tensor([0.0])),
                            "slot_mapping must be an integer tensor"),
    "append: a slot twice": (lambda: da.kv_cache_append(*_pools(), torch.randn(6, 2, 8), torch.randn(6, 2, 8),
                                                        torch.tensor([3, -1, 3, 5, 5, 5])),
                             "slot_mapping gives slot 3 to 2 tokens"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_arguments_are_errors(name):
    """Each malformed argument raises dimattn.Error naming the op and what is wrong,
    never torch's own error, a crash, or a result."""
    call, message = MALFORMED[name]
    op = "kv_cache_append" if name.startswith("append") else "kv_cache_attention"
    with pytest.raises(da.Error, match=rf"^\[{op}\] {message}"):
        call()


@pytest.mark.parametrize("grad", [False, True], ids=["in place", "gathered"])
def test_a_pool_without_blocks_gives_zeros(grad):
    """Sequences of no position over pools of no block (an empty cache): zeros, on
    the kernel reading in place and on the gathered pages (a gradient asked)."""
    q = torch.randn(2, 1, 4, 8, requires_grad=grad)
    out, kernel = _run(q, *_pools(blocks=0), torch.tensor([0, 0]), torch.zeros(2, 3, dtype=torch.int32), None, True,
                       None, (-1, -1), 0.0, None, None, "NHD")
    assert out.shape == (2, 1, 4, 8) and not out.any()
    assert kernel == "cpu_flash"  # in place, or dot_attention's kernel on the gathered pages
    if grad:
        out.sum().backward()
        assert q.grad is not None and not q.grad.any()


def test_a_contiguous_cache_of_more_rows_serves_the_first():
    """FlashAttention's convention: a cache allocated for a larger batch serves
    sequences 0..B-1 from its first rows."""
    q, ks, vs, lens = case(B=2, lens=(70, 33))
    big_k, big_v = torch.cat([ks, torch.randn_like(ks)]), torch.cat([vs, torch.randn_like(vs)])
    got = da.kv_cache_attention(q, big_k, big_v, lens)
    assert torch.equal(got, da.kv_cache_attention(q, ks, vs, lens))
    want = sdpa_per_sequence(q, ks, vs, lens, torch.ones(2, dtype=torch.long))
    assert (got.double() - want).abs().max() < TOL[q.dtype]


def test_no_sequences_give_an_empty_result():
    kp, vp = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    out = da.kv_cache_attention(torch.randn(0, 1, 4, 8), kp, vp, torch.zeros(0, dtype=torch.long),
                                torch.zeros(0, 2, dtype=torch.int32))
    assert out.shape == (0, 1, 4, 8)


def test_compiled_decoding_step_equals_eager():
    """A decoding step under torch.compile(fullgraph=True): one graph, no break (the
    opaque op and its fake), equal to eager on contiguous and paged caches; opcheck on
    the opaque op; with a gradient of q, the eager result."""
    q, ks, vs, lens = case(lens=(70, 1, 5, 33))
    kp, vp, table = paged(ks, vs, lens, 16, hnd=True)

    def step(q, kp, vp, lens, table, ks, vs):
        paged_out = da.kv_cache_attention(q, kp, vp, lens, table, kv_layout="HND", window_size=(40, 0))
        return paged_out * 2 + da.kv_cache_attention(q, ks, vs, lens, softcap=5.0)

    inputs = (q, kp, vp, lens, table, ks, vs)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(*inputs)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    eager = step(*inputs)
    compiled = torch.compile(step, fullgraph=True)(*inputs)
    assert torch.isfinite(eager).all() and (compiled - eager).abs().max() == 0
    # The op's own schema, fake and dispatch checks.
    args = (q, kp, vp, lens, table, None, True, 0.125, -1, 0.0, None, None, True, "auto")
    torch.library.opcheck(da._kv_cache.kv_cache_attention_opaque, args)
    # A gradient of q needs the composite form: without fullgraph dynamo breaks
    # the graph there and the call runs eagerly, gradient included; with it,
    # dynamo refuses (it cannot build the dimattn.Error that says why).
    qg = q.clone().requires_grad_()
    got = torch.compile(step)(qg, *inputs[1:])
    (gq,) = torch.autograd.grad(got.sum(), qg)
    qe = q.clone().requires_grad_()
    (ge,) = torch.autograd.grad(step(qe, *inputs[1:]).sum(), qe)
    assert (got - eager).abs().max() < 1e-6 and gq.abs().max() > 0 and (gq - ge).abs().max() < 1e-6
    torch._dynamo.reset()  # not the graphs compiled above
    with pytest.raises(Exception, match="dimattn"):
        torch.compile(step, fullgraph=True)(q.clone().requires_grad_(), *inputs[1:])


def test_random_cases_match_plain_attention():
    """Seeded random cases over what the tests above fix, against the float64 oracle:
    batch, heads and kv heads (GQA, multi-query), head sizes, lengths (0 to a split
    cache), block sizes, both pool layouts and a contiguous cache, ragged queries
    through cu_seqlens_q, dtypes, scale, window, softcap, ALiBi and sinks."""
    rng = torch.Generator().manual_seed(20261207)

    def below(n):
        return int(torch.randint(n, (1,), generator=rng))

    ran = ragged = contiguous = long = 0
    for i in range(40):
        B, Hkv = 1 + below(4), [1, 2, 4][below(3)]
        H, D = Hkv * [1, 2, 3, 4, 8][below(5)], [8, 16, 32, 64, 128][below(5)]
        Tq = 1 + below(5)
        S = 5000 if below(8) == 0 else 1 + below(300)
        lens = [0 if below(5) == 0 else Tq + below(S - Tq + 1) if S >= Tq else 0 for _ in range(B)]
        dtype = [torch.float32, torch.float32, torch.float32, torch.bfloat16, torch.float16][below(5)]
        q, ks, vs, _ = case(B=B, Tq=Tq, H=H, Hkv=Hkv, D=D, S=S, lens=lens, dtype=dtype, seed=i)
        lens = torch.tensor(lens)
        qlens = torch.where(lens > 0, Tq, 0)
        kw = {}
        if below(3) == 0:
            kw["window_size"] = (below(40), 0)
        if below(4) == 0:
            kw["softcap"] = 1.0 + below(4)
        if below(4) == 0:
            kw["softmax_scale"] = 0.05 + 0.1 * below(5)
        if below(4) == 0:
            kw["alibi_slopes"] = torch.linspace(0.01, 0.3, H)
        if below(4) == 0:
            kw["sinks"] = torch.linspace(-1.0, 2.0, H)
        what = f"case {i}: B {B} heads {H}/{Hkv} D {D} Tq {Tq} lens {lens.tolist()} {dtype} {sorted(kw)}"
        if below(4) == 0:  # a contiguous cache
            got = da.kv_cache_attention(q, ks, vs, lens, **kw)
            contiguous += 1
        else:
            block, hnd = [1, 3, 16, 17, 64, 128][below(6)], below(2) == 1
            kp, vp, table = paged(ks, vs, lens, block, hnd, seed=i)
            layout = "HND" if hnd else "NHD"
            what += f" block {block} {layout}"
            if Tq > 1 and below(2) == 0:  # ragged: each sequence's own count of new rows
                qlens = torch.tensor([below(min(Tq, int(n)) + 1) if n > 0 else 0 for n in lens])
                packed = torch.cat([q[b, :int(qlens[b])] for b in range(B)])
                cu = torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)])
                out = da.kv_cache_attention(packed, kp, vp, lens, table, cu_seqlens_q=cu, kv_layout=layout, **kw)
                got = torch.zeros(B, Tq, H, D, dtype=out.dtype)
                for b in range(B):
                    got[b, :int(qlens[b])] = out[int(cu[b]):int(cu[b + 1])]
                ragged += 1
            else:
                got = da.kv_cache_attention(q, kp, vp, lens, table, kv_layout=layout, **kw)
        long += S > 4096
        want = sdpa_per_sequence(q, ks, vs, lens, qlens, scale=kw.get("softmax_scale"),
                                 window=kw.get("window_size", (-1, 0))[0], softcap=kw.get("softcap", 0.0),
                                 slopes=kw.get("alibi_slopes"), sinks=kw.get("sinks"))
        valid = torch.arange(Tq)[None, :] < qlens[:, None]  # rows past a sequence's new ones: not compared
        err = (got.double() - want).abs()[valid].max().item() if valid.any() else 0.0
        assert torch.isfinite(got[valid]).all(), what
        assert err < TOL[dtype], f"{what}: max error {err}"
        ran += 1
    assert ran == 40 and ragged >= 3 and contiguous >= 3 and long >= 2, (ran, ragged, contiguous, long)
