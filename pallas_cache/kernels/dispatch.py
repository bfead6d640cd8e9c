"""The two decisions that have kernel implementations, behind one dispatch point (docs/semantics.md §7).

Victim selection (the argmin over ``(usage, slot)``) and the seed-000 promotion decision are the
only parts of a cache step that scan the whole slot pool, so they are the parts worth a kernel.
Every op in ``ops.py`` routes them through the two functions here and nothing else, so wiring a
backend is a change to this file alone.

``backend`` is static: ``"xla"`` (pure ``jnp``), ``"pallas"`` (GPU, Triton lowering) or
``"interpret"`` (the Pallas kernels under the Pallas interpreter, for CPU tests). ``None``
resolves to ``"pallas"`` on GPU and ``"xla"`` elsewhere. All backends must produce identical
results.

Why the XLA path loops instead of sorting: on CPU, XLA's sort and top-k over a 2048-slot pool cost
hundreds of microseconds per call, while one masked argmin costs a microsecond or two; a step
fetches a handful of misses, so ``n`` rounds of "take the minimum, knock it out" (exactly
docs/semantics.md §5.2's "``m`` repeated argmins with the claimed slot knocked out") is far cheaper and obviously
right. :func:`argmin_among` is that argmin, shared with the fetch order in ``ops.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["BACKENDS", "argmin_among", "promotion_decision", "resolve_backend", "select_victims"]

BACKENDS = ("xla", "pallas", "interpret")
_INT32_MAX = jnp.iinfo(jnp.int32).max
# Pools up to this many slots scan for the promotion slot unconditionally (see promotion_decision).
_ALWAYS_SCAN_BELOW = 512
# Arrays up to this length take the single-pass argmin (see argmin_among).
_SINGLE_PASS_MAX = 1024


def resolve_backend(backend) -> str:
    """``None`` -> ``"pallas"`` on GPU, else ``"xla"``; anything unknown raises ValueError."""
    if backend is None:
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS} or None")
    return backend


def argmin_among(values, candidate):
    """The lowest index among ``candidate`` entries holding the smallest value, or -1 if none.

    Exact for every int32 value (no sentinel is folded into the values: a non-candidate's index is
    moved past every candidate's instead). This is the ``(usage, slot)`` argmin of victim
    selection; with ``~values`` (bitwise not, an order-reversing map with no overflow) it is the
    "largest value, lowest index" of the fetch order.

    Two formulations, chosen by the static length (measured on XLA:CPU, where a step's cost is
    mostly its number of kernels): up to ``_SINGLE_PASS_MAX`` entries one lexicographic reduction
    over (value, index) pairs; above it, two plain reductions (the minimum, then the lowest index
    holding it), which XLA vectorises better on long arrays.
    """
    size = values.shape[0]
    index = lax.iota(jnp.int32, size)
    if size <= _SINGLE_PASS_MAX:
        def smaller(a, b):
            a_first = (a[0] < b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
            return jnp.where(a_first, a[0], b[0]), jnp.where(a_first, a[1], b[1])

        _, best = lax.reduce(
            (jnp.where(candidate, values, _INT32_MAX), jnp.where(candidate, index, size + index)),
            (jnp.int32(_INT32_MAX), jnp.int32(2 * size)), smaller, (0,))
    else:
        smallest = jnp.min(jnp.where(candidate, values, _INT32_MAX))
        best = jnp.min(jnp.where(candidate & (values == smallest), index, size))
    return jnp.where(best < size, best, -1).astype(jnp.int32)


def select_victims(usage, step, n, *, num_out, backend="xla"):
    """The first ``n`` slots in ascending ``(usage, slot)`` order among evictable slots.

    Args:
      usage: int32[S], after this step's hit refresh.
      step: int32[], this step; a slot whose usage equals it is not evictable.
      n: int32[], traced, ``0 <= n <= num_out``: how many victims to take.
      num_out: static output length, ``<= S``.
      backend: "xla" | "pallas" | "interpret".

    Returns:
      int32[num_out]: the victims in claim order; entries ``>= n`` are -1 (and so is any entry
      beyond the number of evictable slots, which callers never reach since ``S >= E``).
    """
    backend = resolve_backend(backend)
    if backend != "xla":
        from pallas_cache.kernels.victims import victims

        return victims(usage, step, n, num_out=num_out, interpret=backend == "interpret")
    out = jnp.full((num_out,), -1, jnp.int32)
    if num_out == 0:
        return out
    n = jnp.minimum(jnp.asarray(n, jnp.int32), num_out)

    def claim_next(carry):
        k, evictable, out = carry
        slot = argmin_among(usage, evictable)
        knocked_out = evictable & (lax.iota(jnp.int32, evictable.shape[0]) != slot)
        return k + 1, knocked_out, out.at[k].set(slot)

    # A slot touched this step (a hit) is never a victim; each claimed slot is knocked out.
    _, _, out = lax.while_loop(
        lambda carry: carry[0] < n, claim_next, (jnp.int32(0), usage != step, out)
    )
    return out


def promotion_decision(usage, id_of_slot, step, recency_row, miss_mask, fraction16, num_fetch,
                       *, backend="xla"):
    """The seed-000 PROMOTE_ONE decision (docs/semantics.md §5.5); the caller has checked ``order == RECENCY``.

    Fires iff ``fraction16 > 0``, ``num_fetch == 0``, some expert missed, the argmin evictable
    slot (ascending ``(usage, slot)``, ``usage != step``) is empty (``id_of_slot == -1``), and the
    first miss in recency order (largest pre-call recency, ties to the lowest id) was routed
    before (``recency >= 0``).

    Args:
      usage: int32[S], after this step's hit refresh.
      id_of_slot: int32[S].
      step: int32[], this step.
      recency_row: int32[E], the layer's recency before this call.
      miss_mask: bool[E], the routed experts that are not resident.
      fraction16: int32[], the policy fraction (0 = fixed cap, which never promotes).
      num_fetch: int32[], the split's ``F``.
      backend: "xla" | "pallas" | "interpret".

    Returns:
      ``(expert, slot)`` int32 scalars: the layer-local expert to fetch and the slot it takes,
      or ``(-1, -1)`` when the rule does not fire.
    """
    backend = resolve_backend(backend)
    if backend != "xla":
        from pallas_cache.kernels.promotion import promotion

        return promotion(usage, id_of_slot, step, recency_row, miss_mask, fraction16, num_fetch,
                         interpret=backend == "interpret")
    # The first miss in recency order: the largest recency among misses, lowest id on ties.
    expert = argmin_among(~recency_row, miss_mask)
    recurring = recency_row[jnp.maximum(expert, 0)] >= 0
    candidate = (fraction16 > 0) & (num_fetch == 0) & (expert >= 0) & recurring

    def lru_slot_if_empty():
        slot = argmin_among(usage, usage != step)
        return jnp.where((slot >= 0) & (id_of_slot[jnp.maximum(slot, 0)] == -1), slot, -1)

    # On a large pool the scan only runs when everything else already holds; on a small one a
    # conditional costs more than the scan itself (measured on XLA:CPU), so it always runs.
    if usage.shape[0] <= _ALWAYS_SCAN_BELOW:
        slot = jnp.where(candidate, lru_slot_if_empty(), -1)
    else:
        slot = lax.cond(candidate, lru_slot_if_empty, lambda: jnp.int32(-1))
    fires = candidate & (slot >= 0)
    expert = jnp.where(fires, expert, -1).astype(jnp.int32)
    return expert, jnp.where(fires, slot, -1).astype(jnp.int32)
