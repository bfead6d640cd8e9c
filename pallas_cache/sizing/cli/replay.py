"""``pallas-cache replay``: :func:`run` carries a :class:`~pallas_cache.sizing.cli.request.
ReplayRequest` through load -> sizes -> configurations -> memory checks -> replay -> findings
-> output; the expert-parallel replay takes the same steps per device. Ctrl-C exits 130 with no
partial output."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time

import numpy as np

from pallas_cache.evictions import Eviction
from pallas_cache.mesh import expert_sharding
from pallas_cache.sizing import devices as sizing_devices
from pallas_cache.sizing import sweep, synthetic
from pallas_cache.sizing.batching import batched_records, split_requests
from pallas_cache.sizing.cli import output
from pallas_cache.sizing.cli.checks import (check_batch_memory, check_grid,
                                            check_modeled_numbers, check_state_memory,
                                            check_step_memory, policy_warnings)
from pallas_cache.sizing.cli.devices import (check_device_count, print_expert_parallel,
                                             tensor_records)
from pallas_cache.sizing.cli.findings import findings
from pallas_cache.sizing.cli.parser import UsageError
from pallas_cache.sizing.cli.process import (CheckedProgress, InterruptLatch,
                                             compile_started)
from pallas_cache.sizing.cli.request import REFUSED, ReplayRequest, TraceFile, synthetic_params
from pallas_cache.sizing.cli.sizes import SweepSizes, resolve_sizes
from pallas_cache.sizing.progress import Bar, Progress
from pallas_cache.sizing.report import records
from pallas_cache.sizing.sweep import config_grid, precompile
from pallas_cache.sizing.sweep.cost import with_costs
from pallas_cache.sizing.traces import load_trace
from pallas_cache.sizing.units import format_bytes

__all__ = ["Loaded", "Plan", "READ_PROGRESS_AFTER", "configurations",
           "knn_companions", "load", "memory_checks", "run", "run_replay"]


def run_replay(request: ReplayRequest) -> int:
    """``pallas-cache replay`` of a checked request, inside the Ctrl-C latch and its progress."""
    with InterruptLatch() as latch:
        progress = CheckedProgress(Progress() if request.output.quiet else
                                   Bar(sys.stderr, prefix="pallas-cache: "), latch)
        try:
            return run(request, progress, latch)
        finally:  # after an error or Ctrl-C too: the last line starts on a line of its own
            progress.close()


def run(request: ReplayRequest, progress: Progress, latch: InterruptLatch) -> int:
    """Load -> sizes -> configurations -> memory checks -> replay -> output. A refusal on the
    way raises :class:`~pallas_cache.sizing.cli.parser.UsageError` before any replay."""
    if request.parallel == "expert":
        with refusals():
            loaded = load(request, progress)
            check_device_count(request.devices, request.parallel, loaded.trace.num_experts)
            return _run_expert_parallel(request, loaded, progress, latch)
    with refusals():
        loaded = load(request, progress)
        trace = loaded.trace
        plan = configurations(request, trace, loaded.policies)
        check_modeled_numbers(request.cost, trace.num_layers, trace.top_k)
        if request.batches and len(np.unique(trace.sequence)) < 2:
            raise ValueError("--batch needs several requests; the trace has one"
                             + ("" if isinstance(request.source, TraceFile)
                                else " (give --requests N)"))
    companions = [] if request.batches else knn_companions(request, plan.configs)
    with refusals(TypeError, ValueError):  # the legend's route_knn lanes are states too
        memory_checks(request, trace, plan, len(plan.configs + companions),
                      held=_bytes(trace.routes, trace.layers, trace.token_idx, trace.sequence),
                      hit_counts=request.cost.gpu, batches=request.batches)
    _start(loaded, progress)
    results, rows, knn_results = _replay(request, trace, plan.configs, companions, progress)
    latch.check()  # nothing is written after a Ctrl-C, even one a compile callback swallowed
    rows = tensor_records(rows, request.devices, request.parallel)
    found = findings(request, trace, results, rows, companions, knn_results)
    output.print_rows(request, rows, found, plan.sizes.lines, loaded.auto_k)
    return output.write_plot(request, rows)


@contextlib.contextmanager
def refusals(*kinds):
    """``with refusals(*kinds):`` an error of those kinds (default: every kind a check raises)
    becomes the :class:`UsageError` of its one line."""
    try:
        yield
    except (kinds or REFUSED) as error:
        raise UsageError(f"pallas-cache: {error}") from None


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A request's trace, read or generated, with what depends on it: the policies
    (``requested``: resolved; ``policies``: as run), the routes per call ``fraction:auto``
    balances, the warnings, and the precompile thread of a synthetic trace (or ``None``)."""

    trace: object
    requested: list
    policies: list
    auto_k: int | None
    warnings: list
    compiling: threading.Thread | None


