"""Baseline cache simulators that are not library options, for the benchmarks: per-layer LRU.

The simulator is :func:`pallas_cache.sizing.synthetic.per_layer_lru_hit_rate`, beside the trace
statistics (so tests reach it without importing a benchmark).
"""

from __future__ import annotations

from pallas_cache.sizing.trace_stats import per_layer_lru_hit_rate

__all__ = ["per_layer_lru_hit_rate"]
