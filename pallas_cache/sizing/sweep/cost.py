"""The decode-time cost model of a replay: bytes and milliseconds per token (docs/semantics.md §11).

A layer-call costs ``max(fetched * W / B_link, cpu_experts * W / B_cpu + T_cpu)`` (``T_cpu``, the
CPU partial's fixed cost, only when ``cpu_experts > 0``; 0 unless given) and a token the sum
over its layer-calls; :func:`modeled_seconds` computes it from the replay's exact counts of
``(fetched, cpu_experts)`` pairs, for any bandwidths.

With the GPU's time given (``A`` per layer-call, ``C`` per device-computed expert), the event
rules of docs/semantics.md §11.6 time the calls one after the other with the copies, the
device's compute and the CPU partial overlapping inside each call: :func:`overlap_times`
evaluates them on the exact ``(hits, fetched, cpu_experts, calls)`` histogram, with the busy
time of each resource that bounds what any prefetch could save.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

__all__ = ["CostModel", "OverlapTimes", "call_seconds", "modeled_seconds", "ordered_sum",
           "figure_words", "overlap_times", "ranking_figure", "with_costs"]


def modeled_seconds(pair_counts: Iterable[tuple[int, int, int]], expert_bytes: int,
                    link_bandwidth: float, cpu_bandwidth: float,
                    cpu_fixed_seconds: float = 0.0) -> float:
    """``sum(calls * max(fetched * W / B_link, cpu_experts * W / B_cpu + T_cpu))`` over the
    pairs, ``T_cpu`` charged once per call that has at least one CPU expert.

    Args:
      pair_counts: ``(fetched, cpu_experts, calls)`` triples, as a replay reports them.
      expert_bytes: ``W``.
      link_bandwidth: ``B_link`` in bytes per second.
      cpu_bandwidth: ``B_cpu`` in bytes per second.
      cpu_fixed_seconds: ``T_cpu``, the CPU partial's fixed cost per layer-call (its launch,
        the host round trip, the wait for the host threads); 0 leaves the two-bandwidth model.
    """
    return ordered_sum(calls * max(fetched * expert_bytes / link_bandwidth,
                                   _cpu_seconds(cpu_experts, expert_bytes, cpu_bandwidth,
                                                cpu_fixed_seconds))
                       for fetched, cpu_experts, calls in pair_counts)


def ordered_sum(values: Iterable[float]) -> float:
    """``values`` added left to right, as Python 3.11's ``sum()`` does: from 3.12 ``sum()`` of
    floats compensates its rounding, and the model's numbers would differ in the last bit
    between Pythons."""
    total = 0.0
    for value in values:
        total += value
    return total


def _cpu_seconds(cpu_experts: int, expert_bytes: int, cpu_bandwidth: float,
                 cpu_fixed_seconds: float) -> float:
    """One call's CPU partial: ``cpu_experts * W / B_cpu``, plus ``T_cpu`` when it runs at all."""
    seconds = cpu_experts * expert_bytes / cpu_bandwidth
    if cpu_fixed_seconds and cpu_experts > 0:
        seconds += cpu_fixed_seconds
    return seconds


def call_seconds(hits: int, fetched: int, cpu_experts: int, expert_bytes: int,
                 link_bandwidth: float, cpu_bandwidth: float | None,
                 cpu_fixed_seconds: float = 0.0, gpu_layer_seconds: float = 0.0,
                 gpu_expert_seconds: float = 0.0) -> float:
    """One accepted layer-call's time under the event rules (docs/semantics.md §11.6), from
    ``t_end`` of the call before it to its own ``t_end``, when every copy is a demand copy.

    The link is then idle when the call is routed (every earlier copy fed an expert the device
    computed before that call ended), and every hit arrived before it, so: ``A``; then the
    device computes the ``hits`` experts (``C`` each) while the ``fetched`` copies run back to
    back (``tau = W / B_link`` each), and each fetched expert as soon as both its copy and the
    device's previous expert are done; beside all of it, the CPU partial of ``cpu_experts``
    experts (§11.2). The call ends when the device and the CPU both have.
    """
    tau = expert_bytes / link_bandwidth
    device = hits * gpu_expert_seconds
    for copy in range(1, fetched + 1):
        device = max(device, copy * tau) + gpu_expert_seconds
    cpu = (_cpu_seconds(cpu_experts, expert_bytes, cpu_bandwidth, cpu_fixed_seconds)
           if cpu_experts else 0.0)
    return gpu_layer_seconds + max(device, cpu)


