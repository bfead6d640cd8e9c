"""The realistic synthetic presets' statistics (repeat profile, neighbour and next-token
precision, entropy, LRU / per-layer LRU / Belady hit rates) and policy ranking next to two real
Mixtral-8x7B traces, on held-out seeds; ``--trace PATH`` measures a recorded trace instead."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from pallas_cache.sizing.bounds import belady  # noqa: E402
from pallas_cache.sizing.sweep import ReplayConfig, replay  # noqa: E402
from pallas_cache.sizing.synthetic import synthetic_trace  # noqa: E402
from pallas_cache.sizing.trace_stats import (  # noqa: E402
    complete_sequences, lag_repeat_probability, neighbour_precision, next_token_precision,
    per_layer_lru_hit_rate, trace_statistics)
from pallas_cache.sizing.traces import load_trace  # noqa: E402
from results_file import write_section  # noqa: E402
from timing import run_header  # noqa: E402

#: Measured on two real Mixtral-8x7B decode traces (docs/policies.md): HumanEval prompts (338
#: tokens in 2 requests) and GSM8K prompts (247 tokens in 2 requests). The statistics per request
#: over complete tokens (HumanEval request 1, 252 tokens; GSM8K request 0, 166 tokens); hit rates
#: at S = 64 / 128 / 192 from ``pallas-cache replay --policy full`` over the whole trace.
REAL = {
    "lag 1": (0.409, 0.343), "lag 2": (0.339, 0.324), "lag 3": (0.291, 0.315),
    "lag 4": (0.285, 0.279), "lag 6": (0.272, 0.285), "lag 8": (0.269, 0.274),
    "neighbour precision": (0.622, 0.554), "next-token precision": (0.587, 0.488),
    "normalised entropy": (0.976, 0.969),
    "global LRU": ((0.397, 0.571, 0.802), (0.342, 0.535, 0.789)),
    "per-layer LRU": ((0.397, 0.624, 0.819), (0.342, 0.603, 0.813)),
    "Belady": ((0.615, 0.819, 0.933), (0.584, 0.809, 0.926)),
}
#: The two real traces' PAIR_LFU, ROUTE_KNN and ROUTE_LFU hit rates at S = 64 / 128 / 192 (same
#: source).
REAL_POLICIES = {
    "pair_lfu": ((0.397, 0.641, 0.842), (0.342, 0.610, 0.825)),
    "route_knn": ((0.443, 0.682, 0.859), (0.394, 0.654, 0.845)),
    "route_lfu": ((0.397, 0.662, 0.854), (0.342, 0.631, 0.844)),
}
#: The hit rates compared with the mean of the two traces; the other keys with their range.
HIT_KEYS = ("global LRU", "per-layer LRU", "Belady")
#: How far outside the two traces' range a statistic may sit, and a hit rate from their mean.
STATISTIC_SLACK, HIT_SLACK = 0.03, 0.02


def misfit(measured):
    """{key: how far ``measured`` lies outside the real range (statistics) or from the two
    traces' mean (hit rates; the largest over the three sizes)}."""
    out = {}
    for key, (a, b) in REAL.items():
        value, a, b = (np.atleast_1d(np.asarray(x, dtype=np.float64)) for x in
                       (measured[key], a, b))
        if key in HIT_KEYS:
            out[key] = float(np.abs(value - (a + b) / 2).max())
        else:
            out[key] = float(np.maximum(np.maximum(np.minimum(a, b) - value,
                                                   value - np.maximum(a, b)), 0.0).max())
    return out


def fits(measured):
    """Whether every statistic is within STATISTIC_SLACK of the real range and every hit rate
    within HIT_SLACK of the real mean."""
    return all(d <= (HIT_SLACK if key in HIT_KEYS else STATISTIC_SLACK)
               for key, d in misfit(measured).items())


def measure(trace, slots_per_layer):
    """Every statistic of the table for one trace."""
    sizes = [trace.num_layers * s for s in slots_per_layer]
    lags = lag_repeat_probability(trace, 8)
    quiet = lambda status: None  # noqa: E731
    lru = replay(trace, [ReplayConfig(size, "full") for size in sizes], bounds=False,
                 progress=quiet)
    return {
        "lag 1": lags[0], "lag 2": lags[1], "lag 3": lags[2], "lag 4": lags[3], "lag 6": lags[5],
        "lag 8": lags[7],
        "neighbour precision": neighbour_precision(trace, 128),
        "next-token precision": next_token_precision(trace, 128),
        "normalised entropy": trace_statistics(trace).mean_norm_entropy,
        "global LRU": tuple(r.hit_rate for r in lru),
        "per-layer LRU": tuple(per_layer_lru_hit_rate(trace, size) for size in sizes),
        "Belady": tuple(belady(trace, size).hit_rate for size in sizes),
    }


#: The evictions besides LRU whose share of the LRU -> Belady gap is reported.
POLICIES = ("route_knn", "route_lfu")
RANKED = ("pair_lfu", "route_knn", "route_lfu")


def policy_hit_rates(trace, sizes, policies=POLICIES):
    """{policy: (hit rate at each size)} for ``policies``, from the library's replay."""
    configs = [ReplayConfig(size, "full", eviction=policy) for policy in policies
               for size in sizes]
    results = replay(trace, configs, bounds=False, progress=lambda status: None)
    rates = [1.0 - r.missing / r.active for r in results]
    return {policy: tuple(rates[i * len(sizes):(i + 1) * len(sizes)])
            for i, policy in enumerate(policies)}


def runs_of(preset, tokens, seeds, slots_per_layer, policies=()):
    """measure() (and the policies' hit rates) per seed."""
    runs = []
    for seed in seeds:
        trace = synthetic_trace(preset, num_tokens=tokens, seed=seed)
        run = measure(trace, slots_per_layer)
        if policies:
            run.update(policy_hit_rates(trace, [trace.num_layers * s for s in slots_per_layer],
                                        policies))
        runs.append(run)
    return runs


def mean_spread(runs):
    mean, spread = {}, {}
    for key in runs[0]:
        values = np.array([run[key] for run in runs], dtype=np.float64)
        mean[key] = values.mean(axis=0)
        spread[key] = np.ptp(values, axis=0)
    return mean, spread


def share(rates, lru, bel):
    """(policy - LRU) / (Belady - LRU) per size (NaN where Belady == LRU)."""
    lru, bel = np.asarray(lru, dtype=np.float64), np.asarray(bel, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(bel > lru, (np.asarray(rates) - lru) / (bel - lru), np.nan)


def fmt(value, spread=None):
    if value is None:
        return "-"
    values = np.atleast_1d(value)
    if spread is None:
        return " / ".join(f"{v:.3f}" for v in values)
    spreads = np.atleast_1d(spread)
    return " / ".join(f"{v:.3f}" + (f" ±{s / 2:.3f}" if s > 0.0005 else "")
                      for v, s in zip(values, spreads))


def fmt_share(values):
    return " / ".join(f"{v:+.2f}" for v in np.atleast_1d(values))


def real_shares():
    """{policy: (HumanEval shares, GSM8K shares)} from the real columns."""
    out = {}
    for policy, columns in REAL_POLICIES.items():
        out[policy] = tuple(share(columns[t], REAL["global LRU"][t], REAL["Belady"][t])
                            for t in range(2))
    return out


def measure_trace(path, slots_per_layer):
    """Print the statistics of one recorded trace, and what each eviction does on it."""
    trace = load_trace(path)
    sizes = [trace.num_layers * s for s in slots_per_layer]
    stats = measure(trace, slots_per_layer)
    stats.update(policy_hit_rates(trace, sizes, RANKED))
    lru, bel = stats["global LRU"], stats["Belady"]
    complete = sum(d.shape[0] for d in complete_sequences(trace))
    label = " / ".join(str(size) for size in sizes)
    lines = [f"`{path}`: {trace.num_layers} layers x {trace.num_experts} experts, top-"
             f"{trace.top_k}, {len(trace.sequence_names)} sequence(s), {trace.num_tokens} tokens "
             f"({complete} complete: the precisions read those); S = {label}.", "",
             f"| statistic (S = {label} where three) | this trace | real HumanEval | "
             f"real GSM8K |", "|---|---|---|---|"]
    for key, (humaneval, gsm8k) in REAL.items():
        lines.append(f"| {key} | {fmt(stats[key])} | {fmt(humaneval)} | {fmt(gsm8k)} |")
    shares = real_shares()
    for policy in RANKED:
        lines.append(f"| {policy} | {fmt(stats[policy])} | "
                     + (" | ".join(fmt(c) for c in REAL_POLICIES[policy])
                        if policy in REAL_POLICIES else "- | -") + " |")
        lines.append(f"| {policy}: share of the LRU -> Belady gap | "
                     f"{fmt_share(share(stats[policy], lru, bel))} | "
                     + (" | ".join(fmt_share(c) for c in shares[policy])
                        if policy in shares else "- | -") + " |")
    print("\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[10, 11, 12],
                        help="held-out seeds (the preset was tuned on 0 and 1)")
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
    runs = runs_of("mixtral-realistic", args.tokens, args.seeds, (2, 4, 6), RANKED)
    realistic, realistic_spread = mean_spread(runs)
    like, like_spread = mean_spread(runs_of("mixtral-like", args.tokens, args.seeds, (2, 4, 6)))
    off_real, off_like = misfit(realistic), misfit(like)
    lines = ["| statistic (S = 64 / 128 / 192 where three) | real HumanEval | real GSM8K | "
             "mixtral-realistic (synthetic) | off | mixtral-like (synthetic) | off |",
             "|---|---|---|---|---|---|---|"]
    for key, (humaneval, gsm8k) in REAL.items():
        lines.append(f"| {key} | {fmt(humaneval)} | {fmt(gsm8k)} | "
                     f"{fmt(realistic[key], realistic_spread[key])} | {off_real[key]:.3f} | "
                     f"{fmt(like[key], like_spread[key])} | {off_like[key]:.3f} |")
    table = "\n".join(lines)
    worst = lambda off, keys: max(off[k] for k in keys)  # noqa: E731
    stat_keys = [key for key in REAL if key not in HIT_KEYS]
    closeness = (f"off = distance outside the two real values' range (statistics) or from their "
                 f"mean (hit rates). Largest over the statistics / the 9 hit rates: "
                 f"mixtral-realistic {worst(off_real, stat_keys):.3f} / "
                 f"{worst(off_real, HIT_KEYS):.3f} (criterion {STATISTIC_SLACK} / {HIT_SLACK}: "
                 f"{'met' if fits(realistic) else 'NOT met'}); mixtral-like "
                 f"{worst(off_like, stat_keys):.3f} / {worst(off_like, HIT_KEYS):.3f}.")

    shares = real_shares()
    lru, bel = realistic["global LRU"], realistic["Belady"]
    rank = ["| eviction | mixtral-realistic hit rate (synthetic) | share of the gap (synthetic) "
            "| real HumanEval share | real GSM8K share |", "|---|---|---|---|---|"]
    rank.append(f"| lru | {fmt(lru)} | +0.00 / +0.00 / +0.00 | | |")
    for policy in RANKED:
        rank.append(f"| {policy} | {fmt(realistic[policy], realistic_spread[policy])} | "
                    f"**{fmt_share(share(realistic[policy], lru, bel))}** | "
                    + (" | ".join(fmt_share(c) for c in shares[policy])
                       if policy in shares else "- | -") + " |")
    rank.append(f"| Belady | {fmt(bel)} | +1.00 / +1.00 / +1.00 | | |")
    margin = min(float(np.min(np.subtract(run["route_knn"], run["route_lfu"]))) for run in runs)
    knn_seed = np.array([share(run["route_knn"], run["global LRU"], run["Belady"])
                         for run in runs])
    rank_table = "\n".join(rank)
    ranking = (f"Per seed: route_knn's share {fmt_share(knn_seed.min(axis=0))} (lowest) to "
               f"{fmt_share(knn_seed.max(axis=0))} (highest) at S = 64 / 128 / 192; route_knn "
               f"minus route_lfu, worst over seeds and sizes: {margin:+.4f}.")

    fine_runs = runs_of("fine-grained-realistic", args.fine_tokens, args.seeds[:1], (8, 16, 32))
    fine, fine_spread = mean_spread(fine_runs)
    fine_lines = ["| statistic (S = 384 / 768 / 1536 where three) | fine-grained-realistic "
                  "(synthetic) |", "|---|---|"]
    for key in REAL:
        fine_lines.append(f"| {key} | {fmt(fine[key], fine_spread[key])} |")
    fine_table = "\n".join(fine_lines)
    elapsed = time.perf_counter() - start
    print(table, closeness, rank_table, ranking, fine_table, f"({elapsed:.0f} s)", sep="\n\n")

    if args.write:
        seeds = " ".join(map(str, args.seeds))
        command = (f"python benchmarks/realistic_preset.py --tokens {args.tokens} --seeds {seeds}"
                   f" --fine-tokens {args.fine_tokens} --write")
        section = (
            f"## Realistic synthetic preset vs real Mixtral-8x7B (`benchmarks/realistic_preset.py`)"
            f"\n\n{run_header(command, note=f', {elapsed:.0f} s')} numpy {np.__version__}.\n\n"
            f"Real columns: two Mixtral-8x7B decode traces (HumanEval and GSM8K prompts; "
            f"docs/policies.md). Synthetic columns: mean over the held-out seeds {seeds} (the "
            f"preset was tuned on seeds 0-1) of {args.tokens} tokens each (± half the range "
            f"over seeds). Lag-k repeat: share of a call's experts the same layer routed k "
            f"tokens earlier (chance 0.25). Neighbour precision: the past token (window 128) "
            f"with the most matching routes over layers < l predicts layer l "
            f"(`neighbour_precision`); next-token precision: the successor of the past token "
            f"most like the current one predicts the next token (`next_token_precision`). "
            f"Global LRU = the library's cache replayed with policy `full`; per-layer LRU = "
            f"`per_layer_lru_hit_rate` (S / L slots per layer); Belady = "
            f"`pallas_cache.sizing.bounds.belady`.\n\n{table}\n\n{closeness}\n\n"
            f"Policy ranking on the same held-out seeds (policy `full`; share = (policy - LRU) "
            f"/ (Belady - LRU) of the seed means), next to the real traces' shares:\n\n"
            f"{rank_table}\n\n{ranking}\n\n"
            f"`fine-grained-realistic` (48 x 128, top-8; no measured counterpart; synthetic), "
            f"seed {args.seeds[0]}, {args.fine_tokens} tokens, at 8 / 16 / 32 slots per layer:"
            f"\n\n{fine_table}\n")
        write_section("realistic_preset", section)


if __name__ == "__main__":
    main()
