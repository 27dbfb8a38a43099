#!/usr/bin/env python3
"""dimattn against FlexAttention on the CPU (issue 28), forward only, in one process.

    ~/.cache/dimattn/venv/bin/python bench/flex_compare.py --T 2048

(the checkout's python/ package and build/python's op library unless PYTHONPATH or
DIMATTN_TORCH_OPS say otherwise; inductor compiles in this process, without a pool of
worker processes, unless TORCHINDUCTOR_COMPILE_THREADS says otherwise).

Per variant, dtype and T (B = 1, H = 8, D = 64 by default): the median wall time of
  dimattn   dimattn.dot_attention with the variant (the kernel that ran is checked:
            cpu_flash),
  flex      torch.compile(flex_attention) with the equivalent score_mod and
            BlockMask (made once, outside the timing, as a model would),
  sdpa      F.scaled_dot_product_attention with a materialised float mask (-inf where
            masked, plus ALiBi's bias), or is_causal for plain causal; "-" where it
            cannot express the variant (soft-capping) or its mask would pass
            --sdpa-max-bytes,
run alternately in rounds (each first in turn) so that load drifts reach all
alike. Forward only: FlexAttention has no backward on the CPU. Each row's outputs
are compared (max |diff| of dimattn's output against flex's and SDPA's).
Variants: causal; causal + window 256 (row i attends i - 256 .. i); causal + softcap 30;
causal + ALiBi (standard slopes 2^(-8 (h + 1) / H)); causal + 4 documents of T / 4
positions as a bool mask [t, kv]; the same documents as segment ids over t and kv
(dimattn's query_segments / kv_segments; the peers as for the mask); window + documents.
Prints a markdown table with the CPU, its flags, torch's version, the date and the
load before and after; dimattn's GFLOP/s (attended pairs only) and their share of the
machine's arithmetic peak (bench/peak_probe, built with the benchmarks). --quick: T = 256, 3 rounds (a smoke run).
"""
import argparse
import datetime
import os
import pathlib
import sys

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # before torch reads it
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

try:
    import dimattn as da
except ModuleNotFoundError:  # run from a checkout without PYTHONPATH: its python/ (and build/python's library)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "python"))
    import dimattn as da
from bench_timing import cpu_info, interleaved, machine_peak, of_peak

VARIANTS = ["causal", "window", "softcap", "alibi", "documents", "documents_segments", "window_documents"]
LABELS = {
    "causal": "causal",
    "window": "causal + window 256",
    "softcap": "causal + softcap 30",
    "alibi": "causal + ALiBi",
    "documents": "causal + 4 documents (bool mask [t, kv])",
    "documents_segments": "causal + 4 documents (segment ids [t], [kv])",
    "window_documents": "causal + window 256 + 4 documents",
}
WINDOW, SOFTCAP, DOCUMENTS = 256, 30.0, 4


