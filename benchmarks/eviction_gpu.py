"""Per-call cost of each eviction inside a compiled decode loop on whatever JAX runs on, with the
counts and final pools written to ``--json`` so that a ``--cpu`` run can check an accelerator's
decisions bit for bit (``--compare``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_cache as pc  # noqa: E402
from pallas_cache.sizing import synthetic_trace  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import interleaved, run_header, summarize  # noqa: E402

GEOMETRIES = (("mixtral-realistic", 4), ("fine-grained-realistic", 16))


def runs(gpu: bool):
    out = [("lru", "xla"), ("pair_lfu", "xla"), ("route_knn", "xla"), ("route_lfu", "xla")]
    return out + [("lru", "pallas")] if gpu else out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", required=True)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (no timing claims)")
    parser.add_argument("--compare", help="a JSON of another run: counts and pools must match")
    args = parser.parse_args(argv)
    device = jax.devices("cpu")[0] if args.cpu else jax.devices()[0]
    gpu = device.platform == "gpu"
    results, lines = {}, []
    with jax.default_device(device):
        for preset, per_layer in GEOMETRIES:
            trace = synthetic_trace(preset, num_tokens=args.tokens, seed=0)
            layers, routes = (jnp.asarray(a, jnp.int32) for a in trace.to_array())
            size = trace.num_layers * per_layer
            programs = {}
            for eviction, backend in runs(gpu):
                @jax.jit
                def run(state, backend=backend):
                    def body(s, xs):
                        s, plan = pc.ensure_hybrid(s, xs[0], xs[1], pc.FetchPolicy.full(),
                                                   backend=backend)
                        return s, plan.missing
                    return jax.lax.scan(body, state, (layers, routes))
                state = pc.init(trace.num_layers, trace.num_experts, size, eviction=eviction)
                start = time.perf_counter()
                final, missing = jax.block_until_ready(run(state))
                compile_s = time.perf_counter() - start
                programs[(eviction, backend)] = lambda run=run, state=state: (
                    jax.block_until_ready(run(state)))
                results[f"{preset}/{eviction}/{backend}"] = {
                    "missing": int(missing.sum()),
                    "id_of_slot": np.asarray(final.residency.id_of_slot).tolist(),
                    "compile_s": compile_s}
            times = interleaved(programs, args.repeats, warmup=0)  # compiled above
            base = summarize(times[("lru", "xla")]).median / layers.shape[0]
            for (eviction, backend), values in times.items():
                us = summarize(values).median / layers.shape[0] * 1e6
                results[f"{preset}/{eviction}/{backend}"]["us_per_call"] = us
                lines.append(f"| {preset} L={trace.num_layers} E={trace.num_experts} S={size} "
                             f"top-{trace.top_k} | {eviction} | {backend} | {us:.2f} | "
                             f"{us / (base * 1e6):.2f}x |")
    command = (f"python benchmarks/eviction_gpu.py --tokens {args.tokens} --repeats "
               f"{args.repeats}" + (" --cpu" if args.cpu else ""))
    header = (f"{run_header(command)} Device: {device.device_kind} ({device.platform}); "
              f"{args.tokens} tokens, median of {args.repeats} interleaved runs.\n\n"
              "| geometry | eviction | backend | us/call | / lru xla |\n|---|---|---|---|---|")
    print(header, *lines, sep="\n")
    with open(args.json, "w") as handle:
        json.dump({"header": header, "lines": lines, "results": results}, handle)
    if args.compare:
        other = json.load(open(args.compare))["results"]
        bad = [key for key in results if key in other and (
            results[key]["missing"] != other[key]["missing"]
            or results[key]["id_of_slot"] != other[key]["id_of_slot"])]
        print("compared", len([k for k in results if k in other]), "runs; differing:", bad)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
