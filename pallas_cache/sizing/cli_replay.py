"""``pallas-cache replay``: read or generate the trace, run the sweep and print it (a table
with its legend, or records), draw the plot; Ctrl-C exits 130 with no partial output."""

from __future__ import annotations

import dataclasses
import os
import signal
import stat
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np

from pallas_cache.sizing import synthetic
from pallas_cache.sizing.cli_args import (DEFAULT_PRESET, cache_sizes, check_plot_path,
                                          check_state_memory, clamped, cost_options,
                                          model_mismatch, policy_warnings, resolve_policies)
from pallas_cache.sizing.cli_checks import (check_batch_memory, check_before_reading,
                                            check_geometry, check_modeled_numbers,
                                            check_step_memory, exit_without_teardown)
from pallas_cache.sizing.cli_devices import (check_device_count, declared_experts, device_cost,
                                             device_header, run_expert_parallel, tensor_records)
from pallas_cache.sizing.cli_sizing import (batches, cliff_lines, layer_hit_rates,
                                            per_layer_lines, prefetch_lines, synthetic_geometry,
                                            trace_lines, with_budget_fit)
from pallas_cache.sizing.progress import Bar, Progress
from pallas_cache.sizing.report import CONFIG_KEYS, format_records, merged_configs, records
from pallas_cache.sizing.traces import (RUN_FIXED_BYTES, ProcessBudget, TraceError,
                                        default_memory_limit, load_trace, parse_fields)
from pallas_cache.sizing.units import format_bandwidth, format_bytes, format_duration

__all__ = ["READ_PROGRESS_AFTER", "exit_now_if_compiling", "exit_without_teardown",
           "process_budget", "run_replay"]


def process_budget(max_memory: int | None) -> ProcessBudget:
    """``--max-memory`` (``None``: the default limit) as what it leaves for the inputs: the limit
    covers the whole process, so a minimal run's :data:`RUN_FIXED_BYTES` comes off it. A limit
    below that is refused (ValueError, one line), before anything is read."""
    if isinstance(max_memory, ProcessBudget):
        return max_memory
    given = max_memory is not None
    limit = max_memory if given else default_memory_limit()
    if limit < RUN_FIXED_BYTES:
        what = (f"--max-memory {format_bytes(limit)}" if given else
                f"the default memory limit ({format_bytes(limit)}, half of this machine's memory)")
        raise ValueError(f"{what} is below the {format_bytes(RUN_FIXED_BYTES)} a minimal replay "
                         f"takes (the interpreter, JAX and XLA); give --max-memory "
                         f"{format_bytes(RUN_FIXED_BYTES)} or more")
    return ProcessBudget.of(limit)


def _load(args, progress: Progress | None = None):
    if args.trace:
        fields = parse_fields(args.field) if args.field is not None else None
        report = None if progress is None else _ReadProgress(progress, args.trace)
        return load_trace(args.trace, num_layers=args.num_layers, num_experts=args.num_experts,
                          max_memory=args.max_memory, fields=fields,
                          trace_format=args.trace_format, progress=report)
    trace = synthetic.synthetic_trace(args.synthetic or DEFAULT_PRESET, num_tokens=args.tokens,
                                      seed=args.seed, max_memory=args.max_memory,
                                      geometry=_geometry(args))
    if getattr(args, "requests", None) is not None:
        from pallas_cache.sizing.batching import split_requests

        trace = split_requests(trace, args.requests, args.seed)
    return trace


def _geometry(args) -> dict:
    """The synthetic trace's geometry overrides (checked by :func:`synthetic_geometry` before
    the trace is read)."""
    if getattr(args, "geometry", None) is None:
        args.geometry = synthetic_geometry(args, DEFAULT_PRESET)
    return args.geometry


#: Seconds a trace may take to read before its progress is shown (a phase of the replay's).
READ_PROGRESS_AFTER = 2.0


