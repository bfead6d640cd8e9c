"""The reference cache's state: geometry, the two maps, the clock, counters and prefill bookkeeping.

:class:`ReferenceState` holds the fields of the JAX ``CacheState`` as mutable int64 NumPy arrays
and implements construction, cold starts (``reset``, ``rebuild``, docs/semantics.md §5.1, §5.8)
and the clock tick (§5.12). The operations live in their own modules, as in ``pallas_cache``
(:mod:`.ops`, :mod:`.prefill`, :mod:`.reports`), and are assembled
into ``ReferenceCache`` by :mod:`.cache`.
"""

from __future__ import annotations

import numbers

import numpy as np

from dataclasses import dataclass

from .clock import dense_rank_stamps
from .errors import ERR_CACHE_SIZE, int_arg
from .evictions import check_eviction

#: ``usage`` of a slot dropped by ``forget_slot``: older than anything, so it is the first victim.
FORGOTTEN = -(2**31)
#: Default clock value at which the stamps are renumbered (docs/semantics.md §5.12).
DEFAULT_REBASE_THRESHOLD = 2**30
#: Default token ring of the route_knn eviction (docs/semantics.md §5.16).
DEFAULT_HISTORY = 128


# The state's parts: the library's (pallas_cache/state.py), same names, mutable, int64.


class Part:
    """The base of the state's parts: a copy of the state copies each part (``copy_state``)."""


@dataclass
class Residency(Part):
    """``slot_for_id [L, E]``, ``id_of_slot [C]``, ``usage [C]``."""

    slot_for_id: np.ndarray
    id_of_slot: np.ndarray
    usage: np.ndarray


@dataclass
class Clock(Part):
    """``step``, the clock."""

    step: int = 0


@dataclass
class Routing(Part):
    """``recency [L, E]`` (-1 = never), ``freq [L, E]`` (the routing histogram)."""

    recency: np.ndarray
    freq: np.ndarray


@dataclass
class Prefill(Part):
    """The prefill bookkeeping: ``layer [2]`` (-1 = none), ``released [2]``, ``open``,
    ``snapshot [L, E]``, ``hit_rows``, ``rows``."""

    layer: np.ndarray
    released: np.ndarray
    open: bool
    snapshot: np.ndarray
    hit_rows: int
    rows: int


@dataclass
class Settings(Part):
    """``cache_size`` (the usable size ``S``), ``rebase_threshold``, ``collect_routing``."""

    cache_size: int
    rebase_threshold: int
    collect_routing: bool = False


class RebuildRejected(ValueError):
    """A pool resize the cache refused, having changed nothing."""

    def __init__(self, requested: int, minimum: int):
        self.requested = requested
        self.minimum = minimum
        super().__init__(
            f"expert cache of {requested} slots cannot hold one layer of {minimum} experts"
        )


@dataclass
class ResizePlan:
    """What ``resize`` freed: the slots at or past the new size, ascending, with the flat id each
    held (-1 = empty); -1 padded to the capacity."""

    freed_slots: np.ndarray  # [C]
    freed_ids: np.ndarray  # [C]
    count: int = 0
    error: int = 0


