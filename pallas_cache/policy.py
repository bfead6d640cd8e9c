"""How many misses a hybrid step fetches, and which ones (docs/semantics.md §5.3-§5.5).

:class:`FetchPolicy` (the split, a 16-bit fixed-point fraction as traced int32 scalars),
:class:`FetchOrder` (which misses win the fetches) and :class:`Admission` (whether a step may
fetch beyond the split); the last two are static and accept their string values.
"""

from __future__ import annotations

import enum
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_cache import validate
from pallas_cache.tree import Record, pytree_dataclass

__all__ = ["Admission", "FetchOrder", "FetchPolicy", "ONE", "admit_promote_one", "admit_reuse",
           "split_count"]

ONE = 65536  # the fixed-point 1.0 of fraction16


class FetchOrder(enum.Enum):
    """Which misses get the fetches when the split caps them (docs/semantics.md §5.4)."""

    RECENCY = "recency"  # most recently routed first (pre-call recency), ties to the lower id
    LOWEST_ID = "lowest_id"  # ascending expert id

    @classmethod
    def coerce(cls, value: "FetchOrder | str") -> "FetchOrder":
        return validate.coerce_enum(cls, value, "order")


class Admission(enum.Enum):
    """Whether a hybrid step may fetch beyond the split (docs/semantics.md §5.5)."""

    PROMOTE_ONE = "promote_one"  # one recurring miss into an empty slot
    NONE = "none"  # the plain split
    REUSE = "reuse"  # admit further misses while they are more recent than their victims

    @classmethod
    def coerce(cls, value: "Admission | str") -> "Admission":
        return validate.coerce_enum(cls, value, "admission")


