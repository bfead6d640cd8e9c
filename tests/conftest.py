"""Shared test configuration: Hypothesis profiles and the adapters every rule test runs over.

Hypothesis profiles: ``ci`` (the default) keeps the whole suite within a few minutes on two
cores; ``deep`` runs many more sequences (and every adapter test on ``jax-interpret`` too). Pick
one with ``PALLAS_CACHE_PROFILE=deep``.

A rule test is written once against an *adapter* (the idea of ``chex.variants``): a test that
takes the ``adapter`` fixture runs on ``reference`` (the NumPy oracle) and ``jax-eager`` (the
public functions called directly); tests marked ``@pytest.mark.traced`` (rules where a traced
layer, slot or flag, or a constant-folded static option, could change the answer) also on
``jax-jit`` (every function under an outer ``jax.jit``), and tests marked
``@pytest.mark.kernels`` (rules decided by the victim or promotion kernel) also on
``jax-interpret`` (the Pallas kernels in the interpreter). Compiles are the suite's cost (the jit
adapter compiles once per geometry *and* static option), so the ``ci`` profile runs those two on
this representative subset and the lockstep suite drives all three JAX adapters through random
sequences of every operation; the ``deep`` profile runs every adapter test on all four. ``adapter.init``
returns a :class:`Cache` handle with one method per cache operation; every plan and state comes
back through one normalising function per kind (:func:`state_view`, :func:`ensure_view`,
:func:`materialize_view`, :func:`forget_view`, :func:`prefill_view`) as NumPy arrays under the
JAX field names, so a test body reads the same on every adapter, and a renamed plan field is a
one-place change here.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import pallas_cache as pc
import reference
from reference import ReferenceCache, ReferencePolicy
from reference import evictions as reference_evictions

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "deep",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = os.environ.get("PALLAS_CACHE_PROFILE", "ci")

# The console script keeps compiled programs in the user's cache directory; no test may (the
# tests call cli.main in-process, which never does, and this keeps the subprocesses that run
# ``python -m pallas_cache.sizing.cli`` off it too). tests/test_cli_progress.py clears it where
# it tests the cache itself, in a temporary home.
os.environ["PALLAS_CACHE_NO_COMPILE_CACHE"] = "1"
settings.load_profile(PROFILE)


@pytest.fixture(params=["compiled", "python"])
def optima_loop(request, monkeypatch):
    """Run a bound test with each simulation loop of :mod:`pallas_cache.sizing.bounds`: the
    Numba-compiled one (skipped where Numba is not installed; the ``test`` extra installs it)
    and the pure-Python one, which must give the same schedules."""
    from pallas_cache.sizing import bounds

    if request.param == "compiled":
        pytest.importorskip("numba")
        monkeypatch.setenv(bounds.COMPILED_BOUNDS_ENV, "1")  # tiny traces too
        assert bounds.compiled_loops(1) is not None
    else:
        monkeypatch.setenv(bounds.COMPILED_BOUNDS_ENV, "0")
        assert bounds.compiled_loops(10**9) is None
    return request.param


def examples(share: float, *, ci: float | None = None) -> settings:
    """Settings that run ``share`` of the loaded profile's examples (at least 4; ``ci``, if given,
    is the share under the ``ci`` profile instead). For the cross-product lockstep runs (every
    eviction policy x capacity x resize): each repeats, under one more option, what
    tests/test_lockstep.py checks rule by rule, so the ``ci`` profile runs a few of each (the
    suite stays within its time budget) and ``deep`` runs ``share`` x 1000."""
    if ci is not None and PROFILE == "ci":
        share = ci
    return settings(max_examples=max(4, round(settings.default.max_examples * share)))

ADAPTERS = ("reference", "jax-eager", "jax-jit", "jax-interpret")
#: Which marker adds which adapter to the two every adapter test runs on (the deep profile: all).
MARKED_ADAPTERS = {"traced": "jax-jit", "kernels": "jax-interpret"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "traced: a traced layer/slot/flag or a folded static option could change the "
        "answer, so the test also runs on the jax-jit adapter")
    config.addinivalue_line(
        "markers", "kernels: the rule is decided by a Pallas kernel (victims, promotion), so the "
        "test also runs on the jax-interpret adapter")


def adapters_for(definition):
    """The adapters one test runs on: reference and jax-eager, plus what its markers add."""
    if PROFILE == "deep":
        return ADAPTERS
    added = {name for marker, name in MARKED_ADAPTERS.items() if definition.get_closest_marker(marker)}
    return tuple(name for name in ADAPTERS if name in ("reference", "jax-eager") or name in added)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module. The suite compiles thousands of
    small programs (the eager and jit adapters per geometry and option); kept for the whole
    session they exhaust the process's memory mappings (``vm.max_map_count``, 65530 by default)
    and XLA's compiler crashes late in the run."""
    yield
    jax.clear_caches()