class ReferenceState:
    """The expert slot cache's state as a mutable object over int64 NumPy arrays.

    Its parts are the library's ``CacheState`` fields, same names, same nesting (int64 arrays,
    Python ints for the scalars): ``residency`` (:class:`Residency`, ``C`` = ``capacity``; slots
    at or past ``settings.cache_size`` always hold -1 with usage 0, docs/semantics.md §5.15),
    ``clock``, ``routing``, ``stats [L, 4]`` (calls, active, missing, fetched), ``prefill``,
    ``settings``; ``eviction`` (the policy's record, :mod:`.evictions`) and ``eviction_state``
    (its bookkeeping under the library record's field names: ``PairLfuState``,
    ``TokenRingState``; None for lru). ``step`` and ``cache_size`` read (and here, write) the
    clock's and the settings' fields, as the library's read-only properties read them.
    """

    def __init__(self, num_layers, num_experts, cache_size, rebase_threshold=DEFAULT_REBASE_THRESHOLD,
                 capacity=None, eviction="lru", history=DEFAULT_HISTORY):
        num_layers = int_arg(num_layers, "num_layers")
        num_experts = int_arg(num_experts, "num_experts")
        cache_size = int_arg(cache_size, "cache_size")
        capacity = cache_size if capacity is None else int_arg(capacity, "capacity")
        if num_layers < 1 or num_experts < 1:
            raise ValueError(
                f"a MoE model has layers and experts, got num_layers={num_layers}, "
                f"num_experts={num_experts}"
            )
        if cache_size < num_experts:
            raise ValueError(
                f"cache_size {cache_size} cannot hold one layer of {num_experts} experts"
            )
        if capacity < cache_size:
            raise ValueError(f"capacity {capacity} is below cache_size {cache_size}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.settings = Settings(cache_size=cache_size,
                                 rebase_threshold=int_arg(rebase_threshold, "rebase_threshold"))
        self.eviction = check_eviction(eviction)  # a record, fixed for the cache's life, like its geometry
        self.history = int_arg(history, "history")
        if self.history < 1:
            raise ValueError(f"history must be >= 1, got {self.history}")
        self.settings.collect_routing = False
        self._clear(cache_size, capacity)

    @property
    def step(self) -> int:
        return self.clock.step

    @step.setter
    def step(self, value: int) -> None:
        self.clock.step = value

    @property
    def cache_size(self) -> int:
        return self.settings.cache_size

    @cache_size.setter
    def cache_size(self, value: int) -> None:
        self.settings.cache_size = value

    # ---- construction and cold starts ------------------------------------------------------

    def _clear(self, cache_size, capacity):
        """A cold cache of ``capacity`` slots, the first ``cache_size`` usable: everything but
        geometry and the routing flag."""
        L, E = self.num_layers, self.num_experts
        self.cache_size = cache_size
        self.capacity = capacity
        self.residency = Residency(slot_for_id=np.full((L, E), -1, np.int64),
                                   id_of_slot=np.full(capacity, -1, np.int64),
                                   usage=np.zeros(capacity, np.int64))
        self.clock = Clock(step=0)
        self.routing = Routing(recency=np.full((L, E), -1, np.int64),
                               freq=np.zeros((L, E), np.int64))
        self.stats = np.zeros((L, 4), np.int64)
        self.prefill = Prefill(layer=np.full(2, -1, np.int64), released=np.ones(2, bool),
                               open=False, snapshot=np.full((L, E), -1, np.int64), hit_rows=0,
                               rows=0)
        # The eviction policy's bookkeeping (docs/semantics.md §5.16).
        self.eviction_state = self.eviction.init(L, E, self.history)

    def reset(self):
        """A cold start: residency, clock, recency, counters, histogram and prefill all cleared.

        The counters go too: carried across a cold start they would skew every per-call rate.
        The capacity and the usable size are geometry, and stay.
        """
        self._clear(self.cache_size, self.capacity)

    def rebuild(self, cache_size, capacity=None):
        """A new allocation, dropping everything resident (slot ids no longer mean anything).

        As ``__init__``: the capacity defaults to the new ``cache_size`` (the old one is not
        kept). A target below ``E`` is refused with ``RebuildRejected`` *before* anything
        changes, so the caller keeps serving from the old cache.
        """
        cache_size = int_arg(cache_size, "cache_size")
        if cache_size < self.num_experts:
            raise RebuildRejected(requested=cache_size, minimum=self.num_experts)
        capacity = cache_size if capacity is None else int_arg(capacity, "capacity")
        if capacity < cache_size:
            raise ValueError(f"capacity {capacity} is below cache_size {cache_size}")
        self._clear(cache_size, capacity)

    def resize(self, cache_size) -> "ResizePlan":
        """Change the usable size within the capacity (docs/semantics.md §5.15).

        Growing adds empty usable slots. Shrinking frees the slots at or past the new size: their
        experts lose residency (the caller may release those device buffers, which the plan
        lists). Refused (``ERR_CACHE_SIZE``, nothing changes) outside ``[E, capacity]``, and when
        a shrink below ``2E`` would take slots from the prefill buffer at ``[E, 2E)`` while it
        holds a layer that was not released (a running multiply still reads it). An accepted
        shrink below ``2E`` ends that buffer: its record is cleared, since its slots are gone.
        The eviction policy's bookkeeping is per expert and per token, so it is kept (the last
        use of a freed slot is its usage, reset here; docs/semantics.md §5.16).
        """
        new_size = int_arg(cache_size, "cache_size")
        E, C = self.num_experts, self.capacity
        plan = ResizePlan(freed_slots=np.full(C, -1, np.int64), freed_ids=np.full(C, -1, np.int64))
        buffer_busy = self.prefill.layer[1] >= 0 and not self.prefill.released[1]
        if not E <= new_size <= C or (new_size < 2 * E and buffer_busy):
            plan.error = ERR_CACHE_SIZE
            return plan
        for slot in range(new_size, self.cache_size):
            old = int(self.residency.id_of_slot[slot])
            if old >= 0:
                self.residency.slot_for_id[old // E, old % E] = -1
            self.residency.id_of_slot[slot] = -1
            self.residency.usage[slot] = 0  # an unusable slot is as never filled
            plan.freed_slots[plan.count] = slot
            plan.freed_ids[plan.count] = old
            plan.count += 1
        if new_size < 2 * E:
            self.prefill.layer[1] = -1
            self.prefill.released[1] = True
        self.cache_size = new_size
        return plan

    # ---- helpers shared by the operations ----------------------------------------------------

    def _routes(self, expert_ids) -> np.ndarray:
        """The routes as an object array of Python ints: exact for every integer dtype.

        No cast can wrap a wide id (``2**32 + 3``, uint64 max) into a valid one or into padding:
        the range check of docs/semantics.md §6 sees the value the caller wrote.
        """
        # A list is read as Python objects: NumPy would turn [3, 2**63] into floats.
        routes = np.asarray(expert_ids, dtype=None if hasattr(expert_ids, "dtype") else object)
        if routes.size == 0:
            return np.zeros(routes.shape, np.int64)
        if routes.dtype == bool or not (np.issubdtype(routes.dtype, np.integer)
                                        or routes.dtype == object):
            raise TypeError(f"expert_ids must be integers, got dtype {routes.dtype}")
        for v in routes.ravel():
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
                raise TypeError(f"expert_ids must be integers, got {v!r} ({type(v).__name__})")
        return np.array([int(v) for v in routes.ravel()], dtype=object).reshape(routes.shape)

    def _layer_ok(self, layer) -> bool:
        return 0 <= layer < self.num_layers

    def _tick(self) -> int:
        """Advance the clock, renumbering the stamps first if it reached the threshold."""
        if self.step >= self.settings.rebase_threshold:
            self.residency.usage, self.routing.recency, self.step = dense_rank_stamps(
                self.residency.usage, self.routing.recency, self.step)
        self.step += 1
        return self.step
