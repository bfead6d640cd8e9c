"""Peak resident memory (``VmHWM``) of a minimal ``pallas-cache replay`` (a 60-record trace, 2
layers x 4 experts, top-2, ``-q``), each run in a fresh process on the CPU backend: the fixed
cost ``RUN_FIXED_BYTES`` rounds up, which ``--max-memory`` sets aside for the process itself."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import markdown_table, publish, python_child, run_header, section  # noqa: E402

CHILD = r"""
import contextlib, io, json, sys
sys.path.insert(0, sys.argv[1])
from pallas_cache.sizing import cli
with contextlib.redirect_stdout(io.StringIO()):
    code = cli.main(["replay", "--trace", sys.argv[2], "-q"])
with open("/proc/self/status", encoding="ascii") as status:
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
print(json.dumps({"code": code, "peak_mib": peak / 1024}))
"""


def tiny_trace(path: str) -> None:
    with open(path, "w", encoding="ascii") as handle:
        for token in range(30):
            for layer in range(2):
                first, second = (token + layer) % 4, (3 * token + layer + 1) % 4
                experts = [first] if first == second else [first, second]
                handle.write(json.dumps({"layer": layer, "token_idx": token,
                                         "experts": experts}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    from pallas_cache.sizing.traces import RUN_FIXED_BYTES

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "tiny.jsonl")
        tiny_trace(path)
        peaks = []
        for _ in range(args.runs):
            out = python_child(CHILD, REPO, path)
            assert out["code"] == 0, out
            peaks.append(out["peak_mib"])
            print(f"{out['peak_mib']:.0f} MiB", flush=True)
    table = markdown_table(["runs", "peaks (MiB)", "median", "range", "RUN_FIXED_BYTES"],
                           [[len(peaks), ", ".join(f"{p:.0f}" for p in peaks),
                             f"{statistics.median(peaks):.0f} MiB",
                             f"{min(peaks):.0f} to {max(peaks):.0f} MiB",
                             f"{RUN_FIXED_BYTES / 2**20:.0f} MiB"]])
    text = section("A minimal replay's peak memory (`benchmarks/fixed_memory.py`)",
                   run_header(f"python benchmarks/fixed_memory.py --runs {args.runs} --write"),
                   "`pallas-cache replay --trace tiny.jsonl -q` (60 records, 2 layers x 4 "
                   "experts, top-2) in a fresh process each, CPU backend; peak resident memory "
                   "(`VmHWM`). `--max-memory` sets `RUN_FIXED_BYTES` aside for the process "
                   "itself and refuses a limit below it.", table)
    publish("fixed_memory", text, args.write)


if __name__ == "__main__":
    main()
