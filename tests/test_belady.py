"""Belady's optimum and the stationary oracle.

The main check is exhaustive: on tiny traces (L*E <= 6 ids, <= 8 calls) a search over *every*
eviction choice -- including evicting more than needed -- finds the true minimum number of
misses, and Belady must equal it. An implementation that lets a call evict an expert it needs
itself, counts duplicates or padding, or breaks ties in a way that matters, comes out below or
above that minimum. LRU (the cache's own policy, simulated here with its (usage, slot) victim
rule) bounds Belady from above.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_cache.sizing.bounds import belady, oracle_slots_for, stationary_oracle
from pallas_cache.sizing.synthetic import PRESETS, SyntheticParams, synthetic_trace
from pallas_cache.sizing.traces import Trace

# ---- independent simulators (test-only) ------------------------------------------------------


from exhaustive import distinct_calls, exhaustive_min_misses, textbook_belady  # noqa: E402


def brute_force_min_misses(trace: Trace, cache_size: int) -> int:
    """The fewest misses over every schedule that keeps each call's experts resident."""
    return exhaustive_min_misses(trace, cache_size, bypass=False)


def lru_misses(trace: Trace, cache_size: int) -> int:
    """The cache's pure-offload ``ensure`` (docs/semantics.md §5.2): misses counted the same way."""
    usage = [0] * cache_size
    occupant = [-1] * cache_size
    slot_of: dict[int, int] = {}
    missing = 0
    for step, need in enumerate(distinct_calls(trace), start=1):
        for flat in need:
            if flat in slot_of:
                usage[slot_of[flat]] = step
        misses = sorted(need - slot_of.keys())
        victims = sorted((usage[s], s) for s in range(cache_size) if usage[s] != step)
        for flat, (_, slot) in zip(misses, victims):
            if occupant[slot] >= 0:
                del slot_of[occupant[slot]]
            occupant[slot], slot_of[flat], usage[slot] = flat, slot, step
        missing += len(misses)
    return missing


def straightforward_belady_misses(trace: Trace, cache_size: int) -> int:
    """Belady by the book: at each eviction, scan every evictable resident for its next use."""
    return textbook_belady(trace, cache_size)[0]


