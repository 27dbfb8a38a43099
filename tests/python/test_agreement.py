"""dot_attention from Python against torch's SDPA on plain cases and against
the forced reference path (and plain torch) on the cases only dimattn has."""
import pytest
import torch
import torch.nn.functional as F

import dimattn as da
from conftest import masked_attention, named

B, H, T, D = 2, 3, 6, 8


def dims():
    return da.Dim("batch", B), da.Dim("heads", H), da.Dim("time", T), da.Dim("feat", D), da.Dim("vfeat", D)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_float32(causal):
    batch, heads, time, feat, vfeat = dims()
    q, k = named([batch, heads, time, feat], 1), named([batch, heads, time, feat], 2)
    v = named([batch, heads, time, vfeat], 3)
    out = da.dot_attention(q, k, v, key_dim=feat, axis=time, causal_query_spatial_dim=time if causal else None)
    assert out.dims == (batch, heads, time, vfeat)
    ref = F.scaled_dot_product_attention(q.raw, k.raw, v.raw, is_causal=causal)
    assert (out.raw - ref).abs().max() <= 1e-5


def test_matches_sdpa_bfloat16():
    batch, heads, time, feat, vfeat = dims()
    q, k = named([batch, heads, time, feat], 1, torch.bfloat16), named([batch, heads, time, feat], 2, torch.bfloat16)
    v = named([batch, heads, time, vfeat], 3, torch.bfloat16)
    out = da.dot_attention(q, k, v, key_dim=feat, axis=time)
    assert out.raw.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q.raw.float(), k.raw.float(), v.raw.float())
    assert (out.raw.float() - ref).abs().max() <= 2e-2  # docs/numerics.md


def test_dims_in_any_order_and_cross_attention_with_same_names():
    # Query time and kv time share a name but not an identity: cross-attention.
    batch, heads, time, feat, vfeat = dims()
    kv_time = da.Dim("time", 9)
    q = named([heads, feat, time, batch], 1)
    k = named([kv_time, batch, feat, heads], 2)
    v = named([batch, vfeat, heads, kv_time], 3)
    out = da.dot_attention(q, k, v, key_dim=feat, axis=kv_time)
    ref = F.scaled_dot_product_attention(q.raw_in([batch, heads, time, feat]), k.raw_in([batch, heads, kv_time, feat]),
                                         v.raw_in([batch, heads, kv_time, vfeat]))
    assert (out.raw_in([batch, heads, time, vfeat]) - ref).abs().max() <= 1e-5


def both(fn):
    """fn() as selected and with the reference path forced."""
    auto = fn()
    with da.force("reference"):
        ref = fn()
    assert auto.dims == ref.dims
    return auto, ref


def test_dynamic_lengths_causal_padded_rows():
    batch, heads, _, feat, vfeat = dims()
    lens = da.Tensor(torch.tensor([6, 4]), [batch])
    time = da.Dim.dynamic("time", lens)
    q, k = named([batch, heads, (time, T), feat], 1), named([batch, heads, (time, T), feat], 2)
    v = named([batch, heads, (time, T), vfeat], 3)
    auto, ref = both(lambda: da.dot_attention(q, k, v, key_dim=feat, axis=time, causal_query_spatial_dim=time))
    assert (auto.raw - ref.raw).abs().max() <= 1e-5
    # Plain torch: causal and kv padding (only j <= i and j < length); every
    # row keeps position 0, so padded query rows are defined too.
    i = torch.arange(T)
    mask = (i[None, :] <= i[:, None])[None, None] & (i[None, None, None, :] < lens.raw[:, None, None, None])
    plain = masked_attention(q.raw, k.raw, v.raw, mask)
    assert (ref.raw - plain).abs().max() <= 1e-5


