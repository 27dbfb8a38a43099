#!/usr/bin/env python3
"""RETURNN's attention layers (rf.CausalSelfAttention, rf.SelfAttention) with and
without dimattn.returnn, forward + backward, on the CPU; and the integration's own
cost against calling dimattn.dot_attention directly on the same raw tensors.

    PYTHONPATH=python DIMATTN_TORCH_OPS=build/python/libdimattn_torch_ops.so \\
        ~/.cache/dimattn/venv/bin/python bench/returnn_layer.py

Per layer, dtype and T: the median wall time (--cpu-time: the calling thread's CPU
time, with --threads 1 robust to other processes' load) of one training step of the layer
(forward, then the gradients of its input and parameters) on RETURNN's own
implementation and routed to dimattn, measured alternately in rounds in one
process so that load drifts reach both alike, and their ratio. Peak memory: the
growth of the process's peak resident set (VmHWM, reset through
/proc/self/clear_refs) over one step, each variant in a fresh process. Own cost:
rf.dot_attention routed against dimattn.dot_attention on the same raw tensors,
forward + backward, alternating calls, on one thread and in that thread's CPU time
(a difference of well under a percent is lost in wall-clock noise on a shared
machine; on one thread every op runs on the timed thread).
"""
import argparse
import os
import time

import torch

import returnn.frontend as rf
from returnn.tensor import Dim, Tensor

import dimattn as da
import dimattn.returnn as dr
from bench_timing import cpu_info, interleaved, peak_growth_of, peak_in_fresh_process

rf.select_backend_torch()
LAYERS = {"causal": rf.CausalSelfAttention, "self": rf.SelfAttention}


def layer_step(kind, T, dtype, args):
    """One training step of a RETURNN attention layer over [batch, time, model] with
    a dynamic time dim (every sequence of length T)."""
    rf.set_random_seed(0)
    batch, model = Dim(args.batch, name="batch"), Dim(args.model, name="model")
    lengths = Tensor("time_lengths", [batch], "int32", raw_tensor=torch.full([args.batch], T, dtype=torch.int32))
    time_ = Dim(lengths, name="time")
    with rf.set_default_float_dtype_ctx(dtype):
        layer = LAYERS[kind](model, model, key_dim_total=model, value_dim_total=model, num_heads=args.heads,
                             att_dropout=0.0)
    raw = torch.randn(args.batch, T, args.model, dtype=getattr(torch, dtype), requires_grad=True)
    x = Tensor("x", [batch, time_, model], dtype, raw_tensor=raw)
    leaves = [raw] + [p.raw_tensor for _, p in layer.named_parameters()]
    assert all(p.dtype == raw.dtype for p in leaves)

    def step():
        out = layer(x, axis=time_)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out.raw_tensor.float().sum(), leaves)

    return step


def routed(step):
    def run():
        with dr.enabled(strict=True):
            step()
    return run


def peak_growth(kind, T, dtype, variant, args):
    """Peak resident growth (bytes) of one step, measured in a fresh process."""
    return peak_in_fresh_process(__file__, ["--peak-of", kind, T, dtype, variant, "--threads", args.threads,
                                            "--batch", args.batch, "--model", args.model, "--heads", args.heads])


def measure_peak(kind, T, dtype, variant, args):
    step = layer_step(kind, T, dtype, args)
    print(peak_growth_of(routed(step) if variant == "dimattn" else step))


