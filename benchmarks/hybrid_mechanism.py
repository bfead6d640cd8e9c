"""Three JAX mechanisms for the CPU partial (``compute_on``, ``pure_callback``, a separate CPU
program): the per-layer overhead and the per-expert cost of one decode token's CPU experts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pallas_cache as pc  # noqa: E402
from pallas_cache import experts  # noqa: E402
from pallas_cache.moe import put_host_bank  # noqa: E402
from timing import markdown_table, median_seconds, publish, run_header  # noqa: E402

NUM_EXPERTS = 8
TOP_K = 2


#: The library's SwiGLU expert (it reads every bank format of :mod:`pallas_cache.experts`).
swiglu = experts.swiglu


def swiglu_numpy(weights):
    """The same expert in NumPy on one expert's weights, dequantized to float32 (by
    :func:`pallas_cache.experts.dequantize`, before any callback runs): ``x [..., H] ->
    [..., H]``."""
    w = {name: np.asarray(leaf) for name, leaf in experts.dequantize(weights).items()}

    def run(x):
        gate = x @ w["w1"].T
        gate = gate / (1.0 + np.exp(-gate))
        return (gate * (x @ w["w3"].T)) @ w["w2"]
    return run


def make_bank(layers, hidden, ffn, seed=0, dtype="bf16"):
    return experts.random_bank(seed, NUM_EXPERTS, hidden, ffn, dtype, layers=layers)


def plan_for(n, tokens=1):
    """A stand-in plan whose route 0..n-1 of token 0 are CPU routes of experts 0..n-1."""
    cpu = jnp.zeros((tokens, TOP_K), bool).at[0, :n].set(True)
    ids = jnp.broadcast_to(jnp.arange(TOP_K, dtype=jnp.int32), (tokens, TOP_K))
    return SimpleNamespace(cpu=cpu, copy=SimpleNamespace(num_experts=NUM_EXPERTS)), ids


def mech_compute_on(bank, x, gates, layers, n, rounds):
    host = put_host_bank(bank)
    plan, ids = plan_for(n)

    @jax.jit
    def loop(x, host):
        def body(h, layer):
            y = pc.cpu_partial(h, ids, gates, plan, host, swiglu, layer=layer)
            return h + 1e-3 * y, None
        return lax.scan(body, x, jnp.arange(layers, dtype=jnp.int32))[0]

    return median_seconds(lambda: loop(x, host).block_until_ready(), rounds) / layers


def mech_callback(bank, x, gates, layers, n, rounds):
    # The experts the loop chooses (0 .. TOP_K - 1 of each layer), dequantized up front: the
    # callback runs NumPy only.
    host = {(layer, e): swiglu_numpy({k: v[layer, e] for k, v in bank.items()})
            for layer in range(layers) for e in range(TOP_K)}

    def compute(h, layer, chosen):
        h = np.asarray(h, np.float32)
        out = np.zeros_like(h)
        for e in np.asarray(chosen)[:n]:
            out += 0.5 * host[int(layer), int(e)](h)
        return out.astype(np.float32)

    @jax.jit
    def loop(x):
        def body(h, layer):
            chosen = jnp.arange(TOP_K, dtype=jnp.int32)
            y = jax.pure_callback(compute, jax.ShapeDtypeStruct(h.shape, jnp.float32), h,
                                  layer, chosen)
            return h + 1e-3 * y, None
        return lax.scan(body, x, jnp.arange(layers, dtype=jnp.int32))[0]

    return median_seconds(lambda: loop(x).block_until_ready(), rounds) / layers


def mech_cpu_program(bank, x, gates, layers, n, rounds):
    cpu = jax.devices("cpu")[0]
    device = jax.devices()[0]
    cpu_bank = jax.device_put(bank, cpu)

    @jax.jit
    def experts(h, rows):
        out = jnp.zeros(h.shape, jnp.float32)
        for j in range(rows["w1"].shape[0]):
            w = jax.tree.map(lambda r: r[j], rows)
            out = out + 0.5 * jax.vmap(swiglu, in_axes=(None, 0))(w, h).astype(jnp.float32)
        return out

    chosen_on_device = jnp.arange(TOP_K, dtype=jnp.int32)

    def loop():
        h = x
        for layer in range(layers):
            chosen = np.asarray(chosen_on_device)[:n]  # the per-layer host sync
            if n:
                rows = {k: v[layer, chosen[0]:chosen[0] + n] for k, v in cpu_bank.items()}
                y = jax.device_put(experts(jax.device_put(h, cpu), rows), device)
            else:
                y = jnp.zeros(h.shape, jnp.float32)
            h = h + 1e-3 * y
        return h.block_until_ready()

    return median_seconds(loop, rounds) / layers


MECHANISMS = {"compute_on": mech_compute_on, "pure_callback": mech_callback,
              "cpu program": mech_cpu_program}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=3584)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", choices=experts.FORMATS, default="bf16")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)

    bank = make_bank(args.layers, args.hidden, args.ffn, dtype=args.dtype)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, args.hidden), np.float32))
    gates = jnp.full((1, TOP_K), 0.5, jnp.float32)
    expert_bytes = sum(v[0, 0].nbytes for v in bank.values())
    rows = []
    with jax.default_matmul_precision("highest"):
        for name, run in MECHANISMS.items():
            per_n = [run(bank, x, gates, args.layers, n, args.rounds) for n in range(TOP_K + 1)]
            slope = (per_n[-1] - per_n[0]) / TOP_K
            rows.append((name, per_n, slope, expert_bytes / slope if slope > 0 else float("nan")))
            print(f"{name:>14}: " + "  ".join(f"n={n}: {t * 1e6:9.1f} us" for n, t in
                                               enumerate(per_n))
                  + f"  per expert {slope * 1e6:9.1f} us ({rows[-1][3] / 1e9:.2f} GB/s)",
                  flush=True)

    device = jax.devices()[0]
    command = (f"python benchmarks/hybrid_mechanism.py --hidden {args.hidden} --ffn {args.ffn} "
               f"--dtype {args.dtype} --layers {args.layers} --rounds {args.rounds}")
    lines = [
        "## The CPU partial: mechanisms (`benchmarks/hybrid_mechanism.py`)",
        "",
        run_header(command) + (" Host and device are one memory and one CPU here."
                               if device.platform == "cpu" else ""),
        "",
        f"One decode token, `n` distinct CPU experts per layer-call (SwiGLU, {args.dtype}, "
        f"hidden {args.hidden}, ffn {args.ffn}: {expert_bytes / 2**20:.1f} MiB per expert); "
        f"median per layer-call of {args.rounds} runs of a {args.layers}-layer loop.",
        "",
        markdown_table(["mechanism", "n=0 (overhead)", "n=1", "n=2", "per expert",
                        "expert bytes / s"],
                       [[name, *(f"{t * 1e6:.1f} us" for t in per_n), f"{slope * 1e6:.1f} us",
                         f"{rate / 1e9:.2f} GB/s"] for name, per_n, slope, rate in rows]),
    ]
    publish("hybrid_mechanism", "\n".join(lines), not args.no_write)


if __name__ == "__main__":
    main()