class _ReadProgress:
    """``progress(bytes read, file size)`` of :func:`load_trace` as a phase of the CLI's
    :class:`Progress`, started once the read has taken :data:`READ_PROGRESS_AFTER` seconds."""

    def __init__(self, progress: Progress, path: str):
        self.progress, self.path = progress, path
        self.start, self.shown = time.perf_counter(), False

    def __call__(self, done: int, total: int) -> None:
        if not self.shown:
            if time.perf_counter() - self.start < READ_PROGRESS_AFTER:
                return
            self.progress.phase(f"reading {self.path} ({format_bytes(total)})...", max(total, 1))
            self.shown = True
        self.progress.update(done, f"{format_bytes(done)} of {format_bytes(total)}")


def _knn_companions(configs, args) -> list:
    """When the sweep is LRU alone, printed as a table, with the legend's route_knn line asked
    for (``--route-knn-legend``): route_knn at each size of one LRU series (policy
    ``full`` if swept, else the first policy; the first order; the first admission route_knn
    takes). They are replayed by the sweep itself, as lanes of one more compiled program, for
    the legend's one line only (the rows, their costs and the budget pick stay LRU's)."""
    from pallas_cache.sizing.sweep import ReplayConfig

    fmt = args.format or ("json" if args.json else "table")
    admissions = [a for a in args.admission if a != "reuse"]
    if (fmt != "table" or not getattr(args, "knn_legend", False) or set(args.eviction) != {"lru"}
            or not configs or not admissions):
        return []
    policies = [c.policy for c in configs]
    policy = "full" if "full" in policies else policies[0]
    sizes = dict.fromkeys(c.cache_size for c in configs)
    return [ReplayConfig(size, policy, args.order[0], admissions[0], "route_knn")
            for size in sizes]


def _check_knn_legend(args, batched) -> None:
    """``--route-knn-legend`` ends the legend of an LRU-only table of one-token calls; refuse it
    where there is no such legend (ValueError, one line)."""
    fmt = args.format or ("json" if args.json else "table")
    if fmt != "table":
        raise ValueError(f"--route-knn-legend is a line of the table's legend; --format {fmt} "
                         f"has none")
    if set(args.eviction) != {"lru"}:
        raise ValueError(f"--route-knn-legend compares route_knn with an LRU-only sweep; "
                         f"--eviction {' '.join(args.eviction)} shows each eviction's rows")
    if batched:
        raise ValueError("--route-knn-legend is not computed for --batch; add --eviction lru "
                         "route_knn to see its rows")
    if getattr(args, "parallel", None) == "expert":
        raise ValueError("--route-knn-legend is a line of the one-device table's legend; "
                         "--parallel expert prints a table per device without it (add "
                         "--eviction lru route_knn to see its rows)")


def _check_per_layer(args, batched) -> None:
    """``--per-layer`` gives the layers of one device's one-token replay; refuse it where the
    rows are another's (ValueError, one line)."""
    if batched:
        raise ValueError("--per-layer is not computed for --batch (the rows of a batched "
                         "decode); leave out one or the other")
    if getattr(args, "parallel", None) == "expert":
        raise ValueError("--per-layer is not computed for --parallel expert (a table per "
                         "device and the busiest device's rows); leave out one or the other")


#: The legend's last line of an LRU-only table without ``--route-knn-legend``.
KNN_POINTER = ("route_knn (the eviction that wins on real Mixtral routing): add --eviction lru "
               "route_knn to see its rows, or --route-knn-legend for one line of its changes.")


def _knn_line(results, companions, knn_results, lru_table: bool) -> str | None:
    """The legend's line: route_knn's hit rate minus LRU's, at each size of the companions'
    series; ``knn_results`` are the companions' replay results. Without companions, an LRU-only
    table (``lru_table``) gets :data:`KNN_POINTER`, any other ``None``."""
    if not companions or len(knn_results) != len(companions):
        return KNN_POINTER if lru_table else None
    hit_rates = [r.hit_rate for r in knn_results]
    first = companions[0]
    lru = {r.cache_size: r.hit_rate for r in results
           if (r.policy, r.order, r.admission, r.eviction)
           == (first.policy, first.order, first.admission, "lru")}
    changes = ", ".join(f"{rate - lru[knn.cache_size]:+.3f} at {knn.cache_size}"
                        for knn, rate in zip(companions, hit_rates) if knn.cache_size in lru)
    return (f"route_knn (the eviction that wins on real Mixtral routing) on this trace, policy "
            f"{first.policy}: hit rate {changes} (add --eviction lru route_knn to see its rows).")


