"""Offline optima computed the slow, obvious way, for tests/sizing/bounds/test_bounds.py
(test-only).

Independent of ``pallas_cache.sizing.bounds``: a search over every schedule of the model, and
set-based transcriptions of docs/semantics.md §5.14's two rules.
"""

import bisect
import functools
import itertools
import math

from pallas_cache.sizing import Trace


def distinct_calls(trace: Trace) -> list[frozenset[int]]:
    """Per call, the set of distinct flat ids it routes (padding dropped)."""
    return [frozenset(int(f) for f in row if f >= 0) for row in trace.flat_ids()]


def exhaustive_min_misses(trace: Trace, cache_size: int, *, bypass: bool) -> int:
    """The fewest misses over every schedule of the model (see the module docstring)."""
    calls = distinct_calls(trace)

    @functools.lru_cache(maxsize=None)
    def best(index: int, resident: frozenset[int]) -> int:
        if index == len(calls):
            return 0
        need = calls[index]
        hits, misses = need & resident, need - resident
        result = None
        if bypass:  # keep the hits plus any subset of (unrouted residents | misses) that fits
            optional = sorted((resident - need) | misses)
            choices = (hits | set(kept) for size in range(min(cache_size - len(hits),
                                                                 len(optional)) + 1)
                       for kept in itertools.combinations(optional, size))
        else:  # keep the whole call plus any subset of the unrouted residents that fits
            optional = sorted(resident - need)
            choices = (need | set(kept) for size in range(min(cache_size - len(need),
                                                                 len(optional)) + 1)
                       for kept in itertools.combinations(optional, size))
        for after in choices:
            total = len(misses) + best(index + 1, frozenset(after))
            result = total if result is None else min(result, total)
        return result

    return best(0, frozenset())


def textbook_belady(trace: Trace, cache_size: int) -> tuple[int, list[int]]:
    """Belady by the book (scan every evictable resident): ``(missing, missing per layer)``."""
    calls = distinct_calls(trace)
    uses: dict[int, list[int]] = {}
    for index, need in enumerate(calls):
        for flat in need:
            uses.setdefault(flat, []).append(index)

    def next_use(flat: int, after: int) -> float:
        times = uses[flat]
        later = bisect.bisect_right(times, after)
        return times[later] if later < len(times) else math.inf

    resident: set[int] = set()
    layer_missing = [0] * trace.num_layers
    for index, (need, layer) in enumerate(zip(calls, trace.layers.tolist())):
        for flat in sorted(need - resident):
            layer_missing[layer] += 1
            if len(resident) == cache_size:
                victim = max(sorted(resident - need), key=lambda f: next_use(f, index))
                resident.remove(victim)
            resident.add(flat)
    return sum(layer_missing), layer_missing


def textbook_bypass(trace: Trace, cache_size: int) -> tuple[int, list[int]]:
    """docs/semantics.md §5.14's bypass rule, set by set: ``(missing, missing per layer)``."""
    calls = distinct_calls(trace)
    uses: dict[int, list[int]] = {}
    for index, need in enumerate(calls):
        for flat in need:
            uses.setdefault(flat, []).append(index)

    resident: set[int] = set()
    layer_missing = [0] * trace.num_layers
    for index, (need, layer) in enumerate(zip(calls, trace.layers.tolist())):
        hits, misses = need & resident, need - resident
        layer_missing[layer] += len(misses)
        # Rank by the whole sequence of later uses (never again = infinitely far), then flat id.
        ranked = sorted((tuple(later) + (math.inf,), flat)
                        for flat in (resident - need) | misses
                        for later in [uses[flat][bisect.bisect_right(uses[flat], index):]]
                        if later)
        resident = set(hits) | {flat for _, flat in ranked[:cache_size - len(hits)]}
    return sum(layer_missing), layer_missing
