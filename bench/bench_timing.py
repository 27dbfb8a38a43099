"""Timing shared by the Python benchmarks (bench/*.py import it as a sibling module)."""
import statistics
import time


def interleaved(fns, rounds, clock=time.perf_counter):
    """Median seconds of each fn, run alternately (order flipped every round) after one warm-up each,
    so that load drifts reach every fn alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for r in range(rounds):
        for i in list(range(len(fns)))[::(-1 if r % 2 else 1)]:
            t0 = clock()
            fns[i]()
            times[i].append(clock() - t0)
    return [statistics.median(t) for t in times]