@dataclasses.dataclass(frozen=True)
class OverlapTimes:
    """What the event rules give for a replay's calls (all in seconds, over the whole trace).

    Attributes:
      total: the calls' time, one after the other (``t_end`` of the last call).
      gpu_busy: ``A * calls + C * device-computed experts`` (hits and fetched).
      link_busy: ``fetched * W / B_link``, the copies.
      cpu_busy: the CPU partials, ``cpu_experts * W / B_cpu + T_cpu`` per call that has any.
    """

    total: float
    gpu_busy: float
    link_busy: float
    cpu_busy: float

    @property
    def stall(self) -> float:
        """The time the device waits: ``total - gpu_busy``."""
        return self.total - self.gpu_busy

    @property
    def prefetch_bound(self) -> float:
        """``1 - max(gpu_busy, link_busy, cpu_busy) / total``: no schedule that moves the same
        bytes (every prefetch of a perfect predictor) finishes before its busiest resource."""
        if self.total <= 0:
            return 0.0
        return 1.0 - max(self.gpu_busy, self.link_busy, self.cpu_busy) / self.total


def overlap_times(call_counts: Iterable[tuple[int, int, int, int]], expert_bytes: int,
                  link_bandwidth: float, cpu_bandwidth: float | None = None,
                  cpu_fixed_seconds: float = 0.0, gpu_layer_seconds: float = 0.0,
                  gpu_expert_seconds: float = 0.0) -> OverlapTimes:
    """The event rules (docs/semantics.md §11.6) over a replay's exact ``(hits, fetched,
    cpu_experts, calls)`` histogram, in float64: a new ``A``, ``C`` or bandwidth needs no
    replay. ``cpu_bandwidth`` may be ``None`` only when no call has a CPU expert.

    Raises:
      ValueError: a call with CPU experts and no ``cpu_bandwidth``.
    """
    tau = expert_bytes / link_bandwidth
    total, gpu, link, cpu = [], [], [], []
    for hits, fetched, cpu_experts, calls in call_counts:
        if cpu_experts and cpu_bandwidth is None:
            raise ValueError("calls with CPU experts need the CPU bandwidth to be timed")
        total.append(calls * call_seconds(hits, fetched, cpu_experts, expert_bytes,
                                          link_bandwidth, cpu_bandwidth, cpu_fixed_seconds,
                                          gpu_layer_seconds, gpu_expert_seconds))
        gpu.append(calls * (gpu_layer_seconds + (hits + fetched) * gpu_expert_seconds))
        link.append(calls * fetched * tau)
        if cpu_experts:
            cpu.append(calls * _cpu_seconds(cpu_experts, expert_bytes, cpu_bandwidth,
                                            cpu_fixed_seconds))
    return OverlapTimes(math.fsum(total), math.fsum(gpu), math.fsum(link), math.fsum(cpu))


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What turns counts into bytes and milliseconds; every field optional.

    Attributes:
      expert_bytes: ``W``, bytes of one routed expert (``None``: hit rates only).
      link_bandwidth: ``B_link``, host-to-device bytes per second.
      cpu_bandwidth: ``B_cpu``, expert bytes per second the CPU MoE path processes.
      device_budget: device bytes the pool may take; names the best configuration that fits.
      cpu_fixed_seconds: ``T_cpu``, the CPU partial's fixed cost per layer-call with at least
        one CPU expert (``pallas-cache bench-bandwidth`` measures it); 0: none.
      gpu_layer_seconds: ``A``, a layer-call's GPU time outside its routed experts (attention,
        router, norms, the cache step); ``None``: GPU time is not modeled.
      gpu_expert_seconds: ``C``, the GPU time of one distinct routed expert computed on the
        device; ``None``: not modeled. Either one turns on the event rules
        (docs/semantics.md §11.6), the other then counting as 0.
    """

    expert_bytes: int | None = None
    link_bandwidth: float | None = None
    cpu_bandwidth: float | None = None
    device_budget: int | None = None
    cpu_fixed_seconds: float = 0.0
    gpu_layer_seconds: float | None = None
    gpu_expert_seconds: float | None = None

    def __post_init__(self):
        for name in ("expert_bytes", "link_bandwidth", "cpu_bandwidth", "device_budget"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        fixed = self.cpu_fixed_seconds
        if not (isinstance(fixed, (int, float)) and math.isfinite(fixed) and fixed >= 0):
            raise ValueError(f"cpu_fixed_seconds must be a finite number >= 0, got {fixed!r}")
        for name in ("gpu_layer_seconds", "gpu_expert_seconds"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float))
                                          and not isinstance(value, bool)
                                          and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @property
    def gpu(self) -> bool:
        """Whether the GPU's time is given, so the event rules time the calls (§11.6)."""
        return self.gpu_layer_seconds is not None or self.gpu_expert_seconds is not None

    def overlap(self, call_counts: Iterable[tuple[int, int, int, int]]) -> OverlapTimes:
        """The event rules over ``call_counts`` (see :func:`overlap_times`); needs ``W`` and
        ``B_link`` (and ``B_cpu`` where a call has CPU experts)."""
        if self.expert_bytes is None or self.link_bandwidth is None:
            raise ValueError("the GPU-time model needs the expert size and the link bandwidth")
        return overlap_times(call_counts, self.expert_bytes, self.link_bandwidth,
                             self.cpu_bandwidth, self.cpu_fixed_seconds,
                             self.gpu_layer_seconds or 0.0, self.gpu_expert_seconds or 0.0)

    @property
    def timed(self) -> bool:
        """Whether ``W`` and both bandwidths are known, so milliseconds can be modeled."""
        return None not in (self.expert_bytes, self.link_bandwidth, self.cpu_bandwidth)

    def auto_fraction(self, top_k: int | None = None) -> float:
        """The share of misses to copy so that, for a call's misses, the copy and the CPU work
        take the same time: ``B_link / (B_link + B_cpu)`` (the upstream engine's rule). With a
        fixed CPU cost ``T_cpu``, the balance of a call whose ``k = top_k`` routes all miss,
        ``f * k * W / B_link = (1 - f) * k * W / B_cpu + T_cpu``, clamped to ``[0, 1]``: the
        fixed cost moves copies off the CPU (docs/semantics.md §11.4)."""
        if self.link_bandwidth is None or self.cpu_bandwidth is None:
            raise ValueError("fraction:auto needs both --link-bandwidth and --cpu-bandwidth")
        balance = self.link_bandwidth / (self.link_bandwidth + self.cpu_bandwidth)
        if not self.cpu_fixed_seconds:
            return balance
        if self.expert_bytes is None or top_k is None or top_k < 1:
            raise ValueError("fraction:auto with a fixed CPU cost needs the expert size and "
                             "the routes per call")
        link = top_k * self.expert_bytes / self.link_bandwidth
        cpu = top_k * self.expert_bytes / self.cpu_bandwidth
        return min(1.0, (cpu + self.cpu_fixed_seconds) / (link + cpu))

    def auto_policy(self, top_k: int | None = None) -> str:
        """``fraction:auto`` resolved, to 4 significant digits: the row runs what it shows."""
        return f"fraction:{self.auto_fraction(top_k):.4g}"

    def seconds(self, pair_counts: Iterable[tuple[int, int, int]]) -> float:
        """Modeled seconds of the calls in ``pair_counts`` (see :func:`modeled_seconds`)."""
        if not self.timed:
            raise ValueError("modeled time needs the expert size and both bandwidths")
        return modeled_seconds(pair_counts, self.expert_bytes, self.link_bandwidth,
                               self.cpu_bandwidth, self.cpu_fixed_seconds)


