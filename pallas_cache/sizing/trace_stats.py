"""Statistics of any routing trace: skew, reuse and lag repeats, neighbour and next-token
precision, and the per-layer LRU hit rate."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pallas_cache.host.metrics import histogram_metrics
from pallas_cache.sizing.traces import Trace

__all__ = ["TraceStatistics", "trace_statistics", "lag_repeat_probability",
           "neighbour_precision", "next_token_precision", "complete_sequences",
           "per_layer_lru_hit_rate"]


@dataclass(frozen=True, eq=False)
class TraceStatistics:
    """Routing statistics of a trace, per routed layer and in the mean over routed layers.

    Layers with no (non-padding) route are absent, not zeros, as in the cache's skew report
    (docs/semantics.md §5.10): a layer without traffic says nothing about routing.

    Attributes:
        routed_layers: int ``[R]``, the layers with at least one route, ascending.
        routes: int64 ``[R]``, non-padding routes per routed layer (duplicates counted).
        norm_entropy: float64 ``[R]``, ``-sum p ln p / ln E`` of each layer's routing histogram;
            ``0.0`` when ``E == 1``. 1.0 = perfectly flat router.
        working_set: int64 ``[R]``, distinct experts routed at least once per layer.
        reuse_rate: float64 ``[R]``, per layer the share of a call's distinct experts that the
            previous call of that layer in the same sequence also routed (route-weighted over the
            calls that have a predecessor with routes); NaN for a layer with no such call.
        mean_norm_entropy: mean of ``norm_entropy``.
        mean_reuse_rate: the same share pooled over every layer (NaN if no call has a
            predecessor).
        working_set_mean: mean of ``working_set``.
        working_set_max: max of ``working_set``.
    """

    routed_layers: np.ndarray
    routes: np.ndarray
    norm_entropy: np.ndarray
    working_set: np.ndarray
    reuse_rate: np.ndarray
    mean_norm_entropy: float
    mean_reuse_rate: float
    working_set_mean: float
    working_set_max: int


def trace_statistics(trace: Trace) -> TraceStatistics:
    """Measure popularity skew, previous-token reuse and working set of a trace.

    "Previous token" is the previous call of the same layer in the same sequence, in call order
    (for a trace with missing records that is the nearest earlier token that reached the layer).
    Reuse counts distinct experts, ignores padding, and skips calls whose own or whose
    predecessor's routes are all padding.

    Args:
        trace: any trace.

    Returns:
        The statistics (float64 throughout; this is a report).

    Raises:
        ValueError: the trace has no non-padding route at all.
    """
    histogram = trace.routing_histogram()
    routes_per_layer = histogram.sum(axis=1)
    routed_layers = np.flatnonzero(routes_per_layer)
    if routed_layers.size == 0:
        raise ValueError(f"{trace.source}: no non-padding route, nothing to measure")
    metrics = histogram_metrics(histogram[routed_layers])
    norm_entropy, working_set = metrics.norm_entropy, metrics.working_set

    reused, considered = _reuse_counts(trace)
    with np.errstate(divide="ignore", invalid="ignore"):
        reuse_rate = reused[routed_layers] / considered[routed_layers]
    total = considered.sum()
    return TraceStatistics(
        routed_layers=routed_layers,
        routes=routes_per_layer[routed_layers],
        norm_entropy=norm_entropy,
        working_set=working_set,
        reuse_rate=reuse_rate,
        mean_norm_entropy=float(norm_entropy.mean()),
        mean_reuse_rate=float(reused.sum() / total) if total else math.nan,
        working_set_mean=float(working_set.mean()),
        working_set_max=int(working_set.max()),
    )


def _reuse_counts(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Per layer: (distinct experts also routed by the predecessor call, distinct experts).

    Only calls with a predecessor (same layer, same sequence) whose routes are not all padding
    are counted.
    """
    routes = np.sort(trace.routes, axis=1)
    distinct = routes >= 0
    distinct[:, 1:] &= routes[:, 1:] != routes[:, :-1]
    # Group calls by (sequence, layer), keeping call order inside a group (stable sort).
    order = np.lexsort((trace.layers, trace.sequence))
    current, previous = order[1:], order[:-1]
    same_group = ((trace.layers[current] == trace.layers[previous])
                  & (trace.sequence[current] == trace.sequence[previous]))
    current, previous = current[same_group], previous[same_group]
    previous_has_routes = distinct[previous].any(axis=1)
    current, previous = current[previous_has_routes], previous[previous_has_routes]

    cur = np.where(distinct[current], routes[current], -2)    # -2 never matches a route
    prev = np.where(distinct[previous], routes[previous], -3)
    also_previous = (cur[:, :, None] == prev[:, None, :]).any(axis=2)
    layer_of = trace.layers[current]
    reused = np.bincount(layer_of, weights=also_previous.sum(axis=1),
                         minlength=trace.num_layers)
    considered = np.bincount(layer_of, weights=distinct[current].sum(axis=1),
                             minlength=trace.num_layers)
    return reused, considered


