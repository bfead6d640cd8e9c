"""The bypass optimum (and Belady) against exhaustive searches, textbook versions and replays.

The exhaustive searches try every schedule the cache's model allows on tiny traces: for pure
offload every miss is admitted and any subset of the residents the call does not route may be
evicted; with bypass, in addition, any subset of the misses may be left out, while the call's
hits stay (the cache never evicts an expert the same call routes). The textbook versions are
set-based transcriptions of the two rules of docs/semantics.md §5.14, run with a tiny chunk size
so the lean loop crosses many chunk boundaries. The replay property closes the loop: no row of
any policy beats the bypass optimum, no ``full`` row beats Belady.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_cache.sizing import Trace, belady, bypass_optimum, config_grid, replay
from pallas_cache.sizing import bounds as bounds_module
from pallas_cache.sizing.bounds import BypassOptimumResult
from pallas_cache.sizing.synthetic import SyntheticParams, synthetic_trace

# ---- independent versions (test-only) ---------------------------------------------------------

from exhaustive import distinct_calls, exhaustive_min_misses, textbook_belady  # noqa: E402



def textbook_bypass(trace: Trace, cache_size: int) -> tuple[int, list[int]]:
    """docs/semantics.md §5.14's rule, set by set: ``(missing, missing per layer)``."""
    calls = distinct_calls(trace)
    uses: dict[int, list[int]] = {}
    for index, need in enumerate(calls):
        for flat in need:
            uses.setdefault(flat, []).append(index)

    resident: set[int] = set()
    layer_missing = [0] * trace.num_layers
    for index, (need, layer) in enumerate(zip(calls, trace.layers.tolist())):
        hits, misses = need & resident, need - resident
        layer_missing[layer] += len(misses)
        # Rank by the whole sequence of later uses (never again = infinitely far), then flat id.
        ranked = sorted((tuple(later) + (math.inf,), flat)
                        for flat in (resident - need) | misses
                        for later in [uses[flat][bisect.bisect_right(uses[flat], index):]]
                        if later)
        resident = set(hits) | {flat for _, flat in ranked[:cache_size - len(hits)]}
    return sum(layer_missing), layer_missing