def load(request: ReplayRequest, progress: Progress) -> Loaded:
    """Read or generate the trace (a synthetic one while its programs compile), then resolve
    the policies at its routes per call and collect the warnings."""
    source = request.source
    progress.note(f"reading {source.path}..." if isinstance(source, TraceFile) else
                  f"generating the {source.preset} trace...")
    compiling = (None if isinstance(source, TraceFile) or request.parallel == "expert"
                 else _precompile_synthetic(request))
    if compiling is not None:  # every check passed: a log sees the work start, at once
        progress.log(f"generating the {source.preset} trace while its programs compile...")
    trace = _trace(request, progress)
    trace, tokens, calls = trace.without_partial_tokens()
    auto_k = request.auto_k
    if auto_k == 0:
        auto_k = min(trace.top_k, trace.num_experts)
    requested, policies = request.resolved_policies(1 if auto_k == 0 else auto_k)
    warnings = policy_warnings(requested)
    if tokens:
        warnings.append(f"pallas-cache: dropped the trailing partial token of {tokens} "
                        f"sequence{'s' if tokens > 1 else ''} ({calls} layer-calls, fewer than "
                        f"a token's layers): per-token figures count complete tokens")
    mismatch = None if request.model is None else output.model_mismatch(request.model, trace)
    if mismatch:
        warnings.append(mismatch)
    return Loaded(trace, requested, policies, auto_k, warnings, compiling)


def _trace(request: ReplayRequest, progress: Progress | None = None):
    """The request's trace: the file read (with its progress once it is slow), or generated."""
    source = request.source
    if isinstance(source, TraceFile):
        report = None if progress is None else _ReadProgress(progress, source.path)
        return load_trace(source.path, num_layers=source.num_layers,
                          num_experts=source.num_experts, max_memory=request.max_memory,
                          fields=source.fields, trace_format=source.format, progress=report)
    trace = synthetic.synthetic_trace(source.preset, num_tokens=source.tokens, seed=source.seed,
                                      max_memory=request.max_memory,
                                      geometry=dict(source.geometry))
    if source.requests is not None:
        trace = split_requests(trace, source.requests, source.seed)
    return trace


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sweep of one trace (or one device's): its cache sizes, resolved at its geometry, and
    the configurations."""

    sizes: SweepSizes
    configs: list

    @property
    def per_size(self) -> int:
        return len(self.configs) // len(self.sizes.slots)


def configurations(request: ReplayRequest, geometry, policies) -> Plan:
    """Sizes -> configurations: the request's cache sizes at ``geometry`` (a trace's, or a
    synthetic preset's parameters) and the grid of the policies and the request's axes."""
    sizes = resolve_sizes(request.cache_sizes, request.cost, geometry.num_layers,
                          geometry.num_experts, geometry.top_k)
    configs = config_grid(sizes.slots, policies, *request.axes)
    check_grid(configs, request.evictions)
    return Plan(sizes, configs)


def memory_checks(request: ReplayRequest, geometry, plan: Plan, lanes: int, *, held: int = 0,
                  hit_counts: bool = False, batches=None) -> None:
    """Refuse a sweep whose states (``lanes`` configurations), step, or batched calls would not
    fit ``--max-memory`` beside ``held`` bytes of arrays, before any is allocated."""
    per_size, slots = plan.per_size, plan.sizes.slots
    states = check_state_memory(slots, lanes // len(slots), geometry.num_layers,
                                geometry.num_experts, request.max_memory)
    # the arrays and the states stay alive while the step compiles and runs: one sum
    check_step_memory(slots, per_size, geometry.num_experts, geometry.top_k,
                      request.max_memory, states + held, hit_counts=hit_counts)
    if batches:
        check_batch_memory(batches, slots, per_size, geometry, request.max_memory,
                           states + held, hit_counts=hit_counts)


def _bytes(*arrays) -> int:
    return sum(array.nbytes for array in arrays if array is not None)


def _start(loaded: Loaded, progress: Progress) -> None:
    """Every check passed: the warnings, then the precompile joined (a replay started before
    its program is compiled compiles it again)."""
    progress.close()  # the note: warnings follow on a clean line
    for line in loaded.warnings:
        print(line, file=sys.stderr)
    if loaded.compiling is not None:
        loaded.compiling.join()


def _replay(request: ReplayRequest, trace, configs, companions, progress):
    """``(results, rows, knn_results)`` of the sweep (batched, or with the legend's route_knn
    lanes riding in its own programs; the costs and the budget pick are the swept rows'
    alone)."""
    cost = request.cost
    if request.batches:
        results, rows = batched_records(trace, configs, cost, list(request.batches),
                                        sweep.replay, progress)
        return results, rows, []
    replayed = sweep.replay(trace, configs + companions, progress=progress,
                            hit_counts=cost.gpu, per_layer=request.output.per_layer)
    results = with_costs(replayed[:len(configs)], cost)
    return results, records(results, trace, cost), replayed[len(configs):]


def _run_expert_parallel(request: ReplayRequest, loaded: Loaded, progress: Progress,
                         latch: InterruptLatch) -> int:
    """The expert-parallel replay: device ``d``'s trace (its share of every layer's experts)
    through the same steps, every device planned and checked before any replays, then printed
    per device with the busiest device's row of each configuration."""
    trace = loaded.trace
    plans = []
    with refusals(TypeError, ValueError):
        sharding = expert_sharding(trace.num_experts, request.devices)
        for device_trace in sizing_devices.device_traces(trace, sharding):
            plan = configurations(request, device_trace, loaded.policies)
            memory_checks(request, device_trace, plan, len(plan.configs),
                          held=_bytes(device_trace.routes, trace.routes, trace.layers,
                                      trace.token_idx, trace.sequence))
            plans.append((device_trace, plan))
    _start(loaded, progress)
    per_device = [records(sweep.replay(device_trace, plan.configs, cost=request.cost,
                                       progress=progress), device_trace, request.cost)
                  for device_trace, plan in plans]
    latch.check()
    progress.close()
    print_expert_parallel(request, trace, sharding, per_device,
                          [plan.sizes.lines for _, plan in plans])
    return 0


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


