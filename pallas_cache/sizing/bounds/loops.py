"""The offline optima's eviction loops, written once: run by the interpreter or compiled by Numba.

:func:`loops` returns them as a :class:`Loops` record: ``loops(False)`` the plain functions,
``loops(True)`` the same code compiled by :func:`numba.njit` (cached on disk; ``None`` without
Numba). The rationale is docs/design.md's "Offline bounds".
"""

from __future__ import annotations

import heapq
import types
from typing import Any, Callable, NamedTuple

import numpy as np

__all__ = ["Loops", "heap_capacity", "loops"]


class Loops(NamedTuple):
    """One executor of the optima's chunk loops.

    Attributes:
        compiled: whether these are the Numba-compiled functions.
        new_state: ``new_state(id_space, num_layers, slots, most_per_call)`` -> the
            mutable state ``(resident, layer_missing, heap, scalars, own, tied)``.
        belady_chunk: Belady over one chunk of whole calls, in place on the state.
        bypass_chunk: the bypass optimum over one chunk, in place on the state.
    """

    compiled: bool
    new_state: Callable[..., tuple]
    belady_chunk: Callable[..., None]
    bypass_chunk: Callable[..., None]


def heap_capacity(slots: int, most_per_call: int) -> int:
    """Entries the heap can hold at once: the compaction bound ``2 S + 1024`` plus one call's
    pushes (the loops compact at the end of a call once the heap is past the bound)."""
    return 2 * slots + 1024 + 2 * most_per_call + 64


# ---- the heap --------------------------------------------------------------------------------
# A min-heap of distinct int keys with four operations; the loops see only these. Interpreted:
# :mod:`heapq` on a list. Compiled: a binary heap on an int64 array whose last entry holds the
# size (so both take the heap alone, and the interpreter calls heapq's C functions directly).

_push = heapq.heappush  # _push(heap, key)
_pop = heapq.heappop    # _pop(heap) -> the smallest key
_size = len             # _size(heap) -> entries held


def _heapify(heap, size):
    """Keep the first ``size`` entries, as a heap."""
    del heap[size:]
    heapq.heapify(heap)


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


def _array_push(heap, key):
    last = heap.shape[0] - 1
    size = heap[last]
    if size >= last:
        raise IndexError("bounds_loops: heap capacity exceeded")
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        if heap[parent] <= key:
            break
        heap[i] = heap[parent]
        i = parent
    heap[i] = key
    heap[last] = size + 1


def _array_pop(heap):
    last = heap.shape[0] - 1
    size = heap[last] - 1
    top = heap[0]
    heap[last] = size
    if size > 0:
        _sift_down(heap, size, 0, heap[size])
    return top


def _array_size(heap):
    return heap[heap.shape[0] - 1]