def test_causal_offset_chunk_after_history():
    batch, heads, _, feat, vfeat = dims()
    chunk, kv = da.Dim("chunk", 3), da.Dim("kv", 7)
    offset = da.Tensor(torch.tensor([4, 2]), [batch])
    q, k, v = named([batch, heads, chunk, feat], 1), named([batch, heads, kv, feat], 2), named([batch, heads, kv, vfeat], 3)
    auto, ref = both(lambda: da.dot_attention(q, k, v, key_dim=feat, axis=kv, causal_query_spatial_dim=chunk,
                                              causal_offset=offset))
    assert (auto.raw - ref.raw).abs().max() <= 1e-5
    i, j = torch.arange(3), torch.arange(7)
    mask = j[None, None, None, :] <= (i[None, :, None] + offset.raw[:, None, None])[:, None]
    assert (ref.raw - masked_attention(q.raw, k.raw, v.raw, mask)).abs().max() <= 1e-5
    # An int offset is the same offset for every entry.
    out = da.dot_attention(q, k, v, key_dim=feat, axis=kv, causal_query_spatial_dim=chunk, causal_offset=4)
    assert (out.raw[0] - auto.raw[0]).abs().max() <= 1e-6


def test_beam_cross_attention_without_tiling():
    batch, heads, _, feat, vfeat = dims()
    beam, dec, enc = da.Dim("beam", 4), da.Dim("dec", 2), da.Dim("enc", 5)
    q = named([batch, beam, heads, dec, feat], 1)
    k, v = named([batch, heads, enc, feat], 2), named([batch, heads, enc, vfeat], 3)
    auto, ref = both(lambda: da.dot_attention(q, k, v, key_dim=feat, axis=enc))
    assert set(auto.dims) == {batch, beam, heads, dec, vfeat}
    assert (auto.raw - ref.raw).abs().max() <= 1e-5
    tiled = F.scaled_dot_product_attention(q.raw_in([batch, beam, heads, dec, feat]), k.raw[:, None], v.raw[:, None])
    assert (auto.raw_in([batch, beam, heads, dec, vfeat]) - tiled).abs().max() <= 1e-5


def test_keys_only_dims_and_values_with_key_dim():
    batch, heads, time, feat, _ = dims()
    kv, extra = da.Dim("kv", 5), da.Dim("extra", 2)
    q = named([batch, heads, time, feat], 1)
    k = named([batch, extra, heads, kv, feat], 2)
    v = named([batch, extra, heads, kv, feat], 3)  # values carry key_dim itself
    auto, ref = both(lambda: da.dot_attention(q, k, v, key_dim=feat, axis=kv))
    assert set(auto.dims) == {batch, heads, time, feat, extra}
    assert (auto.raw - ref.raw).abs().max() <= 1e-5
    plain = F.scaled_dot_product_attention(q.raw[:, None], k.raw, v.raw)
    assert (auto.raw_in([batch, extra, heads, time, feat]) - plain).abs().max() <= 1e-5


def test_history_lengths_over_batch_and_time():
    # A per-step history: each query step has its own kv set whose length
    # depends on batch entry and step (causal self-attention with state).
    batch, _, _, feat, vfeat = dims()
    time = da.Dim("time", 4)
    lens = da.Tensor(torch.tensor([[1, 2, 3, 4], [2, 2, 0, 1]]), [batch, time])
    hist = da.Dim.dynamic("hist", lens)
    q = named([batch, time, feat], 1)
    k, v = named([batch, time, (hist, 4), feat], 2), named([batch, time, (hist, 4), vfeat], 3)
    auto, ref = both(lambda: da.dot_attention(q, k, v, key_dim=feat, axis=hist))
    assert set(auto.dims) == {batch, time, vfeat}
    assert (auto.raw - ref.raw).abs().max() <= 1e-5
    mask = torch.arange(4)[None, None, None, :] < lens.raw[:, :, None, None]
    plain = masked_attention(q.raw[:, :, None], k.raw, v.raw, mask)[:, :, 0]
    assert (auto.raw_in([batch, time, vfeat]) - plain).abs().max() <= 1e-5
    assert (auto.raw_in([batch, time, vfeat])[1, 2] == 0).all()  # no valid kv position: 0, not NaN