def pytest_generate_tests(metafunc):
    if "adapter" in metafunc.fixturenames:
        metafunc.parametrize("adapter", adapters_for(metafunc.definition), indirect=True)


@pytest.fixture
def adapter(request):
    return ADAPTER[request.param]


# ---- the jitted operations (one table, shared by the jit and interpret adapters) ------------

JITTED = {
    "ensure": jax.jit(pc.ensure, static_argnames=("backend",)),
    "ensure_hybrid": jax.jit(pc.ensure_hybrid, static_argnames=("order", "admission", "backend")),
    "materialize_layer": jax.jit(pc.materialize_layer),
    "forget_slot": jax.jit(pc.forget_slot),
    "begin_prefill": jax.jit(pc.begin_prefill),
    "prefetch_prefill_layer": jax.jit(pc.prefetch_prefill_layer, static_argnames=("bank_feat_bytes",)),
    "release_prefill_layer": jax.jit(pc.release_prefill_layer),
    "reset": jax.jit(pc.reset),
    "reset_stats": jax.jit(pc.reset_stats),
    "set_collect_routing": jax.jit(pc.set_collect_routing),
    "reset_routing": jax.jit(pc.reset_routing),
    "resize": jax.jit(pc.resize),
    "start_token": jax.jit(pc.evictions.start_token),
}
EAGER = {name: getattr(pc, name) for name in JITTED if name != "start_token"}
EAGER["start_token"] = pc.evictions.start_token
_SPLIT = jax.jit(pc.FetchPolicy.split)


# ---- normalised views: NumPy arrays under the JAX names -------------------------------------


def _np(x):
    return np.asarray(jax.device_get(x))


#: JAX ``CacheState`` field -> ``ReferenceCache`` attribute.
STATE_FIELDS = {
    "slot_for_id": "slot_for_id",
    "id_of_slot": "id_of_slot",
    "usage": "usage",
    "cache_size": "cache_size",
    "step": "step",
    "recency": "recency",
    "stats": "stats_table",
    "routing_freq": "routing_freq",
    "collect_routing": "collect_routing",
    "prefill_layer": "prefill_layer",
    "prefill_released": "prefill_released",
    "prefill_open": "prefill_open",
    "prefill_snapshot": "prefill_snapshot",
    "prefill_hit_rows": "prefill_hit_rows",
    "prefill_rows": "prefill_rows",
    "rebase_threshold": "rebase_threshold",
}