def knn_companions(request: ReplayRequest, configs) -> list:
    """When the sweep is LRU alone, printed as a table, with the legend's route_knn line asked
    for (``--route-knn-legend``): route_knn at each size of one LRU series (policy
    ``full`` if swept, else the first policy; on every other axis the first value route_knn
    takes). They are replayed by the sweep itself, as lanes of one more compiled program, for
    the legend's one line only (the rows, their costs and the budget pick stay LRU's)."""
    if (request.output.format != "table" or not request.output.knn_legend
            or not request.lru_only or not configs):
        return []
    policies = [c.policy for c in configs]
    policy = "full" if "full" in policies else policies[0]
    # the grid's first configuration of that policy route_knn takes (it refuses reuse)
    first = next(filter(None, (_as_route_knn(c) for c in configs if c.policy == policy)), None)
    if first is None:
        return []
    sizes = dict.fromkeys(c.cache_size for c in configs)
    return [dataclasses.replace(first, cache_size=size) for size in sizes]


def _as_route_knn(config):
    """``config`` with route_knn's eviction, or ``None`` where route_knn refuses it (an
    admission only LRU takes: ``ReplayConfig`` checks it)."""
    try:
        return dataclasses.replace(config, eviction=Eviction.ROUTE_KNN)
    except ValueError:
        return None


def _precompile_synthetic(request: ReplayRequest) -> threading.Thread | None:
    """A thread compiling the replay's programs while the synthetic trace is generated (its
    geometry is the preset's, so the sweep is known before the trace), or ``None`` where the
    sweep's options are off (the replay reports them after the trace, as for a trace file)."""
    if request.batches:
        return None  # the merged calls' width is B * top_k: other programs than the trace's
    cost = request.cost
    try:  # a refused trace starts no compile: the thread never outlives a refusal
        params = synthetic_params(request.source, request.max_memory)
        _, policies = request.resolved_policies(1 if request.auto_k == 0 else request.auto_k)
        plan = configurations(request, params, policies)
        memory_checks(request, params, plan, len(plan.configs), hit_counts=cost.gpu)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    configs = plan.configs + knn_companions(request, plan.configs)
    finished = compile_started()

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
