"""Layer-calls per second of the compiled replay (one configuration, 64 vmapped) against the
NumPy reference loop, on both synthetic presets; compile time excluded."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from pallas_cache.sizing.sweep import ReplayConfig, replay  # noqa: E402
from pallas_cache.sizing.synthetic import synthetic_trace  # noqa: E402
from pallas_cache.reference import ReferenceCache, ReferencePolicy  # noqa: E402
from timing import markdown_table, median_seconds, publish, run_header, section  # noqa: E402

PRESET_CACHE = {"mixtral-like": 64, "fine-grained": 1024}


def reference_rate(trace, cache_size, max_calls, repeats):
    layers, routes = trace.to_array()
    layers, routes = layers[:max_calls], routes[:max_calls]
    policy = ReferencePolicy.fraction(0.4)

    def run():
        cache = ReferenceCache(trace.num_layers, trace.num_experts, cache_size)
        for layer, route in zip(layers, routes):
            cache.ensure_hybrid(int(layer), route, policy)

    return len(layers) / median_seconds(run, repeats, warmup=0)


def replay_rate(trace, configs, repeats):
    quiet = lambda status: None  # noqa: E731
    seconds = median_seconds(lambda: replay(trace, configs, bounds=False, progress=quiet), repeats)
    return trace.num_calls / seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
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

    table = markdown_table(
        ["preset", "S", "calls", "reference calls/s", "compiled calls/s (1 config)",
         "config-calls/s (64 vmapped)", "compiled / reference", "64 vmapped / 64 sequential"],
        [[preset, size, calls, f"{ref:,.0f}", f"{single:,.0f}", f"{batched:,.0f}", f"{r1:.1f}x",
          f"{r2:.1f}x"] for preset, size, calls, ref, single, batched, r1, r2 in rows])
    command = (f"python benchmarks/replay_throughput.py --tokens {args.tokens} --repeats "
               f"{args.repeats} --write")
    text = section("Replay throughput (`benchmarks/replay_throughput.py`)", run_header(command),
                   f"{args.tokens} tokens per preset, policy fraction:0.4 (64 configurations: "
                   f"fractions 0..63/64), median of {args.repeats}; compile time excluded.", table)
    publish("replay_throughput", text, args.write)


if __name__ == "__main__":
    main()
