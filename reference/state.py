"""The reference cache's state: geometry, the two maps, the clock, counters and prefill bookkeeping.

:class:`ReferenceState` holds the fields of the JAX ``CacheState`` as mutable int64 NumPy arrays
and implements construction, cold starts (``reset``, ``rebuild``, docs/semantics.md §5.1, §5.8)
and the clock tick (§5.12). The operations live in their own modules, as in ``pallas_cache``
(:mod:`reference.ops`, :mod:`reference.prefill`, :mod:`reference.reports`), and are assembled
into ``ReferenceCache`` by :mod:`reference.cache`.
"""

from __future__ import annotations

import numbers

import numpy as np

from .clock import dense_rank_stamps
from .errors import int_arg
from .eviction import check_eviction, cold_bookkeeping

#: ``usage`` of a slot dropped by ``forget_slot``: older than anything, so it is the first victim.
FORGOTTEN = -(2**31)
#: Default clock value at which the stamps are renumbered (docs/semantics.md §5.12).
DEFAULT_REBASE_THRESHOLD = 2**30
#: Default token ring of the route_knn eviction (docs/semantics.md §5.15).
DEFAULT_HISTORY = 128


class RebuildRejected(ValueError):
    """A pool resize the cache refused, having changed nothing."""

    def __init__(self, requested: int, minimum: int):
        self.requested = requested
        self.minimum = minimum
        super().__init__(
            f"expert cache of {requested} slots cannot hold one layer of {minimum} experts"
        )


class ReferenceState:
    """The expert slot cache's state as a mutable object over int64 NumPy arrays.

    Attributes mirror the JAX ``CacheState`` fields: ``slot_for_id [L, E]``, ``id_of_slot [S]``,
    ``usage [S]``, ``step``, ``recency [L, E]``, ``stats_table [L, 4]`` (calls, active, missing,
    fetched), ``routing_freq [L, E]``, ``collect_routing``, and the prefill bookkeeping
    ``prefill_layer [2]`` (-1 = none), ``prefill_released [2]``, ``prefill_open``,
    ``prefill_snapshot [L, E]``, ``prefill_hit_rows``, ``prefill_rows``; ``eviction`` (the
    policy's name) and, for ``pair_lfu``, ``freq [L, E]`` and ``prot [L, E]``.
    """

    def __init__(self, num_layers, num_experts, cache_size, rebase_threshold=DEFAULT_REBASE_THRESHOLD,
                 eviction="lru", history=DEFAULT_HISTORY):
        num_layers = int_arg(num_layers, "num_layers")
        num_experts = int_arg(num_experts, "num_experts")
        cache_size = int_arg(cache_size, "cache_size")
        if num_layers < 1 or num_experts < 1:
            raise ValueError(
                f"a MoE model has layers and experts, got num_layers={num_layers}, "
                f"num_experts={num_experts}"
            )
        if cache_size < num_experts:
            raise ValueError(
                f"cache_size {cache_size} cannot hold one layer of {num_experts} experts"
            )
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.cache_size = cache_size
        self.rebase_threshold = int_arg(rebase_threshold, "rebase_threshold")
        self.eviction = check_eviction(eviction)  # fixed for the cache's life, like its geometry
        self.history = int_arg(history, "history")
        if self.history < 1:
            raise ValueError(f"history must be >= 1, got {self.history}")
        self.collect_routing = False
        self._clear(cache_size)

    # ---- construction and cold starts ------------------------------------------------------

    def _clear(self, cache_size):
        """A cold cache of ``cache_size`` slots: everything but geometry and the routing flag."""
        L, E = self.num_layers, self.num_experts
        self.cache_size = cache_size
        self.slot_for_id = np.full((L, E), -1, np.int64)
        self.id_of_slot = np.full(cache_size, -1, np.int64)
        self.usage = np.zeros(cache_size, np.int64)
        self.step = 0
        self.recency = np.full((L, E), -1, np.int64)
        self.stats_table = np.zeros((L, 4), np.int64)
        self.routing_freq = np.zeros((L, E), np.int64)
        self.prefill_layer = np.full(2, -1, np.int64)
        self.prefill_released = np.ones(2, bool)
        self.prefill_open = False
        self.prefill_snapshot = np.full((L, E), -1, np.int64)
        self.prefill_hit_rows = 0
        self.prefill_rows = 0
        cold_bookkeeping(self)  # the eviction policy's fields (docs/semantics.md §5.15)

    def reset(self):
        """A cold start: residency, clock, recency, counters, histogram and prefill all cleared.

        The counters go too: carried across a cold start they would skew every per-call rate.
        """
        self._clear(self.cache_size)

    def rebuild(self, cache_size):
        """Resize the pool, dropping everything resident (slot ids no longer mean anything).

        A target below ``E`` is refused with ``RebuildRejected`` *before* anything changes, so the
        caller keeps serving from the old cache.
        """
        cache_size = int_arg(cache_size, "cache_size")
        if cache_size < self.num_experts:
            raise RebuildRejected(requested=cache_size, minimum=self.num_experts)
        self._clear(cache_size)

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
        if self.step >= self.rebase_threshold:
            self.usage, self.recency, self.step = dense_rank_stamps(
                self.usage, self.recency, self.step)
        self.step += 1
        return self.step
