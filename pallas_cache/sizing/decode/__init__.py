"""An offloaded decode at a model's expert geometry, measured beside the replay's model.

:func:`bench_decode` decodes a routing trace one token at a time through one compiled program
(``ensure_hybrid``, ``apply_copy_plan``, ``moe_hybrid`` in a ``lax.scan`` over layers inside one
over tokens) with random expert weights in host memory, for each row a user compares: every
expert resident (the floor), no cache (each call copies its routed experts), and cache
configurations. Each row's per-call ``(hits, fetched, cpu_experts)`` counts are checked equal to
the replay's on the same routes, and each row is timed beside the replay's event-rule time
(``overlap_ms_per_token``, docs/semantics.md §11.6) with the parameters measured in the same run
(:func:`measure_parameters`). ``pallas-cache bench-decode`` is its command line;
``benchmarks/hybrid_decode.py`` calls it too.

Each layer is the MoE block alone: attention, dense layers and the LM head are not run, the
router is the trace's routes (gates random), and a norm keeps the residual stream O(1).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import numpy as np

from pallas_cache.sizing.decode.bank import Geometry, check_expert_dtype
from pallas_cache.sizing.decode.decoder import Decoder, RowSpec
from pallas_cache.sizing.decode.parameters import (SLOPE_TIME_LIMIT, Parameters,
                                                   measure_parameters, slope_rate)
from pallas_cache.sizing.decode.rows import (ATTENTION_LINE, DecodeRun, Row, call_histogram,
                                             distinct_per_call, gap_line)
from pallas_cache.sizing.sweep import ReplayConfig, replay
from pallas_cache.sizing.traces import Trace

__all__ = ["ATTENTION_LINE", "DecodeRun", "Geometry", "Parameters", "Row",
           "RowSpec", "bench_decode", "check_expert_dtype", "gap_line", "slope_rate"]


def bench_decode(geometry: Geometry, trace: Trace, cache_sizes: Sequence[int],
                 configurations: Sequence[tuple[str, str]], *, repeats: int = 3,
                 rounds: int = 5, time_limit: float = SLOPE_TIME_LIMIT, seed: int = 0,
                 resident: bool = True, no_cache: bool = True,
                 progress: Callable[[str], None] = lambda line: None) -> DecodeRun:
    """Decode ``trace`` (dense, ``[T, L, k]`` of ``geometry``) for every row and model each.

    Rows: the floor (``resident``), no cache (``no_cache``), then every cache size x
    ``(policy, eviction)`` of ``configurations`` (``fraction:auto`` resolved by the measured
    bandwidths). Raises ``RuntimeError`` when a row's per-call counts differ from the replay's
    (or, for the floor and no-cache rows, from the trace's distinct experts per call).
    """
    g = geometry
    routes = trace.to_dense()
    tokens = routes.shape[0]
    decoder = Decoder(g, routes, seed, progress)
    placement = jax.tree.leaves(decoder.bank)[0].sharding.memory_kind
    width = g.expert_bytes
    specs = []
    if resident:
        specs.append(RowSpec("resident", g.resident_slots))
    if no_cache:
        specs.append(RowSpec("no-cache", g.num_experts))
    smallest = RowSpec("cache", min(cache_sizes) if cache_sizes else g.num_experts)
    params = measure_parameters(decoder, smallest, rounds, time_limit, progress)
    cost = params.cost(width)
    configs = [ReplayConfig(size, cost.auto_policy(g.top_k) if policy == "fraction:auto"
                            else policy, eviction=eviction)
               for size in cache_sizes for policy, eviction in configurations]
    progress(f"replay of {len(configs)} configurations with the measured parameters")
    modeled = replay(trace, configs, bounds=False, cost=cost, progress=lambda line: None,
                     hit_counts=True) if configs else []
    distinct = distinct_per_call(routes)
    zeros = np.zeros_like(distinct)
    expected = {"resident": call_histogram(distinct, zeros, zeros),
                "no-cache": call_histogram(zeros, distinct, zeros)}
    rows, skipped = [], []
    for spec, result in [(s, None) for s in specs] + [
            (RowSpec("cache", c.cache_size, c.policy, c.eviction), r)
            for c, r in zip(configs, modeled)]:
        progress(f"decode {spec.label}: {tokens} tokens, a warm-up and {repeats} repeats")
        try:
            seconds, compile_seconds, (hits, fetched, cpu) = decoder.run(spec, spec.policy,
                                                                         repeats)
        except jax.errors.JaxRuntimeError as error:
            if not _out_of_memory(error):
                raise
            skipped.append(f"{spec.label} did not fit the device's memory: "
                           f"{str(error).splitlines()[0][:160]}")
            progress(skipped[-1])
            decoder.programs.clear()  # what the failed program held goes with it
            continue
        got = call_histogram(hits, fetched, cpu)
        want = expected[spec.kind] if result is None else tuple(
            tuple(c) for c in sorted(result.call_counts))
        against = ("the trace's distinct experts per call" if result is None else
                   "the replay's")
        if got != want:
            raise RuntimeError(f"{spec.label}: the decode's per-call (hits, fetched, "
                               f"cpu_experts, calls) {got} differ from {against} {want}")
        ms = seconds * 1e3 / tokens
        model = (params.ms_per_token(want, width, tokens) if result is None
                 else result.overlap_ms_per_token)
        rows.append(Row(spec.label, spec.kind, spec.cache_size, spec.policy, spec.eviction, ms,
                        1e3 / ms, int(fetched.sum()) / tokens, int(cpu.sum()) / tokens,
                        compile_seconds, model, ms / model if model else math.inf, against,
                        want))
        progress(f"{spec.label}: {ms:.3f} ms/token measured, {model:.3f} modeled")
    gaps = tuple(line for line in (gap_line(r, params, r.call_counts, width, tokens)
                                   for r in rows) if line)
    notes = (ATTENTION_LINE,
             "the no-cache row is modeled as every call copying each of its distinct routed "
             "experts (no hits, no CPU experts); the floor as every call's experts resident "
             "(hits only); the others by the replay's timed model (overlap_ms_per_token)")
    return DecodeRun(g, trace.source, tokens, placement, tuple(rows), params,
                     notes + tuple(skipped), gaps)


def _out_of_memory(error: Exception) -> bool:
    """Whether an XLA runtime error is an allocation that failed (the row is left out)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text
