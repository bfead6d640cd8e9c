"""What both Pallas kernels share: the evictable-slot scan, masked block loads, the Triton launch
parameters and the trace-time input checks. A Triton tensor must have a power-of-two size, so
every in-kernel vector is ``next_pow2`` wide and loaded from the unpadded ref with a mask
(``other`` fills the lanes past the end, and each reduction masks them out again), the pattern of
JAX's shipped ``pallas/ops/gpu/softmax.py``: no padded copy of an input is made in device memory.
"""

from __future__ import annotations


import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_cache.validate import INT32_MAX, INT32_MIN  # noqa: F401  (re-exported to the kernels)

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "as_scalar_i32",
    "check_block",
    "check_vector_i32",
    "compiler_params",
    "default_block",
    "load_block",
    "next_evictable",
    "next_pow2",
    "preload",
]


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


def check_block(block: int, size: int) -> int:
    block, size_pad = int(block), next_pow2(size)
    if block < 1 or block & (block - 1) or size_pad % block:
        raise ValueError(f"block must be a power of two dividing {size_pad}, got {block}")
    return block


def load_block(ref, start, width: int, other: int = 0):
    """``(values, index, valid)`` of the ``width`` entries of the 1-D ``ref`` from ``start``:
    a masked load, so ``width`` may run past the end of the ref (those lanes are ``other`` and
    not ``valid``)."""
    index = start + lax.iota(jnp.int32, width)
    valid = index < ref.shape[0]
    return plgpu.load(ref.at[pl.ds(start, width)], mask=valid, other=other), index, valid


def _block_min_pair(u, idx, valid, step, prev_u, prev_i, limit):
    """The smallest evictable ``(usage, slot)`` in one block strictly after ``(prev_u, prev_i)``
    (no bound when ``prev_u`` is None), as scalars; ``(INT32_MAX, INT32_MAX)`` if none. Slots at
    or past ``limit`` (the usable size; None: no limit) are not evictable."""
    ok = valid & (u != step)
    if limit is not None:
        ok = ok & (idx < limit)
    if prev_u is not None:
        ok = ok & ((u > prev_u) | ((u == prev_u) & (idx > prev_i)))
    m = jnp.min(jnp.where(ok, u, INT32_MAX))
    i = jnp.min(jnp.where(ok & (u == m), idx, INT32_MAX))
    return m, i


def next_evictable(usage_ref, step, prev_u, prev_i, *, block: int, preloaded=None, limit=None):
    """The smallest evictable ``(usage, slot)`` (``usage != step`` and ``slot < limit``, the
    usable size; ``limit=None``: every slot) strictly after ``(prev_u, prev_i)`` (``None``: no
    lower bound, the plain argmin), as scalars ``(m, i)``; ``i == m == INT32_MAX`` when there is
    none.

    ``preloaded`` is :func:`load_block`'s result when the whole pool fits one block (loaded once
    by the caller and kept in registers); otherwise the pool is scanned in ``block``-wide blocks
    in ascending slot order, so a later block only wins with a strictly smaller usage.
    """
    if preloaded is not None:
        return _block_min_pair(*preloaded, step, prev_u, prev_i, limit)

    def body(b, best):
        best_m, best_i = best
        start = pl.multiple_of(b * block, block)
        m, i = _block_min_pair(*load_block(usage_ref, start, block), step, prev_u, prev_i, limit)
        take = (i != INT32_MAX) & ((best_i == INT32_MAX) | (m < best_m))
        return jnp.where(take, m, best_m), jnp.where(take, i, best_i)

    num_blocks = -(-usage_ref.shape[0] // block)
    return lax.fori_loop(0, num_blocks, body, (jnp.int32(INT32_MAX), jnp.int32(INT32_MAX)))


def preload(usage_ref, *, block: int):
    """:func:`load_block` of the whole pool when it fits one block, else ``None``."""
    if next_pow2(usage_ref.shape[0]) != block:
        return None
    return load_block(usage_ref, 0, block)


def as_scalar_i32(x, name: str):
    """An integer scalar as ``i32[1]`` (Triton has no SMEM: scalars travel as 1-element arrays)."""
    x = jnp.asarray(x)
    if x.shape != ():
        raise ValueError(f"{name} must be a scalar, got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer, got dtype {x.dtype}")
    return x.astype(jnp.int32).reshape((1,))


def check_vector_i32(x, name: str):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        x = jnp.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {x.shape}")
    if x.dtype != jnp.int32:
        raise TypeError(f"{name} must be int32, got dtype {x.dtype}")
    return x


