"""Pallas kernel 1 (docs/semantics.md §5.2 step 5, docs/semantics.md §7): victim selection.

``victims(usage, step, n, num_out=...)`` returns the first ``n`` slots in ascending
``(usage, slot)`` order among the *evictable* slots -- those whose ``usage != step`` (a slot
touched in this step is never a victim) -- with ties going to the lowest slot. This is exactly
``n`` repeated argmins with each claimed slot knocked out. The result is an ``i32[num_out]``
array; entries ``>= n`` are ``-1``. If fewer than ``n`` slots are evictable, the entries past the
last evictable slot are ``-1`` as well (``ensure`` never asks for that: ``S >= E``, so the
misses of one call never outnumber the untouched slots; the kernel defines it anyway).

Exactness: every ``int32`` usage value is handled, ``INT32_MIN`` (a forgotten slot) and
``INT32_MAX`` included. No sentinel is ever folded into the usage values: validity (real slot,
not touched this step, not yet claimed) is a separate boolean, and each argmin is two exact
reductions (the minimum usage among valid slots, then the lowest valid slot holding it).

Algorithm (one program, no grid). Round 0 is the plain argmin; round ``k >= 1`` picks the
smallest ``(usage, slot)`` pair strictly greater, lexicographically, than the pair picked in round
``k - 1``. Ascending order makes that the same as knocking out every claimed slot, and it needs no
claimed-mask, only two scalars of loop carry. The round loop runs ``n - 1`` times (``n`` traced,
so a step with few misses costs few rounds; rounds past the last evictable slot find nothing and
write ``-1``). On the GPU, pools up to ``_BLOCK`` slots are loaded once and stay in registers;
larger pools are scanned in ``_BLOCK``-wide blocks each round (reloads hit L1/L2: 16384 slots are
64 KiB), and since blocks are visited in ascending slot order a later block only wins with a
strictly smaller usage. In interpret mode the whole pool is one block (XLA on the host has no
register budget; tests force a small block to cover the blocked scan there too). Cost:
``n * S`` compares and two reductions per block per round; ``num_warps`` is chosen for about 16
elements per thread (64 slots -> 1 warp, 2048 -> 4, >= 4096 -> 8).

Shapes: the Triton lowering needs power-of-two tensors, so the wrapper pads ``usage`` (with
zeros, when ``S`` is not a power of two) and the output (to ``next_pow2(num_out)``, sliced off
afterwards). Padded slots are excluded by a static ``slot < S`` mask inside the kernel, so the
padding value never matters. Scalars travel as ``i32[1]`` arrays (Triton has no SMEM).

Backends: ``interpret=True`` runs the kernel with the Pallas HLO interpreter (any backend, CPU
tests). Otherwise the kernel is lowered with **Triton** -- ``compiler_params`` is always an
explicit ``jax.experimental.pallas.triton.CompilerParams``; a bare ``pallas_call`` on a GPU would
pick Mosaic GPU (``jax_pallas_use_mosaic_gpu`` defaults to True). JAX 0.11 deprecates the Triton
backend; this module keeps using it while it exists. A **Mosaic GPU** port would need:
``plgpu.kernel`` (or ``pl.pallas_call`` with
``jax.experimental.pallas.mosaic_gpu.CompilerParams``); ``usage`` copied into SMEM first (TMA /
``copy_gmem_to_smem`` or a Mosaic GPU ``BlockSpec``), since there are no masked pointer loads;
vectors sized for a warpgroup (a multiple of 128 lanes, ``Layout.WG_STRIDED``) with the
reductions written as warpgroup reductions; scalars (``step``, ``n``) read from SMEM; and the
output staged through SMEM back to GMEM. Nothing in the algorithm is Triton-specific.

Under ``jax.vmap`` the ``pallas_call`` batching rule adds a grid axis (one program per cache).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

INT32_MIN = int(np.iinfo(np.int32).min)
INT32_MAX = int(np.iinfo(np.int32).max)

# Widest block the kernel reduces at once (elements). 4096 x i32 spread over 8 warps is 16
# registers per thread per live vector.
_BLOCK = 4096

__all__ = ["victims"]


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else int(pl.next_power_of_2(int(x)))


def _num_warps(block: int) -> int:
    """About 16 elements per thread: 64 -> 1 warp, 2048 -> 4, 4096 -> 8."""
    return int(min(max(block // 512, 1), 8))


def _block_min_pair(u, idx, valid, step, prev_u, prev_i):
    """The smallest ``(usage, slot)`` in one block with ``(usage, slot) > (prev_u, prev_i)``.

    ``u``/``idx`` are same-shaped vectors; ``valid`` is a bool vector (a real slot) or ``None``
    (all real); ``prev_u``/``prev_i`` are scalars, or ``None`` for "no lower bound" (the first
    pick). Returns scalars ``(m, i)``: ``i == INT32_MAX`` when the block has no candidate (then
    ``m == INT32_MAX`` too).
    """
    ok = u != step
    if valid is not None:
        ok = ok & valid
    if prev_u is not None:
        ok = ok & ((u > prev_u) | ((u == prev_u) & (idx > prev_i)))
    m = jnp.min(jnp.where(ok, u, INT32_MAX))
    i = jnp.min(jnp.where(ok & (u == m), idx, INT32_MAX))
    return m, i


def next_evictable(usage_ref, step, prev_u, prev_i, *, size: int, block: int,
                   preloaded=None):
    """Smallest evictable ``(usage, slot)`` strictly after ``(prev_u, prev_i)``.

    Shared by both kernels. ``usage_ref`` is the padded ``i32[size_pad]`` ref; ``size`` the real
    number of slots; ``block`` divides ``size_pad``; ``prev_u``/``prev_i`` may be ``None`` (no
    lower bound: the plain argmin). ``preloaded`` is what :func:`preload` returned (the
    single-block case, loaded once by the caller). Returns scalars ``(m, i)`` with
    ``i == INT32_MAX`` (and ``m == INT32_MAX``) when there is no candidate.
    """
    if preloaded is not None:
        u, idx, valid = preloaded
        return _block_min_pair(u, idx, valid, step, prev_u, prev_i)
    size_pad = usage_ref.shape[0]
    num_blocks = size_pad // block

    def body(b, best):
        best_m, best_i = best
        start = pl.multiple_of(b * block, block)
        u = usage_ref[pl.ds(start, block)]
        idx = start + lax.iota(jnp.int32, block)
        valid = None if size == size_pad else idx < size
        m, i = _block_min_pair(u, idx, valid, step, prev_u, prev_i)
        # Blocks ascend in slot order: an equal usage in a later block loses the tie.
        take = (i != INT32_MAX) & ((best_i == INT32_MAX) | (m < best_m))
        return jnp.where(take, m, best_m), jnp.where(take, i, best_i)

    init = (jnp.int32(INT32_MAX), jnp.int32(INT32_MAX))
    return lax.fori_loop(0, num_blocks, body, init)


def preload(usage_ref, *, size: int, block: int):
    """``(u, idx, valid)`` when the whole padded pool is one block, else ``None``."""
    size_pad = usage_ref.shape[0]
    if size_pad != block:
        return None
    idx = lax.iota(jnp.int32, size_pad)
    valid = None if size == size_pad else idx < size
    return usage_ref[...], idx, valid


def victims_kernel(usage_ref, step_ref, n_ref, out_ref, *, size: int, num_out: int,
                   block: int):
    """Kernel over refs: ``usage_ref i32[S_pad]``, ``step_ref``/``n_ref`` ``i32[1]``,
    ``out_ref i32[next_pow2(num_out)]``. ``size`` = real ``S``; ``n`` is clamped to
    ``[0, num_out]``; ``block`` (a power of two dividing ``S_pad``) is the reduction width."""
    out_pad = out_ref.shape[0]
    step = step_ref[0]
    n = jnp.minimum(jnp.maximum(n_ref[0], 0), num_out)
    pre = preload(usage_ref, size=size, block=block)
    out_idx = lax.iota(jnp.int32, out_pad)

    # Round 0, the plain argmin (no lower bound); recorded only when n >= 1.
    m0, i0 = next_evictable(usage_ref, step, None, None, size=size, block=block,
                            preloaded=pre)
    pick0 = jnp.where((n > 0) & (i0 != INT32_MAX), i0, -1)
    out0 = jnp.where(out_idx == 0, pick0, -1)

    def round_body(k, carry):
        prev_u, prev_i, out = carry
        m, i = next_evictable(usage_ref, step, prev_u, prev_i, size=size, block=block,
                              preloaded=pre)
        pick = jnp.where(i == INT32_MAX, -1, i)
        # Once nothing is left, (m, i) = (MAX, MAX) and every later round finds nothing too.
        return m, i, jnp.where(out_idx == k, pick, out)

    _, _, out = lax.fori_loop(1, n, round_body, (m0, i0, out0))
    out_ref[...] = out


def _as_scalar_i32(x, name: str):
    x = jnp.asarray(x)
    if x.shape != ():
        raise ValueError(f"{name} must be a scalar, got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer, got dtype {x.dtype}")
    return x.astype(jnp.int32).reshape((1,))


def _check_vector_i32(x, name: str):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        x = jnp.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {x.shape}")
    if x.dtype != jnp.int32:
        raise TypeError(f"{name} must be int32, got dtype {x.dtype}")
    return x


def _pad_to(x, size: int):
    if x.shape[0] == size:
        return x
    return jnp.pad(x, (0, size - x.shape[0]))


def default_block(size_pad: int, interpret: bool) -> int:
    """Reduction width: the whole pool in interpret mode (XLA on the host has no register
    budget, and one wide reduction beats a loop of slices), else at most ``_BLOCK``."""
    return size_pad if interpret else min(size_pad, _BLOCK)


def victims_call(usage, step, n, *, num_out: int, interpret: bool, debug: bool,
                 block: int | None = None):
    """Unjitted body of :func:`victims`; ``block`` overrides the reduction width (tests use a
    small one to exercise the blocked scan on the interpreter)."""
    usage = _check_vector_i32(usage, "usage")
    size = usage.shape[0]
    if not isinstance(num_out, (int, np.integer)) or isinstance(num_out, bool):
        raise TypeError(f"num_out must be a static int, got {num_out!r}")
    num_out = int(num_out)
    if not 0 <= num_out <= size:
        raise ValueError(f"num_out must be in [0, S={size}], got {num_out}")
    step = _as_scalar_i32(step, "step")
    n = _as_scalar_i32(n, "n")
    if num_out == 0:
        return jnp.full((0,), -1, jnp.int32)
    size_pad = _next_pow2(size)
    out_pad = _next_pow2(num_out)
    block = (default_block(size_pad, interpret) if block is None
             else _check_block(block, size_pad))
    kernel = functools.partial(victims_kernel, size=size, num_out=num_out, block=block)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((out_pad,), jnp.int32),
        grid=(),
        compiler_params=plgpu.CompilerParams(num_warps=_num_warps(block), num_stages=1),
        interpret=interpret,
        debug=debug,
        name="pallas_cache_victims",
    )(_pad_to(usage, size_pad), step, n)
    return out if out_pad == num_out else out[:num_out]


def _check_block(block: int, size_pad: int) -> int:
    block = int(block)
    if block < 1 or block & (block - 1) or size_pad % block:
        raise ValueError(f"block must be a power of two dividing {size_pad}, got {block}")
    return block


@functools.partial(jax.jit, static_argnames=("num_out", "interpret", "debug"))
def victims(usage: jax.Array, step: jax.Array, n: jax.Array, *, num_out: int,
            interpret: bool = False, debug: bool = False) -> jax.Array:
    """The first ``n`` evictable slots in ascending ``(usage, slot)`` order.

    Args:
      usage: ``i32[S]`` per-slot LRU stamps (any int32 value).
      step: ``i32[]`` the current step; slots with ``usage == step`` are never victims.
      n: ``i32[]`` how many victims (traced); clamped to ``[0, num_out]``.
      num_out: static output length, ``0 <= num_out <= S``.
      interpret: run the kernel with the Pallas interpreter (CPU).
      debug: print the kernel jaxpr (and the Triton IR when lowering for GPU).

    Returns:
      ``i32[num_out]``: victim slots in order, ``-1`` for entries ``>= n`` and for entries past
      the last evictable slot.

    Raises:
      TypeError / ValueError at trace time: ``usage`` not a 1-D int32 array, ``step``/``n`` not
      integer scalars, ``num_out`` not a static int in ``[0, S]``.
    """
    return victims_call(usage, step, n, num_out=num_out, interpret=interpret, debug=debug)
