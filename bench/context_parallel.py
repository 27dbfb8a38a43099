#!/usr/bin/env python3
"""Context parallelism on this machine: N ranks (Gloo over the loopback, one ATen
thread each) against one process with N threads, at equal total work: the same
causal self-attention, forward and backward, over the whole sequence.

    PYTHONPATH=python DIMATTN_TORCH_OPS=build/python/libdimattn_torch_ops.so \\
        ~/.cache/dimattn/venv/bin/python bench/context_parallel.py --T 2048

Prints the median wall time per step (forward + backward) of each, their ratio,
and the bytes each rank sends per step (keys and values forward; keys, values and
their float32 gradients backward), counted from the shapes the ring passes.
"""
import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dimattn as da


def problem(T, B, H, D, dtype):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, T, D, generator=gen, dtype=dtype) for _ in range(4)]


def step_times(q, k, v, go, kw, reps, cp=None):
    b, h, f = da.Dim("batch", q.shape[0]), da.Dim("heads", q.shape[1]), da.Dim("feat", q.shape[3])
    t = da.Dim("time", q.shape[2])
    times = []
    for _ in range(reps):
        qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
        start = time.perf_counter()
        out = da.dot_attention(da.Tensor(qs, [b, h, t, f]), da.Tensor(ks, [b, h, t, f]), da.Tensor(vs, [b, h, t, f]),
                               key_dim=f, axis=t, causal_query_spatial_dim=t, context_parallel=cp, **kw)
        (out.raw * go).sum().backward()
        if cp is not None:
            dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def rank_main(rank, world, port, args, results):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    q, k, v, go = problem(args.T, args.B, args.H, args.D, torch.float32)
    cp = da.ContextParallel(None, args.sharding, args.strategy)

    def sh(x):
        ranges = da.shard_ranges(args.T, world, rank, args.sharding)
        return torch.cat([x.narrow(2, s, e - s) for s, e in ranges], 2)

    times = step_times(sh(q), sh(k), sh(v), sh(go), {}, args.reps, cp)
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sharding", default="load_balanced")
    p.add_argument("--strategy", default="ring")
    args = p.parse_args()

    torch.set_num_threads(args.world)
    q, k, v, go = problem(args.T, args.B, args.H, args.D, torch.float32)
    with da.force("cpu_flash"):
        single = step_times(q, k, v, go, {}, args.reps)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(rank_main, args=(args.world, port, args, results), nprocs=args.world, start_method="spawn")
    ring = results.get()

    t_local = args.T // args.world
    kv_bytes = 2 * args.B * args.H * t_local * args.D * 4  # one rank's keys and values, float32
    fwd_bytes = (args.world - 1) * kv_bytes  # ring: N - 1 shards passed on; all_gather: N - 1 shards gathered
    # Backward: k, v once more, then dk, dv (float32: kv_bytes per rank) — passed
    # on at each of the N ring steps, or one all-reduce whose payload is every
    # rank's (all_gather).
    bwd_bytes = (args.world - 1) * kv_bytes + args.world * kv_bytes
    med_single, med_ring = statistics.median(single[1:]), statistics.median(ring[1:])
    print(f"causal self-attention B={args.B} H={args.H} T={args.T} D={args.D} float32, forward + backward, "
          f"{args.world} ranks ({args.sharding}, {args.strategy}) vs 1 process with {args.world} threads")
    print(f"  1 process : median {med_single * 1e3:.1f} ms  (runs {', '.join(f'{x * 1e3:.0f}' for x in single)})")
    print(f"  {args.world} ranks   : median {med_ring * 1e3:.1f} ms  (runs {', '.join(f'{x * 1e3:.0f}' for x in ring)})")
    print(f"  ratio ranks / single: {med_ring / med_single:.2f}x")
    what = "sent per rank" if args.strategy == "ring" else "gathered per rank, then all-reduce payload"
    print(f"  {what} per step: forward {fwd_bytes / 2**20:.2f} MiB, backward {bwd_bytes / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
