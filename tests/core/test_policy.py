"""The fetch policy and its balanced split (docs/semantics.md §5.3), on every adapter
(:func:`split` evaluates the split for a whole array of miss counts)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cache as pc
from tests.harness import JITTED

_SPLIT = jax.jit(pc.FetchPolicy.split)


def split(adapter, policy, missing) -> np.ndarray:
    """``F`` for each ``M`` in ``missing`` (an int array), as the adapter computes it."""
    missing = np.asarray(missing)
    if not adapter.is_jax:
        return np.asarray([policy.split(int(m)) for m in missing.ravel()]).reshape(missing.shape)
    split = _SPLIT if adapter.ops is JITTED else pc.FetchPolicy.split
    return np.asarray(split(policy, jnp.asarray(missing, jnp.int32)))


def fraction16(policy) -> int:
    return int(np.asarray(policy.fraction16))


@pytest.mark.parametrize("q, missing, fetch", [
    (0.4, 1, 0), (0.415, 3, 1), (0.415, 4, 2), (0.415, 8, 3), (0.4, 8, 3), (0.4, 2, 1),
    (0.5, 1, 0), (1.0, 5, 5), (0.0, 5, 0),
])
def test_the_balanced_split_matches_the_worked_examples(adapter, q, missing, fetch):
    assert split(adapter, adapter.Policy.fraction(q), [missing]).tolist() == [fetch]


def test_the_split_has_no_minimum_of_one(adapter):
    """FAILS if the split is floored at one fetch: a single miss at q = 0.4 goes to the CPU."""
    assert split(adapter, adapter.Policy.fraction(0.4), [1]).tolist() == [0]


@pytest.mark.parametrize("q", [0.0, 0.01, 0.1, 0.25, 1 / 3, 0.4, 0.415, 0.5, 0.6, 0.77, 0.9, 0.999, 1.0])
def test_the_split_stays_within_one_of_q_times_m(adapter, q):
    # The bound holds for the fraction the policy holds, f / 65536; the requested q differs
    # from it by at most 2**-17, which adds at most M * 2**-17 (e.g. q = 0.01, M = 3701).
    policy = adapter.Policy.fraction(q)
    held = fraction16(policy) / 65536
    assert abs(held - q) <= 2**-17
    missing = np.arange(4097)
    fetch = split(adapter, policy, missing).astype(np.int64)
    assert ((0 <= fetch) & (fetch <= missing)).all()
    assert (np.abs(fetch - held * missing) <= 1).all(), q
    assert (np.abs(fetch - q * missing) <= 1 + missing * 2**-17).all()


def test_the_split_minimises_the_slower_side(adapter):
    """FAILS if F is plain rounding of q*M: the balanced choice minimises max(F(1-q), (M-F)q)."""
    for q in (0.3, 0.415, 0.7):
        policy = adapter.Policy.fraction(q)
        f = fraction16(policy)
        missing = np.arange(1, 200)
        fetch = split(adapter, policy, missing).astype(np.int64)
        for m, chosen in zip(missing.tolist(), fetch.tolist()):
            cost = lambda n: max(n * (65536 - f), (m - n) * f)  # noqa: E731
            assert cost(chosen) == min(cost(n) for n in range(m + 1)), (q, m)


def test_a_fraction_ignores_the_cap_and_the_cap_applies_only_at_zero_fraction(adapter):
    P = adapter.Policy
    assert split(adapter, P.fixed_cap(2), [8, 1]).tolist() == [2, 1]
    assert split(adapter, P.fixed_cap(0), [8]).tolist() == [0]
    assert split(adapter, P.fraction(0.0), [8]).tolist() == [0]
    assert split(adapter, P.full(), [8, 0]).tolist() == [8, 0]


def test_the_fraction_is_fixed_point_rounded_half_to_even_on_the_host(adapter):
    P, f16 = adapter.Policy, fraction16
    assert f16(P.fraction(0.5 / 65536)) == 0  # 0.5 -> 0 (even)
    assert f16(P.fraction(1.5 / 65536)) == 2  # 1.5 -> 2 (even)
    assert f16(P.fraction(2.5 / 65536)) == 2  # 2.5 -> 2 (even)
    assert f16(P.fraction(7.0)) == 65536, "clamped to one"
    assert f16(P.fraction(-0.1)) == 0, "clamped to zero (docs/semantics.md §5.3)"
    assert f16(P.fraction(float("inf"))) == 65536
    assert f16(P.fraction(float("-inf"))) == 0
    assert f16(P.fraction(np.float32(0.25))) == 16384
    assert f16(P.full()) == 65536


@pytest.mark.parametrize("bad, error", [
    (math.nan, ValueError), ("0.4", TypeError), (None, TypeError), (True, TypeError),
    (complex(0.4, 0), TypeError),
])
def test_a_fraction_that_is_not_a_number_is_refused(adapter, bad, error):
    with pytest.raises(error, match=re.escape(repr(bad))):
        adapter.Policy.fraction(bad)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_a_bad_cap_is_refused(adapter, bad, error):
    with pytest.raises(error, match=str(bad)):
        adapter.Policy.fixed_cap(bad)
