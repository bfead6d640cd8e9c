"""GPU check: the Pallas backend against the XLA one on a GPU (docs/semantics.md §7), sized to
fit 15 minutes of GPU time with the machine's start (the run itself estimated at <= 8 minutes,
``--budget-seconds``). In order: a one-call compile-and-compare pre-flight per cost geometry (a
failing kernel stops the cost phase, the report written); the per-call cost at exactly m misses
per call, the largest pool's rows first, with the kernel's device time from ``jax.profiler``
beside the wall time and whether the step ran inside a CUDA graph; the per-call cost of a decode
scan under each eviction (the ring evictions' kernel among them) at Mixtral's and the
fine-grained geometry; equality against XLA (every state and plan leaf) for each eviction, a low
``rebase_threshold``, a usable size below the capacity, more than 4096 slots (the streamed
multi-block search) and ``vmap``; then the random operation sequences. The report is rewritten after every row. Run from the repository root,
e.g. ``PYTHONUNBUFFERED=1 timeout 540 python benchmarks/gpu_check.py --out $OUT/gpu_check.md``;
``--smoke`` runs it on a CPU (interpret), ``--dry-run`` prints the plan and its estimate and
exits. Exit status: 0 matched, 1 a difference or a failed backend, 2 a row without m misses per
call, 3 no GPU."""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

# Parsed before jax is imported, so --smoke can pin the CPU platform.
_SMOKE = bool({"--smoke", "--cpu-smoke", "--dry-run"} & set(sys.argv[1:]))
if _SMOKE:
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
from pallas_cache.reference import lockstep  # noqa: E402

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
# ensure; hybrid (recency, promote_one) -- the promotion scenarios' path -- weighted up; the other five
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


def full_state(rng, L, E, S, empty: int = 0):
    """A pool filled (by real ensure calls, xla backend) to all but ``empty`` slots."""
    flat = rng.choice(L * E, size=S - empty, replace=False)
    per_layer: dict = {}
    for f in flat:
        per_layer.setdefault(int(f) // E, []).append(int(f) % E)
    layers, routes = chunked_routes(rng, per_layer)
    state = _fill(pc.init(L, E, S), jnp.asarray(layers), jnp.asarray(routes))
    ids = np.asarray(state.id_of_slot)
    assert int((ids < 0).sum()) == empty, "warm-up fill left the wrong number of empty slots"
    return state


def nearly_full_state(rng, L, E, S, empty: int = 4):
    """A pool filled to all but ``empty`` slots, collecting routing."""
    return pc.set_collect_routing(full_state(rng, L, E, S, empty), True)


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
    """The ops of a :func:`random_sequence` as the lockstep driver names them."""
    return [(OP_NAMES[op], {"layer": int(layer), "routes": routes, "fraction16": int(f16),
                            "cap": int(cap)})
            for op, layer, routes, f16, cap in zip(xs["op"], xs["layer"], xs["routes"],
                                                   xs["f16"], xs["cap"])]


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
        try:
            lockstep.run(sequence_ops(xs), scan_steps(out[0]), {candidate: scan_steps(out[1])},
                         compare_leaves)
        except AssertionError as mismatch:
            ok = False
            msg = f"MISMATCH [{geometry}, {label} start] at {mismatch}"
            print("!" * 100 + "\n" + msg + "\n" + "!" * 100, flush=True)
            results["failures"].append(msg)
            results["equality"].append((geometry, label, steps, "MISMATCH",
                                        str(mismatch).split(":")[0]))
            continue
        cov = coverage(xs, out[0], state0)
        log(f"equality [{geometry}, {label} start, {steps} steps]: MATCH ({secs:.1f} s incl. "
            f"compile) -- {cov}")
        results["equality"].append((geometry, label, steps, "match", cov))
    return ok


# --------------------------------------------------------------------------------------------
# (b) Per-call cost: exactly m misses per call, unrolled and scanned, against upstream's figures.
# --------------------------------------------------------------------------------------------

# (L, E, S, k), the largest pool first: its rows are the ones that differ from upstream's slope.
COST_GEOMETRIES = ((64, 512, 16384, 8), (48, 128, 4096, 8), (48, 64, 512, 8))
SMOKE_COST_GEOMETRIES = ((4, 32, 64, 8),)
MISSES = (0, 1, 4, 8)
# flashlib lru_ensure on an H100 in a CUDA graph: us per call = base + slope * misses, by S.
UPSTREAM_FIT = {512: (1.6, 0.56), 4096: (2.9, 0.89), 16384: (3.6, 2.11)}
UPSTREAM_NO_MISS_US = 1.33
MODES = ("unrolled", "scan")


class MissSchedule:
    """Routes with exactly ``m`` misses per call once the pool is warm (full, LRU).

    Call ``c`` routes layer ``c mod L``. Each layer routes its ``k - m`` hot experts on every
    visit (refreshed every ``L`` calls) and the next ``m`` of its other ``P = E - k + m`` experts,
    taken cyclically. On a full pool every miss evicts the least recently used entry; the hot
    entries are younger than every streamed one when ``S > k * L``, so the streamed entries leave
    in install order, each after about ``R = (S - L (k - m)) / m`` calls, and an expert comes
    round again after at least ``floor(P / m) * L`` calls. ``check`` asks for that to exceed
    ``R + L``. The plans of the timed calls are checked all the same (``off_m_calls``).
    """

    def __init__(self, L, E, S, k, m, seed):
        self.L, self.E, self.S, self.k, self.m = L, E, S, k, m
        rng = np.random.default_rng(seed)
        perms = [rng.permutation(E).astype(np.int32) for _ in range(L)]
        self.hot = [p[: k - m] for p in perms]
        self.stream = [p[k - m:] for p in perms]
        self.visits = np.zeros(L, np.int64)
        self.call = 0

    def check(self):
        L, E, S, k, m = self.L, self.E, self.S, self.k, self.m
        if not 0 <= m <= k or S <= k * L or S > L * E:
            raise ValueError(f"schedule needs 0 <= m <= k and k*L < S <= L*E, got L={L} E={E} "
                             f"S={S} k={k} m={m}")
        if m:
            residence = (S - L * (k - m)) / m
            period = ((E - k + m) // m) * L
            if period <= residence + L:
                raise ValueError(f"L={L} E={E} S={S} k={k} m={m}: an expert comes round after "
                                 f"{period} calls, before its eviction (~{residence:.0f} calls)")

    def warmup_calls(self) -> int:
        """Calls after which the timed calls have exactly ``m`` misses (from a full pool)."""
        return 2 * self.L if self.m == 0 else -(-self.S // self.m) + 2 * self.L

    def take(self, n):
        """The next ``n`` calls: ``(layers int32[n], routes int32[n, k])``."""
        layers = np.empty(n, np.int32)
        routes = np.empty((n, self.k), np.int32)
        for j in range(n):
            layer = self.call % self.L
            stream = self.stream[layer]
            start = int(self.visits[layer]) * self.m
            miss = stream[(start + np.arange(self.m)) % len(stream)]
            row = np.concatenate([self.hot[layer], miss])
            layers[j], routes[j] = layer, np.roll(row, self.call % self.k)
            self.visits[layer] += 1
            self.call += 1
        return layers, routes


def _call(state, layer, routes, op, backend):
    if op == "ensure":
        return pc.ensure(state, layer, routes, backend=backend)
    return pc.ensure_hybrid(state, layer, routes, pc.FetchPolicy.full(), backend=backend)


def _stack(plans):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *plans)


def _unrolled_impl(state, layers, routes, op, backend):
    # layers: a tuple of int32[] and routes a tuple of int32[k], one per call, so each call reads
    # its own argument buffer (no slice kernel between two calls). The plans leave stacked: one
    # concatenation per plan leaf for all the calls.
    plans = []
    for layer, r in zip(layers, routes):
        state, plan = _call(state, layer, r, op, backend)
        plans.append(plan)
    return state, _stack(plans)


def _scan_impl(state, layers, routes, op, backend):
    def body(state, x):
        return _call(state, x[0], x[1], op, backend)
    return lax.scan(body, state, (layers, routes))


def _floor_impl(state, layers, routes):
    # The same carry, inputs and per-iteration outputs (a plan's shapes) with a trivial body:
    # what one scan iteration costs with no cache call in it.
    like = jax.eval_shape(lambda s, la, r: pc.ensure(s, la, r, backend="xla")[1],
                          state, layers[0], routes[0])

    def body(state, x):
        fake = jax.tree.map(lambda s: jnp.broadcast_to((x[0] + x[1][0]).astype(s.dtype), s.shape),
                            like)
        return state.replace(step=state.step + 1), fake
    return lax.scan(body, state, (layers, routes))


def _unrolled_floor_impl(state, layers, routes):
    # The unrolled program's arguments and outputs with a trivial body: what dispatching it costs.
    like = jax.eval_shape(lambda s, la, r: pc.ensure(s, la, r, backend="xla")[1],
                          state, layers[0], routes[0])
    plans = [jax.tree.map(lambda s, la=la, r=r: jnp.broadcast_to((la + r[0]).astype(s.dtype),
                                                                 s.shape), like)
             for la, r in zip(layers, routes)]
    return state.replace(step=state.step + len(plans)), _stack(plans)


_PROGRAMS = {"unrolled": _unrolled_impl, "scan": _scan_impl, "floor": _floor_impl,
             "unrolled floor": _unrolled_floor_impl}


def _split_impl(layers, routes):
    return tuple(layers[i] for i in range(layers.shape[0])), tuple(routes)


_split = jax.jit(_split_impl)  # outside the timed programs: one buffer per call's arguments


def _fresh(state):
    """A copy of ``state`` in new buffers (the timed programs donate their state)."""
    return jax.tree.map(jnp.copy, state)


_COMPILED: dict = {}
_UNROLL: dict = {}  # (L, E, S, op, backend) -> (calls per unrolled jit, lowered ops per call)


def compiled_program(mode, op, backend, *example):
    """``(compiled, compile seconds)`` of one program for arguments shaped like ``example``."""
    key = (mode, op, backend, str(jax.tree.structure(example)),
           str([(a.shape, str(a.dtype)) for a in jax.tree.leaves(example)]))
    if key not in _COMPILED:
        fn = (_PROGRAMS[mode] if "floor" in mode
              else functools.partial(_PROGRAMS[mode], op=op, backend=backend))
        start = time.perf_counter()
        compiled = jax.jit(fn, donate_argnums=(0,)).lower(*example).compile()
        _COMPILED[key] = (compiled, time.perf_counter() - start)
        return _COMPILED[key]
    return _COMPILED[key][0], 0.0


_FREE_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
             "add-dependency", "opt-barrier", "partition-id", "replica-id"}


def _computations(text: str) -> tuple[dict, str]:
    """``({name: [instruction line, ...]}, entry name)`` of an optimized HLO module's text."""
    comps, entry, name = {}, None, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) (?:\(.*\) -> .*)?\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(2)
            comps[name] = []
            entry = name if head.group(1) else entry
        elif line.startswith("}"):
            name = None
        elif name is not None and " = " in line:
            comps[name].append(line)
    return comps, entry


