"""What the GPU check's phases share: pytree comparison, filled pools, compiled-program kernel
counts, the device time of a dispatch (the sum of its GPU events from a ``jax.profiler``
trace), and the timed decode scan every cost row is made of (both backends from one state,
their final states and plans compared leaf by leaf)."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_cache as pc
from pallas_cache.state import Clock, Residency
from benchmarks.lowering import count_ops  # the one StableHLO op counter

TOP_K = 8
EVICTIONS = ("lru", "pair_lfu", "route_knn", "route_lfu")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Context:
    """One run: the parsed arguments, the failures (a difference or a failed backend) and the
    scenario failures (a cost row whose calls did not miss as scheduled)."""

    def __init__(self, args):
        self.args = args
        self.failures: list[str] = []
        self.scenario_failures: list[str] = []

    def fail(self, msg: str) -> None:
        print(msg, flush=True)
        self.failures.append(msg)

    @property
    def backends(self) -> tuple[str, str]:
        return ("xla", self.args.candidate)


# --------------------------------------------------------------------------------------------
# Pytrees.
# --------------------------------------------------------------------------------------------

def _key_name(key) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def named_leaves(tree) -> list[tuple[str, np.ndarray]]:
    """``[(dotted name, host array)]`` for every leaf, e.g. ``('state.residency.usage', ...)``."""
    flat, _ = jax.tree.flatten_with_path(tree)
    return [(".".join(_key_name(k) for k in path), np.asarray(leaf)) for path, leaf in flat]


def tree_difference(a, b) -> list[str]:
    """The leaves (dotted names) where two pytrees differ; [] when equal bit for bit."""
    la, lb = named_leaves(a), named_leaves(b)
    if [n for n, _ in la] != [n for n, _ in lb]:
        return ["<tree structure>"]
    return [name for (name, x), (_, y) in zip(la, lb)
            if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y)]


def concat(plans_list):
    """The plans of consecutive dispatches (host arrays) as one stack."""
    return jax.tree.map(lambda *leaves: np.concatenate(leaves), *plans_list)


def fresh(state):
    """A copy of ``state`` in new buffers."""
    return jax.tree.map(jnp.copy, state)


def filled_state(rng, eviction, L, E, S, capacity, rebase_threshold=None, empty=0):
    """A pool of usable size ``S`` whose first ``min(S, L * E) - empty`` slots hold random
    experts with distinct usages (the clock just past them); ``rebase_threshold`` None keeps
    the default. A pool larger than the model holds every expert."""
    extra = {} if rebase_threshold is None else {"rebase_threshold": rebase_threshold}
    state = pc.init(L, E, S, capacity=capacity, eviction=eviction, **extra)
    n = min(S, L * E) - empty
    ids = np.full(capacity, -1, np.int32)
    ids[:n] = rng.choice(L * E, size=n, replace=False)
    sfi = np.full(L * E, -1, np.int32)
    sfi[ids[:n]] = np.arange(n)
    usage = np.zeros(capacity, np.int32)
    usage[:n] = rng.permutation(n) + 1
    return state.replace(
        residency=Residency(id_of_slot=jnp.asarray(ids), slot_for_id=jnp.asarray(sfi.reshape(L, E)),
                            usage=jnp.asarray(usage)),
        clock=Clock(step=jnp.int32(n)))


# --------------------------------------------------------------------------------------------
# Kernels per run of a compiled program (optimized HLO), not the StableHLO op count
# (that one is benchmarks/lowering.py's).
# --------------------------------------------------------------------------------------------

_FREE_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
             "add-dependency", "opt-barrier", "partition-id", "replica-id"}


def _computations(text: str) -> tuple[dict, str]:
    """``({name: [instruction line, ...]}, entry name)`` of an optimized HLO module's text."""
    comps, entry, name = {}, None, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) (?:\(.*\) -> .*)?\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(2)
            comps[name] = []
            entry = name if head.group(1) else entry
        elif line.startswith("}"):
            name = None
        elif name is not None and " = " in line:
            comps[name].append(line)
    return comps, entry