def _legend(results, trace, cost, knn_line: str | None = None, rows=None,
            per_device: bool = False, about_trace=()) -> list[str]:
    """What a newcomer needs to read the table: the bounds, the model, the verdict, and (an LRU
    sweep) what route_knn changes (wrapped as the rest). ``rows``: the table's records (their
    ``batch``, and the configurations the table shows once); ``per_device``: the budget is
    each device's; ``about_trace``: what the trace can tell (first)."""
    k = min(trace.top_k, trace.num_experts)
    cliffs = cliff_lines(results, trace)
    paragraphs = [
        "hit_rate = 1 - missing/active per layer-call. Bounds: belady_hit_rate bounds the `full` "
        "rows (every miss admitted); bypass_optimum_hit_rate bounds every row (a miss may be "
        "served without being admitted); oracle_hit_rate (a fixed max(1, round(S/L)) slots per "
        f"layer) is a reference, not a bound. L*k = {trace.num_layers * k} slots hold one "
        "token's experts.",
    ]
    if not cost.expert_bytes:
        paragraphs.append("For bytes and ms per token add --model NAME (or --expert-bytes 336MiB) "
                          "and --link-bandwidth 25GB/s --cpu-bandwidth 60GB/s (your machine's "
                          "numbers: see the README).")
    elif not cost.timed:
        paragraphs.append("For modeled ms per token add --link-bandwidth and --cpu-bandwidth.")
    else:
        fixed = " + T_cpu if cpu_experts > 0" if cost.cpu_fixed_seconds else ""
        paragraphs.append("modeled_ms_per_token: per layer-call max(fetched*W/B_link, "
                          f"cpu_experts*W/B_cpu{fixed}), summed per token (docs/semantics.md "
                          "§11); best = the fastest row at its cache_size.")
        if cost.device_budget is None:
            paragraphs.append("No --device-budget: in this model a bigger cache is never slower, "
                              "so only a budget picks one (e.g. --device-budget 24GiB).")
        else:
            budget = format_bytes(cost.device_budget)
            if not any(r.budget_best for r in results):
                smallest = min(r.cache_bytes for r in results)
                paragraphs.append(f"No configuration fits the {budget} device budget (the "
                                  f"smallest pool takes {format_bytes(smallest)}).")
            paragraphs += _budget_picks(rows if rows is not None else
                                        [dataclasses.asdict(r) for r in results],
                                        budget, per_device)
    if rows is not None:
        paragraphs += _stops_copying(rows, trace)
    if cost.gpu:
        paragraphs.append(
            "overlap_ms_per_token: the layer-calls one after the other, each taking A, then its "
            "copies (tau = W/B_link each, one link) while the device computes each expert (C) "
            "once it is there and the CPU partial runs beside; stall_ms_per_token = the "
            "device's wait; prefetch_bound = 1 - busiest resource/overlap (docs/semantics.md "
            "§11.6).")
        paragraphs += prefetch_lines(results, trace, cost)
    return [textwrap.fill(text, width=100, break_on_hyphens=False)
            for text in [*about_trace, *cliffs, *paragraphs, *([knn_line] if knn_line else [])]]