def own_cost(T, args):
    """rf.dot_attention routed vs dimattn.dot_attention on the same raw tensors,
    causal self-attention over [batch, time, heads, feat], forward + backward."""
    torch.manual_seed(0)
    batch, heads = Dim(args.batch, name="batch"), Dim(args.heads, name="heads")
    feat = Dim(args.model // args.heads, name="feat")
    time_ = Dim(Tensor("time_lengths", [batch], "int32", raw_tensor=torch.full([args.batch], T, dtype=torch.int32)),
                name="time")
    raws = [torch.randn(args.batch, T, args.heads, feat.dimension, requires_grad=True) for _ in range(3)]
    q, k, v = (Tensor(n, [batch, time_, heads, feat], "float32", raw_tensor=r) for n, r in zip("qkv", raws))
    b_, t_, h_, f_ = da.Dim("batch", args.batch), da.Dim("time", T), da.Dim("heads", args.heads), \
        da.Dim("feat", feat.dimension)
    dq, dk, dv = (da.Tensor(r, [b_, t_, h_, f_]) for r in raws)

    def through_returnn():
        out = rf.dot_attention(q, k, v, key_dim=feat, axis=time_, causal_query_spatial_dim=time_)
        torch.autograd.grad(out.raw_tensor.sum(), raws)

    def direct():
        out = da.dot_attention(dq, dk, dv, key_dim=f_, axis=t_, causal_query_spatial_dim=t_)
        torch.autograd.grad(out.raw.sum(), raws)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with dr.enabled(strict=True):
            with da.trace(capture_tensors=False) as t:
                through_returnn()
            assert t.records[0].kernel == "cpu_flash", t.records[0].kernel
            return interleaved([direct, through_returnn], args.own_cost_rounds, clock=time.thread_time)
    finally:
        torch.set_num_threads(threads)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--layers", nargs="+", default=["causal", "self"])
    ap.add_argument("--rounds", type=int, default=11, help="rounds per case (3 at T >= 4096)")
    ap.add_argument("--peak-at", type=int, default=4096)
    ap.add_argument("--own-cost-at", type=int, default=256)
    ap.add_argument("--own-cost-rounds", type=int, default=41)
    ap.add_argument("--threads", type=int, default=2, help="for the layers (the own cost runs on 1)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the layers in the calling thread's CPU time (use with --threads 1: robust to "
                         "other processes' load)")
    ap.add_argument("--skip-layers", action="store_true", help="only the own cost")
    ap.add_argument("--skip-own-cost", action="store_true", help="only the layers")
    ap.add_argument("--peak-of", nargs=4, metavar=("LAYER", "T", "DTYPE", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.peak_of:
        kind, T, dtype, variant = args.peak_of
        return measure_peak(kind, int(T), dtype, variant, args)

    print("CPU: %s; flags: %s" % cpu_info())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}; "
          f"B={args.batch} model={args.model} heads={args.heads}, forward + backward, no dropout, "
          f"{'CPU time of the calling thread' if args.cpu_time else 'wall clock'}")
    print("| layer | dtype | T | RETURNN (s) | dimattn (s) | speed-up | peak RETURNN (MiB) | peak dimattn (MiB) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for kind in [] if args.skip_layers else args.layers:
        for dtype in args.dtypes:
            for T in args.lengths:
                step = layer_step(kind, T, dtype, args)
                theirs, ours = interleaved([step, routed(step)], 3 if T >= 4096 else args.rounds,
                                           clock=time.thread_time if args.cpu_time else time.perf_counter)
                peaks = ""
                if T == args.peak_at:
                    peaks = " | ".join(f"{peak_growth(kind, T, dtype, v, args) / 2**20:.0f}"
                                       for v in ("returnn", "dimattn"))
                print(f"| {kind} | {dtype} | {T} | {theirs:.3f} | {ours:.3f} | {theirs / ours:.2f}x | "
                      f"{peaks or ' | '} |", flush=True)
    if args.skip_own_cost:
        return
    direct, through = own_cost(args.own_cost_at, args)
    print(f"own cost at T={args.own_cost_at} (causal, float32, fwd+bwd, 1 thread, its CPU time): "
          f"dimattn.dot_attention {direct * 1e3:.3f} ms, "
          f"rf.dot_attention routed {through * 1e3:.3f} ms, ratio {through / direct:.4f} "
          f"(+{(through - direct) * 1e6:.0f} us)")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