def _opcode(line: str) -> str:
    rhs = line.split(" = ", 1)[1].lstrip()
    if rhs.startswith("("):  # a tuple shape
        depth = 0
        for i, ch in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                rhs = rhs[i + 1:]
                break
    else:
        rhs = rhs.split(" ", 1)[1] if " " in rhs else rhs
    match = re.match(r"\s*([a-z][a-z0-9\-]*)\(", rhs)
    return match.group(1) if match else "?"


def _launches(comps, name, seen=()) -> tuple[int, int]:
    """``(kernels, pallas calls)`` one run of computation ``name`` launches: every instruction
    except the free ones; a while counts its body and condition once, a conditional its largest
    branch plus one (the predicate), a call its callee."""
    kernels = pallas = 0
    for line in comps.get(name, ()):
        op = _opcode(line)
        if op in _FREE_OPS:
            continue
        callees = re.findall(r"(?:body|condition|to_apply|true_computation|false_computation)"
                             r"=%?([\w.\-]+)", line)
        if op == "while":
            for callee in callees:
                k, p = _launches(comps, callee, seen + (name,))
                kernels, pallas = kernels + k, pallas + p
        elif op == "conditional":
            branches = callees + re.findall(r"%([\w.\-]+)", line.split("branch_computations=")[1]
                                            if "branch_computations=" in line else "")
            counts = [_launches(comps, b, seen + (name,)) for b in branches if b not in seen]
            k, p = max(counts, default=(0, 0))
            kernels, pallas = kernels + 1 + k, pallas + p
        elif op == "call":
            k, p = _launches(comps, callees[0], seen + (name,)) if callees else (1, 0)
            kernels, pallas = kernels + k, pallas + p
        else:
            kernels += 1
            pallas += int(op == "custom-call" and "triton" in line)
    return kernels, pallas


def kernel_count(compiled_text: str) -> tuple[int, int]:
    """``(kernels, pallas calls)`` per iteration of the program's largest while loop (body and
    condition)."""
    comps, _ = _computations(compiled_text)
    best = (0, 0)
    for line in (line for body in comps.values() for line in body):  # XLA:CPU wraps it in a call
        if _opcode(line) == "while":
            callees = re.findall(r"(?:body|condition)=%?([\w.\-]+)", line)
            counts = [_launches(comps, c) for c in callees]
            best = max(best, (sum(c[0] for c in counts), sum(c[1] for c in counts)))
    return best


def ops_per_call(call, backend, state, layer, routes) -> tuple[int, int]:
    """``(Pallas calls, other StableHLO ops)`` one call lowers to on this platform."""
    return count_ops(jax.jit(lambda s, la, r: call(s, la, r, backend)).lower(
        state, layer, routes).as_text())


# --------------------------------------------------------------------------------------------
# Device time: the sum of the GPU events of a dispatch, from one jax.profiler trace.
# --------------------------------------------------------------------------------------------

#: Trace lines of a GPU process that repeat the stream events (spans of modules, ops, steps).
_DERIVED_LINES = ("xla modules", "xla ops", "steps", "framework", "launch", "source", "tf ops")
#: Seconds between two profiled dispatches; their GPU events form one cluster each.
GAP_S = 0.05
#: Compile options of the programs a profiled dispatch runs: no XLA command buffer (no CUDA
#: graph). Tracing a CUDA-graph launch with the profiler faulted on an H200 (jax 0.11.2, driver
#: 580) in a program without the Pallas kernel as in one with it (docs/design.md, "GPU check");
#: ``--profile-graphs`` profiles the graph programs themselves.
PROFILED = {"xla_gpu_enable_command_buffer": ""}


#: Seconds a cost row adds to compile its profiled copies (the XLA step's and the candidate's).
PROFILED_COMPILE_S = 3.0


def profile_options(args) -> dict | None:
    """The compile options of the programs this run profiles (None: the defaults)."""
    return None if getattr(args, "profile_graphs", False) else PROFILED


