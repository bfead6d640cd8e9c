"""The ring evictions' first-use loop in the fused kernel (docs/design.md, "The ring in the
kernel"): its rounds bounded by the neighbours' ages, the rounds past them as one multiply-add,
the same integers as the XLA step's, at 8 mask words per layer (E = 256) and at 2 (E = 40)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_cache as pc
from pallas_cache.kernels import ring as token_ring
from tests.harness import scan_against_xla


class _CountingLax:
    """``jax.lax`` with the trip count of every ``first_uses`` loop reported at run time (the
    interpreter runs the callback with the traced bound's value)."""

    def __init__(self, trips):
        self.trips = trips

    def __getattr__(self, name):
        return getattr(lax, name)

    def fori_loop(self, lower, upper, body, init, **kwargs):
        if getattr(body, "__name__", "") == "first_uses":
            jax.debug.callback(lambda n: self.trips.append(int(n)), upper - lower)
        return lax.fori_loop(lower, upper, body, init, **kwargs)


# (eviction, L, E, S, W, tokens, routes per call): the horizon H = ceil(S / L) above the ring
# (H = 128, W = 4: every neighbour's rounds end at its age, the rest is the closed-form tail;
# 8 mask words a layer) and below it (H = 3, W = 8: the rounds end at H; 2 mask words).
CASES = [("route_knn", 2, 256, 256, 4, 40, 8), ("route_lfu", 16, 40, 48, 8, 6, 3)]


@pytest.mark.parametrize("eviction,L,E,S,W,tokens,k", CASES)
def test_the_first_use_loop_runs_at_most_min_h_w_rounds_and_equals_the_xla_step(
        eviction, L, E, S, W, tokens, k, monkeypatch):
    """FAILS if a call's first-use loop runs more than ``min(H, W - 1)`` rounds (it ran
    ``H`` rounds per neighbour, ``3 * ceil(S / L)`` in all, before its bound), or if the
    bounded loop and its closed-form tail change a counter: whole states and plans equal the
    XLA step's over a run of whole tokens that turns the pool over."""
    trips = []
    monkeypatch.setattr(token_ring, "lax", _CountingLax(trips))
    rng = np.random.default_rng(S)
    layers = np.tile(np.arange(L, dtype=np.int32), tokens)
    layers[L + 1] = 0  # a token cut short
    routes = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in layers]), jnp.int32)
    state = pc.init(L, E, S, eviction=eviction, history=W)
    ours, theirs = scan_against_xla(state, layers, routes)
    for i, (x, y) in enumerate(zip(jax.tree.leaves(ours), jax.tree.leaves(theirs))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"leaf {i}")
    horizon = -(-S // L)
    assert max(trips) <= min(horizon, W - 1), trips
    assert len(trips) == len(layers), trips  # one loop per call
    assert max(trips) > 0, trips  # the calls searched, with neighbours
    assert int(np.sum(np.asarray(theirs[1].copy.count))) > S  # the pool turned over
