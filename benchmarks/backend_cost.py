"""CPU cost of the interpret backend against the xla backend, per layer-step inside lax.scan.

The ``interpret`` backend runs the Pallas kernels in the Pallas interpreter: a test path, not a
product path, but it must stay usable (target: within 2x of ``xla``). Both backends run the same
compiled decode loop (``ensure_hybrid``, fraction 0.4, top-8) over the same routes (the first
``CALLS`` layer-calls of a ``synthetic_trace`` with the generator's default, uniform popularity,
as ``vs_rust.py``); the figure is
the median of ``--repeats`` runs of the whole loop, divided by its number of layer-steps.

    python benchmarks/backend_cost.py [--write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import pallas_cache as pc  # noqa: E402
from pallas_cache.sizing.synthetic import SyntheticParams, synthetic_trace  # noqa: E402
from results_file import write_section  # noqa: E402

GEOMETRIES = [(8, 16, 64), (48, 128, 2048)]
TOP_K, CALLS = 8, 1024


def per_step_us(backend, num_layers, num_experts, cache_size, repeats):
    trace = synthetic_trace(SyntheticParams(num_layers=num_layers, num_experts=num_experts,
                                            top_k=TOP_K, num_tokens=-(-CALLS // num_layers)),
                            seed=0)
    layers, routes = (a[:CALLS].astype(np.int32) for a in trace.to_array())
    policy = pc.FetchPolicy.fraction(0.4)

    @jax.jit
    def loop(state, layers, routes):
        def step(state, xs):
            state, plan = pc.ensure_hybrid(state, xs[0], xs[1], policy, backend=backend)
            return state, plan.copy.count
        return lax.scan(step, state, (layers, routes))

    state = pc.init(num_layers, num_experts, cache_size)
    args = (state, jnp.asarray(layers, jnp.int32), jnp.asarray(routes))
    jax.block_until_ready(loop(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(loop(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / CALLS * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    lines = ["| geometry | xla us/step | interpret us/step | interpret / xla |", "|---|---|---|---|"]
    for geometry in GEOMETRIES:
        xla = per_step_us("xla", *geometry, args.repeats)
        interpret = per_step_us("interpret", *geometry, args.repeats)
        lines.append(f"| L={geometry[0]} E={geometry[1]} S={geometry[2]} | {xla:.1f} | "
                     f"{interpret:.1f} | {interpret / xla:.2f}x |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    if args.write:
        machine = f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, cpu"
        write_section("backend_cost",
                      f"## Backends on CPU (`benchmarks/backend_cost.py`)\n\n{datetime.date.today()}, "
                      f"{machine}; ensure_hybrid fraction 0.4, top-8 routes of synthetic_trace "
                      f"(uniform popularity, as vs_rust.py), {CALLS} layer-steps in one "
                      f"compiled scan, median of {args.repeats}.\n\n{table}\n")


if __name__ == "__main__":
    main()
