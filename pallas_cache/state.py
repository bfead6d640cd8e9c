"""The cache state: one immutable pytree of int32 arrays (docs/semantics.md §3), and the
operations that make or reshape one: init, reset, rebuild, resize. Why a pytree, and how the
geometry, the usable size and the eviction record live in it: docs/design.md, "The state and the
step"."""

from __future__ import annotations

import functools

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
class Residency(Record):
    """Which expert each slot holds, and when each slot was last touched (docs/semantics.md §3).
    Cold: both maps -1, usage 0."""

    #: int32[L, E]. Expert -> slot holding it, -1 = not resident.
    slot_for_id: jax.Array
    #: int32[C]. Slot -> flat id ``layer * E + expert`` it holds, -1 = empty; ``C`` is the static
    #: ``capacity``. Slots at or past ``cache_size`` are always -1.
    id_of_slot: jax.Array
    #: int32[C]. The step that last touched each slot (hit or fill). 0 for a slot never filled or
    #: emptied by a prefill or a shrink, the smallest int32 for a slot dropped by ``forget_slot``
    #: (the very first victim). Slots at or past ``cache_size`` are always 0.
    usage: jax.Array


@pytree_dataclass
class Clock(Record):
    """The step counter (docs/semantics.md §5.12). Cold: 0."""

    #: int32[]. +1 at the start of every ensure / ensure_hybrid / materialize_layer call, so the
    #: first call of a fresh cache runs at step 1.
    step: jax.Array


@pytree_dataclass
class Routing(Record):
    """What the routes asked for, resident or not. Cold: recency -1, freq 0."""

    #: int32[L, E]. The step at which each expert was last routed to by a hybrid call; -1 = never.
    recency: jax.Array
    #: int32[L, E]. Routing histogram (duplicates counted), grown only while
    #: ``settings.collect_routing`` is on.
    freq: jax.Array


@pytree_dataclass
class Prefill(Record):
    """The prefill staging buffers and the open chunk (docs/semantics.md §5.9). Cold: no layer
    staged, both buffers released, no chunk open, zero rows."""

    #: int32[2]. The layer each staging buffer holds, -1 = none.
    layer: jax.Array
    #: bool[2]. Whether the consumer is done reading each buffer.
    released: jax.Array
    #: bool[]. Whether ``begin_prefill`` opened a chunk.
    open: jax.Array
    #: int32[L, E]. ``residency.slot_for_id`` as it stood at ``begin_prefill`` (the chunk
    #: classifies hits against it); all -1 while no chunk is open.
    snapshot: jax.Array
    #: int32[]. Prefill rows served from the cache in this stats window.
    hit_rows: jax.Array
    #: int32[]. All prefill rows staged in this stats window.
    rows: jax.Array


@pytree_dataclass
class Settings(Record):
    """The traced settings: kept by ``reset`` (they are not contents). Cold: as ``init`` sets
    them (routing collection off)."""

    #: int32[]. ``S``, the usable pool size, ``E <= S <= C``: only slots ``[0, S)`` hold experts,
    #: are victims or count in reports (docs/semantics.md §5.15). Traced, so :func:`resize`
    #: changes it without a recompile.
    cache_size: jax.Array
    #: int32[]. When ``clock.step`` reaches it, the clock is renumbered (clock.py).
    rebase_threshold: jax.Array
    #: bool[]. Whether ensure calls add to ``routing.freq``.
    collect_routing: jax.Array