@dataclasses.dataclass(frozen=True)
class StateView:
    """Every state field as a NumPy array (scalars as 0-d arrays), JAX names."""

    slot_for_id: np.ndarray
    id_of_slot: np.ndarray
    usage: np.ndarray
    cache_size: np.ndarray
    step: np.ndarray
    recency: np.ndarray
    stats: np.ndarray
    routing_freq: np.ndarray
    collect_routing: np.ndarray
    prefill_layer: np.ndarray
    prefill_released: np.ndarray
    prefill_open: np.ndarray
    prefill_snapshot: np.ndarray
    prefill_hit_rows: np.ndarray
    prefill_rows: np.ndarray
    rebase_threshold: np.ndarray
    # The eviction policy's bookkeeping (docs/semantics.md §5.16); None where the policy has none.
    freq: np.ndarray | None = None
    prot: np.ndarray | None = None
    ring: np.ndarray | None = None
    sim: np.ndarray | None = None
    head: np.ndarray | None = None
    count: np.ndarray | None = None
    last_layer: np.ndarray | None = None
    counts: np.ndarray | None = None

    @property
    def num_layers(self):
        return self.slot_for_id.shape[0]

    @property
    def num_experts(self):
        return self.slot_for_id.shape[1]

    @property
    def capacity(self):
        return self.id_of_slot.shape[0]

    def slot_of(self, layer, expert):
        slot = int(self.slot_for_id[layer, expert])
        return slot if slot >= 0 else None

    def resident_slots(self):
        return int((self.id_of_slot >= 0).sum())


#: The eviction bookkeeping's fields (the JAX state keeps them under ``state.eviction_state``;
#: the token ring as bits, the reference's as bools and an absolute token index).
EVICTION_FIELDS = ("freq", "prot", "ring", "sim", "head", "count", "last_layer", "counts")


def _eviction_fields(native) -> dict:
    if isinstance(native, ReferenceCache):
        return reference_evictions.policy_of(native).fields(native)
    bookkeeping = native.eviction_state
    extra = {f: _np(getattr(bookkeeping, f)) for f in EVICTION_FIELDS
             if getattr(bookkeeping, f, None) is not None}
    if isinstance(bookkeeping, pc.evictions.TokenRingState):
        extra["ring"] = _np(pc.evictions.ring_bits(bookkeeping.masks, native.num_experts))
    return extra


def state_view(native) -> StateView:
    """A ``CacheState`` or a ``ReferenceCache`` as a :class:`StateView`."""
    if isinstance(native, ReferenceCache):
        return StateView(**{f: np.array(getattr(native, a), copy=True)
                            for f, a in STATE_FIELDS.items()}, **_eviction_fields(native))
    return StateView(**{f: _np(getattr(native, f)) for f in STATE_FIELDS},
                     **_eviction_fields(native))


@dataclasses.dataclass(frozen=True)
class EnsureView:
    """An ensure / ensure_hybrid plan: the copy plan flattened beside the route answers."""

    slots: np.ndarray
    cpu: np.ndarray
    dst_slots: np.ndarray
    src_rows: np.ndarray
    count: int
    active: int
    missing: int
    fetched: int
    error: int

    def valid(self, name):
        """The first ``count`` entries of a copy array, as a list."""
        return getattr(self, name)[: self.count].tolist()


def _copy_part(plan):
    # JAX nests the copy plan (``plan.copy.dst_slots``); the reference keeps it flat.
    copy_plan = getattr(plan, "copy", None)
    return plan if copy_plan is None or callable(copy_plan) else copy_plan


def ensure_view(plan, route_shape=None, num_experts=None) -> EnsureView:
    """An ``EnsurePlan`` or a ``ReferencePlan`` as an :class:`EnsureView`.

    ``route_shape``/``num_experts`` undo an adapter's route padding: the answers are cut back to
    the caller's routes and the copy arrays to ``min(K, E)`` (past ``count`` they are -1 anyway).
    """
    copy_plan = _copy_part(plan)
    slots, cpu = _np(plan.slots), _np(plan.cpu)
    dst, src = _np(copy_plan.dst_slots), _np(copy_plan.src_rows)
    if route_shape is not None:
        size = int(np.prod(route_shape))
        slots, cpu = slots[:size].reshape(route_shape), cpu[:size].reshape(route_shape)
        dst, src = dst[: min(size, num_experts)], src[: min(size, num_experts)]
    return EnsureView(slots, cpu, dst, src, int(_np(copy_plan.count)), int(_np(plan.active)),
                      int(_np(plan.missing)), int(_np(plan.fetched)), int(_np(plan.error)))


