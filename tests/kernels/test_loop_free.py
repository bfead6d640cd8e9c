"""The per-call ops are loop-free outside their kernels and their static rules compile away
(docs/semantics.md §7.1, docs/design.md "A loop-free step"): every op traced with a traced layer,
for every backend, every sub-jaxpr walked except the bodies of ``pallas_call``."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
import pytest

import pallas_cache as pc
from benchmarks.lowering import count_ops
from pallas_cache.ops import Rules, ensure_with_rules

L, E, S, K = 4, 16, 32, 8
BACKENDS = ("xla", "interpret", "pallas")


def _sub_jaxprs(value):
    if isinstance(value, jex_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def primitives(jaxpr, *, into_kernels=False):
    """Every primitive name in ``jaxpr`` and its sub-jaxprs, not entering ``pallas_call`` bodies
    (their name is still listed) unless ``into_kernels``."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call" and not into_kernels:
            continue
        for param in eqn.params.values():
            for sub in _sub_jaxprs(param):
                names.extend(primitives(sub, into_kernels=into_kernels))
    return names


def kernel_names(jaxpr):
    """The ``name`` of every ``pallas_call`` in ``jaxpr`` (with its sub-jaxprs)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            info = eqn.params.get("name_and_src_info") or eqn.params.get("name")
            found.append(str(getattr(info, "name", info)))
            continue
        for param in eqn.params.values():
            for sub in _sub_jaxprs(param):
                found.extend(kernel_names(sub))
    return found


def trace(fn, *args):
    return jax.make_jaxpr(fn)(*args).jaxpr


STATE = pc.init(L, E, S)
LAYER = jnp.int32(1)
ROUTES = jnp.arange(K, dtype=jnp.int32)
POLICY = pc.FetchPolicy.fraction(0.4)


def ops_under_test(backend):
    yield "ensure", lambda s, l, r: pc.ensure(s, l, r, backend=backend)
    for order, admission in itertools.product(pc.FetchOrder, pc.Admission):
        yield (f"ensure_hybrid[{order.value},{admission.value}]",
               lambda s, l, r, o=order, a=admission: pc.ensure_hybrid(
                   s, l, r, POLICY, order=o, admission=a, backend=backend))
    yield "ensure_with_rules[traced rules]", lambda s, l, r: ensure_with_rules(
        s, l, r, POLICY,
        jax.tree.map(jnp.asarray, Rules.of(hybrid=True, order="recency", admission="reuse")),
        backend=backend)


OTHER_OPS = {
    "materialize_layer": lambda s, l, r: pc.materialize_layer(s, l),
    "forget_slot": lambda s, l, r: pc.forget_slot(s, l),
    "begin_prefill": lambda s, l, r: pc.begin_prefill(s),
    "prefetch_prefill_layer": lambda s, l, r: pc.prefetch_prefill_layer(
        pc.begin_prefill(s), l, (1 << 20,)),
    "release_prefill_layer": lambda s, l, r: pc.release_prefill_layer(pc.begin_prefill(s), l),
    "resize": lambda s, l, r: pc.resize(s, l + E),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_while_loop_outside_kernels(backend):
    """FAILS if any per-call op (ensure, every ensure_hybrid order x admission, the rules-as-data
    core, materialize_layer, forget_slot, the prefill ops, resize) traces to a ``while`` primitive outside
    a Pallas kernel, e.g. a fetch order or victim search looping once per miss."""
    offenders = {}
    ops = dict(ops_under_test(backend))
    ops.update(OTHER_OPS)
    for name, fn in ops.items():
        prims = primitives(trace(fn, STATE, LAYER, ROUTES))
        if "while" in prims:
            offenders[name] = prims.count("while")
    assert not offenders, f"backend={backend}: while loops in {offenders}"


def test_walker_sees_loops_in_scans_and_kernels():
    """FAILS if the walker misses a ``while`` nested in a scan/cond, or enters kernel bodies
    (which would make every pallas-backend op look loopy: the fused kernel loops on device)."""
    def loopy(x):
        inner = lambda c: jax.lax.while_loop(lambda v: v < x, lambda v: v + 1, c)
        return jax.lax.scan(lambda c, _: (jax.lax.cond(c > 0, inner, lambda v: v, c), None),
                            x, None, length=2)[0]

    assert "while" in primitives(trace(loopy, jnp.int32(3)))
    kernel = trace(lambda s, l, r: pc.ensure(s, l, r, backend="pallas"), STATE, LAYER, ROUTES)
    assert "pallas_call" in primitives(kernel)
    assert "while" not in primitives(kernel)
    assert "while" in primitives(kernel, into_kernels=True)


@pytest.mark.parametrize("backend", ["pallas", "interpret"])
def test_one_kernel_per_ensure(backend):
    """FAILS if a call of ``ensure`` or ``ensure_hybrid`` (PROMOTE_ONE or NONE) launches anything
    but the one fused step kernel, e.g. a separate victims or promotion kernel."""
    for fn in (lambda s, l, r: pc.ensure(s, l, r, backend=backend),
               lambda s, l, r: pc.ensure_hybrid(s, l, r, POLICY, admission="none",
                                                backend=backend),
               lambda s, l, r: pc.ensure_hybrid(s, l, r, POLICY, backend=backend)):
        assert kernel_names(trace(fn, STATE, LAYER, ROUTES)) == ["pallas_cache_step"]


def _size(fn):
    return len(primitives(trace(fn, STATE, LAYER, ROUTES)))


def test_static_rules_compile_away():
    """FAILS if ``order``/``admission``/hybrid-ness reach the core as traced flags: then plain
    ``ensure``, ``Admission.NONE`` and ``LOWEST_ID`` trace the same program as the richest rule
    set (the promotion and REUSE paths computed and then discarded by a ``select``)."""
    hybrid = lambda order, admission: (lambda s, l, r: pc.ensure_hybrid(
        s, l, r, POLICY, order=order, admission=admission, backend="xla"))
    traced = _size(lambda s, l, r: ensure_with_rules(
        s, l, r, POLICY,
        jax.tree.map(jnp.asarray, Rules.of(hybrid=True, order="recency", admission="reuse"))))
    plain = _size(lambda s, l, r: pc.ensure(s, l, r, backend="xla"))
    none = _size(hybrid("recency", "none"))
    promote = _size(hybrid("recency", "promote_one"))
    reuse = _size(hybrid("recency", "reuse"))
    lowest = _size(hybrid("lowest_id", "reuse"))
    assert none < promote < traced and none < reuse < traced, (none, promote, reuse, traced)
    assert plain < none and lowest < none, (plain, lowest, none)
    # LOWEST_ID ignores the admission rule entirely (docs/semantics.md §5.5): one program.
    assert _size(hybrid("lowest_id", "promote_one")) == lowest


def test_lowered_programs_shrink_with_the_rules():
    """FAILS if the lowered (StableHLO) program of plain ``ensure`` or of ``Admission.NONE`` is as
    large as the one with PROMOTE_ONE / REUSE, i.e. if the unused paths still reach the compiled
    program (as they did when the core took the rules as traced flags). Counted by the one op
    counter, ``benchmarks.lowering.count_ops`` (docs/semantics.md §7's rule)."""
    def size(fn):
        return count_ops(jax.jit(fn).lower(STATE, LAYER, ROUTES).as_text())[1]

    hybrid = lambda admission: size(lambda s, l, r: pc.ensure_hybrid(
        s, l, r, POLICY, admission=admission, backend="xla"))
    plain = size(lambda s, l, r: pc.ensure(s, l, r, backend="xla"))
    none, promote, reuse = hybrid("none"), hybrid("promote_one"), hybrid("reuse")
    assert plain < none < promote and none < reuse, (plain, none, promote, reuse)


def _batch(tree, n=2):
    return jax.tree.map(lambda x: jnp.stack([x] * n), tree)


@pytest.mark.parametrize("nesting", ["vmap inside checkify", "checkify inside vmap"])
def test_checked_under_vmap(nesting):
    """FAILS if ``pc.checked`` cannot be used on a vmapped op in either nesting (checkify refuses
    batched while-loops, which the fetch order and the victim search used to be), or if the
    failing lane's error does not surface while the clean batch passes."""
    from jax.experimental import checkify

    def one(state, routes):
        state, plan = pc.ensure_hybrid(state, LAYER, routes, POLICY)
        return pc.checked(plan)

    if nesting == "vmap inside checkify":
        run = checkify.checkify(jax.jit(jax.vmap(one)))
    else:
        run = jax.jit(jax.vmap(checkify.checkify(one)))
    states = _batch(STATE)
    good = jnp.stack([ROUTES, ROUTES[::-1]])
    err, plan = run(states, good)
    assert err.get() is None
    assert plan.fetched.shape == (2,) and int(plan.fetched.sum()) > 0
    bad = good.at[1, 0].set(E)  # lane 1 routes an expert outside [-1, E)
    err, plan = run(states, bad)
    assert err.get() is not None and "error bits 1" in err.get()
    assert plan.error.tolist() == [0, pc.ERR_EXPERT_ID]
    with pytest.raises(checkify.JaxRuntimeError):
        err.throw()
