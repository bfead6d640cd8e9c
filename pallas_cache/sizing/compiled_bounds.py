"""The offline optima's eviction loops, compiled with Numba (the optional ``fast`` extra).

:mod:`pallas_cache.sizing.bounds` simulates Belady's schedule and the bypass optimum with a heap
of int keys; its Python loop costs about a microsecond per visited access, which on a 2M-call
trace is a minute of CPU next to the replay's scan. These are the same loops over the same keys,
compiled: :mod:`~pallas_cache.sizing.bounds` calls them chunk by chunk when Numba can be
imported (``pip install 'pallas-cache[fast]'``) and the keys fit int64, and falls back to its
own loop otherwise. The results are the same: every heap key is distinct (a next use and a flat
id, or an access index), so which entry a pop returns depends on the set of entries only, never
on how a heap lays them out, and the two implementations hold the same sets
(``tests/test_bounds.py`` compares them on every bound test and on random traces). The two
chunk loops are twins, as ``bounds``' own are, so each reads line for line as its original.

State (arrays, so that a chunk's call changes them in place): ``resident`` int64 ``[L * E]``
(the stamps of :class:`~pallas_cache.sizing.bounds` ``_LoopState``), ``layer_missing`` int64
``[L]``, ``heap`` int64 ``[capacity]`` (a binary min-heap in its first ``scalars[0]`` entries;
keys are negative, so the smallest is the furthest next use) and ``scalars`` int64 ``[2]``
(heap size, residents). ``own`` and ``tied`` are scratch arrays of at least one call's accesses
plus one.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["belady_chunk", "bypass_chunk", "heap_capacity"]

_jit = numba.njit(cache=True, nogil=True)


def heap_capacity(slots: int, most_per_call: int) -> int:
    """Entries the heap can hold at once: the compaction bound ``2 S + 1024`` plus one call's
    pushes (the loops compact at the end of a call once the heap is past the bound)."""
    return 2 * slots + 1024 + 2 * most_per_call + 64


@_jit
def _push(heap, size, key):
    if size >= heap.shape[0]:
        raise IndexError("compiled_bounds: heap capacity exceeded")
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        if heap[parent] <= key:
            break
        heap[i] = heap[parent]
        i = parent
    heap[i] = key
    return size + 1


@_jit
def _sift_down(heap, size, i, key):
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and heap[child + 1] < heap[child]:
            child += 1
        if heap[child] >= key:
            break
        heap[i] = heap[child]
        i = child
    heap[i] = key


@_jit
def _pop(heap, size):
    top = heap[0]
    size -= 1
    if size > 0:
        _sift_down(heap, size, 0, heap[size])
    return top, size


@_jit
def _compact(heap, size, live):
    """Keep the entries ``<= live`` (next use after the current call), then heapify."""
    kept = 0
    for i in range(size):
        if heap[i] <= live:
            heap[kept] = heap[i]
            kept += 1
    for i in range(kept // 2 - 1, -1, -1):
        _sift_down(heap, kept, i, heap[i])
    return kept


@_jit
def _evict(heap, size, resident, id_space, over, stamp, own):
    """Belady: pop the ``over`` furthest live entries not protected by ``stamp``; drop them."""
    held = 0
    for _ in range(over):
        while True:
            key, size = _pop(heap, size)
            victim = (-key) % id_space
            if resident[victim] != stamp:
                break
            own[held] = key  # an id the call routes: back in after the evictions
            held += 1
        resident[victim] = 0
    for j in range(held):
        size = _push(heap, size, own[j])
    return size


@_jit
def belady_chunk(resident, layer_missing, heap, scalars, slots, id_space, flats, keys, stamps,
                 ends, own):
    """Belady over one chunk of whole calls (arguments as ``bounds._belady_loop``'s, as arrays:
    per access its flat id, key (0: no entry) and end (layer + 1 on a call's last access, else
    0); per call its stamp ``c + 1``)."""
    size, count = scalars[0], scalars[1]
    compact_above = 2 * slots + 1024
    misses = 0
    call = 0
    stamp = stamps[0]
    for i in range(flats.shape[0]):
        flat = flats[i]
        if resident[flat] == 0:
            misses += 1
        resident[flat] = stamp
        key = keys[i]
        if key != 0:
            size = _push(heap, size, key)
        end = ends[i]
        if end != 0:  # the call's last access: count, evict
            if misses != 0:
                layer_missing[end - 1] += misses
                count += misses
                misses = 0
                if count > slots:
                    size = _evict(heap, size, resident, id_space, count - slots, stamp, own)
                    count = slots
            if size > compact_above:
                size = _compact(heap, size, -stamp * id_space)
            call += 1
            stamp = stamps[call] if call < stamps.shape[0] else 0
    scalars[0], scalars[1] = size, count


@_jit
def _ranks_later(next_index, next_call, flat, never, first, second):
    """Whether access ``first``'s id is worse to keep than ``second``'s (same next use)."""
    a, b = next_index[first], next_index[second]
    while True:
        use_a, use_b = next_call[a], next_call[b]
        if use_a != use_b:
            return use_a > use_b
        if use_a == never:
            return flat[a] > flat[b]
        a, b = next_index[a], next_index[b]


@_jit
def _evict_bypass(heap, size, resident, unit, over, stamp, own, tied, flat, next_index,
                  next_call, never):
    """The bypass optimum's drops: ``bounds._evict_bypass``, ties on next use broken deeper."""
    held = 0
    for _ in range(over):
        while True:
            key, size = _pop(heap, size)
            if resident[flat[(-key) % unit]] != stamp:
                break
            own[held] = key
            held += 1
        use = (-key) // unit
        if use < never and size > 0 and (-heap[0]) // unit == use:
            tied[0] = key
            count = 1
            while size > 0 and (-heap[0]) // unit == use:
                other, size = _pop(heap, size)
                if resident[flat[(-other) % unit]] == stamp:
                    own[held] = other
                    held += 1
                else:
                    tied[count] = other
                    count += 1
            key = tied[0]
            for j in range(1, count):
                if _ranks_later(next_index, next_call, flat, never, (-tied[j]) % unit,
                                (-key) % unit):
                    key = tied[j]
            for j in range(count):
                if tied[j] != key:
                    size = _push(heap, size, tied[j])
        resident[flat[(-key) % unit]] = 0
    for j in range(held):
        size = _push(heap, size, own[j])
    return size


