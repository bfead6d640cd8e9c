"""Batched decode as a trace: ``B`` requests decoding together, continuous batching
(docs/replay.md, "Batched decode").

:func:`batched_trace` turns a trace of single-token calls into the calls a batched decode
makes: at each step every active request contributes its next token, and each layer gets one
call whose routes are those tokens' routes side by side (``B * k`` columns, ``-1`` padded), so
a merged call reads each distinct expert once (the cache counts distinct experts per call). A
request that has produced its last token leaves after the step, and the next request of the
trace takes its place at the next step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_cache.sizing.traces import Trace

__all__ = ["Batched", "batched_records", "batched_trace", "split_requests"]


@dataclasses.dataclass(frozen=True)
class Batched:
    """A batched decode's trace and what it counts.

    Attributes:
      trace: the merged calls: one "token" per step (``sequence`` 0, ``token_idx`` the step),
        ``B * k`` route columns.
      batch: ``B``, requests decoding together.
      requests: requests of the source trace (its sequences).
      generated: tokens the requests generate (the source trace's tokens).
      steps: decode steps (the merged trace's tokens).
    """

    trace: Trace
    batch: int
    requests: int
    generated: int
    steps: int


def _requests(trace: Trace) -> list[list[list[tuple[int, np.ndarray]]]]:
    """Per request (sequence, in order of first call), per token (in order of first call), its
    calls ``(layer, routes)`` in call order."""
    order: dict[int, dict[int, list]] = {}
    for index in range(trace.num_calls):
        tokens = order.setdefault(int(trace.sequence[index]), {})
        tokens.setdefault(int(trace.token_idx[index]), []).append(
            (int(trace.layers[index]), trace.routes[index]))
    return [list(tokens.values()) for tokens in order.values()]


def batched_trace(trace: Trace, batch: int) -> Batched:
    """The calls of decoding ``trace``'s requests ``batch`` at a time (continuous batching).

    Each step takes the next token of every active request (slots in order; a request joins
    the first free slot), and makes one call per layer any of those tokens routes, in
    ascending layer order, with their routes concatenated in slot order and ``-1`` padded to
    ``batch * top_k`` columns. A request whose last token ran leaves its slot free for the next
    request at the next step.

    Raises:
      ValueError: ``batch`` is not a positive integer.
    """
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    batch = int(batch)
    requests = _requests(trace)
    width = batch * trace.top_k
    pending = iter(requests)
    slots: list = [None] * batch  # per slot: [request's tokens, next token index]
    layers_out, routes_out, steps_out = [], [], []
    step = 0
    while True:
        for slot in range(batch):
            if slots[slot] is None:
                request = next(pending, None)
                if request is not None:
                    slots[slot] = [request, 0]
        if all(slot is None for slot in slots):
            break
        by_layer: dict[int, list[np.ndarray]] = {}
        for slot in slots:
            if slot is None:
                continue
            for layer, routes in slot[0][slot[1]]:
                by_layer.setdefault(layer, []).append(routes)
        for layer in sorted(by_layer):
            merged = np.full(width, -1, np.int32)
            joined = np.concatenate(by_layer[layer])
            merged[:joined.shape[0]] = joined
            layers_out.append(layer)
            routes_out.append(merged)
            steps_out.append(step)
        for index, slot in enumerate(slots):
            if slot is not None:
                slot[1] += 1
                if slot[1] == len(slot[0]):
                    slots[index] = None
        step += 1
    merged_trace = Trace(np.stack(routes_out), np.asarray(layers_out, np.int32),
                         trace.num_layers, trace.num_experts,
                         token_idx=np.asarray(steps_out, np.int64),
                         sequence=np.zeros(len(steps_out), np.int32),
                         source=f"{trace.source} batch={batch}")
    return Batched(merged_trace, batch, len(requests), trace.num_tokens, step)


def split_requests(trace: Trace, requests: int, seed: int = 0) -> Trace:
    """A one-sequence trace (a synthetic one) cut into ``requests`` consecutive requests of
    unequal, seeded lengths (each between about half and one and a half times the mean, at
    least one token); each request's tokens count from 0. The calls stay as they were.

    Raises:
      ValueError: ``requests`` is not a positive integer, exceeds the tokens, or the trace has
        several sequences already.
    """
    if isinstance(requests, bool) or not isinstance(requests, (int, np.integer)) or requests < 1:
        raise ValueError(f"requests must be a positive integer, got {requests!r}")
    tokens = trace.num_tokens
    if requests > tokens:
        raise ValueError(f"--requests {requests} exceeds the trace's {tokens} tokens")
    if len(np.unique(trace.sequence)) != 1:
        raise ValueError("split_requests cuts a one-sequence trace")
    weights = np.random.default_rng([seed, 35]).uniform(0.5, 1.5, int(requests))
    cuts = np.floor(np.cumsum(weights) / weights.sum() * (tokens - requests)).astype(np.int64)
    lengths = np.diff(np.concatenate([[0], cuts])) + 1
    lengths[-1] += tokens - lengths.sum()
    rank = np.searchsorted(np.unique(trace.token_idx), trace.token_idx)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    request = np.searchsorted(np.cumsum(lengths), rank, side="right").astype(np.int32)
    return Trace(trace.routes, trace.layers, trace.num_layers, trace.num_experts,
                 token_idx=(rank - starts[request]).astype(np.int64), sequence=request,
                 sequence_names=tuple(f"request-{i}" for i in range(int(requests))),
                 source=f"{trace.source} requests={int(requests)}")


def batched_records(trace: Trace, configs, cost, batches, replay, progress) -> tuple[list, list]:
    """``(results, records)`` of replaying ``configs`` on ``trace`` decoded ``B`` requests at a
    time, for each ``B`` of ``batches`` (B = 1: the trace itself), in that order.

    Per generated token: ``tokens`` is the requests' tokens, and the per-token fields and the
    cost model's ``modeled_ms_per_token`` divide by it; ``best`` and ``budget_best`` are per
    ``B``; with the GPU's time, the event rules time each merged call (docs/semantics.md §11.6).
    Each record gains ``batch``, ``steps`` (decode steps) and ``modeled_ms_per_step``
    (a step's modeled time: every active request's token at once); ``top_k`` stays the
    trace's, ``sequences`` its requests, ``source`` its own.
    """
    from pallas_cache.sizing.sweep.cost import with_costs
    from pallas_cache.sizing.report import records

    all_results, rows = [], []
    for batch in batches:
        merged = batched_trace(trace, batch)
        replayed = replay(merged.trace, configs, progress=progress,
                          **({"hit_counts": True} if getattr(cost, "gpu", False) else {}))
        generated = merged.generated
        results = with_costs([dataclasses.replace(
            r, tokens=generated, fetched_per_token=r.fetched / generated,
            cpu_experts_per_token=r.cpu_experts / generated) for r in replayed], cost)
        for record in records(results, merged.trace, cost):
            ms = record["modeled_ms_per_token"]
            record.update(source=str(trace.source), top_k=int(trace.top_k),
                          sequences=merged.requests, batch=batch, steps=merged.steps,
                          modeled_ms_per_step=None if ms is None
                          else ms * generated / merged.steps)
            rows.append(record)
        all_results += results
    return all_results, rows
