"""How ROUTE_KNN's and ROUTE_LFU's share of the LRU -> Belady gap moves with how much
``mixtral-realistic``'s token sequence repeats: variants of its copy and vocabulary knobs, each
with the calibration statistics, next-token precision and the policies' hit rates."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from pallas_cache.sizing.synthetic import PRESETS, synthetic_trace  # noqa: E402
from realistic_preset import POLICIES, REAL, measure, misfit, policy_hit_rates  # noqa: E402
from results_file import write_section  # noqa: E402
from timing import run_header  # noqa: E402

SLOTS_PER_LAYER = (2, 4, 6)

#: (label, knobs replaced in mixtral-realistic); the first row is the preset itself. A new span
#: start ends the running span, so a large ``copy_prob`` makes spans short (mean about
#: ``min(copy_span, 1 / copy_prob)``); a source up to ``copy_window = 512`` tokens back is mostly
#: outside ROUTE_KNN's 128-token ring, hence the ``window 128`` rows.
VARIANTS = [("default (mixtral-realistic)", {})]
VARIANTS += [(f"copy_prob {p}, span {s}, window {w}",
              {"copy_prob": p, "copy_span": float(s), "copy_window": w})
             for s, w in ((8, 512), (32, 512), (32, 128)) for p in (0.02, 0.05, 0.1, 0.2, 0.3)
             ]
VARIANTS += [(f"copy_prob {p}, span 128, window 128",
              {"copy_prob": p, "copy_span": 128.0, "copy_window": 128}) for p in (0.01, 0.02, 0.05)]
VARIANTS += [(f"vocab_zipf {z} (default {PRESETS['mixtral-realistic'].vocab_zipf:g})",
              {"vocab_zipf": z}) for z in (1.1, 1.5)]


def _context(tap1):
    """mixtral-realistic's context filter with the lag-1 tap replaced."""
    return (1.0, tap1) + tuple(PRESETS["mixtral-realistic"].context[2:])


#: Long copied passages inside the ring, with ``layer_noise`` and the lag-1 context tap raised
#: (chosen by hand on seeds 0-1; also reported on the held-out seeds).
TUNED = [(f"copy_prob 0.02, span {s}, window 128, layer_noise {n}, context[1] {c}",
          {"copy_prob": 0.02, "copy_span": float(s), "copy_window": 128, "layer_noise": n,
           "context": _context(c)})
         for s, n, c in ((64, 0.35, 0.3), (96, 0.4, 0.45), (128, 0.4, 0.45), (128, 0.45, 0.5))]



def evaluate(params, tokens, seeds):
    """Every number of one table row for ``params``: means over ``seeds`` (a sequence)."""
    sizes = [params.num_layers * s for s in SLOTS_PER_LAYER]
    runs = []
    for seed in seeds:
        trace = synthetic_trace(params, num_tokens=tokens, seed=seed)
        run = measure(trace, SLOTS_PER_LAYER)
        run.update(policy_hit_rates(trace, sizes))
        runs.append(run)
    row = {key: np.mean([np.asarray(run[key], dtype=np.float64) for run in runs], axis=0)
           for key in runs[0]}
    row["worst"] = max(misfit(row).values())
    lru, bel = row["global LRU"], row["Belady"]
    for policy in POLICIES:
        row[policy + " share"] = (row[policy] - lru) / (bel - lru)
    # per seed and size, stricter than the difference of the means
    row["route_lfu - LRU"] = min(float(np.min(np.subtract(run["route_lfu"], run["global LRU"])))
                                 for run in runs)
    return row


def fmt3(values, digits=2):
    return " / ".join(f"{v:.{digits}f}" for v in np.atleast_1d(values))


def seed_text(seeds):
    """``[2, 3, 4]`` -> ``'2-4'``; other lists comma-separated."""
    seeds = list(seeds)
    if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def row_line(label, seeds, row):
    return (f"| {label} | {seeds} | {row['worst']:.3f} | {row['lag 1']:.3f} | "
            f"{row['lag 8']:.3f} | {row['neighbour precision']:.3f} | "
            f"{row['normalised entropy']:.3f} | {fmt3(row['global LRU'], 3)} | "
            f"{fmt3(row['per-layer LRU'], 3)} | {fmt3(row['Belady'], 3)} | "
            f"**{row['next-token precision']:.3f}** | {fmt3(row['route_knn'], 3)} | "
            f"{fmt3(row['route_lfu'], 3)} | **{fmt3(row['route_knn share'])}** | "
            f"{fmt3(row['route_lfu share'])} | {row['route_lfu - LRU']:+.4f} |")


