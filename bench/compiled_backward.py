#!/usr/bin/env python3
"""dimattn.dot_attention's forward + backward eager and under torch.compile, in one
process, interleaved: what a compiled training step pays beyond eager.

    PYTHONPATH=python DIMATTN_TORCH_OPS=build/python/libdimattn_torch_ops.so \\
        ~/.cache/dimattn/venv/bin/python bench/compiled_backward.py

Causal self-attention over [B, H, T, D] (default B 1, H 8, T 2048, D 64, float32): the
median wall time of forward, then the gradients of q, k and v, eager and through
torch.compile(fullgraph=True) of the same function, after compiling once.
"""
import argparse
import os

import torch

import dimattn as da
from bench_timing import cpu_info, interleaved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("CPU: %s; flags: %s" % cpu_info())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}; "
          f"B={args.batch} H={args.heads} D={args.head_dim} {args.dtype}, causal, forward + backward")
    print("| T | eager (ms) | compiled (ms) | compiled / eager |")
    print("|---:|---:|---:|---:|")
    dtype = getattr(torch, args.dtype)
    for T in args.lengths:
        b, h, t, f = da.Dim("b", args.batch), da.Dim("h", args.heads), da.Dim("t", T), da.Dim("f", args.head_dim)
        raws = [torch.randn(args.batch, args.heads, T, args.head_dim, dtype=dtype, requires_grad=True)
                for _ in range(3)]

        def loss(q, k, v):
            out = da.dot_attention(da.Tensor(q, [b, h, t, f]), da.Tensor(k, [b, h, t, f]),
                                   da.Tensor(v, [b, h, t, f]), key_dim=f, axis=t, causal_query_spatial_dim=t)
            return out.raw.float().sum()

        compiled = torch.compile(loss, fullgraph=True)

        def step(fn):
            for x in raws:
                x.grad = None
            fn(*raws).backward()
            return [x.grad for x in raws]

        eager_grads, compiled_grads = step(loss), step(compiled)
        err = max(float((a - c).abs().max()) for a, c in zip(eager_grads, compiled_grads))
        assert err < 1e-3, f"compiled and eager gradients differ by {err}"
        eager, comp = interleaved([lambda: step(loss), lambda: step(compiled)], args.rounds)
        print(f"| {T} | {eager * 1e3:.1f} | {comp * 1e3:.1f} | {comp / eager:.3f}x |", flush=True)
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
