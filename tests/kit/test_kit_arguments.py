"""The kit's records and checks name a bad argument when they are given one (TypeError for a
type, ValueError for a value), and the lazy package answers ``hasattr`` for any name."""

from __future__ import annotations

import math

import pytest

import pallas_cache as pc
from pallas_cache import testing as pt

GEOMETRY = pt.Geometry(num_layers=2, num_experts=4, cache_size=6, capacity=6)


@pytest.mark.parametrize("kind, value, error", [
    ("fraction", math.nan, ValueError), ("fraction", "0.4", TypeError),
    ("fraction", None, TypeError), ("fraction", True, TypeError),
    ("fixed_cap", -1, ValueError), ("fixed_cap", 1.5, TypeError), ("full", 3, ValueError),
])
def test_a_policy_spec_is_checked_when_made(kind, value, error):
    """FAILS if ``PolicySpec('fraction', nan)`` (or a string, None, a bool fraction; a negative
    or fractional cap) is accepted when made and fails only when built, far from where it was
    written: the constructor's own refusal, naming the spec."""
    with pytest.raises(error, match=rf"PolicySpec\('{kind}'"):
        pt.PolicySpec(kind, value)


@pytest.mark.parametrize("policy", [pc.FetchPolicy.fraction(0.4), 0.4, "fraction"],
                         ids=["fetch-policy", "float", "string"])
def test_an_ensure_hybrid_record_takes_a_policy_spec_only(policy):
    """FAILS if ``EnsureHybrid(0, (1, 2), pc.FetchPolicy.fraction(0.4))`` is made and fails in
    ``run_operation`` / ``assert_lockstep`` with "'FetchPolicy' object has no attribute
    'kind'": a TypeError naming the field and the PolicySpec to write."""
    with pytest.raises(TypeError, match=r"EnsureHybrid\.policy must be a PolicySpec"):
        pt.EnsureHybrid(0, (1, 2), policy)


@pytest.mark.parametrize("geometry", [(2, 4, 6, 8), None, {"num_layers": 2}])
def test_assert_lockstep_names_a_geometry_that_is_not_one(geometry):
    """FAILS if ``assert_lockstep(..., geometry=(2, 4, 6, 8))`` is an AttributeError: a
    TypeError naming ``geometry``."""
    with pytest.raises(TypeError, match=r"geometry must be a Geometry"):
        pt.assert_lockstep([pt.Ensure(0, (1, 2))], geometry=geometry)


def test_check_plan_and_check_state_name_an_argument_of_the_wrong_type():
    """FAILS if ``check_plan(s, 0, routes, (s2, plan), s2)`` or ``check_state(None)`` is an
    AttributeError: a TypeError naming the argument."""
    state = GEOMETRY.init()
    after, plan = pc.ensure(state, 0, [1, 2])
    with pytest.raises(TypeError, match=r"plan must be the EnsurePlan"):
        pt.check_plan(state, 0, [1, 2], (after, plan), after)
    with pytest.raises(TypeError, match=r"state_before must be a CacheState"):
        pt.check_plan(None, 0, [1, 2], plan, after)
    with pytest.raises(TypeError, match=r"state_after must be a CacheState"):
        pt.check_plan(state, 0, [1, 2], plan, plan)
    with pytest.raises(TypeError,
                       match=r"state must be a CacheState \(from pc\.init\), got NoneType"):
        pt.check_state(None)
    pt.check_plan(state, 0, [1, 2], plan, after)  # the right arguments still pass


@pytest.mark.parametrize("name", [".", "..x", "a.b", "no_such_name"])
def test_the_package_answers_hasattr_for_any_name(name):
    """FAILS if ``getattr(pc, ".")`` raises ``ModuleNotFoundError`` (the lazy ``__getattr__``
    tried to import ``pallas_cache.``), so ``hasattr(pc, ".")`` raises instead of False."""
    assert not hasattr(pc, name)
    with pytest.raises(AttributeError, match=r"has no attribute"):
        getattr(pc, name)
