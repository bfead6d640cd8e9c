"""One set of histogram metrics behind the skew report, the stationary oracle and trace statistics
(docs/semantics.md §5.10)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cache as pc
from pallas_cache.host.metrics import histogram_metrics, oracle_slots_for
from pallas_cache.sizing.bounds import stationary_oracle
from pallas_cache.sizing.synthetic import synthetic_trace
from pallas_cache.sizing.trace_stats import trace_statistics


def test_the_three_reports_agree_exactly_on_one_trace():
    """FAILS if the skew report, the stationary oracle and the trace statistics compute a metric
    (entropy, working set, hottest share, the oracle's slot count) each their own way."""
    trace = synthetic_trace("fine-grained", num_tokens=40, seed=3)
    histogram = trace.routing_histogram()
    cache_size = 216  # S / L = 4.5 over 48 layers: 5 slots (half away from zero), not 4
    state = pc.init(trace.num_layers, trace.num_experts, cache_size)
    state = state.replace(routing=state.routing.replace(freq=jnp.asarray(histogram, jnp.int32)))
    skew = pc.routing_skew(state)
    oracle = stationary_oracle(trace, cache_size)
    statistics = trace_statistics(trace)
    slots = oracle_slots_for(cache_size, trace.num_layers)
    assert skew.oracle_slots == oracle.oracle_slots == slots
    assert [s.layer for s in skew.per_layer] == oracle.routed_layers.tolist()
    assert [s.oracle_hit_at_slots for s in skew.per_layer] == oracle.hit_rate.tolist()
    assert [s.norm_entropy for s in skew.per_layer] == statistics.norm_entropy.tolist()
    assert [s.working_set for s in skew.per_layer] == statistics.working_set.tolist()


def test_metrics_of_hand_counted_rows():
    """FAILS if the 90% coverage counts the crossing expert twice or not at all, if zero counts
    enter the entropy as NaN, or if the hottest share takes the first ``top`` experts by id."""
    metrics = histogram_metrics([[0, 1, 9, 0], [2, 2, 2, 2]], top=1)
    assert metrics.routed.tolist() == [10, 8]
    assert metrics.working_set.tolist() == [2, 4]
    assert metrics.experts_for_90pct.tolist() == [1, 4]  # 9/10 reaches 90%; 3/4 of a flat row not
    assert metrics.hottest_share.tolist() == [0.9, 0.25]
    p = np.array([0.1, 0.9])
    assert metrics.norm_entropy[0] == pytest.approx(-(p * np.log(p)).sum() / np.log(4), abs=1e-15)
    assert metrics.norm_entropy[1] == pytest.approx(1.0, abs=1e-15)
    assert histogram_metrics([[5]]).norm_entropy.tolist() == [0.0]  # E == 1: 0.0, not NaN


def test_a_row_without_routes_is_refused():
    with pytest.raises(ValueError, match="at least one route"):
        histogram_metrics([[1, 0], [0, 0]])
