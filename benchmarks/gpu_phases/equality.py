"""Phase ``equality``, first and at small sizes: the candidate backend against XLA, every state
and plan leaf, bit for bit. The cases (each eviction from a filled pool: plain, a rebase
threshold low enough to renumber during the run, a usable size below the capacity, ``vmap``
over three caches, then 8192 slots, the streamed two-block search) are scans of random calls;
the random operation sequences run every op (``ensure``, ``ensure_hybrid`` in both orders and
all three admissions, ``materialize_layer``, ``forget_slot``) from a cold and a nearly full
pool, compared step by step by the lockstep driver."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_cache as pc
from pallas_cache.testing import lockstep

from .common import (EVICTIONS, TOP_K, filled_state, fresh, full_state, log, named_leaves,
                     tree_difference)

NAME = "equality"
RECENCY, LOWEST_ID = pc.FetchOrder.RECENCY, pc.FetchOrder.LOWEST_ID
PROMOTE_ONE, NO_ADMISSION, REUSE = pc.Admission.PROMOTE_ONE, pc.Admission.NONE, pc.Admission.REUSE

# (label, eviction, L, E, usable size, capacity, rebase threshold or None, vmap batch or None);
# the first three of each eviction share one compiled program (the threshold and the usable
# size are traced leaves); a vmapped batch holds a plain cache, one with threshold 80 and one
# of usable size 40.
SMALL_CASES = tuple(
    case for e in EVICTIONS for case in (
        (e.upper(), e, 8, 16, 64, 64, None, None),
        (f"{e.upper()}, rebase threshold 80", e, 8, 16, 64, 64, 80, None),
        (f"{e.upper()}, usable 40 of capacity 64", e, 8, 16, 40, 64, None, None),
        (f"{e.upper()}, vmap over 3 caches (plain, threshold 80, usable 40)", e, 8, 16, 64, 64,
         80, 3)))
LARGE_CASES = tuple((f"{e.upper()}, 8192 slots (two blocks)", e, 16, 640, 8192, 8192, None, None)
                    for e in EVICTIONS)
SEQUENCE_GEOMETRY = (8, 16, 64)  # (L, E, S)
STARTS = ("cold", "nearly full")

# The ops of the sequences: one lax.switch branch each (order/admission are static).
OPS = (
    [("ensure", None, None)]
    + [("ensure_hybrid", order, admission) for order in (RECENCY, LOWEST_ID)
       for admission in (PROMOTE_ONE, NO_ADMISSION, REUSE)]
    + [("materialize_layer", None, None), ("forget_slot", None, None)]
)
OP_NAMES = [name if order is None else f"{name}({order.value},{admission.value})"
            for name, order, admission in OPS]
# ensure; hybrid (recency, promote_one) weighted up; the other five; materialize; forget.
OP_P = np.array([0.10, 0.26] + [0.09] * 5 + [0.04, 0.10])
OP_P = OP_P / OP_P.sum()
FRACTIONS = (0.4, 0.4, 0.4, 0.1, 0.25, 0.415, 0.5, 0.75, 1.0)
# Seconds on the GPU (guesses from the 111 s H200 run of an earlier version): a case that
# compiles its two programs, one that reuses them, a sequence's first start and its second.
ESTIMATE_S = {"case": 10.0, "case reuse": 1.0, "large case": 12.0, "sequence": 25.0,
              "sequence reuse": 1.5}


def plan(args):
    """``[(row, estimated seconds)]`` in run order: the 64-slot cases, the sequences, the
    8192-slot cases."""
    out, seen = [], set()
    for case in SMALL_CASES + LARGE_CASES:
        key = (case[1], case[2], case[3], case[5], case[7])
        kind = "large case" if case[5] > 4096 else "case"
        out.append(({"kind": "case", "label": case[0], "case": case},
                    ESTIMATE_S[kind if key not in seen else "case reuse"]))
        seen.add(key)
        if case is SMALL_CASES[-1]:
            for i, start in enumerate(STARTS):
                out.append(({"kind": "sequence", "start": start,
                             "label": f"L,E,S={SEQUENCE_GEOMETRY} {start} ({args.steps} ops)"},
                            ESTIMATE_S["sequence" if i == 0 else "sequence reuse"]))
    return out


def smoke_rows(rows):
    """A smoke run runs every equality check."""
    return rows


def run(ctx, row) -> dict:
    if row["kind"] == "case":
        return check_case(ctx, row["case"])
    return check_sequence(ctx, row["start"])


# --------------------------------------------------------------------------------------------
# The cases.
# --------------------------------------------------------------------------------------------

@functools.cache
def _case_program(eviction, backend, batched):
    """A jitted scan of random calls: ensure, ensure_hybrid in both orders, REUSE under LRU,
    each call picked by a switch; the state carried, every plan stacked. One per eviction,
    backend and batching: the cases of one shape reuse its compiled program."""
    ops = [lambda s, l, r, p: pc.ensure(s, l, r, backend=backend)]
    for order, admission in ((RECENCY, PROMOTE_ONE), (LOWEST_ID, NO_ADMISSION)) + (
            ((RECENCY, REUSE),) if eviction == "lru" else ()):
        ops.append(functools.partial(
            lambda s, l, r, p, o, a: pc.ensure_hybrid(s, l, r, p, order=o, admission=a,
                                                      backend=backend),
            o=order, a=admission))

    def run(state, xs):
        def body(s, x):
            op, layer, routes, fraction16 = x
            policy = pc.FetchPolicy(fraction16=fraction16, cap=layer % 4)
            return lax.switch(op, ops, s, layer, routes, policy)
        return lax.scan(body, state, xs)

    return jax.jit(jax.vmap(run) if batched else run)


def check_case(ctx, case) -> dict:
    label, eviction, L, E, S, C, threshold, batch = case
    args = ctx.args
    steps = args.case_steps
    rng = np.random.default_rng(args.seed + len(label))
    t0 = time.perf_counter()
    if batch is None:
        state = filled_state(rng, eviction, L, E, S, C, threshold, empty=4)
    else:  # plain, the threshold, usable 40: the traced leaves differ per member
        members = [filled_state(rng, eviction, L, E, size, C, thr, empty=4)
                   for size, thr in ((S, None), (S, threshold), (min(40, S), None))][:batch]
        state = jax.tree.map(lambda *x: jnp.stack(x), *members)
    lead = () if batch is None else (batch,)
    num_ops = 3 + (eviction == "lru")
    xs = (jnp.asarray(rng.integers(0, num_ops, (*lead, steps)), jnp.int32),
          jnp.asarray(np.where(rng.random((*lead, steps)) < 0.03, L,
                               rng.integers(0, L, (*lead, steps))), jnp.int32),
          jnp.asarray(rng.integers(-1, E, (*lead, steps, TOP_K)), jnp.int32),
          jnp.asarray(rng.choice([0, 16384, 32768, 65536], (*lead, steps)), jnp.int32))
    outs = []
    for backend in ctx.backends:
        try:
            outs.append(jax.device_get(_case_program(eviction, backend, batch is not None)(
                fresh(state), xs)))
        except Exception as exc:
            ctx.fail(f"FAIL [{label}]: backend {backend!r}: {type(exc).__name__}: {exc}")
            return {"status": "FAIL", "detail": type(exc).__name__}
    diff = tree_difference(outs[0], outs[1])
    fetched = int(np.asarray(outs[0][1].fetched).sum())
    detail = (f"{steps} calls, {fetched} fetches, final clock "
              f"{np.asarray(outs[0][0].step).ravel().tolist()}, "
              f"{time.perf_counter() - t0:.1f} s incl. compile")
    if diff:
        ctx.fail(f"MISMATCH [{label}] in: {', '.join(diff[:6])}")
    log(f"equality [{label}]: {'MISMATCH' if diff else 'MATCH'} ({detail})")
    return {"status": "MISMATCH" if diff else "match", "detail": detail}


# --------------------------------------------------------------------------------------------
# The random operation sequences, step by step.
# --------------------------------------------------------------------------------------------

def _pad_to(x, n: int):
    return jnp.concatenate([x, jnp.full((n - x.shape[0],), -1, x.dtype)]) if x.shape[0] < n else x


def _record(num_experts: int, plan=None, copy=None, error=None, forget_old=None):
    """One uniform per-step plan record, whatever the op (unused fields are -1 / False)."""
    minus1 = jnp.int32(-1)
    rec = {"slots": jnp.full((TOP_K,), -1, jnp.int32), "cpu": jnp.zeros((TOP_K,), jnp.bool_),
           "copy.dst_slots": jnp.full((num_experts,), -1, jnp.int32),
           "copy.src_rows": jnp.full((num_experts,), -1, jnp.int32), "copy.count": minus1,
           "active": minus1, "missing": minus1, "fetched": minus1, "error": minus1,
           "forget.old": minus1}
    if plan is not None:
        rec.update(slots=plan.slots, cpu=plan.cpu, active=plan.active, missing=plan.missing,
                   fetched=plan.fetched, error=plan.error)
        copy = plan.copy
    if copy is not None:
        rec["copy.dst_slots"] = _pad_to(copy.dst_slots, num_experts)
        rec["copy.src_rows"] = _pad_to(copy.src_rows, num_experts)
        rec["copy.count"] = copy.count
    if error is not None:
        rec["error"] = error
    if forget_old is not None:
        rec["forget.old"] = forget_old
    return {k: jnp.asarray(v) for k, v in rec.items()}


def _branches(num_experts: int, cache_size: int, backend: str):
    """One ``(state, x) -> (state, record)`` function per entry of OPS."""
    def do_ensure(state, x):
        state, plan = pc.ensure(state, x["layer"], x["routes"], backend=backend)
        return state, _record(num_experts, plan)

    def hybrid(order, admission):
        def do_hybrid(state, x):
            policy = pc.FetchPolicy(fraction16=x["f16"], cap=x["cap"])
            state, plan = pc.ensure_hybrid(state, x["layer"], x["routes"], policy,
                                           order=order, admission=admission, backend=backend)
            return state, _record(num_experts, plan)
        return do_hybrid

    def do_materialize(state, x):
        state, plan = pc.materialize_layer(state, x["layer"])
        return state, _record(num_experts, copy=plan.copy, error=plan.error)

    def do_forget(state, x):
        # sel >= 0: the (sel mod count)-th occupied slot (any slot if none); sel < 0: slot S (bad).
        occupied = state.residency.id_of_slot >= 0
        count = jnp.sum(occupied, dtype=jnp.int32)
        rank = jnp.cumsum(occupied.astype(jnp.int32)) - 1
        target = x["sel"] % jnp.maximum(count, 1)
        slot = jnp.argmax(occupied & (rank == target)).astype(jnp.int32)
        slot = jnp.where(count > 0, slot, x["sel"] % cache_size)
        slot = jnp.where(x["sel"] < 0, cache_size, slot).astype(jnp.int32)
        state, plan = pc.forget_slot(state, slot)
        return state, _record(num_experts, error=plan.error, forget_old=plan.old)

    named = {"ensure": do_ensure, "materialize_layer": do_materialize, "forget_slot": do_forget}
    return [named.get(name) or hybrid(order, admission) for name, order, admission in OPS]


@functools.partial(jax.jit, static_argnames=("backend",))
def run_sequence(state, xs, backend):
    branches = _branches(state.num_experts, state.capacity, backend)

    def body(state, x):
        state, rec = lax.switch(x["op"], branches, state, x)
        return state, {"plan": rec, "state": state}

    return lax.scan(body, state, xs)


def random_sequence(rng, L, E, S, steps):
    """Host arrays for one sequence: op, layer, routes[steps, TOP_K], f16, cap, sel."""
    ops = rng.choice(len(OPS), size=steps, p=OP_P).astype(np.int32)
    layers = np.empty(steps, np.int32)
    routes = np.empty((steps, TOP_K), np.int32)
    f16 = np.empty(steps, np.int32)
    cap = np.empty(steps, np.int32)
    sel = rng.integers(0, 2**30, size=steps).astype(np.int32)
    hot = rng.choice(L, size=min(L, 4), replace=False)
    weights = np.arange(1, E + 1, dtype=np.float64) ** -1.1
    layer_p = [weights[rng.permutation(E)] / weights.sum() for _ in range(L)]
    previous = [rng.choice(E, TOP_K, replace=False) for _ in range(L)]
    seen = [set() for _ in range(L)]  # experts routed at each layer so far
    for t in range(steps):
        layer = int(rng.choice(hot)) if rng.random() < 0.7 else int(rng.integers(L))
        if rng.random() < 0.6:
            # Sticky: swap 0-2 experts of this layer's previous routes, preferably for experts
            # routed before (recurring misses: the PROMOTE_ONE and REUSE paths).
            r = previous[layer].copy()
            for _ in range(int(rng.choice([0, 1, 1, 2]))):
                outside = np.setdiff1d(np.arange(E), r)
                recurring = np.array(sorted(seen[layer] - set(r.tolist())), dtype=np.int64)
                pool = recurring if len(recurring) and rng.random() < 0.7 else outside
                r[rng.integers(TOP_K)] = rng.choice(pool)
        else:  # a fresh skewed draw
            r = rng.choice(E, TOP_K, replace=False, p=layer_p[layer])
        previous[layer] = r.copy()
        seen[layer].update(r.tolist())
        r = r.astype(np.int32)
        if rng.random() < 0.08:  # duplicates
            r[rng.integers(TOP_K)] = r[rng.integers(TOP_K)]
        if rng.random() < 0.06:  # padding rows
            r[rng.random(TOP_K) < 0.4] = -1
        if rng.random() < 0.01:  # a bad expert id -> ERR_EXPERT_ID
            r[rng.integers(TOP_K)] = E
        if rng.random() < 0.01:  # a bad layer -> ERR_LAYER
            layer = int(rng.choice([-1, L]))
        if rng.random() < 0.03:  # a bad slot for forget_slot -> ERR_SLOT
            sel[t] = -1
        kind = rng.random()
        if kind < 0.6:
            policy = pc.FetchPolicy.fraction(float(rng.choice(FRACTIONS)))
        elif kind < 0.85:
            policy = pc.FetchPolicy.fixed_cap(int(rng.choice([0, 1, 1, 2, 3, 100])))
        else:
            policy = pc.FetchPolicy.full()
        layers[t], routes[t] = layer, r
        f16[t], cap[t] = int(policy.fraction16), int(policy.cap)
    return {"op": ops, "layer": layers, "routes": routes, "f16": f16, "cap": cap, "sel": sel}


def scan_steps(ys):
    """One scanned run's outputs step by step: ``[(dotted name, host array)]`` per step."""
    leaves = named_leaves(ys)
    for step in range(leaves[0][1].shape[0]):
        yield [(name, leaf[step]) for name, leaf in leaves]