def _opcode(line: str) -> str:
    rhs = line.split(" = ", 1)[1].lstrip()
    if rhs.startswith("("):  # a tuple shape
        depth = 0
        for i, ch in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rhs = rhs[i + 1:]
                break
    else:
        rhs = rhs.split(" ", 1)[1] if " " in rhs else rhs
    match = re.match(r"\s*([a-z][a-z0-9\-]*)\(", rhs)
    return match.group(1) if match else "?"


def _launches(comps, name, seen=()) -> tuple[int, int]:
    """``(kernels, pallas calls)`` one run of computation ``name`` launches: every instruction
    except the free ones; a while counts its body and condition once, a conditional its largest
    branch plus one (the predicate), a call its callee."""
    kernels = pallas = 0
    for line in comps.get(name, ()):
        op = _opcode(line)
        if op in _FREE_OPS:
            continue
        callees = re.findall(r"(?:body|condition|to_apply|true_computation|false_computation)"
                             r"=%?([\w.\-]+)", line)
        if op == "while":
            for callee in callees:
                k, p = _launches(comps, callee, seen + (name,))
                kernels, pallas = kernels + k, pallas + p
        elif op == "conditional":
            branches = callees + re.findall(r"%([\w.\-]+)", line.split("branch_computations=")[1]
                                            if "branch_computations=" in line else "")
            counts = [_launches(comps, b, seen + (name,)) for b in branches if b not in seen]
            k, p = max(counts, default=(0, 0))
            kernels, pallas = kernels + 1 + k, pallas + p
        elif op == "call":
            k, p = _launches(comps, callees[0], seen + (name,)) if callees else (1, 0)
            kernels, pallas = kernels + k, pallas + p
        else:
            kernels += 1
            pallas += int(op == "custom-call" and "triton" in line)
    return kernels, pallas


def kernel_count(compiled_text: str, loop: bool) -> tuple[int, int]:
    """``(kernels, pallas calls)``: per iteration of the program's largest while loop (body and
    condition) when ``loop``, else per run of the whole program."""
    comps, entry = _computations(compiled_text)
    if not loop:
        return _launches(comps, entry)
    best = (0, 0)
    for line in (line for body in comps.values() for line in body):  # XLA:CPU wraps it in a call
        if _opcode(line) == "while":
            callees = re.findall(r"(?:body|condition)=%?([\w.\-]+)", line)
            counts = [_launches(comps, c) for c in callees]
            total = (sum(c[0] for c in counts), sum(c[1] for c in counts))
            best = max(best, total)
    return best


