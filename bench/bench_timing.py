"""Timing and machine facts shared by the Python benchmarks (bench/*.py import it as a sibling
module)."""
import platform
import re
import statistics
import subprocess
import sys
import time


def cpu_info():
    """The CPU's model name and the vector flags the kernels' paths depend on (avx2, fma, avx512*,
    amx*), space-separated: what every figure names."""
    model, flags, family = platform.processor() or "?", set(), {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model in ("?", "x86_64", ""):
                model = line.split(":", 1)[1].strip()
            for key in ("cpu family", "model"):  # the name alone ("AMD EPYC") does not say which generation
                if line.split(":", 1)[0].strip() == key and key not in family:
                    family[key] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
    if family:
        model += f" (family {family.get('cpu family', '?')} model {family.get('model', '?')})"
    shown = sorted(x for x in flags if re.fullmatch(r"avx2|fma|avx512[a-z_0-9]*|amx[a-z_0-9]*", x))
    return model, " ".join(shown)


def interleaved(fns, rounds, clock=time.perf_counter, probe=None):
    """Median seconds of each fn, run alternately (each first in turn) after one warm-up each, so
    that load drifts reach every fn alike, and so does what the round before left behind (the first
    call of a round pays for memory the last one gave back). `probe` (a measure of the machine,
    e.g. a read of memory): run and timed at the start of every round, so that it sees the same
    minutes as the fns and precedes each of them in turn (equally often when rounds is a multiple
    of len(fns)); its median comes last."""
    def seconds(fn):
        t0 = clock()
        fn()
        return clock() - t0

    for fn in fns:
        fn()
    times = [[] for _ in fns]
    n = len(fns)
    probe_times = []
    for r in range(rounds):
        if probe is not None:
            probe_times.append(seconds(probe))
        for i in [(r + j) % n for j in range(n)]:
            times[i].append(seconds(fns[i]))
    return [statistics.median(t) for t in times] + ([statistics.median(probe_times)] if probe_times else [])


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def peak_growth_of(fn):
    """Bytes the process's peak resident set grows by while fn() runs (VmHWM, reset to the
    current resident set through /proc/self/clear_refs first)."""
    base = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    fn()
    return (_status_kb("VmHWM") - base) * 1024


def peak_in_fresh_process(script, args):
    """The integer a fresh `python script args...` prints last: each variant's peak
    measured without what an earlier one left behind."""
    out = subprocess.run([sys.executable, script, *map(str, args)], check=True, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1])


def machine_peak(threads):
    """The machine's arithmetic limits on `threads` threads, in GFLOP/s, as bench/peak_probe
    measures them (dimattn/testing/machine_peak.h): {"float32": best float32 FMA rate,
    "bfloat16": the vdpbf16ps rate where the CPU has it, else the float32 one}, or None when the
    probe is not built (DIMATTN_PEAK_PROBE, else the checkout's build/bench/peak_probe)."""
    import json
    import os
    import pathlib
    import tempfile
    probe = os.environ.get("DIMATTN_PEAK_PROBE",
                           str(pathlib.Path(__file__).resolve().parent.parent / "build" / "bench" / "peak_probe"))
    if not os.access(probe, os.X_OK):
        return None
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([probe, f"--threads={threads}", f"--json={f.name}"], check=True, capture_output=True)
        limits = json.load(f)["limits"]
    rate = {row["what"]: row["all_threads"] for row in limits}
    f32 = max((v for k, v in rate.items() if k.startswith("float32 FMA")), default=None)
    if f32 is None:
        return None
    bf16 = next((v for k, v in rate.items() if k.startswith("bfloat16 dot")), f32)
    return {"float32": f32, "bfloat16": bf16, "float16": f32}


def of_peak(gflops, peak, dtype_name):
    """gflops as a percentage of machine_peak()'s limit for the dtype, formatted; "—" without one."""
    return "—" if not peak else f"{100 * gflops / peak[dtype_name]:.0f}%"
