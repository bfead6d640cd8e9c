"""``pallas_cache.sizing.cli.names``: the parser's choices without JAX, each tuple equal to what
it names, so a new eviction policy, preset or trace format cannot be left out of the CLI."""

from __future__ import annotations

from pallas_cache import Admission, Eviction, FetchOrder
from pallas_cache.sizing import synthetic, traces
from pallas_cache.sizing.cli import names as cli_names
from pallas_cache.sizing.cli.parser import build_parser


def test_each_name_tuple_is_what_it_names():
    """FAILS if a tuple of cli_names drifts from the enum, registry or table it mirrors."""
    assert cli_names.EVICTIONS == tuple(e.value for e in Eviction)
    assert cli_names.EVICTIONS == tuple(e.policy.name for e in Eviction)
    assert cli_names.ORDERS == tuple(o.value for o in FetchOrder)
    assert cli_names.ADMISSIONS == tuple(a.value for a in Admission)
    assert cli_names.PRESETS == tuple(sorted(synthetic.PRESETS))
    assert cli_names.FIELD_KEYS == traces.FIELD_KEYS


def test_the_parser_offers_those_names():
    """FAILS if a replay flag's choices come from anywhere else."""
    replay = next(action for action in build_parser()._subparsers._group_actions
                  ).choices["replay"]
    choices = {action.dest: tuple(action.choices) for action in replay._actions
               if action.choices is not None}
    assert choices["eviction"] == cli_names.EVICTIONS
    assert choices["order"] == cli_names.ORDERS
    assert choices["admission"] == cli_names.ADMISSIONS
    assert choices["synthetic"] == cli_names.PRESETS
    assert choices["trace_format"] == ("auto",) + traces.TRACE_FORMATS