def facts(rows, default_label):
    """The reading's numbers, computed from the rows (so a rerun cannot contradict them)."""
    knn64 = lambda row: float(row["route_knn share"][0])  # noqa: E731
    close = [(label, seeds, row) for label, seeds, row in rows if row["worst"] <= 0.03]
    crossing = [row for _, _, row in rows if knn64(row) >= 0.30]
    below = [row for _, _, row in rows if knn64(row) < 0.30]
    default = next(row for label, _, row in rows if label == default_label)
    out = [f"Rows within 0.03 of the real traces (misfit): {len(close)} of {len(rows)}; their "
           f"route_knn share at S = 64: "
           + ", ".join(f"{knn64(row):+.2f} ({label}, seeds {seeds})"
                       for label, seeds, row in close) + "."]
    out.append(f"The default preset's next-token neighbour precision is "
               f"{default['next-token precision']:.3f} (its lag-1 reuse {default['lag 1']:.3f}).")
    if crossing:
        out.append(f"route_knn reaches >= 0.30 of the gap at S = 64 in {len(crossing)} rows, "
                   f"with next-token precision {min(r['next-token precision'] for r in crossing):.3f}"
                   f"-{max(r['next-token precision'] for r in crossing):.3f} and misfit "
                   f"{min(r['worst'] for r in crossing):.3f}-{max(r['worst'] for r in crossing):.3f};"
                   f" the rows below 0.30 reach next-token precision up to "
                   f"{max(r['next-token precision'] for r in below):.3f}.")
    else:
        out.append(f"route_knn stays below 0.30 of the gap at S = 64 in every row (best "
                   f"{max(knn64(r) for _, _, r in rows):+.2f}).")
    x = np.array([row["next-token precision"] for _, _, row in rows])
    y = np.array([knn64(row) for _, _, row in rows])
    slope, intercept = np.polyfit(x, y, 1)
    residual = float(np.abs(y - (slope * x + intercept)).max())
    out.append(f"A least-squares line through all {len(rows)} rows, route_knn share at S = 64 = "
               f"{slope:.2f} * next-token precision {intercept:+.2f} (largest residual "
               f"{residual:.2f}), gives 0.30 at next-token precision "
               f"{(0.30 - intercept) / slope:.2f}.")
    out.append(f"route_lfu minus global LRU, worst over every row, seed and size: "
               f"{min(r['route_lfu - LRU'] for _, _, r in rows):+.4f}; its share at S = 64 is "
               f"{min(float(r['route_lfu share'][0]) for _, _, r in rows):+.2f} to "
               f"{max(float(r['route_lfu share'][0]) for _, _, r in rows):+.2f}.")
    return " ".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--held-out", type=int, nargs="*", default=[2, 3, 4, 5, 6, 7],
                        help="seeds on which the default and the hand-tuned variants are also "
                             "reported")
    parser.add_argument("--save", help="write the rows as JSON to this path")
    parser.add_argument("--load", help="render the rows saved by --save instead of computing")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    base = PRESETS["mixtral-realistic"]
    saved = None
    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        args.tokens = saved.get("tokens", args.tokens)
        args.seeds = saved.get("seeds", args.seeds)
        args.held_out = saved.get("held_out", args.held_out)
    seeds, held = seed_text(args.seeds), seed_text(args.held_out)
    jobs = [(label, knobs, args.seeds, seeds) for label, knobs in VARIANTS + TUNED]
    if args.held_out:
        jobs += [(label, knobs, args.held_out, held) for label, knobs in VARIANTS[:1] + TUNED]
    if saved is not None:
        rows = [(label, shown, {k: np.asarray(v) if isinstance(v, list) else v
                                    for k, v in row.items()})
                for label, shown, row in saved["rows"]]
        elapsed = saved["elapsed"]
    else:
        rows = []
        for label, knobs, seed_list, shown in jobs:
            t0 = time.perf_counter()
            row = evaluate(dataclasses.replace(base, **knobs), args.tokens, seed_list)
            rows.append((label, shown, row))
            print(f"{label} (seeds {shown}): max|d| {row['worst']:.3f}, next-token "
                  f"{row['next-token precision']:.3f}, knn share {fmt3(row['route_knn share'])}, "
                  f"lfu share {fmt3(row['route_lfu share'])} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        elapsed = time.perf_counter() - start
        if args.save:
            with open(args.save, "w") as f:
                json.dump({"elapsed": elapsed, "tokens": args.tokens,
                           "seeds": args.seeds, "held_out": args.held_out,
                           "rows": [(label, shown, {k: np.asarray(v).tolist()
                                                        for k, v in row.items()})
                                    for label, shown, row in rows]}, f)

    header = ("| variant | seeds | misfit | lag 1 | lag 8 | neighbour "
              "prec. | entropy | global LRU | per-layer LRU | Belady | **next-token prec.** | "
              "route_knn | route_lfu | **route_knn share** | route_lfu share | route_lfu - LRU "
              "(worst) |")
    lines = [header, "|" + "---|" * (header.count(" | ") + 1)]
    for column, name in enumerate(("HumanEval", "GSM8K")):
        lines.append(f"| real Mixtral-8x7B {name} | | 0 | "
                     + " | ".join(f"{REAL[k][column]:.3f}" for k in
                                  ("lag 1", "lag 8", "neighbour precision", "normalised entropy"))
                     + " | " + " | ".join(fmt3(REAL[k][column], 3) for k in
                                          ("global LRU", "per-layer LRU", "Belady"))
                     + f" | {REAL['next-token precision'][column]:.3f} | | | | | |")
    lines += [row_line(label, shown, row) for label, shown, row in rows]
    table = "\n".join(lines)
    reading = facts(rows, VARIANTS[0][0])
    print(table, reading, f"({elapsed:.0f} s)", sep="\n\n")

    if args.write:
        command = (f"python benchmarks/preset_sensitivity.py --tokens {args.tokens} --seeds "
                   f"{' '.join(map(str, args.seeds))} --held-out "
                   f"{' '.join(map(str, args.held_out))} --write")
        section = (
            f"## Sensitivity of the eviction results to the preset's token repetition "
            f"(`benchmarks/preset_sensitivity.py`)\n\n"
            f"{run_header(command, note=f', {elapsed:.0f} s')} numpy {np.__version__}.\n\n"
            f"Variants of `mixtral-realistic` (`dataclasses.replace`), mean over the seeds named"
            f" of {args.tokens} tokens each. The calibration statistics as in "
            f"`realistic_preset.measure` (triples at S = 64 / 128 / 192); misfit = "
            f"`realistic_preset.misfit`'s largest distance to the real traces. Next-token prec. "
            f"= next-token neighbour precision (window 128; the past token whose routes over all "
            f"layers best match token T's, ties to the most recent, predicts T + 1's routes by "
            f"its own successor's; chance 0.25; definition: `next_token_precision`'s docstring). "
            f"route_knn / route_lfu = the library's replay (policy `full`); share = (policy - "
            f"LRU) / (Belady - LRU) of the seed means; route_lfu - LRU = the worst over seeds and "
            f"sizes. The last rows (long copied passages with a larger `layer_noise` and lag-1 "
            f"tap, hand-tuned on seeds {seeds}) and the default are repeated on the held-out "
            f"seeds {held}. At {args.tokens} tokens per seed the statistics are noisier than "
            f"in `realistic_preset`'s 2000-token fit, so the default's misfit here is larger."
            f"\n\n{table}\n\n"
            f"Numbers: {reading}\n\n{READING}\n")
        write_section("preset_sensitivity", section)


READING = (
    "Reading. Next-token neighbour precision is the statistic to watch: the least-squares line "
    "above relates it to route_knn's share at S = 64 across the variants (synthetic). The real "
    "Mixtral-8x7B traces score 0.49-0.59 and give route_knn 21-22% of the gap at S = 64 "
    "(docs/policies.md); the default preset is calibrated to them.")


if __name__ == "__main__":
    main()
