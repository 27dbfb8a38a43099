#!/usr/bin/env python3
"""Packed sequences: dimattn.varlen_attention over several sequences laid end to end
against dimattn.packed_attention with the keys and values packed apart (the
sequences in reverse order: another packing than the queries'), the same sequences
run one by one at their own lengths (summed), and one causal call over the whole
packed length T (what a document-unaware model pays).

    PYTHONPATH=python DIMATTN_TORCH_OPS=build/python/libdimattn_torch_ops.so \\
        ~/.cache/dimattn/venv/bin/python bench/packed_sequences.py [--quick]

Per sequence split and dtype: median wall time over interleaved rounds (every variant
once per round, each first in turn (bench_timing.interleaved), so load drifts reach all alike; --cpu-time: the process's CPU time) of forward, and of forward + backward
(the gradients of q, k, v), causal, [tokens, heads, D] operands. Ratios: packed over
one-by-one (goal ≤ 1.1x, issue 28), apart over one-by-one, and packed over full
causal against the attended area Σ lᵢ² / T².
"""
import argparse
import os
import time

import torch

import dimattn as da
from bench_timing import cpu_info, interleaved


def splits(T, quick):
    """Sequence lengths summing to T: equal documents, uneven ones, one long and many short."""
    g = torch.Generator().manual_seed(0)
    cuts = sorted(torch.randperm(T - 1, generator=g)[:7].add(1).tolist())
    uneven = [b - a for a, b in zip([0] + cuts, cuts + [T])]
    rows = {"4 equal": [T // 4] * 4, "8 uneven": uneven, "1 long + 16 short": [T // 2] + [T // 32] * 16}
    return dict(list(rows.items())[:1]) if quick else rows


def no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time (with --threads 1: robust to other processes' load)")
    ap.add_argument("--quick", action="store_true", help="T=256, one split, float32, 2 rounds: a smoke run")
    a = ap.parse_args()
    if a.quick:
        a.T, a.dtype, a.rounds = 256, "float32", 2
    torch.set_num_threads(a.threads)
    clock = time.process_time if a.cpu_time else time.perf_counter
    print(f"bench/packed_sequences.py T={a.T} heads={a.heads} D={a.D}, {a.threads} threads, {'CPU' if a.cpu_time else 'wall'} time, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()}")
    model, flags = cpu_info()
    print(f"CPU: {model}; flags: {flags}\n")
    print("| dtype | sequences | attended Σl²/T² | fwd ms packed / apart / one by one / full causal "
          "| packed, apart / one by one | packed / full, area "
          "| fwd+bwd ms packed / apart / one by one / full causal | packed, apart / one by one "
          "| packed / full, area | max |Δout| vs one by one: packed, apart |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in a.dtype.split(","):
        dt = getattr(torch, dtype)
        for name, lengths in splits(a.T, a.quick).items():
            g = torch.Generator().manual_seed(1)
            q, k, v = (torch.randn(a.T, a.heads, a.D, generator=g).to(dt).requires_grad_() for _ in range(3))
            cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
            longest = max(lengths)
            area = sum(n * n for n in lengths) / a.T ** 2
            b, h, t, f = da.Dim("batch", 1), da.Dim("heads", a.heads), da.Dim("time", a.T), da.Dim("feat", a.D)

            def packed():
                return da.varlen_attention(q, k, v, cu, cu, longest, longest, causal=True)

            def one_by_one():
                outs = []
                for s, n in zip(cu[:-1].tolist(), lengths):
                    seq = da.Dim("time", n)
                    x = [da.Tensor(z[s:s + n], [seq, h, f]) for z in (q, k, v)]
                    outs.append(da.dot_attention(*x, key_dim=f, axis=seq, causal_query_spatial_dim=seq).raw_in([seq, h, f]))
                return torch.cat(outs)

            def full():
                x = [da.Tensor(z[None], [b, t, h, f]) for z in (q, k, v)]
                return da.dot_attention(*x, key_dim=f, axis=t, causal_query_spatial_dim=t).raw[0]

            # The keys and values packed apart: the sequences in reverse order.
            lens = torch.tensor(lengths)
            order = list(reversed(range(len(lengths))))
            perm = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in order])
            k2, v2 = (z.detach()[perm].requires_grad_() for z in (k, v))
            starts_apart = torch.zeros(len(lengths), dtype=torch.int64)
            starts_apart[order] = torch.cat([torch.zeros(1, dtype=torch.int64), lens[order].cumsum(0)[:-1]])

            def apart():
                return da.packed_attention(q, k2, v2, cu[:-1], lens, starts_apart, lens, longest, longest, causal=True)

            def backward(fn):
                inputs = (q, k2, v2) if fn is apart else (q, k, v)
                return lambda: torch.autograd.grad(fn().float().sum(), inputs)

            want = one_by_one().float()
            diffs = [(fn().float() - want).abs().max().item() for fn in (packed, apart)]
            variants = {"packed": packed, "apart": apart, "one": one_by_one, "full": full}
            names = list(variants)

            fwd = dict(zip(names, interleaved([no_grad(variants[n]) for n in names], a.rounds, clock)))
            both = dict(zip(names, interleaved([backward(variants[n]) for n in names], a.rounds, clock)))
            cells = []
            for m in (fwd, both):
                ms = {key: x * 1e3 for key, x in m.items()}
                cells += [f"{ms['packed']:.1f} / {ms['apart']:.1f} / {ms['one']:.1f} / {ms['full']:.1f}",
                          f"{ms['packed'] / ms['one']:.2f}x, {ms['apart'] / ms['one']:.2f}x",
                          f"{ms['packed'] / ms['full']:.2f}, {area:.2f}"]
            print(f"| {dtype} | {name} | {area:.3f} | " + " | ".join(cells) + f" | {diffs[0]:.1e}, {diffs[1]:.1e} |")
    print(f"\nload after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