def off_m_calls(plans, m) -> int:
    """Calls whose plan did not miss and fetch exactly ``m`` (or was refused), over every
    dispatch's stacked plans (host arrays)."""
    bad = 0
    for p in plans:
        bad += int(((np.asarray(p.missing) != m) | (np.asarray(p.fetched) != m)
                    | (np.asarray(p.error) != 0)).sum())
    return bad


def tree_difference(a, b) -> list[str]:
    """The leaves (dotted names) where two pytrees differ; [] when equal bit for bit."""
    la, lb = named_leaves(a), named_leaves(b)
    if [n for n, _ in la] != [n for n, _ in lb]:
        return ["<tree structure>"]
    return [name for (name, x), (_, y) in zip(la, lb)
            if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y)]


def _per_call_us(samples, calls) -> float:
    return statistics.median(samples) / calls * 1e6


def floor_row(L, E, S, k, args, base) -> dict:
    """The trivial-body programs: the scan's us and kernels per iteration, and the unrolled
    program's us per call (dispatching 128 calls' arguments and outputs, nothing else)."""
    ins = tuple(jnp.asarray(a) for a in MissSchedule(L, E, S, k, 0, args.seed).take(args.calls))
    row = {"compile_s": {}}
    for mode, args_in in (("floor", ins), ("unrolled floor", _split(*ins))):
        prog, row["compile_s"][mode] = compiled_program(mode, None, None, base, *args_in)
        state, ys = prog(_fresh(base), *args_in)
        samples = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.replays):
                state, ys = prog(state, *args_in)
            jax.block_until_ready((state, ys))
            samples.append(time.perf_counter() - t0)
        row["us" if mode == "floor" else "unrolled_us"] = _per_call_us(
            samples, args.replays * args.calls)
        if mode == "floor":
            row["kernels"] = kernel_count(prog.as_text(), loop=True)
    return row


def ops_per_call(op, backend, state, layer, routes) -> tuple[int, float]:
    """StableHLO ops of one lowered call, by the rule of tests/test_kernels.py (every
    ``stablehlo.<op>`` but the free ones; a Pallas call counts once), and the seconds the
    lowering took."""
    start = time.perf_counter()
    text = jax.jit(functools.partial(_unrolled_impl, op=op, backend=backend)).lower(
        state, (layer,), (routes,)).as_text()
    secs = time.perf_counter() - start
    free = {"constant", "reshape", "bitcast_convert", "return", "tuple", "get_tuple_element",
            "optimization_barrier"}
    return sum(1 for name in re.findall(r"stablehlo\.([a-z_]+)", text) if name not in free), secs


def unroll_width(op, backend, state, first, args) -> tuple[int, int]:
    """Calls per unrolled jit for ``backend``: ``--calls``; ``--heavy-unroll`` when one call
    lowers to more than ``--light-ops`` ops (the XLA step's ~300 ops per call make a 128-call jit
    take minutes to compile; its per-call cost does not need 128); and fewer than ``--calls``
    when tracing them would take over ``--trace-seconds`` (halved until it fits). Returns
    ``(calls per jit, lowered ops per call)``."""
    ops, secs = ops_per_call(op, backend, state, first[0][0], first[1][0])
    width = args.calls
    if ops > args.light_ops:
        width = min(args.heavy_unroll, args.calls)
    while width > args.heavy_unroll and width * secs > args.trace_seconds:
        width //= 2
    while args.calls % width:  # every dispatch of one chain has the same shapes
        width -= 1
    return width, ops


def _pieces(window, width):
    """One window's calls as the argument tuples of ``n / width`` unrolled dispatches."""
    layers, routes = window
    return [_split(layers[j:j + width], routes[j:j + width])
            for j in range(0, layers.shape[0], width)]


def _concat(plans_list):
    """The plans of consecutive dispatches (host arrays) as one stack."""
    return jax.tree.map(lambda *leaves: np.concatenate(leaves), *plans_list)


