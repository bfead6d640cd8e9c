"""The plans the decode-time operations return (docs/semantics.md §4): what the caller copies,
computes on the CPU or may release. Records of arrays, with no behaviour but a short ``repr``;
every module that makes or reads a plan imports it from here."""

from __future__ import annotations

import jax

from pallas_cache import reprs
from pallas_cache.tree import Record, pytree_dataclass, static_field

__all__ = ["CopyPlan", "EnsurePlan", "ForgetPlan", "MaterializePlan", "ResizePlan"]


@pytree_dataclass
class CopyPlan(Record):
    """The host-to-device copies a step needs before its multiply.

    Attributes:
      dst_slots: int32[K']. Destination slot of each copy, in fetch order; -1 past ``count``.
      src_rows: int32[K']. The **layer-local** host row (expert id) of each copy, so it indexes the
        layer's own host bank; -1 past ``count``.
      count: int32[]. Number of valid entries.
      num_slots: static. The capacity ``C`` the plan was made for (the pool's allocated leading
        axis, not the usable size ``S``; None for a hand-built plan).
      num_experts: static. The experts per layer ``E`` its ``src_rows`` index (None likewise).
        Both let :func:`~pallas_cache.moe.apply_copy_plan` refuse a pool or bank of another
        geometry at trace time instead of dropping or misdirecting copies.
    """

    __repr__ = reprs.plan_repr

    dst_slots: jax.Array
    src_rows: jax.Array
    count: jax.Array
    num_slots: int | None = static_field(default=None)
    num_experts: int | None = static_field(default=None)


@pytree_dataclass
class EnsurePlan(Record):
    """What one ensure / ensure_hybrid call decided (docs/semantics.md §4).

    Attributes:
      slots: int32, the shape of ``expert_ids``. The slot each route reads its expert from; -1 for
        a CPU route or padding.
      cpu: bool, the shape of ``expert_ids``. True for routes the caller computes on the CPU from
        host RAM (hybrid only). Every non-padding route has exactly one of ``slots >= 0`` and
        ``cpu``; duplicates of one expert get the same answer.
      copy: the copies to make, ``K' = min(K, E)`` entries (``K`` = number of routes).
      active: int32[]. Distinct experts routed.
      missing: int32[]. Distinct routed experts that were not resident, before any cap.
      fetched: int32[]. Distinct experts being copied in (``copy.count``).
      error: int32[]. 0, or the error bits of ``errors`` (then everything else is empty and the
        state was returned unchanged).
    """

    __repr__ = reprs.plan_repr

    slots: jax.Array
    cpu: jax.Array
    copy: CopyPlan
    active: jax.Array
    missing: jax.Array
    fetched: jax.Array
    error: jax.Array


@pytree_dataclass
class MaterializePlan(Record):
    """What ``materialize_layer`` asks the caller to copy: the whole layer, position = id.

    Attributes:
      copy: ``E`` entries ``(e, e)`` for every expert, count ``E``; all -1 / 0 on error.
      error: int32[]. 0 or ERR_LAYER.
    """

    __repr__ = reprs.plan_repr

    copy: CopyPlan
    error: jax.Array


@pytree_dataclass
class ForgetPlan(Record):
    """What ``forget_slot`` dropped.

    Attributes:
      old: int32[]. The flat id (``layer * E + expert``) the slot held, or -1 (empty, or error).
      error: int32[]. 0 or ERR_SLOT.
    """

    __repr__ = reprs.plan_repr

    old: jax.Array
    error: jax.Array

    def __int__(self):
        return int(self.old)


@pytree_dataclass
class ResizePlan(Record):
    """What :func:`resize` freed (docs/semantics.md §5.15): the device buffers a caller may release.

    Attributes:
      freed_slots: int32[C]. The slots at or past the new size that were usable before, in
        ascending order; -1 past ``count``.
      freed_ids: int32[C]. The flat id (``layer * E + expert``) each freed slot held, -1 for an
        empty one (and past ``count``). Those experts are no longer resident.
      count: int32[]. Number of freed slots (``old size - new size`` on a shrink, else 0).
      error: int32[]. 0 or ``ERR_CACHE_SIZE`` (then nothing was freed and the state is unchanged).
    """

    __repr__ = reprs.plan_repr

    freed_slots: jax.Array
    freed_ids: jax.Array
    count: jax.Array
    error: jax.Array