def lag_repeat_probability(trace: Trace, max_lag: int = 8) -> np.ndarray:
    """How often a layer routes again an expert it routed ``k`` of its calls earlier.

    For each lag ``k`` in ``1..max_lag``: over every call that has a ``k``-th previous call of
    the same layer in the same sequence (in call order) whose routes are not all padding, the
    share of the call's distinct experts that the earlier call also routed (pooled over layers:
    the sum of matches over the sum of distinct experts). On a uniform top-``K`` router with no
    memory it is ``K / E`` at every lag (0.25 on Mixtral's 2-of-8); lag 1 equals
    :func:`trace_statistics`'s ``mean_reuse_rate``.

    Args:
        trace: any trace.
        max_lag: the largest lag (``>= 1``).

    Returns:
        float64 ``[max_lag]``; entry ``k - 1`` is lag ``k`` (NaN where no call has such a
        predecessor).
    """
    if not isinstance(max_lag, (int, np.integer)) or isinstance(max_lag, bool) or max_lag < 1:
        raise ValueError(f"max_lag must be a positive integer, got {max_lag!r}")
    routes = np.sort(trace.routes, axis=1)
    distinct = routes >= 0
    distinct[:, 1:] &= routes[:, 1:] != routes[:, :-1]
    order = np.lexsort((trace.layers, trace.sequence))   # group by (sequence, layer), call order
    group = trace.sequence[order].astype(np.int64) * trace.num_layers + trace.layers[order]
    has_routes = distinct.any(axis=1)
    out = np.full(max_lag, np.nan)
    for lag in range(1, max_lag + 1):
        current, earlier = order[lag:], order[:-lag]
        keep = (group[lag:] == group[:-lag]) & has_routes[earlier]
        current, earlier = current[keep], earlier[keep]
        cur = np.where(distinct[current], routes[current], -2)    # -2 never matches a route
        prev = np.where(distinct[earlier], routes[earlier], -3)
        matched = (cur[:, :, None] == prev[:, None, :]).any(axis=2).sum()
        considered = distinct[current].sum()
        if considered:
            out[lag - 1] = matched / considered
    return out


def _pooled_precision(trace: Trace, counts, window, block: int) -> float:
    """``sum(matched) / sum(predicted)`` of ``counts(dense, E, window, block)`` over the trace's
    complete sequences (NaN when none predicts anything)."""
    if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be a positive integer, got {window!r}")
    matched = predicted = 0
    for dense in complete_sequences(trace):
        hits, size = counts(dense, trace.num_experts, window, block)
        matched, predicted = matched + hits, predicted + size
    return matched / predicted if predicted else math.nan


def neighbour_precision(trace: Trace, window: int = 128, *, block: int = 256) -> float:
    """How well the past token whose routes best match the current token's predicts the next layer.

    Per sequence, over its complete tokens ``R[t, l]`` (:func:`complete_sequences`: sets of
    distinct routed experts) and every token ``t >= 1`` and layer ``l >= 1``: among the past
    tokens ``j`` in ``[max(0, t - window), t - 1]`` of the same sequence take the one with the
    most matching routes over the layers so far, ``match(j) = sum_{m < l} |R[t, m] & R[j, m]|``,
    ties to the most recent ``j``; its precision is ``|R[j, l] & R[t, l]| / |R[j, l]|`` -- the
    share of the neighbour's layer-``l`` experts the current token routes too. The result pools
    the matches over the predictions of every sequence (``sum |R[j, l] & R[t, l]| / sum
    |R[j, l]|``). Layer 0 (no evidence yet) and a sequence's first token (no past) are not
    counted. A router with no memory scores ``K / E``.

    Args:
        trace: any trace; tokens that do not call every layer are dropped (see
            :func:`complete_sequences`).
        window: how many past tokens are candidates (``>= 1``).
        block: tokens processed at once (memory ``block * window * L``; the value is unchanged).

    Returns:
        The pooled precision (NaN when no sequence has two complete tokens, or ``L == 1``).
    """
    return _pooled_precision(trace, _neighbour_counts, window, block)


