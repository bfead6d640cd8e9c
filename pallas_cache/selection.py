"""The loop-free XLA selection primitive: the first ``n`` entries in ascending ``(key..., index)``
order, as the victim search, the fetch order and every XLA ranking use it (docs/semantics.md
§7.1; rationale in docs/design.md, "A loop-free step" and "Eviction policies")."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from pallas_cache.validate import INT32_MAX

__all__ = ["first_in_order", "select_victims", "smallest_values"]

# Arrays longer than this take the two-level first_in_order.
_TWO_LEVEL_ABOVE = 256
# Pairs one round of first_in_order keeps (measured on XLA:CPU: one 8-wide reduction over 64
# slots costs about a third of eight 1-wide ones).
_ROUND_WIDTH = 8


def _before(a, b):
    """``a < b`` lexicographically, for tuples ``(key..., index)`` of equal length."""
    (x, *a_rest), (y, *b_rest) = a, b
    if not a_rest:
        return x < y
    return (x < y) | ((x == y) & _before(a_rest, b_rest))


def _after(a, b):
    """``a > b`` lexicographically: ``a`` strictly after ``b``."""
    (x, *a_rest), (y, *b_rest) = a, b
    if not a_rest:
        return x > y
    return (x > y) | ((x == y) & _after(a_rest, b_rest))


def _as_keys(keys):
    return tuple(keys) if isinstance(keys, (tuple, list)) else (keys,)


def _merge_smallest(k, width):
    """The ``lax.reduce`` combiner keeping the ``k`` smallest ``(key..., index)`` tuples of
    ``width`` components, sorted: from two sorted k-lists, ``min(a[i], b[k-1-i])`` is a bitonic
    sequence of the k smallest, which a ``log2(k)``-stage bitonic network sorts. Operands:
    component-major, k lanes of each component."""
    def lane(operands, i):
        return [operands[c * k + i] for c in range(width)]

    def merge(a, b):
        lanes = []
        for i in range(k):
            x, y = lane(a, i), lane(b, k - 1 - i)
            take_a = _before(x, y)
            lanes.append([jnp.where(take_a, p, q) for p, q in zip(x, y)])
        span = k // 2
        while span:
            for i in range(k):
                if not i & span:
                    j = i + span
                    swap = _before(lanes[j], lanes[i])
                    for c in range(width):
                        lanes[i][c], lanes[j][c] = (jnp.where(swap, lanes[j][c], lanes[i][c]),
                                                    jnp.where(swap, lanes[i][c], lanes[j][c]))
            span //= 2
        return tuple(lanes[i][c] for c in range(width) for i in range(k))
    return merge


def _sorting_network(k):
    """The compare-exchange lanes ``(low, high)`` of a bitonic network sorting ``k`` (a power of
    two) lanes ascending: ``k = 8`` takes 24 exchanges in 6 layers."""
    exchanges = []
    size = 2
    while size <= k:
        stride = size // 2
        while stride:
            for i in range(k):
                j = i ^ stride
                if j > i:
                    exchanges.append((i, j) if i & size == 0 else (j, i))
            stride //= 2
        size *= 2
    return exchanges


def _smallest_sorted(keys, index, live, k):
    """The ``k`` smallest ``(key..., index)`` tuples among ``live`` entries, ascending, as ``k``
    lanes of each component, component-major (``INT32_MAX`` tuples past the live ones).

    The entries are dealt into ``k`` lanes of ``ceil(size / k)``; a sorting network over the lanes
    (elementwise, so XLA vectorises it across groups) leaves every group of ``k`` a sorted list,
    and one ``lax.reduce`` of :func:`_merge_smallest` merges the ``size / k`` lists. The merge is
    the costly part (scalar, about 80 operations per element), so reducing sorted groups instead
    of single tuples cuts it ``k``-fold: measured on XLA:CPU, about half the time of the
    single-tuple reduction at 64 and 128 entries.
    """
    size = index.shape[0]
    groups = -(-size // k)
    pad = groups * k - size
    columns = [jnp.pad(jnp.where(live, component, INT32_MAX), (0, pad), constant_values=INT32_MAX)
               for component in (*keys, index)]
    parts = [[column[j * groups:(j + 1) * groups] for j in range(k)] for column in columns]
    for a, b in _sorting_network(k):
        swap = _before([part[b] for part in parts], [part[a] for part in parts])
        for part in parts:
            part[a], part[b] = (jnp.where(swap, part[b], part[a]),
                                jnp.where(swap, part[a], part[b]))
    # The barrier asks XLA not to fuse the network into the reduction, which would recompute it
    # per operand and per element. XLA:CPU expands barriers before fusion, so there it is a
    # no-op (docs/design.md, "ROUTE_KNN's per-call cost").
    lists = lax.optimization_barrier(tuple(x for part in parts for x in part))
    return lax.reduce(lists, (jnp.int32(INT32_MAX),) * (len(parts) * k),
                      _merge_smallest(k, len(parts)), (0,))


def _rounds(keys, candidate, num_out, index=None):
    """The first ``num_out`` candidates in ``ceil(num_out / k)`` unrolled rounds of one
    reduction each, ``k = min(_ROUND_WIDTH, next_pow2(num_out))``: round ``r`` keeps the ``k``
    smallest tuples strictly after round ``r - 1``'s last (so no knocked-out mask is carried).
    Entries past the candidates are -1."""
    if num_out == 0:
        return jnp.full((0,), -1, jnp.int32)
    if index is None:
        index = lax.iota(jnp.int32, candidate.shape[0])
    width = len(keys) + 1
    k = min(_ROUND_WIDTH, 1 << (num_out - 1).bit_length())
    picks, last = [], None
    for _ in range(-(-num_out // k)):
        live = candidate
        if last is not None:
            live = live & _after((*keys, index), last)
        best = _smallest_sorted(keys, index, live, k)
        picks.extend(best[(width - 1) * k:])
        last = tuple(best[c * k + k - 1] for c in range(width))
    picks = jnp.stack(picks[:num_out])
    return jnp.where(picks == INT32_MAX, -1, picks).astype(jnp.int32)


def first_in_order(keys, candidate, num_out: int):
    """The indices of the first ``num_out`` ``candidate`` entries in ascending ``(key..., index)``
    order, as int32[num_out]; -1 past the number of candidates. ``keys`` is one int32 array or a
    tuple of them (compared lexicographically, the index last). Exact for every int32 value.

    Loop-free, in one of two static shapes. Short arrays: unrolled rounds (:func:`_rounds`). Long
    ones (``size > _TWO_LEVEL_ABOVE``): the array is cut into rows of ``w ~ sqrt(size / num_out)
    / 2`` entries; the answer lies in the ``num_out`` rows with the smallest ``(row minimum,
    row)`` (the row minimum lexicographic over the keys; a row holding none of the first
    ``num_out`` tuples has its first one after all of them), so rounds over the row minima pick
    those rows and rounds over their ``num_out * w`` entries finish: about ``size + 2.5 *
    sqrt(size * num_out)`` entries read instead of ``num_out * size``.
    """
    keys = _as_keys(keys)
    size = candidate.shape[0]
    if size <= _TWO_LEVEL_ABOVE or num_out == 0:
        return _rounds(keys, candidate, num_out)
    # Half the w that balances the two levels' entries: the merges now run over sorted groups
    # and the rows' pass is cheap, so narrower rows win (measured on XLA:CPU at K' = 8:
    # S = 2048 w = 8 about 20% faster than w = 16, S = 1024 w = 8 faster than 16, no
    # measurable difference at S = 512 and 4096).
    width = 1 << max(0, math.ceil(math.log2(math.sqrt(size / num_out))) - 1)
    num_rows = -(-size // width)
    pad = num_rows * width - size
    keys = tuple(jnp.pad(key, (0, pad)).reshape(num_rows, width) for key in keys)
    candidate = jnp.pad(candidate, (0, pad)).reshape(num_rows, width)
    # Each row's lexicographic minimum: the smallest first key, then the smallest second key
    # among the entries holding it, and so on.
    row_keys, holding = [], candidate
    for j, key in enumerate(keys):
        row_min = jnp.min(jnp.where(holding, key, INT32_MAX), axis=1)
        row_keys.append(row_min)
        if j + 1 < len(keys):
            holding = holding & (key == row_min[:, None])
    # Rows cover ascending index ranges, so (row minimum, row) orders rows like their first tuples.
    rows = _rounds(tuple(row_keys), jnp.any(candidate, axis=1), min(num_out, num_rows))
    taken = jnp.maximum(rows, 0)
    index = taken[:, None] * width + lax.iota(jnp.int32, width)[None, :]
    return _rounds(tuple(key[taken].reshape(-1) for key in keys),
                   (candidate[taken] & (rows >= 0)[:, None]).reshape(-1), num_out,
                   index.reshape(-1))


def smallest_values(values, candidate, num_out: int):
    """The ``num_out`` smallest ``values`` among ``candidate`` entries, ascending, as
    int32[num_out]; -1 past the number of candidates. The values must be distinct and in
    ``[0, INT32_MAX)``: each is then its own index, so one key component is compared where
    :func:`first_in_order` would compare two."""
    if candidate.shape[0] <= _TWO_LEVEL_ABOVE or num_out == 0:
        return _rounds((), candidate, num_out, index=values)
    picks = first_in_order(values, candidate, num_out)
    return jnp.where(picks >= 0, values[jnp.maximum(picks, 0)], -1)


def evictable(usage, step, cache_size=None):
    """bool[C]: not touched this step (``usage != step``) and usable (``slot < cache_size``;
    every slot when ``cache_size`` is None)."""
    out = usage != step
    if cache_size is None:
        return out
    return out & (lax.iota(jnp.int32, usage.shape[0]) < cache_size)


def select_victims(usage, step, n, *, num_out, cache_size=None, keys=None):
    """The first ``n`` evictable slots in ascending ``(key..., slot)`` order.

    Args:
      usage: int32[C], after this step's hit refresh.
      step: int32[], this step; a slot whose usage equals it is not evictable.
      n: int32[], traced, ``0 <= n <= num_out``: how many victims to take.
      num_out: static output length, ``<= C``.
      cache_size: int32[], traced, the usable size ``S``: slots at or past it are never victims
        (docs/semantics.md §5.15). ``None``: every slot is usable.
      keys: the eviction policy's victim keys (one int32[C] array or a tuple of them); ``None``:
        ``usage`` alone, the LRU order.

    Returns:
      int32[num_out]: the victims in claim order; entries ``>= n`` are -1 (and so is any entry
      beyond the number of evictable slots, which callers never reach since ``S >= E``).
    """
    # A slot touched this step (a hit) is never a victim, nor is an unusable one.
    out = first_in_order(usage if keys is None else keys, evictable(usage, step, cache_size),
                         num_out)
    return jnp.where(lax.iota(jnp.int32, num_out) < n, out, -1)