def random_trace(rng: np.random.Generator, max_ids: int, max_calls: int,
                 max_top_k: int) -> tuple[Trace, int]:
    num_layers = int(rng.integers(1, 4))
    num_experts = int(rng.integers(1, max(1, max_ids // num_layers) + 1))
    top_k = int(rng.integers(1, max_top_k + 1))
    calls = int(rng.integers(1, max_calls + 1))
    trace = Trace(routes=rng.integers(-1, num_experts, size=(calls, top_k)),
                  layers=rng.integers(0, num_layers, size=calls),
                  num_layers=num_layers, num_experts=num_experts)
    return trace, int(rng.integers(num_experts, num_layers * num_experts + 1))


# ---- optimality against exhaustive search -----------------------------------------------------


@pytest.mark.usefixtures("optima_loop")
def test_both_optima_equal_the_exhaustive_minimum_on_thousands_of_tiny_traces():
    """FAILS if the bypass rule admits per miss instead of per call, may drop a call's hits,
    keeps never-used-again items, or if Belady lets a call evict its own experts."""
    rng = np.random.default_rng(13)
    for _ in range(2500):
        trace, cache_size = random_trace(rng, max_ids=6, max_calls=7, max_top_k=3)
        bypass = bypass_optimum(trace, cache_size)
        assert bypass.missing == exhaustive_min_misses(trace, cache_size, bypass=True)
        assert belady(trace, cache_size).missing == \
            exhaustive_min_misses(trace, cache_size, bypass=False)
        assert bypass.active == sum(len(call) for call in distinct_calls(trace))


@pytest.mark.usefixtures("optima_loop")
def test_bypass_optimum_equals_the_exhaustive_minimum_on_longer_traces():
    """FAILS if ties on the next use are broken by flat id alone (docs/semantics.md §5.14)."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        num_layers = int(rng.integers(1, 3))
        num_experts = int(rng.integers(1, 4 // num_layers + 1))
        calls = int(rng.integers(10, 41))
        trace = Trace(routes=rng.integers(-1, num_experts, size=(calls, int(rng.integers(1, 4)))),
                      layers=rng.integers(0, num_layers, size=calls),
                      num_layers=num_layers, num_experts=num_experts)
        for cache_size in range(num_experts, num_layers * num_experts):
            assert bypass_optimum(trace, cache_size).missing == \
                exhaustive_min_misses(trace, cache_size, bypass=True)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_bypass_optimum_equals_the_exhaustive_minimum(seed):
    trace, cache_size = random_trace(np.random.default_rng(seed), max_ids=7, max_calls=9,
                                     max_top_k=3)
    assert bypass_optimum(trace, cache_size).missing == \
        exhaustive_min_misses(trace, cache_size, bypass=True)


# ---- the lean loop against the textbook versions ----------------------------------------------


@pytest.mark.usefixtures("optima_loop")
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_lean_loops_match_the_textbook_rules_layer_by_layer(chunk, monkeypatch):
    """FAILS if a chunk boundary drops or repeats accesses, an entry the loop skips as settled
    could have been evicted, a call's own entry is popped as a victim, or stale entries are
    popped after a compaction (traces long enough for several)."""
    monkeypatch.setattr(bounds_module, "_CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    for _ in range(120):
        trace, cache_size = random_trace(rng, max_ids=30, max_calls=400, max_top_k=5)
        lean_belady, lean_bypass = belady(trace, cache_size), bypass_optimum(trace, cache_size)
        missing, per_layer = textbook_belady(trace, cache_size)
        assert lean_belady.missing == missing
        assert lean_belady.layer_missing.tolist() == per_layer
        missing, per_layer = textbook_bypass(trace, cache_size)
        assert lean_bypass.missing == missing
        assert lean_bypass.layer_missing.tolist() == per_layer
        assert lean_bypass.missing <= lean_belady.missing


@pytest.mark.parametrize("name,tokens,sizes", [("mixtral-like", 200, (8, 24, 64, 200)),
                                               ("fine-grained", 24, (128, 700, 2000))])
@pytest.mark.usefixtures("optima_loop")
def test_lean_loops_match_the_textbook_rules_on_presets(name, tokens, sizes):
    """FAILS if the settled-access shortcut or the heap compaction changes a decision on a
    realistic trace (many settled accesses at the large sizes, many evictions at the small)."""
    trace = synthetic_trace(name, num_tokens=tokens, seed=3)
    for cache_size in sizes:
        assert belady(trace, cache_size).layer_missing.tolist() == \
            textbook_belady(trace, cache_size)[1], cache_size
        assert bypass_optimum(trace, cache_size).layer_missing.tolist() == \
            textbook_bypass(trace, cache_size)[1], cache_size


@pytest.mark.usefixtures("optima_loop")
def test_long_traces_cross_chunk_boundaries(monkeypatch):
    """FAILS if the default chunking loses or repeats accesses where a chunk is cut."""
    trace = synthetic_trace(SyntheticParams(num_layers=6, num_experts=16, top_k=4,
                                            num_tokens=6000, skew=0.8, reuse=0.4), seed=1)
    assert (trace.routes >= 0).sum() > 2 * bounds_module._CHUNK
    chunked = [(belady(trace, size).layer_missing.tolist(),
                bypass_optimum(trace, size).layer_missing.tolist()) for size in (16, 40)]
    monkeypatch.setattr(bounds_module, "_CHUNK", 10**9)
    whole = [(belady(trace, size).layer_missing.tolist(),
              bypass_optimum(trace, size).layer_missing.tolist()) for size in (16, 40)]
    assert chunked == whole


def test_the_compiled_loop_is_kept_for_traces_worth_importing_numba_for(monkeypatch):
    """FAILS if a small trace pays for importing Numba (about 0.8 s, more than its Python loop
    takes), if a large one does not get the compiled loop, or if the variable is not obeyed."""
    pytest.importorskip("numba")
    monkeypatch.delenv(bounds_module.COMPILED_BOUNDS_ENV, raising=False)
    threshold = bounds_module._COMPILED_FROM
    assert bounds_module.compiled_loops(threshold - 1) is None
    assert bounds_module.compiled_loops(threshold) is not None
    monkeypatch.setenv(bounds_module.COMPILED_BOUNDS_ENV, "1")
    assert bounds_module.compiled_loops(1) is not None
    monkeypatch.setenv(bounds_module.COMPILED_BOUNDS_ENV, "0")
    assert bounds_module.compiled_loops(10 * threshold) is None


# ---- hand-checked examples --------------------------------------------------------------------


@pytest.mark.usefixtures("optima_loop")
def test_bypass_keeps_a_hot_expert_where_belady_must_thrash():
    """FAILS if bypass_optimum admits every miss (it would equal Belady here)."""
    # L=2, E=1, S=1: ids a=0 (layer 0), b=1 (layer 1); calls a b a b a b.
    # Belady admits every miss: all 6 miss. Bypass keeps a (used sooner) and serves b without
    # admitting it: a misses once, b three times -> 4.
    layers = [0, 1, 0, 1, 0, 1]
    trace = Trace(routes=[[0]] * 6, layers=layers, num_layers=2, num_experts=1)
    assert belady(trace, 1).missing == 6
    result = bypass_optimum(trace, 1)
    assert isinstance(result, BypassOptimumResult)
    assert (result.active, result.missing) == (6, 4)
    assert result.layer_missing.tolist() == [1, 3]
    assert result.hit_rate == pytest.approx(2 / 6)


@pytest.mark.usefixtures("optima_loop")
def test_a_hit_keeps_its_slot_through_its_call_even_if_never_used_again():
    """FAILS if the bypass rule may drop a call's own hits (5 would become 4)."""
    # L=2, E=2, S=3; flat ids: layer 0 -> 0, 1; layer 1 -> 2, 3.
    # c0 layer 1 {2,3}: 2 misses, kept (used at c4).
    # c1 layer 0 {1}:   miss; room for all -> {1,2,3}.
    # c2 layer 0 {0,1}: 1 hits (never used again, yet it stays through c2); 0 misses and takes
    #                   one of the 2 other slots, ranked first (next use c3); of 2 and 3 (both
    #                   at c4) only one fits -> {0,1,2}.
    # c3 layer 0 {0}:   hit.  c4 layer 1 {2,3}: 3 misses -> 5 misses.
    # Dropping the hit 1 at c2 would keep both 2 and 3: 4 misses -- not a schedule the cache has.
    trace = Trace(routes=[[0, 1], [1, -1], [0, 1], [0, -1], [0, 1]], layers=[1, 0, 0, 0, 1],
                  num_layers=2, num_experts=2)
    assert bypass_optimum(trace, 3).missing == 5
    assert exhaustive_min_misses(trace, 3, bypass=True) == 5


@pytest.mark.usefixtures("optima_loop")
def test_ids_tied_on_next_use_are_ranked_by_their_later_uses():
    """FAILS if tied candidates are ranked by flat id alone (8 misses instead of 7)."""
    # L=2, E=2, S=2; flat ids: layer 0 -> 0, 1; layer 1 -> 2, 3. Calls (distinct ids):
    # c0 {0,1}  c1 {2}  c2 {2}  c3 {3}  c4 {0,1}  c5 {1}  c6 {2,3}  c7 {}  c8 {2}  c9 {0,1}
    # At c1 the pool holds 0 and 1, both next used at c4, and 2 (next c2) takes one slot. 1 is
    # used again at c5, 0 only at c9: keeping 1 makes c5 a hit. Keeping 0 (the lower flat id)
    # costs that hit and nothing is gained back: 8 misses.
    trace = Trace(routes=[[1, 0], [0, -1], [0, -1], [1, -1], [0, 1], [1, -1], [0, 1],
                          [-1, -1], [0, -1], [1, 0]],
                  layers=[0, 1, 1, 1, 0, 0, 1, 0, 1, 0], num_layers=2, num_experts=2)
    assert exhaustive_min_misses(trace, 2, bypass=True) == 7
    assert bypass_optimum(trace, 2).missing == 7


@pytest.mark.usefixtures("optima_loop")
def test_a_tie_can_reach_past_the_use_after_next():
    """FAILS if ties on the next use are broken only by the use after it (10 misses, not 9).

    Found by comparing that rule with the exhaustive search on random 39-call traces; ranking
    by the whole sequence of later uses agrees with the search here and on thousands more.
    """
    layers = [1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 1, 0, 1, 0, 1, 1,
              1, 0, 1, 0, 0, 0, 1, 1, 0, 0, 1, 0]
    routes = [[1, -1], [1, -1], [1, 0], [0, -1], [-1, 0], [1, -1], [-1, 0], [1, 0], [-1, 1],
              [0, 1], [1, 0], [1, 1], [1, 1], [1, 0], [0, 1], [0, 0], [-1, -1], [1, 0],
              [1, -1], [1, 0], [1, -1], [-1, -1], [1, 1], [1, -1], [1, 1], [-1, 0], [0, 0],
              [-1, 1], [0, 0], [1, 0], [1, 0], [-1, -1], [0, -1], [0, 1], [0, -1], [-1, 1],
              [1, 0], [-1, 1], [1, -1]]
    trace = Trace(routes=routes, layers=layers, num_layers=2, num_experts=2)
    assert exhaustive_min_misses(trace, 3, bypass=True) == 9
    assert bypass_optimum(trace, 3).missing == 9


def test_bypass_counting_matches_belady_counting():
    trace = Trace(routes=[[1, 1, -1], [-1, -1, -1], [1, 0, 0]], layers=[0, 0, 0],
                  num_layers=1, num_experts=2)
    result = bypass_optimum(trace, 2)
    assert (result.calls, result.active, result.missing) == (3, 3, 2)
    assert result.layer_calls.tolist() == [3]
    assert "BypassOptimumResult(cache_size=2" in repr(result)


def test_bypass_optimum_refuses_bad_arguments():
    trace = Trace(routes=[[0, 1]], layers=[0], num_layers=1, num_experts=4)
    with pytest.raises(ValueError, match=r"cache_size must be an integer >= num_experts=4"):
        bypass_optimum(trace, 3)
    with pytest.raises(ValueError, match="contradicts the trace's num_layers=1"):
        bypass_optimum(trace, 4, num_layers=2)
    array_form = bypass_optimum(trace.to_array(), 4, num_experts=4)
    assert (array_form.active, array_form.missing) == (2, 2)


# ---- the bound property over replays ----------------------------------------------------------

POLICIES = ("full", "fraction:0.25", "fraction:0.6", "cap:0", "cap:1")
ORDERS = ("recency", "lowest_id")
ADMISSIONS = ("promote_one", "none", "reuse")


def sweep_trace(rng: np.random.Generator, calls: int) -> Trace:
    """L=3, E=3, top-2: a cyclic layer sweep (where LRU thrashes) or random layers, with reuse."""
    layers = np.arange(calls) % 3 if rng.random() < 0.5 else rng.integers(0, 3, size=calls)
    routes = rng.integers(-1, 3, size=(calls, 2))
    hot = rng.integers(0, 3, size=3)
    keep = rng.random(calls) < rng.uniform(0.2, 0.9)
    routes[keep, 0] = hot[layers[keep]]  # a per-layer favourite: the reuse a bound can bank
    return Trace(routes=routes, layers=layers, num_layers=3, num_experts=3)


def test_no_replayed_row_beats_its_bound():
    """FAILS if bypass_optimum were Belady's pure-offload optimum (hybrid rows beat that), or
    if either optimum under-counts what a real policy achieves."""
    rng = np.random.default_rng(2024)
    beat_belady = 0
    for _ in range(12):
        trace = sweep_trace(rng, calls=int(rng.integers(20, 60)))
        for cache_size in (3, 5):
            rows = replay(trace, config_grid([cache_size], POLICIES, ORDERS, ADMISSIONS),
                          chunk_calls=64, bounds=False, progress=lambda status: None)
            pure = belady(trace, cache_size).hit_rate
            bypass = bypass_optimum(trace, cache_size).hit_rate
            assert pure <= bypass
            for row in rows:
                assert row.hit_rate <= bypass + 1e-12, row
                if row.policy == "full":
                    assert row.hit_rate <= pure + 1e-12, row
                beat_belady += row.hit_rate > pure
    assert beat_belady > 0  # the property is not vacuous: hybrid rows do beat Belady
