"""Context parallelism over torch.distributed (Gloo over the loopback, processes
started here): every rank's shard of the output and of the gradients equals the
single-process dot_attention's (float32 1e-5, bfloat16 and float64 as
docs/numerics.md allows; gradients twice that), dropout included; bad input
raises on every rank; a failing rank makes every other rank raise within the
timeout instead of hanging."""
import datetime
import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dimattn as da

TIMEOUT_S = 240  # for one group of processes, all its cases


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker, world: int, *args):
    """Runs worker(rank, world, *args) in `world` processes joined into one Gloo
    group; fails when any raises or the group outlives TIMEOUT_S."""
    port = _free_port()
    ctx = mp.start_processes(_entry, args=(world, port, worker, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"the {world} processes did not finish within {TIMEOUT_S} s")


def _entry(rank, world, port, worker, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        worker(rank, world, *args)
    finally:
        dist.destroy_process_group()


# --- the cases ----------------------------------------------------------------------

def _case(rank, world, *, T, causal, sharding, strategy, dropout=0.0, lengths=None, gqa=False, window=None,
          softcap=None, alibi=False, sinks=False, off_by_one=False, segments=False, dtype=torch.float32, tol=1e-5):
    """One call on the whole sequence (single process) and context-parallel;
    compares this rank's shards. Returns whether dropout changed the output (when on)."""
    B, Hkv, G, D = 2, 2, (2 if gqa else 1), 8
    b, h, f = da.Dim("batch", B), da.Dim("heads", Hkv), da.Dim("feat", D)
    g = da.Dim("group", G)
    gen = torch.Generator().manual_seed(1234 + T)
    qdims_full = [b, h, g] if gqa else [b, h]
    qshape = [B, Hkv, G] if gqa else [B, Hkv]

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    qf, kf, vf = rand(*qshape, T, D), rand(B, Hkv, T, D), rand(B, Hkv, T, D)
    gof = rand(*qshape, T, D)
    len_t = None if lengths is None else da.Tensor(torch.tensor(lengths), [b])
    t = da.Dim.dynamic("time", len_t) if len_t is not None else da.Dim("time", T)
    slopes = da.Tensor(torch.tensor([0.5, 0.25], dtype=dtype), [h]) if alibi else None
    opts = dict(key_dim=f, att_dropout=dropout, train=dropout > 0, window=window, softcap=softcap,
                alibi_slopes=slopes, sink_off_by_one=off_by_one)
    # Documents of growing lengths (1, 1, 2, 3, ...: floor(sqrt(c t))), other ones per
    # batch entry, runs that cross the shards' edges.
    ids = torch.stack([torch.arange(T).mul(2 + e).sqrt().floor().long() for e in range(B)])
    sink_logits = torch.tensor([0.7, -0.4], dtype=dtype)

    def call(q, k, v, tdim, seg=ids, **kw):
        pos = dict(causal_query_spatial_dim=tdim) if causal else dict(query_position_dim=tdim)
        if segments:
            kw = {**kw, "query_segments": da.Tensor(seg, [b, tdim]), "kv_segments": da.Tensor(seg, [b, tdim])}
        return da.dot_attention(da.Tensor(q, qdims_full + [tdim, f]), da.Tensor(k, [b, h, tdim, f]),
                                da.Tensor(v, [b, h, tdim, f]), axis=tdim, **pos, **{**opts, **kw})

    # Single process, from the same generator state as the ranks' call below.
    q1, k1, v1, s1 = (x.clone().requires_grad_() for x in (qf, kf, vf, sink_logits))
    torch.manual_seed(99)
    ref = call(q1, k1, v1, t, **({"sinks": da.Tensor(s1, [h])} if sinks else {}))
    (ref.raw * gof).sum().backward()

    cp = da.ContextParallel(None, sharding, strategy, timeout=60)
    ranges = da.shard_ranges(T, world, rank, sharding)

    def sh(x):
        return torch.cat([x.narrow(-2, s, e - s) for s, e in ranges], -2)

    tl = t if t.is_dynamic else da.Dim("time", sh(kf).shape[-2])
    # The query through the package's own helper, keys and values by hand.
    qs = da.shard(da.Tensor(qf, qdims_full + [t, f]), t, cp, tl).raw.clone().requires_grad_()
    assert torch.equal(qs, sh(qf))
    ks, vs = (sh(x).clone().requires_grad_() for x in (kf, vf))
    s2 = sink_logits.clone().requires_grad_()
    torch.manual_seed(99)
    out = call(qs, ks, vs, tl, sh(ids[..., None])[..., 0], context_parallel=cp,
               **({"sinks": da.Tensor(s2, [h])} if sinks else {}))
    (out.raw * sh(gof)).sum().backward()
    if sinks:
        # A replicated parameter: its gradient summed over the ranks is the
        # whole call's.
        dsinks = s2.grad.clone()
        dist.all_reduce(dsinks)
        err = (dsinks - s1.grad).abs().max().item()
        assert err <= 2 * tol, f"rank {rank}/{world} d(sinks): max error {err} > {2 * tol}"
        assert s1.grad.abs().max().item() > 1e-3, "d(sinks) is zero: the sinks case tests nothing"
    assert [d.name for d in out.dims] == [d.name for d in ref.dims]
    # docs/numerics.md's tolerances: `tol` for outputs, twice it for gradients.
    for name, got, want, limit in (("output", out.raw, sh(ref.raw.detach()), tol),
                                   ("d(query)", qs.grad, sh(q1.grad), 2 * tol),
                                   ("d(keys)", ks.grad, sh(k1.grad), 2 * tol),
                                   ("d(values)", vs.grad, sh(v1.grad), 2 * tol)):
        err = (got - want).abs().max().item()
        assert err <= limit, f"rank {rank}/{world} {name}: max error {err} > {limit}"
    if dropout:
        plain = call(qf, kf, vf, t, train=False)
        return not torch.allclose(plain.raw, ref.raw.detach())
    return False


def _cases_worker(rank, world, expected):
    ran = []
    T = 24 if world != 3 else 25  # 3 ranks: uneven contiguous shards (9, 8, 8)
    T_lb = 24  # load_balanced: a multiple of 2N for N = 2, 3, 4
    _case(rank, world, T=T, causal=False, sharding="contiguous", strategy="ring")
    ran.append("non-causal")
    _case(rank, world, T=T, causal=True, sharding="contiguous", strategy="ring")
    ran.append("causal contiguous")
    _case(rank, world, T=T_lb, causal=True, sharding="load_balanced", strategy="ring")
    ran.append("causal load-balanced")
    _case(rank, world, T=T_lb, causal=True, sharding="load_balanced", strategy="all_gather")
    ran.append("causal load-balanced all_gather")
    _case(rank, world, T=T_lb, causal=True, sharding="load_balanced", strategy="ring", lengths=[T_lb, T_lb - 9])
    ran.append("padding")
    _case(rank, world, T=T, causal=True, sharding="contiguous", strategy="ring", gqa=True)
    ran.append("GQA")
    _case(rank, world, T=T_lb, causal=True, sharding="load_balanced", strategy="ring", window=(5, None), softcap=20.0,
          alibi=True)
    ran.append("window + softcap + ALiBi")
    _case(rank, world, T=T_lb, causal=True, sharding="load_balanced", strategy="ring", sinks=True, gqa=True)
    ran.append("sinks")
    _case(rank, world, T=T, causal=False, sharding="contiguous", strategy="all_gather", off_by_one=True)
    ran.append("sink_off_by_one")
    _case(rank, world, T=T, causal=True, sharding="contiguous", strategy="ring", segments=True, gqa=True)
    ran.append("segments contiguous")
    _case(rank, world, T=T_lb, causal=True, sharding="load_balanced", strategy="all_gather", segments=True,
          lengths=[T_lb, T_lb - 7], window=(6, None))
    ran.append("segments load-balanced")
    _case(rank, world, T=T, causal=False, sharding="contiguous", strategy="ring", dtype=torch.float64, tol=1e-12)
    ran.append("float64")
    # bfloat16: the merge in float32 rounds once more than one process does
    # (docs/numerics.md's bfloat16 tolerance for outputs and gradients).
    _case(rank, world, T=T_lb, causal=True, sharding="load_balanced", strategy="ring", dtype=torch.bfloat16, tol=2e-2)
    ran.append("bfloat16")
    for strategy in ("ring", "all_gather"):
        assert _case(rank, world, T=T_lb, causal=True, sharding="load_balanced", strategy=strategy, dropout=0.3,
                     lengths=[T_lb, T_lb - 5]), "dropout did not change the output: the dropout case tests nothing"
        ran.append(f"dropout exact {strategy}")
    assert ran == expected, f"rank {rank}: ran {ran}"


EXPECTED = ["non-causal", "causal contiguous", "causal load-balanced", "causal load-balanced all_gather", "padding",
            "GQA", "window + softcap + ALiBi", "sinks", "sink_off_by_one", "segments contiguous",
            "segments load-balanced", "float64", "bfloat16", "dropout exact ring", "dropout exact all_gather"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_equals_single_process(world):
    _spawn(_cases_worker, world, EXPECTED)


# --- bad input and failures -----------------------------------------------------------

def _expect_error(fn, *needles):
    try:
        fn()
    except da.Error as e:
        for n in needles:
            assert n in str(e), f"{n!r} not in {e}"
        return
    raise AssertionError(f"no dimattn.Error (expected one saying {needles})")


def _errors_worker(rank, world):
    b, f = da.Dim("batch", 2), da.Dim("feat", 8)
    T_local = 4 + (2 if rank == 1 else 0)  # rank 1's shard differs: inconsistent for load_balanced
    t = da.Dim("time", T_local)
    x = da.Tensor(torch.randn(2, T_local, 8), [b, t, f])
    cp = da.ContextParallel(None, "load_balanced", "ring", timeout=30)
    # Shard sizes inconsistent across ranks: every rank raises.
    _expect_error(lambda: da.dot_attention(x, x, x, key_dim=f, axis=t, causal_query_spatial_dim=t,
                                           context_parallel=cp), "shard lengths", "load_balanced")
    # Other sizes of the other dims on one rank (rank 2's batch).
    b2 = da.Dim("batch", 3 if rank == 2 else 2)
    z = da.Tensor(torch.randn(b2.size, T_local if rank != 1 else 4, 8), [b2, da.Dim("time", 4) if rank == 1 else t, f])
    tz = z.dims[1]
    _expect_error(lambda: da.dot_attention(z, z, z, key_dim=f, axis=tz, causal_query_spatial_dim=tz,
                                           context_parallel=da.ContextParallel(None, "contiguous", "ring", timeout=30)),
                  "rank 2 calls with other options or other sizes")
    # Sharding a dim that is not the query's positional dim (cross-attention).
    kv = da.Dim("kv", 5)
    y = da.Tensor(torch.randn(2, 5, 8), [b, kv, f])
    _expect_error(lambda: da.dot_attention(x, y, y, key_dim=f, axis=kv, context_parallel=cp), "lacks it")
    # A group of size 1.
    groups = [dist.new_group([r]) for r in range(world)]  # every rank takes part in creating each group
    solo = groups[rank]
    _expect_error(lambda: da.dot_attention(x, x, x, key_dim=f, axis=t, causal_query_spatial_dim=t,
                                           context_parallel=da.ContextParallel(solo)), "group of size 1")
    # Options this path does not take yet.
    keep = da.Tensor(torch.ones(2, T_local, dtype=torch.bool), [b, t])
    _expect_error(lambda: da.dot_attention(x, x, x, key_dim=f, axis=t, causal_query_spatial_dim=t, mask=keep,
                                           context_parallel=cp), "does not take mask")
    # Segment ids over a dim the operands lack.
    other = da.Dim("other", 2)
    ids = da.Tensor(torch.zeros(2, T_local, dtype=torch.int64), [other, t])
    _expect_error(lambda: da.dot_attention(x, x, x, key_dim=f, axis=t, causal_query_spatial_dim=t, query_segments=ids,
                                           kv_segments=ids, context_parallel=cp), "vary over other")
    # Segment ids that do not vary over the sharded axis (a rank's constant would meet other ranks' keys).
    per_entry = da.Tensor(torch.zeros(2, dtype=torch.int64), [b])
    _expect_error(lambda: da.dot_attention(x, x, x, key_dim=f, axis=t, causal_query_spatial_dim=t,
                                           query_segments=per_entry, kv_segments=per_entry, context_parallel=cp),
                  "do not vary over the sharded axis")


def test_bad_input_raises_on_every_rank():
    _spawn(_errors_worker, 3)


def _failing_worker(rank, world, when):
    """Rank 1 dies (before the forward pass, or between the passes); the others
    must raise within the timeout, not hang."""
    b, f = da.Dim("batch", 1), da.Dim("feat", 8)
    t = da.Dim("time", 8)
    x = torch.randn(1, 8, 8, requires_grad=True)
    cp = da.ContextParallel(None, "contiguous", "ring", timeout=10)
    if rank == 1 and when == "forward":
        os._exit(0)
    start = time.monotonic()
    try:
        out = da.dot_attention(da.Tensor(x, [b, t, f]), da.Tensor(x, [b, t, f]), da.Tensor(x, [b, t, f]), key_dim=f,
                               axis=t, causal_query_spatial_dim=t, context_parallel=cp)
        if rank == 1:
            os._exit(0)
        out.raw.sum().backward()
    except RuntimeError as e:
        took = time.monotonic() - start
        assert took < 30, f"rank {rank} raised only after {took:.0f} s"
        assert "context_parallel" in str(e), str(e)
        os._exit(0)  # the group is broken: leave without its teardown
    traceback.print_stack()
    raise AssertionError(f"rank {rank} finished although rank 1 died in the {when} pass")


@pytest.mark.parametrize("when", ["forward", "backward"])
def test_failing_rank_makes_every_rank_raise(when):
    _spawn(_failing_worker, 3, when)
