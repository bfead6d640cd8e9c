"""Decode-time operations of the reference: ensure, ensure_hybrid, materialize_layer, forget_slot.

The imperative twin of ``pallas_cache.ops`` (docs/semantics.md §5.2-§5.7), one rule per comment.
The plans have the JAX plans' type names and structure (``EnsurePlan`` with a nested ``copy`` of a
:class:`CopyPlan`), as plain mutable dataclasses over NumPy arrays and ints, so a lockstep test
compares them field by field with no translation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ERR_EXPERT_ID, ERR_LAYER, ERR_SLOT, int_arg
from .evictions import ranked_victims
from .policy import ReferencePolicy
from .state import FORGOTTEN

ORDERS = ("recency", "lowest_id")
ADMISSIONS = ("promote_one", "none", "reuse")


@dataclass
class CopyPlan:
    """The host-to-device copies a step needs, in fetch order, -1 padded past ``count``."""

    dst_slots: np.ndarray  # [K'] destination slot of each copy
    src_rows: np.ndarray  # [K'] layer-local host row (expert id) of each copy
    count: int = 0  # valid copy entries

    @classmethod
    def empty(cls, width: int) -> "CopyPlan":
        return cls(dst_slots=np.full(width, -1, np.int64), src_rows=np.full(width, -1, np.int64))


@dataclass
class EnsurePlan:
    """What one ``ensure``/``ensure_hybrid`` call decided (docs/semantics.md §4): fixed-size and
    -1-padded exactly like the JAX ``EnsurePlan``."""

    slots: np.ndarray  # input shape: slot to read each route from, -1 for CPU or padding
    cpu: np.ndarray  # input shape, bool: the caller computes this route on the CPU
    copy: CopyPlan  # the copies, K' = min(K, E) entries
    active: int = 0  # distinct experts routed
    missing: int = 0  # distinct experts not resident, before any cap
    fetched: int = 0  # distinct experts copied in
    error: int = 0  # bit set of ERR_* codes


@dataclass
class MaterializePlan:
    """What ``materialize_layer`` asks the caller to copy: ``(e, e)`` for every expert."""

    copy: CopyPlan
    error: int = 0


@dataclass
class ForgetPlan:
    """The result of ``forget_slot``: the flat id the slot held (or -1) and the error bits."""

    old: int = -1
    error: int = 0

    def __int__(self) -> int:
        return self.old


class DecodeOps:
    """The decode operations, mixed into ``ReferenceCache`` over a ``ReferenceState``."""

    def _ranked_victims(self, step, layer=None) -> list[int]:
        """Evictable slots in ascending ``(usage, slot)`` order.

        A slot whose usage is ``step`` was touched by this very call (a hit, or a victim already
        claimed) and is never a victim: without that rule a step could evict an expert it is
        about to read. The k-th entry is what ``k + 1`` repeated argmins with the claimed slot
        knocked out would pick. Only the usable slots ``[0, cache_size)`` are candidates.
        Another eviction policy ranks the residents its own way (docs/semantics.md §5.16).
        """
        return ranked_victims(self, step, layer)

    def _error_plan(self, routes, width, error) -> EnsurePlan:
        return EnsurePlan(
            slots=np.full(routes.shape, -1, np.int64),
            cpu=np.zeros(routes.shape, bool),
            copy=CopyPlan.empty(width),
            error=error,
        )

    # ---- decode --------------------------------------------------------------------------------

    def ensure(self, layer, expert_ids) -> EnsurePlan:
        """Make every routed expert of ``layer`` resident, evicting by global LRU (docs/semantics.md §5.2)."""
        return self._ensure(layer, expert_ids, policy=None, order="lowest_id", admission="none")

    def ensure_hybrid(
        self, layer, expert_ids, policy: ReferencePolicy, order="recency", admission="promote_one"
    ) -> EnsurePlan:
        """Fetch what the policy's split says, hand the other misses to the CPU (docs/semantics.md §5.4)."""
        if not isinstance(policy, ReferencePolicy):
            raise TypeError(f"policy must be a ReferencePolicy, got {policy!r}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        if admission == "reuse" and not self.eviction.allows_reuse:
            raise ValueError(
                f"admission reuse needs eviction lru, got eviction {self.eviction.name}")
        return self._ensure(layer, expert_ids, policy=policy, order=order, admission=admission)

    def _ensure(self, layer, expert_ids, policy, order, admission) -> EnsurePlan:
        layer = int_arg(layer, "layer")
        routes = self._routes(expert_ids)
        flat_routes = routes.reshape(-1)
        E = self.num_experts
        width = min(flat_routes.size, E)  # distinct routes of one layer never exceed E

        # Check everything before changing anything.
        error = 0
        if np.any((flat_routes < -1) | (flat_routes >= E)):
            error |= ERR_EXPERT_ID
        if not self._layer_ok(layer):
            error |= ERR_LAYER
        if error:
            return self._error_plan(routes, width, error)
        routes = routes.astype(np.int64)  # every id is now in [-1, E)
        flat_routes = routes.reshape(-1)

        t = self._tick()
        base = layer * E
        hybrid = policy is not None

        # The histogram describes what the router asked for: every non-padding route counts,
        # duplicates included (deduplicating would flatten the skew it exists to measure).
        if self.settings.collect_routing:
            for expert in flat_routes:
                if expert >= 0:
                    self.routing.freq[layer, expert] += 1

        # Distinct routes, first occurrence wins; padding (-1) is ignored everywhere.
        distinct: list[int] = []
        for expert in flat_routes:
            if expert >= 0 and expert not in distinct:
                distinct.append(int(expert))

        # The eviction policy sees the call (docs/semantics.md §5.16): PAIR_LFU decays and counts.
        self.eviction.observe(self, layer, distinct)

        # Hits refresh their slot, which also protects it for the rest of this step.
        missing: list[int] = []
        for expert in distinct:
            slot = self.residency.slot_for_id[layer, expert]
            if slot >= 0:
                self.residency.usage[slot] = t
            else:
                missing.append(expert)

        # Fetch order. RECENCY (hybrid only): most recently routed first, using recency as it
        # was before this call, ties to the lower id, never-routed (-1) last. Otherwise by id.
        if hybrid and order == "recency":
            missing.sort(key=lambda e: (-self.routing.recency[layer, e], e))
        else:
            missing.sort()

        num_missing = len(missing)
        num_fetch = policy.split(num_missing) if hybrid else num_missing
        victims = self._ranked_victims(t, layer)

        # Admission (docs/semantics.md §5.5) only acts with the recency order and a fraction policy.
        if hybrid and order == "recency" and policy.fraction16 > 0:
            if admission == "promote_one":
                # A recurring miss that the split rounds down to zero fetches would otherwise run
                # on the CPU forever while slots sit empty: promote exactly that one expert into
                # the empty slot the argmin would pick. A first-time miss is never promoted.
                if (
                    num_fetch == 0
                    and num_missing >= 1
                    and self.residency.id_of_slot[victims[0]] == -1
                    and self.routing.recency[layer, missing[0]] >= 0
                ):
                    num_fetch = 1
            elif admission == "reuse":
                # Past the split, admit a miss while it was routed more recently than the slot
                # it would take was used; the first rejection ends the walk.
                while num_fetch < num_missing:
                    recency = self.routing.recency[layer, missing[num_fetch]]
                    if recency >= 0 and recency >= self.residency.usage[victims[num_fetch]]:
                        num_fetch += 1
                    else:
                        break

        # Install the first num_fetch misses: the k-th miss takes the k-th victim, whose old
        # occupant (any layer) loses residency. The copy plan is in fetch order and its source
        # rows are layer-local, so each layer's host bank can be its own allocation.
        dst_slots = np.full(width, -1, np.int64)
        src_rows = np.full(width, -1, np.int64)
        for k, expert in enumerate(missing[:num_fetch]):
            victim = victims[k]
            old = self.residency.id_of_slot[victim]
            if old >= 0:
                self.residency.slot_for_id[old // E, old % E] = -1
            self.residency.id_of_slot[victim] = base + expert
            self.residency.slot_for_id[layer, expert] = victim
            self.residency.usage[victim] = t
            dst_slots[k] = victim
            src_rows[k] = expert

        # Each route reads its expert's slot after installation; a routed expert without one
        # is a CPU route. Duplicates get the same answer, padding gets neither.
        slots = np.full(flat_routes.shape, -1, np.int64)
        cpu = np.zeros(flat_routes.shape, bool)
        for i, expert in enumerate(flat_routes):
            if expert >= 0:
                slots[i] = self.residency.slot_for_id[layer, expert]
                cpu[i] = slots[i] < 0

        # Recency: every distinct routed expert of a hybrid call, hit, fetched or CPU, in both
        # fetch orders (docs/semantics.md §10: the Rust port's choice).
        if hybrid:
            for expert in distinct:
                self.routing.recency[layer, expert] = t

        self.stats[layer] += (1, len(distinct), num_missing, num_fetch)
        return EnsurePlan(
            slots=slots.reshape(routes.shape),
            cpu=cpu.reshape(routes.shape),
            copy=CopyPlan(dst_slots=dst_slots, src_rows=src_rows, count=num_fetch),
            active=len(distinct),
            missing=num_missing,
            fetched=num_fetch,
        )

    def start_token(self) -> None:
        """route_knn: the next accepted call starts a token (docs/semantics.md §5.16); the other
        policies ignore it."""
        self.eviction.start_token(self)

    def materialize_layer(self, layer) -> MaterializePlan:
        """Copy a whole layer into slots ``[0, E)`` with position == expert id (docs/semantics.md §5.6).

        Routing ids then index the buffer directly. The bookkeeping is what matters: this layer's
        stale placements elsewhere are emptied, and any other layer's expert living in
        ``[0, E)`` loses residency, or the next decode step would hit on someone else's bytes.
        The plan's copy lists ``(e, e)`` for every expert (``count == E``). Recency and counters
        are untouched.
        """
        layer = int_arg(layer, "layer")
        E = self.num_experts
        if not self._layer_ok(layer):
            return MaterializePlan(copy=CopyPlan.empty(E), error=ERR_LAYER)
        t = self._tick()  # first, so a rebase sees the stamps as they were on entry
        base = layer * E
        previous = self.residency.id_of_slot.copy()  # every check reads the occupant as it was on entry
        for slot, old in enumerate(previous):
            if base <= old < base + E:
                self.residency.id_of_slot[slot] = -1
                self.residency.usage[slot] = 0
        for old in previous[:E]:
            if old >= 0 and not (base <= old < base + E):
                self.residency.slot_for_id[old // E, old % E] = -1
        experts = np.arange(E, dtype=np.int64)
        self.residency.id_of_slot[:E] = base + experts
        self.residency.slot_for_id[layer] = experts
        self.residency.usage[:E] = t
        copy = CopyPlan(dst_slots=experts.copy(), src_rows=experts.copy(), count=E)
        return MaterializePlan(copy=copy)

    def forget_slot(self, slot) -> ForgetPlan:
        """Drop one slot's residency after a failed copy (docs/semantics.md §5.7).

        The map records copies the caller was *asked* to make; if one failed, the next step
        would hit on garbage. The slot becomes empty and its usage the oldest possible value,
        so a pool under pressure spends it before evicting a real resident. Idempotent.
        """
        slot = int_arg(slot, "slot")
        if not 0 <= slot < self.cache_size:  # the usable size: unusable slots hold nothing
            return ForgetPlan(old=-1, error=ERR_SLOT)
        old = int(self.residency.id_of_slot[slot])
        if old < 0:
            return ForgetPlan(old=-1)
        self.residency.id_of_slot[slot] = -1
        self.residency.slot_for_id[old // self.num_experts, old % self.num_experts] = -1
        self.residency.usage[slot] = FORGOTTEN
        return ForgetPlan(old=old)
