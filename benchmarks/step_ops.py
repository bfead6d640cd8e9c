"""What one cache call lowers to for CUDA, counted on the CPU: per eviction, geometry and call
(``ensure``, ``ensure_hybrid`` recency/promote_one), the Pallas (Triton) custom calls and the
other non-free StableHLO ops of ``backend="pallas"``, by the counting rule of
tests/kernels/test_kernels.py (docs/semantics.md §7): plain, under ``vmap`` over 4 states, and per
layer-call of a ``lax.scan`` (the loop's own bookkeeping included).

    python benchmarks/step_ops.py            # a Markdown table
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import pallas_cache as pc  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.lowering import count_ops, lower_cuda  # noqa: E402  (the one op counter)

GEOMETRIES = [(8, 16, 64, 8), (32, 8, 64, 2), (32, 8, 128, 2), (48, 128, 2048, 8),
              (48, 128, 4096, 8), (64, 320, 16384, 8)]
EVICTIONS = ("lru", "pair_lfu", "route_knn", "route_lfu")
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


def main() -> int:
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