@dataclasses.dataclass(frozen=True)
class CopyView:
    """A materialize_layer plan."""

    dst_slots: np.ndarray
    src_rows: np.ndarray
    count: int
    error: int


def materialize_view(plan) -> CopyView:
    copy_plan = _copy_part(plan)
    return CopyView(_np(copy_plan.dst_slots), _np(copy_plan.src_rows), int(_np(copy_plan.count)),
                    int(_np(plan.error)))


@dataclasses.dataclass(frozen=True)
class ForgetView:
    old: int
    error: int


def forget_view(plan) -> ForgetView:
    assert int(plan) == int(_np(plan.old)), "int(plan) is the flat id it dropped"
    return ForgetView(int(_np(plan.old)), int(_np(plan.error)))


#: PrefillView field -> where a plan keeps it: the nested name first, the flat name second.
PREFILL_FIELDS = {
    "layer": ("layer",),
    "buffer_id": ("buffer_id",),
    "already_loaded": ("already_loaded",),
    "gather_dst_slots": ("gather.dst_slots", "gather_dst_slots"),
    "gather_src_slots": ("gather.src_slots", "gather_src_slots"),
    "gather_count": ("gather.count", "gather_count"),
    "gather_banks": ("gather.banks", "gather_banks"),
    "run_starts": ("runs.starts", "run_starts"),
    "run_lens": ("runs.lens", "run_lens"),
    "run_count": ("runs.count", "run_count"),
    "entry_bank": ("transfers.bank", "entry_bank"),
    "entry_dst_slot": ("transfers.dst_slot", "entry_dst_slot"),
    "entry_src_row": ("transfers.src_row", "entry_src_row"),
    "entry_rows": ("transfers.rows", "entry_rows"),
    "entry_whole_layer": ("transfers.whole_layer", "entry_whole_layer"),
    "entry_count": ("transfers.count", "entry_count"),
    "error": ("error",),
}
_PREFILL_SCALARS = ("layer", "buffer_id", "gather_count", "run_count", "entry_count", "error")


def _field(plan, paths):
    for path in paths:
        value = plan
        try:
            for name in path.split("."):
                value = getattr(value, name)
        except AttributeError:
            continue
        return value
    raise AttributeError(f"{type(plan).__name__} has none of {paths}")


@dataclasses.dataclass(frozen=True)
class PrefillView:
    """A prefetch_prefill_layer plan, flat names, NumPy arrays (Python scalars for counts)."""

    layer: int
    buffer_id: int
    already_loaded: bool
    gather_dst_slots: np.ndarray
    gather_src_slots: np.ndarray
    gather_count: int
    gather_banks: np.ndarray
    run_starts: np.ndarray
    run_lens: np.ndarray
    run_count: int
    entry_bank: np.ndarray
    entry_dst_slot: np.ndarray
    entry_src_row: np.ndarray
    entry_rows: np.ndarray
    entry_whole_layer: np.ndarray
    entry_count: int
    error: int
    raw: object = dataclasses.field(repr=False, compare=False)

    def valid(self, name, count):
        return getattr(self, name)[: getattr(self, count)].tolist()

    def entry_bytes(self, banks):
        """The plan's own byte counts of the valid entries (host ints)."""
        return [int(b) for b in list(self.raw.entry_bytes(banks))[: self.entry_count]]

    def entries(self, banks):
        """The valid host transfers as ``(bank, dst_slot, src_row, rows, bytes, whole_layer)``."""
        n = self.entry_count
        return list(zip(self.entry_bank[:n].tolist(), self.entry_dst_slot[:n].tolist(),
                        self.entry_src_row[:n].tolist(), self.entry_rows[:n].tolist(),
                        self.entry_bytes(banks), self.entry_whole_layer[:n].tolist()))


@dataclasses.dataclass(frozen=True)
class ResizeView:
    """A resize plan: the freed slots and their old occupants (-1 padded), count, error."""

    freed_slots: np.ndarray
    freed_ids: np.ndarray
    count: int
    error: int


