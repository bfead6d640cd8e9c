"""The fused step kernel's victim order (docs/semantics.md §5.2 step 5, §7) in interpret mode
against plain NumPy, and the loop-free XLA victim search on long pools.

Every kernel call here runs the Pallas interpreter on the CPU, on a few fixed shapes so the
jitted calls compile once and hypothesis examples reuse them. The ``blocked`` variant forces a
small block, so the multi-block pool scan the GPU path uses for pools above 4096 slots runs on
the interpreter too. Each test names the naive implementation it catches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import pallas_cache as pc
from pallas_cache import selection
from pallas_cache.kernels import dispatch
from pallas_cache.kernels import step as fused
from pallas_cache.ops import Rules

I32_MIN = int(np.iinfo(np.int32).min)
I32_MAX = int(np.iinfo(np.int32).max)


def np_victims(usage, step, n, num_out):
    """First n evictable slots (usage != step) in ascending (usage, slot) order, -1 padded."""
    usage = np.asarray(usage, np.int64)
    evictable = [s for s in range(len(usage)) if usage[s] != step]
    order = sorted(evictable, key=lambda s: (usage[s], s))
    out = np.full(num_out, -1, np.int64)
    k = min(max(n, 0), num_out, len(order))
    out[:k] = order[:k]
    return out


# --------------------------------------------------------------------------------------------
# The fused kernel's victims: four misses of layer 0 take the first four victims
# --------------------------------------------------------------------------------------------

L, E, C = 2, 4, 8
_RULES = Rules.of(False, "lowest_id", "none")


@functools.cache
def _kernel_step(block):
    return jax.jit(lambda s, r: fused.fused_step(s, jnp.int32(0), r, pc.FetchPolicy.full(),
                                                 _RULES, interpret=True, block=block))


def _state_with_usage(usage, clock, cache_size):
    """Slots 0..3 hold layer 1's experts, the rest are empty; ``usage`` as given."""
    state = pc.init(L, E, cache_size, capacity=C)
    ids = np.full(C, -1, np.int32)
    ids[:E] = E + np.arange(E)
    slot_for_id = np.full((L, E), -1, np.int32)
    slot_for_id[1] = np.arange(E)
    return state.replace(id_of_slot=jnp.asarray(ids), slot_for_id=jnp.asarray(slot_for_id),
                         usage=jnp.asarray(usage, jnp.int32), step=jnp.int32(clock))


@given(clock=st.sampled_from([5, I32_MAX - 1]), block=st.sampled_from([None, 2]),
       cache_size=st.sampled_from([4, 6, 8]), data=st.data())
def test_the_kernel_takes_victims_in_usage_slot_order(clock, block, cache_size, data):
    """FAILS if the kernel orders victims by anything but ascending ``(usage, slot)`` (ties to
    the lower slot, every int32 usage exact: no sentinel folded into the values), takes a slot
    whose usage is this step or one at or past the usable size, or combines pool blocks
    wrongly (``block=2``: four blocks of two slots)."""
    usage = data.draw(st.lists(st.sampled_from([I32_MIN, -1, 0, 1, 3, clock, clock + 1]),
                               min_size=C, max_size=C), label="usage")
    state = _state_with_usage(usage, clock, cache_size)
    routes = jnp.arange(E, dtype=jnp.int32)
    out = _kernel_step(block)(state, routes)
    expected = np_victims(np.where(np.arange(C) < cache_size, usage, clock + 1), clock + 1, E, E)
    np.testing.assert_array_equal(np.asarray(out[3]), expected)  # the copy plan's dst_slots


# --------------------------------------------------------------------------------------------
# The loop-free XLA twin (selection.py) on long pools: the two-level path
# --------------------------------------------------------------------------------------------

_XLA_VICTIMS = jax.jit(selection.select_victims, static_argnames=("num_out",))


@given(size=st.sampled_from([257, 1000, 2048, 5000]), num_out=st.sampled_from([1, 8, 100]),
       data=st.data())
def test_xla_victims_on_long_pools_match_numpy(size, num_out, data):
    """FAILS if the two-level search of long pools (rows, then the rows with the smallest
    minima) misses a victim in a row whose minimum ties another row's, mishandles the padded
    last row, or orders ties by anything but the slot."""
    step = data.draw(st.sampled_from([0, 3, I32_MAX]), label="step")
    kind = data.draw(st.sampled_from(["ties", "wide", "mostly-touched"]), label="kind")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    if kind == "ties":
        usage = rng.integers(-2, 4, size)
    elif kind == "wide":
        usage = rng.choice([I32_MIN, I32_MAX, -1, 0, 1, 2, 3, 10**9], size)
    else:
        usage = np.where(rng.random(size) < 0.99, step, rng.integers(-2, 4, size))
    n = data.draw(st.integers(0, num_out), label="n")
    got = _XLA_VICTIMS(jnp.asarray(usage, jnp.int32), jnp.int32(step), jnp.int32(n),
                       num_out=num_out)
    np.testing.assert_array_equal(np.asarray(got), np_victims(usage, step, n, num_out))


def test_a_jax_without_the_pallas_triton_backend_resolves_to_xla(monkeypatch):
    """FAILS if ``backend=None`` picks the fused kernel on a JAX that cannot lower it, or an
    explicit ``backend="pallas"`` there fails later than resolution or without naming why."""
    import pytest

    monkeypatch.setattr(dispatch, "has_pallas_triton", lambda: False)
    assert dispatch.resolve_backend(None) == "xla"
    assert dispatch.resolve_backend("xla") == "xla"
    for backend in ("pallas", "interpret"):
        with pytest.raises(ValueError, match="Pallas Triton backend"):
            dispatch.resolve_backend(backend)
