"""Decoding over KV caches on the CPU: dimattn.kv_cache_attention (contiguous and paged
caches) against ATen's SDPA (enable_gqa) in one process, and every row's K + V bytes
over its time against the machine's read bandwidth, measured here by a read-only probe.

    python bench/decode.py                 # the grid docs/perf.md draws from
    python bench/decode.py --quick         # a few rows
    python bench/decode.py --svg docs/decode.svg
    python bench/decode.py --dtype bfloat16 --cache 32768 --B 1   # a part of the grid
    python bench/decode.py --block-sizes 16,32,64,128            # what a pool's block size costs

Each call's query rows are the last positions of their sequence (causal, bottom-right);
D = 128, 32 query heads over 8 kv heads (GQA) or 1 (multi-query). Caches rotate
through enough copies (>= 512 MiB in all) that each call reads its cache from memory,
not from the last level cache. Times are medians of interleaved rounds (bench_timing).
"""
import argparse
import functools
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_timing import cpu_info, interleaved  # noqa: E402

import dimattn as da  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROTATE_BYTES = 512 << 20


@functools.cache
def read_probe():
    """A read-only stream for the start of every round of a row: torch's sum over a 1 GiB float32
    buffer on the benchmark's threads (the sum's arithmetic is far below the machine's peak). Its
    bytes over its median time are the machine's read bandwidth in those rounds."""
    x = torch.ones(1 << 28)
    return lambda: x.sum(), x.numel() * 4


def caches(B, S, Hkv, D, dtype, copies, hnd):
    """`copies` random caches, [B, S, Hkv, D] (NHD) or [B, Hkv, S, D] (HND, ATen's layout)."""
    g = torch.Generator().manual_seed(0)
    shape = (B, Hkv, S, D) if hnd else (B, S, Hkv, D)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(copies)]


