"""N calls of dimattn.dot_attention (forced to aten_flash_cpu) or of
F.scaled_dot_product_attention, for instruction counts under callgrind, which load
on the machine does not change (docs/perf-log.md):

    PYTHONPATH=python DIMATTN_TORCH_OPS=build/python/libdimattn_torch_ops.so valgrind --tool=callgrind \\
        ~/.cache/dimattn/venv/bin/python bench/python_overhead_calls.py dimattn 120 32

Run with two call counts; the difference of the totals over the difference of the
counts is the cost of one call. Arguments: sdpa|dimattn, calls, T.
"""
import sys

import torch
import torch.nn.functional as F

import dimattn as da

torch.set_num_threads(1)
which, n, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
batch, heads, time_, feat, vfeat = (da.Dim("batch", 2), da.Dim("heads", 8), da.Dim("time", T), da.Dim("feat", 64),
                                    da.Dim("vfeat", 64))
q = da.Tensor(torch.randn(2, 8, T, 64), [batch, heads, time_, feat])
v = da.Tensor(torch.randn(2, 8, T, 64), [batch, heads, time_, vfeat])
force = da.force("aten_flash_cpu")


def ours():
    with force:
        return da.dot_attention(q, q, v, key_dim=feat, axis=time_)


def sdpa():
    return F.scaled_dot_product_attention(q.raw, q.raw, v.raw)


fn = ours if which == "dimattn" else sdpa
with torch.no_grad():
    ours()
    sdpa()
    for _ in range(n):
        fn()
