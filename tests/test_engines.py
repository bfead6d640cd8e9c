"""Routing from engines: router logits -> trace arrays, equal to jax.lax.top_k ties included."""

import jax
import numpy as np
import pytest

from pallas_cache.sizing import Trace, routes_from_router_logits


def test_router_logits_pick_what_jax_lax_top_k_picks_ties_included():
    """FAILS if the selection or its order differs from jax.lax.top_k on logits full of ties
    (an unstable or ascending sort puts the higher index first), or the layout is not
    [tokens, layers, top_k] int32."""
    rng = np.random.default_rng(0)
    tokens, layers, experts, k = 37, 3, 16, 4
    per_layer = [rng.integers(-3, 4, (tokens, experts)).astype(np.float32) for _ in range(layers)]
    routes = routes_from_router_logits(per_layer, k)
    assert routes.dtype == np.int32 and routes.shape == (tokens, layers, k)
    for layer, logits in enumerate(per_layer):
        _, expected = jax.lax.top_k(logits, k)
        np.testing.assert_array_equal(routes[:, layer, :], np.asarray(expected))
    # The same from one stacked [layers, tokens, E] array, and as a replayable trace.
    np.testing.assert_array_equal(routes_from_router_logits(np.stack(per_layer), k), routes)
    trace = Trace.from_dense(routes, num_experts=experts)
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (layers, experts, k)


def test_router_logits_misuse_names_the_shapes():
    """FAILS if mismatched layers, a bad top_k or NaN logits pass silently."""
    good = np.zeros((5, 8), np.float32)
    with pytest.raises(ValueError, match=r"layer 1 have shape \(4, 8\), layer 0 has \(5, 8\)"):
        routes_from_router_logits([good, np.zeros((4, 8))], 2)
    with pytest.raises(ValueError, match=r"top_k=9 is outside \[1, num_experts=8\]"):
        routes_from_router_logits([good], 9)
    with pytest.raises(TypeError, match="top_k must be an int"):
        routes_from_router_logits([good], 2.0)
    with pytest.raises(ValueError, match="expected \\[tokens, num_experts\\], got shape \\(8,\\)"):
        routes_from_router_logits([np.zeros(8)], 2)
    bad = good.copy()
    bad[2, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        routes_from_router_logits([bad], 2)