def cost_row(L, E, S, k, m, args, base, results) -> dict:
    """One row: both backends, both modes, the same calls from the same warm pool."""
    backends = ("xla", args.candidate)  # indexed 0 / 1, so --candidate xla works too
    n, geometry = args.calls, f"L={L},E={E},S={S},k={k}"
    sched = MissSchedule(L, E, S, k, m, seed=args.seed + 7 * S + m)
    sched.check()
    row = {"L": L, "E": E, "S": S, "k": k, "m": m, "us": {}, "off_m": {}, "kernels": {},
           "compile_s": {}, "unroll": {}, "ops": {}, "match": True}

    def take():
        return tuple(jnp.asarray(a) for a in sched.take(n))

    # Warm-up: the schedule's first calls on the xla scan program, from a full pool.
    first = take()
    warm_prog, secs = compiled_program("scan", args.op, "xla", base, *first)
    if secs:
        row["compile_s"]["scan xla"] = secs
    warm, _ = warm_prog(_fresh(base), *first)
    for _ in range(-(-sched.warmup_calls() // n) - 1):
        warm, _ = warm_prog(warm, *take())
    # The timed calls: one warm-up window, then repeats x replays, the same for every chain.
    windows = [take() for _ in range(1 + args.repeats * args.replays)]
    jax.block_until_ready((warm, windows))
    row["calls"] = len(windows) * n
    finals = {}
    for mode in MODES:
        progs, states, outs, ins = [], [], ([], []), []
        for i, backend in enumerate(backends):
            if mode == "scan":
                width, pieces = n, [[w] for w in windows]
            else:
                key = (L, E, S, args.op, backend)
                if key not in _UNROLL:
                    _UNROLL[key] = unroll_width(args.op, backend, warm, first, args)
                width, ops = _UNROLL[key]
                row["ops"][backend] = ops
                pieces = [_pieces(w, width) for w in windows]
                row["unroll"][backend] = width
            prog, secs = compiled_program(mode, args.op, backend, warm, *pieces[0][0])
            if secs:
                row["compile_s"][f"{mode} {backend}"] = secs
            state = _fresh(warm)
            for piece in pieces[0]:  # the warm-up window
                state, plans = prog(state, *piece)
                outs[i].append(plans)
            progs.append((prog, width))
            states.append(state)
            ins.append(pieces)
        jax.block_until_ready((states, outs))
        samples = ([], [])
        for trial in range(args.repeats):
            for i in ((0, 1) if trial % 2 == 0 else (1, 0)):  # alternate who goes first
                prog = progs[i][0]
                t0 = time.perf_counter()
                state = states[i]
                for r in range(args.replays):
                    for piece in ins[i][1 + trial * args.replays + r]:
                        state, plans = prog(state, *piece)
                        outs[i].append(plans)
                states[i] = jax.block_until_ready(state)
                samples[i].append(time.perf_counter() - t0)
        if mode == "scan" and jax.default_backend() == "gpu":  # one more dispatch, profiled
            row["device_us"], row["graph"] = profile_program(progs[1][0], warm, ins[1][0][0], n)
        host = [jax.device_get(outs[i]) for i in (0, 1)]  # one transfer per chain
        for i, backend in enumerate(backends):
            key = f"{mode} {backend}"
            prog, width = progs[i]
            row["us"][key] = _per_call_us(samples[i], args.replays * n)
            row["off_m"][key] = off_m_calls(host[i], m)
            kernels, pallas = kernel_count(prog.as_text(), loop=(mode == "scan"))
            row["kernels"][key] = ((kernels / width, pallas / width) if mode == "unrolled"
                                   else (kernels, pallas))
        got = [(jax.device_get(states[i]), _concat(host[i])) for i in (0, 1)]
        diff = tree_difference(got[0], got[1])
        if diff:
            row["match"] = False
            msg = (f"MISMATCH [{geometry}, m={m}, {mode}]: xla and {args.candidate} differ after "
                   f"the same {row['calls']} calls in: {', '.join(diff[:6])}")
            print(msg, flush=True)
            results["failures"].append(msg)
        finals[mode] = got[0]
    if tree_difference(finals["unrolled"], finals["scan"]):
        row["match"] = False
        msg = f"MISMATCH [{geometry}, m={m}]: the unrolled and the scanned xla runs differ"
        print(msg, flush=True)
        results["failures"].append(msg)
    if any(row["off_m"].values()):
        results["scenario_failures"].append(
            f"{geometry}, m={m}: calls without exactly {m} misses and fetches: {row['off_m']}")
    log(f"cost [{geometry}, m={m}]: "
        + ", ".join(f"{key} {us:.2f} us/call" for key, us in row["us"].items())
        + f"; off-m calls {sum(row['off_m'].values())} of {4 * row['calls']}; kernels/call "
        + ", ".join(f"{key} {kp[0]:.3g} ({kp[1]:.3g} pallas)"
                    for key, kp in row["kernels"].items()))
    return row


# --------------------------------------------------------------------------------------------
# (c) The pre-flight, the kernel's device time, the equality cases.
# --------------------------------------------------------------------------------------------

def preflight(L, E, S, k, args) -> str | None:
    """One call of the candidate and of xla on a full pool with k misses: compiled, run and
    compared leaf by leaf. ``None`` when equal, else what failed (the cost phase stops)."""
    rng = np.random.default_rng(args.seed + S)
    state = _filled_state(rng, "lru", L, E, S, S)
    routes = jnp.asarray(rng.choice(E, size=k, replace=False), jnp.int32)
    outs = []
    for backend in ("xla", args.candidate):
        try:
            fn = jax.jit(functools.partial(_call, op=args.op, backend=backend))
            outs.append(jax.device_get(fn(_fresh(state), jnp.int32(0), routes)))
        except Exception as exc:
            traceback.print_exc()
            return f"backend {backend!r} failed to compile or run: {type(exc).__name__}: {exc}"
    diff = tree_difference(outs[0], outs[1])
    return f"xla and {args.candidate} differ in: {', '.join(diff[:6])}" if diff else None


def profile_program(prog, state, piece, calls) -> tuple[float | None, str]:
    """One dispatch of ``prog`` under ``jax.profiler``: the device time of the fused kernel
    (events named ``pallas_cache_step``) per call, and whether the dispatch ran a CUDA graph
    (a host event naming a graph launch or an XLA command buffer): ``"yes"``, ``"no"``, or
    ``"?"`` with no trace to read."""
    import glob
    import gzip
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        state = _fresh(state)
        jax.block_until_ready(state)
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(prog(state, *piece))
        files = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
        if not files:
            return None, "?"
        with gzip.open(files[0], "rt") as f:
            events = json.load(f).get("traceEvents", [])
    kernel_us = [float(e.get("dur", 0.0)) for e in events
                 if "pallas_cache_step" in str(e.get("name", "")) and e.get("ph") == "X"]
    names = {str(e.get("name", "")).lower() for e in events}
    graph = any("graphlaunch" in n or "command_buffer" in n or "commandbuffer" in n
                for n in names)
    return (sum(kernel_us) / calls if kernel_us else None), ("yes" if graph else "no")


def _filled_state(rng, eviction, L, E, S, capacity, rebase_threshold=None, empty=0):
    """A pool of usable size ``S`` whose first ``S - empty`` slots hold random experts with
    distinct usages (the clock just past them); ``rebase_threshold`` None keeps the default."""
    extra = {} if rebase_threshold is None else {"rebase_threshold": rebase_threshold}
    state = pc.init(L, E, S, capacity=capacity, eviction=eviction, **extra)
    n = S - empty
    ids = np.full(capacity, -1, np.int32)
    ids[:n] = rng.choice(L * E, size=n, replace=False)
    sfi = np.full(L * E, -1, np.int32)
    sfi[ids[:n]] = np.arange(n)
    usage = np.zeros(capacity, np.int32)
    usage[:n] = rng.permutation(n) + 1
    return state.replace(id_of_slot=jnp.asarray(ids), slot_for_id=jnp.asarray(sfi.reshape(L, E)),
                         usage=jnp.asarray(usage), step=jnp.int32(n))


# (label, eviction, L, E, usable size, capacity, rebase threshold or None, vmap batch or None)
EQUALITY_CASES = (
    ("LRU", "lru", 8, 16, 64, 64, None, None),
    ("PAIR_LFU", "pair_lfu", 8, 16, 64, 64, None, None),
    ("LRU, rebase threshold 80", "lru", 8, 16, 64, 64, 80, None),
    ("PAIR_LFU, rebase threshold 80", "pair_lfu", 8, 16, 64, 64, 80, None),
    ("LRU, usable 40 of capacity 64", "lru", 8, 16, 40, 64, None, None),
    ("LRU, 8192 slots (two blocks)", "lru", 16, 640, 8192, 8192, None, None),
    ("PAIR_LFU, 8192 slots (two blocks)", "pair_lfu", 16, 640, 8192, 8192, None, None),
    ("LRU, vmap over 3 caches", "lru", 8, 16, 64, 64, None, 3),
    ("PAIR_LFU, vmap over 3 caches, threshold 80", "pair_lfu", 8, 16, 64, 64, 80, 3),
    ("ROUTE_KNN", "route_knn", 8, 16, 64, 64, None, None),
    ("ROUTE_LFU, usable 40 of capacity 64, threshold 80", "route_lfu", 8, 16, 40, 64, 80, None),
    ("ROUTE_KNN, 8192 slots (two blocks)", "route_knn", 16, 640, 8192, 8192, None, None),
    ("ROUTE_LFU, vmap over 3 caches", "route_lfu", 8, 16, 64, 64, None, 3),
)
SMOKE_EQUALITY_CASES = (
    ("LRU, 8192 slots", "lru", 16, 640, 8192, 8192, None, None),
    ("PAIR_LFU, vmap over 2 caches, threshold 40", "pair_lfu", 4, 16, 32, 40, 40, 2),
    ("ROUTE_LFU, vmap over 2 caches, threshold 40", "route_lfu", 4, 16, 32, 40, 40, 2),
)
#: (L, E, S, k) of the per-eviction cost rows: Mixtral's geometry and the fine-grained one.
EVICTION_COST_GEOMETRIES = ((32, 8, 128, 2), (48, 128, 2048, 8))
SMOKE_EVICTION_COST_GEOMETRIES = ((4, 16, 32, 4),)
EVICTIONS = ("lru", "pair_lfu", "route_knn", "route_lfu")


def _case_program(eviction, backend):
    """A scan of random calls: ensure, ensure_hybrid in both orders, REUSE under LRU, each call
    picked by a switch; the state carried, every plan stacked."""
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

    return run, len(ops)


def check_case(case, steps, args, results) -> None:
    label, eviction, L, E, S, C, threshold, batch = case
    rng = np.random.default_rng(args.seed + len(label))
    t0 = time.perf_counter()
    states = [_filled_state(rng, eviction, L, E, S, C, threshold, empty=4)
              for _ in range(batch or 1)]
    state = states[0] if batch is None else jax.tree.map(lambda *x: jnp.stack(x), *states)
    lead = () if batch is None else (batch,)
    num_ops = 3 + (eviction == "lru")
    xs = (jnp.asarray(rng.integers(0, num_ops, (*lead, steps)), jnp.int32),
          jnp.asarray(np.where(rng.random((*lead, steps)) < 0.03, L,
                               rng.integers(0, L, (*lead, steps))), jnp.int32),
          jnp.asarray(rng.integers(-1, E, (*lead, steps, TOP_K)), jnp.int32),
          jnp.asarray(rng.choice([0, 16384, 32768, 65536], (*lead, steps)), jnp.int32))
    outs = []
    for backend in ("xla", args.candidate):
        run, _ = _case_program(eviction, backend)
        fn = jax.jit(run if batch is None else jax.vmap(run))
        try:
            outs.append(jax.device_get(fn(_fresh(state), xs)))
        except Exception as exc:
            traceback.print_exc()
            msg = f"FAIL [{label}]: backend {backend!r}: {type(exc).__name__}: {exc}"
            print(msg, flush=True)
            results["failures"].append(msg)
            results["equality"].append((label, "filled", steps, "FAIL", type(exc).__name__))
            return
    diff = tree_difference(outs[0], outs[1])
    fetched = int(np.asarray(outs[0][1].fetched).sum())
    detail = (f"{fetched} fetches, final clock {np.asarray(outs[0][0].step).ravel().tolist()}, "
              f"{time.perf_counter() - t0:.0f} s incl. compile")
    if diff:
        msg = f"MISMATCH [{label}] in: {', '.join(diff[:6])}"
        print(msg, flush=True)
        results["failures"].append(msg)
    results["equality"].append((label, "filled", steps, "MISMATCH" if diff else "match", detail))
    log(f"equality [{label}]: {'MISMATCH' if diff else 'MATCH'} ({detail})")


def eviction_cost_row(L, E, S, k, eviction, args, results) -> dict:
    """The per-call cost of ``ensure_hybrid`` (full policy) under ``eviction`` in a decode scan:
    ``--calls`` layer-calls per dispatch, whole tokens of random top-k routes (uniform, so most
    calls miss), from a filled pool, on both backends from the same state; us per call (median
    of ``--repeats`` trials of ``--replays`` dispatches), kernels and Pallas calls per scan
    iteration, misses per call, and the final states and plans compared leaf by leaf."""
    rng = np.random.default_rng(args.seed + S + len(eviction))
    state = _filled_state(rng, eviction, L, E, S, S)
    policy = pc.FetchPolicy.full()
    n = args.calls
    windows = [(jnp.asarray(np.arange(n) % L, jnp.int32),
                jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(n)]),
                            jnp.int32))
               for _ in range(1 + args.repeats * args.replays)]
    row = {"L": L, "E": E, "S": S, "k": k, "eviction": eviction, "us": {}, "kernels": {},
           "compile_s": {}}
    finals = []
    for backend in ("xla", args.candidate):
        def run(s, layers, routes, backend=backend):
            def body(s, x):
                s, plan = pc.ensure_hybrid(s, x[0], x[1], policy, backend=backend)
                return s, plan
            return lax.scan(body, s, (layers, routes))

        t0 = time.perf_counter()
        prog = jax.jit(run).lower(state, *windows[0]).compile()
        row["compile_s"][backend] = time.perf_counter() - t0
        s, plans = prog(_fresh(state), *windows[0])
        outs = [plans]
        samples = []
        for trial in range(args.repeats):
            t0 = time.perf_counter()
            for r in range(args.replays):
                s, plans = prog(s, *windows[1 + trial * args.replays + r])
                outs.append(plans)
            jax.block_until_ready(s)
            samples.append(time.perf_counter() - t0)
        row["us"][backend] = _per_call_us(samples, args.replays * n)
        row["kernels"][backend] = kernel_count(prog.as_text(), loop=True)
        host = jax.device_get(outs)
        row["misses"] = float(np.mean([np.asarray(p.missing).mean() for p in host]))
        finals.append((jax.device_get(s), _concat(host)))
    diff = tree_difference(finals[0], finals[1])
    row["match"] = not diff
    if diff:
        msg = (f"MISMATCH [cost {eviction} L={L},E={E},S={S},k={k}]: xla and {args.candidate} "
               f"differ in: {', '.join(diff[:6])}")
        print(msg, flush=True)
        results["failures"].append(msg)
    log(f"eviction cost [{eviction} L={L},E={E},S={S},k={k}]: "
        + ", ".join(f"{b} {us:.2f} us/call" for b, us in row["us"].items())
        + f"; {row['misses']:.2f} misses/call; {'match' if not diff else 'MISMATCH'}")
    return row