def compare_leaves(context, op, expected, got):
    """Every leaf bit for bit; raises naming each field that differs (its first index, both
    values)."""
    if [n for n, _ in expected] != [n for n, _ in got]:
        raise AssertionError(f"{context}: tree structure {[n for n, _ in expected]} vs "
                             f"{[n for n, _ in got]}")
    fields = []
    for (name, a), (_, b) in zip(expected, got):
        if a.shape != b.shape or a.dtype != b.dtype:
            fields.append(f"field {name}: xla={a.dtype}{a.shape} candidate={b.dtype}{b.shape}")
        elif not np.array_equal(a, b):
            idx = tuple(int(i) for i in np.argwhere(a != b)[0]) if a.ndim else ()
            fields.append(f"field {name}{list(idx) if idx else ''}: xla={a[idx].tolist()} "
                          f"candidate={b[idx].tolist()}")
    if fields:
        raise AssertionError("\n    ".join([context] + fields))


def sequence_ops(xs):
    """The ops of a :func:`random_sequence` as labels for the lockstep driver's messages (the
    scan runs them from arrays, not as operation records)."""
    return [f"{OP_NAMES[op]}(layer={int(layer)}, routes={np.asarray(routes).tolist()}, "
            f"fraction16={int(f16)}, cap={int(cap)})"
            for op, layer, routes, f16, cap in zip(xs["op"], xs["layer"], xs["routes"],
                                                   xs["f16"], xs["cap"])]


