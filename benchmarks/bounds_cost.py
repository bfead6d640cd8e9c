"""Cost of the offline bounds: time and peak memory of Belady and the bypass optimum at scale.

A ``fine-grained`` synthetic trace (48 layers x 128 experts, top-8) of the largest requested
length is generated once and saved; each (calls, cache size) point then runs in a fresh
subprocess, which maps the first ``calls`` layer-calls, records its resident memory, runs
``belady`` and ``bypass_optimum`` (they share the trace's access arrays, as a replay sweep
does) and reports the CPU seconds of each and the peak RSS they added. Each figure is the median
of ``--repeats`` subprocesses. ``--baseline REV`` also times ``belady`` of the
``pallas_cache/sizing/bounds.py`` of git revision ``REV`` at the largest length, for a ratio
from the same run.

    python benchmarks/bounds_cost.py [--calls 500000 1000000 2000000] [--sizes 384 1536 4096]
                                     [--repeats 3] [--baseline REV [--baseline-sizes S ...]]
                                     [--write]

``--write`` replaces the bounds section of benchmarks/RESULTS.md.
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

# Runs in the subprocess: argv = trace path prefix, calls, cache size, module directory or "" (library).
CHILD = r"""
import json, resource, sys, time
import numpy as np
trace_path, calls, size, module_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
from pallas_cache.sizing.traces import Trace
if module_dir:
    sys.path.insert(0, module_dir)
    import baseline_bounds as bounds
else:
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


def run_child(trace_path: str, calls: int, size: int, module_dir: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", CHILD, trace_path, str(calls), str(size),
                           module_dir], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[500_000, 1_000_000, 2_000_000])
    parser.add_argument("--sizes", type=int, nargs="+", default=[384, 1536, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default=None, help="git revision to compare belady with")
    parser.add_argument("--baseline-sizes", type=int, nargs="+", default=None,
                        help="cache sizes for the baseline (default: --sizes)")
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

        rows = []
        for calls in args.calls:
            for size in args.sizes:
                runs = [run_child(trace_path, calls, size) for _ in range(args.repeats)]
                row = {"calls": calls, "size": size,
                       **{key: median_of(runs, key) for key in runs[0]}}
                rows.append(row)
                print(json.dumps(row), flush=True)

        baseline = []
        if args.baseline:
            source = subprocess.run(["git", "show", f"{args.baseline}:pallas_cache/sizing/bounds.py"],
                                    cwd=ROOT, capture_output=True, text=True, check=True).stdout
            with open(os.path.join(scratch, "baseline_bounds.py"), "w") as handle:
                handle.write(source)
            for size in args.baseline_sizes or args.sizes:
                runs = [run_child(trace_path, max(args.calls), size, scratch)
                        for _ in range(args.repeats)]
                row = {"size": size, **{key: median_of(runs, key) for key in runs[0]}}
                baseline.append(row)
                print("baseline", json.dumps(row), flush=True)
    load_after = os.getloadavg()

    lines = [
        "## Offline bounds at scale (`benchmarks/bounds_cost.py`)",
        "",
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; load average {load_before[0]:.1f} before and "
        f"{load_after[0]:.1f} after: other jobs shared the cores, so the CPU seconds of the "
        f"process (not wall time) are reported, still inflated by the contention -- compare "
        f"ratios within this run. `fine-grained` preset (48 x 128, top-8, seed 0), first "
        f"`calls` layer-calls; medians of {args.repeats} fresh processes. Peak RSS added = the "
        f"process's peak RSS minus its resident memory once the trace is loaded (Python, NumPy, "
        f"JAX imported), for both bounds together (they share the access arrays).",
        "",
        "| calls | S | belady CPU s | bypass CPU s | peak RSS added MB | trace loaded MB "
        "| belady hit | bypass hit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['calls']:,} | {row['size']} | {row['belady_s']:.1f} | "
                     f"{row['bypass_optimum_s']:.1f} | {row['added_mb']:.0f} | "
                     f"{row['base_mb']:.0f} | {row['belady_hit_rate']:.4f} | "
                     f"{row['bypass_optimum_hit_rate']:.4f} |")
    if baseline:
        lines += ["", f"Belady of revision `{args.baseline}` (the previous implementation) at "
                      f"{max(args.calls):,} calls, same run:", "",
                  "| S | belady CPU s | peak RSS added MB | same hit rate |", "|---|---|---|---|"]
        new = {row["size"]: row for row in rows if row["calls"] == max(args.calls)}
        for row in baseline:
            same = row["belady_hit_rate"] == new[row["size"]]["belady_hit_rate"]
            lines.append(f"| {row['size']} | {row['belady_s']:.1f} | {row['added_mb']:.0f} | "
                         f"{'yes' if same else 'NO'} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("bounds_cost", text)


if __name__ == "__main__":
    main()
