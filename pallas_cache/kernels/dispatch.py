"""The ``backend=`` switch of the ops and the loop-free XLA victim search (docs/semantics.md §7).

``backend`` is static: ``"xla"`` (the XLA step, pure ``jnp``), ``"pallas"`` (the whole step as
one fused Pallas kernel, :mod:`~pallas_cache.kernels.step`, Triton lowering, GPU) or
``"interpret"`` (that kernel under the Pallas interpreter, for CPU tests); ``None`` resolves to
``"pallas"`` on a GPU whose JAX has the Pallas Triton backend and to ``"xla"`` elsewhere, and all
backends give identical results. The XLA search is loop-free (docs/semantics.md §7.1):
:func:`first_in_order` unrolls ``num_out`` fixed "next pair after the previous one" argmin
rounds, because on XLA:CPU a sort, ``top_k`` or an all-pairs rank over a pool costs 5-50x more
than a handful of masked reductions, and a data-dependent ``while_loop`` would read its predicate
back to the host on a GPU (docs/design.md, "A loop-free step").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_cache.validate import INT32_MAX

__all__ = [
    "BACKENDS", "argmin_among", "first_in_order", "has_pallas_triton", "promotion_decision",
    "resolve_backend",
    "select_victims",
]

BACKENDS = ("xla", "pallas", "interpret")
# Arrays up to this length take the single-pass argmin (see _next_pair).
_SINGLE_PASS_MAX = 1024
# Arrays longer than this take the two-level first_in_order.
_TWO_LEVEL_ABOVE = 256
# Pairs one round of first_in_order keeps (measured on XLA:CPU: one 8-wide reduction over 64
# slots costs about a third of eight 1-wide ones).
_ROUND_WIDTH = 8


def has_pallas_triton() -> bool:
    """Whether the installed JAX has the Pallas Triton backend the fused kernel lowers through."""
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend) -> str:
    """``None`` -> ``"pallas"`` on GPU (with the Pallas Triton backend), else ``"xla"``; anything
    unknown raises ValueError, and so does an explicit ``"pallas"``/``"interpret"`` on a JAX
    without the Pallas Triton backend."""
    if backend is None:
        return "pallas" if jax.default_backend() == "gpu" and has_pallas_triton() else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS} or None")
    if backend != "xla" and not has_pallas_triton():
        raise ValueError(f"backend {backend!r} needs the Pallas Triton backend "
                         f"(jax.experimental.pallas.triton), which this JAX {jax.__version__} "
                         f"lacks; use backend='xla'")
    return backend


def argmin_among(values, candidate):
    """The lowest index among ``candidate`` entries holding the smallest value, or -1 if none.

    Exact for every int32 value (no sentinel is folded into the values: a non-candidate's index is
    moved past every candidate's instead). With ``~values`` (bitwise not, an order-reversing map
    with no overflow) it is the "largest value, lowest index" of the fetch order.
    """
    _, best = _next_pair(values, candidate, None, None)
    return jnp.where(best == INT32_MAX, -1, best).astype(jnp.int32)


def _next_pair(values, candidate, prev_value, prev_index, index=None):
    """The smallest ``(value, index)`` among ``candidate`` entries strictly after the pair
    ``(prev_value, prev_index)`` (no bound when they are None), as ``(value, index)``; the index
    is ``INT32_MAX`` when there is none. ``index`` defaults to the positions; explicit indices
    must be distinct and below ``INT32_MAX``.

    Two formulations, chosen by the static length (measured on XLA:CPU, where a step's cost is
    mostly its number of kernels): up to ``_SINGLE_PASS_MAX`` entries one lexicographic reduction
    over (value, index) pairs; above it, two plain reductions (the minimum, then the lowest index
    holding it), which XLA vectorises better on long arrays.
    """
    size = values.shape[0]
    if index is None:
        index = lax.iota(jnp.int32, size)
    if prev_value is not None:
        candidate = candidate & (
            (values > prev_value) | ((values == prev_value) & (index > prev_index)))
    if size <= _SINGLE_PASS_MAX:
        def smaller(a, b):
            a_first = (a[0] < b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
            return jnp.where(a_first, a[0], b[0]), jnp.where(a_first, a[1], b[1])

        return lax.reduce(
            (jnp.where(candidate, values, INT32_MAX), jnp.where(candidate, index, INT32_MAX)),
            (jnp.int32(INT32_MAX), jnp.int32(INT32_MAX)), smaller, (0,))
    smallest = jnp.min(jnp.where(candidate, values, INT32_MAX))
    return smallest, jnp.min(jnp.where(candidate & (values == smallest), index, INT32_MAX))


def _before(a_value, a_index, b_value, b_index):
    return (a_value < b_value) | ((a_value == b_value) & (a_index < b_index))


def _merge_smallest(k):
    """The ``lax.reduce`` combiner keeping the ``k`` smallest (value, index) pairs, sorted: from two
    sorted k-lists, ``min(a[i], b[k-1-i])`` is a bitonic sequence of the k smallest, which a
    ``log2(k)``-stage bitonic network sorts. Operands: k values, then k indices."""
    def merge(a, b):
        value = [None] * k
        index = [None] * k
        for i in range(k):
            take_a = _before(a[i], a[k + i], b[k - 1 - i], b[2 * k - 1 - i])
            value[i] = jnp.where(take_a, a[i], b[k - 1 - i])
            index[i] = jnp.where(take_a, a[k + i], b[2 * k - 1 - i])
        span = k // 2
        while span:
            for i in range(k):
                if not i & span:
                    j = i + span
                    swap = _before(value[j], index[j], value[i], index[i])
                    value[i], value[j] = (jnp.where(swap, value[j], value[i]),
                                          jnp.where(swap, value[i], value[j]))
                    index[i], index[j] = (jnp.where(swap, index[j], index[i]),
                                          jnp.where(swap, index[i], index[j]))
            span //= 2
        return tuple(value) + tuple(index)
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


def _smallest_sorted(values, index, live, k):
    """The ``k`` smallest ``(value, index)`` pairs among ``live`` entries, ascending, as a tuple of
    ``k`` values then ``k`` indices (``INT32_MAX`` pairs past the live ones).

    The entries are dealt into ``k`` lanes of ``ceil(size / k)``; a sorting network over the lanes
    (elementwise, so XLA vectorises it across groups) leaves every group of ``k`` a sorted list,
    and one ``lax.reduce`` of :func:`_merge_smallest` merges the ``size / k`` lists. The merge is
    the costly part (scalar, about 80 operations per element), so reducing sorted groups instead
    of single pairs cuts it ``k``-fold: measured on XLA:CPU, about half the time of the
    single-pair reduction at 64 and 128 entries.
    """
    size = values.shape[0]
    groups = -(-size // k)
    pad = groups * k - size
    value = jnp.pad(jnp.where(live, values, INT32_MAX), (0, pad), constant_values=INT32_MAX)
    slot = jnp.pad(jnp.where(live, index, INT32_MAX), (0, pad), constant_values=INT32_MAX)
    value = [value[j * groups:(j + 1) * groups] for j in range(k)]
    slot = [slot[j * groups:(j + 1) * groups] for j in range(k)]
    for a, b in _sorting_network(k):
        swap = _before(value[b], slot[b], value[a], slot[a])
        value[a], value[b] = (jnp.where(swap, value[b], value[a]),
                              jnp.where(swap, value[a], value[b]))
        slot[a], slot[b] = jnp.where(swap, slot[b], slot[a]), jnp.where(swap, slot[a], slot[b])
    # The barrier keeps XLA from fusing the network into the reduction, which would recompute
    # it per operand and per element.
    lists = lax.optimization_barrier(tuple(value) + tuple(slot))
    return lax.reduce(lists, (jnp.int32(INT32_MAX),) * (2 * k), _merge_smallest(k), (0,))


def _rounds(values, candidate, num_out, index=None):
    """The first ``num_out`` candidate pairs in ``ceil(num_out / k)`` unrolled rounds of one
    reduction each, ``k = min(_ROUND_WIDTH, next_pow2(num_out))``: round ``r`` keeps the ``k``
    smallest pairs strictly after round ``r - 1``'s last (the victims kernel's "strictly after"
    bound, so no knocked-out mask is carried). Entries past the candidates are -1."""
    if num_out == 0:
        return jnp.full((0,), -1, jnp.int32)
    size = values.shape[0]
    if index is None:
        index = lax.iota(jnp.int32, size)
    k = min(_ROUND_WIDTH, 1 << (num_out - 1).bit_length())
    picks, last_value, last_index = [], None, None
    for _ in range(-(-num_out // k)):
        live = candidate
        if last_value is not None:
            live = live & ((values > last_value) | ((values == last_value) & (index > last_index)))
        best = _smallest_sorted(values, index, live, k)
        picks.extend(best[k:])
        last_value, last_index = best[k - 1], best[2 * k - 1]
    picks = jnp.stack(picks[:num_out])
    return jnp.where(picks == INT32_MAX, -1, picks).astype(jnp.int32)


def first_in_order(values, candidate, num_out: int):
    """The indices of the first ``num_out`` ``candidate`` entries in ascending ``(value, index)``
    order, as int32[num_out]; -1 past the number of candidates. Exact for every int32 value.

    Loop-free, in one of two static shapes. Short arrays: ``num_out`` unrolled argmin rounds
    (:func:`_rounds`). Long ones (``size > _TWO_LEVEL_ABOVE``): the array is cut into rows of
    ``w ~ sqrt(size / num_out) / 2`` entries; the answer lies in the ``num_out`` rows with the
    smallest row minima (a row holding none of the first ``num_out`` pairs has its minimum after
    all of them), so rounds over the row minima pick those rows and rounds over their
    ``num_out * w`` entries finish: about ``size + 2.5 * sqrt(size * num_out)`` entries read
    instead of ``num_out * size``.
    """
    size = values.shape[0]
    if size <= _TWO_LEVEL_ABOVE or num_out == 0:
        return _rounds(values, candidate, num_out)
    # Half the w that balances the two levels' entries: the merges now run over sorted groups
    # and the rows' pass is cheap, so narrower rows win (measured on XLA:CPU at K' = 8:
    # S = 2048 w = 8 about 20% faster than w = 16, S = 1024 w = 8 faster than 16, no
    # measurable difference at S = 512 and 4096).
    width = 1 << max(0, math.ceil(math.log2(math.sqrt(size / num_out))) - 1)
    num_rows = -(-size // width)
    pad = num_rows * width - size
    values = jnp.pad(values, (0, pad)).reshape(num_rows, width)
    candidate = jnp.pad(candidate, (0, pad)).reshape(num_rows, width)
    row_min = jnp.min(jnp.where(candidate, values, INT32_MAX), axis=1)
    # Rows cover ascending slot ranges, so (row minimum, row) orders rows like their first pairs.
    rows = _rounds(row_min, jnp.any(candidate, axis=1), min(num_out, num_rows))
    taken = jnp.maximum(rows, 0)
    index = taken[:, None] * width + lax.iota(jnp.int32, width)[None, :]
    return _rounds(values[taken].reshape(-1),
                   (candidate[taken] & (rows >= 0)[:, None]).reshape(-1), num_out,
                   index.reshape(-1))


def select_victims(usage, step, n, *, num_out, cache_size=None):
    """The first ``n`` slots in ascending ``(usage, slot)`` order among evictable slots.

    Args:
      usage: int32[C], after this step's hit refresh.
      step: int32[], this step; a slot whose usage equals it is not evictable.
      n: int32[], traced, ``0 <= n <= num_out``: how many victims to take.
      num_out: static output length, ``<= C``.
      cache_size: int32[], traced, the usable size ``S``: slots at or past it are never victims
        (docs/semantics.md §5.15). ``None``: every slot is usable.

    Returns:
      int32[num_out]: the victims in claim order; entries ``>= n`` are -1 (and so is any entry
      beyond the number of evictable slots, which callers never reach since ``S >= E``).
    """
    # A slot touched this step (a hit) is never a victim, nor is an unusable one.
    out = first_in_order(usage, _evictable(usage, step, cache_size), num_out)
    return jnp.where(lax.iota(jnp.int32, num_out) < n, out, -1)


def _evictable(usage, step, cache_size):
    """bool[C]: not touched this step (``usage != step``) and usable (``slot < cache_size``;
    every slot when ``cache_size`` is None)."""
    evictable = usage != step
    if cache_size is None:
        return evictable
    return evictable & (lax.iota(jnp.int32, usage.shape[0]) < cache_size)


def promotion_decision(usage, id_of_slot, step, recency_row, miss_mask, fraction16, num_fetch,
                       *, cache_size=None):
    """The seed-000 PROMOTE_ONE decision (docs/semantics.md §5.5); the caller has checked ``order == RECENCY``.

    Fires iff ``fraction16 > 0``, ``num_fetch == 0``, some expert missed, the argmin evictable
    slot (ascending ``(usage, slot)``, ``usage != step``) is empty (``id_of_slot == -1``), and the
    first miss in recency order (largest pre-call recency, ties to the lowest id) was routed
    before (``recency >= 0``).

    Args:
      usage: int32[S], after this step's hit refresh.
      id_of_slot: int32[S].
      step: int32[], this step.
      recency_row: int32[E], the layer's recency before this call.
      miss_mask: bool[E], the routed experts that are not resident.
      fraction16: int32[], the policy fraction (0 = fixed cap, which never promotes).
      num_fetch: int32[], the split's ``F``.
      cache_size: int32[], traced, the usable size: slots at or past it are never the victim.
        ``None``: every slot is usable.

    Returns:
      ``(expert, slot)`` int32 scalars: the layer-local expert to fetch and the slot it takes,
      or ``(-1, -1)`` when the rule does not fire.
    """
    # The first miss in recency order: the largest recency among misses, lowest id on ties.
    expert = argmin_among(~recency_row, miss_mask)
    recurring = recency_row[jnp.maximum(expert, 0)] >= 0
    candidate = (fraction16 > 0) & (num_fetch == 0) & (expert >= 0) & recurring

    # The argmin evictable slot, kept only if it is empty. Always computed (one reduction): a
    # data-dependent branch would cost a host round trip on a GPU (docs/semantics.md §7.1).
    slot = argmin_among(usage, _evictable(usage, step, cache_size))
    slot = jnp.where(candidate & (slot >= 0) & (id_of_slot[jnp.maximum(slot, 0)] == -1), slot, -1)
    fires = candidate & (slot >= 0)
    expert = jnp.where(fires, expert, -1).astype(jnp.int32)
    return expert, jnp.where(fires, slot, -1).astype(jnp.int32)
