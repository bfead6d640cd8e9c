"""The realistic synthetic preset's statistics next to measured Mixtral-8x7B decode statistics.

For ``mixtral-realistic`` (and, for comparison, the token-free ``mixtral-like``), averaged over
``--seeds`` seeds of ``--tokens`` tokens each:

* lag-``k`` repeat probability (:func:`~pallas_cache.sizing.synthetic.lag_repeat_probability`;
  chance is 0.25 on 2-of-8) and neighbour precision
  (:func:`~pallas_cache.sizing.synthetic.neighbour_precision`, window 128);
* next-token neighbour precision
  (:func:`~pallas_cache.sizing.synthetic.next_token_precision`, window 128; not measured on the
  real traces: the degree of freedom ``benchmarks/preset_sensitivity.py`` varies);
* hit rates at S = 64 / 128 / 192 slots (2 / 4 / 6 per layer) of global LRU (the library's own
  cache replayed with policy ``full``: every miss fetched, LRU victims), per-layer LRU
  (``benchmarks/baselines.py``: each layer owns S / L slots) and Belady's optimum
  (:func:`pallas_cache.sizing.bounds.belady`).

The "real" column holds the measured Mixtral-8x7B numbers the preset is calibrated against
(issue 15). ``fine-grained-realistic`` has no measured counterpart; its statistics are printed
at 8 / 16 / 32 slots per layer (top-8 needs at least 8) for reference.

    python benchmarks/realistic_preset.py [--tokens 4000] [--seeds 3] [--write]
    python benchmarks/realistic_preset.py --trace routes.jsonl [--slots-per-layer 2 4 6]

``--write`` replaces this benchmark's section of benchmarks/RESULTS.md. ``--trace`` measures a
recorded decode trace instead (any format ``load_trace`` reads; one dense sequence: every token
calls every layer in order), next to the real Mixtral-8x7B column, and adds ROUTE_KNN's and
ROUTE_LFU's hit rates and share of the LRU -> Belady gap: on a real trace this settles what
the synthetic presets cannot (RESULTS.md, ``preset_sensitivity``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from baselines import per_layer_lru_hit_rate  # noqa: E402
from pallas_cache.sizing.bounds import belady  # noqa: E402
from pallas_cache.sizing.sweep import ReplayConfig, replay  # noqa: E402
from pallas_cache.sizing.synthetic import (  # noqa: E402
    lag_repeat_probability, neighbour_precision, next_token_precision, synthetic_trace,
    trace_statistics)
from pallas_cache.sizing.traces import load_trace  # noqa: E402
from results_file import write_section  # noqa: E402

#: Measured on real Mixtral-8x7B decode traces (issue 15); None = not measured.
REAL = {
    "lag 1": 0.40, "lag 2": None, "lag 3": None, "lag 4": None, "lag 6": None, "lag 8": None,
    "lowest of lags 2-8": 0.20,
    "neighbour precision": 0.60, "next-token precision": None, "normalised entropy": 0.97,
    "global LRU": (0.40, 0.57, 0.80),
    "per-layer LRU": (0.40, 0.62, 0.82),
    "Belady": (0.61, 0.82, 0.93),
}


def measure(trace, slots_per_layer):
    """Every statistic of the table for one trace."""
    sizes = [trace.num_layers * s for s in slots_per_layer]
    lags = lag_repeat_probability(trace, 8)
    quiet = lambda status: None  # noqa: E731
    lru = replay(trace, [ReplayConfig(size, "full") for size in sizes], bounds=False,
                 progress=quiet)
    return {
        "lag 1": lags[0], "lag 2": lags[1], "lag 3": lags[2], "lag 4": lags[3], "lag 6": lags[5],
        "lag 8": lags[7], "lowest of lags 2-8": float(lags[1:8].min()),
        "neighbour precision": neighbour_precision(trace, 128),
        "next-token precision": next_token_precision(trace, 128),
        "normalised entropy": trace_statistics(trace).mean_norm_entropy,
        "global LRU": tuple(r.hit_rate for r in lru),
        "per-layer LRU": tuple(per_layer_lru_hit_rate(trace, size) for size in sizes),
        "Belady": tuple(belady(trace, size).hit_rate for size in sizes),
    }


#: The token-similarity evictions whose share of the LRU -> Belady gap is reported.
POLICIES = ("route_knn", "route_lfu")


def policy_hit_rates(trace, sizes):
    """{policy: (hit rate at each size)} for ROUTE_KNN and ROUTE_LFU, from the library's replay."""
    configs = [ReplayConfig(size, "full", eviction=policy) for policy in POLICIES
               for size in sizes]
    results = replay(trace, configs, bounds=False, progress=lambda status: None)
    rates = [1.0 - r.missing / r.active for r in results]
    return {policy: tuple(rates[i * len(sizes):(i + 1) * len(sizes)])
            for i, policy in enumerate(POLICIES)}

def averaged(preset, tokens, seeds, slots_per_layer):
    runs = [measure(synthetic_trace(preset, num_tokens=tokens, seed=seed), slots_per_layer)
            for seed in range(seeds)]
    mean, spread = {}, {}
    for key in runs[0]:
        values = np.array([run[key] for run in runs], dtype=np.float64)
        mean[key] = values.mean(axis=0)
        spread[key] = np.ptp(values, axis=0)
    return mean, spread


