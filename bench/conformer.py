#!/usr/bin/env python3
"""RETURNN's Conformer attention (rf.RelPosSelfAttention) and its ConformerEncoderLayer,
with and without dimattn.returnn, against the peer a speech user would otherwise pick:
the positional term materialised once and passed as the float attn_mask of
F.scaled_dot_product_attention (NeMo's and WeNet's way); and the kernel's own cost of
the positional term (the same dimattn call with and without pos_emb).

    PYTHONPATH=python DIMATTN_TORCH_OPS=build/python/libdimattn_torch_ops.so \\
        ~/.cache/dimattn/venv/bin/python bench/conformer.py

Per module, dtype (bfloat16: under torch.autocast, RETURNN's torch_amp) and T: the median
wall time of one training step (forward, then the gradients of the input and every
parameter) of RETURNN's generic path, routed to dimattn, and (module only) the SDPA
peer with the same weights, measured interleaved in one process (bench_timing); B
sequences padded to T (lengths T, 0.9 T, 0.8 T, 0.7 T). Peak memory: the growth of
the process's peak resident set over one step, each variant in a fresh process.
"""
import argparse
import contextlib
import os

import torch
import torch.nn.functional as F

import returnn.frontend as rf
from returnn.frontend.encoder.conformer import ConformerEncoderLayer
from returnn.tensor import Dim, Tensor

import dimattn as da
import dimattn.returnn as dr
from bench_timing import cpu_info, interleaved, peak_growth_of, peak_in_fresh_process

rf.select_backend_torch()


def lengths(B, T):
    return [max(1, int(T * (1 - 0.1 * b))) for b in range(B)]


def build(module, T, args):
    """(RETURNN module, input Tensor, time Dim, leaves) over [batch, time, model]."""
    rf.set_random_seed(0)
    batch, model = Dim(args.batch, name="batch"), Dim(args.model, name="model")
    lens = torch.tensor(lengths(args.batch, T), dtype=torch.int32)
    time_ = Dim(Tensor("time_lengths", [batch], "int32", raw_tensor=lens), name="time")
    if module == "attention":
        m = rf.RelPosSelfAttention(model, model, key_dim_total=model, value_dim_total=model, num_heads=args.heads,
                                   att_dropout=0.0)
    else:
        m = ConformerEncoderLayer(model, ff_dim=Dim(4 * args.model, name="ff"), num_heads=args.heads, dropout=0.0,
                                  att_dropout=0.0)
    raw = torch.randn(args.batch, T, args.model, requires_grad=True)
    x = Tensor("x", [batch, time_, model], "float32", raw_tensor=raw)
    leaves = [raw] + [p.raw_tensor for _, p in m.named_parameters() if p.raw_tensor.requires_grad]
    return m, x, time_, leaves


def step_of(module, m, x, time_, leaves, amp, routed, grads=True):
    """One training step; grads=False: the forward's output as raw [B, T, model]."""
    def step():
        routing = dr.enabled(strict=True) if routed else contextlib.nullcontext()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp), routing:
            out = m(x, axis=time_) if module == "attention" else m(x, spatial_dim=time_)
            if not grads:
                return out.copy_compatible_to_dims_raw(x.dims)
            torch.autograd.grad(out.raw_tensor.float().sum(), leaves)
    return step