@pytree_dataclass
class CacheState(Record):
    """The whole cache, as arrays in parts (docs/semantics.md §3). Build one with :func:`init`.

    Attributes:
      residency: :class:`Residency`, the two maps and the slots' usage.
      clock: :class:`Clock`, the step.
      routing: :class:`Routing`, recency and the routing histogram.
      stats: int32[L, 4]. Per-layer counters (calls, active, missing, fetched) of the current
        window; the global counters are the column sums. Cold: 0.
      prefill: :class:`Prefill`, the staging buffers' bookkeeping.
      settings: :class:`Settings`, the usable size, the rebase threshold, routing collection.
      eviction: static. The :class:`~pallas_cache.evictions.EvictionPolicy` record fixed by
        ``init``, whose functions the ops and the fused kernel call
        (``pc.Eviction(state.eviction)`` is its registry member).
      eviction_state: the eviction's bookkeeping (``PairLfuState``, ``TokenRingState``), ``None``
        for LRU, so an LRU state has exactly the leaves above (docs/semantics.md §5.16).

    The kernel rewrites ``residency``, ``clock``, ``routing`` and ``stats`` (and the eviction's
    bookkeeping) in place: a field added to one of those parts is a kernel ref with no list to
    edit.
    """

    __repr__ = reprs.state_repr

    residency: Residency
    clock: Clock
    routing: Routing
    stats: jax.Array
    prefill: Prefill
    settings: Settings
    eviction: EvictionPolicy = static_field(default=Eviction.LRU.policy)
    eviction_state: PairLfuState | TokenRingState | None = None

    @property
    def step(self) -> jax.Array:
        """int32[], read-only: ``clock.step``, the step of the last call (0 for a cold cache)."""
        return self.clock.step

    @property
    def cache_size(self) -> jax.Array:
        """int32[], read-only: ``settings.cache_size``, the usable pool size ``S``."""
        return self.settings.cache_size

    # Geometry from shapes. Negative axes, so a batched (stacked) state reports the geometry of
    # its members, and the same code works inside and outside a vmap.
    @property
    def num_layers(self) -> int:
        return self.residency.slot_for_id.shape[-2]

    @property
    def num_experts(self) -> int:
        return self.residency.slot_for_id.shape[-1]

    @property
    def capacity(self) -> int:
        """``C``, the allocated slots (a shape, static); the usable ones are ``cache_size``."""
        return self.residency.id_of_slot.shape[-1]


def check_state(state: CacheState, *, batched: bool = False) -> CacheState:
    """Refuse, at call/trace time, a state whose parts do not have the types, shapes and dtypes
    :func:`init` gives (a hand-built or mangled state): ``TypeError`` for a dtype, a part of the
    wrong type or an eviction record that does not match the bookkeeping, ``ValueError`` for a
    shape or a usable size outside ``[E, C]``, naming the part by its path
    (``state.residency.usage``), what it has and what the geometry ``L, E, C`` (read from
    ``residency``) asks for. The expected leaves are those of the cold state of that geometry
    (``jax.eval_shape`` of it), so every leaf of every part is checked, with no list to keep.
    ``batched``: leading batch axes, the same on every leaf, are allowed (the host reports).

    A usable size held on the host (a Python or NumPy integer) is range-checked here; one on
    the device is not read back (that would stall the call): the ops refuse it with
    ``ERR_CACHE_SIZE`` instead, writing nothing. Unchecked, a wrong shape is read with clamped
    indices or fails deep inside a ``lax.cond``, and a float ``usage`` compares rounded steps."""
    if not isinstance(state, CacheState):
        raise TypeError(f"state must be a CacheState (from pc.init), got "
                        f"{_kind_of(state)}")
    record = state.eviction
    if not isinstance(record, EvictionPolicy):
        member = record if isinstance(record, Eviction) else None
        if isinstance(record, str):
            member = next((m for m in Eviction if m.value == record.lower()), None)
        hint = (f"; the registry member's record is pc.Eviction.{member.name}.policy, but an "
                f"eviction is fixed by pc.init(..., eviction=...) with its bookkeeping"
                if member is not None else "")
        raise TypeError(f"state.eviction must be an EvictionPolicy record (pc.init sets it), "
                        f"got {record!r} ({type(record).__name__}){hint}")
    residency = state.residency
    if not isinstance(residency, Residency):
        raise TypeError(f"state.residency must be a Residency, got {type(residency).__name__}")
    lead = tuple(np.shape(residency.id_of_slot)[:-1]) if batched else ()
    if (np.ndim(residency.slot_for_id) != 2 + len(lead)
            or np.ndim(residency.id_of_slot) != 1 + len(lead)
            or tuple(np.shape(residency.slot_for_id)[:len(lead)]) != lead):
        raise ValueError(f"state.residency.slot_for_id must be [L, E] and "
                         f"state.residency.id_of_slot [C]"
                         f"{' after the same batch axes' if batched else ''}, got shapes "
                         f"{list(np.shape(residency.slot_for_id))} and "
                         f"{list(np.shape(residency.id_of_slot))}"
                         f"{'' if batched else _BATCH_HINT}")
    L, E = np.shape(residency.slot_for_id)[len(lead):]
    (C,) = np.shape(residency.id_of_slot)[len(lead):]
    cold = _cold_shapes(L, E, C, record, _history(state, record, len(lead)))
    for name in ("clock", "routing", "prefill", "settings"):
        want, got = type(getattr(cold, name)), getattr(state, name)
        if not isinstance(got, want):
            raise TypeError(f"state.{name} must be a {want.__name__}, got {type(got).__name__}")
    expected, _ = jax.tree_util.tree_flatten_with_path(cold)
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    if [path for path, _ in leaves] != [path for path, _ in expected]:
        raise TypeError(f"state has leaves {[_path(p) for p, _ in leaves]}, expected "
                        f"{[_path(p) for p, _ in expected]} (eviction {record.name!r})")
    for (path, value), (_, spec) in zip(leaves, expected):
        name = _path(path)
        if type(value) in (int, bool) and spec.shape == () and not lead:  # weakly typed
            if (type(value) is bool) != (spec.dtype == np.bool_):
                raise TypeError(f"{name} is {value!r}, expected {spec.dtype.name}")
            continue
        got_dtype = getattr(value, "dtype", None)
        if got_dtype is None:
            got_dtype = np.asarray(value).dtype
        if tuple(np.shape(value)) != lead + spec.shape:
            raise ValueError(f"{name} has shape {list(np.shape(value))}, expected "
                             f"{list(lead + spec.shape)} for L={L} layers, E={E} experts, "
                             f"C={C} slots")
        if np.dtype(got_dtype) != spec.dtype:
            raise TypeError(f"{name} has dtype {np.dtype(got_dtype).name}, expected "
                            f"{spec.dtype.name}")
    _check_host_size(state.settings.cache_size, E, C)
    return state


