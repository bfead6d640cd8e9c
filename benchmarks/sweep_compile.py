"""Cold sweep time: one compiled program per bucket of sizes against one program per size.

The usable pool size is data (docs/semantics.md §5.15), so ``replay`` runs a bucket of sizes as
one program at the bucket's capacity. ``bucket_ratio=1`` restores one program per size (the
structure before), so both run in one process on the same trace: wall time from a cold program
cache (compiling included, as a first ``pallas-cache replay`` pays it), the number of
compilations (``jax.log_compiles``) and the lanes replayed. Two sweeps of the mixtral-like preset:
the issue's CLI example (sizes 64 128, policies full fraction:0.4, bounds included) and a wide
grid (the auto sizes x 2 policies x 2 orders x 3 admissions, bounds off). Medians of
``--repeats`` interleaved runs.

    python benchmarks/sweep_compile.py [--tokens 512] [--repeats 2] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from pallas_cache.sizing.sweep import auto_cache_sizes, config_grid, replay  # noqa: E402
from pallas_cache.sizing.sweep_program import clear_compiled, lane_key  # noqa: E402
from pallas_cache.sizing.sweep_records import DEFAULT_BUCKET_RATIO  # noqa: E402
from pallas_cache.sizing.synthetic import synthetic_trace  # noqa: E402
from results_file import write_section  # noqa: E402


class _Count(logging.Handler):
    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        self.count += "Compiling jit(_replay_chunk)" in record.getMessage()


def cold_run(trace, configs, bounds, ratio):
    """Seconds of one replay from a cold program cache, and its compilations."""
    clear_compiled()
    counter = _Count()
    logger = logging.getLogger("jax")
    logger.addHandler(counter)
    try:
        with jax.log_compiles(True):
            start = time.perf_counter()
            replay(trace, configs, bounds=bounds, progress=lambda s: None, bucket_ratio=ratio)
            seconds = time.perf_counter() - start
    finally:
        logger.removeHandler(counter)
    return seconds, counter.count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("jax").propagate = False

    trace = synthetic_trace("mixtral-like", args.tokens)
    sizes = auto_cache_sizes(trace.num_layers, trace.num_experts, trace.top_k)
    sweeps = [
        ("sizes 64 128, full fraction:0.4, bounds", config_grid([64, 128], ["full", "fraction:0.4"]),
         True),
        (f"auto sizes {' '.join(map(str, sizes))}, full fraction:0.4, 2 orders x 3 admissions",
         config_grid(sizes, ["full", "fraction:0.4"], ["recency", "lowest_id"],
                     ["promote_one", "none", "reuse"]), False),
    ]
    rows = []
    for name, configs, bounds in sweeps:
        lanes = len({lane_key(c) for c in configs})
        times = {1.0: [], DEFAULT_BUCKET_RATIO: []}
        compiles = {}
        for _ in range(args.repeats):
            for ratio in times:
                seconds, compiles[ratio] = cold_run(trace, configs, bounds, ratio)
                times[ratio].append(seconds)
        per_size, bucketed = (statistics.median(times[r]) for r in times)
        rows.append(f"| {name} | {len(configs)} | {lanes} | {compiles[1.0]} | {per_size:.1f} s | "
                    f"{compiles[DEFAULT_BUCKET_RATIO]} | {bucketed:.1f} s | "
                    f"{per_size / bucketed:.2f}x |")
        print(rows[-1], flush=True)

    load = os.getloadavg()[0]
    header = (
        f"`python benchmarks/sweep_compile.py --tokens {args.tokens} --repeats {args.repeats}` on "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M} (1-minute load average {load:.1f}). Machine: "
        f"{platform.machine()}, {os.cpu_count()} cores; JAX {jax.__version__} on "
        f"{jax.default_backend()}.\n\n"
        f"mixtral-like preset, {trace.num_calls} calls. Wall time of one `replay` from a cold "
        "program cache (compiling included), median of the repeats. *Per size*: "
        "`bucket_ratio=1`, one program per cache size (the structure before the usable size "
        "became data); *bucketed*: the default, one program per bucket of sizes within 4x. "
        "Configurations are lanes after merging those that cannot differ (both columns replay "
        "the merged lanes).\n\n"
        "| sweep | configs | lanes | per size: compiles | per size: time | bucketed: compiles "
        "| bucketed: time | speed-up |\n|---|---|---|---|---|---|---|---|\n")
    markdown = "## Cold sweep: one program per bucket of sizes (`benchmarks/sweep_compile.py`)\n\n"
    markdown += header + "\n".join(rows)
    print(markdown)
    if args.write:
        write_section("sweep_compile", markdown)


if __name__ == "__main__":
    main()
