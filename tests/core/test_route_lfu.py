"""ROUTE_LFU, the eviction that ranks by ring frequency and predicted next use
(docs/semantics.md §5.16): its lockstep with the reference (eager and jitted) and its rules
(protection before the score, the previous token's pair protected, frequency before a nearer
predicted use, next use between equal frequencies, the current token's routes counted)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.harness import deep_only, examples, slot_of, valid
from tests.lockstep.test_lockstep import run_lockstep


# ---- ROUTE_LFU -----------------------------------------------------------------------------

ROUTE_LFU = "route_lfu"


@deep_only  # the fused kernel's lockstep below runs every op; the XLA step: test_lockstep
@examples(0.2, ci=0.16)
@given(data=st.data())
def test_route_lfu_eager_matches_the_reference_after_every_step(data):
    """FAILS if any op, ``start_token`` included, disagrees with the reference in any state
    field or plan field under ROUTE_LFU (its ring is ROUTE_KNN's; its ranking reads the ring's
    frequencies, the latest pair of each layer and the predicted next use)."""
    run_lockstep(data, "jax-eager", eviction=ROUTE_LFU)


@deep_only  # the fused kernel's lockstep below runs every op; the XLA step: test_lockstep
@examples(0.2, ci=0.16)
@given(data=st.data())
def test_route_lfu_jitted_matches_the_reference_after_every_step(data):
    """As above, every op under an outer jit with a traced layer/slot."""
    run_lockstep(data, "jax-jit", eviction=ROUTE_LFU)


def _route_lfu_run(adapter, L, E, S, calls):
    cache = adapter.cache(L, E, S, eviction=ROUTE_LFU, history=8)
    for layer, experts in calls[:-1]:
        cache.ensure(layer, experts)
    return cache, cache.ensure(*calls[-1])


@pytest.mark.traced
@pytest.mark.kernels
def test_route_lfu_protection_outranks_the_score(adapter):
    """FAILS if ROUTE_LFU drops ``prot`` (ranks residents by ``L * F - NU`` alone): layer 0's
    expert 1, routed by this token, has the lowest score and would go.

    L=2, E=2, S=3; tokens 0-2 route expert 0 at both layers, token 3 routes expert 1 at layer 0
    (into the free slot 2), then a miss of layer 1. Keys ``(prot, L*F - NU)``: layer 0 expert 0
    ``(0, 2*3 - 7)``, layer 1 expert 0 ``(0, 2*3 - 10)``, layer 0 expert 1 ``(1, 2*1 - 9)``:
    the victim is layer 1's expert 0 in slot 1."""
    cache, plan = _route_lfu_run(adapter, 2, 2, 3, [(0, [0]), (1, [0])] * 3 + [(0, [1]), (1, [1])])
    assert valid(plan.copy, "dst_slots") == [1]
    assert slot_of(cache.state, 0, 1) == 2 and slot_of(cache.state, 0, 0) == 0


@pytest.mark.traced
@pytest.mark.kernels
def test_route_lfu_protects_the_previous_tokens_pair_of_a_layer_not_yet_called(adapter):
    """FAILS if ``prot`` reads this token's routes for every layer (``R[T, m]``, empty for the
    layers after the call) instead of the previous token's for ``m > l``: layer 1's expert 1,
    routed by token 2, has the lowest score ``2*1 - 9`` and would go at token 3's call of layer
    0. With it protected the victim is layer 0's expert 0 (``2*2 - 10 = -6`` against layer 1
    expert 0's ``2*2 - 7``), slot 2."""
    calls = [(0, [1]), (1, [0]), (0, [0]), (1, [0]), (0, [0]), (1, [1]), (0, [1])]
    cache, plan = _route_lfu_run(adapter, 2, 2, 3, calls)
    assert valid(plan.copy, "dst_slots") == [2]
    assert slot_of(cache.state, 1, 1) == 0


@pytest.mark.traced
@pytest.mark.kernels
def test_route_lfu_ring_frequency_outweighs_a_nearer_predicted_use(adapter):
    """FAILS if ROUTE_LFU ranks the unprotected residents by the predicted next use alone
    (ROUTE_KNN's order, ``-NU``): layer 0's expert 1 (routed by all three past tokens, ``F = 3``,
    ``NU = 10``) would go before layer 1's expert 1 (``F = 1``, ``NU = 9``); the scores are
    ``2*3 - 10 = -4`` and ``2*1 - 9 = -7``, so the rarer expert in slot 2 goes."""
    calls = [(0, [1]), (1, [0]), (0, [1]), (1, [1]), (0, [1]), (1, [2]), (0, [2])]
    cache, plan = _route_lfu_run(adapter, 2, 3, 3, calls)
    assert valid(plan.copy, "dst_slots") == [2]
    assert slot_of(cache.state, 0, 1) == 0


@pytest.mark.traced
@pytest.mark.kernels
def test_route_lfu_predicted_next_use_separates_equal_frequencies(adapter):
    """FAILS if ROUTE_LFU ranks by the ring frequency alone (``L * F``, then LRU): two
    unprotected residents routed once each tie on ``F``, and the older (slot 0, layer 0's expert
    1) would go; ``NU`` (5 for layer 0, the next layer called, 6 for layer 1) makes layer 1's
    expert 1 in slot 1 the victim (``2 - 6 < 2 - 5``)."""
    cache, plan = _route_lfu_run(adapter, 2, 3, 3, [(0, [1]), (1, [1]), (0, [0]), (1, [0])])
    assert valid(plan.copy, "dst_slots") == [1]
    assert slot_of(cache.state, 0, 1) == 0


@pytest.mark.traced
@pytest.mark.kernels
def test_route_lfu_frequency_counts_the_current_tokens_routes(adapter):
    """FAILS if ``F`` leaves out the current token ``T`` (counts only past tokens): it then no
    longer separates two protected residents. L=3, E=3, S=3; token 0 routes expert 0 at every
    layer, token 1 routes it at layer 0, then layer 1 misses experts 1 and 2. Victims: layer 1's
    expert 0 (unprotected), then the protected class: layer 0's expert 0 (``F = 2``, ``NU = 2``,
    score 4) stays, layer 2's expert 0 (``F = 1``, ``NU = 1``, score 2) goes; without ``T``
    the scores are 1 and 2 and slot 0 would go."""
    cache, plan = _route_lfu_run(adapter, 3, 3, 3,
                                 [(0, [0]), (1, [0]), (2, [0]), (0, [0]), (1, [1, 2])])
    assert valid(plan.copy, "dst_slots") == [1, 2]
    assert slot_of(cache.state, 0, 0) == 0