def profiled_compile_s(args) -> float:
    """What compiling a cost row's profiled copies adds to its estimate."""
    return 0.0 if profile_options(args) is None else PROFILED_COMPILE_S


def gpu_events(events) -> tuple[list[tuple[float, float]], list[str]]:
    """``([(start us, duration us, name)], line names)`` of the GPU's own events in a Chrome-format
    trace: the complete events (``ph == "X"``) of processes named for a GPU, on the lines named
    ``Stream ...`` where there are any, else on every line but the derived ones (modules, ops,
    steps), which would count a kernel twice."""
    processes, lines = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            lines[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    gpus = {pid for pid, name in processes.items()
            if "gpu" in name.lower() and "host" not in name.lower()}
    names = {key: name for key, name in lines.items() if key[0] in gpus}
    streams = {key for key, name in names.items() if name.lower().startswith("stream")}
    keep = streams or {key for key, name in names.items()
                       if not any(d in name.lower() for d in _DERIVED_LINES)}
    out = [(float(e.get("ts", 0.0)), float(e.get("dur", 0.0)), str(e.get("name", "")))
           for e in events if e.get("ph") == "X" and e.get("pid") in gpus
           and ((e.get("pid"), e.get("tid")) in keep or not names)]
    return out, sorted({names[k] for k in keep})


def clusters(spans, count: int, gap_us: float = 1e6 * GAP_S / 2) -> list[list] | None:
    """``count`` dispatches' events ``(start, duration, name)``, split where the GPU was idle
    for more than ``gap_us`` (the dispatches ran ``GAP_S`` apart); None unless exactly
    ``count`` clusters are found."""
    if not spans:
        return None
    spans = sorted(spans)
    out, end = [[]], spans[0][0]
    for span in spans:
        start, dur = span[0], span[1]
        if start - end > gap_us:
            out.append([])
        out[-1].append(span)
        end = max(end, start + dur)
    return out if len(out) == count else None


def cluster_sums(spans, count: int, gap_us: float = 1e6 * GAP_S / 2) -> list[float] | None:
    """The summed durations of each of ``count`` dispatches' events (:func:`clusters`)."""
    split = clusters(spans, count, gap_us)
    return None if split is None else [sum(s[1] for s in c) for c in split]


def events_by_name(cluster, iterations: int) -> dict[str, tuple[float, float]]:
    """One dispatch's GPU events by name: ``{name: (count per scan iteration, mean us)}``."""
    by = {}
    for _, dur, name in cluster:
        by.setdefault(name, []).append(dur)
    return {name: (len(d) / iterations, sum(d) / len(d)) for name, d in sorted(by.items())}


#: The Pallas kernel's name (``pallas_call(name=...)``), as its GPU events carry it.
KERNEL_NAME = "pallas_cache_step"


def kernel_mean_us(events: dict) -> float | None:
    """The mean duration of the Pallas kernel's own GPU events (:func:`events_by_name`), or
    None where no event carries its name."""
    own = [(n, mean) for name, (n, mean) in events.items() if KERNEL_NAME in name]
    total = sum(n for n, _ in own)
    return sum(n * mean for n, mean in own) / total if total else None


def format_events(events: dict) -> str:
    """``name xcount mean us`` per event, ``; `` between them."""
    return "; ".join(f"`{name[:60]}` x{n:g} {mean:.2f} us" for name, (n, mean) in events.items())


def device_times(runs) -> tuple[list[float] | None, str]:
    """:func:`device_profile` without the events."""
    sums, note, _ = device_profile(runs)
    return sums, note


def device_profile(runs) -> tuple[list[float] | None, str, list[list] | None]:
    """Each callable of ``runs`` (one blocking dispatch each) once, ``GAP_S`` apart, under one
    ``jax.profiler`` trace: ``(device us of each run, note)``; ``(None, why)`` when the trace
    has no GPU events (off a GPU the trace is taken and read all the same) or cannot be split
    into the runs; third, each run's events (:func:`clusters`, None likewise). The note names the trace lines summed and whether a dispatch launched a CUDA
    graph (an XLA command buffer)."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for run in runs:
                time.sleep(GAP_S)
                jax.block_until_ready(run())
            time.sleep(GAP_S)
        files = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
        if not files:
            return None, "no trace written", None
        with gzip.open(files[0], "rt") as f:
            events = json.load(f).get("traceEvents", [])
    spans, line_names = gpu_events(events)
    names = {str(e.get("name", "")).lower() for e in events}
    graph = any("graphlaunch" in n or "command_buffer" in n or "commandbuffer" in n
                for n in names)
    note = f"lines {', '.join(line_names) or '?'}; CUDA graph {'yes' if graph else 'no'}"
    if not spans:  # off a GPU: the trace is still taken and read, so a smoke run tries it
        return None, ("no GPU events: not a GPU" if jax.default_backend() != "gpu"
                      else f"no GPU events in the trace ({note})"), None
    split = clusters(spans, len(runs))
    if split is None:
        return None, f"trace not split into {len(runs)} runs ({note})", None
    return [sum(s[1] for s in c) for c in split], note, split


# --------------------------------------------------------------------------------------------
# The timed decode scan of a cost row.
# --------------------------------------------------------------------------------------------

def per_call_us(samples, calls) -> float:
    return statistics.median(samples) / calls * 1e6


def floor_program(call, state, layers, routes, options=None):
    """A scan with ``call``'s carry, inputs and per-iteration outputs (a plan's shapes) and a
    trivial body: what one iteration costs with no cache call in it (compiled with
    ``options``)."""
    like = jax.eval_shape(lambda s, la, r: call(s, la, r, "xla")[1], state, layers[0], routes[0])

    def run(state, layers, routes):
        def body(state, x):
            fake = jax.tree.map(
                lambda s: jnp.broadcast_to((x[0] + x[1].ravel()[0]).astype(s.dtype), s.shape),
                like)
            return state.replace(clock=Clock(step=state.step + 1)), fake
        return lax.scan(body, state, (layers, routes))
    return jax.jit(run).lower(state, layers, routes).compile(compiler_options=options)


def scan_program(call, backend, state, layers, routes, options=None):
    """``call(state, layer, routes, backend) -> (state, plan)`` scanned over the calls, compiled
    with ``options``: ``(compiled, compile seconds)``."""
    def run(state, layers, routes):
        return lax.scan(lambda s, x: call(s, x[0], x[1], backend), state, (layers, routes))
    start = time.perf_counter()
    compiled = jax.jit(run).lower(state, layers, routes).compile(compiler_options=options)
    return compiled, time.perf_counter() - start


_PROGRAMS: dict = {}


def cost_scan(ctx, label, call, state, windows, *, programs=None, key=None) -> dict:
    """One cost row: ``call`` in a ``lax.scan`` over each window of calls, on both backends from
    the same ``state``: us per call (median of ``--repeats`` trials of ``--replays``
    dispatches, wall time, the programs as compiled by default), device us per call (one
    profiled dispatch each of the programs compiled with :func:`profile_options`, the
    trivial-body floor's subtracted), kernels per iteration, and the final states and every plan
    compared (a difference is a failure). ``programs(name, options)`` may give ``(compiled,
    compile seconds)`` for each backend and for ``"floor"`` instead (the mesh). Rows of one
    ``key`` (a hashable: the call and its shapes) share their compiled programs."""
    args = ctx.args
    calls = int(windows[0][0].shape[0])
    if programs is None:
        def programs(name, options=None):
            if name == "floor":
                return floor_program(call, state, *windows[0], options), 0.0
            return scan_program(call, name, state, *windows[0], options)
    if key is not None:
        make = programs

        def programs(name, options=None):
            at = (key, name, tuple(sorted((options or {}).items())))
            if at in _PROGRAMS:
                return _PROGRAMS[at][0], 0.0
            _PROGRAMS[at] = make(name, options)
            return _PROGRAMS[at]
    row = {"us": {}, "device_us": {}, "kernels": {}, "compile_s": {}, "plans": {},
           "events": {}, "kernel_us": {}}
    progs, finals = {}, []
    for backend in ctx.backends:
        progs[backend], row["compile_s"][backend] = programs(backend)
        prog = progs[backend]
        s, plans = prog(fresh(state), *windows[0])
        outs, samples = [plans], []
        for trial in range(args.repeats):
            t0 = time.perf_counter()
            for r in range(args.replays):
                s, plans = prog(s, *windows[1 + trial * args.replays + r])
                outs.append(plans)
            jax.block_until_ready(s)
            samples.append(time.perf_counter() - t0)
        row["us"][backend] = per_call_us(samples, args.replays * calls)
        row["kernels"][backend] = kernel_count(prog.as_text())
        host = jax.device_get(outs)
        row["plans"][backend] = host
        finals.append((jax.device_get(s), concat(host)))
    options = profile_options(args)
    names = [*ctx.backends, "floor"]
    profiled = {n: progs[n] if options is None and n in progs else programs(n, options)[0]
                for n in names}
    sums, row["device_note"], split = device_profile(
        [lambda n=n: profiled[n](fresh(state), *windows[0]) for n in names])
    if sums is not None:
        for i, backend in enumerate(ctx.backends):
            row["device_us"][backend] = (sums[i] - sums[-1]) / calls
        # Every GPU event of a scan iteration by name, per program (the floor's too), and the
        # Pallas kernel's own mean: "device us" less the copies and fusions around the call.
        for name, cluster in zip(names, split):
            row["events"][name] = events_by_name(cluster, calls)
        for backend in ctx.backends:
            row["kernel_us"][backend] = kernel_mean_us(row["events"][backend])
    row["final"] = finals[0][0]
    diff = tree_difference(finals[0], finals[1])
    row["status"] = "MISMATCH" if diff else "match"
    if diff:
        ctx.fail(f"MISMATCH [{label}]: xla and {args.candidate} differ after the same "
                 f"{calls * (1 + args.repeats * args.replays)} calls in: {', '.join(diff[:6])}")
    return row


def cell(x, fmt="{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _fill_impl(state, layers, routes):
    def body(state, x):
        state, _ = pc.ensure(state, x[0], x[1], backend="xla")
        return state, None
    return lax.scan(body, state, (layers, routes))[0]


_fill = jax.jit(_fill_impl)


def chunked_routes(rng, per_layer: dict):
    """``ensure`` calls that make the given experts resident: (layers, routes[n, TOP_K])."""
    layers, routes = [], []
    for layer in sorted(per_layer):
        experts = np.asarray(per_layer[layer], np.int32)
        for i in range(0, len(experts), TOP_K):
            chunk = np.full(TOP_K, -1, np.int32)
            part = experts[i:i + TOP_K]
            chunk[:len(part)] = part
            layers.append(layer)
            routes.append(chunk)
    order = rng.permutation(len(layers))  # interleave layers, so usage stamps are mixed
    return np.asarray(layers, np.int32)[order], np.asarray(routes, np.int32)[order]


def full_state(rng, L, E, S, empty: int = 0):
    """A pool filled (by real ensure calls, xla backend) to all but ``empty`` slots."""
    flat = rng.choice(L * E, size=S - empty, replace=False)
    per_layer: dict = {}
    for f in flat:
        per_layer.setdefault(int(f) // E, []).append(int(f) % E)
    layers, routes = chunked_routes(rng, per_layer)
    state = _fill(pc.init(L, E, S), jnp.asarray(layers), jnp.asarray(routes))
    ids = np.asarray(state.residency.id_of_slot)
    assert int((ids < 0).sum()) == empty, "warm-up fill left the wrong number of empty slots"
    return state


def events_lines(done, label) -> list[str]:
    """Per row, every GPU event of a scan iteration by name (count per iteration, mean us) for
    each profiled program: the candidate, the XLA step and the trivial-body floor."""
    out = []
    for row, r in done:
        for name, events in r.get("events", {}).items():
            out.append(f"- {label(row)}, {name}: {format_events(events) or 'none'}")
    return ["", "GPU events per scan iteration (name, count per iteration, mean us):", *out] \
        if out else []