def _neighbour_counts(dense: np.ndarray, num_experts: int, window: int, block: int
                      ) -> tuple[int, int]:
    """(matched, predicted) of :func:`neighbour_precision` over one dense sequence."""
    tokens, layers, _ = dense.shape
    if tokens < 2 or layers < 2:
        return 0, 0
    masks = _route_masks(dense, num_experts)                    # [T, L, W] uint64
    sizes = np.bitwise_count(masks).sum(axis=2, dtype=np.int64)  # [T, L]
    lags = np.arange(1, window + 1)
    matched = predicted = 0
    for start in range(1, tokens, block):
        now = np.arange(start, min(start + block, tokens))
        past = now[:, None] - lags[None, :]                      # [n, window], most recent first
        valid = past >= 0
        past = np.maximum(past, 0)
        overlap = np.bitwise_count(masks[now][:, None] & masks[past]).sum(
            axis=3, dtype=np.int32)                               # [n, window, L]
        so_far = np.cumsum(overlap, axis=2) - overlap              # matches over layers < l
        so_far = np.where(valid[:, :, None], so_far, -1)
        best = np.argmax(so_far, axis=1)                           # [n, L]: first = most recent
        hits = np.take_along_axis(overlap, best[:, None, :], axis=1)[:, 0, :]
        neighbour = np.take_along_axis(past, best, axis=1)        # [n, L]
        size = sizes[neighbour, np.arange(layers)[None, :]]
        matched += int(hits[:, 1:].sum())
        predicted += int(size[:, 1:].sum())
    return matched, predicted


def next_token_precision(trace: Trace, window: int = 128, *, block: int = 256) -> float:
    """How well the successor of the past token most like the current one predicts the next token.

    Per sequence, over its ``N`` complete tokens ``R[t, l]`` (:func:`complete_sequences`: sets
    of distinct routed experts) and every token ``T`` with ``1 <= T <= N - 2``: at the end of
    ``T`` (only tokens up to ``T`` are read), take the past token ``j`` in ``[max(0, T -
    window), T - 1]`` of the same sequence with the most matching routes over *all* layers,
    ``match(j) = sum_l |R[T, l] & R[j, l]|``, ties to the most recent ``j`` (so ``j = T - 1``,
    whose successor is ``T`` itself, is a candidate). Its successor predicts the next token: the
    result pools ``sum_l |R[j + 1, l] & R[T + 1, l]|`` over ``sum_l |R[j + 1, l]|``, summed over
    the sequences. A router with no memory scores ``K / E``; always taking ``j = T - 1`` scores
    the lag-1 reuse.

    This is the statistic that decides how much a token-similarity eviction (``ROUTE_KNN``)
    gains over LRU at two slots per layer (``benchmarks/RESULTS.md``, ``preset_sensitivity``):
    measured on real Mixtral-8x7B decode traces it is 0.49-0.59 (docs/policies.md), and
    ``mixtral-realistic`` is calibrated into that range. Measure it on your own trace
    (``benchmarks/realistic_preset.py --trace PATH``) to tell which regime your traffic is in.

    Args:
        trace: any trace; tokens that do not call every layer are dropped (see
            :func:`complete_sequences`).
        window: how many past tokens are candidates (``>= 1``).
        block: tokens processed at once (memory ``block * window * L``; the value is unchanged).

    Returns:
        The pooled precision (NaN when no sequence has three complete tokens).
    """
    return _pooled_precision(trace, _next_token_counts, window, block)


def _next_token_counts(dense: np.ndarray, num_experts: int, window: int, block: int
                       ) -> tuple[int, int]:
    """(matched, predicted) of :func:`next_token_precision` over one dense sequence."""
    tokens = dense.shape[0]
    if tokens < 3:
        return 0, 0
    masks = _route_masks(dense, num_experts)              # [T, L, W] uint64
    sizes = np.bitwise_count(masks).sum(axis=(1, 2), dtype=np.int64)  # [T] routes per token
    lags = np.arange(1, window + 1)
    matched = predicted = 0
    for start in range(1, tokens - 1, block):
        now = np.arange(start, min(start + block, tokens - 1))  # T with T + 1 < N
        past = now[:, None] - lags[None, :]                      # [n, window], most recent first
        valid = past >= 0
        past = np.maximum(past, 0)
        match = np.bitwise_count(masks[now][:, None] & masks[past]).sum(
            axis=(2, 3), dtype=np.int64)                          # [n, window]
        best = past[np.arange(now.size), np.argmax(np.where(valid, match, -1), axis=1)]
        matched += int(np.bitwise_count(masks[best + 1] & masks[now + 1]).sum(dtype=np.int64))
        predicted += int(sizes[best + 1].sum())
    return matched, predicted


