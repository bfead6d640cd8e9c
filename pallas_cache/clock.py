"""Keeping the int32 clock from wrapping: the dense-rank rebase (docs/semantics.md §5.12).

Every live stamp (``usage``, ``recency``, ``step``) is renumbered by its rank once the clock
reaches ``state.settings.rebase_threshold``; the XLA step's rebase carries its own batching rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap

from pallas_cache.state import CacheState, Clock
from pallas_cache.validate import INT32_MIN

__all__ = ["dense_rank_stamps", "rebase_if_due"]


def dense_rank_stamps(usage, recency, step):
    """Renumber every live stamp to its dense rank among all live stamps (see module doc).

    Args:
      usage: int32[S]; live where ``>= 1``.
      recency: int32[L, E]; live where ``>= 0``.
      step: int32[]; always live.

    Returns:
      ``(usage, recency, step)`` with live stamps replaced by ranks ``1..n`` and dead ones kept.
    """
    values = jnp.concatenate([usage, recency.reshape(-1), step[None]])
    live = jnp.concatenate([usage >= 1, recency.reshape(-1) >= 0, jnp.ones((1,), jnp.bool_)])
    # Dead values sort first (every live stamp is >= 0) and are never counted.
    key = jnp.where(live, values, INT32_MIN)
    order = jnp.argsort(key)
    sorted_key = key[order]
    sorted_live = live[order]
    first_of_value = jnp.concatenate([jnp.ones((1,), jnp.bool_), sorted_key[1:] != sorted_key[:-1]])
    rank_sorted = jnp.cumsum(first_of_value & sorted_live, dtype=jnp.int32)
    rank = jnp.zeros_like(values).at[order].set(rank_sorted)
    renumbered = jnp.where(live, rank, values)
    num_slots = usage.shape[0]
    return (
        renumbered[:num_slots],
        renumbered[num_slots:-1].reshape(recency.shape),
        renumbered[-1],
    )


@custom_vmap
def _rebase_stamps(due, usage, recency, step):
    """``dense_rank_stamps`` under ``lax.cond(due, ...)``, with a batching rule that keeps the
    conditional a real branch.

    Under a plain ``vmap`` a ``lax.cond`` with a batched predicate becomes a ``select`` that runs
    *both* branches for every cache, so every step of a vmapped replay would sort all stamps
    (measured: about 100x the cost of the rest of the step on CPU). The rebase is rare, so the
    rule below branches once on "any cache of the batch is due" and renumbers only then, keeping
    the caches that are not due unchanged.
    """
    return lax.cond(due, dense_rank_stamps, lambda u, r, s: (u, r, s), usage, recency, step)


@_rebase_stamps.def_vmap
def _rebase_stamps_vmap(axis_size, in_batched, due, usage, recency, step):
    due, usage, recency, step = (
        value if batched else jnp.broadcast_to(value, (axis_size,) + jnp.shape(value))
        for value, batched in zip((due, usage, recency, step), in_batched)
    )

    def renumber_due(stamps):
        renumbered = jax.vmap(dense_rank_stamps)(*stamps)
        return tuple(
            jnp.where(due.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
            for new, old in zip(renumbered, stamps)
        )

    stamps = lax.cond(jnp.any(due), renumber_due, lambda stamps: stamps, (usage, recency, step))
    return stamps, (True, True, True)


def rebase_if_due(state: CacheState, accepted) -> CacheState:
    """The state with its stamps renumbered if the call is accepted and ``step`` reached the
    threshold; otherwise the state itself. Traced: the renumbering runs under ``lax.cond``, also
    under ``vmap`` (see ``_rebase_stamps``)."""
    due = accepted & (state.step >= state.settings.rebase_threshold)
    usage, recency, step = _rebase_stamps(due, state.residency.usage, state.routing.recency,
                                          state.step)
    return state.replace(residency=state.residency.replace(usage=usage),
                         routing=state.routing.replace(recency=recency), clock=Clock(step=step))
