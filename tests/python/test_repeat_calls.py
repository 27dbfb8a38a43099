"""Repeated calls reuse what they can (the Python encoding per Dims and options, the
op's per-thread plan per spec and shapes) and nothing else: lengths are read on
every call, a spec met with other sizes gets its own Dims, dropout draws a new seed
per call, and threads do not share plans."""
import threading

import pytest
import torch
import torch.nn.functional as F

import dimattn as da
from conftest import masked_attention, named

B, H, T, D = 2, 3, 6, 8


def test_lengths_are_read_on_every_call():
    batch, heads, feat, vfeat = da.Dim("batch", B), da.Dim("heads", H), da.Dim("feat", D), da.Dim("vfeat", D)
    lens = da.Tensor(torch.tensor([6, 4]), [batch])
    time = da.Dim.dynamic("time", lens)
    q, k = named([batch, heads, (time, T), feat], 1), named([batch, heads, (time, T), feat], 2)
    v = named([batch, heads, (time, T), vfeat], 3)
    for values in ([6, 4], [2, 5], [6, 6], [1, 3]):
        lens.raw.copy_(torch.tensor(values))  # the same Dims and lengths tensor, new values
        out = da.dot_attention(q, k, v, key_dim=feat, axis=time)
        mask = torch.arange(T)[None, None, None, :] < lens.raw[:, None, None, None]
        assert (out.raw - masked_attention(q.raw, k.raw, v.raw, mask)).abs().max() <= 1e-5, values
    # A new dynamic Dim of the same name and extent: the same spec and shapes,
    # its own lengths.
    lens2 = da.Tensor(torch.tensor([3, 6]), [batch])
    time2 = da.Dim.dynamic("time", lens2)
    q2, k2 = da.Tensor(q.raw, [batch, heads, time2, feat]), da.Tensor(k.raw, [batch, heads, time2, feat])
    v2 = da.Tensor(v.raw, [batch, heads, time2, vfeat])
    out = da.dot_attention(q2, k2, v2, key_dim=feat, axis=time2)
    mask = torch.arange(T)[None, None, None, :] < lens2.raw[:, None, None, None]
    assert (out.raw - masked_attention(q.raw, k.raw, v.raw, mask)).abs().max() <= 1e-5


def test_one_spec_with_other_sizes():
    # Dims of the same names encode to the same spec; each size gets its own plan.
    for t, d in ((6, 8), (9, 8), (6, 4), (6, 8)):
        batch, heads, time, feat, vfeat = (da.Dim("batch", B), da.Dim("heads", H), da.Dim("time", t),
                                           da.Dim("feat", d), da.Dim("vfeat", d))
        q, k = named([batch, heads, time, feat], 1), named([batch, heads, time, feat], 2)
        v = named([batch, heads, time, vfeat], 3)
        for _ in range(2):
            out = da.dot_attention(q, k, v, key_dim=feat, axis=time, causal_query_spatial_dim=time)
            assert out.dims == (batch, heads, time, vfeat)
            ref = F.scaled_dot_product_attention(q.raw, k.raw, v.raw, is_causal=True)
            assert (out.raw - ref).abs().max() <= 1e-5


def test_repeated_dropout_calls_draw_new_seeds():
    batch, heads, time, feat, vfeat = (da.Dim("batch", B), da.Dim("heads", H), da.Dim("time", T),
                                       da.Dim("feat", D), da.Dim("vfeat", D))
    q, k = named([batch, heads, time, feat], 1), named([batch, heads, time, feat], 2)
    v = named([batch, heads, time, vfeat], 3)

    def calls():
        torch.manual_seed(7)
        return [da.dot_attention(q, k, v, key_dim=feat, axis=time, att_dropout=0.5, train=True).raw
                for _ in range(3)]

    first, again = calls(), calls()
    for a, b in zip(first, again):
        assert torch.equal(a, b)  # torch.manual_seed reproduces each call
    assert not torch.equal(first[1], first[2])  # and each call has its own mask


def test_threads_get_their_own_plans():
    errors = []

    def worker(i):
        try:
            t = 4 + i
            batch, heads, time, feat, vfeat = (da.Dim("batch", B), da.Dim("heads", H), da.Dim("time", t),
                                               da.Dim("feat", D), da.Dim("vfeat", D))
            q, k = named([batch, heads, time, feat], i), named([batch, heads, time, feat], i + 10)
            v = named([batch, heads, time, vfeat], i + 20)
            ref = F.scaled_dot_product_attention(q.raw, k.raw, v.raw)
            for _ in range(50):
                out = da.dot_attention(q, k, v, key_dim=feat, axis=time)
                assert (out.raw - ref).abs().max() <= 1e-5
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def test_dynamic_axis_in_no_operand_keeps_its_message():
    # The op's plan makes Dims from the tensors' shapes; a dynamic axis that no
    # tensor has still reaches dot_attention's own check, named with its lengths.
    batch, heads, feat, kv = da.Dim("batch", B), da.Dim("heads", H), da.Dim("feat", D), da.Dim("kv", T)
    q, k = named([batch, heads, kv, feat], 1), named([batch, heads, kv, feat], 2)
    other = da.Dim.dynamic("other", da.Tensor(torch.tensor([3, 2]), [batch]))
    with pytest.raises(da.Error, match=r"axis other\[<=3 over batch\] is not in keys"):
        da.dot_attention(q, k, k, key_dim=feat, axis=other)


def test_a_plain_call_repeated_hits_the_fast_path(monkeypatch):
    """dot_attention's fast path and the cache behind it make one key
    (_call.encoding_key): a plain call repeated finds its encoding there, without
    the general path; a call with a new option misses and takes it."""
    from dimattn import _call
    batch, heads, time, feat = da.Dim("batch", B), da.Dim("heads", H), da.Dim("time", T), da.Dim("feat", D)
    q = named([batch, heads, time, feat], 1)
    kw = dict(key_dim=feat, axis=time, causal_query_spatial_dim=time, scale=0.3)
    first = da.dot_attention(q, q, q, **kw)  # encodes, through the general path
    general = []
    monkeypatch.setattr(_call, "cached_encoding", lambda *a: general.append(a) or pytest.fail("general path"))
    again = da.dot_attention(q, q, q, **kw)
    assert torch.equal(first.raw, again.raw) and not general
    with pytest.raises(pytest.fail.Exception, match="general path"):
        da.dot_attention(q, q, q, **{**kw, "scale": 0.4})
