"""The decode's shape and its bank: :class:`Geometry` and random expert weights of
:mod:`pallas_cache.experts`' formats in host memory (:func:`expert_fn_and_bank`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_cache import experts
from pallas_cache.formats import int4_groups
from pallas_cache.moe import put_host_bank

__all__ = ["Geometry", "check_expert_dtype", "expert_fn_and_bank"]


def check_expert_dtype(dtype: str) -> None:
    """Raise ``ValueError`` for a dtype no expert function of :mod:`pallas_cache.experts` reads
    (one line, for the CLI)."""
    if dtype not in experts.FORMATS:
        raise ValueError(f"no expert function for {dtype} (bench-decode runs the library's "
                         f"expert formats: {', '.join(experts.FORMATS)})")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The decode's shape.

    Attributes:
      num_layers / num_experts / top_k: ``L``, ``E`` and routes per layer-call.
      d_model / d_expert: one SwiGLU expert's three matrices, each stored as ``d_expert`` rows of
        ``d_model`` weights (:mod:`pallas_cache.experts`' layout).
      dtype: the bank's format, one of ``pallas_cache.experts.FORMATS``.
    """

    num_layers: int
    num_experts: int
    top_k: int
    d_model: int
    d_expert: int
    dtype: str

    @property
    def expert_bytes(self) -> int:
        """``W``: one expert's three matrices as the bank stores them, scales included
        (:func:`pallas_cache.experts.bytes_per_expert`)."""
        return experts.bytes_per_expert(self.d_model, self.d_expert, self.dtype)

    @property
    def resident_slots(self) -> int:
        """``L * E``: the pool of the floor row."""
        return self.num_layers * self.num_experts


#: The symmetric codes of each quantized format: ``2 m + 1`` levels ``-m .. m``.
_LEVELS = {"int8": 255, "int4": 15}


def expert_fn_and_bank(geometry: Geometry, *, seed: int = 0, device=None,
                        progress: Callable[[str], None] = lambda line: None):
    """``(expert_fn, host_bank)``: :data:`pallas_cache.experts.swiglu` and a bank of random
    weights in the experts' layout of ``geometry.dtype`` (``w1, w3, w2: [L, E, F, H]``; bf16 as
    uint16 bits, int8 codes with float32 ``<matrix>_scale`` per output channel, int4 packed
    ``[L, E, F, H / 2]`` with ``[L, E, F, groups]`` scales), made a leaf at a time on the device
    and moved into host memory (``put_host_bank``), so neither NumPy nor the device ever holds
    more than one leaf."""
    check_expert_dtype(geometry.dtype)
    g = geometry
    device = jax.devices()[0] if device is None else device
    lead = (g.num_layers, g.num_experts)
    shape = lead + (g.d_expert, g.d_model)
    leaves = []
    for index, name in enumerate(("w1", "w3", "w2")):
        fan_in = g.d_expert if name == "w2" else g.d_model
        leaves.append((name, functools.partial(_random_leaf, shape=shape, fmt=g.dtype,
                                               fan_in=fan_in, seed=3 * seed + index)))
        if g.dtype in _LEVELS:
            scale_shape = lead + ((g.d_model if name == "w2" else g.d_expert,) if g.dtype == "int8"
                                  else (g.d_expert, int4_groups(g.d_model)))
            value = math.sqrt(12.0 / fan_in / (_LEVELS[g.dtype] ** 2 - 1))  # variance 1/fan_in
            leaves.append((f"{name}_scale", functools.partial(jnp.full, scale_shape, value,
                                                              jnp.float32)))
    bank = {}
    for name, make in leaves:
        leaf = jax.jit(make, out_shardings=jax.sharding.make_single_device_sharding(device))()
        progress(f"bank leaf {name} {list(leaf.shape)} {leaf.dtype} ({g.dtype})")
        bank[name] = put_host_bank(leaf, device)
        if bank[name] is not leaf:
            leaf.delete()
    return experts.swiglu, bank




def _random_leaf(shape, fmt, fan_in, seed):
    """One stored matrix ``[L, E, F, H]`` of format ``fmt``: uniform weights of variance
    ``1 / fan_in`` (quantized: uniform codes ``-m .. m`` of :data:`_LEVELS`, whose scale leaf
    gives that variance), from a hash of each stored element's (layer, expert) and its index
    inside the expert, elementwise (one fused loop, no draw of float32 first). int4 takes two
    codes from each byte's hash, the even weight in the low nibble."""
    def mix(x):
        x = x ^ (x >> 16)
        x = x * jnp.uint32(0x7FEB352D)
        x = x ^ (x >> 15)
        x = x * jnp.uint32(0x846CA68B)
        return x ^ (x >> 16)

    stored = shape[:-1] + (shape[-1] // 2,) if fmt == "int4" else shape
    iota = functools.partial(lax.broadcasted_iota, jnp.uint32, stored)
    expert = iota(0) * jnp.uint32(stored[1]) + iota(1) + jnp.uint32(seed * 0x9E3779B9 % 2**32)
    inner = iota(2) * jnp.uint32(stored[3]) + iota(3)
    bits = mix(mix(expert) + inner)

    def unit(shift, width):  # [-0.5, 0.5) from ``width`` bits of the hash: variance 1/12
        return ((bits >> shift) & jnp.uint32(2**width - 1)).astype(jnp.float32) / 2**width - 0.5

    if fmt not in _LEVELS:
        weights = unit(8, 24) * math.sqrt(12.0 / fan_in)
        if fmt == "bf16":  # the bits, as the experts' banks store them
            return lax.bitcast_convert_type(weights.astype(jnp.bfloat16), jnp.uint16)
        return weights
    levels = _LEVELS[fmt]

    def codes(shift, width):
        return jnp.floor(unit(shift, width) * levels + 0.5).astype(jnp.int32)  # -m .. m

    if fmt == "int8":
        return codes(8, 24).astype(jnp.int8)
    low, high = codes(8, 12), codes(20, 12)
    return ((low & 0xF) | ((high & 0xF) << 4)).astype(jnp.uint8)
