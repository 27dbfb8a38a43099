"""Timing shared by the Python benchmarks (bench/*.py import it as a sibling module)."""
import statistics
import time


def interleaved(fns, rounds, clock=time.perf_counter):
    """Median seconds of each fn, run alternately (each first in turn) after one warm-up each, so
    that load drifts reach every fn alike, and so does what the round before left behind (the first
    call of a round pays for memory the last one gave back)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    n = len(fns)
    for r in range(rounds):
        for i in [(r + j) % n for j in range(n)]:
            t0 = clock()
            fns[i]()
            times[i].append(clock() - t0)
    return [statistics.median(t) for t in times]