def _field(row, key):
    return row.get(key) if isinstance(row, dict) else getattr(row, key)


def ranking_figure(rows) -> str | None:
    """The ms-per-token figure ``best``, ``budget_best`` and the sizes named under the table
    rank ``rows`` (records or results) by: the one the run models most completely,
    ``overlap_ms_per_token`` (the GPU's time, the copies and the CPU partial overlapping) when
    every row has it, else ``modeled_ms_per_token`` when every row has that; ``None`` without
    either."""
    rows = list(rows)
    for key in ("overlap_ms_per_token", "modeled_ms_per_token"):
        if rows and all(_field(r, key) is not None for r in rows):
            return key
    return None


def figure_words(key: str) -> str:
    """How a pick's ms/token names the :func:`ranking_figure` it was ranked by."""
    return ("ms/token with the GPU's time (overlap_ms_per_token)" if key.startswith("overlap")
            else "ms/token modeled")


def with_costs(results: list, cost: CostModel | None) -> list:
    """The replay's results with the cost model's fields filled (docs/semantics.md §11): bytes,
    modeled ms per token, ``best`` and ``budget_best``; unchanged without an expert size. With
    the GPU's time (``cost.gpu``) and the link bandwidth, also ``overlap_ms_per_token``,
    ``stall_ms_per_token`` and ``prefetch_bound`` of every result that carries its
    ``call_counts`` (``None`` for a row with CPU experts and no CPU bandwidth; ``prefetch_bound``
    ``None`` on a row with CPU experts). ``best`` and ``budget_best`` rank by
    :func:`ranking_figure`: the overlapped time when every row has it."""
    if cost is None or cost.expert_bytes is None:
        return results
    width = cost.expert_bytes
    out = []
    for r in results:
        tokens = max(r.tokens, 1)
        ms = 1e3 * cost.seconds(r.pair_counts) / tokens if cost.timed else None
        out.append(dataclasses.replace(
            r, cache_bytes=r.cache_size * width,
            fetched_bytes_per_token=r.fetched * width / tokens,
            cpu_bytes_per_token=r.cpu_experts * width / tokens,
            modeled_ms_per_token=ms, **_overlap_fields(r, cost, tokens)))
    key = ranking_figure(out)
    if key is None:
        return out
    fastest = {}
    for r in out:
        fastest[r.cache_size] = min(fastest.get(r.cache_size, math.inf), getattr(r, key))
    out = [dataclasses.replace(r, best=getattr(r, key) == fastest[r.cache_size]) for r in out]
    if cost.device_budget is not None:
        fits = [getattr(r, key) for r in out if r.cache_bytes <= cost.device_budget]
        floor = min(fits, default=None)
        out = [dataclasses.replace(r, budget_best=(r.cache_bytes <= cost.device_budget
                                                   and getattr(r, key) == floor))
               for r in out]
    return out


def _overlap_fields(result, cost: CostModel, tokens: int) -> dict:
    """``overlap_ms_per_token``, ``stall_ms_per_token`` and ``prefetch_bound`` of one result
    (§11.6); ``{}`` without the GPU's time, the link bandwidth or the result's call counts."""
    if not cost.gpu or cost.link_bandwidth is None or not result.call_counts:
        return {}
    if result.cpu_experts and cost.cpu_bandwidth is None:
        return {}
    times = cost.overlap(result.call_counts)
    # On a row whose CPU computes experts, 1 - busiest/overlap measures how unevenly the calls
    # split their work between the link and the CPU, not what prefetch could save: not given.
    return dict(overlap_ms_per_token=1e3 * times.total / tokens,
                stall_ms_per_token=1e3 * times.stall / tokens,
                prefetch_bound=None if result.cpu_experts else times.prefetch_bound)
