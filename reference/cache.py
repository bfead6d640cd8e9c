"""The NumPy oracle of the expert slot cache: docs/semantics.md §3-§6 and §5.12, written to be read.

This is the imperative twin of ``pallas_cache``: one method per operation, int64 arrays, plain
loops, and each rule stated once, in a comment next to the line that implements it. It imports no
JAX. The property tests drive both implementations with the same operations and compare every
state field and every plan field after every step, so where this file and the JAX code disagree,
one of them is wrong and docs/semantics.md says which.

Why the rules are what they are, in one place:

- **One id space, one pool.** Expert ``e`` of layer ``l`` is the flat id ``l * E + e``, and all
  layers compete for the same ``S`` slots: routing is not uniform across layers, and a global LRU
  puts the residency where the traffic is.
- **Victims by ``(usage, slot)`` ascending; a slot touched this step is never a victim.** The
  tie-break is what lets a GPU kernel and this reference pick the same slot. The exclusion is what
  keeps a step from evicting an expert it is about to read.
- **Duplicate routes collapse.** Two tokens routed to one expert are one miss, one copy, one slot.
- **Every route is assigned exactly once** -- to a slot or to the CPU -- so the caller can simply
  add the GPU and CPU partial results.
- **Value errors change nothing.** A bad id, layer or slot comes back as an error bit with the
  cache exactly as it was (not even the clock moves), so a server can drop one bad request and
  keep serving. The reasons behind the choices are in ``docs/design.md``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from .policy import ReferencePolicy

# ---- error bits (docs/semantics.md §6; the same values as pallas_cache.errors) -------------------------------
ERR_EXPERT_ID = 1  # a route outside [-1, E)
ERR_LAYER = 2  # a layer outside [0, L)
ERR_SLOT = 4  # a slot outside [0, S)
ERR_PREFILL_NOT_BEGUN = 8  # staging a layer before begin_prefill
ERR_PREFILL_BUSY = 16  # staging into a buffer whose layer was not released

#: ``usage`` of a slot dropped by ``forget_slot``: older than anything, so it is the first victim.
FORGOTTEN = -(2**31)
#: Default clock value at which the stamps are renumbered (docs/semantics.md §5.12).
DEFAULT_REBASE_THRESHOLD = 2**30
#: Per-expert row size below which a bank ships its whole layer as one prefill entry.
SMALL_BANK_FEAT_BYTES = 256 * 1024
#: The routing mass ``experts_for_90pct`` covers.
COVERAGE_FRACTION = 0.9

ORDERS = ("recency", "lowest_id")
ADMISSIONS = ("promote_one", "none", "reuse")


class RebuildRejected(ValueError):
    """A pool resize the cache refused, having changed nothing."""

    def __init__(self, requested: int, minimum: int):
        self.requested = requested
        self.minimum = minimum
        super().__init__(
            f"expert cache of {requested} slots cannot hold one layer of {minimum} experts"
        )


class PrefillDoesNotFit(ValueError):
    """The pool cannot lend the two prefill buffers their ``2 * E`` slots."""


# ---- plans -------------------------------------------------------------------------------------


@dataclass
class ReferencePlan:
    """What one ``ensure``/``ensure_hybrid``/``materialize_layer`` call asks the caller to do.

    Fixed-size and -1-padded exactly like the JAX ``EnsurePlan`` (docs/semantics.md §4), so the two compare
    field by field. ``dst_slots``/``src_rows``/``count`` are the copy plan (``plan.copy.*`` in JAX).
    """

    slots: np.ndarray  # input shape: slot to read each route from, -1 for CPU or padding
    cpu: np.ndarray  # input shape, bool: the caller computes this route on the CPU
    dst_slots: np.ndarray  # [K'] destination slot of each copy, -1 padded
    src_rows: np.ndarray  # [K'] layer-local host row of each copy, -1 padded
    count: int = 0  # valid copy entries
    active: int = 0  # distinct experts routed
    missing: int = 0  # distinct experts not resident, before any cap
    fetched: int = 0  # distinct experts copied in
    error: int = 0  # bit set of ERR_* codes


@dataclass
class ForgetPlan:
    """The result of ``forget_slot``: the flat id the slot held (or -1) and the error bits."""

    old: int = -1
    error: int = 0

    def __int__(self) -> int:
        return self.old


@dataclass
class ReferencePrefillPlan:
    """What staging one layer into a prefill buffer costs (docs/semantics.md §5.11), fixed-size, -1 padded.

    Gathers are device-side copies ``slot -> slot`` of rows already resident above the buffers;
    runs are the maximal runs of consecutive missing expert ids; entries are the host transfers,
    grouped by bank in the caller's order. Byte counts come from ``entry_bytes`` (host-side,
    since they overflow int32 for large banks).
    """

    layer: int
    buffer_id: int
    already_loaded: bool
    gather_dst_slots: np.ndarray  # [E]
    gather_src_slots: np.ndarray  # [E]
    gather_count: int
    run_starts: np.ndarray  # [E]
    run_lens: np.ndarray  # [E]
    run_count: int
    entry_bank: np.ndarray  # [B*E]
    entry_dst_slot: np.ndarray  # [B*E]
    entry_src_row: np.ndarray  # [B*E]
    entry_rows: np.ndarray  # [B*E]
    entry_whole_layer: np.ndarray  # [B*E] bool
    entry_count: int
    gather_banks: np.ndarray  # [B], -1 padded: banks the gather serves (rows >= 256 KiB)
    error: int = 0

    def entry_bytes(self, bank_feat_bytes) -> list[int]:
        """Bytes of each valid host-transfer entry: ``rows * bank_feat_bytes[bank]``."""
        return [
            int(self.entry_rows[i]) * int(bank_feat_bytes[int(self.entry_bank[i])])
            for i in range(self.entry_count)
        ]


@dataclass
class ReferenceStats:
    """The four counters of a stats window and the rates derived from them (docs/semantics.md §5.9)."""

    calls: int = 0
    active: int = 0
    missing: int = 0
    fetched: int = 0

    @staticmethod
    def _ratio(num: int, den: int) -> float:
        return num / den if den else 0.0

    @property
    def miss_rate(self) -> float:
        return self._ratio(self.missing, self.active)

    @property
    def fetch_rate(self) -> float:
        return self._ratio(self.fetched, self.missing)

    @property
    def active_per_call(self) -> float:
        return self._ratio(self.active, self.calls)

    @property
    def missing_per_call(self) -> float:
        return self._ratio(self.missing, self.calls)

    @property
    def fetched_per_call(self) -> float:
        return self._ratio(self.fetched, self.calls)


@dataclass
class LayerSkew:
    """One layer's routing concentration (docs/semantics.md §5.10)."""

    layer: int
    routed: int  # routes observed, duplicates counted
    working_set: int  # experts routed at least once
    experts_for_90pct: int  # hottest experts needed to cover 90% of the mass
    norm_entropy: float  # -sum p ln p / ln E; 0.0 when E == 1
    oracle_hit_at_slots: float  # share of the oracle_slots hottest experts