def sdpa_peer(m, x, time_, leaves, amp, args, grads=True):
    """The same RelPosSelfAttention weights, computed as NeMo does: (q + v)·p materialised
    over [B, H, T, 2T - 1], shifted to [B, H, T, T], scaled and added (with the key
    padding as -inf) as SDPA's float attn_mask, with q + u as SDPA's query."""
    B, T, H = args.batch, x.raw_tensor.shape[1], args.heads
    Dh = args.model // H
    lens = torch.tensor(lengths(B, T))
    params = {n: p.raw_tensor for n, p in m.named_parameters()}
    pad = torch.where(torch.arange(T)[None, :] < lens[:, None], 0.0, float("-inf"))[:, None, None, :]
    pos = rf.relative_positional_encoding(query_spatial_dim=time_, key_value_spatial_dim=time_,
                                          feat_dim=m.pos_emb_feat_dim)[0].raw_tensor  # [2T - 1, model]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            xr = x.raw_tensor
            qkv = (xr @ params["qkv.weight"] + params["qkv.bias"]).view(B, T, H, 3 * Dh).transpose(1, 2)
            q, k, v = qkv.split(Dh, -1)
            p = (pos @ params["linear_pos.weight"]).view(2 * T - 1, H, Dh).transpose(0, 1)  # [H, 2T - 1, Dh]
            bd = (q + params["pos_bias_v"][:, None]) @ p.transpose(-1, -2)  # [B, H, T, 2T - 1]
            idx = (T - 1) + torch.arange(T)[None, :] - torch.arange(T)[:, None]
            bd = bd.gather(-1, idx.expand(B, H, T, T))
            mask = bd * Dh ** -0.5 + pad.to(bd.dtype)
            att = F.scaled_dot_product_attention(q + params["pos_bias_u"][:, None], k, v, attn_mask=mask)
            out = att.transpose(1, 2).reshape(B, T, H * Dh) @ params["proj.weight"] + params["proj.bias"]
            if not grads:
                return out
            torch.autograd.grad(out.float().sum(), leaves)
    return step


def check_agreement(m, x, time_, leaves, amp, args):
    """The three paths' outputs on the sequences' valid frames: max abs difference to RETURNN's."""
    with torch.no_grad():
        ref = step_of("attention", m, x, time_, leaves, amp, False, grads=False)().float()
        ours = step_of("attention", m, x, time_, leaves, amp, True, grads=False)().float()
        peer = sdpa_peer(m, x, time_, leaves, amp, args, grads=False)().float()
    valid = torch.arange(ref.shape[1])[None, :] < torch.tensor(lengths(args.batch, ref.shape[1]))[:, None]
    return [float(((y - ref).abs() * valid[..., None]).max()) for y in (ours, peer)]


def kernel_calls(T, args, amp):
    """dimattn's call with and without pos_emb (RETURNN's layout), forward and forward + backward."""
    B, H, Dh = args.batch, args.heads, args.model // args.heads
    dt = torch.bfloat16 if amp else torch.float32
    b, h, f = da.Dim("b", B), da.Dim("h", H), da.Dim("f", Dh)
    t = da.Dim.dynamic("t", da.Tensor(torch.tensor(lengths(B, T)), [b]))
    kv = da.Dim.dynamic("kv", da.Tensor(torch.tensor(lengths(B, T)), [b]))
    r = da.Dim("r", 2 * T - 1)
    raws = [torch.randn(B, T, H, Dh, dtype=dt, requires_grad=True) for _ in range(3)]
    table = torch.randn(H, 2 * T - 1, Dh, dtype=dt, requires_grad=True)
    uv = [torch.randn(H, Dh, dtype=dt, requires_grad=True) for _ in range(2)]
    q, k, v = da.Tensor(raws[0], [b, t, h, f]), da.Tensor(raws[1], [b, kv, h, f]), da.Tensor(raws[2], [b, kv, h, f])
    rel = dict(pos_emb=da.Tensor(table, [h, r, f]), pos_bias_u=da.Tensor(uv[0], [h, f]),
               pos_bias_v=da.Tensor(uv[1], [h, f]))

    def call(with_rel, backward):
        def run():
            kw = rel if with_rel else {}
            if backward:
                out = da.dot_attention(q, k, v, key_dim=f, axis=kv, query_position_dim=t, **kw)
                torch.autograd.grad(out.raw.float().sum(), raws + ([table] + uv if with_rel else []))
            else:
                with torch.no_grad():
                    da.dot_attention(q, k, v, key_dim=f, axis=kv, query_position_dim=t, **kw)
        return run

    return call


