"""Running a sweep: its plan (:class:`SweepPlan`), the scan of every group chunk by chunk with
a group's lanes split over host threads, and the offline optima computed meanwhile on a thread
of their own."""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_cache.evictions import Eviction
from pallas_cache.host.reports import per_layer_stats
from pallas_cache.policy import Admission, FetchOrder
from pallas_cache.sizing import bounds as belady_lib
from pallas_cache.sizing.progress import Progress
from pallas_cache.sizing.sweep.program import (Placement, executable, group_batches, groups,
                                               hit_triples, lane_key)
from pallas_cache.sizing.sweep.records import ReplayResult
from pallas_cache.sizing.traces import Trace

__all__ = ["OptimaThread", "SweepPlan", "run_groups"]


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    """One replay's scan, fixed before it runs: the trace, the configurations and their lanes,
    the groups that each compile one program, the calls padded to whole chunks, and where the
    lanes run.

    Attributes:
      trace: the routing trace (its geometry and token count).
      configs: the configurations, in the caller's order; ``keys`` their lane keys, aligned.
      groups: ``(bucket of sizes, eviction)`` per compiled program
        (:func:`~pallas_cache.sizing.sweep.program.groups`).
      layers: int32 ``[chunks * chunk_calls]``, the trace's layers padded with layer ``-1``.
      routes: int32 ``[chunks * chunk_calls, K]``, its routes padded with ``-1``.
      num_calls: the trace's layer-calls (before padding).
      chunk_calls: layer-calls per compiled chunk.
      where: the devices and host threads (:class:`~pallas_cache.sizing.sweep.program.Placement`).
      hit_counts: count the calls by ``(hits, fetched, cpu_experts)`` too (the GPU-time model's
        histogram, docs/semantics.md §11.6).
      per_layer: keep each configuration's per-layer counters (``ReplayResult.layer_stats``).
    """

    trace: Trace
    configs: tuple
    keys: tuple
    groups: tuple
    layers: np.ndarray
    routes: np.ndarray
    num_calls: int
    chunk_calls: int
    where: Placement
    hit_counts: bool = False
    per_layer: bool = False

    @classmethod
    def of(cls, trace: Trace, configs, *, chunk_calls: int, bucket_ratio: float,
           where: Placement, hit_counts: bool = False, per_layer: bool = False) -> "SweepPlan":
        """The plan of replaying ``trace`` through ``configs``: the calls padded to whole
        chunks with refused layer ``-1`` calls, which change nothing and count nothing."""
        layers, routes = trace.to_array()
        num_calls = layers.shape[0]
        padded = -(-num_calls // chunk_calls) * chunk_calls
        layers = np.concatenate([layers.astype(np.int32),
                                 np.full(padded - num_calls, -1, np.int32)])
        routes = np.concatenate([routes.astype(np.int32),
                                 np.full((padded - num_calls, routes.shape[1]), -1, np.int32)])
        keys = tuple(lane_key(config) for config in configs)
        return cls(trace, tuple(configs), keys, tuple(groups(keys, bucket_ratio)), layers,
                   routes, num_calls, chunk_calls, where, bool(hit_counts), bool(per_layer))

    @property
    def num_chunks(self) -> int:
        return self.layers.shape[0] // self.chunk_calls

    @property
    def num_routes(self) -> int:
        """Non-padding routes, duplicates counted."""
        return int((self.routes >= 0).sum())

    @property
    def pair_side(self) -> int:
        """The side of a lane's ``(fetched, cpu_experts)`` table: both lie in ``[0, K']``."""
        return min(self.trace.top_k, self.trace.num_experts) + 1


def run_groups(plan: SweepPlan, report: Progress, compiled: Callable[[], None]) -> dict:
    """The scan of a replay: ``{config index: ReplayResult}`` without the bounds.

    Every group's first chunk runs first (each compiles its program), then ``compiled()`` is
    called, then the groups' other chunks run, one group after the other. With
    ``plan.where.threads > 1`` a group's lanes are dealt into that many equal parts, each run by
    its own host thread through the same compiled program (:func:`_run_parts`).
    """
    trace, configs, keys = plan.trace, plan.configs, plan.keys
    layers, routes, chunk_calls, num_calls = (plan.layers, plan.routes, plan.chunk_calls,
                                              plan.num_calls)
    num_chunks, num_routes = plan.num_chunks, plan.num_routes
    num_tokens = trace.num_tokens
    results: dict[int, ReplayResult] = {}
    done = 0

    def run(program, batch, chunk, status=None):
        """One chunk of one part; ``status``: report it (the main thread's part only)."""
        nonlocal done
        window = slice(chunk * chunk_calls, (chunk + 1) * chunk_calls)
        chunk_layers, chunk_routes = jnp.asarray(layers[window]), jnp.asarray(routes[window])
        batch = executable(program, batch, chunk_layers, chunk_routes)(
            batch, chunk_layers, chunk_routes)
        if status is not None:
            done += 1
            report.update(done, f"{status} calls {min((chunk + 1) * chunk_calls, num_calls)}"
                                f"/{num_calls}")
        return batch

    started = []
    for bucket, eviction in plan.groups:
        unique, batches, program = group_batches(trace.num_layers, trace.num_experts,
                                                 plan.pair_side, bucket, eviction, keys,
                                                 plan.where, plan.hit_counts)
        status = "cache_size=" + ",".join(str(size) for size in bucket) + (
            "" if eviction == Eviction.LRU.value else f" eviction={eviction}")
        batches[0] = run(program, batches[0], 0, status)  # compiles the group's program
        started.append([bucket, eviction, unique, program, batches, status])
    compiled()
    for entry in started:
        bucket, eviction, unique, program, batches, status = entry
        entry[4] = None  # the group's state lives in `batches` only (donated chunk by chunk)
        batches = _run_parts(run, program, batches, num_chunks, status)
        states, cpu_routes, pairs = jax.tree.map(
            lambda *parts: np.concatenate(parts), *(jax.device_get(b[:3]) for b in batches))
        for index, config in enumerate(configs):
            key = keys[index]
            if key.cache_size not in bucket or key.eviction != eviction:
                continue
            row = unique.index(key)
            size = key.cache_size
            calls, active, missing, fetched = (int(v) for v in states.stats[row].sum(axis=0))
            table = pairs[row]
            call_counts = ()
            if table.ndim == 1:  # (hits, fetched, cpu_experts): the pairs are its sums over hits
                (found,) = np.nonzero(table)
                call_counts = tuple(sorted(
                    (h, f, c, int(table[index]))
                    for (h, f, c), index in zip(hit_triples(found), found)))
                table = np.zeros((plan.pair_side, plan.pair_side), table.dtype)
                for _, f, c, count in call_counts:
                    table[f, c] += count
            fetched_of, cpu_of = np.nonzero(table)
            results[index] = ReplayResult(
                cache_size=size,
                policy=config.policy,
                order=FetchOrder.coerce(config.order).value,
                admission=Admission.coerce(config.admission).value,
                calls=calls,
                routes=num_routes,
                active=active,
                missing=missing,
                fetched=fetched,
                cpu_routes=int(cpu_routes[row]),
                # Usable slots only: those past the lane's size are neither empty nor full.
                empty_slots=int((states.residency.id_of_slot[row][:size] < 0).sum()),
                hit_rate=1.0 - missing / active if active else 1.0,
                belady_hit_rate=None,
                bypass_optimum_hit_rate=None,
                oracle_hit_rate=None,
                tokens=num_tokens,
                cpu_experts=missing - fetched,
                fetched_per_token=fetched / max(num_tokens, 1),
                cpu_experts_per_token=(missing - fetched) / max(num_tokens, 1),
                pair_counts=tuple((int(f), int(c), int(table[f, c]))
                                  for f, c in zip(fetched_of, cpu_of)),
                call_counts=call_counts,
                note=_note(size, trace, 1.0 - missing / active if active else 1.0),
                eviction=eviction,
                layer_stats=(tuple(per_layer_stats(jax.tree.map(lambda a: a[row], states)))
                             if plan.per_layer else ()),
            )
    return results


def _run_parts(run, program, batches, num_chunks, status):
    """Run the parts of one group to the end of the trace: part 0 on this thread (from its
    second chunk, reporting), every other part on a host thread of its own (from its first).

    The parts share the compiled ``program``; XLA releases the GIL while a chunk runs, so on a
    multi-core CPU the parts' scans run side by side. Lanes never interact, so the results are
    those of one program over all the lanes. An error in any part is raised here, after every
    part has stopped.
    """
    errors: list = []
    stop = threading.Event()

    def work(index):
        try:
            batch = batches[index]
            for chunk in range(num_chunks):
                if stop.is_set():
                    return
                # Waiting for each chunk keeps the thread from queueing the whole trace ahead,
                # so a failure or Ctrl-C on the main thread stops it within a chunk.
                batch = jax.block_until_ready(run(program, batch, chunk))
            batches[index] = batch
        except BaseException as error:  # noqa: BLE001 - raised on the calling thread
            errors.append(error)

    workers = [threading.Thread(target=work, args=(index,), daemon=True,
                                name=f"pallas-cache-lanes-{index}")
               for index in range(1, len(batches))]
    for worker in workers:
        worker.start()
    try:
        batch = batches[0]
        for chunk in range(1, num_chunks):
            if errors:  # a part failed: stop this one too, and raise its error below
                break
            batch = run(program, batch, chunk, status)
        batches[0] = batch
    except BaseException:
        stop.set()
        raise
    finally:
        for worker in workers:
            worker.join()
    if errors:
        raise errors[0]
    return batches


class _Cancelled(Exception):
    """Raised inside the optima thread when the replay failed and no one will read them."""


class OptimaThread:
    """The three bounds of every size, computed on a background thread.

    The thread queues each progress event; :meth:`report_to` replays them, in order, as one
    phase of ``report`` (the same events a sequential pass would report, so a terminal bar and a
    log read the same), then returns ``{size: {bound field: hit rate}}`` or raises what the
    thread raised.
    """

    def __init__(self, trace: Trace, sizes: list[int]):
        self.sizes = sizes
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False
        self.thread = threading.Thread(target=self._run, args=(trace,), daemon=True,
                                       name="pallas-cache-optima")
        self.thread.start()

    def cancel(self) -> None:
        self.cancelled = True

    def _update(self, done: int, status: str) -> None:
        if self.cancelled:
            raise _Cancelled
        self.events.put(("update", done, status))

    def _run(self, trace: Trace) -> None:
        try:
            optima = {}
            # A trace with no route at all (an expert-parallel device whose experts the trace
            # never routes) has no oracle: None, as a row without bounds, not an error.
            routed = bool(np.any(np.asarray(trace.routes) >= 0))
            for index, size in enumerate(self.sizes):
                hit_rates = []
                for step, (name, bound) in enumerate((("belady", belady_lib.belady),
                                                      ("bypass optimum",
                                                       belady_lib.bypass_optimum))):
                    base = 1000 * (2 * index + step)
                    status = f"{name} cache_size={size}"
                    hit_rates.append(bound(trace, size, progress=lambda done, total: self._update(
                        base + 1000 * done // max(total, 1), status)).hit_rate)
                optima[size] = dict(
                    belady_hit_rate=hit_rates[0], bypass_optimum_hit_rate=hit_rates[1],
                    oracle_hit_rate=(belady_lib.stationary_oracle(trace, size).mean_hit_rate
                                     if routed else None))
            self.events.put(("done", optima, None))
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            self.events.put(("error", error, None))

    def report_to(self, report: Progress) -> dict:
        """Wait for the bounds, reporting their progress as one phase of ``report``."""
        passes = 2 * len(self.sizes)  # two optima per size (the oracle is a histogram: no time)
        report.phase(f"offline optima (Belady, bypass) for {len(self.sizes)} cache "
                     f"size{'s' if len(self.sizes) != 1 else ''}...", 1000 * passes)
        while True:
            kind, value, status = self.events.get()
            if kind == "update":
                report.update(value, status)
            elif kind == "error":
                raise value
            else:
                return value


def _note(size: int, trace: Trace, hit_rate: float) -> str:
    """Why a row of this size deserves a second look (docs/semantics.md §11.3), else ``""``;
    ``hit_rate``: the row's, quoted beside the cliff it fell off."""
    num_layers, top_k = trace.num_layers, min(trace.top_k, trace.num_experts)
    notes = []
    if size < num_layers * top_k:
        notes.append(f"S < L*k = {num_layers * top_k}: LRU thrashes on the cyclic layer sweep "
                     f"(hit rate {hit_rate:.3f} here)")
    if size < num_layers:
        notes.append(f"oracle assumes 1 slot/layer = {num_layers} > S")
    return "; ".join(notes)
