"""What one cache step costs: the NumPy reference vs a jitted call vs a step inside a compiled loop.

For ``ensure_hybrid`` (fraction 0.4, RECENCY order, PROMOTE_ONE admission) on a top-8 routing
trace from ``pallas_cache.sizing.synthetic_trace`` (uniform popularity, as ``vs_rust.py``), at
two geometries -- the seed-000 toy (L=8, E=16, S=64) and a large MoE
(L=48, E=128, S=2048) -- this measures the median per-call time of

  (a) the NumPy reference, ``ReferenceCache.ensure_hybrid``, one call at a time;
  (b) ``jax.jit(pc.ensure_hybrid)`` called from Python, one call at a time (dispatch included,
      result waited for);
  (c) one layer-step inside a compiled ``lax.scan`` decode loop over (tokens x layers), which is
      how the library is meant to run: the whole loop is one program, so the per-step cost is
      the cache bookkeeping alone.

All three start from the same warmed cache and replay the same trace. Run it from the repository
root::

    python benchmarks/step_cost.py [--tokens-small 200] [--tokens-large 40] [--rounds 5]
                                   [--no-write]

It prints a table with the ratios and writes (or replaces) the "step cost" section of
``benchmarks/RESULTS.md`` with the machine and the date. The target is (c) at least 10x faster
than (a).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pallas_cache as pc  # noqa: E402
from pallas_cache.sizing.synthetic import SyntheticParams, synthetic_trace  # noqa: E402
from reference import ReferenceCache, ReferencePolicy  # noqa: E402
from results_file import RESULTS, write_section  # noqa: E402

TOP_K = 8
FRACTION = 0.4
CONFIGS = (("small", 8, 16, 64), ("large", 48, 128, 2048))


def routing_trace(num_layers, num_experts, tokens, seed=0):
    """int32[tokens, L, TOP_K]: a ``synthetic_trace`` with the generator's default (uniform)
    popularity, the routes ``vs_rust.py`` times; TOP_K distinct experts per step."""
    trace = synthetic_trace(SyntheticParams(num_layers=num_layers, num_experts=num_experts,
                                            top_k=TOP_K, num_tokens=tokens), seed=seed)
    layers, routes = trace.to_array()
    assert np.array_equal(layers, np.tile(np.arange(num_layers), tokens))  # decode order
    return routes.reshape(tokens, num_layers, TOP_K).astype(np.int32)


def warm_both(num_layers, num_experts, cache_size, warmup):
    """The JAX state and a reference cache after the same warm-up trace."""
    state = pc.init(num_layers, num_experts, cache_size)
    ref = ReferenceCache(num_layers, num_experts, cache_size)
    policy, ref_policy = pc.FetchPolicy.fraction(FRACTION), ReferencePolicy.fraction(FRACTION)
    for token_routes in warmup:
        for layer, routes in enumerate(token_routes):
            state, _ = pc.ensure_hybrid(state, layer, routes, policy)
            ref.ensure_hybrid(layer, routes, ref_policy)
    np.testing.assert_array_equal(np.asarray(state.id_of_slot), ref.id_of_slot)
    return state, ref


def reference_round(ref, trace):
    """Median seconds per call of the reference replaying ``trace`` from (a copy of) ``ref``."""
    ref = copy.deepcopy(ref)
    policy = ReferencePolicy.fraction(FRACTION)
    times = []
    for token_routes in trace:
        for layer, routes in enumerate(token_routes):
            start = time.perf_counter()
            ref.ensure_hybrid(layer, routes, policy)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def jitted_call_round(step, state, layers, device_trace, policy):
    """Median seconds per ``jax.jit(pc.ensure_hybrid)`` call from Python, result waited for."""
    times = []
    for token_routes in device_trace:
        for layer, routes in zip(layers, token_routes):
            start = time.perf_counter()
            state, plan = step(state, layer, routes, policy)
            jax.block_until_ready(plan)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(state, ref, trace, rounds):
    """(a), (b), (c) medians over ``rounds`` interleaved rounds, and the median a/c ratio.

    Interleaving matters on a shared machine: the three are measured back to back in every round,
    so a slow spell hits all of them rather than one.
    """
    policy = pc.FetchPolicy.fraction(FRACTION)
    num_layers = trace.shape[1]
    step = jax.jit(pc.ensure_hybrid, static_argnames=("order", "admission", "backend"))
    layer_ids = [jnp.int32(layer) for layer in range(num_layers)]
    device_trace = [[jnp.asarray(r) for r in token_routes] for token_routes in trace]
    jax.block_until_ready(step(state, layer_ids[0], device_trace[0][0], policy))  # compile

    def layer_step(state, xs):
        layer, layer_routes = xs
        state, plan = pc.ensure_hybrid(state, layer, layer_routes, policy)
        return state, plan.copy.count

    layers = jnp.tile(jnp.arange(num_layers, dtype=jnp.int32), trace.shape[0])
    routes = jnp.asarray(trace.reshape(-1, TOP_K))
    loop = jax.jit(lambda s, l, r: jax.lax.scan(layer_step, s, (l, r)))
    jax.block_until_ready(loop(state, layers, routes))  # compile

    a, b, c = [], [], []
    for _ in range(rounds):
        a.append(reference_round(ref, trace))
        b.append(jitted_call_round(step, state, layer_ids, device_trace, policy))
        scans = []
        for _ in range(3):  # the first scan after a Python-heavy stretch runs on cold caches
            start = time.perf_counter()
            jax.block_until_ready(loop(state, layers, routes))
            scans.append((time.perf_counter() - start) / len(layers))
        c.append(min(scans))
    ratio = statistics.median(x / y for x, y in zip(a, c))
    return statistics.median(a), statistics.median(b), statistics.median(c), ratio


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = jax.devices()[0]
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}; Python "
            f"{platform.python_version()}, JAX {jax.__version__} on {device.platform} "
            f"({device.device_kind})")


def write_results(rows, tokens):
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    try:
        load = " (1-minute load average %.1f)" % os.getloadavg()[0]
    except OSError:
        load = ""
    lines = [
        "## Step cost: reference vs jitted call vs compiled loop",
        "",
        f"`python benchmarks/step_cost.py` on {date}{load}. Machine: {machine()}.",
        "",
        f"`ensure_hybrid`, fraction {FRACTION}, RECENCY + PROMOTE_ONE, top-{TOP_K} routes of "
        f"`synthetic_trace` (uniform popularity, as vs_rust.py), warmed cache; medians over "
        f"interleaved rounds (a/c is the median of the per-round ratios). (a) NumPy reference; (b) "
        f"`jax.jit(pc.ensure_hybrid)` called from Python (dispatch included); (c) one layer-step "
        f"inside a compiled `lax.scan` over (tokens x layers).",
        "",
        "| geometry | tokens | (a) reference | (b) jitted call | (c) step in scan | a/b | a/c |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, geometry, a, b, c, ratio in rows:
        lines.append(
            f"| {name} {geometry} | {tokens[name]} | {a * 1e6:.1f} us | {b * 1e6:.1f} us | "
            f"{c * 1e6:.2f} us | {a / b:.1f}x | {ratio:.1f}x |")
    write_section("step_cost", "\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-small", type=int, default=200)
    parser.add_argument("--tokens-large", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=20, help="tokens replayed before timing")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    tokens = {"small": args.tokens_small, "large": args.tokens_large}

    rows = []
    for name, num_layers, num_experts, cache_size in CONFIGS:
        geometry = f"L={num_layers} E={num_experts} S={cache_size}"
        trace = routing_trace(num_layers, num_experts, args.warmup + tokens[name])
        warmup, timed = trace[: args.warmup], trace[args.warmup:]
        state, ref = warm_both(num_layers, num_experts, cache_size, warmup)
        a, b, c, ratio = measure(state, ref, timed, args.rounds)
        rows.append((name, geometry, a, b, c, ratio))
        print(f"{name:5s} {geometry:22s} (a) reference {a * 1e6:9.1f} us   (b) jitted call "
              f"{b * 1e6:8.1f} us   (c) step in scan {c * 1e6:7.2f} us   a/b {a / b:6.1f}x   "
              f"a/c {ratio:6.1f}x", flush=True)
    if not args.no_write:
        write_results(rows, tokens)
        print(f"wrote {RESULTS}")
    return rows


if __name__ == "__main__":
    main()