@pytest.mark.parametrize("kernel", ["cpu_flash", "reference"])
def test_kv_lengths_per_query_row(kernel):
    """A chunk attending a history whose lengths vary over the batch and the chunk's
    own time dim, which keys and values lack (each query row its own kv length, a
    row of length 0 among them), against plain torch, with gradients."""
    batch, heads, _, feat, vfeat = dims()
    time = da.Dim("time", 4)
    lens = torch.tensor([[1, 3, 5, 2], [0, 5, 4, 2]])
    hist = da.Dim.dynamic("hist", da.Tensor(lens, [batch, time]))
    q = named([batch, heads, time, feat], 1, torch.float64, requires_grad=True)
    k = named([batch, heads, (hist, 5), feat], 2, torch.float64, requires_grad=True)
    v = named([batch, heads, (hist, 5), vfeat], 3, torch.float64, requires_grad=True)
    with da.force(kernel), da.trace(capture_tensors=False) as t:
        out = da.dot_attention(q, k, v, key_dim=feat, axis=hist)
    assert [r.kernel for r in t.records] == [kernel]
    assert set(out.dims) == {batch, heads, time, vfeat}
    got = out.raw_in([batch, heads, time, vfeat])

    # Plain torch, without NaN in the gradients of the empty row: masked scores
    # far below the others (exp gives exactly 0), and that row's output times 0.
    mask = torch.arange(5) < lens[:, None, :, None]  # [batch, 1, time, hist]
    e = (q.raw @ k.raw.transpose(-1, -2)) / D ** 0.5
    plain = torch.softmax(e.masked_fill(~mask, -1e30), -1) @ v.raw * mask.any(-1, keepdim=True)
    assert (got - plain).abs().max() <= 1e-12
    assert (got[1, :, 0] == 0).all()  # no kv position: 0, not NaN
    w = torch.randn_like(plain)
    grads = torch.autograd.grad((got * w).sum(), (q.raw, k.raw, v.raw))
    want = torch.autograd.grad((plain * w).sum(), (q.raw, k.raw, v.raw))
    for name, a, b in zip("qkv", grads, want):
        assert (a - b).abs().max() <= 1e-12, name


def test_single_step_query():
    batch, heads, time, feat, vfeat = dims()
    q = named([batch, heads, feat], 1)
    k, v = named([batch, heads, time, feat], 2), named([batch, heads, time, vfeat], 3)
    out = da.dot_attention(q, k, v, key_dim=feat, axis=time)
    assert out.dims == (batch, heads, vfeat)
    ref = F.scaled_dot_product_attention(q.raw[:, :, None], k.raw, v.raw)[:, :, 0]
    assert (out.raw - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("broadcast", [False, True])
def test_dropout_same_mask_on_kernel_and_reference(broadcast):
    batch, heads, time, feat, vfeat = dims()
    q, k = named([batch, heads, time, feat], 1), named([batch, heads, time, feat], 2)
    v = named([batch, heads, time, vfeat], 3)

    def call():
        torch.manual_seed(7)
        return da.dot_attention(q, k, v, key_dim=feat, axis=time, att_dropout=0.3, att_dropout_broadcast=broadcast,
                                train=True)

    with da.force("cpu_flash"):
        fused = call()
    with da.force("reference"):
        ref = call()
    assert (fused.raw - ref.raw).abs().max() <= 1e-5
    assert torch.equal(call().raw, call().raw)  # torch.manual_seed reproduces a run
    no_dropout = da.dot_attention(q, k, v, key_dim=feat, axis=time)
    assert (fused.raw - no_dropout.raw).abs().max() > 1e-3
    if broadcast:
        with da.trace() as t:
            call()
        w = t.records[0].att_weights.raw_in([batch, heads, time, t.records[0].att_weights.dims[-1]])
        dropped = w == 0
        assert (dropped == dropped[:1, :1, :1]).all()  # one mask over the kv axis only


def test_train_flag_decides_dropout():
    batch, heads, time, feat, vfeat = dims()
    q, k = named([batch, heads, time, feat], 1), named([batch, heads, time, feat], 2)
    v = named([batch, heads, time, vfeat], 3)
    plain = da.dot_attention(q, k, v, key_dim=feat, axis=time)
    off = da.dot_attention(q, k, v, key_dim=feat, axis=time, att_dropout=0.5)
    assert torch.equal(off.raw, plain.raw)
    with da.train_scope(True):
        assert da.train_flag()
        on = da.dot_attention(q, k, v, key_dim=feat, axis=time, att_dropout=0.5)
        off_again = da.dot_attention(q, k, v, key_dim=feat, axis=time, att_dropout=0.5, train=False)
    assert not torch.equal(on.raw, plain.raw)
    assert torch.equal(off_again.raw, plain.raw)