def eviction_cost_markdown(args, rows) -> list[str]:
    cand = args.candidate
    lines = ["", f"Per-call cost under each eviction: `ensure_hybrid` (full policy) in a "
             f"`lax.scan` of {args.calls} layer-calls per dispatch (whole tokens, uniform random "
             f"top-k routes), from a filled pool, {args.replays} dispatches per trial, median of "
             f"{args.repeats} trials, us per call including the scan's own per-iteration cost; "
             "kernels per scan iteration from the compiled program (in brackets the Pallas "
             "calls); the final states and every plan compared.", "",
             f"| L, E, S, k | eviction | misses/call | {cand} us | xla us | xla / {cand} | "
             f"{cand} kernels/iter | xla kernels/iter | compile s ({cand}; xla) | equal |",
             "|---|---|---:|---:|---:|---:|---|---|---|---|"]
    for row in rows:
        geo = f"{row['L']}, {row['E']}, {row['S']}, {row['k']}"
        if "skipped" in row:
            lines.append(f"| {geo} | {row['eviction']} | {row['skipped']} | | | | | | | |")
            continue
        kc, pc_ = row["kernels"][cand]
        kx, px = row["kernels"]["xla"]
        lines.append(
            f"| {geo} | {row['eviction']} | {row['misses']:.2f} | {row['us'][cand]:.2f} | "
            f"{row['us']['xla']:.2f} | {row['us']['xla'] / row['us'][cand]:.1f} | {kc} ({pc_}) | "
            f"{kx} ({px}) | {row['compile_s'][cand]:.1f}; {row['compile_s']['xla']:.1f} | "
            f"{'yes' if row['match'] else 'NO'} |")
    return lines


