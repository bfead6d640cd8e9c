"""The counters' state edits, pure and jittable: open a stats window, switch or clear the
routing histogram, and read one layer's histogram row (docs/semantics.md §5.9, 5.10)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_cache import validate
from pallas_cache.state import CacheState, check_state
from pallas_cache.hints import IndexLike

__all__ = ["checked_layer", "reset_routing", "reset_stats", "routing_histogram",
           "set_collect_routing"]


def checked_layer(state: CacheState, layer) -> int:
    """``layer`` as a Python int in ``[0, L)``; ValueError names it and the range."""
    layer = validate.as_host_int("layer", layer)
    if not 0 <= layer < state.num_layers:
        raise ValueError(f"layer {layer} is outside a model of {state.num_layers} layers")
    return layer


def reset_stats(state: CacheState) -> CacheState:
    """Open a new window: counters and prefill row counters zeroed; residency and the routing
    histogram kept (the histogram estimates a distribution; a scrape must not destroy it).

    Writes ``stats``, ``prefill.hit_rows`` and ``prefill.rows``.
    """
    check_state(state)
    return state.replace(
        stats=jnp.zeros_like(state.stats),
        prefill=state.prefill.replace(hit_rows=jnp.zeros_like(state.prefill.hit_rows),
                                      rows=jnp.zeros_like(state.prefill.rows)),
    )


def set_collect_routing(state: CacheState, on: bool | jax.Array) -> CacheState:
    """Turn routing-histogram collection on or off (``on`` may be traced). Off by default: a
    histogram is only meaningful over a long stationary window.

    Writes ``settings.collect_routing``.
    """
    check_state(state)
    if not isinstance(on, (bool, np.bool_)) and not (
        hasattr(on, "dtype") and np.shape(on) == () and jnp.issubdtype(on.dtype, jnp.bool_)
    ):
        raise TypeError(f"set_collect_routing takes a bool, got {on!r}")
    return state.replace(
        settings=state.settings.replace(collect_routing=jnp.asarray(on, jnp.bool_)))


def routing_histogram(state: CacheState, layer: IndexLike) -> jax.Array:
    """int32[E]: how often each expert of ``layer`` was routed to, duplicates counted.

    Jittable. A Python int layer is range-checked (ValueError); a traced one is clamped into
    range, since a report cannot carry an error bit."""
    check_state(state)
    if validate.is_int(layer):
        layer = checked_layer(state, layer)
    return state.routing.freq[jnp.clip(layer, 0, state.num_layers - 1)]


def reset_routing(state: CacheState) -> CacheState:
    """Throw the observed routing distribution away (collection setting unchanged).

    Writes ``routing.freq``.
    """
    check_state(state)
    return state.replace(routing=state.routing.replace(freq=jnp.zeros_like(state.routing.freq)))
