"""``pallas-cache bench-decode`` (:mod:`pallas_cache.sizing.decode`, the one decode loop), its
table published as a section of benchmarks/RESULTS.md: measured ms per token per row beside the
replay's timed model with parameters measured in the same run, counts checked equal to the
replay's.

  python benchmarks/hybrid_decode.py --small            # this CPU host (minutes)
  python benchmarks/hybrid_decode.py --at-size          # Mixtral-8x7B bf16, 16 layers, a GPU

On a lent GPU (the tree copied there; the file comes back under $OUT, then here
``python -c "from benchmarks.results_file import write_section; ..."`` or paste it):

  PYTHONUNBUFFERED=1 timeout 420 python benchmarks/hybrid_decode.py --at-size --no-write \
      --out $OUT/hybrid_decode_at_size.md

Every other flag is bench-decode's (``pallas-cache bench-decode --help``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pallas_cache.sizing.cli.decode import (build_decode_request, format_run,  # noqa: E402
                                            plan_and_run)
from pallas_cache.sizing.cli.parser import UsageError, build_parser  # noqa: E402
from pallas_cache.sizing.decode import slope_rate  # noqa: E402,F401 (test_benchmark_rounds)
from timing import publish, run_header  # noqa: E402

#: The at-size run of issue #64: Mixtral-8x7B bf16 experts, 16 layers, 2 and 3 slots per layer,
#: LRU and route_knn with every miss copied, the recommended split with LRU, no cache and the
#: resident floor; 8 tokens, 2 repeats, short slopes: meant to fit 6 minutes of an H100's time.
AT_SIZE = ["--model", "mixtral-8x7b", "--layers", "16", "--cache-size", "32", "48",
           "--tokens", "8", "--repeats", "2", "--rounds", "3", "--time-limit", "20"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--at-size", action="store_true",
                        help="the prepared Mixtral-8x7B bf16 run (" + " ".join(AT_SIZE) + ")")
    parser.add_argument("--no-write", action="store_true", help="print, do not edit RESULTS.md")
    parser.add_argument("--out", metavar="FILE.md", default=None,
                        help="also write the section's text to this file (a device run's $OUT)")
    args, rest = parser.parse_known_args(argv)
    flags = (AT_SIZE if args.at_size else []) + rest
    wall = time.perf_counter()
    try:
        decode_args = build_parser().parse_args(["bench-decode", *flags])
        plan, run = plan_and_run(build_decode_request(decode_args))
    except UsageError as error:
        raise SystemExit(str(error)) from None
    elapsed = time.perf_counter() - wall
    command = "python benchmarks/hybrid_decode.py " + " ".join(
        (["--at-size"] if args.at_size else []) + rest)
    name = "hybrid_decode_at_size" if args.at_size else (
        "hybrid_decode_small" if "--small" in rest else "hybrid_decode")
    text = "\n".join([
        f"## Offloaded decode, measured beside the model (`{command.strip()}`)", "",
        run_header(command.strip(), note=f", {elapsed:.0f} s"), "",
        format_run(run, plan.lines, markdown=True)])
    publish(name, text, not args.no_write)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
