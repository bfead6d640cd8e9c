"""Phase ``mesh``: the several-devices path (docs/semantics.md §5.17) inside
``jax.shard_map(..., check_vma=True)`` over every device of the machine, both layouts:
*expert-parallel* (one cache per device, each of its own experts, fed its local routes) and
*tensor-parallel* (one replicated cache, the same plan on every device; ``check_vma`` proves the
replication). Each row is a decode scan of ``ensure_hybrid`` (full policy) run on both backends
(wall and device us per call, the floor subtracted; final states and plans compared), and the
mesh's final caches are compared with one-device caches fed the same routes (device 0's local
routes for expert-parallel), so a layout that drifts from one cache fails."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import pallas_cache as pc
from pallas_cache import mesh as pm
from pallas_cache.state import Clock

from .common import cell, cost_scan, log, profiled_compile_s, tree_difference

NAME = "mesh"
AXIS = "d"
LAYOUTS = ("expert-parallel", "tensor-parallel")
GEOMETRY = (32, 8, 64, 2)  # (L, E, S per device, k): Mixtral-like
SMOKE_GEOMETRY = (4, 8, 16, 2)
ESTIMATE_S = {"row": 12.0}  # four programs (xla, candidate, floor, one-device reference)


def plan(args):
    L, E, S, k = SMOKE_GEOMETRY if args.smoke else GEOMETRY
    return [({"layout": layout, "eviction": e, "L": L, "E": E, "S": S, "k": k,
              "label": f"{layout} {e} L={L},E={E},S={S},k={k}"}, ESTIMATE_S["row"] + profiled_compile_s(args))
            for layout in LAYOUTS for e in args.mesh_evictions]


def _programs(mesh, layout, sharding, state, windows):
    """``(name, options) -> (compiled, seconds)`` of the shard_mapped scan for a backend or
    ``"floor"``, compiled with ``options``."""
    policy = pc.FetchPolicy.full()
    expert = layout == "expert-parallel"
    spec = P(AXIS) if expert else P()

    def make(name, options=None):
        def body(state, layers, routes):
            if expert:
                state = pm.device_view(state)
            device = lax.axis_index(AXIS)

            def step(s, x):
                layer, r = x
                if expert:
                    r = pm.local_routes(sharding, r, device)
                if name == "floor":  # the same carry and plan shapes, a trivial body
                    like = jax.eval_shape(
                        lambda s, la, r: pc.ensure_hybrid(s, la, r, policy, backend="xla")[1],
                        s, layer, r)
                    return s.replace(clock=Clock(step=s.step + 1)), jax.tree.map(
                        lambda a: jnp.broadcast_to((layer + r[0]).astype(a.dtype), a.shape),
                        like)
                return pc.ensure_hybrid(s, layer, r, policy, backend=name)

            out = lax.scan(step, state, (layers, routes))
            return pm.stack_view(out) if expert else out

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P(), P()),
                                   out_specs=spec, check_vma=True))
        t0 = time.perf_counter()
        compiled = fn.lower(state, *windows[0]).compile(compiler_options=options)
        return compiled, time.perf_counter() - t0
    return make


@jax.jit
def _one_device(state, layers, routes):
    policy = pc.FetchPolicy.full()
    return lax.scan(lambda s, x: pc.ensure_hybrid(s, x[0], x[1], policy, backend="xla"),
                    state, (layers, routes))[0]


def smoke_rows(rows):
    """A smoke run takes the first row of each layout."""
    return [next(r for r in rows if r[0]["layout"] == layout) for layout in LAYOUTS]


def run(ctx, row) -> dict:
    args = ctx.args
    L, E, S, k, eviction = row["L"], row["E"], row["S"], row["k"], row["eviction"]
    devices = jax.devices()
    D = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    expert = row["layout"] == "expert-parallel"
    sharding = pm.expert_sharding(E, D)
    rng = np.random.default_rng(args.seed + S + len(row["layout"]))
    if expert:
        state = pm.init_expert_parallel(sharding, L, max(S, sharding.num_local),
                                        eviction=eviction)
        state = jax.device_put(state, jax.sharding.NamedSharding(mesh, P(AXIS)))
    else:
        state = pc.init(L, E, S, eviction=eviction)
    n = args.calls
    windows = [(jnp.asarray(np.arange(n) % L, jnp.int32),
                jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(n)]),
                            jnp.int32))
               for _ in range(1 + args.repeats * args.replays)]
    out = cost_scan(ctx, row["label"], None, state, windows,
                    programs=_programs(mesh, row["layout"], sharding, state, windows))
    out.pop("plans")
    out["devices"] = D
    # The layout against one device: the same calls (device 0's local routes) on one cache.
    final = jax.device_get(out.pop("final"))
    one = (jax.tree.map(lambda leaf: np.asarray(leaf)[0], jax.device_get(state)) if expert
           else jax.device_get(state))
    one = jax.tree.map(jnp.asarray, one)
    for layers, routes in windows:  # every window once, as each backend's chain ran them
        if expert:
            routes = pm.local_routes(sharding, routes, 0)
        one = _one_device(one, layers, routes)
    mine = jax.tree.map(lambda leaf: np.asarray(leaf)[0], final) if expert else final
    diff = tree_difference(mine, jax.device_get(one))
    out["one_device"] = "match" if not diff else "MISMATCH"
    if diff:
        out["status"] = "MISMATCH"
        ctx.fail(f"MISMATCH [mesh {row['label']}]: device 0's cache differs from one cache fed "
                 f"its routes in: {', '.join(diff[:6])}")
    log(f"mesh [{row['label']}, {D} devices]: " + ", ".join(
        f"{b} {out['us'][b]:.2f} us/call wall, {cell(out['device_us'].get(b))} device"
        for b in ctx.backends) + f"; one device {out['one_device']}; {out['status']}")
    return out


def markdown(args, done) -> list[str]:
    cand = args.candidate
    lines = [f"Several devices (`jax.shard_map`, `check_vma=True`, every device of the machine on "
             f"one axis): `ensure_hybrid` (full policy) in a `lax.scan` of {args.calls} calls "
             "per dispatch inside the `shard_map`, uniform random top-k routes from a cold pool. "
             "*one device*: device 0's final cache against one cache fed the same (local) "
             "routes. With `backend='pallas'` the step inside the `shard_map` is the fused "
             "kernel, one Pallas call per iteration (docs/design.md, \"Several devices\").", "",
             f"| layout | eviction | L, E, S, k | devices | {cand} device us | xla device us | "
             f"{cand} wall us | xla wall us | kernels/iter ({cand}; xla) | one device | status |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    for row, r in done:
        geo = f"{row['L']}, {row['E']}, {row['S']}, {row['k']}"
        if "us" not in r:
            lines.append(f"| {row['layout']} | {row['eviction']} | {geo} | | | | | | | | "
                         f"{r['status']} |")
            continue
        kc, kx = r["kernels"][cand], r["kernels"]["xla"]
        lines.append(
            f"| {row['layout']} | {row['eviction']} | {geo} | {r['devices']} | "
            f"{cell(r['device_us'].get(cand))} | {cell(r['device_us'].get('xla'))} | "
            f"{r['us'][cand]:.2f} | {r['us']['xla']:.2f} | {kc[0]} ({kc[1]}); {kx[0]} ({kx[1]}) "
            f"| {r['one_device']} | {r['status']} |")
    return lines
