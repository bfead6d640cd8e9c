"""The offline sizing tool: routing traces in, replays of many cache configurations out.

Layers: :mod:`~pallas_cache.sizing.traces` (the trace type and its readers),
:mod:`~pallas_cache.sizing.synthetic` (seeded synthetic traces), :mod:`~pallas_cache.sizing.bounds`
(Belady's optimum, the bypass optimum and the stationary oracle), :mod:`~pallas_cache.sizing.sweep` (the compiled
sweep; :mod:`~pallas_cache.sizing.progress` draws its progress),
:mod:`~pallas_cache.sizing.cli` (``pallas-cache replay``) and
:mod:`~pallas_cache.sizing.scenarios` (the seed-000 table); :func:`records`/:func:`format_records`
(:mod:`~pallas_cache.sizing.report`: one record schema, five formats) and :func:`plot`
(:mod:`~pallas_cache.sizing.plotting`: the sweep as a figure) are what the CLI and the notebook
print and draw. Routing from elsewhere: :mod:`~pallas_cache.sizing.engines` (router logits),
:mod:`~pallas_cache.sizing.recorder` (a JAX decode loop's routes) and the vLLM and Parquet
readers behind :func:`load_trace`.
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
