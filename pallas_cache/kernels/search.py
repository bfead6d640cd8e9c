"""The fused step's searches over the slot pool (the kernel's twin of pallas_cache/selection.py):
the first ``need`` victims in ``(key, slot)`` order of a pool of one block or streamed over
several, and the clock rebase's renumbering of every live stamp in place (docs/semantics.md
§5.12)."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_cache.kernels import common
from pallas_cache.kernels.common import INT32_MAX, INT32_MIN


def _candidate(key, index, prev_key, prev_index):
    """A pool block's slots still in the search: eligible (``index`` is ``INT32_MAX`` for a slot
    that is not: one vector, not an index and a mask, to spare registers) and strictly after
    ``(prev_key..., prev_index)``."""
    return (index != INT32_MAX) & common.after(key, index, prev_key, prev_index)


def _next(key, index, start, prev_key, prev_i, *, block):
    """``common.lex_min(key, index, _candidate(key, index, prev_key, prev_i))`` over the block
    of ``block`` slots at ``start``, ``(key, i)`` scalars, ``i`` = ``INT32_MAX`` when no slot is
    left. A key of one component (LRU) takes one reduction, not two: every candidate's key is at
    least the previous round's, so its offset from that key and its position pack into one
    int32, ordered as ``(key, slot)``, and one minimum finds both, exactly, when the smallest
    candidate's offset fits ``31 - log2(block)`` bits. When it does not (a block's first round,
    whose floor is ``INT32_MIN``; a gap of ``2**19 - 1`` or more between two successive keys of a
    block of 4096) or no slot is left, the two reductions decide, in a branch the other rounds
    skip. (A first round that took the block's smallest key as its floor would need that
    reduction under a condition, which the compiler turns into predicated barriers.)"""
    cand = _candidate(key, index, prev_key, prev_i)
    if len(key) > 1:
        return common.lex_min(key, index, cand)
    (k,) = key
    floor = prev_key[0]
    shift = block.bit_length() - 1
    offset = (k - floor).astype(jnp.uint32)  # the true difference where k >= floor
    fits = cand & (k >= floor) & (offset < jnp.uint32((1 << (31 - shift)) - 1))
    packed = jnp.where(fits, (offset.astype(jnp.int32) << shift) | lax.iota(jnp.int32, block),
                       INT32_MAX)
    least = jnp.min(packed)
    return lax.cond(least != INT32_MAX,
                    lambda: ((floor + (least >> shift),), start + (least & (block - 1))),
                    lambda: common.lex_min(key, index, cand))


def victims_one_block(pool_block, id_of_slot_ref, need, o_idx, *, width, block):
    """The first ``need`` victims of a pool of one block, ``(victims, usage, occupants)``
    [o_width], -1 padded: the block is loaded once and each round takes its smallest key
    strictly after the previous round's; the occupants are gathered once, after the rounds."""
    key, index = pool_block(0, block)
    minus = jnp.full(o_idx.shape, -1, jnp.int32)

    def victim_cond(carry):
        count, _, _, done, *_ = carry
        return (count < need) & ~done

    def victim_round(carry):
        count, prev_key, prev_i, done, victims, vusage = carry
        m, i = _next(key, index, jnp.int32(0), prev_key, prev_i, block=block)
        found = i != INT32_MAX
        at = found & (o_idx == count)
        return (count + found.astype(jnp.int32), m, i, ~found, jnp.where(at, i, victims),
                jnp.where(at, m[-1], vusage))

    start_key = (jnp.int32(INT32_MIN),) * width
    _, _, _, _, victims, vusage = lax.while_loop(
        victim_cond, victim_round,
        (jnp.int32(0), start_key, jnp.int32(-1), jnp.bool_(False), minus, minus))
    occupants = plgpu.load(id_of_slot_ref.at[jnp.maximum(victims, 0)], mask=victims >= 0, other=-1)
    return victims, vusage, occupants


