"""``pallas-cache replay --cache-size``: each value read once into a ``CacheSize`` (its spelling
and its slots), and a request's sizes resolved at a geometry, in one place, into the slots the
sweep replays and the ``size:`` lines the table prints."""

from __future__ import annotations

import pathlib
import types

import pytest

from pallas_cache.sizing.cli import replay
from pallas_cache.sizing.cli.parser import build_parser
from pallas_cache.sizing.cli.request import build_request
from pallas_cache.sizing.cli.sizes import CacheSize, SweepSizes, resolve_sizes

CLI = pathlib.Path(replay.__file__).parent
W = 336 * 2**20  # mixtral-8x7b's expert (bf16)
TIMED = ("--model", "mixtral-8x7b", "--link-bandwidth", "25GB/s", "--cpu-bandwidth", "60GB/s")


def request(*argv):
    return build_request(build_parser().parse_args(["replay", *argv]))


def test_each_spelling_is_read_once_into_its_slots():
    """FAILS if a byte size leaves the request without its slots (to be worked out again where
    it is replayed or printed), or ``auto`` gets any."""
    assert CacheSize.parse("64", None) == CacheSize("64", 64)
    assert CacheSize.parse("12GiB", W) == CacheSize("12GiB", 36, 12 * 2**30)
    assert CacheSize.parse("auto", W) == CacheSize("auto")
    got = request(*TIMED, "--cache-size", "12GiB", "auto")
    assert [size.slots for size in got.cache_sizes] == [36, None]


def test_the_sweep_and_the_table_get_the_one_resolution():
    """FAILS if the slots the sweep replays and the lines above the table come from two places:
    ``auto``'s grid, a pool past every expert clamped to ``L*E``, a byte size's slots and the
    ``--device-budget`` fit sorted in are all one :class:`SweepSizes`, which the plan carries."""
    got = request(*TIMED, "--cache-size", "auto", "100", "16GiB", "300",
                  "--device-budget", "25GiB")
    sizes = resolve_sizes(got.cache_sizes, got.cost, 32, 8, 2)
    assert sizes == SweepSizes(
        (48, 64, 76, 91, 100, 128, 181, 256),
        ("16GiB = 48 slots of 336MiB (15.8GiB)",
         "300 slots is more than every expert (L*E = 32*8): replayed as 256 (84.0GiB), every "
         "expert resident",
         "--device-budget 25.0GiB fits 76 slots of 336MiB (24.9GiB): replayed beside the grid"))
    geometry = types.SimpleNamespace(num_layers=32, num_experts=8, top_k=2)
    plan = replay.configurations(got, geometry, ["full"])
    assert plan.sizes == sizes
    assert sorted({c.cache_size for c in plan.configs}) == list(sizes.slots)


def test_a_size_below_one_layer_is_refused_where_it_is_resolved():
    got = request(*TIMED, "--cache-size", "1GiB")
    with pytest.raises(ValueError, match="holds 3 experts of 336MiB, fewer than one layer's 8"):
        resolve_sizes(got.cache_sizes, got.cost, 32, 8, 2)


def test_no_other_cli_module_decides_what_a_cache_size_means():
    """FAILS if a module of the CLI other than sizes.py turns ``--cache-size`` into slots again
    (the ``auto`` grid, the budget's fit, bytes over ``W``): the meaning of a size is decided
    in one file. (bench-decode's sizes are its own: slots in ``[E, L*E]``, no ``auto``.)"""
    for path in CLI.glob("*.py"):
        if path.name in ("sizes.py", "decode.py"):
            continue
        text = path.read_text()
        for name in ("auto_cache_sizes", "budget_fit", "nbytes //", ".nbytes is not None"):
            assert name not in text, f"{path.name} uses {name}"