def resize_view(plan) -> ResizeView:
    return ResizeView(_np(plan.freed_slots), _np(plan.freed_ids), int(_np(plan.count)),
                      int(_np(plan.error)))


def prefill_view(plan) -> PrefillView:
    values = {}
    for name, paths in PREFILL_FIELDS.items():
        value = _np(_field(plan, paths))
        values[name] = int(value) if name in _PREFILL_SCALARS else value
    values["already_loaded"] = bool(values["already_loaded"])
    return PrefillView(**values, raw=plan)


# ---- comparisons and the invariants (docs/semantics.md §3, §4) --------------------------------


def assert_same_state(a: StateView, b: StateView, context=""):
    for name in STATE_FIELDS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name),
                                      err_msg=f"state.{name} {context}")
    for name in EVICTION_FIELDS:
        mine, theirs = getattr(a, name), getattr(b, name)
        assert (mine is None) == (theirs is None), f"state.{name} on one side only {context}"
        if mine is not None:
            np.testing.assert_array_equal(mine, theirs, err_msg=f"state.{name} {context}")


def assert_same_plan(a, b, context=""):
    """Two views of one kind, field by field (the raw plan excluded)."""
    for field in dataclasses.fields(a):
        if field.compare:
            np.testing.assert_array_equal(getattr(a, field.name), getattr(b, field.name),
                                          err_msg=f"plan.{field.name} {context}")