_BATCH_HINT = " (a batch of states: vmap over it, or take one with pc.take_state)"


def _kind_of(value) -> str:
    """What a wrong ``state`` argument is, saying so for the NumPy reference's state."""
    kind = type(value)
    if kind.__module__.startswith("pallas_cache.reference"):
        return (f"a {kind.__name__} of the NumPy reference (pallas_cache.reference): its ops "
                f"take it, the library's take the state of pc.init")
    return kind.__name__


def _history(state: CacheState, record: EvictionPolicy, batch_axes: int):
    """The ring size the bookkeeping holds, once its type is the record's (a record of another
    eviction than the bookkeeping, set by ``state.replace(eviction=...)``, is refused here)."""
    bookkeeping = state.eviction_state
    want = _bookkeeping_type(record)
    if type(bookkeeping) is not want:
        raise TypeError(f"state.eviction_state is {type(bookkeeping).__name__}, but "
                        f"state.eviction {record.name!r} keeps {want.__name__}: the record and "
                        f"the bookkeeping come from different evictions (an eviction is fixed "
                        f"by pc.init(..., eviction=...))")
    if bookkeeping is None:
        return None
    try:
        return record.history_of(bookkeeping)
    except (AttributeError, IndexError, TypeError) as error:
        raise ValueError(f"state.eviction_state ({type(bookkeeping).__name__}) cannot give "
                         f"{record.name!r} its ring size: {error}") from None


@functools.lru_cache(maxsize=16)
def _bookkeeping_type(record: EvictionPolicy) -> type:
    """The type of ``record``'s bookkeeping (``type(None)`` for none)."""
    return type(jax.eval_shape(lambda: record.init(1, 1, 1)))


def _check_host_size(cache_size, E: int, C: int) -> None:
    """A usable size held on the host outside ``[E, C]`` raises ValueError (a device value is
    not read back: the ops' ``ERR_CACHE_SIZE`` refuses it)."""
    if isinstance(cache_size, jax.Array):  # a tracer is one too
        return
    sizes = np.asarray(cache_size)
    bad = (sizes < E) | (sizes > C)
    if np.any(bad):
        raise ValueError(f"state.settings.cache_size is {sizes[bad].ravel()[0]}, outside "
                         f"[E, capacity] = [{E}, {C}]: the usable pool must hold one layer and "
                         f"fit the allocation (pc.resize changes it)")


@functools.lru_cache(maxsize=64)
def _cold_shapes(L: int, E: int, C: int, eviction, history) -> CacheState:
    """The shapes and dtypes of the cold state of a geometry (``jax.eval_shape``: nothing is
    allocated), what :func:`check_state` compares a state against; cached, since every op call
    checks its state."""
    history = DEFAULT_HISTORY if history is None else history
    return jax.eval_shape(lambda: _empty_state(L, E, C, E, 1, False, eviction, history))


