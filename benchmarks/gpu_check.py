"""GPU check: the Pallas backend against the XLA backend, for equality and for speed (docs/semantics.md §7).

A prepared script for the one lent GPU machine (an NVIDIA H200, stock image: Python 3.12,
jax 0.11.x, numpy; no network, no installs, no chex/hypothesis). It needs no install: it puts
the repository root on ``sys.path`` itself. Run it from the repository root::

    PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py --out $OUT/gpu_check.md

It must finish in under 5 minutes, compiles included; ``--budget-seconds`` (default 240) makes
it skip the timing rows that would not fit (they are reported as skipped). Exit status: 0 when
everything matched and every scenario check held, 1 on any pallas/xla difference (or a backend
that failed to compile or run), 2 when a timing scenario was not what it claims to be, 3 when
there is no GPU (use ``--cpu-smoke`` there).

What it checks
--------------
(a) **Equality.** For two geometries -- the seed-000 toy (L=8, E=16, S=64) and a large MoE
    (L=48, E=128, S=2048), top-8 routes -- a seeded random operation sequence runs as **one
    compiled ``lax.scan``** per backend, with a traced layer and a ``lax.switch`` over every op:
    ``ensure``; ``ensure_hybrid`` with fraction / fixed-cap / full policies (traced), both fetch
    orders and all three admission rules (static, one switch branch each); ``materialize_layer``;
    ``forget_slot`` (mostly an occupied slot, sometimes a bad one). Routes are sticky per layer
    (so one or two misses per call, where the split rounds to zero and PROMOTE_ONE decides), with
    duplicates, padding, and the odd bad expert id or layer (error paths). Each geometry runs
    twice: from a cold cache, and from a pool filled to all but 4 slots (evictions of occupied
    slots, promotion into the last empty ones) with routing collection on. The scan emits the
    whole state and the whole plan after every step; every leaf must be equal, bit for bit,
    between "pallas" and "xla". The first difference is reported with its geometry, sequence,
    step, op and field, and the exit status is 1. A coverage line says how often each path ran
    (fetches, promotions, evictions, CPU routes, errors).

(b) **Timing.** The per-layer-call cost of ``ensure_hybrid`` (fraction 0.4, RECENCY,
    PROMOTE_ONE) inside a compiled decode loop: one jitted ``lax.scan`` of ``--calls`` (128)
    layer-calls (layer = call % L), dispatched ``--replays`` (20) times back to back, then
    ``block_until_ready``; the median over ``--repeats`` (9) trials, pallas and xla alternating
    (the seed-000 protocol). Two scenarios of the seed-000 table, both on a **full** pool:

    * "all hits": every call routes 8 resident experts of its layer.
    * "full cache, one recurring miss": every call routes 7 resident experts and one expert that
      is not resident but was routed before. At fraction 0.4 the split of one miss is 0, and the
      pool has no empty slot, so PROMOTE_ONE never fires: the miss stays a CPU route on every call.
      The script **verifies** this (per call: 7 device routes + 1 CPU route, nothing fetched,
      no empty slot, the missing expert's recency >= 0; and no fetch during the whole timing run)
      and prints the verdict; a failed verdict exits with status 2.

    Note: these numbers are a whole decode-loop iteration of a JAX program (XLA control flow of
    the scan included), not the seed's CUDA-graph replay of one kernel, so compare the
    pallas/xla ratio, not the absolute values, with the seed table.

(c) **Host sync.** The per-step time of one compiled ``lax.scan`` of ``--loop-steps`` (1,000)
    ``ensure_hybrid`` layer-calls, both backends, median of ``--repeats``: once with every call
    a hit, once with uniform top-8 routes from ``synthetic_trace`` (several misses and fetches
    per call). The step has no data-dependent loop outside its kernels (docs/semantics.md
    §7.1), so the two should cost about the same; a step that read a loop predicate back to the
    host per miss would show tens of microseconds more per step with misses.

(d) ``--cpu-smoke``: the same on the CPU with backend "interpret" standing in for "pallas",
    fewer steps and repeats -- to test this script without a GPU. The CUDA lowering itself is
    checked without a GPU by tests/test_kernels_lowering.py.

Output: the jax version, the device kind, whether every comparison matched, and the tables;
``--out FILE`` also writes them as the ``gpu_check`` section of FILE (``results_file``: pass
benchmarks/RESULTS.md, or a file under ``$OUT`` on a lent machine).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

# Parsed before jax is imported, so --cpu-smoke can pin the CPU platform.
_CPU_SMOKE = "--cpu-smoke" in sys.argv[1:]
if _CPU_SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # be gentle with a shared GPU

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jaxlib  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

try:
    import pallas_cache as pc  # noqa: E402
except Exception:  # e.g. a jax without the Pallas Triton backend the kernels import
    traceback.print_exc()
    print(f"FAILED: cannot import pallas_cache from {REPO} with jax {jax.__version__}",
          file=sys.stderr)
    sys.exit(1)
from pallas_cache.sizing.synthetic import SyntheticParams, synthetic_trace  # noqa: E402
from results_file import write_section  # noqa: E402

TOP_K = 8
FRACTION = 0.4
GEOMETRIES = ((8, 16, 64), (48, 128, 2048))  # (L, E, S)

RECENCY, LOWEST_ID = pc.FetchOrder.RECENCY, pc.FetchOrder.LOWEST_ID
PROMOTE_ONE, NO_ADMISSION, REUSE = pc.Admission.PROMOTE_ONE, pc.Admission.NONE, pc.Admission.REUSE

# The ops of the equality sequences: one lax.switch branch each (order/admission are static).
OPS = (
    [("ensure", None, None)]
    + [("ensure_hybrid", order, admission) for order in (RECENCY, LOWEST_ID)
       for admission in (PROMOTE_ONE, NO_ADMISSION, REUSE)]
    + [("materialize_layer", None, None), ("forget_slot", None, None)]
)
OP_NAMES = [name if order is None else f"{name}({order.value},{admission.value})"
            for name, order, admission in OPS]
# ensure; hybrid (recency, promote_one) -- the seed-000 path -- weighted up; the other five
# hybrids; materialize_layer; forget_slot.
OP_P = np.array([0.10, 0.26] + [0.09] * 5 + [0.04, 0.10])
OP_P = OP_P / OP_P.sum()
FRACTIONS = (0.4, 0.4, 0.4, 0.1, 0.25, 0.415, 0.5, 0.75, 1.0)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Pytree helpers.
# --------------------------------------------------------------------------------------------

def _key_name(key) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def named_leaves(tree) -> list[tuple[str, np.ndarray]]:
    """``[(dotted name, host array)]`` for every leaf, e.g. ``('state.usage', ...)``."""
    flat, _ = jax.tree.flatten_with_path(tree)
    return [(".".join(_key_name(k) for k in path), np.asarray(leaf)) for path, leaf in flat]


# --------------------------------------------------------------------------------------------
# (a) Equality: random operation sequences as one compiled scan per backend.
# --------------------------------------------------------------------------------------------

def _pad_to(x, n: int):
    return jnp.concatenate([x, jnp.full((n - x.shape[0],), -1, x.dtype)]) if x.shape[0] < n else x


def _record(num_experts: int, plan=None, copy=None, error=None, forget_old=None):
    """One uniform per-step plan record, whatever the op (unused fields are -1 / False)."""
    minus1 = jnp.int32(-1)
    rec = {
        "slots": jnp.full((TOP_K,), -1, jnp.int32),
        "cpu": jnp.zeros((TOP_K,), jnp.bool_),
        "copy.dst_slots": jnp.full((num_experts,), -1, jnp.int32),
        "copy.src_rows": jnp.full((num_experts,), -1, jnp.int32),
        "copy.count": minus1,
        "active": minus1,
        "missing": minus1,
        "fetched": minus1,
        "error": minus1,
        "forget.old": minus1,
    }
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

    def policy_of(x):
        return pc.FetchPolicy(fraction16=x["f16"], cap=x["cap"])

    def do_ensure(state, x):
        state, plan = pc.ensure(state, x["layer"], x["routes"], backend=backend)
        return state, _record(num_experts, plan)

    def hybrid(order, admission):
        def do_hybrid(state, x):
            state, plan = pc.ensure_hybrid(state, x["layer"], x["routes"], policy_of(x),
                                           order=order, admission=admission, backend=backend)
            return state, _record(num_experts, plan)
        return do_hybrid

    def do_materialize(state, x):
        state, plan = pc.materialize_layer(state, x["layer"])
        return state, _record(num_experts, copy=plan.copy, error=plan.error)

    def do_forget(state, x):
        # sel >= 0: the (sel mod count)-th occupied slot (any slot if none); sel < 0: slot S (bad).
        occupied = state.id_of_slot >= 0
        count = jnp.sum(occupied, dtype=jnp.int32)
        rank = jnp.cumsum(occupied.astype(jnp.int32)) - 1
        target = x["sel"] % jnp.maximum(count, 1)
        slot = jnp.argmax(occupied & (rank == target)).astype(jnp.int32)
        slot = jnp.where(count > 0, slot, x["sel"] % cache_size)
        slot = jnp.where(x["sel"] < 0, cache_size, slot).astype(jnp.int32)
        state, plan = pc.forget_slot(state, slot)
        return state, _record(num_experts, error=plan.error, forget_old=plan.old)

    fns = []
    for name, order, admission in OPS:
        fns.append({"ensure": do_ensure, "materialize_layer": do_materialize,
                    "forget_slot": do_forget}.get(name) or hybrid(order, admission))
    return fns


def _run_sequence_impl(state, xs, backend):
    E, S = state.num_experts, state.capacity  # a static slot count (capacity == usable size here)
    branches = _branches(E, S, backend)

    def body(state, x):
        state, rec = lax.switch(x["op"], branches, state, x)
        return state, {"plan": rec, "state": state}

    return lax.scan(body, state, xs)


run_sequence = jax.jit(_run_sequence_impl, static_argnames=("backend",))


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


def _fill_impl(state, layers, routes):
    def body(state, x):
        state, _ = pc.ensure(state, x[0], x[1], backend="xla")
        return state, None
    return lax.scan(body, state, (layers, routes))[0]


_fill = jax.jit(_fill_impl)


def chunked_routes(rng, per_layer: dict):
    """``ensure`` calls that make the given experts resident: (layers, routes[n, TOP_K])."""
    layers, routes = [], []
    for layer in sorted(per_layer):
        experts = np.asarray(per_layer[layer], np.int32)
        for i in range(0, len(experts), TOP_K):
            chunk = np.full(TOP_K, -1, np.int32)
            part = experts[i:i + TOP_K]
            chunk[:len(part)] = part
            layers.append(layer)
            routes.append(chunk)
    order = rng.permutation(len(layers))  # interleave layers, so usage stamps are mixed
    return np.asarray(layers, np.int32)[order], np.asarray(routes, np.int32)[order]


def nearly_full_state(rng, L, E, S, empty: int = 4):
    """A pool filled (by real ensure calls, xla backend) to all but ``empty`` slots."""
    flat = rng.choice(L * E, size=S - empty, replace=False)
    per_layer: dict = {}
    for f in flat:
        per_layer.setdefault(int(f) // E, []).append(int(f) % E)
    layers, routes = chunked_routes(rng, per_layer)
    state = _fill(pc.init(L, E, S), jnp.asarray(layers), jnp.asarray(routes))
    ids = np.asarray(state.id_of_slot)
    assert int((ids < 0).sum()) == empty, "warm-up fill left the wrong number of empty slots"
    return pc.set_collect_routing(state, True)


def first_difference(ys_ref, ys_cand):
    """``None`` if equal, else ``(step, [(field, index, xla value, candidate value), ...])``."""
    ref, cand = named_leaves(ys_ref), named_leaves(ys_cand)
    if [n for n, _ in ref] != [n for n, _ in cand]:
        return 0, [("<tree structure>", (), [n for n, _ in ref], [n for n, _ in cand])]
    first_step, fields = None, []
    for (name, a), (_, b) in zip(ref, cand):
        if a.shape != b.shape or a.dtype != b.dtype:
            return 0, [(name, (), f"{a.dtype}{a.shape}", f"{b.dtype}{b.shape}")]
        bad = (a != b).reshape(a.shape[0], -1).any(axis=1)
        if not bad.any():
            continue
        step = int(np.argmax(bad))
        if first_step is None or step < first_step:
            first_step, fields = step, []
        if step == first_step:
            idx = tuple(int(i) for i in np.argwhere(a[step] != b[step])[0]) if a.ndim > 1 else ()
            fields.append((name, idx, a[step][idx].tolist(), b[step][idx].tolist()))
    return None if first_step is None else (first_step, fields)


def coverage(xs, ys, init_state) -> str:
    """How often each interesting path ran, from the xla run (both backends agree if we get here)."""
    plan = {n: a for n, a in named_leaves(ys["plan"])}
    ids_after = np.asarray(ys["state"].id_of_slot)
    ids_before = np.concatenate([np.asarray(init_state.id_of_slot)[None], ids_after[:-1]])
    op = xs["op"]
    hybrid = (op >= 1) & (op <= 6)
    fetched, missing, error = plan["fetched"], plan["missing"], plan["error"]
    split = np.asarray(pc.FetchPolicy(fraction16=jnp.asarray(xs["f16"]),
                                      cap=jnp.asarray(xs["cap"])).split(jnp.asarray(missing)))
    promotions = int((hybrid & (xs["f16"] > 0) & (split == 0) & (fetched == 1)
                      & (error == 0)).sum())
    dst = plan["copy.dst_slots"]
    count = plan["copy.count"]
    evictions = 0
    for t in np.nonzero(op <= 6)[0]:
        d = dst[t][: max(int(count[t]), 0)]
        evictions += int((ids_before[t][d] >= 0).sum())
    return (f"fetching calls {int(((op <= 6) & (fetched > 0)).sum())}, promotions {promotions}, "
            f"evictions {evictions}, CPU routes {int(plan['cpu'].sum())}, "
            f"errors {int((error > 0).sum())}, materialize {int((op == 7).sum())}, "
            f"forget {int((op == 8).sum())} (of which dropped an expert "
            f"{int(((op == 8) & (plan['forget.old'] >= 0)).sum())})")


def check_equality(L, E, S, steps, candidate, seed, results) -> bool:
    """Runs the cold and the nearly-full sequence of one geometry on xla and ``candidate``."""
    geometry = f"L={L},E={E},S={S}"
    ok = True
    rng = np.random.default_rng(seed)
    starts = (("cold", pc.init(L, E, S)), ("nearly full", nearly_full_state(rng, L, E, S)))
    for label, state0 in starts:
        xs = random_sequence(rng, L, E, S, steps)
        dxs = jax.tree.map(jnp.asarray, xs)
        t0 = time.perf_counter()
        out = []
        for backend in ("xla", candidate):
            try:
                _, ys = run_sequence(state0, dxs, backend=backend)
                out.append(jax.block_until_ready(ys))
            except Exception as exc:  # compile or run failure of a backend
                traceback.print_exc()
                msg = (f"FAIL [{geometry}, {label} start]: backend {backend!r} failed to compile "
                       f"or run the sequence: {type(exc).__name__}: {exc}")
                print(msg, flush=True)
                results["failures"].append(msg)
                return False
        secs = time.perf_counter() - t0
        diff = first_difference(out[0], out[1])
        if diff is None:
            cov = coverage(xs, out[0], state0)
            log(f"equality [{geometry}, {label} start, {steps} steps]: MATCH ({secs:.1f} s incl. "
                f"compile) -- {cov}")
            results["equality"].append((geometry, label, steps, "match", cov))
        else:
            ok = False
            step, fields = diff
            where = (f"op {OP_NAMES[xs['op'][step]]}, layer {xs['layer'][step]}, routes "
                     f"{xs['routes'][step].tolist()}, fraction16 {xs['f16'][step]}, cap "
                     f"{xs['cap'][step]}")
            lines = [f"MISMATCH [{geometry}, {label} start] at step {step} ({where}):"]
            for name, idx, a, b in fields:
                lines.append(f"    field {name}{list(idx) if idx else ''}: xla={a} {candidate}={b}")
            msg = "\n".join(lines)
            print("!" * 100 + "\n" + msg + "\n" + "!" * 100, flush=True)
            results["failures"].append(msg)
            results["equality"].append((geometry, label, steps, f"MISMATCH at step {step}",
                                        ", ".join(f[0] for f in fields)))
    return ok


# --------------------------------------------------------------------------------------------
# (b) Timing: ensure_hybrid per layer-call inside a compiled decode loop.
# --------------------------------------------------------------------------------------------

def _checksum(plan):
    """A cheap reduction of the whole plan, carried through the loop so nothing is dead code."""
    return (jnp.sum(plan.slots) + jnp.sum(plan.cpu.astype(jnp.int32)) + plan.copy.count
            + jnp.sum(plan.copy.dst_slots) + jnp.sum(plan.copy.src_rows) + plan.missing
            + plan.error)


def _decode_impl(state, acc, layers, routes, policy, backend, unroll):
    def body(carry, x):
        state, acc = carry
        state, plan = pc.ensure_hybrid(state, x[0], x[1], policy, backend=backend)
        return (state, acc + _checksum(plan)), None
    return lax.scan(body, (state, acc), (layers, routes), unroll=unroll)[0]


decode = jax.jit(_decode_impl, static_argnames=("backend", "unroll"))


def _decode_trace_impl(state, layers, routes, policy, backend):
    """The same loop, emitting what the scenario check needs about every call."""
    def body(state, x):
        layer, r = x
        empty_before = jnp.sum(state.id_of_slot < 0, dtype=jnp.int32)
        recency_before = jnp.min(state.recency[layer][r])
        state, plan = pc.ensure_hybrid(state, layer, r, policy, backend=backend)
        out = {"device": jnp.sum(plan.slots >= 0, dtype=jnp.int32),
               "cpu": jnp.sum(plan.cpu, dtype=jnp.int32), "missing": plan.missing,
               "fetched": plan.fetched, "error": plan.error, "empty_before": empty_before,
               "min_recency_before": recency_before}
        return state, out
    return lax.scan(body, state, (layers, routes))


decode_trace = jax.jit(_decode_trace_impl, static_argnames=("backend",))


@functools.lru_cache(maxsize=None)
def timing_fixture(L, E, S, seed):
    """A full pool and two route tables [L, TOP_K] (all hits; 7 hits + 1 non-resident)."""
    rng = np.random.default_rng(seed)
    counts = [S // L + (1 if layer < S % L else 0) for layer in range(L)]
    assert min(counts) >= TOP_K and max(counts) < E, "geometry cannot host the scenarios"
    resident, hit_routes, miss_routes = {}, [], []
    for layer, n in enumerate(counts):
        experts = rng.permutation(E)
        resident[layer] = experts[:n]
        hit_routes.append(experts[:TOP_K])
        miss = experts[n]  # not resident
        row = np.concatenate([experts[:TOP_K - 1], [miss]])
        miss_routes.append(rng.permutation(row))
    layers, routes = chunked_routes(rng, resident)
    state = _fill(pc.init(L, E, S), jnp.asarray(layers), jnp.asarray(routes))
    ids = np.asarray(state.id_of_slot)
    assert (ids >= 0).all(), "timing fixture: the pool is not full"
    return state, np.asarray(hit_routes, np.int32), np.asarray(miss_routes, np.int32)


SCENARIOS = ("all hits", "full cache, one recurring miss")


def scenario_check(scenario, trace) -> tuple[bool, str]:
    t = {k: np.asarray(v) for k, v in trace.items()}
    if scenario == "all hits":
        ok = ((t["device"] == TOP_K).all() and (t["cpu"] == 0).all() and (t["missing"] == 0).all()
              and (t["fetched"] == 0).all() and (t["error"] == 0).all())
        return ok, "every call: 8 device routes, 0 misses, 0 fetched"
    ok = ((t["device"] == TOP_K - 1).all() and (t["cpu"] == 1).all()
          and (t["missing"] == 1).all() and (t["fetched"] == 0).all()
          and (t["error"] == 0).all() and (t["empty_before"] == 0).all()
          and (t["min_recency_before"] >= 0).all())
    return ok, ("every call: 7 device routes + 1 CPU route, 1 miss, 0 fetched, 0 empty slots, "
                "the missing expert routed before (recency >= 0): split(1)=0 at fraction 0.4 and "
                "no empty slot, so PROMOTE_ONE never fires and it stays a CPU route")


def time_row(L, E, S, scenario, candidate, args, results):
    """One table row: both backends, verified scenario, median us/call."""
    state0, hit_routes, miss_routes = timing_fixture(L, E, S, seed=args.seed + S)
    table = hit_routes if scenario == "all hits" else miss_routes
    layers_np = (np.arange(args.calls) % L).astype(np.int32)
    layers = jnp.asarray(layers_np)
    routes = jnp.asarray(table[layers_np])
    policy = pc.FetchPolicy.fraction(FRACTION)
    assert int(policy.split(jnp.int32(1))) == 0, "split(1) at fraction 0.4 should be 0"
    backends = ("xla", candidate)  # indexed 0 / 1, so --candidate xla works too
    states, accs, verdicts = [None, None], [None, None], []
    for i, backend in enumerate(backends):
        # Warm-up pass: compiles, and makes every miss expert a recurring one.
        state, acc = decode(state0, jnp.int32(0), layers, routes, policy, backend=backend,
                            unroll=args.unroll)
        state, trace = decode_trace(state, layers, routes, policy, backend=backend)
        jax.block_until_ready((state, acc, trace))
        ok, what = scenario_check(scenario, trace)
        verdicts.append((backend, ok))
        states[i], accs[i] = state, acc
    fetched_before = [int(np.asarray(st.stats)[:, 3].sum()) for st in states]
    samples = ([], [])
    timed_start = time.perf_counter()
    for trial in range(args.repeats):
        for i in ((0, 1) if trial % 2 == 0 else (1, 0)):  # alternate which backend goes first
            state, acc = states[i], accs[i]
            start = time.perf_counter()
            for _ in range(args.replays):
                state, acc = decode(state, acc, layers, routes, policy, backend=backends[i],
                                    unroll=args.unroll)
            jax.block_until_ready((state, acc))
            samples[i].append((time.perf_counter() - start) / (args.replays * args.calls))
            states[i], accs[i] = state, acc
    timed_s = time.perf_counter() - timed_start
    no_fetch = all(int(np.asarray(st.stats)[:, 3].sum()) == before
                   for st, before in zip(states, fetched_before))
    ok = all(v for _, v in verdicts) and no_fetch
    verdict = ("OK: " if ok else "FAILED: ") + what + (
        "; no fetch during the timing run" if no_fetch else "; SOME CALL FETCHED during timing")
    if int(accs[0]) != int(accs[1]):
        msg = (f"MISMATCH [S={S}, {scenario}]: plan checksums differ after timing "
               f"(xla {int(accs[0])}, {candidate} {int(accs[1])})")
        print(msg, flush=True)
        results["failures"].append(msg)
    if not ok:
        results["scenario_failures"].append(f"S={S} {scenario}: {verdict} "
                                             f"(per backend: {verdicts})")
    xla_us = statistics.median(samples[0]) * 1e6
    cand_us = statistics.median(samples[1]) * 1e6
    return xla_us, cand_us, verdict, timed_s


# --------------------------------------------------------------------------------------------
# (c) Host sync: a long scanned decode loop, with and without misses.
# --------------------------------------------------------------------------------------------

def _loop_impl(state, layers, routes, policy, backend):
    def body(carry, x):
        state, acc = carry
        state, plan = pc.ensure_hybrid(state, x[0], x[1], policy, backend=backend)
        return (state, acc + _checksum(plan)), None
    return lax.scan(body, (state, jnp.int32(0)), (layers, routes))[0]


decode_loop = jax.jit(_loop_impl, static_argnames=("backend",))


def _floor_impl(state, layers, routes):
    # The same carry and inputs with a trivial body: what one scan iteration costs on this device.
    def body(carry, x):
        state, acc = carry
        state = state.replace(step=state.step + 1)
        return (state, acc + x[0] + x[1][0]), None
    return lax.scan(body, (state, jnp.int32(0)), (layers, routes))[0]


scan_floor = jax.jit(_floor_impl)


def kernels_in(compiled_text: str) -> int:
    """The device kernels one compiled program launches per loop iteration, roughly: the fusions,
    custom calls (the Pallas kernels) and unfused scatters/sorts in its optimized HLO."""
    ops = (" fusion(", " custom-call(", " scatter(", " sort(", " reduce(", " gather(")
    return sum(line.count(op) for line in compiled_text.splitlines() for op in ops)


def loop_rows(args):
    """``[(S, routes, fetched per step, {backend: us/step})]`` for both geometries."""
    policy = pc.FetchPolicy.fraction(FRACTION)
    rows = []
    for L, E, S in GEOMETRIES:
        state0, hit_routes, _ = timing_fixture(L, E, S, seed=args.seed + S)
        layers_np = (np.arange(args.loop_steps) % L).astype(np.int32)
        trace = synthetic_trace(SyntheticParams(num_layers=L, num_experts=E, top_k=TOP_K,
                                                num_tokens=-(-args.loop_steps // L)),
                                seed=args.seed)
        _, uniform = trace.to_array()
        cases = (("all hits", hit_routes[layers_np]),
                 ("uniform top-8 (misses)", uniform[: args.loop_steps]))
        for label, routes_np in cases:
            layers, routes = jnp.asarray(layers_np), jnp.asarray(routes_np, jnp.int32)
            per_backend, fetched = {}, None
            for backend in ("xla", args.candidate):
                state, _ = jax.block_until_ready(
                    decode_loop(state0, layers, routes, policy, backend=backend))  # compile
                fetched = int(np.asarray(state.stats)[:, 3].sum()
                              - np.asarray(state0.stats)[:, 3].sum()) / args.loop_steps
                samples = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(decode_loop(state0, layers, routes, policy,
                                                      backend=backend))
                    samples.append((time.perf_counter() - start) / args.loop_steps * 1e6)
                per_backend[backend] = statistics.median(samples)
            log(f"decode loop [S={S}, {label}]: {fetched:.2f} fetched/step, "
                + ", ".join(f"{b} {t:.2f} us/step" for b, t in per_backend.items()))
            rows.append((S, label, fetched, per_backend))
        # The floor: a scan iteration with a trivial body, and how many kernels the step has.
        layers, routes = jnp.asarray(layers_np), jnp.asarray(uniform[: args.loop_steps], jnp.int32)
        jax.block_until_ready(scan_floor(state0, layers, routes))
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(scan_floor(state0, layers, routes))
            samples.append((time.perf_counter() - start) / args.loop_steps * 1e6)
        floor = statistics.median(samples)
        kernels = {b: kernels_in(decode_loop.lower(state0, layers, routes, policy, backend=b)
                                 .compile().as_text())
                   for b in ("xla", args.candidate)}
        log(f"decode loop [S={S}, trivial body]: {floor:.2f} us/step; kernels in the compiled "
            "loop: " + ", ".join(f"{b} {n}" for b, n in kernels.items()))
        rows.append((S, "trivial body (scan floor)", 0.0,
                     {b: floor for b in ("xla", args.candidate)}))
        rows.append((S, "kernels in the compiled loop (count)", 0.0, kernels))
    return rows


# --------------------------------------------------------------------------------------------
# Driver and report.
# --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run on the CPU with backend 'interpret' for 'pallas', small sizes")
    p.add_argument("--candidate", choices=pc.BACKENDS, default=None,
                   help="backend compared against 'xla' (default: pallas; interpret with "
                        "--cpu-smoke)")
    p.add_argument("--budget-seconds", type=float, default=240.0,
                   help="skip timing rows that would end after this many seconds (default 240)")
    p.add_argument("--steps", type=int, default=None,
                   help="ops per equality sequence; two sequences per geometry (default 192, "
                        "smoke 96)")
    p.add_argument("--calls", type=int, default=None, help="layer-calls per scan (default 128)")
    p.add_argument("--replays", type=int, default=None,
                   help="scan dispatches per trial (default 20, smoke 2)")
    p.add_argument("--repeats", type=int, default=None,
                   help="trials, median taken (default 9, smoke 3)")
    p.add_argument("--unroll", type=int, default=1, help="lax.scan unroll of the timed loop")
    p.add_argument("--loop-steps", type=int, default=1000,
                   help="layer-calls of the host-sync decode loop (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="also write the report as the gpu_check section of this markdown file")
    args = p.parse_args(argv)
    smoke = args.cpu_smoke
    args.candidate = args.candidate or ("interpret" if smoke else "pallas")
    args.steps = args.steps or (96 if smoke else 192)
    args.calls = args.calls or (64 if smoke else 128)
    args.replays = args.replays or (2 if smoke else 20)
    args.repeats = args.repeats or (3 if smoke else 9)
    return args


def device_description() -> str:
    d = jax.devices()[0]
    return f"{d.platform} ({getattr(d, 'device_kind', '?')})"


def markdown(args, results, rows, matched, elapsed, loops=()) -> str:
    cand = args.candidate
    lines = [
        f"## GPU check: {cand} vs xla (`benchmarks/gpu_check.py`)",
        "",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; "
        f"{'CPU smoke run' if args.cpu_smoke else 'GPU run'}; {elapsed:.0f} s in all",
        f"- jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"Python {platform.python_version()}, device {device_description()}",
        f"- equality ({cand} vs xla, every state and plan leaf after every step): "
        f"**{'all matched' if matched else 'MISMATCH'}**",
    ]
    for geometry, label, steps, status, detail in results["equality"]:
        lines.append(f"  - {geometry}, {label} start, {steps} random ops: {status} ({detail})")
    if results["failures"]:
        lines += ["", "Failures:", "", "```"] + results["failures"] + ["```"]
    lines += [
        "",
        f"Per layer-call cost of `ensure_hybrid` (fraction {FRACTION}, RECENCY, PROMOTE_ONE, "
        f"top-{TOP_K}) inside a compiled `lax.scan` of {args.calls} layer-calls, "
        f"{args.replays} dispatches per trial, median of {args.repeats} alternating trials:",
        "",
        f"| Slots | Scenario | xla us/call | {cand} us/call | {cand}/xla |",
        "|---:|---|---:|---:|---:|",
    ]
    for S, scenario, xla_us, cand_us, _ in rows:
        if xla_us is None:
            lines.append(f"| {S} | {scenario} | {cand_us} | | |")
        else:
            lines.append(f"| {S} | {scenario} | {xla_us:.3f} | {cand_us:.3f} | "
                         f"{cand_us / xla_us:.2f} |")
    lines.append("")
    for S, scenario, _, _, verdict in rows:
        if verdict:
            lines.append(f"- S={S}, {scenario}: {verdict}")
    if loops:
        lines += ["", f"Host sync: one compiled `lax.scan` of {args.loop_steps} `ensure_hybrid` "
                  f"layer-calls, us per step, median of {args.repeats}:", "",
                  f"| Slots | Routes | fetched/step | xla us/step | {cand} us/step |",
                  "|---:|---|---:|---:|---:|"]
        for S, label, fetched, times in loops:
            if label.startswith("kernels"):
                lines.append(f"| {S} | {label} | | {times['xla']} | {times[cand]} |")
                continue
            lines.append(f"| {S} | {label} | {fetched:.2f} | {times['xla']:.2f} | "
                         f"{times[cand]:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    log(f"jax {jax.__version__} on {device_description()}; comparing {args.candidate!r} "
        f"against 'xla'")
    if args.candidate == "pallas" and jax.default_backend() != "gpu":
        print("No GPU here: backend 'pallas' needs one. Use --cpu-smoke (interpret) on a CPU; "
              "tests/test_kernels_lowering.py checks the CUDA lowering without a GPU.", file=sys.stderr)
        return 3

    results = {"equality": [], "failures": [], "scenario_failures": []}
    rows, loops = [], []

    def write_report():
        # Rewritten after every phase, so a run killed at its time limit still leaves a report.
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            ok = all(status == "match" for _, _, _, status, _ in results["equality"])
            write_section("gpu_check", markdown(args, results, rows, ok and not results["failures"],
                                                time.perf_counter() - start, loops), args.out)

    matched = True
    for i, (L, E, S) in enumerate(GEOMETRIES):
        matched &= check_equality(L, E, S, args.steps, args.candidate, args.seed + i, results)
        write_report()

    # Budget estimates: the first row of a geometry compiles (estimated from the previous first
    # row), a later one only times (estimated from the previous row's timed part).
    first_row_s, timed_row_s = 5.0, 2.0
    for L, E, S in GEOMETRIES:
        compiled = False  # whether this geometry's timing programs are compiled yet
        for scenario in SCENARIOS:
            elapsed = time.perf_counter() - start
            needed = 1.5 * (timed_row_s if compiled else first_row_s)
            if elapsed + needed > args.budget_seconds:
                log(f"timing [S={S}, {scenario}]: SKIPPED ({elapsed:.0f} s used of a "
                    f"{args.budget_seconds:.0f} s budget, about {needed:.0f} s needed)")
                rows.append((S, scenario, None, "skipped (budget)", ""))
                continue
            t0 = time.perf_counter()
            try:
                xla_us, cand_us, verdict, timed_s = time_row(L, E, S, scenario, args.candidate,
                                                             args, results)
            except Exception as exc:
                traceback.print_exc()
                msg = f"timing [S={S}, {scenario}] failed: {type(exc).__name__}: {exc}"
                print(msg, flush=True)
                results["failures"].append(msg)
                rows.append((S, scenario, None, "error", ""))
                continue
            row_s = time.perf_counter() - t0
            first_row_s = first_row_s if compiled else row_s
            compiled = True
            timed_row_s = max(timed_s, 0.5)
            log(f"timing [S={S}, {scenario}]: xla {xla_us:.3f} us/call, {args.candidate} "
                f"{cand_us:.3f} us/call ({row_s:.1f} s) -- scenario check {verdict}")
            rows.append((S, scenario, xla_us, cand_us, verdict))
            write_report()

    try:
        loops.extend(loop_rows(args))
    except Exception as exc:
        traceback.print_exc()
        results["failures"].append(f"decode loop failed: {type(exc).__name__}: {exc}")
    write_report()

    matched &= not results["failures"]
    elapsed = time.perf_counter() - start
    cand = args.candidate
    print()
    print(f"jax {jax.__version__}; device {device_description()}; "
          f"{'CPU smoke, ' if args.cpu_smoke else ''}{cand} vs xla")
    print(f"results matched: {'YES' if matched else 'NO'}")
    print(f"{'slots':>6} | {'scenario':<31} | {'xla us/call':>11} | {cand + ' us/call':>16} | "
          f"{cand + '/xla':>13}")
    for S, scenario, xla_us, cand_us, _ in rows:
        if xla_us is None:
            print(f"{S:>6} | {scenario:<31} | {cand_us}")
        else:
            print(f"{S:>6} | {scenario:<31} | {xla_us:>11.3f} | {cand_us:>16.3f} | "
                  f"{cand_us / xla_us:>13.2f}")
    for msg in results["scenario_failures"]:
        print("SCENARIO CHECK FAILED: " + msg)
    print(f"total {elapsed:.1f} s")
    if args.out is not None:
        write_report()
        print(f"markdown report written to {args.out}")
    if not matched:
        print("FAILED: pallas/xla results differ or a backend failed (see above)", file=sys.stderr)
        return 1
    if results["scenario_failures"]:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