@pytree_dataclass
class FetchPolicy(Record):
    """How many of a hybrid step's misses cross the link (docs/semantics.md §5.3).

    Attributes:
      fraction16: int32[]. The fetch fraction as ``f / 65536``, ``0 <= f <= 65536``; 0 selects the
        fixed-cap rule.
      cap: int32[]. With ``fraction16 == 0``: at most this many misses are fetched. Ignored
        otherwise (a fraction and a cap are not combined).

    Build one with :meth:`fraction`, :meth:`fixed_cap` or :meth:`full`; stack several with
    ``jax.tree.map(lambda *x: jnp.stack(x), *policies)`` to vmap over them.
    """

    fraction16: jax.Array
    cap: jax.Array

    def __post_init__(self):
        # Concrete values (Python ints, NumPy and concrete JAX arrays) are checked here, once, on
        # the host, in their own width: a cap of 2**32 must not pass as an int32 0. Pytree
        # rebuilds pass tracers, None and vmap axis ints through this constructor: those are left
        # alone, and split() saturates whatever value arrives on the device (docs/semantics.md
        # §5.3).
        for name, low, high in (("fraction16", 0, ONE), ("cap", 0, validate.INT32_MAX)):
            value = getattr(self, name)
            concrete = isinstance(value, (np.ndarray, np.generic)) or (
                isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer))
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
                host = np.asarray(int(value), object)
            elif concrete and jnp.issubdtype(value.dtype, jnp.integer):
                host = np.asarray(value).astype(object)  # Python ints: no wrap in the compare
            else:
                continue
            bad = (host < low) | (host > high)
            if np.any(bad):
                raise ValueError(
                    f"FetchPolicy.{name} must be in [{low}, {high}], got "
                    f"{np.asarray(host)[bad].ravel()[0]} (build policies with "
                    f"FetchPolicy.fraction, fixed_cap (which saturates a larger cap) or full)")

    @classmethod
    def fraction(cls, q: float) -> "FetchPolicy":
        """The balanced split at fetch fraction ``q``.

        ``f = clamp(round_half_even(q * 65536), 0, 65536)``, computed on the host: ``q`` above 1
        fetches everything, ``q`` below 0 is fraction 0 (with cap 0: fetch nothing), as docs/semantics.md §5.3
        writes it. Raises TypeError for a non-number (bools included) or a traced ``q`` (the
        message shows the forms that work under ``jit``) and ValueError for NaN.
        """
        if isinstance(q, jax.core.Tracer):
            raise TypeError(
                "FetchPolicy.fraction rounds q on the host, so q cannot be traced; build the "
                "policy outside jit and pass it in (a policy is traced data: stack several with "
                "jax.tree.map(lambda *x: jnp.stack(x), *policies) and vmap), or set the field "
                "yourself: FetchPolicy(fraction16=jnp.round(q * 65536).astype(jnp.int32), "
                "cap=jnp.int32(0))")
        if isinstance(q, (bool, np.bool_)) or not isinstance(q, numbers.Real):
            kind = type(q).__name__
            raise TypeError(f"fetch fraction must be a real number, got {q!r} ({kind})")
        q = float(q)
        if math.isnan(q):
            raise ValueError(f"fetch fraction must not be NaN, got {q!r}")
        # q * 65536 is exact in float64 (a power-of-two scale), so round() -- half to even on
        # the exact value -- is exactly the rule. Clamping q first (rounding is monotone, so it
        # is the same clamp) keeps infinities out of round().
        f = round(min(max(q, 0.0), 1.0) * ONE)
        return cls(fraction16=jnp.asarray(f, jnp.int32), cap=jnp.asarray(0, jnp.int32))

    @classmethod
    def fixed_cap(cls, n: int) -> "FetchPolicy":
        """Fetch at most ``n >= 0`` misses per step (fraction 0).

        Raises TypeError for a non-int (bools included) and ValueError for ``n < 0``."""
        n = validate.as_host_int("fetch cap", n)
        if n < 0:
            raise ValueError(f"fetch cap must be >= 0, got {n}")
        cap = jnp.asarray(min(n, validate.INT32_MAX), jnp.int32)
        return cls(fraction16=jnp.asarray(0, jnp.int32), cap=cap)

    @classmethod
    def full(cls) -> "FetchPolicy":
        """Fetch every miss, the same count as ``ensure``: the split at fraction 1
        (``F = M``; with ``F >= 1`` whenever anything missed, no admission rule changes it)."""
        return cls(fraction16=jnp.asarray(ONE, jnp.int32), cap=jnp.asarray(0, jnp.int32))

    def validate(self) -> "FetchPolicy":
        """Static check at call/trace time: both fields integer scalars (inside any vmap)."""
        for name in ("fraction16", "cap"):
            value = getattr(self, name)
            shape = np.shape(value)
            if shape != ():
                raise ValueError(
                    f"FetchPolicy.{name} must be a scalar per cache, got shape {shape} "
                    f"(vmap over a stacked policy instead of passing a batch)"
                )
            dtype = value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype
            if not jnp.issubdtype(dtype, jnp.integer):
                raise TypeError(
                    f"FetchPolicy.{name} must be an integer, got dtype {np.dtype(dtype).name}")
        return self

    def split(self, num_missing: jax.Array) -> jax.Array:
        """``F``, the number of the ``M = num_missing`` distinct misses to fetch (int32 scalar):
        :func:`split_count` of this policy's fields."""
        return split_count(self.fraction16, self.cap, num_missing)


