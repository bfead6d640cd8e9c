"""GPU: what the compiled decode loop's per-call cost owes to kernel launches, under XLA flag sets.

``benchmarks/gpu_check.py`` measured about 40 us per ``ensure_hybrid`` layer-call inside a
compiled ``lax.scan`` on an H200, the same with or without misses: 56-68 kernels launched per
scan iteration, not the plan work. XLA:GPU can record a loop body's kernels as a CUDA graph
("command buffers"), and with the ``WHILE``/``CONDITIONAL`` command types the whole loop, which
removes most launches. This script runs gpu_check's host-sync loop (its section (c): 1,000 scanned
layer-calls at S = 64 and 2048, all-hit and uniform top-8 routes, backends ``xla`` and ``pallas``,
median of ``--repeats``) once per flag set, each in a fresh process (``XLA_FLAGS`` is read at
start-up), and checks that every flag set yields the same final states bit for bit::

    PYTHONUNBUFFERED=1 python benchmarks/gpu_loop_flags.py --out $OUT/gpu_loop_flags.md

A flag set XLA rejects is reported as failed, not fatal. ``--cpu-smoke`` runs one CPU process
(``interpret`` for ``pallas``) to test the script. The flags are a decode loop's own choice (set
in its process's environment before JAX starts); the library sets none.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

#: ``(label, XLA_FLAGS)``; the first is the baseline the others are compared with.
FLAG_SETS = (
    ("default", ""),
    ("no command buffers", "--xla_gpu_enable_command_buffer="),
    ("command buffers + WHILE, CONDITIONAL",
     "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
     " --xla_gpu_graph_min_graph_size=1"),
)


def child(args) -> dict:
    """One process, one flag set: gpu_check's loop rows plus a digest of the final states."""
    sys.path.insert(0, HERE)
    import gpu_check as gc  # noqa: E402 (imports jax: XLA_FLAGS is already set)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from pallas_cache.sizing.synthetic import SyntheticParams, synthetic_trace

    candidate = "interpret" if args.cpu_smoke else "pallas"
    ns = argparse.Namespace(seed=0, loop_steps=args.loop_steps, repeats=args.repeats,
                            candidate=candidate)
    rows = gc.loop_rows(ns)
    digest = hashlib.sha256()
    policy = gc.pc.FetchPolicy.fraction(gc.FRACTION)
    for L, E, S in gc.GEOMETRIES:
        state0, _, _ = gc.timing_fixture(L, E, S, seed=S)
        layers = jnp.asarray((np.arange(args.loop_steps) % L).astype(np.int32))
        trace = synthetic_trace(SyntheticParams(num_layers=L, num_experts=E, top_k=gc.TOP_K,
                                                num_tokens=-(-args.loop_steps // L)), seed=0)
        routes = jnp.asarray(trace.to_array()[1][: args.loop_steps], jnp.int32)
        for backend in ("xla", candidate):
            final = gc.decode_loop(state0, layers, routes, policy, backend=backend)
            for leaf in jax.tree.leaves(jax.device_get(final)):
                digest.update(np.asarray(leaf).tobytes())
    device = jax.devices()[0]
    return {"rows": [[S, label, fetched, times] for S, label, fetched, times in rows],
            "digest": digest.hexdigest(), "jax": jax.__version__,
            "device": getattr(device, "device_kind", device.platform)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loop-steps", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per flag set")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return 0

    sets = FLAG_SETS[:1] if args.cpu_smoke else FLAG_SETS
    results = {}
    for label, flags in sets:
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        if args.cpu_smoke:
            env["JAX_PLATFORMS"] = "cpu"
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--loop-steps",
               str(args.loop_steps), "--repeats", str(args.repeats)]
        cmd += ["--cpu-smoke"] if args.cpu_smoke else []
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
            out = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not out:
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                results[label] = {"error": f"exit {proc.returncode}: {tail[:300]}"}
            else:
                results[label] = json.loads(out[-1][len("RESULT "):])
        except subprocess.TimeoutExpired:
            results[label] = {"error": f"timed out after {args.timeout:.0f} s"}
        print(f"[{label}] {time.perf_counter() - start:.1f} s: "
              f"{results[label].get('error') or 'ok'}", flush=True)

    base = results[sets[0][0]]
    lines = [f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
             f"jax {base.get('jax', '?')} on {base.get('device', '?')}; {args.loop_steps} "
             f"scanned `ensure_hybrid` layer-calls (fraction 0.4), median of {args.repeats}; "
             "us per layer-call. `same states`: the final states of every case equal the "
             "default flags' bit for bit.", "",
             "| flags | S | routes | xla us | pallas us | same states |",
             "|---|---:|---|---:|---:|---|"]
    for label, flags in sets:
        res = results[label]
        if "error" in res:
            lines.append(f"| {label} (`{flags}`) | | | | | failed: {res['error']} |")
            continue
        same = "yes" if res["digest"] == base.get("digest") else "**NO**"
        for S, route_label, _, times in res["rows"]:
            if route_label.startswith("kernels"):
                continue
            vals = list(times.values())
            lines.append(f"| {label} | {S} | {route_label} | {vals[0]:.2f} | {vals[-1]:.2f} "
                         f"| {same} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n\nflag sets:\n" + "\n".join(f"- {l}: `{f}`" for l, f in sets)
                     + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
