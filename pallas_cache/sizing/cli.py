"""The ``pallas-cache`` command: size an expert cache by replaying routing traces.

``pallas-cache replay`` with no arguments replays the embedded synthetic ``mixtral-like`` trace
through a small grid of cache sizes and policies and prints, for each configuration, the hit rate
next to Belady's offline optimum and the stationary per-layer oracle. ``pallas-cache scenarios``
prints the seed-000 promotion table computed by the library.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

from pallas_cache.sizing import synthetic
from pallas_cache.sizing.trace import (TraceError, check_memory, default_memory_limit,
                                       load_trace)

DEFAULT_PRESET = "mixtral-like"
DEFAULT_POLICIES = ("full", "fraction:0.4")
#: File written inside a directory given to ``--plot``.
DEFAULT_PLOT_NAME = "hit_rate.png"
#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130

REPLAY_HELP = """\
Replay a routing trace through a grid of cache configurations and report, for each one, how
often the routed experts were already on the device.

  pallas-cache replay                                   # the embedded mixtral-like trace
  pallas-cache replay --synthetic fine-grained --cache-size 256 1024 2048
  pallas-cache replay --trace routes.jsonl --cache-size 64 128 --policy full fraction:0.4 cap:1
  pallas-cache replay --order recency lowest_id --admission promote_one none --json

Trace files: JSONL, one record per (token, layer):
  {"layer": 3, "token_idx": 17, "experts": [5, 1], "sequence": "prompt-42"}
(gzipped is fine), or a .npy/.npz integer array [tokens, layers, top_k] (-1 = padding; each
array of an .npz is one sequence).

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
                        help="draw hit rate against cache size (needs matplotlib); a directory "
                             f"gets {DEFAULT_PLOT_NAME} inside it")
    replay.add_argument("--max-memory", type=_memory_size, default=None, metavar="BYTES",
                        help="refuse a trace, synthetic size or cache state estimated above this "
                             "(e.g. 8GiB, 512MiB, 2e9; default: half the machine's memory)")

    commands.add_parser("scenarios", help="print the seed-000 promotion table")
    return parser


def _load(args):
    if args.trace:
        return load_trace(args.trace, num_layers=args.num_layers, num_experts=args.num_experts,
                          max_memory=args.max_memory)
    return synthetic.synthetic_trace(args.synthetic or DEFAULT_PRESET, num_tokens=args.tokens,
                                     seed=args.seed, max_memory=args.max_memory)


# ---- argument checks: everything that can fail does so before the work ----------------------

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def _memory_size(text: str) -> int:
    """``--max-memory``: ``8GiB``, ``512MiB``, ``2e9``, ``1000000`` -> bytes (argparse type)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size (e.g. 8GiB, 512MiB, "
                                         f"2e9)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive memory size")
    return value


def _check_plot_path(path: str) -> str:
    """The file ``--plot`` will write, checked now: matplotlib importable, a known image format,
    an existing, writable directory. A directory gets :data:`DEFAULT_PLOT_NAME` inside it.

    Raises:
        ValueError: the one-line reason.
    """
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'pallas-cache[plot]'") from None
    if os.path.isdir(path):
        path = os.path.join(path, DEFAULT_PLOT_NAME)
    elif path.endswith(("/", os.sep)):
        raise ValueError(f"--plot {path}: no such directory")
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in formats:
        raise ValueError(f"--plot {path}: unknown image format "
                         f"{('.' + extension) if extension else '(no extension)'}; use one of "
                         f"{', '.join('.' + f for f in formats)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--plot {path}: no such directory {folder}")
    try:  # a real write: permission bits say nothing to root or on a read-only mount
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".pallas-cache-probe-")
        os.close(handle)
        os.remove(probe)
    except OSError as error:
        raise ValueError(f"--plot {path}: cannot write in {folder}: "
                         f"{error.strerror or error}") from None
    return path


def _policy_warnings(policies) -> list[str]:
    """One line per ``fraction:Q`` whose clamping or rounding changes what it means
    (docs/semantics.md §5.3: ``q`` clamps to ``[0, 1]`` and is kept in 1/65536 steps)."""
    from pallas_cache.policy import ONE
    from pallas_cache.sizing.replay import parse_policy

    lines = []
    for text in policies:
        kind, _, value = str(text).partition(":")
        try:
            requested, f16 = float(value), int(parse_policy(text).fraction16)
        except ValueError:
            continue  # not a fraction, or malformed: config_grid reports it
        if kind != "fraction":
            continue
        if f16 == 0 and requested != 0:
            lines.append(f"pallas-cache: warning: {text} means fetch fraction 0 (q clamps to "
                         f"[0, 1] in steps of 1/{ONE}): the split fetches no miss")
        elif f16 == ONE and requested > 1:
            lines.append(f"pallas-cache: warning: {text} means fetch fraction 1 (q clamps to "
                         f"[0, 1]): the split fetches every miss, as 'full'")
    return lines


#: Bytes of one cache state per flat id (slot map, recency, routing histogram and prefill
#: snapshot: int32 [L, E] each) and per slot (id_of_slot, usage: int32 [S] each).
_STATE_BYTES_PER_ID = 16
_STATE_BYTES_PER_SLOT = 8


def _check_state_memory(sizes, configs_per_size: int, num_layers: int, num_experts: int,
                        limit: int) -> None:
    """Refuse cache sizes whose replay state would exceed ``limit``, before any is allocated.

    A size replays its ``configs_per_size`` configurations as one batch: the stacked states, the
    program's output batch and the initial state, ``2 * n + 1`` states in all.
    """
    for size in sorted(set(sizes), reverse=True):
        state = (num_layers * num_experts * _STATE_BYTES_PER_ID + size * _STATE_BYTES_PER_SLOT
                 + num_layers * 16)
        check_memory((2 * configs_per_size + 1) * state, limit, f"--cache-size {size}",
                     f"{configs_per_size} cache state(s) of {size} slots for {num_layers} "
                     f"layers x {num_experts} experts")


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


def _write_atomically(path: str, write) -> None:
    """``write(temp_path)`` next to ``path``, then rename over it: an interrupt or error leaves
    no partial file behind."""
    folder, name = os.path.split(os.path.abspath(path))
    handle, temp = tempfile.mkstemp(dir=folder, prefix=f".{name}.",
                                    suffix=os.path.splitext(name)[1])
    os.close(handle)
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


def _plot(results, path: str, trace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    try:
        _write_atomically(path, lambda temp: figure.savefig(temp, dpi=120, format=extension))
    finally:
        plt.close(figure)


def _replay(args) -> int:
    from pallas_cache.sizing.replay import config_grid, replay  # jax import deferred until needed

    try:
        if args.max_memory is None:
            args.max_memory = default_memory_limit()
        if args.plot:
            args.plot = _check_plot_path(args.plot)
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
        _check_state_memory(sizes, len(configs) // len(set(sizes)), trace.num_layers,
                            trace.num_experts, args.max_memory)
    except (TypeError, ValueError) as error:
        print(f"pallas-cache: {error}", file=sys.stderr)
        return 2
    for line in _policy_warnings(args.policy):
        print(line, file=sys.stderr)
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
    """Run ``pallas-cache``; returns the exit status (``130`` after Ctrl-C, with one line on
    stderr and no partial output file)."""
    try:
        args = _parser().parse_args(argv)
        if args.command == "replay":
            return _replay(args)
        return _scenarios(args)
    except KeyboardInterrupt:
        print("pallas-cache: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