def fmt(value, spread=None):
    if value is None:
        return "-"
    values = np.atleast_1d(value)
    if spread is None:
        return " / ".join(f"{v:.2f}" for v in values)
    spreads = np.atleast_1d(spread)
    return " / ".join(f"{v:.3f}" + (f" ±{s / 2:.3f}" if s > 0.0005 else "")
                      for v, s in zip(values, spreads))


def measure_trace(path, slots_per_layer):
    """Print the statistics of one recorded trace, and what ROUTE_KNN / ROUTE_LFU do on it."""
    trace = load_trace(path)
    sizes = [trace.num_layers * s for s in slots_per_layer]
    stats = measure(trace, slots_per_layer)
    stats.update(policy_hit_rates(trace, sizes))
    lru, bel = np.array(stats["global LRU"]), np.array(stats["Belady"])
    gap = np.where(bel > lru, bel - lru, np.nan)
    label = " / ".join(str(size) for size in sizes)
    lines = [f"`{path}`: {trace.num_layers} layers x {trace.num_experts} experts, top-"
             f"{trace.top_k}, {trace.num_tokens} tokens; S = {label}.", "",
             f"| statistic (S = {label} where three) | this trace | real Mixtral-8x7B |",
             "|---|---|---|"]
    for key, real in REAL.items():
        lines.append(f"| {key} | {fmt(stats[key], np.zeros_like(np.atleast_1d(stats[key])))} | "
                     f"{fmt(real)} |")
    for policy in POLICIES:
        share = (np.array(stats[policy]) - lru) / gap
        lines.append(f"| {policy} | {fmt(stats[policy], np.zeros(3))} | - |")
        lines.append(f"| {policy}: share of the LRU -> Belady gap | "
                     f"{' / '.join(f'{s:+.2f}' for s in share)} | - |")
    print("\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--fine-tokens", type=int, default=1000)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--trace", help="measure this recorded trace instead of the presets")
    parser.add_argument("--slots-per-layer", type=int, nargs=3, default=(2, 4, 6),
                        help="the three pool sizes of --trace, in slots per layer (default 2 4 6)")
    args = parser.parse_args(argv)
    if args.trace:
        measure_trace(args.trace, tuple(args.slots_per_layer))
        return

    start = time.perf_counter()
    realistic, realistic_spread = averaged("mixtral-realistic", args.tokens, args.seeds, (2, 4, 6))
    like, like_spread = averaged("mixtral-like", args.tokens, args.seeds, (2, 4, 6))
    lines = ["| statistic (S = 64 / 128 / 192 where three) | real Mixtral-8x7B | "
             "mixtral-realistic | mixtral-like |", "|---|---|---|---|"]
    for key, real in REAL.items():
        lines.append(f"| {key} | {fmt(real)} | {fmt(realistic[key], realistic_spread[key])} | "
                     f"{fmt(like[key], like_spread[key])} |")
    table = "\n".join(lines)

    def worst(measured, keys):
        return max(float(np.abs(np.atleast_1d(measured[key]) - np.atleast_1d(REAL[key])).max())
                   for key in keys)

    hit_keys = ("global LRU", "per-layer LRU", "Belady")
    known = [key for key, real in REAL.items() if real is not None]
    count = sum(np.atleast_1d(REAL[key]).size for key in known)
    closeness = (f"Largest |preset - real| over the 9 hit rates / over all {count} measured "
                 f"numbers: mixtral-realistic {worst(realistic, hit_keys):.3f} / "
                 f"{worst(realistic, known):.3f}; mixtral-like {worst(like, hit_keys):.3f} / "
                 f"{worst(like, known):.3f}.")

    fine, fine_spread = averaged("fine-grained-realistic", args.fine_tokens, 1, (8, 16, 32))
    fine_lines = ["| statistic (S = 384 / 768 / 1536 where three) | fine-grained-realistic |",
                  "|---|---|"]
    for key in REAL:
        fine_lines.append(f"| {key} | {fmt(fine[key], fine_spread[key])} |")
    fine_table = "\n".join(fine_lines)
    elapsed = time.perf_counter() - start
    print(table, closeness, fine_table, f"({elapsed:.0f} s)", sep="\n\n")

    if args.write:
        machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"{platform.system()} {platform.machine()}; numpy {np.__version__}, "
                   f"jax {jax.__version__} on {jax.default_backend()}")
        section = (
            f"## Realistic synthetic preset vs real Mixtral-8x7B (`benchmarks/realistic_preset.py`)"
            f"\n\n`python benchmarks/realistic_preset.py --tokens {args.tokens} --seeds "
            f"{args.seeds}` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
            f"UTC. Machine: {machine}.\n\n"
            f"Mean over seeds 0..{args.seeds - 1} of {args.tokens} tokens each (± half the range "
            f"over seeds). Lag-k repeat: share of a call's experts the same layer routed k "
            f"tokens earlier (chance 0.25). Neighbour precision: the past token (window 128) "
            f"with the most matching routes over layers < l predicts layer l "
            f"(`neighbour_precision`). Global LRU = the library's cache replayed with policy "
            f"`full`; per-layer LRU = `benchmarks/baselines.py` (S / L slots per layer); "
            f"Belady = `pallas_cache.sizing.bounds.belady`.\n\n{table}\n\n{closeness}\n\n"
            f"`fine-grained-realistic` (48 x 128, top-8; no measured counterpart), seed 0, "
            f"{args.fine_tokens} tokens, at 8 / 16 / 32 slots per layer:\n\n{fine_table}\n")
        write_section("realistic_preset", section)


if __name__ == "__main__":
    main()
