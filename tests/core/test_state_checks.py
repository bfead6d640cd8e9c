"""Every public op checks the state it is given, the same way, at call/trace time
(docs/semantics.md §6): its parts' types, shapes and dtypes, an eviction record that matches
the bookkeeping, and a usable size inside ``[E, capacity]``; a device usable size outside it is
refused with ``ERR_CACHE_SIZE``, nothing written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_cache as pc
from pallas_cache import reference

IDS = [1, 2]


def _cold():
    return pc.init(2, 4, 8)


#: (name, op of a state): every public op and report that takes a state, one call each.
OPS = [
    ("ensure", lambda s: pc.ensure(s, 0, IDS)),
    ("ensure_hybrid", lambda s: pc.ensure_hybrid(s, 0, IDS, pc.FetchPolicy.fraction(0.5))),
    ("materialize_layer", lambda s: pc.materialize_layer(s, 0)),
    ("resize", lambda s: pc.resize(s, 5)),
    ("forget_slot", lambda s: pc.forget_slot(s, 0)),
    ("begin_prefill", pc.begin_prefill),
    ("prefetch_prefill_layer", lambda s: pc.prefetch_prefill_layer(s, 0, (4,))),
    ("release_prefill_layer", lambda s: pc.release_prefill_layer(s, 0)),
    ("prefill_overlap_fits", pc.prefill_overlap_fits),
    ("reset", pc.reset),
    ("rebuild", lambda s: pc.rebuild(s, 6)),
    ("reset_stats", pc.reset_stats),
    ("reset_routing", pc.reset_routing),
    ("set_collect_routing", lambda s: pc.set_collect_routing(s, True)),
    ("routing_histogram", lambda s: pc.routing_histogram(s, 0)),
    ("stats", pc.stats),
    ("layer_stats", lambda s: pc.layer_stats(s, 0)),
    ("per_layer_stats", pc.per_layer_stats),
    ("routing_skew", pc.routing_skew),
    ("describe", pc.describe),
    ("diff", lambda s: pc.diff(s, s)),
]
#: The ops that run under ``jit`` (the reports read the host, ``rebuild`` makes a shape).
JITTABLE = {"ensure", "ensure_hybrid", "materialize_layer", "resize", "forget_slot",
            "begin_prefill", "prefetch_prefill_layer", "release_prefill_layer",
            "prefill_overlap_fits", "reset", "reset_stats", "reset_routing",
            "set_collect_routing", "routing_histogram"}


#: The reports that take a batch of states (leading axes on every leaf), or name one.
BATCHED = {"stats", "layer_stats", "per_layer_stats", "describe", "routing_skew"}


def _each_op(state, error, message, *, skip=()):
    for name, op in OPS:
        if name in skip:
            continue
        with pytest.raises(error, match=message):
            op(state)
        if name in JITTABLE:
            with pytest.raises(error, match=message):
                jax.jit(op)(state)


def test_a_float_state_is_refused_by_every_op_naming_the_part():
    """FAILS if an op other than ensure / ensure_hybrid / materialize_layer takes a state cast
    to float32 (``resize``: "not does not accept dtype float32", ``forget_slot``: "Indexer must
    have integer or boolean type", the reports read float counters): every op raises TypeError
    naming the first part of the wrong dtype."""
    state = jax.tree.map(lambda x: x.astype(jnp.float32), _cold())
    _each_op(state, TypeError, r"state\.residency\.slot_for_id has dtype float32, expected int32")


def test_a_part_of_another_length_is_refused_by_every_op():
    """FAILS if ``forget_slot``, ``begin_prefill``, ``release_prefill_layer`` (or any other op)
    accept ``residency.usage`` of length 10 for C = 8: ValueError naming the part, its shape
    and the geometry."""
    state = _cold()
    state = state.replace(residency=state.residency.replace(usage=jnp.zeros(10, jnp.int32)))
    _each_op(state, ValueError, r"state\.residency\.usage has shape \[10\], expected \[8\]")


@pytest.mark.parametrize("record", [pc.Eviction.LRU, "lru", None],
                         ids=["member", "string", "none"])
def test_an_eviction_that_is_not_a_record_is_refused_naming_it(record):
    """FAILS if ``state.replace(eviction=pc.Eviction.LRU)`` (or ``"lru"``, ``None``) reaches the
    step (``AttributeError: 'Eviction' object has no attribute 'history_of'``): a TypeError
    naming ``state.eviction``, and for a registry member or its name, the record to use."""
    state = _cold().replace(eviction=record)
    hint = r".*pc\.Eviction\.LRU\.policy" if record is not None else ""
    _each_op(state, TypeError, r"state\.eviction must be an EvictionPolicy record" + hint)


@pytest.mark.parametrize("state_eviction, record", [("lru", "route_knn"), ("route_knn", "lru"),
                                                    ("lru", "pair_lfu")])
def test_another_evictions_record_on_a_state_is_refused(state_eviction, record):
    """FAILS if a record of another eviction than the state's bookkeeping is used (route_knn's
    record on an LRU state: "'NoneType' object has no attribute 'masks'"; LRU's on a ring state
    runs with the ring ignored): a TypeError naming ``state.eviction_state`` and both."""
    state = pc.init(2, 4, 8, eviction=state_eviction)
    state = state.replace(eviction=pc.Eviction(record).policy)
    _each_op(state, TypeError, rf"state\.eviction_state is \w+, but state\.eviction '{record}'")


@pytest.mark.parametrize("mangle, error, message", [
    (lambda s: jax.tree.map(lambda x: x * 1, s), TypeError,
     r"state\.prefill\.released has dtype int32, expected bool"),
    (lambda s: jax.tree.map(lambda x: x[None], s), ValueError,
     r"state\.residency\.slot_for_id must be \[L, E\]"),
    (lambda s: s.replace(routing=s.prefill, prefill=s.routing), TypeError,
     r"state\.routing must be a Routing, got Prefill"),
    (lambda s: s.replace(stats=s.residency.usage), ValueError,
     r"state\.stats has shape \[8\], expected \[2, 4\]"),
], ids=["times-one", "added-axis", "swapped-parts", "swapped-leaf"])
def test_a_state_a_tree_op_changed_is_refused_naming_the_part(mangle, error, message):
    """FAILS if a state changed by a tree op reaches the ops: ``x * 1`` turns the bool leaves
    into int32, ``x[None]`` adds an axis, parts swapped with each other; each op names the part
    (TypeError for a type, ValueError for a shape). An added axis is a batch of one to the
    reports that take batches."""
    state = mangle(_cold())
    _each_op(state, error, message, skip=BATCHED if error is ValueError else ())


def test_numpy_leaves_of_the_right_dtype_and_shape_are_accepted():
    """FAILS if a state whose leaves are NumPy arrays (a state loaded from ``np.savez``) is
    refused, or gives another result than the same state on the device."""
    state, _ = pc.ensure(_cold(), 0, [0, 3])
    host = jax.tree.map(np.asarray, state)
    for name, op in OPS:
        got, want = op(host), op(state)
        if name in JITTABLE:
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("size", [-1, 2, 9, np.int32(2)])
def test_a_host_usable_size_outside_e_and_capacity_is_refused(size):
    """FAILS if a hand-built state with ``settings.cache_size`` below E (-1, or 2 with E = 4) or
    above the capacity is accepted (error 0, ``copy.count 4`` with ``dst_slots [-1, ...]``: a
    copy loop writes ``pool[-1]``): every op raises ValueError naming the setting and the
    range."""
    state = _cold()
    state = state.replace(settings=state.settings.replace(cache_size=size))
    for name, op in OPS:
        with pytest.raises(ValueError, match=r"state\.settings\.cache_size is -?\d+, outside "
                                              r"\[E, capacity\] = \[4, 8\]"):
            op(state)


@pytest.mark.parametrize("size", [2, 9])
@pytest.mark.parametrize("backend", [
    "xla", "interpret",
    pytest.param("pallas", marks=pytest.mark.skipif(jax.default_backend() != "gpu",
                                                    reason="the compiled kernel needs a GPU"))])
def test_a_device_usable_size_outside_e_and_capacity_writes_nothing(size, backend):
    """FAILS if a device (or traced) ``settings.cache_size`` outside ``[E, C]`` lets a call
    through (error 0, four copies into slots -1, or a slot past the pool forgotten): ensure,
    ensure_hybrid (the XLA step and the fused kernel), materialize_layer and forget_slot set
    ERR_CACHE_SIZE and return the state they were given, under ``jit`` too."""
    state, _ = pc.ensure(_cold(), 1, [0, 1])
    state = state.replace(settings=state.settings.replace(cache_size=jnp.int32(size)))
    calls = [lambda s: pc.ensure(s, 0, [0, 1, 2, 3], backend=backend),
             lambda s: pc.ensure_hybrid(s, 0, [0, 1, 2, 3], pc.FetchPolicy.full(),
                                        backend=backend),
             lambda s: pc.materialize_layer(s, 0),
             lambda s: pc.forget_slot(s, 1)]
    for call in calls:
        for run in (call, jax.jit(call)):
            new, plan = run(state)
            assert int(plan.error) & pc.ERR_CACHE_SIZE
            for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state)):
                np.testing.assert_array_equal(a, b)
            copy = getattr(plan, "copy", None)
            if copy is not None:
                assert int(copy.count) == 0
                assert not np.any(np.asarray(plan.cpu)) if hasattr(plan, "cpu") else True


def test_the_library_and_the_reference_say_which_state_they_got():
    """FAILS if ``reference.ensure(library_state, ...)`` fails with ``FrozenInstanceError`` or
    ``pc.ensure(reference_state, ...)`` with an AttributeError: each names the state it got
    and whose ops take it."""
    with pytest.raises(TypeError, match=r"got the library's CacheState \(pallas_cache\.init\)"):
        reference.ensure(_cold(), 0, IDS)
    with pytest.raises(TypeError, match=r"of the NumPy reference \(pallas_cache\.reference\)"):
        pc.ensure(reference.init(2, 4, 8), 0, IDS)


@pytest.mark.parametrize("bad", [None, "state", 3])
def test_a_report_given_no_state_names_it(bad):
    """FAILS if ``pc.stats(None)`` or ``pc.describe("state")`` is an AttributeError: a
    TypeError saying a CacheState was expected and what came."""
    for report in (pc.stats, pc.describe, pc.per_layer_stats, pc.routing_skew):
        with pytest.raises(TypeError, match=r"state must be a CacheState \(from pc\.init\), "
                                            rf"got {type(bad).__name__}"):
            report(bad)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="needs a host without a GPU")
def test_the_pallas_backend_without_a_gpu_says_what_to_use():
    """FAILS if an eager ``backend="pallas"`` call on a CPU reaches the compile (JAX's "Only
    interpret mode is supported"): a ValueError naming "interpret" and "xla"."""
    for call in (lambda: pc.ensure(_cold(), 0, IDS, backend="pallas"),
                 lambda: pc.ensure_hybrid(_cold(), 0, IDS, pc.FetchPolicy.full(),
                                          backend="pallas")):
        with pytest.raises(ValueError, match=r"backend='interpret'.*'xla'"):
            call()
