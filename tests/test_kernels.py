"""The two Pallas kernels (docs/semantics.md §5.2 step 5, 5.5, 7) in interpret mode against plain NumPy.

Every kernel call here runs the Pallas interpreter on the CPU. Shapes come from small fixed
sets so the jitted wrappers compile once per shape and hypothesis examples reuse them. The
``blocked`` variants force a small reduction block, so the multi-block scan that the GPU path
uses for large pools (``S > 4096``) is exercised on the interpreter too.

Each explicit test names the naive implementation it catches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

from pallas_cache.kernels import dispatch
from pallas_cache.kernels.promotion import promotion
from pallas_cache.kernels.victims import victims
from pallas_cache.kernels.promotion import promotion_call
from pallas_cache.kernels.victims import victims_call

I32_MIN = int(np.iinfo(np.int32).min)
I32_MAX = int(np.iinfo(np.int32).max)


# --------------------------------------------------------------------------------------------
# NumPy oracles (int64, written to be read)
# --------------------------------------------------------------------------------------------

def np_victims(usage, step, n, num_out):
    """First n evictable slots (usage != step) in ascending (usage, slot) order, -1 padded."""
    usage = np.asarray(usage, np.int64)
    evictable = [s for s in range(len(usage)) if usage[s] != step]
    order = sorted(evictable, key=lambda s: (usage[s], s))
    out = np.full(num_out, -1, np.int64)
    k = min(max(n, 0), num_out, len(order))
    out[:k] = order[:k]
    return out


def np_promotion(usage, id_of_slot, step, recency_row, miss_mask, fraction16, num_fetch):
    """The seed-000 PROMOTE_ONE decision: (expert, slot) or (-1, -1)."""
    usage = np.asarray(usage, np.int64)
    recency_row = np.asarray(recency_row, np.int64)
    evictable = [s for s in range(len(usage)) if usage[s] != step]
    misses = [e for e in range(len(recency_row)) if miss_mask[e]]
    if not (fraction16 > 0 and num_fetch == 0 and misses and evictable):
        return -1, -1
    victim = min(evictable, key=lambda s: (usage[s], s))
    first = min(misses, key=lambda e: (-recency_row[e], e))
    if id_of_slot[victim] == -1 and recency_row[first] >= 0:
        return first, victim
    return -1, -1


def run_victims(usage, step, n, num_out, block=None):
    usage = jnp.asarray(np.asarray(usage, np.int32))
    if block is None:
        out = victims(usage, step, n, num_out=num_out, interpret=True)
    else:
        out = _blocked_victims(usage, jnp.int32(step), jnp.int32(n), num_out=num_out, block=block)
    assert out.shape == (num_out,) and out.dtype == jnp.int32
    return np.asarray(out)


@functools.partial(jax.jit, static_argnames=("num_out", "block"))
def _blocked_victims(usage, step, n, *, num_out, block):
    return victims_call(usage, step, n, num_out=num_out, interpret=True, debug=False,
                        block=block)


@functools.partial(jax.jit, static_argnames=("block",))
def _blocked_promotion(*args, block):
    return promotion_call(*args, interpret=True, debug=False, block=block)


def run_promotion(usage, id_of_slot, step, recency_row, miss_mask, fraction16, num_fetch,
                  block=None):
    args = (jnp.asarray(np.asarray(usage, np.int32)), jnp.asarray(np.asarray(id_of_slot, np.int32)),
            jnp.int32(step), jnp.asarray(np.asarray(recency_row, np.int32)),
            jnp.asarray(np.asarray(miss_mask)), jnp.int32(fraction16), jnp.int32(num_fetch))
    if block is None:
        e, s = promotion(*args, interpret=True)
    else:
        e, s = _blocked_promotion(*args, block=block)
    assert e.shape == () and s.shape == () and e.dtype == s.dtype == jnp.int32
    return int(e), int(s)


# --------------------------------------------------------------------------------------------
# Strategies: few shapes, value pools full of ties, the step and the int32 extremes
# --------------------------------------------------------------------------------------------

STEPS = [I32_MIN, -1, 0, 1, 2, 3, I32_MAX]
# (S, num_out choices): non-powers of two, S == 1, num_out == S.
VICTIM_SHAPES = {1: (1,), 3: (1, 3), 64: (1, 16, 64), 100: (7, 100)}


@st.composite
def usage_vectors(draw, size, step):
    pool = st.sampled_from([I32_MIN, -1, 0, 1, 2, 3, 5, I32_MAX, step])
    wide = st.integers(I32_MIN, I32_MAX)
    return draw(st.lists(st.one_of(pool, pool, wide), min_size=size, max_size=size))


@st.composite
def victims_cases(draw, sizes=tuple(VICTIM_SHAPES)):
    size = draw(st.sampled_from(sizes))
    num_out = draw(st.sampled_from(VICTIM_SHAPES[size]))
    step = draw(st.sampled_from(STEPS))
    usage = draw(usage_vectors(size, step))
    n = draw(st.one_of(st.just(0), st.just(num_out), st.integers(0, num_out)))
    return usage, step, n, num_out


PROMO_SHAPES = [(1, 1), (3, 2), (64, 16), (100, 7), (64, 1)]


@st.composite
def promotion_cases(draw, shapes=tuple(PROMO_SHAPES)):
    size, num_experts = draw(st.sampled_from(shapes))
    step = draw(st.sampled_from(STEPS))
    usage = draw(usage_vectors(size, step))
    id_of_slot = draw(st.lists(st.sampled_from([-1, -1, 0, 5, 17]), min_size=size,
                               max_size=size))
    recency = draw(st.lists(st.sampled_from([-1, 0, 1, 4, 9, I32_MAX, I32_MIN]),
                            min_size=num_experts, max_size=num_experts))
    miss = draw(st.lists(st.booleans(), min_size=num_experts, max_size=num_experts))
    fraction16 = draw(st.sampled_from([0, 1, 26214, 65536, -1]))
    num_fetch = draw(st.sampled_from([0, 0, 1, 3]))
    return usage, id_of_slot, step, recency, miss, fraction16, num_fetch


# --------------------------------------------------------------------------------------------
# victims
# --------------------------------------------------------------------------------------------

@given(victims_cases())
def test_victims_matches_numpy(case):
    usage, step, n, num_out = case
    np.testing.assert_array_equal(run_victims(usage, step, n, num_out),
                                  np_victims(usage, step, n, num_out))


@given(victims_cases(sizes=(64, 100)), st.sampled_from([8, 16]))
def test_victims_blocked_scan_matches_numpy(case, block):
    usage, step, n, num_out = case
    np.testing.assert_array_equal(run_victims(usage, step, n, num_out, block=block),
                                  np_victims(usage, step, n, num_out))


def test_victims_ties_go_to_the_lowest_slot():
    # Fails if ties go to the highest slot (or to any other order than ascending slot).
    usage = [4, 2, 2, 9, 2, 2, 4]
    np.testing.assert_array_equal(run_victims(usage, 100, 7, 7), [1, 2, 4, 5, 0, 6, 3])
    np.testing.assert_array_equal(run_victims([0] * 5, 1, 5, 5), [0, 1, 2, 3, 4])
    # Ties across reduction blocks: the earlier block must win.
    usage = [7] * 16 + [3] * 16 + [3] * 16 + [1] * 3 + [3] * 13
    np.testing.assert_array_equal(run_victims(usage, 100, 6, 6, block=16),
                                  [48, 49, 50, 16, 17, 18])


def test_victims_skip_slots_touched_this_step():
    # Fails if slots with usage == step are not excluded: slot 0 (usage == step == 0) would be
    # taken first (it has the smallest usage).
    usage = [0, 5, 0, 3, 7]
    np.testing.assert_array_equal(run_victims(usage, 0, 3, 5), [3, 1, 4, -1, -1])
    # The step can be any value, including one that equals the largest real usage.
    np.testing.assert_array_equal(run_victims([I32_MAX, 1, I32_MAX, 0], I32_MAX, 4, 4),
                                  [3, 1, -1, -1])


def test_victims_all_excluded_gives_minus_one():
    np.testing.assert_array_equal(run_victims([6, 6, 6], 6, 3, 3), [-1, -1, -1])
    np.testing.assert_array_equal(run_victims([6] * 100, 6, 7, 7), [-1] * 7)


def test_victims_fewer_evictable_than_n_pads_with_minus_one():
    # Fails if the kernel keeps returning some slot (e.g. a claimed or touched one).
    usage = [9, 2, 9, 9, 1]
    np.testing.assert_array_equal(run_victims(usage, 9, 5, 5), [4, 1, -1, -1, -1])


def test_victims_n_zero_and_n_equal_num_out_equal_s():
    usage = [3, 1, 2]
    np.testing.assert_array_equal(run_victims(usage, 7, 0, 3), [-1, -1, -1])
    np.testing.assert_array_equal(run_victims(usage, 7, 3, 3), [1, 2, 0])
    # Entries >= n are -1 even when more slots are evictable.
    np.testing.assert_array_equal(run_victims(usage, 7, 1, 3), [1, -1, -1])
    # S == num_out == n with every slot evictable: a permutation, in (usage, slot) order.
    rng = np.random.default_rng(0)
    usage = rng.integers(-3, 3, 100)
    got = run_victims(usage, 50, 100, 100)
    np.testing.assert_array_equal(got, np_victims(usage, 50, 100, 100))
    assert sorted(got) == list(range(100))


def test_victims_int32_extremes():
    # INT32_MIN (a forgotten slot) comes first; INT32_MAX is a real, evictable usage.
    usage = [5, I32_MAX, I32_MIN, 0, I32_MIN, I32_MAX]
    np.testing.assert_array_equal(run_victims(usage, 3, 6, 6), [2, 4, 3, 0, 1, 5])
    # A touched INT32_MAX slot at a lower index must not hide an evictable INT32_MAX slot
    # (fails if exclusion is done by mapping touched slots to INT32_MAX).
    np.testing.assert_array_equal(run_victims([I32_MAX, I32_MAX], I32_MAX, 2, 2), [-1, -1])
    np.testing.assert_array_equal(run_victims([7, I32_MAX, 7], 7, 2, 2), [1, -1])


def test_victims_n_is_traced_and_clamped():
    f = jax.jit(lambda u, n: victims(u, 0, n, num_out=3, interpret=True))
    u = jnp.asarray([5, 4, 3, 2, 1], jnp.int32)
    for n, want in [(0, [-1, -1, -1]), (2, [4, 3, -1]), (3, [4, 3, 2]), (9, [4, 3, 2]),
                    (-4, [-1, -1, -1])]:
        np.testing.assert_array_equal(f(u, n), want)


def test_victims_num_out_zero():
    out = victims(jnp.zeros(4, jnp.int32), 1, 0, num_out=0, interpret=True)
    assert out.shape == (0,) and out.dtype == jnp.int32


def test_victims_under_vmap():
    rng = np.random.default_rng(1)
    batch, size, num_out = 5, 100, 7
    usage = rng.integers(-2, 4, (batch, size)).astype(np.int32)
    usage[0, :] = 1                       # all excluded in cache 0 (its step is 1)
    usage[1, 3] = I32_MIN
    steps = np.array([1, 2, 0, 3, -1], np.int32)
    ns = np.array([7, 0, 3, 7, 5], np.int32)
    f = jax.vmap(lambda u, s, n: victims(u, s, n, num_out=num_out, interpret=True))
    got = np.asarray(f(jnp.asarray(usage), jnp.asarray(steps), jnp.asarray(ns)))
    want = np.stack([np_victims(usage[b], steps[b], ns[b], num_out) for b in range(batch)])
    np.testing.assert_array_equal(got, want)
    # Unbatched step and n.
    g = jax.vmap(lambda u: victims(u, 2, 4, num_out=num_out, interpret=True))
    want = np.stack([np_victims(usage[b], 2, 4, num_out) for b in range(batch)])
    np.testing.assert_array_equal(g(jnp.asarray(usage)), want)


def test_victims_inside_scan_equals_step_by_step():
    size, num_out, steps = 64, 8, 12
    rng = np.random.default_rng(2)
    hits = rng.integers(0, size, steps).astype(np.int32)
    ns = rng.integers(0, num_out + 1, steps).astype(np.int32)

    def one_step(usage, x):
        t, hit, n = x
        usage = usage.at[hit].set(t)
        v = victims(usage, t, n, num_out=num_out, interpret=True)
        return usage.at[jnp.where(v >= 0, v, size)].set(t, mode="drop"), v

    xs = (jnp.arange(1, steps + 1, dtype=jnp.int32), jnp.asarray(hits), jnp.asarray(ns))
    _, got = jax.jit(lambda u, xs: lax.scan(one_step, u, xs))(jnp.zeros(size, jnp.int32), xs)
    usage = np.zeros(size, np.int64)
    for k in range(steps):
        t = k + 1
        usage[hits[k]] = t
        want = np_victims(usage, t, ns[k], num_out)
        np.testing.assert_array_equal(got[k], want)
        usage[want[want >= 0]] = t


def test_victims_rejects_bad_input():
    with pytest.raises(TypeError, match="int32"):
        victims(jnp.zeros(4, jnp.float32), 1, 1, num_out=2, interpret=True)
    with pytest.raises(ValueError, match="1-D"):
        victims(jnp.zeros((2, 4), jnp.int32), 1, 1, num_out=2, interpret=True)
    with pytest.raises(ValueError, match="num_out"):
        victims(jnp.zeros(4, jnp.int32), 1, 1, num_out=5, interpret=True)
    with pytest.raises(ValueError, match="scalar"):
        victims(jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32), 1, num_out=2, interpret=True)
    with pytest.raises(TypeError, match="integer"):
        victims(jnp.zeros(4, jnp.int32), 1.5, 1, num_out=2, interpret=True)


def test_victims_debug_prints_the_kernel(capsys):
    victims(jnp.zeros(5, jnp.int32), 1, 1, num_out=2, interpret=True, debug=True)
    assert "pallas_call" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# promotion
# --------------------------------------------------------------------------------------------

@given(promotion_cases())
def test_promotion_matches_numpy(case):
    assert run_promotion(*case) == np_promotion(*case)


@given(promotion_cases(shapes=((64, 16), (100, 7))), st.sampled_from([8, 32]))
def test_promotion_blocked_scan_matches_numpy(case, block):
    assert run_promotion(*case, block=block) == np_promotion(*case)


def _promo(usage, ids, step, rec, miss, fraction16=26214, num_fetch=0, block=None):
    return run_promotion(usage, ids, step, rec, miss, fraction16, num_fetch, block=block)


def test_promotion_fires_for_a_recurring_miss_and_an_empty_lru_slot():
    # Slot 2 is the argmin evictable slot (usage 0, empty); expert 1 was routed before.
    assert _promo([4, 4, 0, 3], [10, 11, -1, 12], 5, [-1, 2, -1], [0, 1, 0]) == (1, 2)
    # Recency 0 counts as routed before (>= 0).
    assert _promo([4, 0], [10, -1], 5, [0, -1], [1, 1]) == (0, 1)


def test_promotion_first_miss_is_by_recency_not_by_id():
    # Fails if the first miss is taken by lowest id: expert 0 is a first-time miss (-1), which
    # would block the promotion; the recurring miss 3 must be found among first-time misses.
    assert _promo([0, 5], [-1, 3], 9, [-1, -1, -1, 4], [1, 1, 0, 1]) == (3, 0)
    # Max recency wins over a lower id with a lower recency.
    assert _promo([0, 5], [-1, 3], 9, [2, 7, 7, 1], [1, 0, 1, 1]) == (2, 0)
    # Ties in recency go to the lowest expert id (fails if ties go to the highest).
    assert _promo([0, 5], [-1, 3], 9, [7, 7, 7, 1], [0, 1, 1, 1]) == (1, 0)
    # A resident (non-missing) expert with a higher recency is ignored.
    assert _promo([0, 5], [-1, 3], 9, [99, 3], [0, 1]) == (1, 0)


def test_promotion_never_promotes_a_first_time_miss():
    assert _promo([0, 5], [-1, 3], 9, [-1, -1, -1], [1, 1, 1]) == (-1, -1)
    assert _promo([0, 5], [-1, 3], 9, [I32_MIN, 8], [1, 0]) == (-1, -1)


def test_promotion_victim_is_the_argmin_not_any_empty_slot():
    # Fails if the rule looks for *any* empty slot: the LRU slot 0 is occupied, so a full-cache
    # eviction decision is not changed even though slot 1 is empty.
    assert _promo([1, 3, 2], [7, -1, 8], 9, [5], [1]) == (-1, -1)
    # Ties in usage go to the lowest slot: slot 0 (occupied) beats the empty slot 1.
    assert _promo([2, 2], [7, -1], 9, [5], [1]) == (-1, -1)
    assert _promo([2, 2], [-1, 7], 9, [5], [1]) == (0, 0)
    # Across reduction blocks too.
    usage = [5] * 8 + [2] + [5] * 7 + [2] * 16
    ids = [3] * 16 + [-1] * 16
    assert _promo(usage, ids, 9, [5], [1], block=8) == (-1, -1)
    ids[8] = -1
    assert _promo(usage, ids, 9, [5], [1], block=8) == (0, 8)


def test_promotion_skips_slots_touched_this_step():
    # Fails if touched slots are not excluded: slot 0 (usage == step, empty) would be the argmin.
    assert _promo([9, 3, 4], [-1, 7, -1], 9, [5], [1]) == (-1, -1)
    assert _promo([9, 3, 4], [-1, -1, 8], 9, [5], [1]) == (0, 1)
    # Every slot touched: no victim, no promotion.
    assert _promo([9, 9], [-1, -1], 9, [5], [1]) == (-1, -1)


def test_promotion_needs_fraction_zero_fetch_and_a_miss():
    base = ([0, 5], [-1, 3], 9, [4, 2], [1, 1])
    assert _promo(*base) == (0, 0)
    assert _promo(*base, fraction16=0) == (-1, -1)      # fixed cap
    assert _promo(*base, fraction16=-3) == (-1, -1)
    assert _promo(*base, num_fetch=1) == (-1, -1)        # the split already fetches
    assert _promo([0, 5], [-1, 3], 9, [4, 2], [0, 0]) == (-1, -1)   # no miss


def test_promotion_int32_extremes_and_int_mask():
    # A forgotten slot (INT32_MIN, empty) is the first victim.
    assert _promo([0, I32_MIN, 4], [-1, -1, 2], 9, [1], [1]) == (0, 1)
    # INT32_MAX recency and usage are ordinary values.
    assert _promo([I32_MAX, I32_MAX], [-1, 2], 1, [I32_MAX, 3], np.array([1, 1], np.int32)) \
        == (0, 0)
    assert _promo([I32_MAX, 4], [-1, 2], I32_MAX, [1], np.array([7], np.int32)) == (-1, -1)


def test_promotion_under_vmap():
    rng = np.random.default_rng(3)
    batch, size, num_experts = 6, 100, 7
    usage = rng.integers(0, 3, (batch, size)).astype(np.int32)
    ids = np.where(rng.random((batch, size)) < 0.5, -1, 3).astype(np.int32)
    rec = rng.integers(-1, 3, (batch, num_experts)).astype(np.int32)
    miss = rng.random((batch, num_experts)) < 0.5
    steps = np.array([1, 2, 3, 1, 2, 3], np.int32)
    frac = np.array([1, 1, 0, 1, 1, 1], np.int32)
    nf = np.array([0, 0, 0, 1, 0, 0], np.int32)
    f = jax.vmap(functools.partial(promotion, interpret=True))
    e, s = f(*map(jnp.asarray, (usage, ids, steps, rec, miss, frac, nf)))
    want = [np_promotion(usage[b], ids[b], steps[b], rec[b], miss[b], frac[b], nf[b])
            for b in range(batch)]
    assert list(zip(np.asarray(e).tolist(), np.asarray(s).tolist())) == want
    assert any(w != (-1, -1) for w in want) and any(w == (-1, -1) for w in want)
    # Only the cache state batched (a fraction sweep shares the routing).
    g = jax.vmap(lambda u, i: promotion(u, i, 2, rec[0], miss[0], 1, 0, interpret=True))
    e, s = g(jnp.asarray(usage), jnp.asarray(ids))
    want = [np_promotion(usage[b], ids[b], 2, rec[0], miss[0], 1, 0) for b in range(batch)]
    assert list(zip(np.asarray(e).tolist(), np.asarray(s).tolist())) == want


def test_promotion_rejects_bad_input():
    z4, z2 = jnp.zeros(4, jnp.int32), jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="id_of_slot"):
        promotion(z4, jnp.zeros(3, jnp.int32), 1, z2, z2, 1, 0, interpret=True)
    with pytest.raises(ValueError, match="miss_mask"):
        promotion(z4, z4, 1, z2, jnp.zeros(3, bool), 1, 0, interpret=True)
    with pytest.raises(TypeError, match="miss_mask"):
        promotion(z4, z4, 1, z2, jnp.zeros(2, jnp.float32), 1, 0, interpret=True)
    with pytest.raises(TypeError, match="recency_row"):
        promotion(z4, z4, 1, jnp.zeros(2, jnp.int16), z2, 1, 0, interpret=True)


# --------------------------------------------------------------------------------------------
# The loop-free XLA twin (kernels/dispatch.py) on long pools: the two-level path
# --------------------------------------------------------------------------------------------

_XLA_VICTIMS = jax.jit(functools.partial(dispatch.select_victims, backend="xla"),
                       static_argnames=("num_out",))


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