def split_count(fraction16, cap, num_missing) -> jax.Array:
    """The balanced split (docs/semantics.md §5.3): ``F``, the number of the ``M = num_missing``
    distinct misses to fetch (int32 scalar), for a policy's ``fraction16`` and ``cap`` (int
    scalars, traced or not; the fused kernel passes the values it read).

    Fixed cap (``f == 0``): ``min(M, cap)``. Fraction (``f > 0``): with
    ``M * f = lo * 65536 + r`` (``0 <= r < 65536``), the cost comparison of docs/semantics.md §5.3,
    ``max(lo*(65536-f), (M-lo)*f) <= max((lo+1)*(65536-f), (M-lo-1)*f)``, reduces to
    ``r <= 65536 - f`` (both maxima take their first/second term respectively, because
    ``lo <= M*f/65536 < lo + 1``); so ``F = lo`` if ``r <= 65536 - f`` else ``lo + 1``. That
    form never multiplies anything as large as ``M * f``: ``M`` is split into
    ``M = a * 65536 + b`` and ``b * f < 2**32`` is formed in uint32, so every ``M`` that fits
    in int32 is exact.
    """
    m = jnp.asarray(num_missing, jnp.int32)
    # A traced policy built by hand may hold anything: clamp it into the valid range, so no
    # count is ever negative or above M (docs/semantics.md §5.3), in its own dtype before
    # the int32 cast (a uint32 or int64 cap of 2**32 saturates, it does not wrap to 0).
    f = _saturated_int32(fraction16, ONE)
    cap = _saturated_int32(cap, validate.INT32_MAX)
    a = m >> 16
    b = (m & (ONE - 1)).astype(jnp.uint32)
    bf = b * f.astype(jnp.uint32)  # <= 65535 * 65536 < 2**32
    lo = a * f + (bf >> 16).astype(jnp.int32)  # a * f <= 32767 * 65536 < 2**31
    r = (bf & (ONE - 1)).astype(jnp.int32)
    balanced = jnp.minimum(jnp.where(r <= ONE - f, lo, lo + 1), m)
    capped = jnp.minimum(m, cap)
    return jnp.where(f > 0, balanced, capped).astype(jnp.int32)


# The admission rules (docs/semantics.md §5.5), once for both backends: on the misses in fetch
# order and the victims in claim order, as vectors of one length (-1 past their counts), with
# each miss's pre-call recency (``recs``), each victim's usage after the hit refresh
# (``vusage``) and its occupant (``occupants``). Each returns the new ``F``.

def admit_promote_one(on, num_fetch, experts, recs, victims, occupants, *, first):
    """PROMOTE_ONE: with the rule ``on`` (RECENCY order and a fraction policy) and ``F = 0``, the
    first miss takes the first victim if that slot is empty and the miss was routed before
    (recency ``>= 0``). ``first(v)``: a vector's first entry (``v[0]``; in a kernel, which has
    no element read of a value, a masked reduction: one, of the four tests combined lane by
    lane)."""
    ready = (experts >= 0) & (recs >= 0) & (victims >= 0) & (occupants == -1)
    promoted = on & (num_fetch == 0) & (first(ready.astype(jnp.int32)) > 0)
    return jnp.where(promoted, 1, num_fetch)


def admit_reuse(on, num_fetch, experts, recs, victims, vusage, num_out: int):
    """REUSE: with the rule ``on``, the first ``F`` misses are admitted and the k-th after them
    iff its recency is ``>= 0`` and ``>=`` the usage of the k-th victim; the first rejection
    stops. Entries at or past ``num_out`` (a kernel's power-of-two padding) are never
    rejections."""
    position = lax.iota(jnp.int32, experts.shape[0])
    admitted = (position < num_fetch) | ((experts >= 0) & (victims >= 0) & (recs >= 0)
                                         & (recs >= vusage))
    first_rejected = jnp.min(jnp.where(admitted | (position >= num_out), num_out, position))
    return jnp.where(on, first_rejected, num_fetch)


def _saturated_int32(value, high: int) -> jax.Array:
    """An integer scalar clamped to ``[0, high]`` in its own dtype, then cast to int32."""
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        return jnp.clip(value.astype(jnp.int32), 0, high)
    info = jnp.iinfo(value.dtype)
    top = jnp.asarray(min(high, int(info.max)), value.dtype)
    low = jnp.asarray(max(0, int(info.min)), value.dtype)
    return jnp.clip(value, low, top).astype(jnp.int32)