def _budget_picks(rows, budget: str, per_device: bool) -> list[str]:
    """One line per budget pick (one per batch), naming its batch and, for a configuration
    whose rows another's equal, both; a budget per device says so."""
    merged = merged_configs(rows)
    lines = []
    for r in rows:
        config = tuple(r[key] for key in CONFIG_KEYS)
        if not r["budget_best"] or config in merged:
            continue
        same = [" ".join(f"{key}={mine}" for key, mine, theirs in zip(CONFIG_KEYS, other, kept)
                         if mine != theirs)
                for other, kept in merged.items() if kept == config]
        where = (f"Best within {budget}{' per device' if per_device else ''}"
                 f"{' at batch=' + str(r['batch']) if 'batch' in r else ''}")
        lines.append(
            f"{where}: cache_size={r['cache_size']} ({format_bytes(r['cache_bytes'])}) "
            f"policy={r['policy']} order={r['order']} admission={r['admission']}"
            f"{'' if r['eviction'] == 'lru' else ' eviction=' + r['eviction']}: "
            f"{r['modeled_ms_per_token']:.1f} ms/token modeled"
            + (f" (the same rows as {', '.join(same)})." if same else "."))
    return lines


def _stops_copying(rows, trace) -> list[str]:
    """Why a ``fraction:Q`` marked best copies no miss once the pool is full: at this trace's
    routes per call its split rounds every call's misses down to 0 (docs/semantics.md §5.3),
    so only the admission rule fills empty slots, and the CPU computes every miss after."""
    import jax.numpy as jnp

    from pallas_cache.sizing.sweep import parse_policy

    lines = []
    for policy in dict.fromkeys(r["policy"] for r in rows if r["best"] or r["budget_best"]):
        kind, _, value = policy.partition(":")
        if kind != "fraction":
            continue
        widths = {min(trace.top_k, trace.num_experts) * r.get("batch", 1) for r in rows
                  if r["policy"] == policy}
        split = parse_policy(policy).split  # the library's own rule
        for k in sorted(widths):
            if int(jnp.max(split(jnp.arange(1, k + 1, dtype=jnp.int32)))) == 0:
                lines.append(
                    f"{policy} is marked best, but at {k} routes per call its balanced split "
                    f"copies none of a call's 1-{k} misses (docs/semantics.md §5.3): only the "
                    f"admission rule fills empty slots, so once the pool is full it stops "
                    f"copying and the CPU computes every miss, which the model finds fastest "
                    f"there.")
                break
    return lines


def _write_atomically(path: str, write) -> None:
    """``write(temp_path)`` next to ``path``, then rename over it: an interrupt or error leaves
    no partial file behind."""
    folder, name = os.path.split(os.path.abspath(path))
    handle, temp = tempfile.mkstemp(dir=folder, prefix=f".{name}.",
                                    suffix=os.path.splitext(name)[1])
    os.close(handle)
    try:
        write(temp)
        try:  # the temporary file is 0600: give it the mode the file has, or a new file gets
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            mode = _new_file_mode()
        os.chmod(temp, mode)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)