# --------------------------------------------------------------------------------------------
# Driver and report.
# --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", "--cpu-smoke", dest="smoke", action="store_true",
                   help="run on the CPU with backend 'interpret' for 'pallas', tiny sizes")
    p.add_argument("--candidate", choices=pc.BACKENDS, default=None,
                   help="backend compared against 'xla' (default: pallas; interpret with --smoke)")
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="skip cost rows that would end after this many seconds (default 420, "
                        "smoke 240)")
    p.add_argument("--steps", type=int, default=None,
                   help="ops per equality sequence; two sequences per geometry (default 192, "
                        "smoke 48)")
    p.add_argument("--skip-equality", action="store_true", help="only the cost table")
    p.add_argument("--op", choices=("ensure", "ensure_hybrid"), default="ensure",
                   help="the timed call (ensure_hybrid runs with the full policy)")
    p.add_argument("--misses", default="0,1,4,8", help="misses per call, comma separated")
    p.add_argument("--sizes", default=None,
                   help="only the cost geometries with these pool sizes S, comma separated "
                        "(e.g. 16384 to rerun the rows a cut-off run skipped)")
    p.add_argument("--calls", type=int, default=None,
                   help="layer-calls per dispatch (default 128, smoke 4)")
    p.add_argument("--heavy-unroll", type=int, default=8,
                   help="calls per unrolled jit for a backend whose call lowers to more than "
                        "--light-ops ops (default 8)")
    p.add_argument("--light-ops", type=int, default=64,
                   help="ops per lowered call up to which the unrolled jit holds --calls calls")
    p.add_argument("--trace-seconds", type=float, default=40.0,
                   help="halve the unrolled jit's calls while tracing them would take longer")
    p.add_argument("--replays", type=int, default=None,
                   help="dispatches per trial (default 10, smoke 2)")
    p.add_argument("--repeats", type=int, default=None,
                   help="trials, median taken (default 5, smoke 3)")
    p.add_argument("--evictions", default=",".join(EVICTIONS),
                   help="the evictions of the per-eviction cost rows, comma separated "
                        "(default all four; empty: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case-steps", type=int, default=None,
                   help="calls per equality case (default 96, smoke 12)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the phases, their rows and the time estimate, run nothing")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the report as the gpu_check section of this markdown file")
    args = p.parse_args(argv)
    smoke = args.smoke
    args.candidate = args.candidate or ("interpret" if smoke else "pallas")
    args.budget_seconds = args.budget_seconds or (240.0 if smoke else 420.0)
    args.steps = args.steps or (48 if smoke else 192)
    args.calls = args.calls or (4 if smoke else 128)
    args.replays = args.replays or (2 if smoke else 10)
    args.repeats = args.repeats or (3 if smoke else 5)
    args.misses = tuple(int(m) for m in args.misses.split(","))
    # The cases above cover the larger pools; the random sequences run on the small one.
    args.eq_geometries = GEOMETRIES[:1]
    args.case_steps = args.case_steps or (12 if smoke else 96)
    args.cases = SMOKE_EQUALITY_CASES if smoke else EQUALITY_CASES
    args.cost_geometries = SMOKE_COST_GEOMETRIES if smoke else COST_GEOMETRIES
    args.eviction_geometries = (SMOKE_EVICTION_COST_GEOMETRIES if smoke
                                else EVICTION_COST_GEOMETRIES)
    args.evictions = tuple(e for e in args.evictions.split(",") if e)
    unknown = set(args.evictions) - set(EVICTIONS)
    if unknown:
        p.error(f"--evictions: unknown {sorted(unknown)}; expected some of {EVICTIONS}")
    if args.sizes:
        keep = {int(x) for x in args.sizes.split(",")}
        args.cost_geometries = tuple(g for g in args.cost_geometries if g[2] in keep)
        if not args.cost_geometries:
            p.error(f"--sizes {args.sizes}: no cost geometry has those pool sizes")
    return args


def device_description() -> str:
    d = jax.devices()[0]
    return f"{d.platform} ({getattr(d, 'device_kind', '?')})"


def upstream_us(S, m):
    """flashlib's published figure for S slots and m misses (None where it published none)."""
    if S not in UPSTREAM_FIT:
        return None
    base, slope = UPSTREAM_FIT[S]
    return base + slope * m


def _cell(x, fmt="{:.2f}"):
    return "" if x is None else fmt.format(x)


def _verdict(row, floor, cand, smoke) -> str:
    target = upstream_us(row["S"], row["m"])
    if smoke or target is None or jax.default_backend() != "gpu":
        return "n/a (not a GPU)" if target is not None or smoke else "n/a"
    misses = []
    unrolled = row["us"][f"unrolled {cand}"]
    scan = row["us"][f"scan {cand}"] - floor["us"]
    for label, us in (("unrolled", unrolled), ("scan", scan)):
        if us > target:
            misses.append(f"{label} {us:.2f} > {target:.2f} us")
    k_unrolled, p_unrolled = row["kernels"][f"unrolled {cand}"]
    k_scan = row["kernels"][f"scan {cand}"][0] - floor["kernels"][0]
    if p_unrolled != 1 or k_scan > 1:
        misses.append(f"{k_scan:g} kernels/call in the scan, {p_unrolled:g} Pallas")
    return "met" if not misses else "not met: " + "; ".join(misses)


