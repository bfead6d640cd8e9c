"""Baseline cache simulators that are not library options: per-layer LRU.

Per-layer LRU is the policy of mixtral-offloading: each of the ``L`` layers owns ``S / L`` slots
and keeps the most recently used experts of that layer in them. A call to layer ``l`` with
distinct experts ``D`` hits the experts of ``D`` that are resident; then every expert of ``D``
becomes resident with last use = this call, and while the layer holds more than its ``S / L``
slots it evicts its least recently used resident, ties (experts of one earlier call) to the
lowest expert id. ``S / L >= |D|`` is required, so a call never evicts its own experts. Counting
matches the cache's stats: distinct experts per call, ``-1`` padding ignored.
"""

from __future__ import annotations

import numpy as np

from pallas_cache.sizing.traces import Trace


def per_layer_lru_hit_rate(trace: Trace, cache_size: int) -> float:
    """Hit rate of per-layer LRU with ``cache_size // L`` slots per layer over ``trace``.

    Vectorised over layers, one step per token: the trace must be dense (every token calls
    layers ``0..L-1`` in order), so each step touches each layer once.

    Raises:
        ValueError: ``cache_size // L`` is below the trace's ``top_k``.
        TraceError: the trace is not dense.
    """
    dense = trace.to_dense()
    layers, experts = trace.num_layers, trace.num_experts
    per_layer = cache_size // layers
    if per_layer < trace.top_k:
        raise ValueError(f"cache_size {cache_size} gives {per_layer} slots per layer for "
                         f"{layers} layers, fewer than top_k={trace.top_k}")
    rows = np.arange(layers)[:, None]
    # key = last use * E + expert for residents, -1 otherwise: the largest `per_layer` keys stay
    # (a later use wins; among one call's experts the higher id stays, the lower is evicted).
    key = np.full((layers, experts), -1, dtype=np.int64)
    hits = active = 0
    expert_ids = np.arange(experts, dtype=np.int64)[None, :]
    for token in range(dense.shape[0]):
        route = dense[token]
        routed = route >= 0
        safe = np.where(routed, route, 0)
        used = np.zeros((layers, experts), dtype=bool)
        used[np.broadcast_to(rows, route.shape)[routed], safe[routed]] = True
        hits += int(((key >= 0) & used).sum())
        active += int(used.sum())
        key = np.where(used, token * experts + expert_ids, key)
        if per_layer < experts:
            kth = np.partition(key, experts - per_layer, axis=1)[:, experts - per_layer]
            key = np.where(key >= kth[:, None], key, -1)
    return hits / active if active else 1.0


def per_layer_lru_hit_rate_brute(trace: Trace, cache_size: int) -> float:
    """The same policy, one call at a time with plain lists (the check for the fast one)."""
    per_layer = cache_size // trace.num_layers
    resident: dict[int, list[tuple[int, int]]] = {l: [] for l in range(trace.num_layers)}
    hits = active = 0
    for call, (layer, route) in enumerate(trace):
        wanted = sorted({int(e) for e in route if e >= 0})
        held = {e for _, e in resident[int(layer)]}
        hits += sum(e in held for e in wanted)
        active += len(wanted)
        entries = [(use, e) for use, e in resident[int(layer)] if e not in wanted]
        entries += [(call, e) for e in wanted]
        entries.sort()                                 # oldest first, then lowest id
        resident[int(layer)] = entries[max(0, len(entries) - per_layer):]
    return hits / active if active else 1.0
