"""Phase ``geometries``: the per-call cost of ``ensure_hybrid`` (full policy) in a decode scan
under each of the four evictions at the geometries a user runs: (32, 8, 64, 2) and
(32, 8, 256, 2) (Mixtral-like: a quarter of the experts, and all of them), (58, 256, 2048, 8)
and (61, 256, 16384, 8) (fine-grained; the last pool holds every expert). Whole tokens of
uniform random top-k routes from a filled pool, both backends from the same state: wall and
device us per call (the floor subtracted), misses per call, kernels per iteration, and the
final states and plans compared."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import pallas_cache as pc

from .common import (EVICTIONS, cell, cost_scan, events_lines, filled_state, log,
                     profiled_compile_s)

NAME = "geometries"
GEOMETRIES = ((32, 8, 64, 2), (32, 8, 256, 2), (58, 256, 2048, 8), (61, 256, 16384, 8))
SMOKE_GEOMETRIES = ((4, 8, 16, 2),)
# A row compiles three programs (xla, the candidate, the floor), times, profiles; the ring
# evictions' XLA step is the largest program (853-2141 ops lowered for CUDA against ~300).
ESTIMATE_S = {"lru": 8.0, "pair_lfu": 8.0, "route_knn": 10.0, "route_lfu": 10.0}


def plan(args):
    return [({"L": L, "E": E, "S": S, "k": k, "eviction": e,
              "label": f"{e} L={L},E={E},S={S},k={k}"}, ESTIMATE_S[e] + profiled_compile_s(args))
            for L, E, S, k in (SMOKE_GEOMETRIES if args.smoke else GEOMETRIES)
            for e in EVICTIONS]


def _call(state, layer, routes, backend):
    return pc.ensure_hybrid(state, layer, routes, pc.FetchPolicy.full(), backend=backend)


def run(ctx, row) -> dict:
    args = ctx.args
    L, E, S, k, eviction = row["L"], row["E"], row["S"], row["k"], row["eviction"]
    rng = np.random.default_rng(args.seed + S + len(eviction))
    state = filled_state(rng, eviction, L, E, S, S)
    n = args.calls
    windows = [(jnp.asarray(np.arange(n) % L, jnp.int32),
                jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(n)]),
                            jnp.int32))
               for _ in range(1 + args.repeats * args.replays)]
    out = cost_scan(ctx, row["label"], _call, state, windows)
    plans = out.pop("plans")["xla"]
    out.pop("final")
    out["misses"] = float(np.mean([np.asarray(p.missing).mean() for p in plans]))
    log(f"geometries [{row['label']}]: " + ", ".join(
        f"{b} {out['us'][b]:.2f} us/call wall, {cell(out['device_us'].get(b))} device"
        for b in ctx.backends) + f"; {out['misses']:.2f} misses/call; {out['status']}")
    return out


def markdown(args, done) -> list[str]:
    cand = args.candidate
    lines = [f"Per-call cost under each eviction: `ensure_hybrid` (full policy) in a `lax.scan` "
             f"of {args.calls} layer-calls per dispatch (whole tokens, uniform random top-k "
             f"routes) from a filled pool, {args.replays} dispatches per trial, median of "
             f"{args.repeats} trials. *device us*: the sum of the GPU events of one profiled "
             "dispatch minus the trivial-body scan's, per call; *kernel us*: the mean of the "
             "Pallas kernel's own GPU events; *wall us*: including the scan's "
             "own per-iteration cost; kernels per scan iteration (in brackets the Pallas calls).",
             "", f"| L, E, S, k | eviction | misses/call | {cand} kernel us | "
             f"{cand} device us | xla device us | "
             f"{cand} wall us | xla wall us | kernels/iter ({cand}; xla) | compile s "
             f"({cand}; xla) | status |", "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for row, r in done:
        geo = f"{row['L']}, {row['E']}, {row['S']}, {row['k']}"
        if "us" not in r:
            lines.append(f"| {geo} | {row['eviction']} | | | | | | | | | {r['status']} |")
            continue
        kc, kx = r["kernels"][cand], r["kernels"]["xla"]
        lines.append(
            f"| {geo} | {row['eviction']} | {r['misses']:.2f} | "
            f"{cell(r.get('kernel_us', {}).get(cand))} | {cell(r['device_us'].get(cand))} | {cell(r['device_us'].get('xla'))} | "
            f"{r['us'][cand]:.2f} | {r['us']['xla']:.2f} | {kc[0]} ({kc[1]}); {kx[0]} ({kx[1]}) "
            f"| {r['compile_s'][cand]:.1f}; {r['compile_s']['xla']:.1f} | {r['status']} |")
    notes = {r.get("device_note") for _, r in done if r.get("device_note")}
    lines += ["", "Device trace: " + "; ".join(sorted(notes))] if notes else []
    return lines + events_lines(
        done, lambda row: f"{row['L']}, {row['E']}, {row['S']}, {row['k']}, {row['eviction']}")