def _array_heapify(heap, size):
    heap[heap.shape[0] - 1] = size
    for i in range(size // 2 - 1, -1, -1):
        _sift_down(heap, size, i, heap[i])


# ---- the optima (docs/semantics.md §5.14; keys and stamps as bounds._simulate describes) -----


def _compact(heap, live):
    """Keep the entries ``<= live`` (next use after the current call)."""
    kept = 0
    for i in range(_size(heap)):
        if heap[i] <= live:
            heap[kept] = heap[i]
            kept += 1
    _heapify(heap, kept)


def _evict(heap, resident, id_space, over, stamp, own):
    """Belady: pop the ``over`` furthest live entries not protected by ``stamp``; drop their ids."""
    held = 0
    for _ in range(over):
        while True:
            key = _pop(heap)
            victim = (-key) % id_space
            if resident[victim] != stamp:
                break
            own[held] = key  # an id the call routes: back in after the evictions
            held += 1
        resident[victim] = 0
    for j in range(held):
        _push(heap, own[j])


def _ranks_later(next_index, next_call, flat, never, first, second):
    """Whether access ``first``'s id is worse to keep than ``second``'s (same next use)."""
    a, b = next_index[first], next_index[second]
    while True:  # a, b: the two ids' accesses at the same call
        use_a, use_b = next_call[a], next_call[b]
        if use_a != use_b:
            return use_a > use_b
        if use_a == never:
            return flat[a] > flat[b]
        a, b = next_index[a], next_index[b]


def _evict_bypass(heap, resident, unit, over, stamp, own, tied, flat, next_index,
                  next_call, never):
    """The bypass optimum's drops: the ``over`` worst candidates, ties on next use broken deeper.

    Candidates with the same next use ``n`` (ids routed together at ``n``) are ranked by their
    whole sequence of later uses, compared from the front (never again = infinitely far), the
    higher flat id first when the sequences are equal. Ids never used again are dropped first,
    in any order (dropping one or the other changes no later miss).
    """
    held = 0
    for _ in range(over):
        while True:
            key = _pop(heap)
            if resident[flat[(-key) % unit]] != stamp:
                break
            own[held] = key
            held += 1
        use = (-key) // unit
        if use < never and _size(heap) > 0 and (-heap[0]) // unit == use:
            tied[0] = key
            count = 1
            while _size(heap) > 0 and (-heap[0]) // unit == use:
                other = _pop(heap)
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
                    _push(heap, tied[j])
        resident[flat[(-key) % unit]] = 0
    for j in range(held):
        _push(heap, own[j])


def _belady_chunk(resident, layer_missing, heap, scalars, slots, id_space, flats, keys, stamps,
                  ends, own):
    """Belady over one chunk of whole calls: every miss admitted.

    Per access: its flat id, key (0: no entry) and ``end`` (layer + 1 on the call's last access,
    else 0); per call: its stamp ``c + 1``. ``scalars`` = ``[residents]``.
    """
    count = scalars[0]
    compact_above = 2 * slots + 1024
    misses = 0
    call = 0
    stamp = stamps[0]
    for flat, key, end in zip(flats, keys, ends):
        if resident[flat] == 0:
            misses += 1
        resident[flat] = stamp
        if key != 0:
            _push(heap, key)
        if end != 0:  # the call's last access: count, evict
            if misses != 0:
                layer_missing[end - 1] += misses
                count += misses
                misses = 0
                if count > slots:
                    _evict(heap, resident, id_space, count - slots, stamp, own)
                    count = slots
            if _size(heap) > compact_above:
                _compact(heap, -stamp * id_space)
            call += 1
            stamp = stamps[call] if call < len(stamps) else 0
    scalars[0] = count


def _bypass_chunk(resident, layer_missing, heap, scalars, slots, unit, calls, flats, keys, stamps,
                  ends, own, tied, flat, next_index, next_call):
    """The bypass optimum over one chunk (arguments as :func:`_belady_chunk`'s, plus the trace's
    access arrays for the deep tie-break).

    A twin of :func:`_belady_chunk` rather than one loop with a ``bypass`` flag: this is the
    per-access hot loop, and a branch per access costs more than the ten shared lines."""
    count = scalars[0]
    dead = -calls * unit  # keys <= dead: never used again
    compact_above = 2 * slots + 1024
    misses = 0
    call = 0
    stamp = stamps[0]
    for this, key, end in zip(flats, keys, ends):
        if resident[this] != 0:  # a hit: kept through the call (protected by its stamp)
            resident[this] = stamp
            if key != 0:
                _push(heap, key)
        else:
            misses += 1
            if key > dead:  # used again: admitted unless ranked out below
                resident[this] = -stamp
                count += 1
                if key != 0:
                    _push(heap, key)
        if end != 0:
            if misses != 0:
                layer_missing[end - 1] += misses
                misses = 0
                if count > slots:
                    _evict_bypass(heap, resident, unit, count - slots, stamp, own,
                                         tied, flat, next_index, next_call, calls)
                    count = slots
            if _size(heap) > compact_above:
                _compact(heap, -stamp * unit)
            call += 1
            stamp = stamps[call] if call < len(stamps) else 0
    scalars[0] = count


def _python_state(id_space: int, num_layers: int, slots: int, most_per_call: int) -> tuple:
    scratch = 2 * most_per_call + 8
    return [0] * id_space, [0] * num_layers, [], [0], [0] * scratch, [0] * scratch


def _array_state(id_space: int, num_layers: int, slots: int, most_per_call: int) -> tuple:
    scratch = 2 * most_per_call + 8
    return (np.zeros(id_space, np.int64), np.zeros(num_layers, np.int64),
            np.zeros(heap_capacity(slots, most_per_call) + 1, np.int64), np.zeros(1, np.int64),
            np.zeros(scratch, np.int64), np.zeros(scratch, np.int64))


#: The functions the chunk loops reach, compiled together; the heap's array versions take the
#: names the loops call.
_SHARED = ("_sift_down", "_compact", "_evict", "_ranks_later", "_evict_bypass", "_belady_chunk",
           "_bypass_chunk")
_ARRAY_HEAP = {"_push": "_array_push", "_pop": "_array_pop", "_size": "_array_size",
               "_heapify": "_array_heapify"}

_PYTHON = Loops(compiled=False, new_state=_python_state, belady_chunk=_belady_chunk,
                bypass_chunk=_bypass_chunk)
_COMPILED: list = []  # [Loops] once built


def _compile() -> Loops:
    """The same function objects' code, compiled by Numba in a namespace where the heap is the
    array one (``ImportError`` without Numba)."""
    import numba

    jit = numba.njit(cache=True, nogil=True)
    space: dict[str, Any] = dict(globals())
    for name, source in [*((name, name) for name in _SHARED), *_ARRAY_HEAP.items()]:
        function = globals()[source]
        space[name] = jit(types.FunctionType(function.__code__, space, name))
    return Loops(compiled=True, new_state=_array_state, belady_chunk=space["_belady_chunk"],
                 bypass_chunk=space["_bypass_chunk"])


def loops(compiled: bool) -> Loops | None:
    """The compiled loops (``None`` where Numba cannot be imported) or the Python ones."""
    if not compiled:
        return _PYTHON
    if not _COMPILED:
        try:
            _COMPILED.append(_compile())
        except ImportError:
            return None
    return _COMPILED[0]
