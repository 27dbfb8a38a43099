#!/usr/bin/env python3
"""Cost of per-query-row kv lengths on a CPU kernel: a chunk of queries attending a
history whose lengths vary over the chunk's own time dim (lengths over (batch, time)),
forward + backward, against the same call with every row's length the full history,
with lengths per batch entry and with a static history.

    DIMATTN_NUM_THREADS=1 PYTHONPATH=python \\
        DIMATTN_TORCH_OPS=build/python/libdimattn_torch_ops.so \\
        ~/.cache/dimattn/venv/bin/python bench/row_lengths.py

Prints, per case, the median and minimum over rounds of the process CPU time per
call (one thread: dimattn's and torch's) and the median's ratio to the full-length
per-row case, next to the ratio of attended (row, kv) pairs. Cases alternate in
rounds so that load drifts reach all alike.
"""
import argparse
import statistics
import time

import torch

import dimattn as da
from bench_timing import cpu_info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256, help="query rows (the chunk's time dim)")
    ap.add_argument("--history", type=int, default=4096, help="kv extent (the history's padded length)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kernel", default="cpu_flash")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    B, H, D, Tq, Tk = args.batch, args.heads, args.head_dim, args.chunk, args.history
    batch, heads, time_, feat, vfeat = (da.Dim("batch", B), da.Dim("heads", H), da.Dim("time", Tq),
                                        da.Dim("feat", D), da.Dim("vfeat", D))
    q = torch.randn(B, H, Tq, D, requires_grad=True)
    k = torch.randn(B, H, Tk, D, requires_grad=True)
    v = torch.randn(B, H, Tk, D, requires_grad=True)
    grad = torch.randn(B, H, Tq, D)

    def rows(lengths):  # lengths over (batch, time)
        return torch.tensor(lengths, dtype=torch.int64).expand(B, Tq).contiguous()

    ramp = [(i + 1) * Tk // Tq for i in range(Tq)]  # row i sees (i + 1)·Tk/Tq positions
    cases = {
        "per-row, every row Tk": (rows([Tk] * Tq), [batch, time_], Tk * Tq),
        "per-row, every row Tk/4": (rows([Tk // 4] * Tq), [batch, time_], Tk // 4 * Tq),
        "per-row, row i (i+1)·Tk/Tq": (rows(ramp), [batch, time_], sum(ramp)),
        "per-entry, Tk/4": (torch.full((B,), Tk // 4, dtype=torch.int64), [batch], Tk // 4 * Tq),
        "static Tk": (None, None, Tk * Tq),
    }
    calls = {}
    for name, (lens, over, _) in cases.items():
        kv = da.Dim("hist", Tk) if lens is None else da.Dim.dynamic("hist", da.Tensor(lens, over))
        dq, dk = da.Tensor(q, [batch, heads, time_, feat]), da.Tensor(k, [batch, heads, kv, feat])
        dv = da.Tensor(v, [batch, heads, kv, vfeat])

        def call(dq=dq, dk=dk, dv=dv, kv=kv):
            with da.force(args.kernel):
                out = da.dot_attention(dq, dk, dv, key_dim=feat, axis=kv)
            torch.autograd.grad(out.raw_in([batch, heads, time_, vfeat]), (q, k, v), grad)

        calls[name] = call
        call()  # warm up (plans, buffers)
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, call in calls.items():
            t0 = time.process_time()
            call()
            times[name].append(time.process_time() - t0)
    print("CPU: %s; flags: %s" % cpu_info())
    print(f"torch {torch.__version__}, kernel {args.kernel}, 1 thread; B={B} H={H} D={D} float32, "
          f"chunk Tq={Tq}, history Tk={Tk}; forward + backward, {args.rounds} rounds")
    base = statistics.median(times["per-row, every row Tk"])
    full_pairs = cases["per-row, every row Tk"][2]
    print(f"{'case':30s} {'median ms':>10s} {'min ms':>8s} {'time ratio':>10s} {'pair ratio':>10s}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:30s} {med * 1e3:10.1f} {min(ts) * 1e3:8.1f} {med / base:10.3f} "
              f"{cases[name][2] / full_pairs:10.3f}")


if __name__ == "__main__":
    main()