@st.composite
def tiny_traces(draw, max_ids=6, max_calls=8, max_top_k=3):
    num_layers = draw(st.integers(1, 3))
    num_experts = draw(st.integers(1, max(1, max_ids // num_layers)))
    top_k = draw(st.integers(1, max_top_k))
    calls = draw(st.integers(1, max_calls))
    layers = draw(st.lists(st.integers(0, num_layers - 1), min_size=calls, max_size=calls))
    routes = draw(st.lists(st.lists(st.integers(-1, num_experts - 1), min_size=top_k,
                                    max_size=top_k), min_size=calls, max_size=calls))
    cache_size = draw(st.integers(num_experts, num_layers * num_experts))
    trace = Trace(routes=routes, layers=layers, num_layers=num_layers, num_experts=num_experts)
    return trace, cache_size


# ---- optimality -------------------------------------------------------------------------------


@given(tiny_traces())
def test_belady_equals_the_exhaustive_minimum(case):
    trace, cache_size = case
    result = belady(trace, cache_size)
    assert result.missing == brute_force_min_misses(trace, cache_size)
    assert result.active == sum(len(c) for c in distinct_calls(trace))


@pytest.mark.usefixtures("optima_loop")
def test_belady_equals_the_exhaustive_minimum_on_a_crowded_enumeration():
    # Deterministic sweep of the tightest geometry (2 layers x 3 experts, S = 3 and 4), so the
    # check does not depend on what hypothesis happens to draw.
    rng = np.random.default_rng(0)
    for _ in range(60):
        calls = int(rng.integers(3, 9))
        trace = Trace(routes=rng.integers(-1, 3, size=(calls, 3)),
                      layers=rng.integers(0, 2, size=calls), num_layers=2, num_experts=3)
        for cache_size in (3, 4, 5):
            assert belady(trace, cache_size).missing == brute_force_min_misses(trace, cache_size)


@given(tiny_traces(max_ids=24, max_calls=60, max_top_k=4))
def test_belady_never_misses_more_than_lru_and_is_monotone_in_cache_size(case):
    trace, cache_size = case
    result = belady(trace, cache_size)
    assert result.missing <= lru_misses(trace, cache_size)
    if cache_size > trace.num_experts:
        assert belady(trace, cache_size - 1).missing >= result.missing
    # Compulsory misses: each id's first use misses under any policy.
    assert result.missing >= len(set().union(*distinct_calls(trace)))


@pytest.mark.usefixtures("optima_loop")
@given(tiny_traces(max_ids=24, max_calls=300, max_top_k=4))
def test_belady_matches_the_textbook_scan_on_longer_traces(case):
    # Long enough that the heap is compacted (stale entries dropped) several times; the
    # mixtral-like preset case below compacts it too.
    trace, cache_size = case
    assert belady(trace, cache_size).missing == straightforward_belady_misses(trace, cache_size)


@pytest.mark.parametrize("name,tokens,sizes", [("mixtral-like", 150, (8, 20, 40, 128)),
                                               ("fine-grained", 10, (128, 600))])
@pytest.mark.usefixtures("optima_loop")
def test_belady_matches_the_textbook_scan_on_presets(name, tokens, sizes):
    trace = synthetic_trace(name, num_tokens=tokens, seed=2)
    for cache_size in sizes:
        assert belady(trace, cache_size).missing == \
            straightforward_belady_misses(trace, cache_size), cache_size


@pytest.mark.parametrize("name,tokens,sizes", [("mixtral-like", 120, (8, 24, 96)),
                                               ("fine-grained", 40, (128, 640))])
def test_belady_beats_lru_on_presets(name, tokens, sizes):
    trace = synthetic_trace(name, num_tokens=tokens, seed=5)
    for cache_size in sizes:
        optimal, lru = belady(trace, cache_size).missing, lru_misses(trace, cache_size)
        assert optimal < lru, (cache_size, optimal, lru)


# ---- hand-checked examples --------------------------------------------------------------------


@pytest.mark.usefixtures("optima_loop")
def test_a_call_never_evicts_an_expert_it_needs():
    # L=2, E=2, S=2.  A = (0,0), B = (0,1), X = (1,0).
    # call 0: X     miss               pool {X}
    # call 1: A     miss               pool {X, A}
    # call 2: A, B  A hit, B miss. A is never used again (furthest), but the call needs it:
    #               X must go.         pool {A, B}
    # call 3: X     miss               -> 4 misses. Evicting A at call 2 would give 3.
    trace = Trace(routes=[[0, -1], [0, -1], [0, 1], [0, -1]], layers=[1, 0, 0, 1],
                  num_layers=2, num_experts=2)
    result = belady(trace, 2)
    assert (result.active, result.missing) == (5, 4)
    assert result.layer_missing.tolist() == [2, 2]


@pytest.mark.usefixtures("optima_loop")
def test_furthest_next_use_is_evicted_not_the_least_recent():
    # L=3, E=1, S=2: flat ids 0, 1, 2 (one expert per layer). Layers called: 0 1 2 0 1 0 1 0 2.
    # Belady at call 2 (pool {0,1}, next uses 0->3, 1->4) evicts 1; at call 4 (pool {0,2}:
    # 0->5, 2->8) evicts 2; at call 8 evicts 0 or 1 (neither is used again).
    # Misses: calls 0, 1, 2 (compulsory) + 4 + 8 = 5.
    # LRU evicts the least recent instead: misses at calls 0, 1, 2, 3, 4, 8 = 6.
    layers = [0, 1, 2, 0, 1, 0, 1, 0, 2]
    trace = Trace(routes=[[0]] * len(layers), layers=layers, num_layers=3, num_experts=1)
    assert belady(trace, 2).missing == 5
    assert lru_misses(trace, 2) == 6


def test_counting_ignores_padding_and_duplicates_and_keeps_empty_calls():
    trace = Trace(routes=[[1, 1, -1], [-1, -1, -1], [1, 0, 0]], layers=[0, 0, 0],
                  num_layers=1, num_experts=2)
    result = belady(trace, 2)
    assert (result.calls, result.active, result.missing) == (3, 3, 2)
    assert result.layer_calls.tolist() == [3]
    assert result.hit_rate == pytest.approx(1 - 2 / 3)
    assert result.miss_rate == pytest.approx(2 / 3)


def test_per_layer_counters_sum_to_the_global_ones_and_rates_default_to_zero_miss():
    trace = synthetic_trace(SyntheticParams(num_layers=4, num_experts=8, top_k=2,
                                            num_tokens=50, skew=0.5, reuse=0.3), seed=4)
    padded = Trace(routes=np.vstack([trace.routes, [[-1, -1]]]),
                   layers=np.append(trace.layers, 0), num_layers=5, num_experts=8)
    result = belady(padded, 16)
    assert result.layer_missing.sum() == result.missing
    assert result.layer_active.sum() == result.active
    assert result.layer_calls.sum() == result.calls == padded.num_calls
    assert result.layer_active[4] == 0 and result.layer_miss_rate[4] == 0.0
    assert result.layer_hit_rate[4] == 1.0


def test_a_pool_holding_everything_misses_only_compulsorily():
    trace = synthetic_trace("mixtral-like", num_tokens=100, seed=1)
    result = belady(trace, 32 * 8)
    assert result.missing == len(np.unique(trace.flat_ids()))  # each id once


def test_array_input_matches_trace_input():
    trace = synthetic_trace(SyntheticParams(num_layers=3, num_experts=6, top_k=2, num_tokens=60,
                                            reuse=0.2), seed=9)
    from_trace = belady(trace, 7)
    from_arrays = belady(trace.to_array(), 7, num_experts=6)
    assert (from_arrays.missing, from_arrays.active) == (from_trace.missing, from_trace.active)


def test_belady_refuses_bad_arguments():
    trace = Trace(routes=[[0, 1]], layers=[0], num_layers=1, num_experts=4)
    with pytest.raises(ValueError, match=r"cache_size must be an integer >= num_experts=4"):
        belady(trace, 3)
    with pytest.raises(ValueError, match="contradicts the trace's num_experts=4"):
        belady(trace, 4, num_experts=5)
    with pytest.raises(ValueError, match=r"expert 4 is outside \[-1, 4\)"):
        belady(([0], [[4]]), 4, num_experts=4)
    with pytest.raises(ValueError, match="routes must be >= -1"):
        belady(([0], [[-2]]), 4)


# ---- the stationary oracle --------------------------------------------------------------------


@pytest.mark.parametrize("cache_size,num_layers,expected", [
    (5, 2, 3),    # 2.5 -> 3 (half away from zero; half-to-even would give 2)
    (7, 2, 4),    # 3.5 -> 4
    (3, 2, 2),    # 1.5 -> 2
    (1, 4, 1),    # 0.25 -> 0 -> at least 1
    (10, 4, 3),   # 2.5 -> 3
    (9, 4, 2),    # 2.25 -> 2
    (256, 32, 8),
])
def test_oracle_slots_round_half_away_from_zero(cache_size, num_layers, expected):
    assert oracle_slots_for(cache_size, num_layers) == expected


def test_stationary_oracle_hand_counted():
    # L=2, E=4, S=5 -> 2.5 slots per layer -> 3 oracle slots.
    # Layer 0 routes (duplicates counted): e0 x3, e1 x2, e2 x1, e3 x2 -> top 3 = 3+2+2 = 7 of 8.
    # Layer 1: never routed -> absent (the mean is over layer 0 only).
    trace = Trace(routes=[[0, 0], [0, 1], [1, 2], [3, 3], [-1, -1]], layers=[0, 0, 0, 0, 1],
                  num_layers=2, num_experts=4)
    oracle = stationary_oracle(trace, 5)
    assert oracle.slots_per_layer == 2.5 and oracle.oracle_slots == 3
    assert oracle.routed_layers.tolist() == [0]
    assert oracle.hit_rate.tolist() == [pytest.approx(7 / 8)]
    assert oracle.mean_hit_rate == pytest.approx(7 / 8)
    assert stationary_oracle(trace, 4).mean_hit_rate == pytest.approx(5 / 8)  # 2 slots


def test_stationary_oracle_reflects_skew():
    flat = synthetic_trace("mixtral-like", num_tokens=400, seed=0)
    skewed = synthetic_trace(dataclasses.replace(PRESETS["mixtral-like"], skew=2.5),
                             num_tokens=400, seed=0)
    assert stationary_oracle(skewed, 64).mean_hit_rate > stationary_oracle(flat, 64).mean_hit_rate
    assert stationary_oracle(flat, 256).mean_hit_rate == 1.0
    with pytest.raises(ValueError, match="cache_size must be a positive integer"):
        stationary_oracle(flat, 0)
