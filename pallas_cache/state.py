"""The cache state: one immutable pytree of int32 arrays (docs/semantics.md §3), and the
operations that make or reshape one: init, reset, rebuild, resize. Why a pytree, and how the
geometry, the usable size and the eviction record live in it: docs/design.md, "The state and the
step"."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from pallas_cache import errors, reprs, validate
from pallas_cache import evictions
from pallas_cache.evictions import Eviction, EvictionPolicy, PairLfuState, TokenRingState
from pallas_cache.tree import Record, pytree_dataclass, static_field
from pallas_cache.hints import IndexLike
from pallas_cache.plans import ResizePlan

__all__ = [
    "CacheState",
    "RebuildRejected",
    "ResizePlan",
    "init",
    "rebuild",
    "reset",
    "resize",
]

# The default clock threshold of docs/semantics.md §5.12: far below the int32 wrap, far above any test.
DEFAULT_REBASE_THRESHOLD = 2**30
# The default token ring of Eviction.ROUTE_KNN (docs/semantics.md §5.16).
DEFAULT_HISTORY = 128


@pytree_dataclass
class CacheState(Record):
    """The whole cache, as arrays (docs/semantics.md §3). Build one with :func:`init`.

    Attributes:
      slot_for_id: int32[L, E]. Expert -> slot holding it, -1 = not resident.
      id_of_slot: int32[C]. Slot -> flat id ``layer * E + expert`` it holds, -1 = empty; ``C`` is
        the static ``capacity``. Slots at or past ``cache_size`` are always -1.
      usage: int32[C]. The step that last touched each slot (hit or fill). 0 for a slot that was
        never filled or was emptied by a prefill or a shrink, the smallest int32 for a slot
        dropped by ``forget_slot`` (the very first victim). Slots at or past ``cache_size`` are
        always 0.
      cache_size: int32[]. ``S``, the usable pool size, ``E <= S <= C``: only slots ``[0, S)``
        hold experts, are victims or count in reports (docs/semantics.md §5.15). Traced, so
        :func:`resize` changes it without a recompile.
      step: int32[]. The clock: +1 at the start of every ensure / ensure_hybrid /
        materialize_layer call, so the first call of a fresh cache runs at step 1.
      recency: int32[L, E]. The step at which each expert was last routed to by a hybrid call,
        resident or not; -1 = never.
      stats: int32[L, 4]. Per-layer counters (calls, active, missing, fetched) of the current
        window; the global counters are the column sums.
      routing_freq: int32[L, E]. Routing histogram (duplicates counted), only grown while
        ``collect_routing`` is on.
      collect_routing: bool[]. Whether ensure calls add to ``routing_freq``.
      prefill_layer: int32[2]. The layer each prefill staging buffer holds, -1 = none.
      prefill_released: bool[2]. Whether the consumer is done reading each buffer.
      prefill_open: bool[]. Whether ``begin_prefill`` opened a chunk.
      prefill_snapshot: int32[L, E]. ``slot_for_id`` as it stood at ``begin_prefill`` (the chunk
        classifies hits against it); all -1 while no chunk is open.
      prefill_hit_rows: int32[]. Prefill rows served from the cache in this stats window.
      prefill_rows: int32[]. All prefill rows staged in this stats window.
      rebase_threshold: int32[]. When ``step`` reaches it, the clock is renumbered (clock.py).
      eviction: static. The :class:`~pallas_cache.evictions.EvictionPolicy` record fixed by
        ``init``, whose functions the ops and the fused kernel call
        (``pc.Eviction(state.eviction)`` is its registry member).
      eviction_state: the eviction's bookkeeping (``PairLfuState``, ``TokenRingState``), ``None``
        for LRU, so an LRU state has exactly the leaves above (docs/semantics.md §5.16).
    """

    __repr__ = reprs.state_repr

    slot_for_id: jax.Array
    id_of_slot: jax.Array
    usage: jax.Array
    cache_size: jax.Array
    step: jax.Array
    recency: jax.Array
    stats: jax.Array
    routing_freq: jax.Array
    collect_routing: jax.Array
    prefill_layer: jax.Array
    prefill_released: jax.Array
    prefill_open: jax.Array
    prefill_snapshot: jax.Array
    prefill_hit_rows: jax.Array
    prefill_rows: jax.Array
    rebase_threshold: jax.Array
    eviction: EvictionPolicy = static_field(default=Eviction.LRU.policy)
    eviction_state: PairLfuState | TokenRingState | None = None

    # Geometry from shapes. Negative axes, so a batched (stacked) state reports the geometry of
    # its members, and the same code works inside and outside a vmap.
    @property
    def num_layers(self) -> int:
        return self.slot_for_id.shape[-2]

    @property
    def num_experts(self) -> int:
        return self.slot_for_id.shape[-1]

    @property
    def capacity(self) -> int:
        """``C``, the allocated slots (a shape, static); the usable ones are ``cache_size``."""
        return self.id_of_slot.shape[-1]


def _field_specs(L: int, E: int, C: int) -> dict:
    """``{field: (dtype, shape)}`` of one (unbatched) state of geometry ``L, E, C``."""
    i32, b = jnp.int32, jnp.bool_
    return {"slot_for_id": (i32, (L, E)), "id_of_slot": (i32, (C,)), "usage": (i32, (C,)),
            "cache_size": (i32, ()), "step": (i32, ()), "recency": (i32, (L, E)),
            "stats": (i32, (L, 4)), "routing_freq": (i32, (L, E)), "collect_routing": (b, ()),
            "prefill_layer": (i32, (2,)), "prefill_released": (b, (2,)), "prefill_open": (b, ()),
            "prefill_snapshot": (i32, (L, E)), "prefill_hit_rows": (i32, ()),
            "prefill_rows": (i32, ()), "rebase_threshold": (i32, ())}


def check_state(state: CacheState) -> CacheState:
    """Refuse, at call/trace time, a state whose fields do not have the shapes and dtypes
    :func:`init` gives (a hand-built or mangled state): ``TypeError`` for a dtype, ``ValueError``
    for a shape, naming the field, what it has and what the geometry ``L, E, C`` (read from
    ``slot_for_id`` and ``id_of_slot``) asks for. Unchecked, a wrong shape is read with
    clamped indices or fails deep inside a ``lax.cond``, and a float ``usage`` compares
    rounded steps."""
    if not isinstance(state, CacheState):
        raise TypeError(f"state must be a CacheState (from init), got {type(state).__name__}")
    if np.ndim(state.slot_for_id) != 2 or np.ndim(state.id_of_slot) != 1:
        raise ValueError(f"state.slot_for_id must be [L, E] and state.id_of_slot [C], got "
                         f"shapes {list(np.shape(state.slot_for_id))} and "
                         f"{list(np.shape(state.id_of_slot))} (vmap over a stacked state)")
    L, E = np.shape(state.slot_for_id)
    (C,) = np.shape(state.id_of_slot)
    for name, (dtype, shape) in _field_specs(L, E, C).items():
        value = getattr(state, name)
        if type(value) in (int, bool) and shape == ():  # a Python scalar: weakly typed
            if (type(value) is bool) != (dtype is jnp.bool_):
                raise TypeError(f"state.{name} is {value!r}, expected {np.dtype(dtype).name}")
            continue
        got_dtype = getattr(value, "dtype", None)
        if got_dtype is None:
            got_dtype = np.asarray(value).dtype
        if tuple(np.shape(value)) != shape:
            raise ValueError(f"state.{name} has shape {list(np.shape(value))}, expected "
                             f"{list(shape)} for L={L} layers, E={E} experts, C={C} slots")
        if np.dtype(got_dtype) != np.dtype(dtype):
            raise TypeError(f"state.{name} has dtype {np.dtype(got_dtype).name}, expected "
                            f"{np.dtype(dtype).name}")
    return state


class RebuildRejected(ValueError):
    """``rebuild`` refused a pool that cannot hold one layer; nothing changed (docs/semantics.md §5.8).

    Attributes:
      requested: the cache size that was asked for.
      minimum: the smallest acceptable cache size (``E``).
    """

    def __init__(self, requested: int, minimum: int) -> None:
        self.requested = requested
        self.minimum = minimum
        super().__init__(
            f"expert cache of {requested} slots cannot hold one layer of {minimum} experts; "
            f"the old cache is unchanged"
        )


def _empty_state(num_layers, num_experts, capacity, cache_size, rebase_threshold,
                 collect_routing, eviction=Eviction.LRU.policy, history=DEFAULT_HISTORY):
    """The cold state of a geometry; ``reset`` and ``rebuild`` reuse it so the three agree.
    ``cache_size`` may be traced (``reset`` keeps the usable size)."""
    L, E, C = num_layers, num_experts, capacity
    return CacheState(
        slot_for_id=jnp.full((L, E), -1, jnp.int32),
        id_of_slot=jnp.full((C,), -1, jnp.int32),
        usage=jnp.zeros((C,), jnp.int32),
        cache_size=jnp.asarray(cache_size, jnp.int32),
        step=jnp.zeros((), jnp.int32),
        recency=jnp.full((L, E), -1, jnp.int32),
        stats=jnp.zeros((L, 4), jnp.int32),
        routing_freq=jnp.zeros((L, E), jnp.int32),
        collect_routing=jnp.asarray(collect_routing, jnp.bool_),
        prefill_layer=jnp.full((2,), -1, jnp.int32),
        prefill_released=jnp.ones((2,), jnp.bool_),
        prefill_open=jnp.zeros((), jnp.bool_),
        prefill_snapshot=jnp.full((L, E), -1, jnp.int32),
        prefill_hit_rows=jnp.zeros((), jnp.int32),
        prefill_rows=jnp.zeros((), jnp.int32),
        rebase_threshold=jnp.asarray(rebase_threshold, jnp.int32),
        eviction=eviction,
        eviction_state=eviction.init(L, E, history),
    )


def _capacity(cache_size: int, capacity) -> int:
    """``capacity`` checked against ``cache_size`` (``None``: the same), for init and rebuild."""
    if capacity is None:
        return cache_size
    capacity = validate.positive_int("capacity", capacity)
    if capacity < cache_size:
        raise ValueError(f"capacity {capacity} is below cache_size {cache_size}: the usable "
                         f"slots are the first cache_size of the capacity")
    return _fits_int32("capacity", capacity)


def _fits_int32(name: str, value: int) -> int:
    if value > validate.INT32_MAX:
        raise ValueError(f"{name} must fit in int32 (<= {validate.INT32_MAX}), got {value}")
    return value


def check_capacity(num_layers: int, num_experts: int, capacity: int) -> None:
    """Refuse, before anything is allocated, a capacity :func:`init` would refuse for a cache of
    ``num_layers x num_experts`` (ValueError): above int32, or no room for the clock's stamps
    after a rebase (``C + L * E + 1 >= 2**31 - 1``)."""
    _fits_int32("capacity", capacity)
    _check_representable(num_layers, num_experts, 1, capacity)


def _check_representable(L: int, E: int, S: int, C: int) -> None:
    """Refuse, before anything is allocated, a geometry whose int32 quantities overflow
    (docs/semantics.md §5.1): each size, the ``L * E`` flat ids, and the clock's stamps after a
    rebase (at most ``C + L * E + 1``, then the call's tick; §5.12)."""
    for name, value in (("num_layers", L), ("num_experts", E), ("cache_size", S),
                        ("capacity", C)):
        _fits_int32(name, value)
    if L * E > validate.INT32_MAX:
        raise ValueError(f"num_layers * num_experts = {L} * {E} = {L * E} flat ids do not fit "
                         f"in int32 (<= {validate.INT32_MAX})")
    stamps = C + L * E + 1
    if stamps >= validate.INT32_MAX:
        raise ValueError(f"capacity + num_layers * num_experts + 1 = {stamps} clock stamps leave "
                         f"the int32 clock no room to tick after a rebase (at most "
                         f"{validate.INT32_MAX - 1})")


def init(num_layers: int, num_experts: int, cache_size: int, *, capacity: int | None = None,
         rebase_threshold: int = DEFAULT_REBASE_THRESHOLD,
         eviction: Eviction | EvictionPolicy | str = Eviction.LRU,
         history: int = DEFAULT_HISTORY) -> CacheState:
    """A cold cache (docs/semantics.md §5.1).

    Args:
      num_layers: ``L``, MoE layers (>= 1).
      num_experts: ``E``, experts per layer (>= 1).
      cache_size: ``S``, usable device slots shared by all layers; must hold one layer
        (``S >= E``).
      capacity: ``C``, allocated slots (static shapes, ``C >= S``; default ``S``). The slots
        ``[S, C)`` are unusable until :func:`resize` grows the pool.
      rebase_threshold: the clock value at which stamps are renumbered (docs/semantics.md §5.12); lower it
        only to test the rebase.
      eviction: an :class:`~pallas_cache.evictions.Eviction` (or its string value, or an
        :class:`~pallas_cache.evictions.EvictionPolicy` record), fixed for the life of the state
        (static metadata; docs/semantics.md §5.16). Default LRU.
      history: ROUTE_KNN's token ring ``W`` (>= 1); validated, unused by the other evictions.

    Returns:
      A ``CacheState`` with empty maps, usage 0, step 0, recency -1, zero counters, routing
      collection off and no prefill chunk open.

    Raises:
      TypeError: a non-integer argument. ValueError: an argument < 1, ``S < E``, ``C < S``, an
        unknown eviction, or a size int32 cannot represent: ``L``, ``E``, ``S``, ``C``, the
        threshold or ``history`` above ``2**31 - 1``, ``L * E`` above it, or
        ``C + L * E + 1 >= 2**31 - 1`` (no room for the clock after a rebase).
    """
    L = validate.positive_int("num_layers", num_layers)
    E = validate.positive_int("num_experts", num_experts)
    S = validate.positive_int("cache_size", cache_size)
    threshold = validate.positive_int("rebase_threshold", rebase_threshold)
    eviction = evictions.coerce(eviction)
    ring = validate.positive_int("history", history)
    if S < E:
        raise ValueError(f"cache_size {S} cannot hold one layer of {E} experts")
    C = _capacity(S, capacity)
    _check_representable(L, E, S, C)
    _fits_int32("rebase_threshold", threshold)
    _fits_int32("history", ring)
    return _empty_state(L, E, C, S, threshold, collect_routing=False, eviction=eviction,
                        history=ring)


def reset(state: CacheState) -> CacheState:
    """A cold start with the same geometry (docs/semantics.md §5.8).

    Maps emptied, usage 0, step 0, recency -1, counters, histogram and prefill bookkeeping
    cleared. The routing-collection switch, the rebase threshold, the capacity and the usable
    size are settings or geometry, not contents, and are kept. Jittable.
    """
    return _empty_state(state.num_layers, state.num_experts, state.capacity, state.cache_size,
                        state.rebase_threshold, state.collect_routing, state.eviction,
                        state.eviction.history_of(state.eviction_state))


def rebuild(state: CacheState, cache_size: int, *, capacity: int | None = None) -> CacheState:
    """A new pool of ``cache_size`` usable slots for the same model (docs/semantics.md §5.8).

    A new allocation, exactly as :func:`init` makes one: ``capacity`` defaults to the new
    ``cache_size`` (the old capacity is not kept; to change the usable size within the
    allocation, without a recompile, use :func:`resize`). Everything
    resident is dropped (slot ids index an allocation that no longer exists), and the counters,
    histogram and prefill bookkeeping are cleared, as in :func:`reset`. Not jittable: the
    capacity is a shape.

    Raises:
      RebuildRejected: ``cache_size < E``; the caller keeps the old state, which is untouched.
      TypeError: ``cache_size`` or ``capacity`` is not an integer. ValueError: ``capacity <
        cache_size``, or a size int32 cannot represent (as :func:`init`).
    """
    requested = validate.as_host_int("cache_size", cache_size)
    if requested < state.num_experts:
        raise RebuildRejected(requested=requested, minimum=state.num_experts)
    new_capacity = _capacity(requested, capacity)
    _check_representable(state.num_layers, state.num_experts, requested, new_capacity)
    return _empty_state(state.num_layers, state.num_experts, new_capacity,
                        requested, state.rebase_threshold, state.collect_routing, state.eviction,
                        state.eviction.history_of(state.eviction_state))


def resize(state: CacheState, cache_size: IndexLike) -> tuple[CacheState, ResizePlan]:
    """Change the usable pool size within the capacity, without a recompile (docs/semantics.md §5.15).

    Growing adds empty usable slots (usage 0). Shrinking frees the slots at or past the new size:
    their experts lose residency, the slots become unusable (id -1, usage 0) and the plan lists
    them with their old occupants. Nothing else changes: no clock advance, no rebase, counters,
    recency, histogram and the eviction's bookkeeping (per expert and per token, not per
    slot; docs/semantics.md §5.16) kept. A shrink below ``2E`` also ends the prefill buffer at ``[E, 2E)``
    (its record is cleared), and is refused while that buffer holds a layer not yet released.

    Args:
      state: the cache.
      cache_size: integer scalar, possibly traced: the new usable size, in ``[E, capacity]``.

    Returns:
      ``(state, ResizePlan)``. A size outside ``[E, capacity]``, or a shrink below ``2E`` while
      the second prefill buffer is busy, sets ``ERR_CACHE_SIZE``: state unchanged, empty plan.

    Raises:
      TypeError / ValueError: ``cache_size`` is not an integer scalar.
    """
    return _resize(state, validate.as_index("cache_size", cache_size))


@jax.jit
def _resize(state: CacheState, new_size):
    L, E, C = state.num_layers, state.num_experts, state.capacity
    below_buffers = new_size < 2 * E
    # The buffer at [E, 2E) (buffer 1) loses slots on a shrink below 2E: refused while a staged
    # layer there is still being read (docs/semantics.md §5.15).
    busy = below_buffers & (state.prefill_layer[1] >= 0) & ~state.prefill_released[1]
    bad = (new_size < E) | (new_size > C) | busy
    error = jnp.where(bad, errors.ERR_CACHE_SIZE, 0).astype(jnp.int32)
    accepted = error == 0
    size = jnp.where(accepted, new_size, state.cache_size)

    slots = jnp.arange(C, dtype=jnp.int32)
    freed = accepted & (slots >= size) & (slots < state.cache_size)
    occupant = state.id_of_slot
    dropped = freed & (occupant >= 0)
    slot_for_id = state.slot_for_id.reshape(-1).at[jnp.where(dropped, occupant, L * E)].set(
        -1, mode="drop").reshape(L, E)
    end_buffer = accepted & below_buffers & (jnp.arange(2) == 1)
    new_state = state.replace(
        slot_for_id=slot_for_id,
        id_of_slot=jnp.where(freed, -1, occupant),
        usage=jnp.where(freed, 0, state.usage),
        cache_size=size.astype(jnp.int32),
        prefill_layer=jnp.where(end_buffer, -1, state.prefill_layer),
        prefill_released=state.prefill_released | end_buffer,
    )
    position = jnp.cumsum(freed, dtype=jnp.int32) - 1
    target = jnp.where(freed, position, C)
    plan = ResizePlan(
        freed_slots=jnp.full((C,), -1, jnp.int32).at[target].set(slots, mode="drop"),
        freed_ids=jnp.full((C,), -1, jnp.int32).at[target].set(occupant, mode="drop"),
        count=jnp.sum(freed, dtype=jnp.int32),
        error=error,
    )
    return new_state, plan
