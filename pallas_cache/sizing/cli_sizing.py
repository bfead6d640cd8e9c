"""``pallas-cache replay``'s sizing flags (the legend's route_knn line, the model geometry of a
synthetic trace, the exact-fit size of a device budget, batched decode, the CPU's fixed cost):
their argument group and the checks that refuse a bad value or combination before the trace is
read (each as one line, exit 2)."""

from __future__ import annotations

import argparse

__all__ = ["add_sizing_arguments"]


def add_sizing_arguments(replay: argparse.ArgumentParser) -> None:
    """Add the sizing flags to the ``replay`` subcommand's parser, as one argument group."""
    group = replay.add_argument_group("sizing")
    group.add_argument("--no-route-knn-legend", dest="knn_legend", action="store_false",
                       help="leave out the table legend's route_knn line (an LRU-only table "
                            "replays route_knn at each size beside the sweep, in the same "
                            "compiled programs, for that line)")
