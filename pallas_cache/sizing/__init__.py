"""The offline sizing tool: routing traces in, replays of many cache configurations out.

``pallas-cache replay`` is its command line; docs/replay.md describes its output and inputs.

The names load on first use (PEP 562), so the command line's parser, in this package, answers
``--help`` without importing JAX.
"""

from __future__ import annotations

from pallas_cache.sizing.lazy import lazy_names

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

#: Where each public name lives.
_HOMES = {
    "PRESETS": "pallas_cache.sizing.synthetic",
    "ReplayConfig": "pallas_cache.sizing.sweep",
    "ReplayResult": "pallas_cache.sizing.sweep",
    "RouteRecorder": "pallas_cache.sizing.recorder",
    "Trace": "pallas_cache.sizing.traces",
    "TraceError": "pallas_cache.sizing.traces",
    "belady": "pallas_cache.sizing.bounds",
    "bypass_optimum": "pallas_cache.sizing.bounds",
    "config_grid": "pallas_cache.sizing.sweep",
    "format_records": "pallas_cache.sizing.report",
    "init_recorder": "pallas_cache.sizing.recorder",
    "load_trace": "pallas_cache.sizing.traces",
    "parse_policy": "pallas_cache.sizing.sweep",
    "plot": "pallas_cache.sizing.plotting",
    "record_routes": "pallas_cache.sizing.recorder",
    "records": "pallas_cache.sizing.report",
    "replay": "pallas_cache.sizing.sweep",
    "routes_from_router_logits": "pallas_cache.sizing.engines",
    "stationary_oracle": "pallas_cache.sizing.bounds",
    "synthetic_trace": "pallas_cache.sizing.synthetic",
    "trace_from_routes": "pallas_cache.sizing.recorder",
}


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
