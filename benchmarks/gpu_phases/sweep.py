"""Phase ``sweep``: the LRU miss sweep against upstream's table. ``ensure`` (or
``ensure_hybrid`` with the full policy, ``--op``) on a full LRU pool with exactly m misses per
call, m = 0, 1, 8, at S = 512 and S = 16384 (upstream's sizes), in a ``lax.scan``: wall and
device us per call on both backends, the floor subtracted, next to flashlib ``lru_ensure``
(one Triton program, an H100, a CUDA graph). Every timed call's plan is checked for m misses
and m fetches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_cache as pc

from .common import (cell, cost_scan, events_lines, full_state, log, ops_per_call,
                     profiled_compile_s)

NAME = "sweep"
GEOMETRIES = ((48, 64, 512, 8), (64, 512, 16384, 8))  # (L, E, S, k)
SMOKE_GEOMETRIES = ((4, 32, 64, 8),)
MISSES = (0, 1, 8)
# flashlib lru_ensure on an H100 in a CUDA graph: us per call = base + slope * misses, by S.
UPSTREAM_FIT = {512: (1.6, 0.56), 4096: (2.9, 0.89), 16384: (3.6, 2.11)}
UPSTREAM_NO_MISS_US = 1.33
# A geometry's first row fills the pool and compiles three programs; a later row only times.
ESTIMATE_S = {"first row": 22.0, "row": 4.0}


class MissSchedule:
    """Routes with exactly ``m`` misses per call once the pool is warm (full, LRU).

    Call ``c`` routes layer ``c mod L``. Each layer routes its ``k - m`` hot experts on every
    visit (refreshed every ``L`` calls) and the next ``m`` of its other ``P = E - k + m`` experts,
    taken cyclically. On a full pool every miss evicts the least recently used entry; the hot
    entries are younger than every streamed one when ``S > k * L``, so the streamed entries leave
    in install order, each after about ``R = (S - L (k - m)) / m`` calls, and an expert comes
    round again after at least ``floor(P / m) * L`` calls. ``check`` asks for that to exceed
    ``R + L``. The plans of the timed calls are checked all the same.
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


def plan(args):
    out = []
    for L, E, S, k in (SMOKE_GEOMETRIES if args.smoke else GEOMETRIES):
        for j, m in enumerate(MISSES):
            out.append(({"L": L, "E": E, "S": S, "k": k, "m": m,
                         "label": f"LRU L={L},E={E},S={S},k={k} m={m} ({args.op})"},
                        ESTIMATE_S["first row" if j == 0 else "row"]
                        + (profiled_compile_s(args) if j == 0 else 0.0)))
    return out


def upstream_us(S, m):
    """flashlib's published figure for S slots and m misses (None where it published none)."""
    if S not in UPSTREAM_FIT:
        return None
    base, slope = UPSTREAM_FIT[S]
    return base + slope * m


def _call_for(op):
    def call(state, layer, routes, backend):
        if op == "ensure":
            return pc.ensure(state, layer, routes, backend=backend)
        return pc.ensure_hybrid(state, layer, routes, pc.FetchPolicy.full(), backend=backend)
    return call


@jax.jit
def _warm(state, layers, routes):
    def body(state, x):
        return pc.ensure(state, x[0], x[1], backend="xla")[0], None
    return lax.scan(body, state, (layers, routes))[0]


_BASES: dict = {}


def off_m_calls(plans, m) -> int:
    """Calls whose plan did not miss and fetch exactly ``m`` (or was refused)."""
    return sum(int(((np.asarray(p.missing) != m) | (np.asarray(p.fetched) != m)
                    | (np.asarray(p.error) != 0)).sum()) for p in plans)


