"""Pallas kernel 2, the seed-000 ``PROMOTE_ONE`` decision (docs/semantics.md §5.5, §7):
``promotion(usage, id_of_slot, step, recency_row, miss_mask, fraction16, num_fetch)`` returns
``(expert, slot)``, the first miss in recency order (largest recency, ties to the lowest id) and
the first victim (the argmin evictable usable slot, as :mod:`~pallas_cache.kernels.victims`), or
``(-1, -1)`` unless ``fraction16 > 0``, ``num_fetch == 0``, some expert missed, that miss was
routed before (``recency >= 0``) and that slot is empty. The static conditions (RECENCY order,
PROMOTE_ONE admission) are the caller's; the core of ``ensure_hybrid`` reads the same decision
from the victims it computes anyway, so this kernel is the standalone form of the rule. The
``O(E)`` conditions run first and the ``O(S)`` pool scan only under a ``lax.cond`` when they
hold (on the device, no host round trip). Triton lowering with explicit ``compiler_params``;
``interpret=True`` on the CPU; one program per cache under ``jax.vmap``. Port notes:
docs/design.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_cache.kernels import common
from pallas_cache.kernels.common import INT32_MAX, INT32_MIN

__all__ = ["promotion"]


def promotion_kernel(
    usage_ref,  # i32[S]
    id_ref,  # i32[S]
    step_ref,  # i32[1]
    rec_ref,  # i32[E]
    miss_ref,  # i32[E], nonzero = missing
    frac_ref,  # i32[1]
    nfetch_ref,  # i32[1]
    size_ref,  # i32[1]: the usable size; slots at or past it are never the victim
    out_ref,  # i32[2]: (expert, slot)
    *,
    block: int,  # power of two: the reduction width over the slots
):
    # First miss in recency order: max recency among misses, ties to the lowest expert id.
    e_width = common.next_pow2(rec_ref.shape[0])
    rec, eidx, real = common.load_block(rec_ref, 0, e_width)
    miss_flag, _, _ = common.load_block(miss_ref, 0, e_width)
    miss = real & (miss_flag != 0)
    best_rec = jnp.max(jnp.where(miss, rec, INT32_MIN))
    first = jnp.min(jnp.where(miss & (rec == best_rec), eidx, INT32_MAX))
    candidate = ((frac_ref[0] > 0) & (nfetch_ref[0] == 0) & (first != INT32_MAX)
                 & (best_rec >= 0))

    def victim_if_empty(_):
        # The argmin evictable slot (the first victim), kept only if it is empty.
        pre = common.preload(usage_ref, block=block)
        _, victim = common.next_evictable(usage_ref, step_ref[0], None, None, block=block,
                                          preloaded=pre, limit=size_ref[0])
        has_victim = victim != INT32_MAX
        victim = jnp.where(has_victim, victim, 0)
        return jnp.where(has_victim & (id_ref[victim] == -1), victim, -1)

    def no_slot(first):
        # Computed from an operand: the Triton lowering of cond cannot yield a bare literal.
        return first * 0 - 1

    slot = lax.cond(candidate, victim_if_empty, no_slot, first)
    fire = candidate & (slot >= 0)
    lane = lax.iota(jnp.int32, 2)
    out_ref[...] = jnp.where(fire, jnp.where(lane == 0, first, slot), -1)


def promotion_call(usage, id_of_slot, step, recency_row, miss_mask, fraction16, num_fetch, *,
                   interpret: bool, debug: bool, block: int | None = None, cache_size=None):
    """Unjitted body of :func:`promotion`; ``block`` overrides the reduction width over the slots
    (tests use a small one to exercise the blocked scan on the interpreter)."""
    usage = common.check_vector_i32(usage, "usage")
    id_of_slot = common.check_vector_i32(id_of_slot, "id_of_slot")
    recency_row = common.check_vector_i32(recency_row, "recency_row")
    if not hasattr(miss_mask, "dtype"):
        miss_mask = jnp.asarray(miss_mask)
    if miss_mask.ndim != 1:
        raise ValueError(f"miss_mask must be 1-D, got shape {miss_mask.shape}")
    if miss_mask.dtype not in (jnp.bool_, jnp.int32):
        raise TypeError(f"miss_mask must be bool or int32, got dtype {miss_mask.dtype}")
    size = usage.shape[0]
    num_experts = recency_row.shape[0]
    if id_of_slot.shape != usage.shape:
        raise ValueError(f"id_of_slot shape {id_of_slot.shape} != usage shape {usage.shape}")
    if miss_mask.shape != recency_row.shape:
        raise ValueError(
            f"miss_mask shape {miss_mask.shape} != recency_row shape {recency_row.shape}")
    step = common.as_scalar_i32(step, "step")
    fraction16 = common.as_scalar_i32(fraction16, "fraction16")
    num_fetch = common.as_scalar_i32(num_fetch, "num_fetch")
    limit = common.as_scalar_i32(size if cache_size is None else cache_size, "cache_size")
    if size == 0 or num_experts == 0:
        none = jnp.int32(-1)
        return none, none
    block = (common.default_block(size, interpret) if block is None
             else common.check_block(block, size))
    out = pl.pallas_call(
        functools.partial(promotion_kernel, block=block),
        out_shape=jax.ShapeDtypeStruct((2,), jnp.int32),
        grid=(),
        compiler_params=common.compiler_params(block),
        interpret=interpret,
        debug=debug,
        name="pallas_cache_promotion",
    )(usage, id_of_slot, step, recency_row, miss_mask.astype(jnp.int32), fraction16, num_fetch,
      limit)
    return out[0], out[1]


@functools.partial(jax.jit, static_argnames=("interpret", "debug"))
def promotion(usage: jax.Array, id_of_slot: jax.Array, step: jax.Array,
              recency_row: jax.Array, miss_mask: jax.Array, fraction16: jax.Array,
              num_fetch: jax.Array, *, interpret: bool = False,
              debug: bool = False, cache_size=None) -> tuple[jax.Array, jax.Array]:
    """The seed-000 ``PROMOTE_ONE`` decision for one ``ensure_hybrid`` call.

    Args:
      usage: ``i32[S]`` per-slot LRU stamps (hits of this call already refreshed to ``step``).
      id_of_slot: ``i32[S]`` slot occupants, ``-1`` = empty.
      step: ``i32[]`` the current step (``usage == step`` is not evictable).
      recency_row: ``i32[E]`` the layer's recency **before** this call (``-1`` = never routed).
      miss_mask: ``bool[E]`` or ``i32[E]`` (nonzero) -- the distinct missing experts.
      fraction16: ``i32[]`` the policy fraction in 1/65536 units (``0`` = fixed cap).
      num_fetch: ``i32[]`` the split's fetch count ``F``.
      interpret: run the kernel with the Pallas interpreter (CPU).
      debug: print the kernel jaxpr (and the Triton IR when lowering for GPU).
      cache_size: ``i32[]`` the usable size (traced): slots at or past it are never the victim;
        ``None``: every slot.

    Returns:
      ``(expert, slot)`` ``i32[]`` each: the promoted layer-local expert and its slot, or
      ``(-1, -1)``.

    Raises:
      TypeError / ValueError at trace time: wrong rank, dtype or mismatched shapes.
    """
    return promotion_call(usage, id_of_slot, step, recency_row, miss_mask, fraction16, num_fetch,
                          interpret=interpret, debug=debug, cache_size=cache_size)
