"""Load time of JSONL whose content is blank (gzips of N MiB of newlines) and of a records file,
each read by ``load_trace`` in a fresh subprocess; ``--baseline DIR`` times another checkout."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import markdown_table, publish, python_child, run_header, section  # noqa: E402

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from pallas_cache.sizing import TraceError, load_trace
start = time.perf_counter()
try:
    calls = load_trace(sys.argv[2]).num_calls
except TraceError as error:
    calls = str(error).rsplit(": ", 1)[-1]
print(json.dumps({"seconds": time.perf_counter() - start, "result": calls}))
"""


def blank_gzip(path: str, mib: int) -> int:
    """Write a gzip of ``mib`` MiB of newlines; returns its size in bytes."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"\n" * (1 << 20)
    with open(path, "wb") as handle:
        for _ in range(mib):
            handle.write(compressor.compress(block))
        handle.write(compressor.flush())
    return os.path.getsize(path)


def load_seconds(root: str, path: str, repeats: int) -> tuple[float, str]:
    runs = [python_child(CHILD, root, path) for _ in range(repeats)]
    return statistics.median(r["seconds"] for r in runs), str(runs[0]["result"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, nargs="+", default=[100, 1024])
    parser.add_argument("--records", type=int, default=200_000, help="calls of the records file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", metavar="DIR", help="another checkout to time as well")
    parser.add_argument("--baseline-mib", type=int, nargs="+", default=[100])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()

    from pallas_cache.sizing import synthetic_trace
    from pallas_cache.sizing.traces import save_trace

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        inputs = []
        for mib in sorted(set(args.mib) | set(args.baseline_mib if args.baseline else [])):
            path = os.path.join(folder, f"blank-{mib}.jsonl.gz")
            inputs.append((f"{mib} MiB of blank lines, gzipped ({blank_gzip(path, mib) / 1e6:.2f}"
                           f" MB)", path, mib))
        trace = synthetic_trace("fine-grained", num_tokens=args.records // 48)
        records = os.path.join(folder, "records.jsonl")
        save_trace(trace, records)
        inputs.append((f"{trace.num_calls:,} synthetic fine-grained records, JSONL "
                       f"({os.path.getsize(records) / 1e6:.0f} MB)", records, None))
        for label, path, mib in inputs:
            row = [label]
            if mib is None or mib in args.mib:
                seconds, result = load_seconds(REPO, path, args.repeats)
                row += [f"{seconds:.2f}", result]
            else:
                row += ["-", "-"]
            if args.baseline:
                if mib is None or mib in args.baseline_mib:
                    seconds, _ = load_seconds(args.baseline, path, 1)
                    row.append(f"{seconds:.2f}")
                else:
                    row.append("-")
            rows.append(row)
            print(" | ".join(row), flush=True)

    header = ["input", f"load s (median of {args.repeats})", "result"]
    if args.baseline:
        header.append("baseline load s (1 run)")
    command = ("python benchmarks/blank_lines.py --mib " + " ".join(map(str, args.mib))
               + f" --records {args.records} --repeats {args.repeats}"
               + (" --baseline DIR --baseline-mib " + " ".join(map(str, args.baseline_mib))
                  if args.baseline else "") + " --write")
    text = section("Blank JSONL content (`benchmarks/blank_lines.py`)", run_header(command),
                   "`load_trace` in a fresh subprocess, load time only."
                   + (" The baseline is the checkout given as DIR." if args.baseline else ""),
                   markdown_table(header, rows))
    publish("blank_lines", text, args.write)


if __name__ == "__main__":
    main()
