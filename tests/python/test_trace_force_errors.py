"""Tracing, forcing and explain from Python; errors as dimattn.Error naming dims."""
import pytest
import torch

import dimattn as da
from conftest import named

B, H, T, D = 2, 3, 5, 4


def operands():
    batch, heads, time, feat, vfeat = (da.Dim("batch", B), da.Dim("heads", H), da.Dim("time", T), da.Dim("feat", D),
                                       da.Dim("vfeat", D))
    q, k = named([batch, heads, time, feat], 1), named([batch, heads, time, feat], 2)
    v = named([batch, heads, time, vfeat], 3)
    return q, k, v, batch, heads, time, feat, vfeat


def test_trace_records_energy_and_weights():
    q, k, v, batch, heads, time, feat, vfeat = operands()
    with da.trace() as t:
        out = da.dot_attention(q, k, v, key_dim=feat, axis=time, causal_query_spatial_dim=time)
    (r,) = t.records
    assert r.kernel == "reference" and r.output is out
    kv = r.energy.dims[-1]
    assert r.energy.dims == (batch, heads, time, kv) and kv.name == "time'" and kv is not time
    e = r.energy.raw
    assert torch.allclose(e, q.raw @ k.raw.transpose(-1, -2) / D**0.5, atol=1e-5)
    w = r.att_weights.raw
    assert torch.allclose(w.sum(-1), torch.ones(B, H, T), atol=1e-6)
    assert (w.triu(1) == 0).all()  # causal
    assert torch.allclose(w @ v.raw, out.raw_in([batch, heads, time, vfeat]), atol=1e-5)


def test_trace_without_capture_names_the_kernel_and_nests():
    q, k, v, batch, heads, time, feat, vfeat = operands()
    with da.trace(capture_tensors=False) as outer:
        with da.force("aten_math"):
            da.dot_attention(q, k, v, key_dim=feat, axis=time)
        with da.trace() as inner:
            da.dot_attention(q, k, v, key_dim=feat, axis=time)
    assert [r.kernel for r in outer.records] == ["aten_math", "reference"]
    assert outer.records[0].energy is None and outer.records[1].energy is None
    assert len(inner.records) == 1 and inner.records[0].energy is not None


def test_capturing_trace_with_kernels_forced_away_from_reference_is_an_error():
    q, k, v, batch, heads, time, feat, vfeat = operands()
    with da.trace(), da.force("cpu_flash"), pytest.raises(da.Error, match="needs the reference path"):
        da.dot_attention(q, k, v, key_dim=feat, axis=time)


def test_traced_output_keeps_autograd():
    q, k, v, batch, heads, time, feat, vfeat = operands()
    q.raw.requires_grad_(True)
    with da.trace():
        out = da.dot_attention(q, k, v, key_dim=feat, axis=time)
    (g,) = torch.autograd.grad(out.raw.sum(), q.raw)
    assert g.shape == q.raw.shape


def test_force_and_explain():
    q, k, v, batch, heads, time, feat, vfeat = operands()
    assert "reference" in da.kernel_names() and "cpu_flash" in da.kernel_names()
    d = da.explain(q, k, v, key_dim=feat, axis=time)
    assert d.kernel == "cpu_flash" and d.rejected == []
    with da.force("aten_flash_cpu,reference"):
        d = da.explain(q, k, v, key_dim=feat, axis=time, att_dropout=0.1, train=True)
    assert d.kernel == "reference"
    reasons = {r.kernel: r.reason for r in d.rejected}
    assert "dropout" in reasons["aten_flash_cpu"] and "not among the forced kernels" in reasons["cpu_flash"]
    assert "aten_flash_cpu" in str(d)
    with pytest.raises(da.Error, match="unknown kernel no_such"):
        da.force("no_such")


