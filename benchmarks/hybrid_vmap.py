"""``jit(vmap(layer))`` over a batch of caches against one cache's layer, with CPU experts: each
cache should read its own CPU experts only, so 4 caches cost about 4 times one (issue #62:
<= 1.5x four times one cache's; before, the switch on the CPU-expert count became a select that
ran every branch for every cache: 803 ms for 4 caches against 47.6 for one).

The layer: ``ensure_hybrid`` (every miss on the CPU: ``fraction:0``, so nothing is copied),
``moe_hybrid`` with ``pc.experts.swiglu`` on a bf16 bank; one token per cache, top-2, distinct
routes per cache. Per-round ratios, medians over interleaved rounds.

    python benchmarks/hybrid_vmap.py [--rounds 21] [--caches 4] [--write]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pallas_cache as pc  # noqa: E402
from pallas_cache import experts  # noqa: E402
from timing import (interleaved, load_average, markdown_table, publish, run_header,  # noqa: E402
                    section)

E, H, F, TOP_K = 8, 1024, 3584, 2


def calls(n: int, *, num_experts: int = E, d_model: int = H, d_expert: int = F):
    """The jitted layer for one cache and its ``vmap`` over ``n``, with their arguments:
    ``(one, one_args, many, many_args)``.

    The bank is an argument of both, shared by the caches (``in_axes`` None), not closed over:
    jax <= 0.11 makes a closed-over array a constant of the program, which XLA:CPU rebuilds on
    every call (the filler bank, a splat, from a broadcast: 176 MB here, most of a call's time on
    those versions, which made 4 caches look cheaper than one)."""
    bank = experts.filler_bank(num_experts, d_model, d_expert, "bf16")
    pool = experts.pool_like(bank, num_experts)
    policy = pc.FetchPolicy.fraction(0.0)

    def layer(state, pool, ids, x, bank):
        gates = jnp.full(ids.shape, 0.5, jnp.float32)
        state, plan = pc.ensure_hybrid(state, 0, ids, policy)
        # fraction:0 fetches nothing: the pool stays as it is (no apply_copy_plan to time).
        return pc.moe_hybrid(x, ids, gates, plan, pool, bank, experts.swiglu)

    ids = jnp.asarray([[(2 * c) % num_experts, (2 * c + 1) % num_experts] for c in range(n)],
                      jnp.int32)[:, None]
    x = jnp.full((n, 1, d_model), 0.01, jnp.float32)
    state = pc.init(1, num_experts, num_experts)
    states = pc.stack_states([state] * n)
    pools = jax.tree.map(lambda leaf: jnp.stack([leaf] * n), pool)
    return (jax.jit(layer), (state, pool, ids[0], x[0], bank),
            jax.jit(jax.vmap(layer, in_axes=(0, 0, 0, 0, None))), (states, pools, ids, x, bank))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--caches", type=int, default=4)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    n = args.caches
    one, one_args, many, many_args = calls(n)
    variants = {"one cache": lambda: one(*one_args).block_until_ready(),
                f"vmap over {n}": lambda: many(*many_args).block_until_ready()}
    loads = [load_average()]
    times = interleaved(variants, args.rounds)
    loads.append(load_average())
    ratio = statistics.median(b / (n * a) for a, b in zip(times["one cache"],
                                                          times[f"vmap over {n}"]))
    rows = [[name, f"{statistics.median(t) * 1e3:.1f}"] for name, t in times.items()]
    header = run_header(f"python benchmarks/hybrid_vmap.py --rounds {args.rounds} --caches {n}",
                        load=max(loads), note=f", jax {jax.__version__}")
    text = section(
        f"vmap over caches with CPU experts, jax {jax.__version__} (`benchmarks/hybrid_vmap.py`)",
        header,
        f"One layer-call per cache (`ensure_hybrid` at `fraction:0`, which copies nothing, "
        f"then `moe_hybrid` with `pc.experts.swiglu`, bf16 experts {H} x {F}, {E} experts, one "
        f"token, top-{TOP_K}: 2 CPU experts per cache, different ones per cache; the bank an "
        f"argument of both programs, shared by the caches); "
        f"{args.rounds} interleaved rounds. Load average {min(loads):.1f}-{max(loads):.1f}.",
        markdown_table(["call", "ms (median)"], rows),
        f"`jit(vmap(layer))` over {n} caches / {n} x one cache's, per round: **{ratio:.2f}x** "
        f"(acceptance <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'}).")
    publish(f"vmap over caches with CPU experts, jax {jax.__version__}", text, args.write)


if __name__ == "__main__":
    main()