@dataclass
class SkewReport:
    """Routing skew over the layers that were routed to; means exclude un-routed layers."""

    slots_per_layer: float
    oracle_slots: int
    working_set_mean: float
    working_set_max: int
    experts_for_90pct: float
    oracle_hit_at_slots: float
    norm_entropy: float
    per_layer: list = field(default_factory=list)


def _int_arg(value, what) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


# ---- the cache ---------------------------------------------------------------------------------


class ReferenceCache:
    """The expert slot cache as a mutable object over int64 NumPy arrays.

    Attributes mirror the JAX ``CacheState`` fields: ``slot_for_id [L, E]``, ``id_of_slot [S]``,
    ``usage [S]``, ``step``, ``recency [L, E]``, ``stats_table [L, 4]`` (calls, active, missing,
    fetched), ``routing_freq [L, E]``, ``collect_routing``, and the prefill bookkeeping
    ``prefill_layer [2]`` (-1 = none), ``prefill_released [2]``, ``prefill_open``,
    ``prefill_snapshot [L, E]``, ``prefill_hit_rows``, ``prefill_rows``.
    """

    def __init__(self, num_layers, num_experts, cache_size, rebase_threshold=DEFAULT_REBASE_THRESHOLD):
        num_layers = _int_arg(num_layers, "num_layers")
        num_experts = _int_arg(num_experts, "num_experts")
        cache_size = _int_arg(cache_size, "cache_size")
        if num_layers < 1 or num_experts < 1:
            raise ValueError(
                f"a MoE model has layers and experts, got num_layers={num_layers}, "
                f"num_experts={num_experts}"
            )
        if cache_size < num_experts:
            raise ValueError(
                f"cache_size {cache_size} cannot hold one layer of {num_experts} experts"
            )
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.cache_size = cache_size
        self.rebase_threshold = _int_arg(rebase_threshold, "rebase_threshold")
        self.collect_routing = False
        self._clear(cache_size)

    # ---- construction and cold starts ------------------------------------------------------

    def _clear(self, cache_size):
        """A cold cache of ``cache_size`` slots: everything but geometry and the routing flag."""
        L, E = self.num_layers, self.num_experts
        self.cache_size = cache_size
        self.slot_for_id = np.full((L, E), -1, np.int64)
        self.id_of_slot = np.full(cache_size, -1, np.int64)
        self.usage = np.zeros(cache_size, np.int64)
        self.step = 0
        self.recency = np.full((L, E), -1, np.int64)
        self.stats_table = np.zeros((L, 4), np.int64)
        self.routing_freq = np.zeros((L, E), np.int64)
        self.prefill_layer = np.full(2, -1, np.int64)
        self.prefill_released = np.ones(2, bool)
        self.prefill_open = False
        self.prefill_snapshot = np.full((L, E), -1, np.int64)
        self.prefill_hit_rows = 0
        self.prefill_rows = 0

    def reset(self):
        """A cold start: residency, clock, recency, counters, histogram and prefill all cleared.

        The counters go too: carried across a cold start they would skew every per-call rate.
        """
        self._clear(self.cache_size)

    def rebuild(self, cache_size):
        """Resize the pool, dropping everything resident (slot ids no longer mean anything).

        A target below ``E`` is refused with ``RebuildRejected`` *before* anything changes, so the
        caller keeps serving from the old cache.
        """
        cache_size = _int_arg(cache_size, "cache_size")
        if cache_size < self.num_experts:
            raise RebuildRejected(requested=cache_size, minimum=self.num_experts)
        self._clear(cache_size)

    # ---- helpers -----------------------------------------------------------------------------

    def _routes(self, expert_ids) -> np.ndarray:
        """The routes as an object array of Python ints: exact for every integer dtype.

        No cast can wrap a wide id (``2**32 + 3``, uint64 max) into a valid one or into padding:
        the range check of docs/semantics.md §6 sees the value the caller wrote.
        """
        # A list is read as Python objects: NumPy would turn [3, 2**63] into floats.
        routes = np.asarray(expert_ids, dtype=None if hasattr(expert_ids, "dtype") else object)
        if routes.size == 0:
            return np.zeros(routes.shape, np.int64)
        if routes.dtype == bool or not (np.issubdtype(routes.dtype, np.integer)
                                        or routes.dtype == object):
            raise TypeError(f"expert_ids must be integers, got dtype {routes.dtype}")
        for v in routes.ravel():
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
                raise TypeError(f"expert_ids must be integers, got {v!r} ({type(v).__name__})")
        return np.array([int(v) for v in routes.ravel()], dtype=object).reshape(routes.shape)

    def _layer_ok(self, layer) -> bool:
        return 0 <= layer < self.num_layers

    def _tick(self) -> int:
        """Advance the clock, renumbering the stamps first if it reached the threshold."""
        if self.step >= self.rebase_threshold:
            self._rebase()
        self.step += 1
        return self.step

    def _rebase(self):
        """Replace every live stamp by its dense rank among all live stamps (docs/semantics.md §5.12).

        Live: ``usage >= 1`` (0 is "empty", FORGOTTEN is "forgotten"), ``recency >= 0`` (-1 is
        "never routed") and ``step``. Ranks start at 1, so sentinels survive, occupied slots keep
        ``usage >= 1``, and every comparison between two live stamps -- usage against usage,
        recency against recency, recency against usage -- gives the same answer as before.
        """
        live_usage = self.usage >= 1
        live_recency = self.recency >= 0
        stamps = np.unique(
            np.concatenate([self.usage[live_usage], self.recency[live_recency], [self.step]])
        )
        rank = lambda values: np.searchsorted(stamps, values) + 1  # noqa: E731
        self.usage[live_usage] = rank(self.usage[live_usage])
        self.recency[live_recency] = rank(self.recency[live_recency])
        self.step = int(rank(self.step))

    def _ranked_victims(self, step) -> list[int]:
        """Evictable slots in ascending ``(usage, slot)`` order.

        A slot whose usage is ``step`` was touched by this very call (a hit, or a victim already
        claimed) and is never a victim: without that rule a step could evict an expert it is
        about to read. The k-th entry is what ``k + 1`` repeated argmins with the claimed slot
        knocked out would pick.
        """
        return sorted(
            (slot for slot in range(self.cache_size) if self.usage[slot] != step),
            key=lambda slot: (self.usage[slot], slot),
        )

    def _error_plan(self, routes, width, error) -> ReferencePlan:
        return ReferencePlan(
            slots=np.full(routes.shape, -1, np.int64),
            cpu=np.zeros(routes.shape, bool),
            dst_slots=np.full(width, -1, np.int64),
            src_rows=np.full(width, -1, np.int64),
            error=error,
        )

    # ---- decode --------------------------------------------------------------------------------

    def ensure(self, layer, expert_ids) -> ReferencePlan:
        """Make every routed expert of ``layer`` resident, evicting by global LRU (docs/semantics.md §5.2)."""
        return self._ensure(layer, expert_ids, policy=None, order="lowest_id", admission="none")

    def ensure_hybrid(
        self, layer, expert_ids, policy: ReferencePolicy, order="recency", admission="promote_one"
    ) -> ReferencePlan:
        """Fetch what the policy's split says, hand the other misses to the CPU (docs/semantics.md §5.4)."""
        if not isinstance(policy, ReferencePolicy):
            raise TypeError(f"policy must be a ReferencePolicy, got {policy!r}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        return self._ensure(layer, expert_ids, policy=policy, order=order, admission=admission)

    def _ensure(self, layer, expert_ids, policy, order, admission) -> ReferencePlan:
        layer = _int_arg(layer, "layer")
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
        if self.collect_routing:
            for expert in flat_routes:
                if expert >= 0:
                    self.routing_freq[layer, expert] += 1

        # Distinct routes, first occurrence wins; padding (-1) is ignored everywhere.
        distinct: list[int] = []
        for expert in flat_routes:
            if expert >= 0 and expert not in distinct:
                distinct.append(int(expert))

        # Hits refresh their slot, which also protects it for the rest of this step.
        missing: list[int] = []
        for expert in distinct:
            slot = self.slot_for_id[layer, expert]
            if slot >= 0:
                self.usage[slot] = t
            else:
                missing.append(expert)

        # Fetch order. RECENCY (hybrid only): most recently routed first, using recency as it
        # was before this call, ties to the lower id, never-routed (-1) last. Otherwise by id.
        if hybrid and order == "recency":
            missing.sort(key=lambda e: (-self.recency[layer, e], e))
        else:
            missing.sort()

        num_missing = len(missing)
        num_fetch = policy.split(num_missing) if hybrid else num_missing
        victims = self._ranked_victims(t)

        # Admission (docs/semantics.md §5.5) only acts with the recency order and a fraction policy.
        if hybrid and order == "recency" and policy.fraction16 > 0:
            if admission == "promote_one":
                # A recurring miss that the split rounds down to zero fetches would otherwise run
                # on the CPU forever while slots sit empty: promote exactly that one expert into
                # the empty slot the argmin would pick. A first-time miss is never promoted.
                if (
                    num_fetch == 0
                    and num_missing >= 1
                    and self.id_of_slot[victims[0]] == -1
                    and self.recency[layer, missing[0]] >= 0
                ):
                    num_fetch = 1
            elif admission == "reuse":
                # Past the split, admit a miss while it was routed more recently than the slot
                # it would take was used; the first rejection ends the walk.
                while num_fetch < num_missing:
                    recency = self.recency[layer, missing[num_fetch]]
                    if recency >= 0 and recency >= self.usage[victims[num_fetch]]:
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
            old = self.id_of_slot[victim]
            if old >= 0:
                self.slot_for_id[old // E, old % E] = -1
            self.id_of_slot[victim] = base + expert
            self.slot_for_id[layer, expert] = victim
            self.usage[victim] = t
            dst_slots[k] = victim
            src_rows[k] = expert

        # Each route reads its expert's slot after installation; a routed expert without one
        # is a CPU route. Duplicates get the same answer, padding gets neither.
        slots = np.full(flat_routes.shape, -1, np.int64)
        cpu = np.zeros(flat_routes.shape, bool)
        for i, expert in enumerate(flat_routes):
            if expert >= 0:
                slots[i] = self.slot_for_id[layer, expert]
                cpu[i] = slots[i] < 0

        # Recency: every distinct routed expert of a hybrid call, hit, fetched or CPU, in both
        # fetch orders (docs/semantics.md §10: the Rust port's choice).
        if hybrid:
            for expert in distinct:
                self.recency[layer, expert] = t

        self.stats_table[layer] += (1, len(distinct), num_missing, num_fetch)
        return ReferencePlan(
            slots=slots.reshape(routes.shape),
            cpu=cpu.reshape(routes.shape),
            dst_slots=dst_slots,
            src_rows=src_rows,
            count=num_fetch,
            active=len(distinct),
            missing=num_missing,
            fetched=num_fetch,
        )

    def materialize_layer(self, layer) -> ReferencePlan:
        """Copy a whole layer into slots ``[0, E)`` with position == expert id (docs/semantics.md §5.6).

        Routing ids then index the buffer directly. The bookkeeping is what matters: this layer's
        stale placements elsewhere are emptied, and any other layer's expert living in
        ``[0, E)`` loses residency, or the next decode step would hit on someone else's bytes.
        The plan has the copy fields of an ensure plan (``count == E``); ``slots`` is the
        identity over ``[0, E)``. Recency and counters are untouched.
        """
        layer = _int_arg(layer, "layer")
        E = self.num_experts
        if not self._layer_ok(layer):
            return self._error_plan(np.zeros(E, np.int64), E, ERR_LAYER)
        t = self._tick()  # first, so a rebase sees the stamps as they were on entry
        base = layer * E
        previous = self.id_of_slot.copy()  # every check reads the occupant as it was on entry
        for slot, old in enumerate(previous):
            if base <= old < base + E:
                self.id_of_slot[slot] = -1
                self.usage[slot] = 0
        for old in previous[:E]:
            if old >= 0 and not (base <= old < base + E):
                self.slot_for_id[old // E, old % E] = -1
        experts = np.arange(E, dtype=np.int64)
        self.id_of_slot[:E] = base + experts
        self.slot_for_id[layer] = experts
        self.usage[:E] = t
        return ReferencePlan(
            slots=experts.copy(),
            cpu=np.zeros(E, bool),
            dst_slots=experts.copy(),
            src_rows=experts.copy(),
            count=E,
        )

    def forget_slot(self, slot) -> ForgetPlan:
        """Drop one slot's residency after a failed copy (docs/semantics.md §5.7).

        The map records copies the caller was *asked* to make; if one failed, the next step
        would hit on garbage. The slot becomes empty and its usage the oldest possible value,
        so a pool under pressure spends it before evicting a real resident. Idempotent.
        """
        slot = _int_arg(slot, "slot")
        if not 0 <= slot < self.cache_size:
            return ForgetPlan(old=-1, error=ERR_SLOT)
        old = int(self.id_of_slot[slot])
        if old < 0:
            return ForgetPlan(old=-1)
        self.id_of_slot[slot] = -1
        self.slot_for_id[old // self.num_experts, old % self.num_experts] = -1
        self.usage[slot] = FORGOTTEN
        return ForgetPlan(old=old)

    # ---- stats (docs/semantics.md §5.9) ----------------------------------------------------------------------

    @staticmethod
    def _stats_of(row) -> ReferenceStats:
        return ReferenceStats(*(int(v) for v in row))

    def stats(self) -> ReferenceStats:
        """Global counters: the column sums of the per-layer ones, so the two always agree."""
        return self._stats_of(self.stats_table.sum(axis=0))

    def layer_stats(self, layer) -> ReferenceStats:
        """One layer's counters: the only view that tells one thrashing layer (rebalance) from a
        uniformly tight cache (grow), which have the same global miss rate."""
        return self._stats_of(self.stats_table[layer])

    def per_layer_stats(self) -> list[ReferenceStats]:
        return [self._stats_of(row) for row in self.stats_table]

    def reset_stats(self):
        """Open a new window: counters and prefill row counters zeroed; residency and the
        histogram kept (a metrics scrape must not destroy a slowly built distribution)."""
        self.stats_table[:] = 0
        self.prefill_hit_rows = 0
        self.prefill_rows = 0

    # ---- routing histogram and skew (docs/semantics.md §5.10) --------------------------------------------------

    def set_collect_routing(self, on: bool):
        if not isinstance(on, (bool, np.bool_)):
            raise TypeError(f"collect_routing must be a bool, got {on!r}")
        self.collect_routing = bool(on)

    def routing_histogram(self, layer) -> np.ndarray:
        return self.routing_freq[layer].copy()

    def reset_routing(self):
        self.routing_freq[:] = 0

    def routing_skew(self) -> SkewReport | None:
        """How concentrated the observed routing is, per routed layer; None if nothing was seen.

        This describes the traffic, not the cache: ``oracle_hit_at_slots`` is the best hit rate
        any per-layer policy could reach with a fair share of the pool. Un-routed layers are
        absent (zeros would read as "unservable" when the truth is "no data").
        """
        E = self.num_experts
        slots_per_layer = self.cache_size / self.num_layers
        oracle_slots = max(1, math.floor(slots_per_layer + 0.5))  # half away from zero
        per_layer = []
        for layer in range(self.num_layers):
            freq = self.routing_freq[layer]
            routed = int(freq.sum())
            if routed == 0:
                continue
            descending = sorted((int(c) for c in freq), reverse=True)
            cumulative, below = 0, 0
            for count in descending:
                cumulative += count
                if cumulative / routed >= COVERAGE_FRACTION:
                    break
                below += 1
            entropy = -sum((c / routed) * math.log(c / routed) for c in freq if c > 0)
            per_layer.append(
                LayerSkew(
                    layer=layer,
                    routed=routed,
                    working_set=int((freq > 0).sum()),
                    experts_for_90pct=below + 1,
                    norm_entropy=entropy / math.log(E) if E > 1 else 0.0,
                    oracle_hit_at_slots=sum(descending[:oracle_slots]) / routed,
                )
            )
        if not per_layer:
            return None
        mean = lambda name: sum(getattr(s, name) for s in per_layer) / len(per_layer)  # noqa: E731
        return SkewReport(
            slots_per_layer=slots_per_layer,
            oracle_slots=oracle_slots,
            working_set_mean=mean("working_set"),
            working_set_max=max(s.working_set for s in per_layer),
            experts_for_90pct=mean("experts_for_90pct"),
            oracle_hit_at_slots=mean("oracle_hit_at_slots"),
            norm_entropy=mean("norm_entropy"),
            per_layer=per_layer,
        )

    # ---- prefill double buffers (docs/semantics.md §5.11) ------------------------------------------------------

    def prefill_overlap_fits(self) -> bool:
        """Whether the pool can lend the two buffers slots ``[0, 2E)``."""
        return self.cache_size >= 2 * self.num_experts

    def _require_prefill_fits(self):
        if not self.prefill_overlap_fits():
            raise PrefillDoesNotFit(
                f"cache of {self.cache_size} slots cannot lend {2 * self.num_experts} "
                f"to the prefill buffers"
            )

    def begin_prefill(self):
        """Open a chunk: both buffers empty and released, and the residency snapshot taken.

        Hits are decided against the snapshot for the whole chunk. The only writer inside a
        chunk (buffer invalidation) only touches slots below ``2E``, which are misses under both
        maps, so gathers and host transfers may run in any order.
        """
        self._require_prefill_fits()
        self.prefill_layer[:] = -1
        self.prefill_released[:] = True
        self.prefill_open = True
        self.prefill_snapshot = self.slot_for_id.copy()

    def prefetch_prefill_layer(self, layer, bank_feat_bytes) -> ReferencePrefillPlan:
        """Stage ``layer`` into buffer ``layer % 2`` and say what moves where."""
        banks = tuple(bank_feat_bytes)
        for feat in banks:
            if isinstance(feat, bool) or not isinstance(feat, numbers.Integral) or feat <= 0:
                raise ValueError(f"bank_feat_bytes must be positive ints, got {bank_feat_bytes!r}")
        self._require_prefill_fits()
        layer = _int_arg(layer, "layer")
        E, B = self.num_experts, len(banks)
        buffer_id = layer % 2
        buffer_base = buffer_id * E
        # Small banks are not gathered: their whole-layer entry already covers every row.
        gather_banks = np.full(B, -1, np.int64)
        big = [b for b, feat in enumerate(banks) if feat >= SMALL_BANK_FEAT_BYTES]
        gather_banks[: len(big)] = big

        plan = ReferencePrefillPlan(
            layer=layer,
            buffer_id=buffer_id,
            already_loaded=False,
            gather_dst_slots=np.full(E, -1, np.int64),
            gather_src_slots=np.full(E, -1, np.int64),
            gather_count=0,
            run_starts=np.full(E, -1, np.int64),
            run_lens=np.full(E, -1, np.int64),
            run_count=0,
            entry_bank=np.full(B * E, -1, np.int64),
            entry_dst_slot=np.full(B * E, -1, np.int64),
            entry_src_row=np.full(B * E, -1, np.int64),
            entry_rows=np.full(B * E, -1, np.int64),
            entry_whole_layer=np.zeros(B * E, bool),
            entry_count=0,
            gather_banks=gather_banks,
        )
        # Refusals: every failing check sets its bit (the buffer checks need a valid layer).
        layer_ok = self._layer_ok(layer)
        held = self.prefill_layer[buffer_id] if layer_ok else -1
        if not layer_ok:
            plan.error |= ERR_LAYER
        if not self.prefill_open:
            plan.error |= ERR_PREFILL_NOT_BEGUN
        # Reusing a buffer a running multiply still reads would silently corrupt it: refused.
        if held >= 0 and held != layer and not self.prefill_released[buffer_id]:
            plan.error |= ERR_PREFILL_BUSY
        if plan.error:
            return plan
        # Re-staging what the buffer already holds is a no-op, so a caller can prefetch ahead.
        if held == layer:
            plan.already_loaded = True
            return plan

        # A row is resident only if its snapshot slot is at or above 2E (the buffers own every
        # slot below, and rewrite them every other layer, so "has a slot" is not "is resident")
        # and the live map still has it there (docs/semantics.md §5.11).
        threshold = 2 * E
        missing = []
        for expert in range(E):
            slot = self.prefill_snapshot[layer, expert]
            # A decode step since begin_prefill may have evicted it: then the slot holds
            # another expert's rows, and the row must come from the host.
            if slot >= threshold and self.slot_for_id[layer, expert] == slot:
                k = plan.gather_count
                plan.gather_dst_slots[k] = buffer_base + expert
                plan.gather_src_slots[k] = slot
                plan.gather_count += 1
            else:
                missing.append(expert)
        self.prefill_hit_rows += plan.gather_count
        self.prefill_rows += E

        # Invalidate the buffer: its occupants lose residency (or a decode step would hit on
        # bytes about to be overwritten) and its usage goes to 0 (so the next decode miss takes
        # these free slots first instead of evicting a live resident elsewhere).
        for slot in range(buffer_base, buffer_base + E):
            old = self.id_of_slot[slot]
            if old >= 0:
                self.slot_for_id[old // E, old % E] = -1
            self.id_of_slot[slot] = -1
            self.usage[slot] = 0

        # Misses coalesce into maximal runs of consecutive ids: one entry per run, not per row.
        runs: list[list[int]] = []
        for expert in missing:
            if runs and runs[-1][0] + runs[-1][1] == expert:
                runs[-1][1] += 1
            else:
                runs.append([expert, 1])
        for k, (start, length) in enumerate(runs):
            plan.run_starts[k] = start
            plan.run_lens[k] = length
        plan.run_count = len(runs)

        # Host transfers, banks in the caller's order. A bank under 256 KiB per row ships its
        # whole layer as one entry, even with no misses: it covers the rows the gather skips for
        # small banks, and keeps sub-256 KiB entries out of a batch that would turn synchronous.
        def add_entry(bank, dst_slot, src_row, rows, whole_layer):
            k = plan.entry_count
            plan.entry_bank[k] = bank
            plan.entry_dst_slot[k] = dst_slot
            plan.entry_src_row[k] = src_row
            plan.entry_rows[k] = rows
            plan.entry_whole_layer[k] = whole_layer
            plan.entry_count += 1

        for bank, feat in enumerate(banks):
            if feat < SMALL_BANK_FEAT_BYTES:
                add_entry(bank, buffer_base, 0, E, True)
            else:
                for start, length in runs:
                    add_entry(bank, buffer_base + start, start, length, False)

        # Nothing staged is registered as resident: the buffer's bytes are volatile.
        self.prefill_layer[buffer_id] = layer
        self.prefill_released[buffer_id] = False
        return plan

    def release_prefill_layer(self, layer):
        """Mark ``layer``'s buffer done; a layer that is not the one staged is ignored."""
        layer = _int_arg(layer, "layer")
        if self._layer_ok(layer) and self.prefill_layer[layer % 2] == layer:
            self.prefill_released[layer % 2] = True