def _route_masks(dense: np.ndarray, num_experts: int) -> np.ndarray:
    """``[T, L, K]`` routes (-1 = padding) -> ``[T, L, ceil(E / 64)]`` uint64 expert bitmasks."""
    words = -(-num_experts // 64)
    tokens, layers, _ = dense.shape
    masks = np.zeros((tokens, layers, words), dtype=np.uint64)
    for k in range(dense.shape[2]):
        expert = dense[:, :, k].astype(np.int64)
        routed = expert >= 0
        safe = np.where(routed, expert, 0)
        bit = np.where(routed, np.left_shift(np.uint64(1), (safe % 64).astype(np.uint64)),
                       np.uint64(0))
        for word in range(words):
            masks[:, :, word] |= np.where(safe // 64 == word, bit, np.uint64(0))
    return masks


def complete_sequences(trace: Trace) -> list[np.ndarray]:
    """Each sequence's complete tokens as one dense ``[tokens, layers, top_k]`` array.

    A token (a ``(sequence, token_idx)`` pair) is *complete* when its calls, in call order, are
    layers ``0..L-1`` once each; other tokens are dropped -- typically a request's last tokens
    in a JSONL trace, which stop before the last layers. A sequence's complete tokens keep
    ascending ``token_idx`` order, so a dropped token's neighbours become adjacent. A dense
    trace gives ``[trace.to_dense()]``.

    Args:
        trace: any trace.

    Returns:
        One int32 array per sequence with at least one complete token, in sequence order.
    """
    layers = trace.num_layers
    pairs = np.stack([trace.sequence.astype(np.int64), trace.token_idx], axis=1)
    _, token_of = np.unique(pairs, axis=0, return_inverse=True)  # sorted by (sequence, token_idx)
    token_of = token_of.reshape(-1)
    order = np.argsort(token_of, kind="stable")                  # by token, call order inside
    counts = np.bincount(token_of)
    starts = np.cumsum(counts) - counts
    position = np.arange(trace.num_calls) - np.repeat(starts, counts)
    out_of_place = np.bincount(token_of[order], weights=trace.layers[order] != position,
                               minlength=counts.size)
    complete = (counts == layers) & (out_of_place == 0)
    keep = complete[token_of[order]]
    calls = order[keep]                                          # complete tokens' calls, layer order
    routes = trace.routes[calls].reshape(-1, layers, trace.top_k)
    sequence_of = trace.sequence[calls[::layers]]
    bounds = np.flatnonzero(np.diff(sequence_of)) + 1
    return [np.ascontiguousarray(part) for part in np.split(routes, bounds) if part.size]


def per_layer_lru_hit_rate(trace: Trace, cache_size: int) -> float:
    """Hit rate of per-layer LRU with ``cache_size // L`` slots per layer over ``trace``.

    Per-layer LRU is the policy of mixtral-offloading: each of the ``L`` layers owns ``S / L``
    slots and keeps the most recently used experts of that layer in them. A call to layer ``l``
    with distinct experts ``D`` hits the experts of ``D`` that are resident; then every expert
    of ``D`` becomes resident with last use = this call, and while the layer holds more than its
    ``S / L`` slots it evicts its least recently used resident, ties (experts of one earlier
    call) to the lowest expert id. Counting matches the cache's stats: distinct experts per
    call, ``-1`` padding ignored. Like the replay, it runs over every call of the trace in call
    order with one cache: a new sequence starts with the previous one's residents, and a token
    that misses some layers simply does not touch them (every call is counted).

    Vectorised over layers: step ``i`` plays the ``i``-th call of every layer.

    Raises:
        ValueError: ``cache_size // L`` is below the trace's ``top_k`` (a call would evict its
            own experts).
    """
    layers, experts = trace.num_layers, trace.num_experts
    per_layer = cache_size // layers
    if per_layer < trace.top_k:
        raise ValueError(f"cache_size {cache_size} gives {per_layer} slots per layer for "
                         f"{layers} layers, fewer than top_k={trace.top_k}")
    order = np.argsort(trace.layers, kind="stable")              # by layer, call order inside
    counts = np.bincount(trace.layers, minlength=layers)
    rank = np.arange(trace.num_calls) - np.repeat(np.cumsum(counts) - counts, counts)
    schedule = np.full((int(counts.max()), layers), -1, dtype=np.int64)  # [step, L] call index
    schedule[rank, trace.layers[order]] = order
    rows = np.arange(layers)[:, None]
    # key = last use * E + expert for residents, -1 otherwise: the largest `per_layer` keys stay
    # (a later use wins; among one call's experts the higher id stays, the lower is evicted).
    key = np.full((layers, experts), -1, dtype=np.int64)
    hits = active = 0
    expert_ids = np.arange(experts, dtype=np.int64)[None, :]
    for call in schedule:
        route = np.where(call[:, None] >= 0, trace.routes[np.maximum(call, 0)], -1)
        routed = route >= 0
        safe = np.where(routed, route, 0)
        used = np.zeros((layers, experts), dtype=bool)
        used[np.broadcast_to(rows, route.shape)[routed], safe[routed]] = True
        hits += int(((key >= 0) & used).sum())
        active += int(used.sum())
        key = np.where(used, call[:, None] * experts + expert_ids, key)
        if per_layer < experts:
            kth = np.partition(key, experts - per_layer, axis=1)[:, experts - per_layer]
            key = np.where(key >= kth[:, None], key, -1)
    return hits / active if active else 1.0
