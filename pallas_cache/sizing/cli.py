"""The ``pallas-cache`` command: size an expert cache by replaying routing traces.

``pallas-cache replay`` with no arguments replays the embedded synthetic ``mixtral-like`` trace
through a small grid of cache sizes and policies and prints, for each configuration, the hit rate
next to Belady's offline optimum and the stationary per-layer oracle. ``pallas-cache scenarios``
prints the seed-000 promotion table computed by the library.
"""

from __future__ import annotations

import argparse
import json
import sys

from pallas_cache.sizing import synthetic
from pallas_cache.sizing.trace import TraceError, load_trace

DEFAULT_PRESET = "mixtral-like"
DEFAULT_POLICIES = ("full", "fraction:0.4")

REPLAY_HELP = """\
Replay a routing trace through a grid of cache configurations and report, for each one, how
often the routed experts were already on the device.

  pallas-cache replay                                   # the embedded mixtral-like trace
  pallas-cache replay --synthetic fine-grained --cache-size 256 1024 2048
  pallas-cache replay --trace routes.jsonl --cache-size 64 128 --policy full fraction:0.4 cap:1
  pallas-cache replay --order recency lowest_id --admission promote_one none --json

Trace files: JSONL, one record per (token, layer):
  {"layer": 3, "token_idx": 17, "experts": [5, 1], "sequence": "prompt-42"}
or a .npy/.npz integer array [tokens, layers, top_k] (-1 = padding).

hit_rate = 1 - missing/active, counted per layer-call over distinct experts. belady is the
offline optimum for the same pool (evict the resident used furthest in the future); oracle is
the best a fixed per-layer share of S/L slots could do on this traffic.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pallas-cache",
        description="Plan and size the GPU expert slot cache of offloaded MoE inference.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    replay = commands.add_parser(
        "replay", help="replay a routing trace through cache configurations",
        description=REPLAY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = replay.add_mutually_exclusive_group()
    source.add_argument("--trace", metavar="FILE", help="a .jsonl, .npy or .npz routing trace")
    source.add_argument("--synthetic", metavar="PRESET", choices=sorted(synthetic.PRESETS),
                        help=f"a generated trace: {', '.join(sorted(synthetic.PRESETS))} "
                             f"(default: {DEFAULT_PRESET})")
    replay.add_argument("--tokens", type=int, default=None,
                        help="tokens to generate for --synthetic (default: the preset's)")
    replay.add_argument("--seed", type=int, default=0, help="seed for --synthetic (default: 0)")
    replay.add_argument("--num-layers", type=int, default=None,
                        help="declared layer count of --trace (default: inferred)")
    replay.add_argument("--num-experts", type=int, default=None,
                        help="declared experts per layer of --trace (default: inferred)")
    replay.add_argument("--cache-size", type=int, nargs="+", metavar="N",
                        help="pool sizes in slots, each >= experts per layer "
                             "(default: E, L*E/8, L*E/4, L*E/2)")
    replay.add_argument("--policy", nargs="+", default=list(DEFAULT_POLICIES), metavar="P",
                        help="full | fraction:Q | cap:N (default: full fraction:0.4)")
    replay.add_argument("--order", nargs="+", default=["recency"], choices=["recency", "lowest_id"],
                        help="which misses win a capped fetch (default: recency)")
    replay.add_argument("--admission", nargs="+", default=["promote_one"],
                        choices=["promote_one", "none", "reuse"],
                        help="fetches beyond the split (default: promote_one)")
    replay.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    replay.add_argument("--plot", metavar="FILE.png",
                        help="draw hit rate against cache size (needs matplotlib)")

    commands.add_parser("scenarios", help="print the seed-000 promotion table")
    return parser


def _load(args):
    if args.trace:
        return load_trace(args.trace, num_layers=args.num_layers, num_experts=args.num_experts)
    return synthetic.synthetic_trace(args.synthetic or DEFAULT_PRESET, num_tokens=args.tokens,
                                     seed=args.seed)


def _default_sizes(num_layers: int, num_experts: int) -> list[int]:
    total = num_layers * num_experts
    return sorted({num_experts, *(max(num_experts, total // d) for d in (8, 4, 2))})


def _table(results, trace) -> str:
    header = ("cache_size", "policy", "order", "admission", "hit_rate", "belady", "oracle",
              "fetched/call", "cpu_routes", "empty_slots")
    rows = [header]
    for r in results:
        rows.append((
            str(r.cache_size), r.policy, r.order, r.admission, f"{r.hit_rate:.4f}",
            f"{r.belady_hit_rate:.4f}", f"{r.oracle_hit_rate:.4f}",
            f"{r.fetched / r.calls if r.calls else 0.0:.3f}", str(r.cpu_routes), str(r.empty_slots),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"trace: {trace.source}  layers={trace.num_layers} experts={trace.num_experts} "
             f"top_k={trace.top_k} calls={trace.num_calls}"]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _plot(results, path: str, trace) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'pallas-cache[plot]'") from None
    figure, axes = plt.subplots(figsize=(7, 4.5))
    sizes = sorted({r.cache_size for r in results})
    series: dict[str, list] = {}
    for r in results:
        series.setdefault(f"{r.policy} / {r.order} / {r.admission}", []).append(r)
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r.cache_size)
        axes.plot([r.cache_size for r in rs], [r.hit_rate for r in rs], marker="o", label=label)
    optimum = {r.cache_size: r.belady_hit_rate for r in results}
    oracle = {r.cache_size: r.oracle_hit_rate for r in results}
    axes.plot(sizes, [optimum[s] for s in sizes], "k--", marker="x", label="Belady (optimum)")
    axes.plot(sizes, [oracle[s] for s in sizes], "k:", label="stationary oracle")
    axes.set_xlabel("cache size (slots)")
    axes.set_ylabel("hit rate (1 - missing / active)")
    axes.set_ylim(0, 1.02)
    axes.set_title(f"{trace.source}", fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _replay(args) -> int:
    from pallas_cache.sizing.replay import config_grid, replay  # jax import deferred until needed

    try:
        trace = _load(args)
    except (TraceError, OSError, KeyError, ValueError) as error:
        print(f"pallas-cache: {error}", file=sys.stderr)
        return 2
    sizes = args.cache_size or _default_sizes(trace.num_layers, trace.num_experts)
    try:
        configs = config_grid(sizes, args.policy, args.order, args.admission)
        too_small = [s for s in sizes if s < trace.num_experts]
        if too_small:
            raise ValueError(f"cache size {too_small[0]} cannot hold one layer of "
                             f"{trace.num_experts} experts")
    except (TypeError, ValueError) as error:
        print(f"pallas-cache: {error}", file=sys.stderr)
        return 2
    results = replay(trace, configs)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=1))
    else:
        print(_table(results, trace))
    if args.plot:
        _plot(results, args.plot, trace)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _scenarios(_args) -> int:
    from pallas_cache.sizing.scenarios import seed000_table

    rows = seed000_table()
    width = max(len(name) for name, _, _ in rows)
    print("Seed-000 scenarios: fraction 0.4, L=8, E=16, S=64, top-8, 256 steps per active layer")
    print(f"{'scenario'.ljust(width)}  {'NONE':>6}  {'PROMOTE_ONE':>11}")
    for name, none, promote in rows:
        print(f"{name.ljust(width)}  {none:>6}  {promote:>11}")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "replay":
        return _replay(args)
    return _scenarios(args)


if __name__ == "__main__":
    sys.exit(main())
