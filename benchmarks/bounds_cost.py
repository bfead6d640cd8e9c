"""Cost of the offline bounds: time and peak memory of Belady and the bypass optimum at scale.

A ``fine-grained`` synthetic trace (48 x 128, top-8) is generated once; each (calls, cache size)
point runs both optima in fresh subprocesses, this tree's and, with ``--baseline REV``, revision
``REV``'s whole ``pallas_cache`` interleaved with them, reporting CPU seconds and peak RSS added
(medians of ``--repeats``). ``--python`` also times the Python loops at the smallest length.

    python benchmarks/bounds_cost.py [--calls N ...] [--sizes S ...] [--repeats 3]
                                     [--baseline REV] [--python] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_file import write_section  # noqa: E402

LAYERS, EXPERTS = 48, 128

# Runs in the subprocess (PYTHONPATH = the package root to time): argv = trace path prefix,
# calls, cache size.
CHILD = r"""
import json, resource, sys, time
import numpy as np
trace_path, calls, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from pallas_cache.sizing.traces import Trace
from pallas_cache.sizing import bounds
routes = np.load(trace_path + ".routes.npy", mmap_mode="r")[:calls]
layers = np.load(trace_path + ".layers.npy", mmap_mode="r")[:calls]
trace = Trace(routes=routes, layers=layers, num_layers=%d, num_experts=%d)
del routes, layers
with open("/proc/self/statm") as statm:  # resident pages now (the peak so far may be higher)
    base = int(statm.read().split()[1]) * resource.getpagesize() / 2**20
out = {"base_mb": base}
for name in ("belady", "bypass_optimum"):
    if not hasattr(bounds, name):
        continue
    cpu = time.process_time()
    result = getattr(bounds, name)(trace, size)
    out[name + "_s"] = time.process_time() - cpu
    out[name + "_hit_rate"] = result.hit_rate
out["added_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
print(json.dumps(out))
""" % (LAYERS, EXPERTS)


def run_child(trace_path: str, calls: int, size: int, root: str = ROOT,
              python: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=root)
    env["PALLAS_CACHE_COMPILED_BOUNDS"] = "0" if python else "1"
    done = subprocess.run([sys.executable, "-c", CHILD, trace_path, str(calls), str(size)],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[500_000, 1_000_000, 2_000_000])
    parser.add_argument("--sizes", type=int, nargs="+", default=[384, 1536, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default=None, help="git revision to compare with")
    parser.add_argument("--python", action="store_true",
                        help="also time the Python loops at the smallest --calls")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()

    from pallas_cache.sizing.synthetic import synthetic_trace
    import numpy as np

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        tokens = -(-max(args.calls) // LAYERS)
        start = time.perf_counter()
        trace = synthetic_trace("fine-grained", num_tokens=tokens, seed=0)
        trace_path = os.path.join(scratch, "trace")
        np.save(trace_path + ".layers.npy", trace.layers)
        np.save(trace_path + ".routes.npy", trace.routes)
        del trace
        print(f"trace: {tokens} tokens in {time.perf_counter() - start:.1f} s", flush=True)
        builds = {"now": ROOT}
        if args.baseline:
            builds[args.baseline] = os.path.join(scratch, "baseline")
            os.mkdir(builds[args.baseline])
            archive = subprocess.run(["git", "archive", args.baseline, "pallas_cache"], cwd=ROOT,
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", builds[args.baseline]], input=archive, check=True)
        loops = [("compiled", False)] + ([("python", True)] if args.python else [])
        for root in builds.values():  # compile (and cache) each build's loops before timing
            run_child(trace_path, min(args.calls), min(args.sizes), root)

        rows = []
        for loop, python in loops:
            for calls in args.calls[:1] if python else args.calls:
                for size in args.sizes:
                    runs: dict[str, list[dict]] = {name: [] for name in builds}
                    for _ in range(args.repeats):  # interleaved: the load hits both alike
                        for name, root in builds.items():
                            runs[name].append(run_child(trace_path, calls, size, root, python))
                    row = {"loop": loop, "calls": calls, "size": size}
                    for name, done in runs.items():
                        row[name] = {key: median_of(done, key) for key in done[0]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    load_after = os.getloadavg()
    text = render(rows, args.baseline, args.repeats, load_before[0], load_after[0],
                  " ".join(sys.argv[1:]).replace(" --write", ""))
    print(text)
    if args.write:
        write_section("bounds_cost", text)


def render(rows: list[dict], base: str | None, repeats: int, load_before: float,
           load_after: float, command: str) -> str:
    """The RESULTS.md section for the measured ``rows``."""
    lines = [
        "## Offline bounds at scale (`benchmarks/bounds_cost.py`)",
        "",
        f"{datetime.date.today()}, {platform.machine()} ({_cpu_name()}), {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; load average {load_before:.1f} before and "
        f"{load_after:.1f} after: other jobs shared the cores, so the CPU seconds of the "
        f"process (not wall time) are reported, still inflated by the contention -- compare "
        f"ratios within this run. `fine-grained` preset (48 x 128, top-8, seed 0), first "
        f"`calls` layer-calls; medians of {repeats} fresh processes"
        + (f", this tree's and revision `{base}`'s interleaved" if base else "")
        + ". CPU s = `belady` + `bypass_optimum` (`compiled`: Numba's loops, importing Numba "
        "and loading them from its cache included; `python`: `PALLAS_CACHE_COMPILED_BOUNDS=0`); "
        "`belady` builds the access arrays, which `bypass_optimum` reuses, so the bypass column "
        "is mostly the loop itself. Peak RSS added = the process's peak RSS minus its resident "
        "memory once the trace is loaded.",
        "",
        "| loop | calls | S | CPU s | " + (f"`{base}` CPU s | ratio | " if base else "")
        + "bypass CPU s | " + (f"`{base}` bypass CPU s | ratio | " if base else "")
        + "peak RSS added MB | belady hit | bypass hit |" + (" same hits |" if base else ""),
        "|---|---|---|---|" + ("---|---|" if base else "") + "---|" + ("---|---|" if base else "")
        + "---|---|---|" + ("---|" if base else ""),
    ]
    for row in rows:
        now = row["now"]
        cpu = now["belady_s"] + now["bypass_optimum_s"]
        cells = [row["loop"], f"{row['calls']:,}", str(row["size"]), f"{cpu:.2f}"]
        if base:
            old = row[base]
            old_cpu = old["belady_s"] + old["bypass_optimum_s"]
            cells += [f"{old_cpu:.2f}", f"{cpu / old_cpu:.2f}"]
        cells.append(f"{now['bypass_optimum_s']:.2f}")
        if base:
            cells += [f"{old['bypass_optimum_s']:.2f}",
                      f"{now['bypass_optimum_s'] / old['bypass_optimum_s']:.2f}"]
        cells += [f"{now['added_mb']:.0f}", f"{now['belady_hit_rate']:.4f}",
                  f"{now['bypass_optimum_hit_rate']:.4f}"]
        if base:
            same = all(now[key] == old[key] for key in ("belady_hit_rate",
                                                        "bypass_optimum_hit_rate"))
            cells.append("yes" if same else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Rerun: `python benchmarks/bounds_cost.py {command}`"]
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