def victims_streamed(pool_block, pool_load, id_of_slot_ref, need, o_idx, *, width, block,
                     num_loads, prefetch: bool):
    """:func:`victims_one_block` for a pool of several blocks, in one pass over it: each block
    is loaded once (with ``prefetch``, the next one's loads issued before this one's rounds)
    and yields its keys in ascending order into a set of the ``need`` smallest seen so far until
    its next key would not enter; the set is sorted at the end ([picks, picks] rank). The set's
    worst member is kept as scalars: a key entering a set that is not full raises it to the
    larger of the two, one entering a full set replaces it and the new worst is the set's
    maximum, a reduction over the picks only on such an entry."""
    o_width, num_blocks = o_idx.shape[0], -(-id_of_slot_ref.shape[0] // block)
    none = jnp.full((o_width,), INT32_MAX, jnp.int32)
    lowest = (jnp.int32(INT32_MIN),) * width

    def block_pass(b, carry):
        start = pl.multiple_of(b * block, block)
        *carry, loaded = carry
        if prefetch:
            # The first block's loads here (the others came with the block before): a call
            # that searches no victim runs no block and issues none.
            first = pool_load(start, block, when=b == 0)
            loaded = tuple(jnp.where(b == 0, x, y) for x, y in zip(first, loaded))
            ahead = pool_load(start + block, block)  # masked off past the pool
        else:
            loaded = ahead = pool_load(start, block)
        key, index = pool_block(start, block, loaded)

        def victim_round(c):
            best_key, best_i, count, worst_key, worst_i, prev_key, prev_i, _ = c
            m, i = _next(key, index, start, prev_key, prev_i, block=block)
            full = count >= need
            enters = (i != INT32_MAX) & (~full | common.after(worst_key, worst_i, m, i))
            at = enters & jnp.where(full, best_i == worst_i, o_idx == count)
            best_key = tuple(jnp.where(at, x, y) for x, y in zip(m, best_key))
            best_i = jnp.where(at, i, best_i)

            def new_worst():
                return common.lex_max(best_key, best_i, o_idx < count)

            raise_to = enters & common.after(m, i, worst_key, worst_i)
            worst_key, worst_i = lax.cond(
                enters & full, new_worst,
                lambda: (tuple(jnp.where(raise_to, x, y) for x, y in zip(m, worst_key)),
                         jnp.where(raise_to, i, worst_i)))
            return (best_key, best_i, count + (enters & ~full).astype(jnp.int32), worst_key,
                    worst_i, m, i, enters)

        best_key, best_i, count, worst_key, worst_i = carry
        best_key, best_i, count, worst_key, worst_i, *_ = lax.while_loop(
            lambda c: c[-1], victim_round,
            (best_key, best_i, count, worst_key, worst_i, lowest, jnp.int32(-1), need > 0))
        return best_key, best_i, count, worst_key, worst_i, ahead

    # No block at all when no victim is searched (the loads would be masked off anyway).
    best_key, best_i, count, *_ = lax.fori_loop(
        0, jnp.where(need > 0, jnp.int32(num_blocks), jnp.int32(0)), block_pass,
        ((none,) * width, none, jnp.int32(0), lowest, jnp.int32(INT32_MIN),
         (jnp.zeros((block,), jnp.int32),) * num_loads))
    filled = o_idx < count
    ahead = filled[None, :] & common.after(tuple(k[:, None] for k in best_key), best_i[:, None],
                                     tuple(k[None, :] for k in best_key), best_i[None, :])
    rank = jnp.sum(ahead.astype(jnp.int32), axis=1)
    placed = (rank[None, :] == o_idx[:, None]) & filled[None, :]
    victims = jnp.max(jnp.where(placed, best_i[None, :], -1), axis=1)
    vusage = jnp.max(jnp.where(placed, best_key[-1][None, :], INT32_MIN), axis=1)
    occupants = plgpu.load(id_of_slot_ref.at[jnp.maximum(victims, 0)], mask=victims >= 0, other=-1)
    return victims, jnp.where(victims >= 0, vusage, -1), occupants


def rebase(usage_ref, recency_ref, usage_out, recency_out, step0, *, block, stamp_block):
    """Renumber every live stamp (usage >= 1, recency >= 0, the clock) to its dense rank, in
    place; returns the clock's rank. One pass per distinct value, ascending: pass ``r`` writes
    rank ``r`` over the entries holding the ``r``-th smallest value ``m_r`` and finds
    ``m_{r+1}``, the smallest live value above ``m_r``. A rank never exceeds its value (every
    live stamp of a reachable state is >= 1), so an entry already renumbered is never above
    ``m_r`` and a pass reads the same candidates whether it sees the entry before or after its
    write. O(N) per distinct value, O(N^2) in all: it runs about once per threshold calls."""
    parts = ((usage_ref, usage_out, 1, block), (recency_ref, recency_out, 0, stamp_block))

    def one_pass(carry):
        m, r, _, rank_step = carry

        def scan(src, dst, low, width):
            size = math.prod(src.shape)
            def body(b, best):
                start = pl.multiple_of(b * width, width)
                index = start + lax.iota(jnp.int32, width)  # row-major over [L, E] stamps
                valid = index < size
                v = plgpu.load(common.flat_at(src, index), mask=valid, other=low - 1)
                live = valid & (v >= low)
                plgpu.store(common.flat_at(dst, index), jnp.full((width,), r),
                            mask=live & (v == m) & (r >= 1))
                above = live & (v > m)
                return (jnp.minimum(best[0], jnp.min(jnp.where(above, v, INT32_MAX))),
                        best[1] | common.any_true(above))

            return lax.fori_loop(0, -(-size // width), body,
                                 (jnp.int32(INT32_MAX), jnp.bool_(False)))

        nxt, found = jnp.where(step0 > m, step0, INT32_MAX), step0 > m
        for src, dst, low, width in parts:
            part_min, part_found = scan(src, dst, low, width)
            nxt, found = jnp.minimum(nxt, part_min), found | part_found
        rank_step = jnp.where((r >= 1) & (step0 == m), r, rank_step)
        return nxt, r + 1, found, rank_step

    _, _, _, rank_step = lax.while_loop(
        lambda carry: carry[2], one_pass,
        (jnp.int32(INT32_MIN), jnp.int32(0), jnp.bool_(True), jnp.int32(0)))
    return rank_step
