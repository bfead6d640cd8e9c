"""The sweep's records: one cache configuration (:class:`ReplayConfig`) and the grids of them,
the buckets of sizes that share a compiled program, and what one configuration did
(:class:`ReplayResult`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

from pallas_cache.evictions import Eviction, check_admission
from pallas_cache.policy import Admission, FetchOrder, FetchPolicy
from pallas_cache.validate import is_int

__all__ = ["DEFAULT_BUCKET_RATIO", "ReplayConfig", "ReplayResult", "auto_cache_sizes",
           "capacity_buckets", "config_grid", "parse_policy"]

#: A bucket's largest size is at most this factor above its smallest (see capacity_buckets).
DEFAULT_BUCKET_RATIO = 8.0


def parse_policy(text: str) -> FetchPolicy:
    """``"full"``, ``"fraction:Q"`` or ``"cap:N"`` -> :class:`FetchPolicy` (raises ValueError)."""
    kind, _, value = str(text).partition(":")
    try:
        if kind == "full" and not value:
            return FetchPolicy.full()
        if kind == "fraction" and value:
            return FetchPolicy.fraction(float(value))
        if kind == "cap" and value:
            return FetchPolicy.fixed_cap(int(value))
    except (TypeError, ValueError) as error:
        raise ValueError(f"bad policy {text!r}: {error}") from None
    raise ValueError(f"bad policy {text!r}: expected full, fraction:Q (0 <= Q <= 1) or cap:N")


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """One cache configuration of a sweep.

    Attributes:
      cache_size: ``S``, device slots shared by all layers (``>= E``).
      policy: ``"full"``, ``"fraction:Q"`` or ``"cap:N"`` (see :func:`parse_policy`).
      order: ``"recency"`` or ``"lowest_id"``.
      admission: ``"promote_one"``, ``"none"`` or ``"reuse"``.
      eviction: ``"lru"``, ``"pair_lfu"``, ``"route_knn"`` or ``"route_lfu"`` (docs/semantics.md
        §5.16, the default ring of 128 tokens); ``reuse`` needs ``lru``.
    """

    cache_size: int
    policy: str = "fraction:0.4"
    order: str = "recency"
    admission: str = "promote_one"
    eviction: str = "lru"

    def __post_init__(self):
        parse_policy(self.policy)
        FetchOrder.coerce(self.order)
        check_admission(Eviction.coerce(self.eviction).policy,
                        Admission.coerce(self.admission) is Admission.REUSE)
        if not is_int(self.cache_size):
            raise TypeError(f"cache_size must be an int, got {self.cache_size!r}")


def config_grid(cache_sizes: Iterable[int], policies: Iterable[str], orders: Iterable[str] = ("recency",),
                admissions: Iterable[str] = ("promote_one",),
                evictions: Iterable[str] = ("lru",)) -> list[ReplayConfig]:
    """The cartesian product, cache size slowest, as a list of configurations. An eviction
    whose record refuses ``reuse`` is not combined with it (docs/semantics.md §5.16)."""
    return [
        ReplayConfig(int(size), policy, order, admission, eviction)
        for size in cache_sizes for eviction in evictions for policy in policies
        for order in orders for admission in admissions
        if Eviction.coerce(eviction).policy.allows_reuse
        or Admission.coerce(admission) is not Admission.REUSE
    ]


def auto_cache_sizes(num_layers: int, num_experts: int, top_k: int) -> list[int]:
    """The ``--cache-size auto`` grid (docs/semantics.md §11.3): from ``max(E, L*k)`` up to ``L*E``
    in steps of x sqrt(2), each rounded half up to whole slots, plus ``L*E`` itself.

    ``L*k`` bounds one token's working set (``k = min(top_k, E)``); below it global LRU thrashes
    on the cyclic layer sweep, so the grid starts there.
    """
    total = num_layers * num_experts
    start = max(num_experts, num_layers * min(top_k, num_experts))
    sizes, step = [], 0
    while True:
        size = math.floor(start * math.sqrt(2) ** step + 0.5)
        if size >= total:
            break
        if not sizes or size > sizes[-1]:
            sizes.append(size)
        step += 1
    return sizes + [total]


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """What one configuration did over the whole trace.

    Attributes:
      calls: layer-calls replayed. routes: non-padding routes (duplicates counted).
      active / missing / fetched: the cache's counters (distinct experts per call).
      cpu_routes: routes the CPU computed (hybrid misses not fetched; duplicates counted).
      empty_slots: slots never filled (or emptied) at the end of the trace.
      hit_rate: ``1 - missing / active``. belady_hit_rate: the offline optimum at this size when
        every miss is admitted (bounds ``full`` rows only: a hybrid row may beat it).
      bypass_optimum_hit_rate: the offline optimum when a miss may be served without being
        admitted (bounds every row).
      oracle_hit_rate: the stationary per-layer oracle at this size (mean over routed layers; it
        grants every layer at least one slot, so below ``S = L`` it uses more than ``S``).
      tokens: decode tokens of the trace (distinct (sequence, token) pairs).
      cpu_experts: distinct experts the CPU computed, summed over calls (``missing - fetched``).
      fetched_per_token / cpu_experts_per_token: ``fetched / tokens``, ``cpu_experts / tokens``.
      pair_counts: ``(fetched, cpu_experts, calls)`` for every per-call pair that occurred:
        exact, and enough to model any bandwidths (docs/semantics.md §11.2).
      cache_bytes: ``S * W`` (``None`` without ``W``; likewise the per-token bytes).
      fetched_bytes_per_token / cpu_bytes_per_token: ``fetched * W / tokens``,
        ``cpu_experts * W / tokens``.
      modeled_ms_per_token: docs/semantics.md §11.2's time (``None`` without both bandwidths).
      best: the lowest ms/token among the rows of its cache size (ties all true; ``None`` when
        untimed), by ``overlap_ms_per_token`` when every row has it, else by
        ``modeled_ms_per_token`` (:func:`~pallas_cache.sizing.sweep.cost.ranking_figure`).
      budget_best: the lowest ms/token by the same figure among all rows whose ``cache_bytes``
        fits the device budget (``None`` without a budget).
      note: why the row is flagged (semicolon-separated), else empty.
      call_counts: ``(hits, fetched, cpu_experts, calls)`` for every per-call triple that
        occurred, exact; only from a replay asked for them (``hit_counts``, or a cost model with
        the GPU's time), else empty: what the event rules time (docs/semantics.md §11.6).
      overlap_ms_per_token: the event rules' time per token (``None`` without the GPU's time).
      stall_ms_per_token: ``overlap_ms_per_token`` minus the device's own work per token.
      prefetch_bound: ``1 - max(gpu_busy, link_busy, cpu_busy) / overlap``: the most any
        prefetch that moves the same bytes could save, as a fraction; ``None`` on a row with
        CPU experts (there it measures how unevenly the link and the CPU share the calls' work).
      layer_stats: each layer's counters at the end of the trace
        (:func:`pallas_cache.per_layer_stats` of the configuration's final state), indexed by
        layer; only from a replay asked for them (``per_layer``), else empty. Not a record key:
        the records (JSON, CSV) keep their fields.
    """

    cache_size: int
    policy: str
    order: str
    admission: str
    calls: int
    routes: int
    active: int
    missing: int
    fetched: int
    cpu_routes: int
    empty_slots: int
    hit_rate: float
    belady_hit_rate: float | None
    bypass_optimum_hit_rate: float | None
    oracle_hit_rate: float | None
    tokens: int = 0
    cpu_experts: int = 0
    fetched_per_token: float = 0.0
    cpu_experts_per_token: float = 0.0
    pair_counts: tuple = ()
    cache_bytes: int | None = None
    fetched_bytes_per_token: float | None = None
    cpu_bytes_per_token: float | None = None
    modeled_ms_per_token: float | None = None
    best: bool | None = None
    budget_best: bool | None = None
    note: str = ""
    eviction: str = "lru"
    call_counts: tuple = ()
    overlap_ms_per_token: float | None = None
    stall_ms_per_token: float | None = None
    prefetch_bound: float | None = None
    layer_stats: tuple = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def capacity_buckets(sizes: Sequence[int], ratio: float = DEFAULT_BUCKET_RATIO) -> list[list[int]]:
    """The ascending ``sizes`` cut into buckets that each run as one compiled program at the
    capacity of their largest size: a bucket starts at its smallest size and takes every next
    size up to ``ratio`` times it. A lane pays for the whole capacity (the victim search reads
    every slot, masked), but that part of its step grows slowly (the two-level search) beside
    the step's fixed per-call costs: measured on the 48 x 128 geometry, a 256-slot lane costs
    about the same in a 2048-slot program as in its own, so the default ratio 8 runs a
    256/1024/2048 sweep as one program and saves a compile (benchmarks/RESULTS.md, sweep_2m);
    past it a bucket still bounds the waste at the cost of one compile (docs/design.md)."""
    buckets: list[list[int]] = []
    for size in sorted(set(sizes)):
        if buckets and size <= ratio * buckets[-1][0]:
            buckets[-1].append(size)
        else:
            buckets.append([size])
    return buckets
