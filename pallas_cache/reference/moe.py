"""The reference of ``pallas_cache.moe.apply_copy_plan``: a plan's copies as a NumPy loop (§5.13)."""

from __future__ import annotations

import numpy as np


def apply_copy_plan(pool, host_bank, plan, *, layer=None, traced=False):
    """The new pool after ``pool[dst_slots[i]] = host_bank[src_rows[i]]`` for every counted entry.

    ``pool`` and ``host_bank`` are NumPy arrays or dicts of them (leaves ``[S, ...]`` and
    ``[E, ...]``, or ``[L, E, ...]`` with ``layer``). A counted entry is one with ``i < count``,
    ``dst_slots[i] >= 0`` and ``src_rows[i] >= 0``. A layer outside ``[0, L)`` or a counted entry
    whose slot is outside ``[0, S)`` or whose row is outside ``[0, E)`` raises ``ValueError``, as
    the JAX function does for concrete values; ``traced=True`` gives the rule for values it
    cannot see: such an entry copies nothing, and such a layer returns the pool unchanged.
    """
    copy = getattr(plan, "copy", plan)
    if isinstance(pool, dict):
        return {key: apply_copy_plan(pool[key], host_bank[key], copy, layer=layer, traced=traced)
                for key in pool}
    pool, bank = np.array(pool), np.asarray(host_bank)
    if layer is not None:
        if not 0 <= layer < bank.shape[0]:
            if not traced:
                raise ValueError(f"layer {layer} is outside [0, {bank.shape[0]})")
            return pool
        bank = bank[layer]
    dst, src = np.asarray(copy.dst_slots), np.asarray(copy.src_rows)
    for i in range(min(int(copy.count), dst.shape[0])):
        if dst[i] < 0 or src[i] < 0:
            continue  # padding
        if dst[i] >= pool.shape[0] or src[i] >= bank.shape[0]:
            if not traced:
                raise ValueError(f"copy entry {i} ({dst[i]}, {src[i]}) is out of range")
            continue
        pool[dst[i]] = bank[src[i]].astype(pool.dtype)
    return pool