class Problem:
    """q, k, v of [B, H, T, D] and the variant's pieces for each implementation."""

    def __init__(self, variant, dtype, T, args):
        B, H, D = args.batch, args.heads, args.head_dim
        torch.manual_seed(0)
        self.q, self.k, self.v = (torch.randn(B, H, T, D, dtype=dtype) for _ in range(3))
        pos = torch.arange(T)
        causal = pos[:, None] >= pos[None, :]
        doc = pos // max(1, T // DOCUMENTS)
        allowed = causal.clone()
        if "window" in variant:
            allowed &= pos[:, None] - pos[None, :] <= WINDOW
        if "documents" in variant:
            allowed &= doc[:, None] == doc[None, :]
        self.gflop = 4 * B * H * D * allowed.sum().item() / 1e9  # the attended pairs only (DESIGN.md §9)
        self.slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])

        # dimattn: keys and values over a kv dim of their own, so that a mask names
        # both positions ([t, kv]); causal across time and kv.
        self.dims = [da.Dim("batch", B), da.Dim("heads", H), da.Dim("time", T)]
        b, h, t = self.dims
        kv, f, vf = da.Dim("kv", T), da.Dim("feat", D), da.Dim("vfeat", D)
        self.out_dims = [b, h, t, vf]
        self.da_args = (da.Tensor(self.q, [b, h, t, f]), da.Tensor(self.k, [b, h, kv, f]),
                        da.Tensor(self.v, [b, h, kv, vf]))
        kw = dict(key_dim=f, axis=kv, causal_query_spatial_dim=t)
        if "window" in variant:
            kw["window"] = (WINDOW, None)
        if variant == "softcap":
            kw["softcap"] = SOFTCAP
        if variant == "alibi":
            kw["alibi_slopes"] = da.Tensor(self.slopes, [h])
        if variant == "documents_segments":
            kw["query_segments"], kw["kv_segments"] = da.Tensor(doc, [t]), da.Tensor(doc, [kv])
        elif "documents" in variant:
            kw["mask"] = da.Tensor(doc[:, None] == doc[None, :], [t, kv])
        self.da_kwargs = kw

        # FlexAttention: the mask as a BlockMask, the score change as a score_mod.
        def mask_mod(b_, h_, q_idx, kv_idx):
            m = q_idx >= kv_idx
            if "window" in variant:
                m = m & (q_idx - kv_idx <= WINDOW)
            if "documents" in variant:
                m = m & (doc[q_idx] == doc[kv_idx])
            return m

        self.block_mask = create_block_mask(mask_mod, None, None, T, T, device="cpu")
        self.score_mod = None
        if variant == "softcap":
            self.score_mod = lambda s, b_, h_, q_idx, kv_idx: SOFTCAP * torch.tanh(s / SOFTCAP)
        if variant == "alibi":
            slopes = self.slopes
            self.score_mod = lambda s, b_, h_, q_idx, kv_idx: s - slopes[h_] * (q_idx - kv_idx).abs()

        # SDPA: is_causal, or a materialised float mask.
        self.sdpa_kwargs = None
        if variant == "causal":
            self.sdpa_kwargs = dict(is_causal=True)
        elif variant != "softcap":
            planes = H if variant == "alibi" else 1
            if planes * T * T * torch.finfo(dtype).bits // 8 <= args.sdpa_max_bytes:
                m = torch.zeros(T, T, dtype=dtype).masked_fill(~allowed, float("-inf"))
                if variant == "alibi":
                    dist = (pos[:, None] - pos[None, :]).abs().to(torch.float32)
                    m = (m.float() - self.slopes[:, None, None] * dist).to(dtype)
                self.sdpa_kwargs = dict(attn_mask=m)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sdpa-max-bytes", type=int, default=1 << 30, help="largest materialised mask for SDPA")
    ap.add_argument("--quick", action="store_true", help="smoke run: T = 256, 3 rounds")
    args = ap.parse_args()
    if args.quick:
        args.T, args.rounds = [256], 3
    torch.set_num_threads(args.threads)
    # Every (variant, dtype, T) is a graph of its own: past dynamo's default limit
    # of 8 per function, flex_attention would fall back to its slow eager form.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)
    flex = torch.compile(flex_attention, dynamic=False)
    model, flags = cpu_info()
    peak = machine_peak(args.threads)
    load_before = os.getloadavg()
    print(f"# flex_compare: {model}; flags: {flags}\n# torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{datetime.datetime.now().isoformat(timespec='minutes')}, load before {load_before}; "
          f"B={args.batch} H={args.heads} D={args.head_dim}, forward, median of {args.rounds} rounds (wall)",
          flush=True)
    print("# machine peak (bench/peak_probe): " + (", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peak.items())
                                                 if peak else "not built, no % of peak"), flush=True)

    # First every row's setup, its first calls (flex's compilation) and its
    # agreement check; then the timings, with no compiler at work.
    problems = []
    with torch.no_grad():
        for T in args.T:
            for dtype_name in args.dtypes:
                for variant in args.variants:
                    p = Problem(variant, getattr(torch, dtype_name), T, args)
                    p.label, p.dtype_name, p.T = LABELS[variant], dtype_name, T
                    p.fns = [lambda p=p: da.dot_attention(*p.da_args, **p.da_kwargs),
                             lambda p=p: flex(p.q, p.k, p.v, score_mod=p.score_mod, block_mask=p.block_mask)]
                    if p.sdpa_kwargs is not None:
                        p.fns.append(lambda p=p: F.scaled_dot_product_attention(p.q, p.k, p.v, **p.sdpa_kwargs))
                    with da.trace(capture_tensors=False) as tr:
                        out = p.fns[0]()
                    kernel = tr.records[0].kernel
                    assert kernel == "cpu_flash", f"{variant}: dimattn ran {kernel}"
                    out = out.raw_in(p.out_dims).float()
                    p.diffs = [(out - fn().float()).abs().max().item() for fn in p.fns[1:]]
                    problems.append(p)
        print(f"# set up and compiled {len(problems)} rows; load {os.getloadavg()}", flush=True)
        rows = []
        for p in problems:
            times = interleaved(p.fns, args.rounds)
            t_sdpa = times[2] if len(times) > 2 else None
            rows.append((p.label, p.dtype_name, p.T, times[0], p.gflop / times[0], times[1], t_sdpa,
                         times[0] / min(times[1:]), p.diffs[0], p.diffs[1] if len(p.diffs) > 1 else None))
            print(f"# {p.label}, {p.dtype_name}, T={p.T}: dimattn {times[0] * 1e3:.1f} ms, flex {times[1] * 1e3:.1f} ms"
                  + (f", sdpa {t_sdpa * 1e3:.1f} ms" if t_sdpa else ""), flush=True)

    ms = lambda t: "—" if t is None else f"{t * 1e3:.1f}"
    dif = lambda d: "—" if d is None else f"{d:.1e}"
    print("\n| variant | dtype | T | dimattn ms | dimattn GFLOP/s (% of peak) | FlexAttention ms | SDPA + mask ms "
          "| dimattn / best peer | max abs diff vs flex | vs SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, dt, T, t_da, rate, t_flex, t_sdpa, ratio, d_flex, d_sdpa in rows:
        print(f"| {label} | {dt} | {T} | {ms(t_da)} | {rate:.0f} ({of_peak(rate, peak, dt)}) | {ms(t_flex)} "
              f"| {ms(t_sdpa)} | {ratio:.2f}x | {dif(d_flex)} | {dif(d_sdpa)} |")
    print("\nGFLOP/s: 4·B·H·D per attended (query, key) pair (window and documents count only theirs) over "
          "dimattn's median; % of peak: of the machine peak above for the dtype")
    print(f"\nload before {load_before}, after {os.getloadavg()}")


if __name__ == "__main__":
    main()