def assert_invariants(state: StateView):
    """docs/semantics.md §3: the maps are mutually inverse, no slot is claimed twice, usage <= step."""
    slot_for_id, id_of_slot, E = state.slot_for_id, state.id_of_slot, state.num_experts
    for slot, flat in enumerate(id_of_slot.tolist()):
        if flat >= 0:
            assert slot_for_id[flat // E, flat % E] == slot, f"slot {slot} and its occupant disagree"
    for (layer, expert), slot in np.ndenumerate(slot_for_id):
        if slot >= 0:
            assert id_of_slot[slot] == layer * E + expert, f"expert {(layer, expert)} -> slot {slot}"
    claimed = slot_for_id[slot_for_id >= 0]
    assert len(set(claimed.tolist())) == len(claimed), "a slot is claimed twice"
    assert (state.usage <= state.step).all(), "usage ahead of the clock"
    size = int(state.cache_size)
    assert E <= size <= state.capacity, f"usable size {size} outside [E, capacity]"
    assert (id_of_slot[size:] == -1).all() and (state.usage[size:] == 0).all(), \
        "a slot past the usable size holds something"


def assert_plan_well_formed(plan: EnsureView, routes, num_experts):
    """docs/semantics.md §4: every route assigned exactly once, duplicates alike, copy arrays -1 padded."""
    flat = np.asarray(routes)
    assert plan.slots.shape == plan.cpu.shape == flat.shape
    assert plan.dst_slots.shape == plan.src_rows.shape == (min(flat.size, num_experts),)
    slots, cpu, flat = plan.slots.ravel(), plan.cpu.ravel(), flat.ravel()
    if plan.error:
        assert (slots == -1).all() and not cpu.any()
        return
    route = flat >= 0
    assert ((slots >= 0) != cpu)[route].all(), "a route assigned to both devices or to neither"
    assert (slots[~route] == -1).all() and not cpu[~route].any(), "padding got an assignment"
    for expert in set(flat[route].tolist()):
        same = flat == expert
        assert len(set(slots[same].tolist())) == 1 and len(set(cpu[same].tolist())) == 1
    count = plan.count
    assert count == plan.fetched
    assert (plan.dst_slots[count:] == -1).all() and (plan.src_rows[count:] == -1).all()
    assert len(set(plan.dst_slots[:count].tolist())) == count


# ---- the adapters ---------------------------------------------------------------------------

#: JAX adapters pad short 1-D routes with -1 to this width, so most tests share one compile per
#: geometry; padding is ignored everywhere (docs/semantics.md §4) and the views cut it back off.
ROUTE_WIDTH = 8


def _option(value):
    return value.value if hasattr(value, "value") else value


class Cache:
    """One cache under one adapter: a mutable handle whatever the implementation."""

    def __init__(self, adapter, native):
        self.adapter = adapter
        self.native = native  # a ReferenceCache, or the current CacheState

    @property
    def state(self) -> StateView:
        return state_view(self.native)


class RefCache(Cache):
    def clone(self):
        return RefCache(self.adapter, copy.deepcopy(self.native))

    def ensure(self, layer, routes):
        return ensure_view(self.native.ensure(layer, routes))

    def ensure_hybrid(self, layer, routes, policy, **options):
        options = {k: _option(v) for k, v in options.items()}
        return ensure_view(self.native.ensure_hybrid(layer, routes, policy, **options))

    def materialize_layer(self, layer):
        return materialize_view(self.native.materialize_layer(layer))

    def forget_slot(self, slot):
        return forget_view(self.native.forget_slot(slot))

    def prefetch_prefill_layer(self, layer, banks):
        return prefill_view(self.native.prefetch_prefill_layer(layer, banks))

    def rebuild(self, cache_size, **kwargs):
        self.native.rebuild(cache_size, **kwargs)

    def resize(self, cache_size):
        return resize_view(self.native.resize(cache_size))

    def shift_clock(self, offset):
        """Move every live stamp and the clock forward, as if the cache had run that long."""
        c = self.native
        c.usage[c.usage >= 1] += offset
        c.recency[c.recency >= 0] += offset
        c.step += offset

    def __getattr__(self, name):
        # begin_prefill, release_prefill_layer, reset, reset_stats, set_collect_routing,
        # reset_routing, stats, layer_stats, per_layer_stats, routing_histogram, routing_skew,
        # prefill_overlap_fits: the reference's own methods, same names and results.
        return getattr(self.native, name)


class JaxCache(Cache):
    pad_routes = True  # see ROUTE_WIDTH; the lockstep suite turns it off

    def clone(self):
        twin = JaxCache(self.adapter, self.native)
        twin.pad_routes = self.pad_routes
        return twin

    def _op(self, name, *args, **kwargs):
        return self.adapter.ops[name](self.native, *args, **kwargs)

    def _routes(self, routes):
        routes = np.asarray(routes)
        shape = routes.shape
        if routes.dtype.kind not in "iu":
            return routes, shape  # let the library refuse it, naming the dtype
        routes = routes.astype(np.int32)
        if self.pad_routes and routes.ndim == 1 and routes.size < ROUTE_WIDTH:
            routes = np.concatenate([routes, np.full(ROUTE_WIDTH - routes.size, -1, np.int32)])
        return jnp.asarray(routes), shape

    def ensure(self, layer, routes):
        routes, shape = self._routes(routes)
        self.native, plan = self._op("ensure", self.adapter.index(layer), routes,
                                     backend=self.adapter.backend)
        return ensure_view(plan, shape, self.native.num_experts)

    def ensure_hybrid(self, layer, routes, policy, **options):
        routes, shape = self._routes(routes)
        # Explicit defaults, so a call with and one without them share one compile.
        options = {"order": "recency", "admission": "promote_one",
                   **{k: _option(v) for k, v in options.items()}}
        self.native, plan = self._op("ensure_hybrid", self.adapter.index(layer), routes, policy,
                                     backend=self.adapter.backend, **options)
        return ensure_view(plan, shape, self.native.num_experts)

    def materialize_layer(self, layer):
        self.native, plan = self._op("materialize_layer", self.adapter.index(layer))
        return materialize_view(plan)

    def forget_slot(self, slot):
        self.native, plan = self._op("forget_slot", self.adapter.index(slot))
        return forget_view(plan)

    def begin_prefill(self):
        self.native = self._op("begin_prefill")

    def prefetch_prefill_layer(self, layer, banks):
        self.native, plan = self._op("prefetch_prefill_layer", self.adapter.index(layer),
                                     bank_feat_bytes=tuple(banks))
        return prefill_view(plan)

    def release_prefill_layer(self, layer):
        self.native = self._op("release_prefill_layer", self.adapter.index(layer))

    def reset(self):
        self.native = self._op("reset")

    def reset_stats(self):
        self.native = self._op("reset_stats")

    def set_collect_routing(self, on):
        self.native = self._op("set_collect_routing", self.adapter.flag(on))

    def reset_routing(self):
        self.native = self._op("reset_routing")

    def start_token(self):
        self.native = self._op("start_token")

    def rebuild(self, cache_size, **kwargs):
        self.native = pc.rebuild(self.native, cache_size, **kwargs)  # host-side: it changes shapes

    def resize(self, cache_size):
        self.native, plan = self._op("resize", self.adapter.index(cache_size))
        return resize_view(plan)

    def stats(self):
        return pc.stats(self.native)

    def layer_stats(self, layer):
        return pc.layer_stats(self.native, layer)

    def per_layer_stats(self):
        return pc.per_layer_stats(self.native)

    def routing_histogram(self, layer):
        return _np(pc.routing_histogram(self.native, layer))

    def routing_skew(self):
        return pc.routing_skew(self.native)

    def prefill_overlap_fits(self):
        return bool(pc.prefill_overlap_fits(self.native))

    def shift_clock(self, offset):
        s = self.native
        usage, recency = _np(s.usage), _np(s.recency)
        self.native = s.replace(
            usage=jnp.asarray(np.where(usage >= 1, usage + offset, usage), jnp.int32),
            recency=jnp.asarray(np.where(recency >= 0, recency + offset, recency), jnp.int32),
            step=jnp.int32(int(_np(s.step)) + offset))


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One way of running the cache: ``init`` a :class:`Cache`, plus the policy and error names.

    ``Policy`` is the implementation's policy class (``fraction``/``fixed_cap``/``full``);
    ``errors`` a namespace with the ``ERR_*`` bits, ``RebuildRejected`` and ``PrefillDoesNotFit``.
    """

    name: str

    def __repr__(self):
        return self.name

    @property
    def is_jax(self):
        return self.name != "reference"

    @property
    def Policy(self):  # noqa: N802 - a class, as on both sides
        return pc.FetchPolicy if self.is_jax else ReferencePolicy

    @property
    def errors(self):
        return pc if self.is_jax else reference

    @property
    def ops(self):
        return EAGER if self.name == "jax-eager" else JITTED

    @property
    def backend(self):
        return "interpret" if self.name == "jax-interpret" else None

    def index(self, i):
        """A layer or slot as this adapter passes it: traced under jit, a Python int eagerly."""
        return jnp.int32(i) if self.ops is JITTED else i

    def flag(self, on):
        return jnp.bool_(on) if self.ops is JITTED else on

    def init(self, num_layers, num_experts, cache_size, *, rebase_threshold=None,
             capacity=None, eviction=None, history=None) -> Cache:
        kwargs = {} if rebase_threshold is None else {"rebase_threshold": rebase_threshold}
        if capacity is not None:
            kwargs["capacity"] = capacity
        if eviction is not None:
            kwargs["eviction"] = eviction
        if history is not None:
            kwargs["history"] = history
        if not self.is_jax:
            return RefCache(self, ReferenceCache(num_layers, num_experts, cache_size, **kwargs))
        return JaxCache(self, pc.init(num_layers, num_experts, cache_size, **kwargs))

    def split(self, policy, missing) -> np.ndarray:
        """``F`` for each ``M`` in ``missing`` (an int array)."""
        missing = np.asarray(missing)
        if not self.is_jax:
            return np.asarray([policy.split(int(m)) for m in missing.ravel()]).reshape(missing.shape)
        split = _SPLIT if self.ops is JITTED else pc.FetchPolicy.split
        return _np(split(policy, jnp.asarray(missing, jnp.int32)))

    @staticmethod
    def fraction16(policy) -> int:
        return int(_np(policy.fraction16))


ADAPTER = {name: Adapter(name) for name in ADAPTERS}