@_jit
def bypass_chunk(resident, layer_missing, heap, scalars, slots, unit, calls, flats, keys, stamps,
                 ends, own, tied, flat, next_index, next_call):
    """The bypass optimum over one chunk (``bounds._bypass_loop``; arguments as
    :func:`belady_chunk`'s, plus the trace's access arrays for the deep tie-break)."""
    size, count = scalars[0], scalars[1]
    dead = -calls * unit  # keys <= dead: never used again
    compact_above = 2 * slots + 1024
    misses = 0
    call = 0
    stamp = stamps[0]
    for i in range(flats.shape[0]):
        this = flats[i]
        key = keys[i]
        if resident[this] != 0:  # a hit: kept through the call (protected by its stamp)
            resident[this] = stamp
            if key != 0:
                size = _push(heap, size, key)
        else:
            misses += 1
            if key > dead:  # used again: admitted unless ranked out below
                resident[this] = -stamp
                count += 1
                if key != 0:
                    size = _push(heap, size, key)
        end = ends[i]
        if end != 0:
            if misses != 0:
                layer_missing[end - 1] += misses
                misses = 0
                if count > slots:
                    size = _evict_bypass(heap, size, resident, unit, count - slots, stamp, own,
                                         tied, flat, next_index, next_call, calls)
                    count = slots
            if size > compact_above:
                size = _compact(heap, size, -stamp * unit)
            call += 1
            stamp = stamps[call] if call < stamps.shape[0] else 0
    scalars[0], scalars[1] = size, count


def new_state(id_space: int, num_layers: int, slots: int, most_per_call: int):
    """``(resident, layer_missing, heap, scalars, own, tied)`` for a fresh simulation."""
    scratch = 2 * most_per_call + 8
    return (np.zeros(id_space, np.int64), np.zeros(num_layers, np.int64),
            np.zeros(heap_capacity(slots, most_per_call), np.int64), np.zeros(2, np.int64),
            np.zeros(scratch, np.int64), np.zeros(scratch, np.int64))
