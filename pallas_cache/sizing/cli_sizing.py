"""``pallas-cache replay``'s sizing flags (the legend's route_knn line, the model geometry of a
synthetic trace, the exact-fit size of a device budget, batched decode, the CPU's fixed cost):
their argument group and the checks that refuse a bad value or combination before the trace is
read (each as a ``ValueError`` whose text is the one line the CLI prints, exit 2)."""

from __future__ import annotations

import argparse

from pallas_cache.sizing.units import parse_duration

__all__ = ["add_sizing_arguments", "cpu_fixed_seconds"]


def add_sizing_arguments(replay: argparse.ArgumentParser) -> None:
    """Add the sizing flags to the ``replay`` subcommand's parser, as one argument group."""
    group = replay.add_argument_group("sizing")
    group.add_argument("--no-route-knn-legend", dest="knn_legend", action="store_false",
                       help="leave out the table legend's route_knn line (an LRU-only table "
                            "replays route_knn at each size beside the sweep, in the same "
                            "compiled programs, for that line)")
    group.add_argument("--cpu-fixed-cost", metavar="TIME", default=None,
                       help="T_cpu, the CPU partial's fixed cost per layer-call that has at "
                            "least one CPU expert, e.g. 0.08ms (pallas-cache bench-bandwidth "
                            "measures it; needs W and both bandwidths; default 0)")


def cpu_fixed_seconds(args, timed: bool) -> float:
    """``--cpu-fixed-cost`` in seconds (0 when not given); ``timed``: whether ``W`` and both
    bandwidths are known, without which the flag does not apply (an error naming it)."""
    text = getattr(args, "cpu_fixed_cost", None)
    if text is None:
        return 0.0
    try:
        seconds = parse_duration(text)
    except ValueError as error:
        raise ValueError(f"--cpu-fixed-cost: {error}") from None
    if not timed:
        raise ValueError("--cpu-fixed-cost needs an expert size (--model or --expert-bytes) and "
                         "both --link-bandwidth and --cpu-bandwidth")
    return seconds
