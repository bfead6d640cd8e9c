"""Pallas kernel 2 (docs/semantics.md §5.5, §7): the seed-000 ``PROMOTE_ONE`` decision.

``promotion(usage, id_of_slot, step, recency_row, miss_mask, fraction16, num_fetch)`` returns
``(expert, slot)``, both ``i32[]``: the one miss to promote and the slot it goes to, or
``(-1, -1)`` when the rule does not fire. It fires iff **all** hold:

* ``fraction16 > 0`` (the policy is a fraction) and ``num_fetch == 0`` (the split chose
  ``F == 0``);
* at least one expert is missing (``miss_mask``);
* the argmin evictable slot -- the lowest ``(usage, slot)`` among slots with ``usage != step``,
  ties to the lowest slot, exactly the first victim of :func:`~pallas_cache.kernels.victims` --
  exists and is **empty** (``id_of_slot == -1``);
* the first miss in recency order -- the maximum ``recency_row`` among misses, ties to the
  lowest expert id -- has ``recency >= 0`` (it was routed before; a first-time miss is never
  promoted, and a recurring miss is found even among first-time misses with lower ids).

Then ``expert`` is that first miss (layer-local id) and ``slot`` that victim. The remaining
conditions of docs/semantics.md §5.5 (order is ``RECENCY``, admission is ``PROMOTE_ONE``) are static and are
the caller's business. The kernel checks the cheap ``O(E)`` conditions first and runs the
``O(S)`` pool scan under a ``lax.cond`` only when they all hold. Every ``int32`` value is handled
exactly (validity is a separate mask, never a sentinel folded into the values).

Shapes: the wrapper pads ``usage``/``id_of_slot`` to ``next_pow2(S)`` and ``recency_row``/
``miss_mask`` to ``next_pow2(E)`` (zeros; padded lanes are masked out statically inside the
kernel) -- the Triton lowering needs power-of-two tensors. ``miss_mask`` may be bool or int32
(nonzero = missing); it is passed to the kernel as int32. Scalars travel as ``i32[1]``; the
result is one ``i32[2]`` block ``(expert, slot)``.

Backends: ``interpret=True`` runs the Pallas HLO interpreter (CPU tests); otherwise Triton, with
an explicit ``jax.experimental.pallas.triton.CompilerParams`` (a bare ``pallas_call`` on a GPU
would pick Mosaic GPU, the default of ``jax_pallas_use_mosaic_gpu``). JAX 0.11 deprecates the
Triton backend; this module keeps using it while it exists. A **Mosaic GPU** port would need the
same as the victims kernel (inputs copied into SMEM instead of masked pointer loads,
warpgroup-sized vectors of a multiple of 128 lanes with warpgroup reductions, scalars in SMEM)
plus a dynamic SMEM read of ``id_of_slot[victim]``.

Under ``jax.vmap`` the ``pallas_call`` batching rule adds a grid axis (one program per cache).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_cache.kernels.victims import (
    INT32_MAX,
    INT32_MIN,
    _as_scalar_i32,
    _check_block,
    _check_vector_i32,
    _next_pow2,
    _num_warps,
    _pad_to,
    default_block,
    next_evictable,
    preload,
)

__all__ = ["promotion"]


def promotion_kernel(usage_ref, id_ref, step_ref, rec_ref, miss_ref, frac_ref, nfetch_ref,
                     out_ref, *, size: int, num_experts: int, block: int):
    """Kernel over refs: ``usage_ref``/``id_ref`` ``i32[S_pad]``, ``rec_ref``/``miss_ref``
    ``i32[E_pad]``, scalars ``i32[1]``; writes ``out_ref i32[2] = (expert, slot)``."""
    # First miss in recency order: max recency among misses, ties to the lowest expert id.
    e_pad = rec_ref.shape[0]
    eidx = lax.iota(jnp.int32, e_pad)
    miss = (eidx < num_experts) & (miss_ref[...] != 0)
    rec = rec_ref[...]
    best_rec = jnp.max(jnp.where(miss, rec, INT32_MIN))
    first = jnp.min(jnp.where(miss & (rec == best_rec), eidx, INT32_MAX))
    candidate = ((frac_ref[0] > 0) & (nfetch_ref[0] == 0) & (first != INT32_MAX)
                 & (best_rec >= 0))

    def victim_if_empty(_):
        # The argmin evictable slot (the first victim), kept only if it is empty.
        step = step_ref[0]
        pre = preload(usage_ref, size=size, block=block)
        _, victim = next_evictable(usage_ref, step, None, None, size=size, block=block,
                                   preloaded=pre)
        has_victim = victim != INT32_MAX
        victim = jnp.where(has_victim, victim, 0)
        return jnp.where(has_victim & (id_ref[victim] == -1), victim, -1)

    def no_slot(first):
        # Computed from an operand: the Triton lowering of cond cannot yield a bare literal.
        return first * 0 - 1

    # The pool scan (the only O(S) part) runs only when everything else already holds.
    slot = lax.cond(candidate, victim_if_empty, no_slot, first)
    fire = candidate & (slot >= 0)
    lane = lax.iota(jnp.int32, 2)
    out_ref[...] = jnp.where(fire, jnp.where(lane == 0, first, slot), -1)


def promotion_call(usage, id_of_slot, step, recency_row, miss_mask, fraction16, num_fetch, *,
                   interpret: bool, debug: bool, block: int | None = None):
    """Unjitted body of :func:`promotion`; ``block`` overrides the reduction width over the slots
    (tests use a small one to exercise the blocked scan on the interpreter)."""
    usage = _check_vector_i32(usage, "usage")
    id_of_slot = _check_vector_i32(id_of_slot, "id_of_slot")
    recency_row = _check_vector_i32(recency_row, "recency_row")
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
    step = _as_scalar_i32(step, "step")
    fraction16 = _as_scalar_i32(fraction16, "fraction16")
    num_fetch = _as_scalar_i32(num_fetch, "num_fetch")
    if size == 0 or num_experts == 0:
        none = jnp.int32(-1)
        return none, none
    size_pad = _next_pow2(size)
    e_pad = _next_pow2(num_experts)
    block = (default_block(size_pad, interpret) if block is None
             else _check_block(block, size_pad))
    kernel = functools.partial(promotion_kernel, size=size, num_experts=num_experts,
                               block=block)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((2,), jnp.int32),
        grid=(),
        compiler_params=plgpu.CompilerParams(num_warps=_num_warps(block), num_stages=1),
        interpret=interpret,
        debug=debug,
        name="pallas_cache_promotion",
    )(_pad_to(usage, size_pad), _pad_to(id_of_slot, size_pad), step,
      _pad_to(recency_row, e_pad), _pad_to(miss_mask.astype(jnp.int32), e_pad),
      fraction16, num_fetch)
    return out[0], out[1]


@functools.partial(jax.jit, static_argnames=("interpret", "debug"))
def promotion(usage: jax.Array, id_of_slot: jax.Array, step: jax.Array,
              recency_row: jax.Array, miss_mask: jax.Array, fraction16: jax.Array,
              num_fetch: jax.Array, *, interpret: bool = False,
              debug: bool = False) -> tuple[jax.Array, jax.Array]:
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

    Returns:
      ``(expert, slot)`` ``i32[]`` each: the promoted layer-local expert and its slot, or
      ``(-1, -1)``.

    Raises:
      TypeError / ValueError at trace time: wrong rank, dtype or mismatched shapes.
    """
    return promotion_call(usage, id_of_slot, step, recency_row, miss_mask, fraction16, num_fetch,
                          interpret=interpret, debug=debug)