def _new_file_mode() -> int:
    """The mode a newly created file gets from the process umask (0o644 under umask 022).
    Read from /proc where Linux has it, so the umask is never changed, even for a moment."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask



def _plot(rows, path: str) -> None:
    from pallas_cache.sizing.plotting import plot

    figure = plot(rows)
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    _write_atomically(path, lambda temp: figure.savefig(temp, dpi=120, format=extension))


class _InterruptLatch:
    """Ctrl-C that is never lost. Python raises ``KeyboardInterrupt`` at the next bytecode of the
    main thread, which may run inside a callback of XLA's compiler that swallows it (a SIGINT
    during the first compile can let the replay finish and write its plot). The latch also
    records the signal, and :meth:`check` raises again wherever the CLI looks (every progress
    report, and before any output is written). Installed only over Python's default handler, in
    the main thread."""

    def __init__(self):
        self.fired = False
        self._previous = None

    def __enter__(self):
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc_info):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False

    def _handle(self, signum, frame):
        self.fired = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.fired:
            raise KeyboardInterrupt


class _Checked(Progress):
    """A :class:`Progress` that checks the interrupt latch at every report."""

    def __init__(self, inner: Progress, latch: _InterruptLatch):
        self.inner, self.latch = inner, latch

    def phase(self, line, total):
        self.latch.check()
        self.inner.phase(line, total)

    def update(self, done, status=""):
        self.latch.check()
        self.inner.update(done, status)

    def note(self, line):
        self.latch.check()
        self.inner.note(line)

    def log(self, line):
        self.latch.check()
        self.inner.log(line)

    def close(self):
        self.inner.close()


def _auto_top_k(args, cost) -> int | None:
    """The routes per call ``fraction:auto`` balances with a fixed CPU cost: ``None`` without
    one (the rule needs none), the synthetic trace's ``min(top_k, E)``, or 0 for a trace file
    (known once it is read)."""
    if not cost.cpu_fixed_seconds:
        return None
    if args.trace:
        return 0
    params, _ = synthetic.checked_params(args.synthetic or DEFAULT_PRESET, args.tokens,
                                         args.seed, max_memory=args.max_memory,
                                         geometry=_geometry(args))
    return min(params.top_k, params.num_experts)


def _precompile_synthetic(args, policies, cost) -> threading.Thread | None:
    """A thread compiling the replay's programs while the synthetic trace is generated (its
    geometry is the preset's, so the sweep is known before the trace), or ``None`` where the
    sweep's options are off (the replay reports them after the trace, as for a trace file)."""
    from pallas_cache.sizing.sweep import config_grid, precompile

    if getattr(args, "batch", None) and batches(args):
        return None  # the merged calls' width is B * top_k: other programs than the trace's
    try:  # a refused trace starts no compile: the thread never outlives a refusal
        params, _ = synthetic.checked_params(args.synthetic or DEFAULT_PRESET, args.tokens,
                                             args.seed, max_memory=args.max_memory,
                                             geometry=_geometry(args))
        sizes, _ = with_budget_fit(*cache_sizes(args.cache_size, params, cost), cost,
                                   params.num_layers, params.num_experts)
        configs = config_grid(sizes, policies, args.order, args.admission, args.eviction)
        states = check_state_memory(sizes, len(configs) // len(set(sizes)), params.num_layers,
                                    params.num_experts, args.max_memory)
        check_step_memory(sizes, len(configs) // len(set(sizes)), params.num_experts,
                          params.top_k, args.max_memory, states, hit_counts=cost.gpu)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if not configs:
        return None
    configs = configs + _knn_companions(configs, args)

    finished = threading.Event()
    _COMPILES.append(finished)

    def compile_quietly():
        try:
            precompile(params.num_layers, params.num_experts, params.top_k, configs,
                       hit_counts=cost.gpu)
        except Exception:  # noqa: BLE001 - the replay compiles, and reports, on its own
            pass
        finally:
            finished.set()

    thread = threading.Thread(target=compile_quietly, daemon=True,
                              name="pallas-cache-precompile")
    thread.start()
    return thread


#: One event per precompile thread, set by the thread as it ends. (``Thread.is_alive()`` is no
#: witness: a ``join()`` interrupted by Ctrl-C can leave it False while the thread compiles.)
_COMPILES: list[threading.Event] = []


def exit_now_if_compiling(status: int) -> None:
    """End the process with ``status`` at once if a precompile thread is still running.

    The interpreter's normal exit stops daemon threads wherever they are; one inside XLA's C++
    code then aborts the process (``terminate called ...``, exit 134) after the CLI has printed
    its line. A refusal starts no such thread, but a Ctrl-C can arrive while one compiles, so
    the console script flushes its output and leaves without the interpreter's teardown."""
    if not all(finished.is_set() for finished in _COMPILES):
        exit_without_teardown(status)


def run_replay(args) -> int:
    with _InterruptLatch() as latch:
        progress = _Checked(Progress() if args.quiet else
                            Bar(sys.stderr, prefix="pallas-cache: "), latch)
        try:
            return _replay_with(args, progress, latch)
        finally:  # after an error or Ctrl-C too: the last line starts on a line of its own
            progress.close()


