"""``pallas-cache replay``'s sweep axes (``--order``, ``--admission``, ``--eviction``): the
request's enum members reach the sweep's configurations as they are, and no module of the CLI
past the request names the axes one by one (a new axis is the parser's flag, the request's
field and the report's key)."""

from __future__ import annotations

import pathlib
import re
import types

from pallas_cache import Admission, Eviction, FetchOrder
from pallas_cache.sizing.cli import replay
from pallas_cache.sizing.cli.parser import build_parser
from pallas_cache.sizing.cli.request import build_request

CLI = pathlib.Path(replay.__file__).parent
GEOMETRY = types.SimpleNamespace(num_layers=32, num_experts=8, top_k=2)


def request(*argv):
    return build_request(build_parser().parse_args(["replay", *argv]))


def test_the_axes_reach_the_sweep_as_enum_members():
    """FAILS if the request turns its axes back into strings for the sweep to coerce again: the
    configurations carry the members the request holds."""
    got = request("--cache-size", "64", "--order", "lowest_id", "--admission", "none",
                  "--eviction", "route_knn")
    assert got.axes == ((FetchOrder.LOWEST_ID,), (Admission.NONE,), (Eviction.ROUTE_KNN,))
    [config] = replay.configurations(got, GEOMETRY, ["full"]).configs
    assert config.order is FetchOrder.LOWEST_ID
    assert config.admission is Admission.NONE
    assert config.eviction is Eviction.ROUTE_KNN


def test_the_route_knn_companions_are_the_grids_own_first_configuration():
    """FAILS if the legend's route_knn lanes are not the grid's first configuration of the
    chosen policy that route_knn takes (reuse refused), at every size, with the eviction
    replaced and every other axis kept."""
    got = request("--cache-size", "64", "128", "--policy", "fraction:0.4", "full",
                  "--order", "lowest_id", "recency", "--admission", "reuse", "none",
                  "--route-knn-legend")
    configs = replay.configurations(got, GEOMETRY, ["fraction:0.4", "full"]).configs
    companions = replay.knn_companions(got, configs)
    assert [(c.cache_size, c.policy, c.order, c.admission, c.eviction) for c in companions] == [
        (size, "full", FetchOrder.LOWEST_ID, Admission.NONE, Eviction.ROUTE_KNN)
        for size in (64, 128)]


#: A configuration key named one by one: ``row["order"]``, ``r.admission``, ``orders[0]``.
_NAMED_AXIS = re.compile(r"""\[["'](order|admission)["']\]|\.(order|admission)\b(?!\.value)"""
                         r"""|\b(orders|admissions), \w+ = """)


def test_no_cli_module_past_the_request_names_the_axes_one_by_one():
    """FAILS if replay.py, output.py, findings.py or devices.py names the order or admission
    axis (a new axis would have to be added there too): they walk ``ReplayRequest.axes`` and
    ``report.CONFIG_KEYS``."""
    for name in ("replay.py", "output.py", "findings.py", "devices.py"):
        text = (CLI / name).read_text()
        found = [match.group(0) for match in _NAMED_AXIS.finditer(text)]
        assert not found, f"{name} names an axis: {found}"
