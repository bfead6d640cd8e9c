"""Lockstep property tests: the JAX cache against the NumPy reference, field by field.

Hypothesis draws a geometry and a random sequence of every operation (ensure; ensure_hybrid with
every policy kind, fetch order and admission rule; materialize_layer; forget_slot, bad slots
included; the prefill chunk ops; reset; rebuild, rejected targets included; stats windows;
routing collection on and off; padding routes, duplicates, batches larger than E, bad ids and
layers). Both implementations run it; after **every** step every state field and every plan
field must be equal, and the docs/semantics.md §3 invariants must hold. A rebase threshold is drawn too, so
sequences cross the int32-clock renumbering (docs/semantics.md §5.12).

Cost control (the file must stay well under three minutes on two cores with the 'ci' profile):
compilation is the cost, so geometries come from a small fixed list, each geometry has one fixed
route shape (routes are padded with -1 to it), rebuild only moves between sizes already in the
list, and the jitted wrappers are module-level so every compiled function is reused across
examples. The eager mode calls the public functions directly (they jit their bodies internally);
the jit mode wraps every public function in an outer ``jax.jit`` with a traced layer/slot.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import chex

import pallas_cache as pc
from pallas_cache.kernels import dispatch as backends
from reference import PrefillDoesNotFit as RefPrefillDoesNotFit
from reference import RebuildRejected as RefRebuildRejected
from reference import ReferenceCache, ReferencePolicy

BIG_BANK = 512 * 1024
SMALL_BANK = 4 * 1024
BANK_CHOICES = ((BIG_BANK,), (BIG_BANK, SMALL_BANK))

# (L, E, S, route shape, rebuild targets). Pairs of geometries share (L, E) so a rebuild lands on a
# geometry that is compiled anyway. Covers E == 1, L == 1, S == E, S == 2E, S odd, 2-D routes, and
# route batches larger than E.
GEOMETRIES = {
    "eager": [
        (1, 1, 1, (3,), (1, 2)),
        (1, 1, 2, (3,), (1, 2)),
        (2, 3, 3, (5,), (3, 6)),
        (2, 3, 6, (5,), (3, 6)),
        (3, 4, 12, (2, 3), (12,)),
        (4, 2, 7, (4,), (7,)),
    ],
    "jit": [
        (1, 1, 2, (3,), (2,)),
        (2, 3, 6, (5,), (6,)),
        (3, 4, 12, (2, 3), (12,)),
    ],
}
REBASE_THRESHOLDS = (2**30, 4, 11)
QUICK_FRACTIONS = (0.0, 0.25, 0.4, 0.415, 0.5, 0.75, 1.0)


JITTED = {
    "ensure": jax.jit(pc.ensure, static_argnames=("backend",)),
    "ensure_hybrid": jax.jit(pc.ensure_hybrid, static_argnames=("order", "admission", "backend")),
    "materialize_layer": jax.jit(pc.materialize_layer),
    "forget_slot": jax.jit(pc.forget_slot),
    "begin_prefill": jax.jit(pc.begin_prefill),
    "prefetch_prefill_layer": jax.jit(pc.prefetch_prefill_layer, static_argnames=("bank_feat_bytes",)),
    "release_prefill_layer": jax.jit(pc.release_prefill_layer),
    "reset": jax.jit(pc.reset),
    "reset_stats": jax.jit(pc.reset_stats),
    "set_collect_routing": jax.jit(pc.set_collect_routing),
    "reset_routing": jax.jit(pc.reset_routing),
}
EAGER = {name: getattr(pc, name) for name in JITTED}

# JAX state field -> reference attribute.
STATE_FIELDS = {
    "slot_for_id": "slot_for_id",
    "id_of_slot": "id_of_slot",
    "usage": "usage",
    "step": "step",
    "recency": "recency",
    "stats": "stats_table",
    "routing_freq": "routing_freq",
    "collect_routing": "collect_routing",
    "prefill_layer": "prefill_layer",
    "prefill_released": "prefill_released",
    "prefill_open": "prefill_open",
    "prefill_snapshot": "prefill_snapshot",
    "prefill_hit_rows": "prefill_hit_rows",
    "prefill_rows": "prefill_rows",
    "rebase_threshold": "rebase_threshold",
}


# ---- comparing -----------------------------------------------------------------------------


def _np(x):
    return np.asarray(jax.device_get(x))


def assert_same_state(state, ref, context):
    chex.assert_type([state.slot_for_id, state.id_of_slot, state.usage, state.step], jnp.int32)
    for field, attr in STATE_FIELDS.items():
        np.testing.assert_array_equal(
            _np(getattr(state, field)), np.asarray(getattr(ref, attr)),
            err_msg=f"state.{field} after {context}")


def assert_same_plan(plan, ref, context, path="plan"):
    """Every field of a JAX plan equals the reference plan's field of the same name, nested parts
    (``copy``, ``gather``, ``runs``, ``transfers``) included: the two have one structure."""
    assert type(plan).__name__ == type(ref).__name__, f"{path}: {type(plan)} vs {type(ref)}"
    for field in dataclasses.fields(plan):
        mine, theirs = getattr(plan, field.name), getattr(ref, field.name)
        if dataclasses.is_dataclass(mine):
            assert_same_plan(mine, theirs, context, f"{path}.{field.name}")
        else:
            np.testing.assert_array_equal(_np(mine), np.asarray(theirs),
                                          err_msg=f"{path}.{field.name} after {context}")


def assert_invariants(state):
    """docs/semantics.md §3: the maps are mutually inverse, no slot is claimed twice, usage <= step."""
    slot_for_id, id_of_slot = _np(state.slot_for_id), _np(state.id_of_slot)
    usage, step = _np(state.usage), int(_np(state.step))
    E = slot_for_id.shape[1]
    for slot, flat in enumerate(id_of_slot):
        if flat >= 0:
            assert slot_for_id[flat // E, flat % E] == slot, f"slot {slot} and its occupant disagree"
    resident = slot_for_id[slot_for_id >= 0]
    for (layer, expert), slot in np.ndenumerate(slot_for_id):
        if slot >= 0:
            assert id_of_slot[slot] == layer * E + expert, f"expert {(layer, expert)} -> slot {slot}"
    assert len(set(resident.tolist())) == len(resident), "a slot is claimed twice"
    assert (id_of_slot >= 0).sum() <= len(id_of_slot)
    assert (usage <= step).all(), "usage ahead of the clock"


def assert_plan_well_formed(plan, routes, num_experts):
    """docs/semantics.md §4: every route assigned exactly once, duplicates alike, copy arrays -1 padded."""
    slots, cpu, flat = _np(plan.slots), _np(plan.cpu), np.asarray(routes)
    chex.assert_shape([plan.slots, plan.cpu], flat.shape)
    chex.assert_shape([plan.copy.dst_slots, plan.copy.src_rows], (min(flat.size, num_experts),))
    slots, cpu, flat = slots.ravel(), cpu.ravel(), flat.ravel()
    if int(_np(plan.error)):
        assert (slots == -1).all() and not cpu.any()
        return
    route = flat >= 0
    assert ((slots >= 0) != cpu)[route].all(), "a route assigned to both devices or to neither"
    assert (slots[~route] == -1).all() and not cpu[~route].any(), "padding got an assignment"
    for expert in set(flat[route].tolist()):
        same = flat == expert
        assert len(set(slots[same].tolist())) == 1 and len(set(cpu[same].tolist())) == 1
    count = int(_np(plan.copy.count))
    assert count == int(_np(plan.fetched))
    assert (_np(plan.copy.dst_slots)[count:] == -1).all() and (_np(plan.copy.src_rows)[count:] == -1).all()
    assert len(set(_np(plan.copy.dst_slots)[:count].tolist())) == count


def assert_same_reports(state, ref, context):
    mine, theirs = pc.stats(state), ref.stats()
    for name in ("calls", "active", "missing", "fetched", "miss_rate", "fetch_rate",
                 "active_per_call", "missing_per_call", "fetched_per_call"):
        assert getattr(mine, name) == getattr(theirs, name), f"stats.{name} after {context}"
    assert [dataclass_tuple(s) for s in pc.per_layer_stats(state)] == [
        dataclass_tuple(s) for s in ref.per_layer_stats()]
    for layer in range(state.num_layers):
        assert dataclass_tuple(pc.layer_stats(state, layer)) == dataclass_tuple(ref.layer_stats(layer))
        np.testing.assert_array_equal(_np(pc.routing_histogram(state, layer)),
                                      ref.routing_histogram(layer))
    mine, theirs = pc.routing_skew(state), ref.routing_skew()
    assert (mine is None) == (theirs is None), context
    if mine is not None:
        for name in ("slots_per_layer", "oracle_slots", "working_set_max"):
            assert getattr(mine, name) == getattr(theirs, name), name
        for name in ("working_set_mean", "experts_for_90pct", "oracle_hit_at_slots", "norm_entropy"):
            assert getattr(mine, name) == pytest.approx(getattr(theirs, name), rel=1e-12, abs=1e-12)
        assert len(mine.per_layer) == len(theirs.per_layer)
        for a, b in zip(mine.per_layer, theirs.per_layer):
            for name in ("layer", "routed", "working_set", "experts_for_90pct"):
                assert getattr(a, name) == getattr(b, name), name
            for name in ("norm_entropy", "oracle_hit_at_slots"):
                assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-12, abs=1e-12)


def dataclass_tuple(s):
    return (s.calls, s.active, s.missing, s.fetched)


# ---- drawing operations --------------------------------------------------------------------


def draw_layer(data, L):
    """Mostly in range; one draw in ten out of range (ERR_LAYER)."""
    if data.draw(st.integers(0, 9), label="bad layer?") == 0:
        return data.draw(st.sampled_from([-1, L, L + 3]), label="bad layer")
    return data.draw(st.integers(0, L - 1), label="layer")


def draw_routes(data, E, shape):
    size = int(np.prod(shape))
    if data.draw(st.integers(0, 4), label="whole layer?") == 0:
        return whole_layer(E, shape)
    hot = data.draw(st.integers(1, E), label="hot experts")  # a small range makes hits likely
    routes = data.draw(st.lists(st.integers(-1, hot - 1), min_size=size, max_size=size), label="routes")
    if data.draw(st.integers(0, 19), label="bad id?") == 0:
        routes[data.draw(st.integers(0, size - 1))] = data.draw(st.sampled_from([E, E + 5, -2, -7]))
    return np.asarray(routes, np.int32).reshape(shape)


def whole_layer(E, shape):
    """Routes to every expert of a layer (padded with -1 to the geometry's route shape)."""
    size = int(np.prod(shape))
    return np.resize(np.concatenate([np.arange(E), -np.ones(size, int)]), size).astype(np.int32).reshape(shape)


def draw_policy(data, E):
    kind = data.draw(st.sampled_from(["fraction", "fraction", "fixed_cap", "full"]), label="policy")
    if kind == "fraction":
        q = data.draw(st.one_of(st.sampled_from(QUICK_FRACTIONS), st.floats(0.0, 1.0)), label="q")
        return pc.FetchPolicy.fraction(q), ReferencePolicy.fraction(q)
    if kind == "fixed_cap":
        n = data.draw(st.integers(0, E + 1), label="cap")
        return pc.FetchPolicy.fixed_cap(n), ReferencePolicy.fixed_cap(n)
    return pc.FetchPolicy.full(), ReferencePolicy.full()


OP_KINDS = (
    ["ensure"] * 4 + ["ensure_hybrid"] * 8 + ["begin_prefill"] * 2 + ["prefetch_prefill_layer"] * 3
    + ["release_prefill_layer"] * 2 + ["materialize_layer", "forget_slot", "reset", "rebuild",
                                       "reset_stats", "set_collect_routing", "reset_routing"]
)


def run_lockstep(data, mode, backend):
    L, E, S, route_shape, rebuild_targets = data.draw(st.sampled_from(GEOMETRIES[mode]), label="geometry")
    threshold = data.draw(st.sampled_from(REBASE_THRESHOLDS), label="rebase threshold")
    ops = JITTED if mode == "jit" else EAGER
    state = pc.init(L, E, S, rebase_threshold=threshold)
    ref = ReferenceCache(L, E, S, rebase_threshold=threshold)
    assert_same_state(state, ref, "init")
    index = (lambda i: jnp.int32(i)) if mode == "jit" else (lambda i: i)
    # Half the sequences start by warming every layer into the pool (so residents sit above the
    # prefill buffers' slots and chunks see gathers) and opening a prefill chunk.
    prefix = []
    if data.draw(st.booleans(), label="warm the pool and open a chunk?"):
        warm_order = data.draw(st.permutations(range(L)), label="warm order")
        prefix = [("ensure", {"layer": layer, "routes": whole_layer(E, route_shape)})
                  for layer in warm_order] + [("begin_prefill", {})]
    num_ops = len(prefix) + data.draw(st.integers(1, 40), label="number of ops")
    for step in range(num_ops):
        if step < len(prefix):
            kind, given_args = prefix[step]
        else:
            kind, given_args = data.draw(st.sampled_from(OP_KINDS), label="op"), {}
        previous_step, plan = ref.step, None
        context = f"op {step} {kind}"
        if kind == "ensure":
            layer = given_args["layer"] if given_args else draw_layer(data, L)
            routes = given_args["routes"] if given_args else draw_routes(data, E, route_shape)
            context += f"(layer={layer}, routes={routes.tolist()})"
            state, plan = ops["ensure"](state, index(layer), jnp.asarray(routes), backend=backend)
            assert_same_plan(plan, ref.ensure(layer, routes), context)
            assert_plan_well_formed(plan, routes, E)
        elif kind == "ensure_hybrid":
            layer, routes = draw_layer(data, L), draw_routes(data, E, route_shape)
            policy, ref_policy = draw_policy(data, E)
            order = data.draw(st.sampled_from(list(pc.FetchOrder)), label="order")
            admission = data.draw(st.sampled_from(list(pc.Admission)), label="admission")
            context += (f"(layer={layer}, routes={routes.tolist()}, policy={ref_policy}, "
                        f"order={order.value}, admission={admission.value})")
            state, plan = ops["ensure_hybrid"](state, index(layer), jnp.asarray(routes), policy,
                                               order=order, admission=admission, backend=backend)
            expected = ref.ensure_hybrid(layer, routes, ref_policy, order=order.value,
                                         admission=admission.value)
            assert_same_plan(plan, expected, context)
            assert_plan_well_formed(plan, routes, E)
        elif kind == "materialize_layer":
            layer = draw_layer(data, L)
            context += f"(layer={layer})"
            state, plan = ops["materialize_layer"](state, index(layer))
            assert_same_plan(plan, ref.materialize_layer(layer), context)
        elif kind == "forget_slot":
            slot = data.draw(st.sampled_from(list(range(S)) * 3 + [-1, S]), label="slot")
            context += f"(slot={slot})"
            state, plan = ops["forget_slot"](state, index(slot))
            assert_same_plan(plan, ref.forget_slot(slot), context)
        elif kind == "begin_prefill":
            if ref.prefill_overlap_fits():
                state = ops["begin_prefill"](state)
                ref.begin_prefill()
            else:
                with pytest.raises(pc.PrefillDoesNotFit):
                    ops["begin_prefill"](state)
                with pytest.raises(RefPrefillDoesNotFit):
                    ref.begin_prefill()
            assert pc.prefill_overlap_fits(state) == ref.prefill_overlap_fits()
        elif kind == "prefetch_prefill_layer":
            layer = draw_layer(data, L)
            banks = data.draw(st.sampled_from(BANK_CHOICES), label="banks")
            context += f"(layer={layer}, banks={banks})"
            if not ref.prefill_overlap_fits():
                with pytest.raises(pc.PrefillDoesNotFit):
                    ops["prefetch_prefill_layer"](state, index(layer), bank_feat_bytes=banks)
                continue
            state, plan = ops["prefetch_prefill_layer"](state, index(layer), bank_feat_bytes=banks)
            expected = ref.prefetch_prefill_layer(layer, banks)
            assert_same_plan(plan, expected, context)
            count = int(_np(plan.transfers.count))
            assert plan.entry_bytes(banks)[:count].tolist() == list(expected.entry_bytes(banks))
        elif kind == "release_prefill_layer":
            layer = draw_layer(data, L)
            context += f"(layer={layer})"
            state = ops["release_prefill_layer"](state, index(layer))
            ref.release_prefill_layer(layer)
        elif kind == "reset":
            state = ops["reset"](state)
            ref.reset()
        elif kind == "rebuild":
            target = data.draw(st.sampled_from(list(rebuild_targets) + [E - 1]), label="rebuild to")
            context += f"(cache_size={target})"
            if target < E:
                with pytest.raises(pc.RebuildRejected) as rejected:
                    pc.rebuild(state, target)
                assert (rejected.value.requested, rejected.value.minimum) == (target, E)
                with pytest.raises(RefRebuildRejected):
                    ref.rebuild(target)
            else:
                state = pc.rebuild(state, target)
                ref.rebuild(target)
                S = target
        elif kind == "reset_stats":
            state = ops["reset_stats"](state)
            ref.reset_stats()
        elif kind == "set_collect_routing":
            on = data.draw(st.booleans(), label="collect")
            context += f"({on})"
            state = ops["set_collect_routing"](state, jnp.bool_(on) if mode == "jit" else on)
            ref.set_collect_routing(on)
        elif kind == "reset_routing":
            state = ops["reset_routing"](state)
            ref.reset_routing()
        assert_same_state(state, ref, context)
        assert_invariants(state)
        note_events(kind, plan if kind in PLAN_OPS else None, previous_step, ref)
    assert_same_reports(state, ref, "the sequence")


PLAN_OPS = ("ensure", "ensure_hybrid", "materialize_layer", "prefetch_prefill_layer")


def note_events(kind, plan, previous_step, ref):
    """Hypothesis statistics (``--hypothesis-show-statistics``): which rules the run exercised."""
    if plan is None:
        return
    if int(_np(plan.error)):
        event(f"{kind} refused")
        return
    if kind in ("ensure", "ensure_hybrid", "materialize_layer") and ref.step <= previous_step:
        event("clock rebased")
    if kind == "ensure_hybrid" and int(_np(plan.cpu).sum()):
        event("hybrid step with CPU routes")
    if kind == "ensure_hybrid" and int(_np(plan.missing)) > int(_np(plan.fetched)) > 0:
        event("hybrid step with capped fetches")
    if kind == "prefetch_prefill_layer" and int(_np(plan.gather.count)):
        event("prefill gather")
    if kind == "prefetch_prefill_layer" and bool(_np(plan.already_loaded)):
        event("prefill already loaded")


@given(data=st.data())
def test_eager_matches_the_reference_after_every_step(data):
    run_lockstep(data, "eager", "xla")


@given(data=st.data())
def test_jitted_matches_the_reference_after_every_step(data):
    run_lockstep(data, "jit", "xla")


# The Pallas kernels under the interpreter: the same sequences, fewer of them (each geometry
# compiles the interpreted kernels once; the "deep" profile still runs many).
@settings(max_examples=max(6, settings.default.max_examples // 3))
@given(data=st.data())
def test_the_interpret_backend_matches_the_reference_after_every_step(data):
    run_lockstep(data, "jit", "interpret")


def test_a_long_run_across_the_clock_rebase_matches_the_reference():
    """A cache started just below a (small) threshold runs across several rebases, with forgotten
    slots, prefill-emptied slots and never-routed experts alive at the time (docs/semantics.md §5.12)."""
    L, E, S = 3, 4, 9
    state = pc.init(L, E, S, rebase_threshold=20)
    ref = ReferenceCache(L, E, S, rebase_threshold=20)
    rng = np.random.default_rng(7)
    hybrid = JITTED["ensure_hybrid"]
    policies = [(pc.FetchPolicy.fraction(0.4), ReferencePolicy.fraction(0.4)),
                (pc.FetchPolicy.fixed_cap(1), ReferencePolicy.fixed_cap(1))]
    for step in range(200):
        layer = int(rng.integers(L))
        routes = rng.integers(-1, E, size=5).astype(np.int32)
        policy, ref_policy = policies[step % 2]
        state, plan = hybrid(state, layer, jnp.asarray(routes), policy, order="recency",
                             admission="reuse" if step % 3 else "promote_one")
        expected = ref.ensure_hybrid(layer, routes, ref_policy, order="recency",
                                     admission="reuse" if step % 3 else "promote_one")
        assert_same_plan(plan, expected, f"step {step}")
        if step % 17 == 0:
            state, _ = JITTED["forget_slot"](state, step % S)
            ref.forget_slot(step % S)
        assert_same_state(state, ref, f"step {step}")
        assert_invariants(state)
        assert int(_np(state.step)) <= 20 + 1