def _path(path) -> str:
    """``state.residency.usage``: a leaf named by its key path."""
    return "state" + "".join(f".{k.name}" if hasattr(k, "name") else jax.tree_util.keystr((k,))
                             for k in path)


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
        residency=Residency(slot_for_id=jnp.full((L, E), -1, jnp.int32),
                            id_of_slot=jnp.full((C,), -1, jnp.int32),
                            usage=jnp.zeros((C,), jnp.int32)),
        clock=Clock(step=jnp.zeros((), jnp.int32)),
        routing=Routing(recency=jnp.full((L, E), -1, jnp.int32),
                        freq=jnp.zeros((L, E), jnp.int32)),
        stats=jnp.zeros((L, 4), jnp.int32),
        prefill=Prefill(layer=jnp.full((2,), -1, jnp.int32), released=jnp.ones((2,), jnp.bool_),
                        open=jnp.zeros((), jnp.bool_), snapshot=jnp.full((L, E), -1, jnp.int32),
                        hit_rows=jnp.zeros((), jnp.int32), rows=jnp.zeros((), jnp.int32)),
        settings=Settings(cache_size=jnp.asarray(cache_size, jnp.int32),
                          rebase_threshold=jnp.asarray(rebase_threshold, jnp.int32),
                          collect_routing=jnp.asarray(collect_routing, jnp.bool_)),
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

    Writes every part but ``settings`` (a cold state with the same settings).

    Maps emptied, usage 0, step 0, recency -1, counters, histogram and prefill bookkeeping
    cleared. The routing-collection switch, the rebase threshold, the capacity and the usable
    size are settings or geometry, not contents, and are kept. Jittable.
    """
    check_state(state)
    return _empty_state(state.num_layers, state.num_experts, state.capacity, state.cache_size,
                        state.settings.rebase_threshold, state.settings.collect_routing,
                        state.eviction, state.eviction.history_of(state.eviction_state))


def rebuild(state: CacheState, cache_size: int, *, capacity: int | None = None) -> CacheState:
    """A new pool of ``cache_size`` usable slots for the same model (docs/semantics.md §5.8).

    Writes every part but ``settings.rebase_threshold`` and ``settings.collect_routing`` (a new
    allocation).

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
    check_state(state)
    requested = validate.as_host_int("cache_size", cache_size)
    if requested < state.num_experts:
        raise RebuildRejected(requested=requested, minimum=state.num_experts)
    new_capacity = _capacity(requested, capacity)
    _check_representable(state.num_layers, state.num_experts, requested, new_capacity)
    return _empty_state(state.num_layers, state.num_experts, new_capacity,
                        requested, state.settings.rebase_threshold,
                        state.settings.collect_routing, state.eviction,
                        state.eviction.history_of(state.eviction_state))


def resize(state: CacheState, cache_size: IndexLike) -> tuple[CacheState, ResizePlan]:
    """Change the usable pool size within the capacity, without a recompile (docs/semantics.md §5.15).

    Writes ``residency``, ``settings.cache_size`` and, below ``2E``, ``prefill``.

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
    check_state(state)
    return _resize(state, validate.as_index("cache_size", cache_size))


@jax.jit
def _resize(state: CacheState, new_size):
    L, E, C = state.num_layers, state.num_experts, state.capacity
    below_buffers = new_size < 2 * E
    # The buffer at [E, 2E) (buffer 1) loses slots on a shrink below 2E: refused while a staged
    # layer there is still being read (docs/semantics.md §5.15).
    busy = below_buffers & (state.prefill.layer[1] >= 0) & ~state.prefill.released[1]
    bad = (new_size < E) | (new_size > C) | busy
    error = jnp.where(bad, errors.ERR_CACHE_SIZE, 0).astype(jnp.int32)
    accepted = error == 0
    size = jnp.where(accepted, new_size, state.cache_size)

    slots = jnp.arange(C, dtype=jnp.int32)
    freed = accepted & (slots >= size) & (slots < state.cache_size)
    occupant = state.residency.id_of_slot
    dropped = freed & (occupant >= 0)
    slot_for_id = state.residency.slot_for_id.reshape(-1).at[jnp.where(dropped, occupant, L * E)].set(
        -1, mode="drop").reshape(L, E)
    end_buffer = accepted & below_buffers & (jnp.arange(2) == 1)
    new_state = state.replace(
        residency=Residency(slot_for_id=slot_for_id, id_of_slot=jnp.where(freed, -1, occupant),
                            usage=jnp.where(freed, 0, state.residency.usage)),
        settings=state.settings.replace(cache_size=size.astype(jnp.int32)),
        prefill=state.prefill.replace(layer=jnp.where(end_buffer, -1, state.prefill.layer),
                                      released=state.prefill.released | end_buffer),
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
