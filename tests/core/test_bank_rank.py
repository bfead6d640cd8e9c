"""A host bank of the other rank than ``layer=`` says (docs/semantics.md §5.13): a whole-model
bank ``[L, E, ...]`` given without ``layer=``, or one layer's bank ``[E, ...]`` given with it, is
named as such by ``apply_copy_plan``, ``cpu_partial`` and ``moe_hybrid``, not blamed on the
expert function's output shape or the plan's expert count."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import pallas_cache as pc
from pallas_cache.moe import apply_copy_plan

S, H = 12, 16


def _scale(weights, x):
    """An elementwise expert: any row shape broadcasts, so only the rank check can tell."""
    return weights * x


def _matmul(weights, x):
    return x @ weights


CALLS = {
    "apply_copy_plan": lambda pool, bank, plan, fn, **kw: apply_copy_plan(pool, bank, plan, **kw),
    "cpu_partial": lambda pool, bank, plan, fn, **kw: pc.cpu_partial(
        jnp.ones((1, H)), jnp.array([[0, 1]], jnp.int32), jnp.ones((1, 2)), plan, bank, fn, **kw),
    "moe_hybrid": lambda pool, bank, plan, fn, **kw: pc.moe_hybrid(
        jnp.ones((1, H)), jnp.array([[0, 1]], jnp.int32), jnp.ones((1, 2)), plan, pool, bank, fn,
        **kw),
}


def _setup(num_layers, num_experts, row):
    state = pc.init(num_layers, num_experts, S)
    _, plan = pc.ensure_hybrid(state, 3, jnp.array([[0, 1]], jnp.int32),
                               pc.FetchPolicy.fixed_cap(1))
    bank = jnp.ones((num_layers, num_experts, *row))
    return plan, bank, jnp.zeros((S, *row))


GEOMETRIES = [(8, 8, (H,), _scale), (4, 8, (H,), _scale), (8, 8, (H, H), _matmul),
              (6, 8, (H, H), _matmul)]


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("num_layers, num_experts, row, fn", GEOMETRIES)
def test_a_whole_model_bank_without_layer_is_named(name, num_layers, num_experts, row, fn):
    """FAILS if a whole-model bank passed without ``layer=`` is blamed on something else (the
    expert function's output shape ``[8, 256]``, the pool and bank rows differing): the error
    must say it is a whole-model bank and to pass ``layer=``."""
    plan, bank, pool = _setup(num_layers, num_experts, row)
    with pytest.raises(ValueError, match=r"whole-model bank \[L, E, \.\.\.\].*pass layer="):
        CALLS[name](pool, bank, plan, fn)


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("num_layers, num_experts, row, fn", GEOMETRIES)
def test_one_layers_bank_with_layer_is_named(name, num_layers, num_experts, row, fn):
    """FAILS if one layer's bank passed with ``layer=`` is blamed on the plan's expert count:
    the error must say ``layer=`` was given with a one-layer bank."""
    plan, bank, pool = _setup(num_layers, num_experts, row)
    with pytest.raises(ValueError, match=r"layer= was given, but .* one layer's bank \[E, \.\.\.\]"):
        CALLS[name](pool, bank[3], plan, fn, layer=3)


@pytest.mark.parametrize("name", list(CALLS))
def test_banks_of_the_right_rank_pass(name):
    """FAILS if the rank check refuses a correct call: a whole-model bank with ``layer=``, one
    layer's bank without it."""
    plan, bank, pool = _setup(8, 8, (H,))
    CALLS[name](pool, bank, plan, _scale, layer=3)
    CALLS[name](pool, bank[3], plan, _scale)
