"""The fused kernel's launch parameters (power-of-two widths, the pool scan's block, the Triton
compiler parameters) and its vector helpers. A Triton tensor must have a power-of-two size, so
every in-kernel vector is ``next_pow2`` wide and loaded from the unpadded ref with a mask
(``other`` fills the lanes past the end, and each reduction masks them out again), the pattern of
JAX's shipped ``pallas/ops/gpu/softmax.py``: no padded copy of an input is made in device
memory. A vector wider than its ref is read and written through an index vector,
``ref.at[start + iota]``, never a slice ``ref.at[pl.ds(start, width)]``: JAX 0.12 refuses a static
slice past a ref's end at trace time, and Triton compiles both to the same masked loads.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_cache.validate import INT32_MAX, INT32_MIN  # noqa: F401  (re-exported to the kernels)

__all__ = ["INT32_MAX", "INT32_MIN", "after", "any_true", "check_block", "compiler_params",
           "default_block", "flat_at", "flat_index", "lane", "lex_max", "lex_min", "next_pow2",
           "scatter", "stamp_block"]


# Widest block a kernel reduces at once (elements). 4096 x i32 spread over 8 warps is 16
# registers per thread per live vector.
MAX_BLOCK = 4096


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else int(pl.next_power_of_2(int(x)))


def compiler_params(block: int) -> plgpu.CompilerParams:
    """Explicit Triton parameters (a bare ``pallas_call`` on a GPU would pick Mosaic GPU):
    about 16 elements per thread, so 64 slots -> 1 warp, 2048 -> 4, >= 4096 -> 8."""
    return plgpu.CompilerParams(num_warps=int(min(max(block // 512, 1), 8)), num_stages=1)


def default_block(size: int, interpret: bool) -> int:
    """Reduction width: the whole (power-of-two rounded) pool in interpret mode (XLA on the host
    has no register budget, and one wide reduction beats a loop of slices), else at most
    ``MAX_BLOCK``."""
    size_pad = next_pow2(size)
    return size_pad if interpret else min(size_pad, MAX_BLOCK)


def stamp_block(size: int, block: int, interpret: bool) -> int:
    """The rebase's width over the ``size`` recency stamps: :func:`default_block`, at most the
    pool scan's 16 elements per thread (512 per warp of ``compiler_params(block)``): wider, the
    rebase's loop sets the registers of the whole kernel (docs/design.md, "Registers"). The
    same rule interpreted, so the interpreter scans the stamps in the same blocks."""
    return min(default_block(size, interpret), 512 * compiler_params(block).num_warps)


def check_block(block: int, size: int) -> int:
    block, size_pad = int(block), next_pow2(size)
    if block < 1 or block & (block - 1) or size_pad % block:
        raise ValueError(f"block must be a power of two dividing {size_pad}, got {block}")
    return block


# In-kernel vector helpers (Triton has no element read of a value, and reductions take a mask).

def lane(vector, k):
    """Entry ``k`` of an in-kernel vector (Triton has no element read of a value)."""
    position = lax.iota(jnp.int32, vector.shape[0])
    return jnp.min(jnp.where(position == k, vector, INT32_MAX))


def any_true(mask):
    return jnp.max(jnp.where(mask, 1, 0)) > 0


def after(key, index, prev_key, prev_index):
    """``(key..., index)`` strictly after ``(prev_key..., prev_index)`` lexicographically."""
    out = index > prev_index
    for k, p in zip(reversed(key), reversed(prev_key)):
        out = (k > p) | ((k == p) & out)
    return out


def _lex_extreme(key, index, live, reduce, none):
    best, ok = [], live
    for k in key:
        m = reduce(jnp.where(ok, k, none))
        best.append(m)
        ok = ok & (k == m)
    return tuple(best), reduce(jnp.where(ok, index, none))


def lex_max(key, index, live):
    """The largest live ``(key..., index)`` as scalars; index ``INT32_MIN`` when none."""
    return _lex_extreme(key, index, live, jnp.max, INT32_MIN)


def lex_min(key, index, live):
    """The smallest live ``(key..., index)`` as scalars; index ``INT32_MAX`` when none."""
    return _lex_extreme(key, index, live, jnp.min, INT32_MAX)


def scatter(ref, index, value, mask):
    """A masked vector store at ``index`` (one index per dimension of ``ref`` as a tuple, or one
    for a 1-D ref); masked lanes point past the ref's first dimension (the interpreter's scatter
    drops them, where a duplicate in-range index could rewrite a stored entry)."""
    first, *rest = index if isinstance(index, tuple) else (index,)
    plgpu.store(ref.at[(jnp.where(mask, first, ref.shape[0]), *rest)], value, mask=mask)


def flat_index(ref, index) -> tuple:
    """The index of ``ref`` at the row-major positions ``index`` (one vector; a 2-D ref's
    ``[rows, cols]`` read as ``rows * cols`` entries), one vector per dimension (the refs keep
    their leaves' shapes: docs/design.md, "The kernel's operands"). Positions past the end fall
    past the last row."""
    if len(ref.shape) == 1:
        return (index,)
    cols = ref.shape[1]
    return lax.div(index, cols), lax.rem(index, cols)


def flat_at(ref, index):
    """``ref.at`` the row-major positions ``index`` (:func:`flat_index`)."""
    return ref.at[flat_index(ref, index)]