def coverage(xs, ys, init_state) -> str:
    """How often each interesting path ran, from the xla run."""
    plan = {n: a for n, a in named_leaves(ys["plan"])}
    ids_after = np.asarray(ys["state"].residency.id_of_slot)
    ids_before = np.concatenate([np.asarray(init_state.residency.id_of_slot)[None], ids_after[:-1]])
    op = xs["op"]
    hybrid = (op >= 1) & (op <= 6)
    fetched, missing, error = plan["fetched"], plan["missing"], plan["error"]
    split = np.asarray(pc.FetchPolicy(fraction16=jnp.asarray(xs["f16"]),
                                      cap=jnp.asarray(xs["cap"])).split(jnp.asarray(missing)))
    promotions = int((hybrid & (xs["f16"] > 0) & (split == 0) & (fetched == 1)
                      & (error == 0)).sum())
    dst, count = plan["copy.dst_slots"], plan["copy.count"]
    evictions = sum(int((ids_before[t][dst[t][: max(int(count[t]), 0)]] >= 0).sum())
                    for t in np.nonzero(op <= 6)[0])
    return (f"fetching calls {int(((op <= 6) & (fetched > 0)).sum())}, promotions {promotions}, "
            f"evictions {evictions}, CPU routes {int(plan['cpu'].sum())}, "
            f"errors {int((error > 0).sum())}, materialize {int((op == 7).sum())}, "
            f"forget {int((op == 8).sum())} (of which dropped an expert "
            f"{int(((op == 8) & (plan['forget.old'] >= 0)).sum())})")


