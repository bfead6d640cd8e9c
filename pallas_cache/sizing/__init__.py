"""The offline sizing tool: routing traces in, replays of many cache configurations out.

``pallas-cache replay`` is its command line; docs/replay.md describes its output and inputs.
"""

from pallas_cache.sizing.bounds import belady, bypass_optimum, stationary_oracle
from pallas_cache.sizing.engines import routes_from_router_logits
from pallas_cache.sizing.plotting import plot
from pallas_cache.sizing.recorder import RouteRecorder, init_recorder, record_routes, trace_from_routes
from pallas_cache.sizing.sweep import ReplayConfig, ReplayResult, config_grid, parse_policy, replay
from pallas_cache.sizing.report import format_records, records
from pallas_cache.sizing.synthetic import PRESETS, synthetic_trace
from pallas_cache.sizing.traces import Trace, TraceError, load_trace

__all__ = [
    "PRESETS",
    "ReplayConfig",
    "ReplayResult",
    "RouteRecorder",
    "Trace",
    "TraceError",
    "belady",
    "bypass_optimum",
    "config_grid",
    "format_records",
    "init_recorder",
    "load_trace",
    "parse_policy",
    "plot",
    "record_routes",
    "records",
    "replay",
    "routes_from_router_logits",
    "stationary_oracle",
    "synthetic_trace",
    "trace_from_routes",
]
