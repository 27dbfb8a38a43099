"""Packed (varlen) attention: dimattn.varlen_attention and packed_attention against
torch's SDPA run on each sequence alone, with gradients, GQA, cross-attention,
gaps between sequences, dropout, bad input, and seeded random packings."""
import pytest
import torch
import torch.nn.functional as F

import dimattn as da

LENGTHS = {"mixed": [5, 0, 1, 7], "one": [1], "empty": [0, 0], "long_odd": [33, 64, 127]}


def packed(lengths, heads, dim, seed, gap=0):
    """A [tokens, heads, dim] tensor of the sequences laid end to end (gap tokens
    between them) and their starts."""
    g = torch.Generator().manual_seed(seed)
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n + gap
    return torch.randn(at, heads, dim, generator=g, requires_grad=True), torch.tensor(starts)


def per_sequence(q, k, v, starts_q, lens_q, starts_k, lens_k, causal):
    """Each sequence alone through SDPA, written into a zero [tokens_q, heads, Dv]."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    group = q.shape[1] // k.shape[1]
    for s_q, l_q, s_k, l_k in zip(starts_q.tolist(), lens_q.tolist(), starts_k.tolist(), lens_k.tolist()):
        if l_q == 0 or l_k == 0:
            continue
        qs = q[s_q:s_q + l_q].transpose(0, 1)
        ks = k[s_k:s_k + l_k].transpose(0, 1).repeat_interleave(group, 0)
        vs = v[s_k:s_k + l_k].transpose(0, 1).repeat_interleave(group, 0)
        mask = None
        if causal:  # query i sees kv j <= i + l_k - l_q (bottom-right)
            mask = torch.arange(l_k)[None, :] <= torch.arange(l_q)[:, None] + (l_k - l_q)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        if mask is not None:
            o = torch.where(mask.any(1)[None, :, None], o, 0)  # rows that see nothing give 0
        out = out.index_copy(0, torch.arange(s_q, s_q + l_q), o.transpose(0, 1))
    return out


def assert_close_with_grads(out, ref, inputs, tol):
    assert out.shape == ref.shape
    if out.numel() == 0:  # no tokens: empty gradients, still through autograd
        assert all(g.shape == x.shape for g, x in zip(torch.autograd.grad(out.sum(), inputs), inputs))
        return
    assert (out - ref).abs().max() <= tol
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, g, allow_unused=True)
    want = torch.autograd.grad(ref, inputs, g, allow_unused=True)
    for a, b in zip(got, want):
        a = torch.zeros_like(b) if a is None else a
        assert (a - b).abs().max() <= tol


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_varlen_matches_each_sequence_alone(lengths, heads, causal):
    (h, h_kv), d = heads, 8
    q, starts = packed(lengths, h, d, 1)
    k, _ = packed(lengths, h_kv, d, 2)
    v, _ = packed(lengths, h_kv, 6, 3)
    lens = torch.tensor(lengths)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    with da.trace(capture_tensors=False) as t:
        out = da.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)
    assert out.shape == (sum(lengths), h, 6)
    # One packing for query and keys: one call over the tokens as they are, on the fused kernel.
    assert [r.kernel for r in t.records] == (["cpu_flash"] if sum(lengths) else [])
    ref = per_sequence(q, k, v, starts, lens, starts, lens, causal)
    assert_close_with_grads(out, ref, (q, k, v), 2e-5)


def test_random_packings_match_each_sequence_alone():
    """Seeded random cases over what the tests around fix: 1-6 sequences of 0-80
    tokens (sometimes 300), self- or cross-attention (own kv lengths), gaps between
    the sequences on either side, GQA and multi-query heads, head sizes (value
    features of their own size), causal or not, a scale; outputs and gradients
    against SDPA on each sequence alone."""
    rng = torch.Generator().manual_seed(20261207)

    def below(n):
        return int(torch.randint(n, (1,), generator=rng))

    ran = cross = gaps = 0
    for i in range(30):
        n = 1 + below(6)
        lq = [0 if below(6) == 0 else 1 + below(300 if below(8) == 0 else 80) for _ in range(n)]
        lk = list(lq) if below(2) == 0 else [0 if x == 0 else 1 + below(80) for x in lq]
        h_kv = [1, 2, 4][below(3)]
        h, d, dv = h_kv * [1, 2, 3, 4][below(4)], [4, 8, 16, 64][below(4)], [4, 6, 16, 64][below(4)]
        gap_q, gap_k = [0, 0, 1, 3][below(4)], [0, 0, 2][below(3)]
        causal, scale = below(2) == 1, [None, 0.3][below(2)]
        q, starts_q = packed(lq, h, d, 3 * i, gap=gap_q)
        k, starts_k = packed(lk, h_kv, d, 3 * i + 1, gap=gap_k)
        v, _ = packed(lk, h_kv, dv, 3 * i + 2, gap=gap_k)
        lens_q, lens_k = torch.tensor(lq), torch.tensor(lk)
        out = da.packed_attention(q, k, v, starts_q, lens_q, starts_k, lens_k, max(lq), max(lk), causal=causal,
                                  scale=scale)
        mul = 1.0 if scale is None else scale * d ** 0.5  # per_sequence scales by 1/sqrt(d)
        ref = per_sequence(q * mul, k, v, starts_q, lens_q, starts_k, lens_k, causal)
        try:
            assert_close_with_grads(out, ref, (q, k, v), 5e-5)
        except AssertionError as e:
            raise AssertionError(f"case {i}: lq {lq} lk {lk} heads {h}/{h_kv} d {d}/{dv} gaps {gap_q},{gap_k} "
                                 f"causal {causal} scale {scale}") from e
        ran += 1
        cross += lq != lk
        gaps += gap_q > 0 or gap_k > 0
    assert ran == 30 and cross >= 3 and gaps >= 3, (ran, cross, gaps)


@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention_with_gaps(causal):
    """Query and kv sequences of different lengths, gaps between the sequences
    (RETURNN's packed layout): gap rows of the output are 0 and get no gradient."""
    lq, lk = [3, 4, 0, 2], [5, 1, 2, 2]
    q, starts_q = packed(lq, 4, 8, 4, gap=2)
    k, starts_k = packed(lk, 2, 8, 5, gap=1)
    v, _ = packed(lk, 2, 8, 6, gap=1)
    lens_q, lens_k = torch.tensor(lq, dtype=torch.int32), torch.tensor(lk, dtype=torch.int32)
    out = da.packed_attention(q, k, v, starts_q, lens_q, starts_k, lens_k, 4, 5, causal=causal, scale=0.3)
    ref = per_sequence(q * (0.3 * 8 ** 0.5), k, v, starts_q, lens_q, starts_k, lens_k, causal)
    gap_rows = torch.ones(q.shape[0], dtype=torch.bool)
    for s, n in zip(starts_q.tolist(), lq):
        gap_rows[s:s + n] = False
    assert gap_rows.sum() == 8 and (out[gap_rows] == 0).all()
    assert_close_with_grads(out, ref, (q, k, v), 2e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_one_packing_with_gaps(causal):
    """Query and keys of one packing with gaps between the sequences (one call over
    the tokens, segment ids): gap rows are 0, attend nothing and are attended by
    nothing (their keys and values get no gradient)."""
    lengths = [3, 6, 1]
    q, starts = packed(lengths, 2, 8, 17, gap=2)
    k, _ = packed(lengths, 2, 8, 18, gap=2)
    v, _ = packed(lengths, 2, 8, 19, gap=2)
    lens = torch.tensor(lengths)
    out = da.packed_attention(q, k, v, starts, lens, starts, lens, 6, 6, causal=causal)
    gap = torch.ones(q.shape[0], dtype=torch.bool)
    for s0, n in zip(starts.tolist(), lengths):
        gap[s0:s0 + n] = False
    assert gap.sum() == 6 and (out[gap] == 0).all()
    ref = per_sequence(q, k, v, starts, lens, starts, lens, causal)
    assert_close_with_grads(out, ref, (q, k, v), 2e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_other_packings_run_in_one_call(causal):
    """Query and kv sequences of equal lengths but packed apart (other gaps): one
    call over both token dims as they are, each query row's causal end its kv
    length."""
    lengths = [5, 0, 1, 7, 40]
    q, starts_q = packed(lengths, 4, 8, 14, gap=1)
    k, starts_k = packed(lengths, 2, 8, 15)
    v, _ = packed(lengths, 2, 8, 16)
    lens = torch.tensor(lengths)
    with da.trace(capture_tensors=False) as t:
        out = da.packed_attention(q, k, v, starts_q, lens, starts_k, lens, 40, 40, causal=causal)
    assert [r.kernel for r in t.records] == ["cpu_flash"]
    ref = per_sequence(q, k, v, starts_q, lens, starts_k, lens, causal)
    assert_close_with_grads(out, ref, (q, k, v), 2e-5)


def test_dropout_same_mask_on_kernel_and_reference():
    lengths = [6, 9, 3]
    q, _ = packed(lengths, 2, 8, 7)
    k, _ = packed(lengths, 2, 8, 8)
    v, _ = packed(lengths, 2, 8, 9)
    cu = torch.tensor([0, 6, 15, 18])

    def call():
        torch.manual_seed(3)
        return da.varlen_attention(q, k, v, cu, cu, 9, 9, causal=True, dropout_p=0.4)

    with da.force("cpu_flash"):
        fused = call()
    with da.force("reference"):
        ref = call()
    assert (fused - ref).abs().max() <= 1e-5
    assert torch.equal(call(), call())
    assert (fused - da.varlen_attention(q, k, v, cu, cu, 9, 9, causal=True)).abs().max() > 1e-3
    g = torch.randn_like(fused)
    for a, b in zip(torch.autograd.grad(fused, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert (a - b).abs().max() <= 1e-5


def test_dropout_other_packings_same_mask_on_kernel_and_reference():
    """Cross-attention with gaps and longer queries than keys (rows that see nothing)."""
    lq, lk = [4, 7, 2], [6, 3, 2]
    q, starts_q = packed(lq, 2, 8, 20, gap=1)
    k, starts_k = packed(lk, 2, 8, 21, gap=2)
    v, _ = packed(lk, 2, 8, 22, gap=2)
    lens_q, lens_k = torch.tensor(lq), torch.tensor(lk)

    def call():
        torch.manual_seed(5)
        return da.packed_attention(q, k, v, starts_q, lens_q, starts_k, lens_k, 7, 6, causal=True, dropout_p=0.3)

    with da.force("cpu_flash"):
        fused = call()
    with da.force("reference"):
        ref = call()
    assert (fused - ref).abs().max() <= 1e-5
    assert (fused - da.packed_attention(q, k, v, starts_q, lens_q, starts_k, lens_k, 7, 6, causal=True)).abs().max() > 1e-3
    g = torch.randn_like(fused)
    for a, b in zip(torch.autograd.grad(fused, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert (a - b).abs().max() <= 1e-5


def test_bfloat16():
    lengths = [17, 40]
    q, starts = packed(lengths, 4, 16, 10)
    k, _ = packed(lengths, 4, 16, 11)
    v, _ = packed(lengths, 4, 16, 12)
    cu = torch.tensor([0, 17, 57])
    out = da.varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, cu, 40, 40, causal=True)
    ref = per_sequence(q, k, v, starts, cu.diff(), starts, cu.diff(), True)
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max() <= 3e-2


BAD = {
    "query_not_3d": (lambda q, k, v, cu: (q[0], k, v, cu, cu, 4, 4), "query must be a [tokens, heads, D]"),
    "heads_not_multiple": (lambda q, k, v, cu: (q, k[:, :3], v[:, :3], cu, cu, 4, 4), "multiple of key's 3 heads"),
    "length_above_max": (lambda q, k, v, cu: (q, k, v, cu, cu, 3, 4), "length 4 > the given maximum 3"),
    "past_tokens": (lambda q, k, v, cu: (q, k, v, cu + 1, cu, 4, 4), "ends at token 8, past the 7 tokens"),
    "sequence_counts": (lambda q, k, v, cu: (q, k, v, cu, cu[:2], 4, 4), "2 query sequences but 1 kv"),
    "float_offsets": (lambda q, k, v, cu: (q, k, v, cu.float(), cu, 4, 4), "int32/int64"),
}


@pytest.mark.parametrize("case", BAD.keys())
def test_bad_input_is_a_clear_error(case):
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 4, 8), torch.randn(7, 4, 8)
    make, message = BAD[case]
    with pytest.raises(da.Error, match=r"\[varlen_attention\].*" + message.replace("[", r"\[").replace("(", r"\(")):
        da.varlen_attention(*make(q, k, v, torch.tensor([0, 3, 7])))


def test_sequences_that_share_tokens_are_an_error():
    """A token's sequence is its segment id: two sequences of one side may not share a token."""
    q, k, v = torch.randn(7, 2, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    lens = torch.tensor([3, 4])
    with pytest.raises(da.Error, match=r"\[packed_attention\] kv sequences 0 and 1 share tokens \(tokens 0..2 and 2..5\)"):
        da.packed_attention(q, k, v, torch.tensor([0, 3]), lens, torch.tensor([0, 2]), lens, 4, 4)
    # Touching sequences and empty ones anywhere are fine.
    out = da.packed_attention(q, k, v, torch.tensor([0, 3, 1]), torch.tensor([3, 4, 0]), torch.tensor([0, 3, 0]),
                              torch.tensor([3, 4, 0]), 4, 4)
    assert out.shape == (7, 2, 8)
