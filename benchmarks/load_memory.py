"""Peak resident memory (``VmHWM``) and time of loading a top-8 JSONL trace with ``load_trace`` and
replaying it through one configuration, in a fresh subprocess, at 0.5M / 1M / 2M layer-calls;
``--baseline DIR`` measures another checkout's loader beside it."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import markdown_table, publish, python_child, run_header, section  # noqa: E402

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
    from pallas_cache.sizing import ReplayConfig, replay
from pallas_cache.sizing import load_trace
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
    from pallas_cache.sizing import PRESETS, synthetic_trace

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
    return python_child(CHILD, repo, path, "1" if replay_too else "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
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

    header = ["calls", "JSONL", "peak after imports (jax)", "peak after load",
              "peak after replay", "load s", "replay s"]
    if args.baseline:
        header += ["baseline loader: peak after load", "baseline load s"]
    table = []
    for calls, size_mb, now, before in rows:
        table.append([f"{calls:,}", f"{size_mb:.0f} MB", f"{now['imports_mb']:.0f} MB",
                      f"{now['load_mb']:.0f} MB", f"{now['replay_mb']:.0f} MB",
                      f"{now['load_s']:.1f}", f"{now['replay_s']:.1f}"])
        if before:
            table[-1] += [f"{before['load_mb']:.0f} MB", f"{before['load_s']:.1f}"]
    command = ("python benchmarks/load_memory.py --calls " + " ".join(map(str, args.calls))
               + (" --baseline DIR" if args.baseline else "") + " --write")
    text = section("Load + replay peak memory (`benchmarks/load_memory.py`)", run_header(command),
                   "Fine-grained synthetic trace (L=48, E=128, top-8) written as JSONL, loaded "
                   "with `load_trace` and replayed through one configuration (S=1024, "
                   "fraction:0.4, bounds off) in a fresh subprocess; peak RSS (`VmHWM`), "
                   "cumulative.",
                   markdown_table(header, table))
    publish("load_memory", text, args.write)


if __name__ == "__main__":
    main()