def cost_markdown(args, cost) -> list[str]:
    cand = args.candidate
    op = "`ensure`" if args.op == "ensure" else "`ensure_hybrid` (full policy)"
    lines = [
        "",
        f"Per-call cost of {op}, top-k routes on a full pool with exactly m misses per call "
        "(each evicts the LRU entry; checked on every timed call's plan), "
        f"{args.calls} layer-calls per dispatch, {args.replays} dispatches per trial, median of "
        f"{args.repeats} alternating trials, us per call. *unrolled*: one `jax.jit` of the "
        f"{args.calls} calls written out (\"(xN)\": N calls per jit, for a backend whose call "
        f"lowers to more than {args.light_ops} ops -- a 128-call jit of the XLA step compiles for "
        f"minutes -- or whose {args.calls} calls would take over {args.trace_seconds:.0f} s to "
        "trace); *scan*: per `lax.scan` iteration minus the trivial-body "
        "floor. Kernels per call, from the compiled programs: unrolled = all launches / calls "
        "(includes one stacking concatenation per plan leaf per jit); scan = while body and "
        "condition minus the floor's; in brackets the Pallas calls. Upstream: flashlib "
        f"`lru_ensure`, one Triton program, H100, CUDA graph ({UPSTREAM_NO_MISS_US} us with no "
        "miss; base + slope * m). Target: at or below upstream's base + slope * m, one kernel "
        "per call. *kernel device us*: the fused kernel's own time on the device per call, from a "
        "`jax.profiler` trace of one scan dispatch (events named `pallas_cache_step`); *CUDA "
        "graph*: whether that dispatch launched a CUDA graph (an XLA command buffer) -- "
        "upstream's figures are CUDA-graph figures.",
        "",
        f"| L, E, S, k | m | upstream us | {cand} unrolled | {cand} scan-floor | "
        f"{cand} kernel device us (profiler) | CUDA graph | xla unrolled | "
        f"xla scan-floor | {cand} kernels/call (unrolled; scan) | xla kernels/call "
        "(unrolled; scan) | off-m calls | target |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---|---|---:|---|",
    ]
    for row in cost["rows"]:
        geo = f"{row['L']}, {row['E']}, {row['S']}, {row['k']}"
        target = upstream_us(row["S"], row["m"])
        if "skipped" in row:
            lines.append(f"| {geo} | {row['m']} | {_cell(target)} | {row['skipped']} "
                         "| | | | | | | | | |")
            continue
        floor = cost["floors"][(row["L"], row["E"], row["S"])]

        def kern(backend, row=row, floor=floor):
            ku, pu = row["kernels"][f"unrolled {backend}"]
            ks, ps = row["kernels"][f"scan {backend}"]
            return f"{ku:.3g} ({pu:.3g}); {ks - floor['kernels'][0]:g} ({ps:g})"

        def unrolled(backend, row=row):
            width = row["unroll"].get(backend, args.calls)
            us = f"{row['us'][f'unrolled {backend}']:.2f}"
            return us if width == args.calls else f"{us} (x{width})"
        lines.append(
            f"| {geo} | {row['m']} | {_cell(target)} | {unrolled(cand)} | "
            f"{row['us'][f'scan {cand}'] - floor['us']:.2f} | {_cell(row.get('device_us'))} | "
            f"{row.get('graph', 'n/a')} | {unrolled('xla')} | "
            f"{row['us']['scan xla'] - floor['us']:.2f} | {kern(cand)} | {kern('xla')} | "
            f"{sum(row['off_m'].values())} of {4 * row['calls']} | "
            f"{_verdict(row, floor, cand, args.smoke)} |")
    lines.append("")
    for (L, E, S), floor in cost["floors"].items():
        compiles, ops = dict(floor["compile_s"]), {}
        for row in cost["rows"]:
            if (row["L"], row["E"], row["S"]) == (L, E, S):
                compiles.update(row.get("compile_s", {}))
                ops.update(row.get("ops", {}))
        lines.append(
            f"- L={L}, E={E}, S={S}: scan floor {floor['us']:.2f} us and {floor['kernels'][0]} "
            f"kernels per iteration; the unrolled program's dispatch alone (trivial body, same "
            f"arguments and outputs) {floor['unrolled_us']:.2f} us per call, so an unrolled "
            "figure near it is host-bound; one call lowers to "
            + ", ".join(f"{b} {n}" for b, n in ops.items())
            + " StableHLO ops (the rule of tests/test_kernels.py, this platform); "
            "compile s: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(compiles.items())))
    for msg in cost["notes"]:
        lines.append(f"- {msg}")
    return lines


def markdown(args, results, cost, matched, elapsed) -> str:
    cand = args.candidate
    lines = [
        f"## GPU check: {cand} vs xla (`benchmarks/gpu_check.py`)",
        "",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; "
        f"{'CPU smoke run' if args.smoke else jax.default_backend().upper() + ' run'}; "
        f"{elapsed:.0f} s in all",
        f"- jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"Python {platform.python_version()}, device {device_description()}",
        f"- equality ({cand} vs xla, every state and plan leaf after every step, and after every "
        f"cost row's calls): **{'all matched' if matched else 'MISMATCH'}**",
    ]
    for geometry, label, steps, status, detail in results["equality"]:
        lines.append(f"  - {geometry}, {label} start, {steps} random ops: {status} ({detail})")
    if results["failures"]:
        lines += ["", "Failures:", "", "```"] + results["failures"] + ["```"]
    if results["scenario_failures"]:
        lines += ["", "Rows without exactly m misses per call:", "", "```"]
        lines += results["scenario_failures"] + ["```"]
    lines += cost_markdown(args, cost)
    lines += eviction_cost_markdown(args, cost["evictions"])
    return "\n".join(lines) + "\n"


# Seconds per phase item, a guess from the H200 run of the earlier version (111 s for two
# sequence geometries and four rows): a pre-flight compiles two one-call programs, a cost
# geometry's first row compiles six programs and times 4 x 5 x 10 dispatches, a later row only
# times, an equality case compiles two scans.
ESTIMATE_S = {"preflight": 12.0, "first row": 35.0, "row": 12.0, "case": 15.0, "sequence": 40.0,
              "start": 15.0, "eviction row": 20.0}


def dry_run(args) -> str:
    """The phases in run order with their rows, and the estimated seconds (no JAX work)."""
    est = ESTIMATE_S["start"]
    lines = [f"candidate {args.candidate} vs xla; budget {args.budget_seconds:.0f} s"]
    for L, E, S, k in args.cost_geometries:
        lines.append(f"pre-flight L={L},E={E},S={S},k={k}")
        est += ESTIMATE_S["preflight"]
    for L, E, S, k in args.eviction_geometries:
        for eviction in args.evictions:
            lines.append(f"eviction cost L={L},E={E},S={S},k={k} {eviction}")
            est += ESTIMATE_S["eviction row"]
    for L, E, S, k in args.cost_geometries:
        for j, m in enumerate(args.misses):
            lines.append(f"cost L={L},E={E},S={S},k={k} m={m} ({args.op})")
            est += ESTIMATE_S["first row" if j == 0 else "row"]
    if not args.skip_equality:
        for case in args.cases:
            lines.append(f"equality case: {case[0]} ({args.case_steps} calls)")
            est += ESTIMATE_S["case"]
        for L, E, S in args.eq_geometries:
            lines.append(f"equality sequences L={L},E={E},S={S} ({args.steps} ops x 2 starts)")
            est += ESTIMATE_S["sequence"]
    lines.append(f"estimated {est:.0f} s ({est / 60:.1f} min) if nothing is cut by the budget; "
                 f"the budget cuts the run at {args.budget_seconds:.0f} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print(dry_run(args))
        return 0
    start = time.perf_counter()
    log(f"jax {jax.__version__} on {device_description()}; comparing {args.candidate!r} "
        f"against 'xla'")
    if args.candidate == "pallas" and jax.default_backend() != "gpu":
        print("No GPU here: backend 'pallas' needs one. Use --smoke (interpret) on a CPU; "
              "tests/test_kernels.py checks the CUDA lowering without a GPU.",
              file=sys.stderr)
        return 3

    results = {"equality": [], "failures": [], "scenario_failures": []}
    cost = {"rows": [], "floors": {}, "notes": [], "evictions": []}

    def report() -> str:
        ok = all(status in ("match", "skipped (budget)")
             for _, _, _, status, _ in results["equality"])
        return markdown(args, results, cost, ok and not results["failures"],
                        time.perf_counter() - start)

    def write_report():
        # Rewritten after every phase, so a run killed at its time limit still leaves a report.
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_section("gpu_check", report(), args.out)

    # Pre-flight: one call per cost geometry, compiled and compared; a failure stops the cost
    # phase (its rows would only time a wrong kernel) with the report written.
    preflight_ok = True
    for L, E, S, k in args.cost_geometries:
        t0 = time.perf_counter()
        failure = preflight(L, E, S, k, args)
        log(f"pre-flight [L={L},E={E},S={S},k={k}]: {failure or 'MATCH'} "
            f"({time.perf_counter() - t0:.1f} s incl. compile)")
        if failure:
            results["failures"].append(f"pre-flight [L={L},E={E},S={S},k={k}]: {failure}")
            cost["notes"].append(f"cost phase stopped: the pre-flight at S={S} failed")
            preflight_ok = False
            write_report()
            break

    # The per-call cost under each eviction first (the ring evictions' kernel is the newest
    # path), while the budget lasts.
    for L, E, S, k in args.eviction_geometries:
        for eviction in args.evictions:
            if time.perf_counter() - start + ESTIMATE_S["eviction row"] > args.budget_seconds:
                cost["evictions"].append({"L": L, "E": E, "S": S, "k": k, "eviction": eviction,
                                          "skipped": "skipped (budget)"})
                continue
            try:
                cost["evictions"].append(eviction_cost_row(L, E, S, k, eviction, args, results))
            except Exception as exc:
                traceback.print_exc()
                msg = (f"eviction cost [{eviction} L={L},E={E},S={S},k={k}] failed: "
                       f"{type(exc).__name__}: {exc}")
                print(msg, flush=True)
                results["failures"].append(msg)
                cost["evictions"].append({"L": L, "E": E, "S": S, "k": k, "eviction": eviction,
                                          "skipped": "error"})
            write_report()

    # Budget: a geometry's first row compiles (estimated from the previous geometry's first row,
    # scaled up), a later row only runs (estimated from the row before it).
    first_row_s = 10.0 if args.smoke else 45.0
    for L, E, S, k in (args.cost_geometries if preflight_ok else ()):
        base = None
        row_s = None
        for m in args.misses:
            elapsed = time.perf_counter() - start
            needed = 1.3 * (row_s if row_s is not None else first_row_s)
            if elapsed + needed > args.budget_seconds:
                log(f"cost [L={L},E={E},S={S},k={k}, m={m}]: SKIPPED ({elapsed:.0f} s used of "
                    f"{args.budget_seconds:.0f} s, about {needed:.0f} s needed)")
                cost["rows"].append({"L": L, "E": E, "S": S, "k": k, "m": m,
                                     "skipped": "skipped (budget)"})
                continue
            t0 = time.perf_counter()
            try:
                if base is None:
                    base = full_state(np.random.default_rng(args.seed + S), L, E, S)
                    cost["floors"][(L, E, S)] = floor_row(L, E, S, k, args, base)
                cost["rows"].append(cost_row(L, E, S, k, m, args, base, results))
            except Exception as exc:
                traceback.print_exc()
                msg = f"cost [L={L},E={E},S={S},k={k}, m={m}] failed: {type(exc).__name__}: {exc}"
                print(msg, flush=True)
                results["failures"].append(msg)
                cost["rows"].append({"L": L, "E": E, "S": S, "k": k, "m": m,
                                     "skipped": "error"})
                continue
            spent = time.perf_counter() - t0
            if row_s is None:
                first_row_s = 1.5 * spent
            compiling = sum(cost["rows"][-1]["compile_s"].values())
            row_s = max(spent - compiling, 0.5)  # the next row of this geometry compiles nothing
            write_report()

    # Equality: the cases (every eviction the kernel runs, low threshold, usable < capacity,
    # > 4096 slots, vmap), then the random operation sequences, each while the budget lasts.
    case_s = 20.0 if args.smoke else ESTIMATE_S["case"]
    for case in (() if args.skip_equality else args.cases):
        if time.perf_counter() - start + case_s > args.budget_seconds:
            results["equality"].append((case[0], "filled", args.case_steps, "skipped (budget)",
                                        ""))
            continue
        check_case(case, args.case_steps, args, results)
        write_report()
    for i, (L, E, S) in enumerate(() if args.skip_equality else args.eq_geometries):
        if time.perf_counter() - start + 2 * case_s > args.budget_seconds:
            results["equality"].append((f"L={L},E={E},S={S}", "random", args.steps,
                                        "skipped (budget)", ""))
            continue
        check_equality(L, E, S, args.steps, args.candidate, args.seed + i, results)
        write_report()

    matched = not results["failures"] and all(
        status in ("match", "skipped (budget)") for _, _, _, status, _ in results["equality"])
    text = report()
    print()
    print(text)
    write_report()
    if args.out is not None:
        print(f"markdown report written to {args.out}")
    if not matched:
        print("FAILED: pallas/xla results differ or a backend failed (see above)", file=sys.stderr)
        return 1
    if results["scenario_failures"]:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
