"""Replay throughput: layer-calls per second of the compiled replay against the reference loop.

For both synthetic presets, in one run:
  (a) a Python loop over the NumPy reference (``ReferenceCache.ensure_hybrid``),
  (b) one compiled replay of one configuration (``pallas_cache.sizing.sweep``),
  (c) one compiled replay of 64 configurations (one vmapped program),
and the ratios (b)/(a) and (c)/(64 x (b)) -- the second compares the vmapped program against 64
single-configuration replays run one after another. Compile time is excluded (a warm-up replay
runs first); each figure is the median of ``--repeats`` runs.

    python benchmarks/replay_throughput.py [--tokens 128] [--repeats 3] [--write]

``--write`` replaces the replay section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from pallas_cache.sizing.sweep import ReplayConfig, replay  # noqa: E402
from pallas_cache.sizing.synthetic import synthetic_trace  # noqa: E402
from reference import ReferenceCache, ReferencePolicy  # noqa: E402
from results_file import write_section  # noqa: E402

PRESET_CACHE = {"mixtral-like": 64, "fine-grained": 1024}


def median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def reference_rate(trace, cache_size, max_calls, repeats):
    layers, routes = trace.to_array()
    layers, routes = layers[:max_calls], routes[:max_calls]
    policy = ReferencePolicy.fraction(0.4)

    def run():
        cache = ReferenceCache(trace.num_layers, trace.num_experts, cache_size)
        for layer, route in zip(layers, routes):
            cache.ensure_hybrid(int(layer), route, policy)

    return len(layers) / median_seconds(run, repeats)


def replay_rate(trace, configs, repeats):
    quiet = lambda status: None  # noqa: E731
    replay(trace, configs, bounds=False, progress=quiet)  # compile
    seconds = median_seconds(lambda: replay(trace, configs, bounds=False, progress=quiet), repeats)
    return trace.num_calls / seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reference-calls", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)

    rows = []
    for preset, size in PRESET_CACHE.items():
        trace = synthetic_trace(preset, num_tokens=args.tokens)
        one = [ReplayConfig(size, "fraction:0.4")]
        many = [ReplayConfig(size, f"fraction:{q / 64:.6f}") for q in range(64)]
        ref = reference_rate(trace, size, args.reference_calls, args.repeats)
        single = replay_rate(trace, one, args.repeats)
        batched = replay_rate(trace, many, args.repeats)
        rows.append((preset, size, trace.num_calls, ref, single, batched * 64,
                     single / ref, batched * 64 / single))
        print(rows[-1], flush=True)

    header = ("| preset | S | calls | reference calls/s | compiled calls/s (1 config) | "
              "config-calls/s (64 vmapped) | compiled / reference | 64 vmapped / 64 sequential |")
    lines = [header, "|" + "---|" * 8]
    for preset, size, calls, ref, single, batched, r1, r2 in rows:
        lines.append(f"| {preset} | {size} | {calls} | {ref:,.0f} | {single:,.0f} | {batched:,.0f} "
                     f"| {r1:.1f}x | {r2:.1f}x |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        machine = f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, " \
                  f"{jax.default_backend()}"
        section = (f"## Replay throughput (`benchmarks/replay_throughput.py`)\n\n"
                   f"{datetime.date.today()}, {machine}; {args.tokens} tokens per preset, "
                   f"policy fraction:0.4 (64 configurations: fractions 0..63/64), median of "
                   f"{args.repeats}; compile time excluded.\n\n{table}\n")
        write_section("replay_throughput", section)


if __name__ == "__main__":
    main()