def paged(k, v, block, hnd, shuffled=True):
    """The cache as pools of `block` positions (in a shuffled order unless not `shuffled`), and the
    table that finds them."""
    if hnd:  # [B, Hkv, S, D] -> [B * S / block, Hkv, block, D]
        B, Hkv, S, D = k.shape
        k, v = (x.view(B, Hkv, S // block, block, D).transpose(1, 2).reshape(-1, Hkv, block, D) for x in (k, v))
    else:
        B, S, Hkv, D = k.shape
        k, v = (x.reshape(-1, block, Hkv, D) for x in (k, v))
    perm = (torch.randperm(k.shape[0], generator=torch.Generator().manual_seed(1)) if shuffled
            else torch.arange(k.shape[0]))
    table = torch.argsort(perm).to(torch.int32).view(B, S // block)
    return k[perm].contiguous(), v[perm].contiguous(), table


# Layouts: "NHD" and "HND" contiguous caches ([B, S, Hkv, D], FlashAttention's;
# [B, Hkv, S, D], ATen's), "paged N" / "paged HND N": pools of blocks of N positions,
# shuffled; "... in order": the pool's blocks in the sequence's order (what the shuffle costs).
def row(B, Tq, S, H, Hkv, dtype, layouts, rounds):
    D = 128
    t = DTYPES[dtype]
    kv_bytes = 2 * B * S * Hkv * D * t.itemsize
    copies = max(2, math.ceil(ROTATE_BYTES / kv_bytes))
    data = {hnd: caches(B, S, Hkv, D, t, copies, hnd) for hnd in (False, True)
            if any(("HND" in x) == hnd for x in layouts) or hnd}  # HND always: ATen reads it
    q = torch.randn(B, Tq, H, D).to(t)
    lens = torch.full((B,), S)
    state = {"i": 0}

    def rotating(call):
        def fn():
            state["i"] = (state["i"] + 1) % copies
            return call(state["i"])
        return fn

    fns = []
    for layout in layouts:
        hnd = "HND" in layout
        kw = {"kv_layout": "HND"} if hnd else {}
        if layout.startswith("paged"):
            block = int(layout.removesuffix(" in order").split()[-1])
            pools = [paged(k, v, block, hnd, not layout.endswith(" in order")) for k, v in data[hnd]]
            fns.append(rotating(lambda i, p=pools, kw=kw: da.kv_cache_attention(q, p[i][0], p[i][1], lens, p[i][2],
                                                                                **kw)))
        elif hnd:  # a contiguous heads-outer cache: one block per sequence
            table = torch.arange(B, dtype=torch.int32).view(B, 1)
            fns.append(rotating(lambda i: da.kv_cache_attention(q, data[True][i][0], data[True][i][1], lens, table,
                                                                kv_layout="HND")))
        else:
            fns.append(rotating(lambda i: da.kv_cache_attention(q, data[False][i][0], data[False][i][1], lens)))
    qa = q.transpose(1, 2)
    mask = None if Tq == 1 else torch.ones(Tq, S, dtype=torch.bool).tril(S - Tq)
    fns.append(rotating(lambda i: F.scaled_dot_product_attention(qa, data[True][i][0], data[True][i][1],
                                                                 attn_mask=mask, enable_gqa=True)))
    # The probe in the same rounds as the calls: the machine's bandwidth drifts with its neighbours' load.
    probe, probe_bytes = read_probe()
    names = list(layouts) + ["aten"]
    *times, probe_time = interleaved(fns, rounds, probe=probe)
    bandwidth = probe_bytes / probe_time / 1e9
    out = {"B": B, "Tq": Tq, "cache": S, "heads": f"{H}/{Hkv}", "dtype": dtype, "kv_bytes": kv_bytes,
           "read_GBps": bandwidth,
           "ms": {n: tm * 1e3 for n, tm in zip(names, times)}}
    out["GBps"] = {n: kv_bytes / tm / 1e9 for n, tm in zip(names, times)}
    out["pct_bw"] = {n: 100 * g / bandwidth for n, g in out["GBps"].items()}
    return out


def block_sweep(sizes):
    """Pools of each block size against the contiguous caches at B = 1, 32k positions, 32/8
    heads, every dtype; the smallest also in order."""
    layouts = ["HND", "NHD"] + [f"paged HND {n}" for n in sizes] + [f"paged HND {sizes[0]} in order"] + \
        [f"paged {n}" for n in sizes]
    return [(1, 1, 32768, 32, 8, dtype, layouts) for dtype in DTYPES]


def grid(quick):
    """The rows docs/perf.md draws from: every dtype and head configuration at B = 1 over 1k..128k
    positions (one query), both contiguous layouts and paged pools up to 32k, query positions
    4 and 16 and B = 8 at 32k."""
    if quick:
        return [(1, 1, 32768, 32, 8, "float32", ["NHD", "HND", "paged 16", "paged HND 16"]),
                (1, 1, 32768, 32, 8, "bfloat16", ["HND"])]
    rows = []
    for dtype in DTYPES:
        for hkv in (8, 1):
            for S in (1024, 4096, 32768, 131072):
                layouts = ["HND"] + (["NHD", "paged 16", "paged 128", "paged HND 16", "paged HND 128"]
                                     if S <= 32768 else [])
                rows.append((1, 1, S, 32, hkv, dtype, layouts))
    for tq in (4, 16):
        for dtype in ("float32", "bfloat16"):
            rows.append((1, tq, 32768, 32, 8, dtype, ["HND", "NHD"]))
    for dtype in DTYPES:
        rows.append((8, 1, 32768, 32, 8, dtype, ["HND", "paged HND 16"]))
    return rows


def svg(rows, path, bandwidth):
    """GB/s against cache length (log scale) for the B = 1, one-query rows: one line per dtype and
    head configuration, dashed the probe's highest read bandwidth."""
    series = {}
    for r in rows:
        if r["B"] == 1 and r["Tq"] == 1:
            series.setdefault(f'{r["dtype"]} {r["heads"]}', []).append((r["cache"], r["GBps"]["HND"]))
    W, Hh, L, T = 640, 360, 60, 30
    xs = sorted({x for s in series.values() for x, _ in s})
    top = max([bandwidth] + [y for s in series.values() for _, y in s]) * 1.1
    def px(x):
        return L + (math.log2(x) - math.log2(xs[0])) / max(1e-9, math.log2(xs[-1]) - math.log2(xs[0])) * (W - L - 150)
    def py(y):
        return Hh - 40 - y / top * (Hh - 40 - T)
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{Hh}" font-family="sans-serif" font-size="11">',
           f'<text x="{L}" y="18">kv_cache_attention, B=1, one query, D=128, HND cache: K+V GB/s vs cache length</text>',
           f'<line x1="{L}" y1="{py(0)}" x2="{W - 150}" y2="{py(0)}" stroke="black"/>',
           f'<line x1="{L}" y1="{py(0)}" x2="{L}" y2="{T}" stroke="black"/>',
           f'<line x1="{L}" y1="{py(bandwidth)}" x2="{W - 150}" y2="{py(bandwidth)}" stroke="gray" stroke-dasharray="4"/>',
           f'<text x="{W - 145}" y="{py(bandwidth) + 4}">read probe {bandwidth:.0f} GB/s</text>']
    for x in xs:
        out.append(f'<text x="{px(x) - 10}" y="{Hh - 22}">{x // 1024}k</text>')
    for y in range(0, int(top) + 1, 10):
        out.append(f'<text x="{L - 25}" y="{py(y) + 4}">{y}</text>')
    for i, (name, pts) in enumerate(sorted(series.items())):
        c = colors[i % len(colors)]
        pts = sorted(pts)
        out.append('<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>' %
                   (c, " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)))
        out.append(f'<text x="{W - 145}" y="{py(bandwidth) + 24 + 16 * i}" fill="{c}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def block_sizes(text):
    """argparse's type for --block-sizes: positive divisors of the sweep's 32k positions."""
    try:
        sizes = [int(n) for n in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 or 32768 % n for n in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: want comma-separated divisors of 32768, e.g. 16,32,64,128")
    return sizes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--svg", help="write the plot here")
    ap.add_argument("--dtype", help="only the grid's rows of these dtypes (comma-separated), e.g. bfloat16")
    ap.add_argument("--cache", help="only the grid's rows of these cache lengths (comma-separated), e.g. 32768")
    ap.add_argument("--B", help="only the grid's rows of these batch sizes (comma-separated)")
    ap.add_argument("--block-sizes", type=block_sizes, help="instead of the grid, paged pools of these block sizes (comma-separated) "
                    "against contiguous caches at 32k positions, e.g. 16,32,64,128")
    a = ap.parse_args()
    model, flags = cpu_info()
    print(f"# {model}; {flags}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("# read bw: the probe (torch's sum of 1 GiB float32) at the start of each of the row's rounds")
    print("| B | query rows | cache | heads | dtype | layout | dimattn ms | K+V GB/s | read bw GB/s | % of read bw "
          "| ATen ms | ATen / dimattn |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    def wanted(spec):
        B, _, S, _, _, dtype, _ = spec
        return all(sel is None or str(v) in sel.split(",") for sel, v in ((a.dtype, dtype), (a.cache, S), (a.B, B)))
    specs = block_sweep(a.block_sizes) if a.block_sizes else grid(a.quick)
    for spec in filter(wanted, specs):
        r = row(*spec, rounds=a.rounds)
        rows.append(r)
        for layout in spec[-1]:
            print(f'| {r["B"]} | {r["Tq"]} | {r["cache"] // 1024}k | {r["heads"]} | {r["dtype"]} | {layout} | '
                  f'{r["ms"][layout]:.2f} | {r["GBps"][layout]:.1f} | {r["read_GBps"]:.1f} | '
                  f'{r["pct_bw"][layout]:.0f}% | {r["ms"]["aten"]:.2f} | {r["ms"]["aten"] / r["ms"][layout]:.1f}x |',
                  flush=True)
    bw = max(r["read_GBps"] for r in rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": model, "flags": flags, "rows": rows}, f, indent=1)
    if a.svg:
        svg(rows, a.svg, bw)


if __name__ == "__main__":
    main()