def check_sequence(ctx, start) -> dict:
    """One random sequence from a cold or a nearly full pool, on xla and the candidate."""
    L, E, S = SEQUENCE_GEOMETRY
    args = ctx.args
    label = f"L={L},E={E},S={S}, {start} start"
    rng = np.random.default_rng(args.seed + STARTS.index(start))
    state0 = (pc.init(L, E, S) if start == "cold"
              else pc.set_collect_routing(full_state(rng, L, E, S, empty=4), True))
    xs = random_sequence(rng, L, E, S, args.steps)
    dxs = jax.tree.map(jnp.asarray, xs)
    t0 = time.perf_counter()
    out = []
    for backend in ctx.backends:
        try:
            out.append(jax.block_until_ready(run_sequence(state0, dxs, backend=backend)[1]))
        except Exception as exc:  # compile or run failure of a backend
            ctx.fail(f"FAIL [{label}]: backend {backend!r} failed to compile or run the "
                     f"sequence: {type(exc).__name__}: {exc}")
            return {"status": "FAIL", "detail": type(exc).__name__}
    secs = time.perf_counter() - t0
    try:
        lockstep.run(sequence_ops(xs), scan_steps(out[0]),
                     {args.candidate: scan_steps(out[1])}, compare_leaves)
    except AssertionError as mismatch:
        ctx.fail("!" * 100 + f"\nMISMATCH [{label}] at {mismatch}\n" + "!" * 100)
        return {"status": "MISMATCH", "detail": str(mismatch).split(":")[0]}
    cov = coverage(xs, out[0], state0)
    log(f"equality [{label}, {args.steps} ops]: MATCH ({secs:.1f} s incl. compile) -- {cov}")
    return {"status": "match", "detail": f"{args.steps} random ops, {cov}"}


def markdown(args, done) -> list[str]:
    lines = [f"Equality ({args.candidate} vs xla, every state and plan leaf; the cases "
             f"{args.case_steps} random calls from a filled pool, the sequences compared step "
             "by step):", ""]
    for row, result in done:
        lines.append(f"- {row['label']}: {result['status']}"
                     + (f" ({result['detail']})" if result.get("detail") else ""))
    return lines
