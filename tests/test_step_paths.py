"""The step's size-dependent formulations against the NumPy reference.

``ops.ensure_with_rules`` and ``selection.first_in_order`` pick a formulation by static size: the
histogram row and the fetch-order list are masked sums up to ``ops._MASKED_SUM_MAX`` compared
pairs and scatters above it, and the victim search over a pool of more than 256 slots goes
through the two-level search of presorted groups. The lockstep geometries are small and reach
only the first of each, so one geometry here reaches the others: many routes per call (a scatter
for the histogram and for the LOWEST_ID list), RECENCY over ``first_in_order``, and a pool of 300
slots. Plans and whole states are compared after every call.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ADAPTER, assert_same_plan, assert_same_state

L, E, S, K = 2, 128, 300, 64  # K * E and 64 * E above the masked-sum limit, S above 256
RULES = (None, ("recency", "promote_one"), ("recency", "reuse"), ("lowest_id", "none"))


@pytest.mark.parametrize("name", ["jax-jit"])
def test_large_call_paths_match_the_reference(name):
    """FAILS if the scatter fallbacks (histogram, LOWEST_ID list), the RECENCY order through
    first_in_order, or the two-level victim search differ from the reference in any plan or state
    field."""
    jax_side, ref_side = ADAPTER[name], ADAPTER["reference"]
    cache, ref = jax_side.init(L, E, S), ref_side.init(L, E, S)
    rng = np.random.default_rng(11)
    for t in range(48):
        layer = int(rng.integers(0, L))
        hot = int(rng.integers(8, E + 1))
        routes = rng.integers(-1, hot, K).astype(np.int32)  # duplicates and padding included
        rules = RULES[t % len(RULES)]
        context = f"call {t}, rules {rules}, layer {layer}, routes {routes.tolist()}"
        if rules is None:
            plan, expected = cache.ensure(layer, routes), ref.ensure(layer, routes)
        else:
            fraction = (0.0, 0.4, 1.0)[t % 3]
            plan = cache.ensure_hybrid(layer, routes, jax_side.Policy.fraction(fraction),
                                       order=rules[0], admission=rules[1])
            expected = ref.ensure_hybrid(layer, routes, ref_side.Policy.fraction(fraction),
                                         order=rules[0], admission=rules[1])
        assert_same_plan(plan, expected, context)
        assert_same_state(cache.state, ref.state, context)
