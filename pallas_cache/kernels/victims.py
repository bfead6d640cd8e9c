"""Pallas kernel 1, victim selection (docs/semantics.md §5.2, §7): ``victims(usage, step, n,
num_out=..., cache_size=...)`` returns the first ``n`` slots in ascending ``(usage, slot)`` order
among the evictable slots (``usage != step``: a slot touched this step is never a victim; and
``slot < cache_size``: an unusable slot never is either), as ``i32[num_out]``
with ``-1`` past ``n`` and past the last evictable slot. One program, no grid: round 0 is the
plain argmin and round ``k`` the smallest pair strictly after round ``k - 1``'s, which equals
knocking out every claimed slot with two scalars of carry; the round loop runs on the device, so
its traced trip count costs no host round trip. Exact for every int32 usage (validity is a
separate mask, never a sentinel folded into the values). Triton lowering with explicit
``compiler_params``; ``interpret=True`` runs it on the CPU; under ``jax.vmap`` the
``pallas_call`` batching rule adds one program per cache. Port notes: docs/design.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_cache.kernels import common
from pallas_cache.kernels.common import INT32_MAX

__all__ = ["victims"]


def victims_kernel(
    usage_ref,  # i32[C]
    step_ref,  # i32[1]
    n_ref,  # i32[1]
    size_ref,  # i32[1]: the usable size; slots at or past it are never victims
    out_ref,  # i32[num_out]
    *,
    num_out: int,
    block: int,  # power of two: the reduction width over the slots
):
    out_width = common.next_pow2(num_out)
    step = step_ref[0]
    limit = size_ref[0]
    n = jnp.minimum(jnp.maximum(n_ref[0], 0), num_out)
    pre = common.preload(usage_ref, block=block)
    position = lax.iota(jnp.int32, out_width)

    # Round 0, the plain argmin (no lower bound); recorded only when n >= 1.
    m0, i0 = common.next_evictable(usage_ref, step, None, None, block=block, preloaded=pre,
                                   limit=limit)
    out0 = jnp.where((position == 0) & (n > 0) & (i0 != INT32_MAX), i0, -1)

    def round_body(k, carry):
        prev_u, prev_i, out = carry
        m, i = common.next_evictable(usage_ref, step, prev_u, prev_i, block=block,
                                     preloaded=pre, limit=limit)
        # Once nothing is left, (m, i) = (MAX, MAX) and every later round finds nothing too.
        return m, i, jnp.where(position == k, jnp.where(i == INT32_MAX, -1, i), out)

    _, _, out = lax.fori_loop(1, n, round_body, (m0, i0, out0))
    plgpu.store(out_ref.at[pl.ds(0, out_width)], out, mask=position < num_out)


def victims_call(usage, step, n, *, num_out: int, interpret: bool, debug: bool,
                 block: int | None = None, cache_size=None):
    """Unjitted body of :func:`victims`; ``block`` overrides the reduction width (tests use a
    small one to exercise the blocked scan on the interpreter)."""
    usage = common.check_vector_i32(usage, "usage")
    size = usage.shape[0]
    if not isinstance(num_out, (int, np.integer)) or isinstance(num_out, bool):
        raise TypeError(f"num_out must be a static int, got {num_out!r}")
    num_out = int(num_out)
    if not 0 <= num_out <= size:
        raise ValueError(f"num_out must be in [0, S={size}], got {num_out}")
    step = common.as_scalar_i32(step, "step")
    n = common.as_scalar_i32(n, "n")
    limit = common.as_scalar_i32(size if cache_size is None else cache_size, "cache_size")
    if num_out == 0:
        return jnp.full((0,), -1, jnp.int32)
    block = (common.default_block(size, interpret) if block is None
             else common.check_block(block, size))
    return pl.pallas_call(
        functools.partial(victims_kernel, num_out=num_out, block=block),
        out_shape=jax.ShapeDtypeStruct((num_out,), jnp.int32),
        grid=(),
        compiler_params=common.compiler_params(block),
        interpret=interpret,
        debug=debug,
        name="pallas_cache_victims",
    )(usage, step, n, limit)


@functools.partial(jax.jit, static_argnames=("num_out", "interpret", "debug"))
def victims(usage: jax.Array, step: jax.Array, n: jax.Array, *, num_out: int,
            interpret: bool = False, debug: bool = False, cache_size=None) -> jax.Array:
    """The first ``n`` evictable slots in ascending ``(usage, slot)`` order.

    Args:
      usage: ``i32[C]`` per-slot LRU stamps (any int32 value).
      step: ``i32[]`` the current step; slots with ``usage == step`` are never victims.
      n: ``i32[]`` how many victims (traced); clamped to ``[0, num_out]``.
      num_out: static output length, ``0 <= num_out <= C``.
      cache_size: ``i32[]`` the usable size (traced): slots at or past it are never victims;
        ``None``: all ``C``.
      interpret: run the kernel with the Pallas interpreter (CPU).
      debug: print the kernel jaxpr (and the Triton IR when lowering for GPU).

    Returns:
      ``i32[num_out]``: victim slots in order, ``-1`` for entries ``>= n`` and for entries past
      the last evictable slot.

    Raises:
      TypeError / ValueError at trace time: ``usage`` not a 1-D int32 array, ``step``/``n`` not
      integer scalars, ``num_out`` not a static int in ``[0, C]``.
    """
    return victims_call(usage, step, n, num_out=num_out, interpret=interpret, debug=debug,
                        cache_size=cache_size)