def run(ctx, row) -> dict:
    args = ctx.args
    L, E, S, k, m = row["L"], row["E"], row["S"], row["k"], row["m"]
    if (L, E, S) not in _BASES:
        _BASES[(L, E, S)] = full_state(np.random.default_rng(args.seed + S), L, E, S)
    sched = MissSchedule(L, E, S, k, m, seed=args.seed + 7 * S + m)
    sched.check()
    n = args.calls
    state = _BASES[(L, E, S)]
    for _ in range(-(-sched.warmup_calls() // n)):
        state = _warm(state, *(jnp.asarray(a) for a in sched.take(n)))
    windows = [tuple(jnp.asarray(a) for a in sched.take(n))
               for _ in range(1 + args.repeats * args.replays)]
    out = cost_scan(ctx, row["label"], _call_for(args.op), state, windows,
                    key=("sweep", args.op, L, E, S, k, n))
    plans = out.pop("plans")
    out.pop("final")
    out["off_m"] = {b: off_m_calls(plans[b], m) for b in ctx.backends}
    out["calls"] = n * len(windows)
    out["ops"] = {b: ops_per_call(_call_for(args.op), b, state, *(w[0] for w in windows[0]))
                  for b in ctx.backends}
    if any(out["off_m"].values()):
        ctx.scenario_failures.append(f"{row['label']}: calls without exactly {m} misses and "
                                     f"fetches: {out['off_m']}")
    log(f"sweep [{row['label']}]: " + ", ".join(
        f"{b} {out['us'][b]:.2f} us/call wall, {cell(out['device_us'].get(b))} device"
        for b in ctx.backends) + f"; off-m calls {sum(out['off_m'].values())}; {out['status']}")
    return out


def _verdict(row, result, cand) -> str:
    target = upstream_us(row["S"], row["m"])
    device = result["device_us"].get(cand)
    if target is None or device is None:
        return "n/a (no device time)" if device is None else "n/a"
    misses = []
    if device > target:
        misses.append(f"{device:.2f} > {target:.2f} us")
    kernels, pallas = result["kernels"][cand]
    if pallas != 1:
        misses.append(f"{pallas} Pallas calls per iteration")
    return "met" if not misses else "not met: " + "; ".join(misses)


def _ops(counted) -> str:
    pallas, others = counted
    return f"{others} + {pallas} Pallas" if pallas else str(others)


def markdown(args, done) -> list[str]:
    cand = args.candidate
    lines = [f"LRU miss sweep: `{args.op}` on a full LRU pool with exactly m misses per call "
             f"(checked on every timed call's plan), a `lax.scan` of {args.calls} calls per "
             f"dispatch, {args.replays} dispatches per trial, median of {args.repeats} trials. "
             "*device us*: the sum of the GPU events of one profiled dispatch minus the "
             "trivial-body scan's, per call; *kernel us*: the mean of the Pallas kernel's own "
             "GPU events (the copies and fusions around it not counted), beside upstream's "
             "figure. Upstream: flashlib `lru_ensure`, one Triton "
             f"program, H100, CUDA graph ({UPSTREAM_NO_MISS_US} us with no miss; base + slope * "
             "m); target: the candidate's device us at or below it, one Pallas call per call.",
             "", f"| L, E, S, k | m | upstream us | {cand} kernel us | {cand} device us | "
             f"xla device us | "
             f"{cand} wall us | xla wall us | kernels/iter ({cand}; xla) | lowered ops/call "
             f"({cand}; xla) | off-m calls | target | status |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|---|"]
    for row, r in done:
        geo = f"{row['L']}, {row['E']}, {row['S']}, {row['k']}"
        up = upstream_us(row["S"], row["m"])
        if "us" not in r:
            lines.append(f"| {geo} | {row['m']} | {cell(up)} | | | | | | | | | | "
                         f"{r['status']} |")
            continue
        kc, kx = r["kernels"][cand], r["kernels"]["xla"]
        lines.append(
            f"| {geo} | {row['m']} | {cell(up)} | {cell(r.get('kernel_us', {}).get(cand))} | "
            f"{cell(r['device_us'].get(cand))} | "
            f"{cell(r['device_us'].get('xla'))} | {r['us'][cand]:.2f} | {r['us']['xla']:.2f} | "
            f"{kc[0]} ({kc[1]}); {kx[0]} ({kx[1]}) | {_ops(r['ops'][cand])}; "
            f"{_ops(r['ops']['xla'])} | {sum(r['off_m'].values())} of "
            f"{2 * r['calls']} | {_verdict(row, r, cand)} | {r['status']} |")
    notes = {r.get("device_note") for _, r in done if r.get("device_note")}
    lines += ["", "Device trace: " + "; ".join(sorted(notes))] if notes else []
    return lines + events_lines(
        done, lambda row: f"{row['L']}, {row['E']}, {row['S']}, {row['k']}, m={row['m']}")