def _replay_with(args, progress: Progress, latch: _InterruptLatch) -> int:
    from pallas_cache.sizing.cost import with_costs
    from pallas_cache.sizing.sweep import config_grid, replay  # jax import deferred until needed

    try:
        args.max_memory = process_budget(args.max_memory)
        if args.field is not None:
            if not args.trace:
                raise ValueError("--field names the keys of a JSONL or Parquet --trace")
            parse_fields(args.field)
        if args.plot:
            args.plot = check_plot_path(args.plot)
        cost, model, weight_label = cost_options(args)
        cost = device_cost(args, cost)
        _geometry(args)
        check_device_count(args, declared_experts(args, DEFAULT_PRESET))
        batched = batches(args)
        if batched and getattr(args, "devices", None) is not None:
            raise ValueError(f"--batch replays one device's cache; it does not combine with "
                             f"--devices {args.devices}")
        if getattr(args, "knn_legend", False):
            _check_knn_legend(args, batched)
        if getattr(args, "per_layer", False):
            _check_per_layer(args, batched)
        auto_k = _auto_top_k(args, cost)
        # fraction:auto with a fixed CPU cost waits for a trace file's routes per call (auto_k
        # 0); until then the policies are checked as resolved at one route per call
        requested = resolve_policies(args.policy, cost, 1 if auto_k == 0 else auto_k)
        policies = list(dict.fromkeys(clamped(policy) for policy in requested))
        check_before_reading(args, cost, policies)
        progress.note(f"reading {args.trace}..." if args.trace else
                      f"generating the {args.synthetic or DEFAULT_PRESET} trace...")
        expert_parallel = getattr(args, "parallel", None) == "expert"
        compiling = (None if args.trace or expert_parallel
                     else _precompile_synthetic(args, policies, cost))
        if compiling is not None:  # every check passed: a log sees the work start, at once
            progress.log(f"generating the {args.synthetic or DEFAULT_PRESET} trace while its "
                         f"programs compile...")
        trace = _load(args, progress)
        if auto_k == 0:
            auto_k = min(trace.top_k, trace.num_experts)
            requested = resolve_policies(args.policy, cost, auto_k)
            policies = list(dict.fromkeys(clamped(policy) for policy in requested))
        warnings = policy_warnings(requested)
        if model is not None and model_mismatch(model, trace):
            warnings.append(model_mismatch(model, trace))
        if expert_parallel:
            check_device_count(args, trace.num_experts)
            return run_expert_parallel(args, trace, cost, policies, progress, latch, warnings)
        sizes, size_lines = with_budget_fit(*cache_sizes(args.cache_size, trace, cost), cost,
                                            trace.num_layers, trace.num_experts)
        check_geometry(trace.num_layers, trace.num_experts, sizes)
        check_modeled_numbers(cost, trace.num_layers, trace.top_k)
        configs = config_grid(sizes, policies, args.order, args.admission, args.eviction)
        if not configs:
            raise ValueError(f"admission reuse needs eviction lru; got --eviction "
                             f"{' '.join(args.eviction)}")
        if batched and len(np.unique(trace.sequence)) < 2:
            raise ValueError("--batch needs several requests; the trace has one"
                             + ("" if args.trace else " (give --requests N)"))
    except (TraceError, OSError, KeyError, TypeError, ValueError) as error:
        progress.close()
        print(f"pallas-cache: {error}", file=sys.stderr)
        return 2
    companions = [] if batched else _knn_companions(configs, args)
    try:  # the legend's route_knn lanes are states of the sweep too
        states = check_state_memory(sizes, len(configs + companions) // len(set(sizes)),
                                    trace.num_layers, trace.num_experts, args.max_memory)
        # the trace and the states stay alive while the step compiles and runs: one sum
        held = states + sum(array.nbytes for array in (trace.routes, trace.layers,
                                                        trace.token_idx, trace.sequence)
                            if array is not None)
        check_step_memory(sizes, len(configs) // len(set(sizes)), trace.num_experts,
                          trace.top_k, args.max_memory, held, hit_counts=cost.gpu)
        if batched:
            check_batch_memory(batched, sizes, len(configs) // len(set(sizes)), trace,
                               args.max_memory, held, hit_counts=cost.gpu)
    except (TypeError, ValueError) as error:
        progress.close()
        print(f"pallas-cache: {error}", file=sys.stderr)
        return 2
    progress.close()  # the note: warnings follow on a clean line
    for line in warnings:
        print(line, file=sys.stderr)
    if compiling is not None:
        compiling.join()  # a replay started before its program is compiled compiles it again
    # route_knn's lanes for the legend ride in the sweep's own programs; the costs (and the
    # budget pick) are the swept rows' alone.
    if batched:
        from pallas_cache.sizing.batching import batched_records

        results, rows = batched_records(trace, configs, cost, batched, replay, progress)
        knn_results = []
    else:
        replayed = replay(trace, configs + companions, progress=progress,
                          hit_counts=cost.gpu, per_layer=getattr(args, "per_layer", False))
        results = with_costs(replayed[:len(configs)], cost)
        knn_results = replayed[len(configs):]
        rows = records(results, trace, cost)
    latch.check()  # nothing is written after a Ctrl-C, even one a compile callback swallowed
    fmt = args.format or ("json" if args.json else "table")
    rows = tensor_records(rows, args)
    per_layer = [] if not getattr(args, "per_layer", False) else (
        per_layer_lines(results, rows) if fmt in ("table", "markdown") else [])
    if getattr(args, "per_layer", False) and fmt not in ("table", "markdown"):
        rows = [dict(row, layer_hit_rates=layer_hit_rates(result))
                for row, result in zip(rows, results)]
    about_trace = trace_lines(rows, trace, None if args.trace else
                              (args.synthetic or DEFAULT_PRESET))
    if fmt != "table":
        print(format_records(rows, fmt))
        for line in per_layer:
            print(line)
        for line in [] if args.quiet else about_trace:
            print(f"pallas-cache: {line}", file=sys.stderr)
    else:
        header = []
        if weight_label:
            header.append(f"expert: {weight_label}")
        if cost.link_bandwidth or cost.cpu_bandwidth:
            header.append("bandwidth: " + "  ".join(
                f"{name}={format_bandwidth(value)}" for name, value in
                (("B_link", cost.link_bandwidth), ("B_cpu", cost.cpu_bandwidth)) if value)
                + (f"  T_cpu={format_duration(cost.cpu_fixed_seconds)}"
                   if cost.cpu_fixed_seconds else ""))
        if cost.gpu:
            header.append(f"gpu: A={format_duration(cost.gpu_layer_seconds or 0.0)} per "
                          f"layer-call  C={format_duration(cost.gpu_expert_seconds or 0.0)} per "
                          f"device-computed expert (estimates you gave)")
        if args.policy is None or "fraction:auto" in args.policy:
            if cost.link_bandwidth and cost.cpu_bandwidth and not cost.cpu_fixed_seconds:
                header.append(f"fraction:auto = B_link/(B_link+B_cpu) = "
                              f"{cost.auto_fraction():.4f} -> {cost.auto_policy()}")
            elif cost.link_bandwidth and cost.cpu_bandwidth:
                header.append(f"fraction:auto = (k*W/B_cpu + T_cpu)/(k*W/B_link + k*W/B_cpu) at "
                              f"k = {auto_k} = {cost.auto_fraction(auto_k):.4f} -> "
                              f"{cost.auto_policy(auto_k)}")
        header += [f"size: {line}" for line in size_lines] + device_header(args, cost)
        print(format_records(rows, "table", header))
        knn_line = _knn_line(results, companions, knn_results, set(args.eviction) == {"lru"})
        print("\n".join(_legend(results, trace, cost, knn_line, rows,
                                 getattr(args, "parallel", None) == "tensor", about_trace)
                         + per_layer))
    if args.plot:
        try:
            _plot(rows, args.plot)
        except OSError as error:  # checked before the replay; changed since
            print(f"pallas-cache: --plot {args.plot}: {error.strerror or error}", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
