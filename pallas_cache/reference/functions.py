"""The reference's operations as functions of a state, with the library's signatures:
``ensure(state, layer, expert_ids) -> (state, plan)``, ``reset(state) -> state``,
``stats(state) -> ReferenceStats``... so a decode loop written against ``pallas_cache`` runs on the
reference by swapping the module. Each function returns a new :class:`ReferenceCache` and leaves
its argument as it was (the methods of ``ReferenceCache`` are the same operations, in place)."""

from __future__ import annotations

import copy

import numpy as np

from .cache import ReferenceCache
from .state import Part
from .reports import layer_stats, per_layer_stats, routing_histogram, routing_skew, stats  # noqa: F401


def init(num_layers, num_experts, cache_size, *, capacity=None, rebase_threshold=None,
         eviction="lru", history=None) -> ReferenceCache:
    """A cold cache, as ``pallas_cache.init``."""
    options = {"capacity": capacity, "rebase_threshold": rebase_threshold, "history": history}
    return ReferenceCache(num_layers, num_experts, cache_size, eviction=eviction,
                          **{k: v for k, v in options.items() if v is not None})


def copy_state(state: ReferenceCache) -> ReferenceCache:
    """An independent copy of ``state`` (its arrays and eviction bookkeeping copied); anything
    but a reference state (the library's ``CacheState`` included) raises TypeError saying what
    it got."""
    if not isinstance(state, ReferenceCache):
        kind = type(state)
        library = kind.__module__.startswith("pallas_cache") and kind.__name__ == "CacheState"
        raise TypeError(
            f"state must be a reference state (pallas_cache.reference.init), got "
            + ("the library's CacheState (pallas_cache.init): the library's ops take it"
               if library else kind.__name__))
    twin = copy.copy(state)
    for name, value in vars(state).items():
        if isinstance(value, (np.ndarray, Part)):
            setattr(twin, name, copy.deepcopy(value))
    twin.eviction_state = copy.deepcopy(state.eviction_state)
    return twin


def _with_plan(method):
    def operation(state, *args, **kwargs):
        state = copy_state(state)
        return state, getattr(state, method)(*args, **kwargs)

    operation.__name__ = method
    operation.__doc__ = (f"``(state, plan)`` after ``{method}``: see "
                         f":meth:`ReferenceCache.{method}`.")
    return operation


def _state_only(method):
    def operation(state, *args, **kwargs):
        state = copy_state(state)
        getattr(state, method)(*args, **kwargs)
        return state

    operation.__name__ = method
    operation.__doc__ = f"The state after ``{method}``: see :meth:`ReferenceCache.{method}`."
    return operation


ensure = _with_plan("ensure")
ensure_hybrid = _with_plan("ensure_hybrid")
materialize_layer = _with_plan("materialize_layer")
forget_slot = _with_plan("forget_slot")
prefetch_prefill_layer = _with_plan("prefetch_prefill_layer")
resize = _with_plan("resize")
begin_prefill = _state_only("begin_prefill")
release_prefill_layer = _state_only("release_prefill_layer")
reset = _state_only("reset")
reset_stats = _state_only("reset_stats")
reset_routing = _state_only("reset_routing")
set_collect_routing = _state_only("set_collect_routing")
start_token = _state_only("start_token")
rebuild = _state_only("rebuild")


def prefill_overlap_fits(state: ReferenceCache) -> bool:
    """Whether the usable pool can lend the two prefill buffers slots ``[0, 2E)``."""
    return state.prefill_overlap_fits()