def test_force_takes_a_list_and_explain_is_structured():
    q, k, v, batch, heads, time, feat, vfeat = operands()
    with da.force(["aten_flash_cpu", "reference"]):
        d = da.explain(q, k, v, key_dim=feat, axis=time, att_dropout=0.1, train=True)
        # The forcing reaches a call as a list too: the kernel is the one explain names.
        with da.trace(capture_tensors=False) as t:
            da.dot_attention(q, k, v, key_dim=feat, axis=time, att_dropout=0.1, train=True)
    assert t.records[0].kernel == d.kernel == "reference"
    assert isinstance(d.rejected, list) and all(isinstance(r, da.Rejection) for r in d.rejected)
    reasons = {r.kernel: r.reason for r in d.rejected}
    assert list(reasons)[:2] == ["cpu_flash", "aten_flash_cpu"] and "dropout" in reasons["aten_flash_cpu"]
    with pytest.raises(da.Error, match=r"unknown kernel no_such.*known: auto, reference"):
        da.force(["cpu_flash", "no_such"])


def test_forced_kernel_that_cannot_run_is_an_error():
    q, k, v, batch, heads, time, feat, vfeat = operands()
    with da.force("aten_flash_cpu"), pytest.raises(da.Error, match="aten_flash_cpu.*dropout"):
        da.dot_attention(q, k, v, key_dim=feat, axis=time, att_dropout=0.1, train=True)


def test_dimattn_sdpa_environment_is_honoured(monkeypatch):
    q, k, v, batch, heads, time, feat, vfeat = operands()
    monkeypatch.setenv("DIMATTN_SDPA", "aten_math")
    assert da.explain(q, k, v, key_dim=feat, axis=time).kernel == "aten_math"
    with da.trace(capture_tensors=False) as t:
        da.dot_attention(q, k, v, key_dim=feat, axis=time)
    assert t.records[0].kernel == "aten_math"
    with da.force("auto"):  # a scope overrides the variable
        assert da.explain(q, k, v, key_dim=feat, axis=time).kernel == "cpu_flash"


def test_errors_name_the_dims():
    q, k, v, batch, heads, time, feat, vfeat = operands()
    other_feat = da.Dim("feat", D)
    with pytest.raises(da.Error, match=r"\[dot_attention\] key_dim feat#2\[4\] is not in query") as e:
        da.dot_attention(q, k, v, key_dim=other_feat, axis=time)
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, ValueError)
    with pytest.raises(da.Error, match=r"axis .* is not in values"):
        da.dot_attention(q, k, named([batch, heads, da.Dim("kv", 7), vfeat], 4), key_dim=feat, axis=time)
    with pytest.raises(da.Error, match=r"att_dropout must be in \[0, 1\)"):
        da.dot_attention(q, k, v, key_dim=feat, axis=time, att_dropout=1.5, train=True)
    chunk = da.Dim("chunk", 2)
    with pytest.raises(da.Error, match=r"causal attention without causal_offset needs equal query and kv extents"):
        da.dot_attention(named([batch, heads, chunk, feat], 5), k, v, key_dim=feat, axis=time,
                         causal_query_spatial_dim=chunk)
    with pytest.raises(da.Error, match=r"\[Tensor\] axis 1 has size 3 but dim time\[5\]"):
        da.Tensor(torch.zeros(2, 3), [batch, time])
    with pytest.raises(da.Error, match=r"query must be a dimattn.Tensor"):
        da.dot_attention(q.raw, k, v, key_dim=feat, axis=time)
    dyn = da.Dim.dynamic("dyn", da.Tensor(torch.tensor([3, 4]), [batch]))
    with pytest.raises(da.Error, match=r"dim 'dyn' has size 4 in keys but 5 elsewhere"):
        da.dot_attention(named([batch, heads, (dyn, 5), feat], 6), named([batch, heads, (dyn, 4), feat], 7),
                         named([batch, heads, (dyn, 4), vfeat], 8), key_dim=feat, axis=dyn)
