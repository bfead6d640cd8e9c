"""Peak memory of loading a JSONL trace and replaying it, at 0.5M / 1M / 2M top-8 layer-calls.

For each size, a seeded ``fine-grained`` synthetic trace (L=48, E=128, top-8) is written as JSONL
(one record per call, the realistic worst case for a loader), then a fresh subprocess imports
JAX, loads the file with ``load_trace`` and replays it through one configuration (S=1024,
fraction:0.4, bounds off: Belady is measured separately by its own benchmark). The subprocess
reports its peak resident set size after the imports, after the load and after the
replay (``VmHWM``, the high-water mark of this process's own memory; ``ru_maxrss`` would also
count the parent's pages it was forked from), so each figure is what one ``pallas-cache replay``
without bounds would need.
``--baseline DIR`` also measures the load alone (imports and load, no replay) with the
``pallas_cache`` of another checkout (e.g. an export of main), for a before/after.

    python benchmarks/load_memory.py [--calls 500000 1000000 2000000] [--baseline DIR] [--write]

``--write`` replaces the load_memory section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_file import write_section  # noqa: E402

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
path, replay_too = sys.argv[2], sys.argv[3] == "1"
def peak_mb():  # VmHWM: ru_maxrss survives exec, so it would count the parent's pages
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
if replay_too:
    import jax  # noqa: F401
    from pallas_cache.sizing.sweep import ReplayConfig, replay
from pallas_cache.sizing.traces import load_trace
out = {"imports_mb": peak_mb()}
start = time.perf_counter()
trace = load_trace(path)
out.update(load_s=time.perf_counter() - start, load_mb=peak_mb(), calls=trace.num_calls)
if replay_too:
    start = time.perf_counter()
    replay(trace, [ReplayConfig(1024, "fraction:0.4")], bounds=False, progress=lambda s: None)
    out.update(replay_s=time.perf_counter() - start, replay_mb=peak_mb())
print(json.dumps(out))
"""


def write_jsonl(calls: int, folder: str) -> str:
    from pallas_cache.sizing.synthetic import PRESETS, synthetic_trace

    layers = PRESETS["fine-grained"].num_layers
    trace = synthetic_trace("fine-grained", num_tokens=-(-calls // layers), seed=0)
    path = os.path.join(folder, f"trace_{calls}.jsonl")
    with open(path, "w", encoding="ascii") as handle:
        for token, layer, routes in zip(trace.token_idx[:calls].tolist(),
                                        trace.layers[:calls].tolist(),
                                        trace.routes[:calls].tolist()):
            handle.write(f'{{"layer":{layer},"token_idx":{token},"experts":{routes}}}\n'
                         .replace(" ", ""))
    return path


def measure(repo: str, path: str, replay_too: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, repo, path, "1" if replay_too else "0"],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[500_000, 1_000_000, 2_000_000])
    parser.add_argument("--baseline", metavar="DIR", help="another checkout: its loader, load only")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for calls in args.calls:
            path = write_jsonl(calls, folder)
            size_mb = os.path.getsize(path) / 2**20
            now = measure(REPO, path, replay_too=True)
            before = measure(args.baseline, path, replay_too=False) if args.baseline else None
            rows.append((calls, size_mb, now, before))
            print(calls, f"{size_mb:.0f} MB", now, before, flush=True)
            os.remove(path)

    load_avg = os.getloadavg()[0]
    lines = [
        "## Load + replay peak memory (`benchmarks/load_memory.py`)",
        "",
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores (1-minute load "
        f"average {load_avg:.1f}), Python {platform.python_version()}; fine-grained synthetic "
        f"trace (L=48, E=128, top-8) written as JSONL, loaded with `load_trace` and replayed "
        f"through one configuration (S=1024, fraction:0.4, bounds off -- Belady is measured by "
        f"its own benchmark) in a fresh subprocess; peak RSS (`VmHWM`), cumulative.",
        "",
        "| calls | JSONL | peak after imports (jax) | peak after load | peak after replay | load s "
        "| replay s |" + (" main's loader: peak after load | main load s |"
                           if args.baseline else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|" if args.baseline else ""),
    ]
    for calls, size_mb, now, before in rows:
        line = (f"| {calls:,} | {size_mb:.0f} MB | {now['imports_mb']:.0f} MB | "
                f"{now['load_mb']:.0f} MB | {now['replay_mb']:.0f} MB | {now['load_s']:.1f} | "
                f"{now['replay_s']:.1f} |")
        if before:
            line += f" {before['load_mb']:.0f} MB | {before['load_s']:.1f} |"
        lines.append(line)
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("load_memory", text)


if __name__ == "__main__":
    main()
