#!/usr/bin/env python3
"""Overhead of dimattn's torch op from Python against F.scaled_dot_product_attention
on the same CPU kernel (ATen's flash attention for CPU: dimattn forced to
aten_flash_cpu, which SDPA picks for these float32 inputs), forward only, no grad.

    PYTHONPATH=python DIMATTN_TORCH_OPS=build/python/libdimattn_torch_ops.so \\
        ~/.cache/dimattn/venv/bin/python bench/python_overhead.py

Prints, per T, the median and the minimum over rounds of the time per call of
each and their ratios (dimattn / SDPA);
calls alternate in rounds so that load drifts reach both alike. Times are the
calling thread's CPU time (one ATen thread by default, --threads).
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import dimattn as da


def per_call(fn, calls):
    # CPU time of this thread: on a shared machine, time spent waiting for a
    # core is not the call's (with --threads 1 every op runs on this thread).
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t0) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 1024])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--kernel", default="aten_flash_cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B={args.batch} H={args.heads} "
          f"D={args.head_dim} float32, kernel {args.kernel}")
    for T in args.lengths:
        batch, heads, time_, feat = da.Dim("batch", args.batch), da.Dim("heads", args.heads), da.Dim("time", T), \
            da.Dim("feat", args.head_dim)
        vfeat = da.Dim("vfeat", args.head_dim)
        q, k, v = (torch.randn(args.batch, args.heads, T, args.head_dim) for _ in range(3))
        dq, dk = da.Tensor(q, [batch, heads, time_, feat]), da.Tensor(k, [batch, heads, time_, feat])
        dv = da.Tensor(v, [batch, heads, time_, vfeat])
        force = da.force(args.kernel)

        def ours():
            with force:
                return da.dot_attention(dq, dk, dv, key_dim=feat, axis=time_)

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v)

        with torch.no_grad():
            assert (ours().raw - sdpa()).abs().max() < 1e-5
            calls = max(3, int(0.2 / per_call(sdpa, 3)))  # about 0.2 s per measurement
            ts, to = [], []
            for _ in range(args.rounds):
                ts.append(per_call(sdpa, calls))
                to.append(per_call(ours, calls))
        ms, mo = statistics.median(ts), statistics.median(to)
        ns, no = min(ts), min(to)
        print(f"T={T:5d}  median: sdpa {ms * 1e6:9.1f} us  dimattn {mo * 1e6:9.1f} us  ratio {mo / ms:.3f}   "
              f"min: sdpa {ns * 1e6:9.1f} us  dimattn {no * 1e6:9.1f} us  ratio {no / ns:.3f}   "
              f"({calls} calls x {args.rounds} rounds)")


if __name__ == "__main__":
    main()