def peak(module, T, dtype, variant, args):
    """MiB, measured in a fresh process (measure_peak)."""
    return peak_in_fresh_process(__file__, ["--peak-of", module, T, dtype, variant, "--threads", args.threads,
                                            "--batch", args.batch, "--model", args.model, "--heads", args.heads]) / 2 ** 20


def measure_peak(module, T, dtype, variant, args):
    m, x, time_, leaves = build(module, T, args)
    amp = dtype == "bfloat16"
    step = sdpa_peer(m, x, time_, leaves, amp, args) if variant == "sdpa" else \
        step_of(module, m, x, time_, leaves, amp, variant == "dimattn")
    print(peak_growth_of(step))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[500, 1000, 2000, 4000])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--modules", nargs="*", default=["attention", "conformer"])
    ap.add_argument("--rounds", type=int, default=5, help="rounds per case (2 at T >= 4000)")
    ap.add_argument("--peak-at", type=int, nargs="*", default=[1000, 4000])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--peak-of", nargs=4, metavar=("MODULE", "T", "DTYPE", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.peak_of:
        module, T, dtype, variant = args.peak_of
        return measure_peak(module, int(T), dtype, variant, args)

    print("CPU: %s; flags: %s" % cpu_info())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}; "
          f"B={args.batch} (lengths T, 0.9T, 0.8T, 0.7T) model={args.model} heads={args.heads}, "
          f"forward + backward, no dropout, wall clock, median of {args.rounds} interleaved rounds")
    if not args.skip_kernel:
        print("\nThe positional term's cost in dimattn's kernel (same call with and without pos_emb, u, v):")
        print("| dtype | T | forward without (ms) | forward with (ms) | ratio | fwd+bwd without (ms) | fwd+bwd with "
              "(ms) | ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for dtype in args.dtypes:
            for T in args.lengths:
                call = kernel_calls(T, args, dtype == "bfloat16")
                rounds = 3 if T >= 4000 else args.rounds
                f0, f1 = interleaved([call(False, False), call(True, False)], rounds)
                b0, b1 = interleaved([call(False, True), call(True, True)], rounds)
                print(f"| {dtype} | {T} | {f0 * 1e3:.1f} | {f1 * 1e3:.1f} | {f1 / f0:.2f}x | {b0 * 1e3:.1f} | "
                      f"{b1 * 1e3:.1f} | {b1 / b0:.2f}x |", flush=True)
    print("\n| module | dtype | T | RETURNN (s) | SDPA + bias (s) | dimattn (s) | vs RETURNN | vs SDPA + bias | "
          "peak RETURNN / SDPA / dimattn (MiB) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for module in args.modules:
        for dtype in args.dtypes:
            for T in args.lengths:
                amp = dtype == "bfloat16"
                m, x, time_, leaves = build(module, T, args)
                fns = [step_of(module, m, x, time_, leaves, amp, False), step_of(module, m, x, time_, leaves, amp, True)]
                if module == "attention":
                    fns.append(sdpa_peer(m, x, time_, leaves, amp, args))
                    err = check_agreement(m, x, time_, leaves, amp, args)
                    assert max(err) < (5e-2 if amp else 1e-3), f"the paths disagree by {err}"
                times = interleaved(fns, 2 if T >= 4000 else args.rounds)
                theirs, ours = times[0], times[1]
                peer = times[2] if len(times) > 2 else None
                variants = ["returnn", "sdpa", "dimattn"] if module == "attention" else ["returnn", "dimattn"]
                peaks = " / ".join(f"{peak(module, T, dtype, v, args):.0f}" for v in variants) \
                    if T in args.peak_at else ""
                print(f"| {module} | {dtype} | {T} | {theirs:.3f} | {peer or float('nan'):.3f} | {ours:.3f} | "
                      f"{theirs / ours:.2f}x | {(peer / ours) if peer else float('nan'):.2f}x | {peaks} |", flush=True)
                del m, x, fns
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
