"""Does tracing a CUDA-graph launch with ``jax.profiler`` fault on this GPU stack, with or without
the fused kernel? One GPU run answers it (docs/design.md, "The GPU check").

Each mode runs in a process of its own (a CUDA fault poisons its context) and reports ``ok`` or
the error that ended it:

- ``xla``: a jitted ``lax.scan`` of 512 decode-like steps with no Pallas kernel (a top-k of
  scores, a scatter, an argmin), compiled as XLA does by default (a CUDA graph on a GPU),
  dispatched 50 times untraced;
- ``xla-traced``: the same program, three dispatches in each of two ``jax.profiler`` traces;
- ``xla-traced-nograph``: the same, compiled without XLA command buffers;
- ``pallas``: ``ensure`` on the fused kernel (``backend="pallas"``; ``"interpret"`` off a GPU)
  in a scan of 512 calls, default compile, 50 dispatches untraced, the final state and every
  plan then compared with the XLA step's;
- ``pallas-traced-nograph``: that scan compiled without command buffers, in two traces.

Run from the repository root: ``PYTHONUNBUFFERED=1 timeout 300 python
benchmarks/profiler_graph_fault.py --out $OUT/profiler_graph_fault.md``. Exit status 0 when every
mode behaved as the design expects (the untraced and the no-graph modes ``ok``), 1 otherwise;
``xla-traced`` is reported either way (it ran ok on the H200, jax 0.11.2, where profiling the
cache's own scans in graphs faulted: ``gpu_check.py --profile-graphs``), 2 a bad argument.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from script_args import out_error, seconds_error  # this folder, first on sys.path as a script

REPO = Path(__file__).resolve().parents[1]
NO_GRAPH = {"xla_gpu_enable_command_buffer": ""}
MODES = ("xla", "xla-traced", "xla-traced-nograph", "pallas", "pallas-traced-nograph")
#: The modes whose ``ok`` the design relies on (the others show whether the fault is there).
EXPECTED_OK = ("xla", "xla-traced-nograph", "pallas", "pallas-traced-nograph")
STEPS, DISPATCHES = 512, 50


def _xla_program(options):
    import jax
    import jax.numpy as jnp
    from jax import lax

    def body(carry, x):
        usage, clock = carry
        scores = jnp.sin(usage.astype(jnp.float32) * 0.001 + x)
        _, top = lax.top_k(scores, 8)
        usage = usage.at[top].set(clock)
        victim = jnp.argmin(usage)
        return (usage.at[victim].add(1), clock + 1), victim

    def run(usage, xs):
        return lax.scan(body, (usage, jnp.int32(1)), xs)

    usage = jnp.zeros(4096, jnp.int32)
    xs = jnp.linspace(0.0, 1.0, STEPS, dtype=jnp.float32)
    compiled = jax.jit(run).lower(usage, xs).compile(compiler_options=options)
    return lambda: compiled(usage, xs)


def _pallas_programs(options, backend):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    import pallas_cache as pc

    L, E, S, k = 16, 64, 512, 8
    rng = np.random.default_rng(0)
    layers = jnp.asarray(np.arange(STEPS) % L, jnp.int32)
    routes = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(STEPS)]),
                         jnp.int32)

    def compiled(name, opts):
        def run(state, layers, routes):
            return lax.scan(lambda s, x: pc.ensure(s, x[0], x[1], backend=name), state,
                            (layers, routes))
        state = pc.init(L, E, S)
        return jax.jit(run).lower(state, layers, routes).compile(compiler_options=opts)

    return pc.init(L, E, S), (layers, routes), compiled(backend, options), compiled("xla", None)


def _traced(runs, traces=2):
    import jax

    for _ in range(traces):
        with tempfile.TemporaryDirectory() as tmp, jax.profiler.trace(tmp):
            for _ in range(3):
                jax.block_until_ready(runs())


def run_mode(mode: str) -> str:
    """Run one mode in this process; a line saying what it did."""
    import jax

    on_gpu = jax.default_backend() == "gpu"
    if mode.startswith("xla"):
        once = _xla_program(NO_GRAPH if mode.endswith("nograph") else None)
        if mode == "xla":
            for _ in range(DISPATCHES):
                out = once()
            jax.block_until_ready(out)
            return f"{DISPATCHES} dispatches of {STEPS} steps"
        _traced(once)
        return "2 traces of 3 dispatches"
    backend = "pallas" if on_gpu else "interpret"
    options = NO_GRAPH if mode.endswith("nograph") else None
    state, xs, candidate, reference = _pallas_programs(options, backend)
    if mode == "pallas":
        s, r = state, state
        for _ in range(DISPATCHES if on_gpu else 2):
            s, plans = candidate(s, *xs)
            r, want = reference(r, *xs)
            same = jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), plans, want))
            if not same:
                raise AssertionError(f"{backend} plans differ from the XLA step's")
        if not jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), s, r)):
            raise AssertionError(f"{backend} final state differs from the XLA step's")
        return f"{backend}: dispatches of {STEPS} calls, every plan and the state equal to xla"
    _traced(lambda: candidate(state, *xs))
    return f"{backend}: 2 traces of 3 dispatches"


def _child(mode: str, timeout: float) -> tuple[str, str]:
    """``(outcome, detail)`` of one mode in a fresh process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return "timeout", f"over {timeout:.0f} s"
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    if done.returncode == 0 and lines and lines[-1].startswith("ok: "):
        return "ok", lines[-1][4:]
    why = next((line for line in reversed(lines) if "CUDA" in line or "Error" in line),
               lines[-1] if lines else "")
    kind = f"signal {-done.returncode}" if done.returncode < 0 else f"rc {done.returncode}"
    return "FAILED", f"{kind}: {why.strip()[:300]}"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage block
        print(f"profiler_graph_fault.py: error: {message}", file=sys.stderr)
        sys.exit(2)


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    why = seconds_error(text, value)
    if why:
        raise argparse.ArgumentTypeError(why)
    return value


def main(argv=None) -> int:
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma separated, of {', '.join(MODES)} (default all)")
    p.add_argument("--timeout", type=_seconds, default=120.0, help="seconds per mode")
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if out_error(args.out):
        p.error(out_error(args.out))
    if args.child:
        print(f"ok: {run_mode(args.child)}", flush=True)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        print(f"profiler_graph_fault.py: error: --modes {args.modes!r}: give some of "
              f"{', '.join(MODES)}", file=sys.stderr)
        return 2
    import jax
    import jaxlib

    head = (f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
            f"{jax.default_backend()} ({jax.devices()[0].device_kind}), "
            f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
    rows = ["| mode | outcome | detail |", "|---|---|---|"]
    status = 0
    print(head, flush=True)
    for mode in modes:
        outcome, detail = _child(mode, args.timeout)
        print(f"{mode}: {outcome} ({detail})", flush=True)
        rows.append(f"| {mode} | {outcome} | {detail.replace('|', '/')} |")
        status |= int(mode in EXPECTED_OK and outcome != "ok")
    if args.out:
        args.out.write_text(f"Profiler and CUDA graphs: {head}\n\n" + "\n".join(rows) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
