"""What one cache call lowers to for CUDA, counted on the CPU: per eviction, geometry and call
(``ensure``, ``ensure_hybrid`` recency/promote_one), the Pallas (Triton) custom calls and the
other non-free StableHLO ops of ``backend="pallas"``, by the counting rule of
tests/kernels/test_kernels.py (docs/semantics.md §7): plain, under ``vmap`` over 4 states, and per
layer-call of a ``lax.scan`` (the loop's own bookkeeping included). With ``--census``: what
XLA puts around the call in a scan's loop body (benchmarks/lowering.py, :func:`scan_census`: the
scan lowered for CUDA, the Triton call replaced by a CPU stand-in with the same aliases,
compiled by XLA:CPU): copies, fusions and other instructions, for a scan that stacks the plans
and one that only returns the state (a decode loop's shape), beside a trivial body's loop.

    python benchmarks/step_ops.py            # a Markdown table
    python benchmarks/step_ops.py --census   # the loop bodies' census, a Markdown table
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

# This tree's package and benchmarks, not an installed copy.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pallas_cache as pc  # noqa: E402
from pallas_cache.state import Clock  # noqa: E402

from benchmarks.lowering import count_ops, lower_cuda, scan_census  # noqa: E402

GEOMETRIES = [(8, 16, 64, 8), (32, 8, 64, 2), (32, 8, 128, 2), (48, 128, 2048, 8),
              (48, 128, 4096, 8), (64, 320, 16384, 8)]
EVICTIONS = ("lru", "pair_lfu", "route_knn", "route_lfu")
CENSUS_GEOMETRIES = [(8, 16, 64, 8), (48, 64, 512, 8), (48, 128, 4096, 8), (64, 512, 16384, 8)]


def lower(fn, *args) -> str:
    return lower_cuda(fn, *args).as_text()


def counts(geometry, eviction, hybrid: bool):
    L, E, S, k = geometry
    state = pc.init(L, E, S, eviction=eviction, history=128)
    routes = jnp.arange(k, dtype=jnp.int32) % E
    policy = pc.FetchPolicy.fraction(0.4)
    if hybrid:
        call = lambda s, layer: pc.ensure_hybrid(s, layer, routes, policy,  # noqa: E731
                                                 backend="pallas")
    else:
        call = lambda s, layer: pc.ensure(s, layer, routes, backend="pallas")  # noqa: E731
    batched = jax.tree.map(lambda x: jnp.broadcast_to(x, (4, *x.shape)), state)
    layers = jnp.arange(L, dtype=jnp.int32)
    plain = count_ops(lower(call, state, jnp.int32(1)))
    vmapped = count_ops(lower(jax.vmap(lambda s: call(s, jnp.int32(1))), batched))
    scanned = count_ops(lower(lambda s: lax.scan(lambda s, l: (call(s, l)[0], None), s,
                                                 layers)[0], state))
    return plain, vmapped, scanned


def _call(state, hybrid: bool, k: int):
    routes = jnp.arange(k, dtype=jnp.int32) % state.num_experts
    if hybrid:
        policy = pc.FetchPolicy.fraction(0.4)
        return lambda s, layer: pc.ensure_hybrid(s, layer, routes, policy,  # noqa: E731
                                                 backend="pallas")
    return lambda s, layer: pc.ensure(s, layer, routes, backend="pallas")  # noqa: E731


def census(geometry, eviction, hybrid: bool) -> dict:
    """:func:`~benchmarks.lowering.scan_census` of a scan over the ``L`` layers: ``"state"``
    (the state carried, nothing stacked) and ``"plans"`` (the plans stacked too)."""
    L, E, S, k = geometry
    state = pc.init(L, E, S, eviction=eviction, history=128)
    call = _call(state, hybrid, k)
    layers = jnp.arange(L, dtype=jnp.int32)
    return {"state": scan_census(lambda s: lax.scan(lambda s, l: (call(s, l)[0], None), s,
                                                     layers)[0], state),
            "plans": scan_census(lambda s: lax.scan(call, s, layers), state)}


def floor_census(geometry) -> dict:
    """A trivial body's loop (the state carried, its clock advanced): the scan's own
    instructions."""
    L, E, S, _ = geometry
    state = pc.init(L, E, S)
    layers = jnp.arange(L, dtype=jnp.int32)
    body = lambda s, l: (s.replace(clock=Clock(step=s.step + l)), None)  # noqa: E731
    return scan_census(lambda s: lax.scan(body, s, layers)[0], state)


def _cells(c: dict) -> str:
    return f"{c['copies']} | {c['counter_copies']} | {c['fusions']} | {c['calls']} | {c['others']}"


def main_census() -> int:
    print(f"jax {jax.__version__}; a scan's loop body, lowered for CUDA, the Triton call "
          f"replaced by a CPU stand-in, compiled by XLA:CPU\n")
    print("| L,E,S,k | eviction | call | scan | copies of state leaves | counter copy | fusions "
          "| custom calls | others |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for geometry in CENSUS_GEOMETRIES:
        g = ",".join(map(str, geometry))
        print(f"| {g} | - | trivial body | state | {_cells(floor_census(geometry))} |",
              flush=True)
        for eviction in EVICTIONS:
            for hybrid in (False, True):
                name = "ensure_hybrid" if hybrid else "ensure"
                for kind, c in census(geometry, eviction, hybrid).items():
                    print(f"| {g} | {eviction} | {name} | {kind} | {_cells(c)} |", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--census", action="store_true",
                   help="what XLA puts around the call in a scan's loop body")
    if p.parse_args(argv).census:
        return main_census()
    print(f"jax {jax.__version__}; (Pallas calls, other ops) per call, lowered for CUDA\n")
    print("| L,E,S,k | eviction | call | plain | vmap x4 | in a scan |")
    print("|---|---|---|---:|---:|---:|")
    for geometry in GEOMETRIES:
        for eviction in EVICTIONS:
            for hybrid in (False, True):
                cells = [f"{p} + {o}" for p, o in counts(geometry, eviction, hybrid)]
                name = "ensure_hybrid" if hybrid else "ensure"
                print(f"| {','.join(map(str, geometry))} | {eviction} | {name} | "
                      + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
