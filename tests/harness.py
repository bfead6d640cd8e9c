"""Shared test helpers (``tests/conftest.py`` re-exports the hooks and fixtures; test files import
``from tests.harness import ...``): Hypothesis profiles (``ci``, the default, fast; ``deep`` via
``PALLAS_CACHE_PROFILE=deep``: many more sequences, every adapter test on all four adapters), the
adapters, the one record comparison and the evictions under test.

**Adapters** (the idea of ``chex.variants``). A test taking the ``adapter`` fixture runs on
``reference`` (:mod:`pallas_cache.reference`) and ``jax-eager`` (the public functions); marked
``traced`` also on ``jax-jit`` (every op under an outer ``jax.jit``, layers/slots/flags traced),
marked ``kernels`` also on ``jax-interpret`` (jit, Pallas kernels in the interpreter). An
:class:`Adapter` is a plain set of functions with the library's signatures over that
implementation's own records (the reference's have the library's field names and nesting):
``init(L, E, S, *, capacity, eviction, history, rebase_threshold) -> state``;
``ensure(state, layer, routes)``, ``ensure_hybrid(state, layer, routes, policy, order=,
admission=)``, ``materialize_layer``, ``forget_slot``, ``prefetch_prefill_layer(state, layer,
banks)``, ``resize`` -> ``(state, plan)``; ``begin_prefill``, ``release_prefill_layer``, ``reset``,
``reset_stats``, ``reset_routing``, ``set_collect_routing``, ``start_token``, ``rebuild`` ->
state; ``stats``, ``layer_stats``, ``per_layer_stats``, ``routing_histogram``, ``routing_skew``,
``prefill_overlap_fits`` -> reports; ``Policy``, ``errors`` (``ERR_*``, ``RebuildRejected``,
``PrefillDoesNotFit``), ``is_jax``, ``ops`` (``EAGER`` or ``JITTED``), ``index(i)``.

JAX plans come back with NumPy leaves; short 1-D routes are padded to :data:`ROUTE_WIDTH` (one
compile per geometry) and the plan cut back (``adapter.unpadded()`` does not pad). A
:class:`Cache` holds a state for a sequence: ``c.ensure(layer, routes)`` is ``c.state, plan =
adapter.ensure(c.state, layer, routes)``, returning the plan; ``c.apply(op)`` runs an operation
record of :mod:`pallas_cache.testing.operations` the same way (:func:`steps`: a sequence).
:func:`assert_same` compares two records (states, plans) field by field. Every list of evictions
in a test comes from :func:`evictions_under_test`: the ``Eviction`` registry plus
:func:`add_eviction_under_test`'s. The sizing tests' own helpers are in tests/sizing/conftest.py.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import pallas_cache as pc
from pallas_cache import hybrid, reference
from pallas_cache.reference.checks import assert_invariants, assert_plan_well_formed  # noqa: F401
from pallas_cache.testing import record_difference

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=_SLOW_OK)
settings.register_profile("deep", max_examples=1000, deadline=None, suppress_health_check=_SLOW_OK)
PROFILE = os.environ.get("PALLAS_CACHE_PROFILE", "ci")

# The console script keeps compiled programs in the user's cache directory; no test may (this
# keeps the subprocesses running ``python -m pallas_cache.sizing.cli`` off it too;
# tests/sizing/cli/test_cli_progress.py clears it where it tests that cache, in a temporary home).
os.environ["PALLAS_CACHE_NO_COMPILE_CACHE"] = "1"
settings.load_profile(PROFILE)

#: Whether XLA compiles with most of its optimizations off (``jax_disable_most_optimizations``:
#: LLVM at -O0): the default of the ``ci`` profile, whose time is mostly XLA:CPU compiling small
#: programs that run a few times (a quarter less CPU in the lockstep tests). Under ``deep``, or
#: with ``JAX_DISABLE_MOST_OPTIMIZATIONS=0``, the tests compile as users do; a test that reads
#: XLA's optimized program takes the :func:`optimized_xla` fixture. Set in the environment too,
#: so the subprocesses the tests start (the CLI, the four-device mesh checks) compile alike.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1" if PROFILE == "ci" else "0")
FAST_COMPILE = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() in ("1", "true", "yes", "y",
                                                                         "t", "on")
jax.config.update("jax_disable_most_optimizations", FAST_COMPILE)


#: A test the ``deep`` profile runs and ``ci`` skips (visibly): one whose rules other tests of the
#: fast profile already cover on another path.
deep_only = pytest.mark.skipif(PROFILE != "deep", reason="deep profile only "
                               "(PALLAS_CACHE_PROFILE=deep)")


def examples(share: float, *, ci: float | None = None) -> settings:
    """Settings that run ``share`` of the loaded profile's examples (at least 4; ``ci``, if given,
    is the share under the ``ci`` profile instead): for the cross-product lockstep runs, which
    repeat under one more option what the plain lockstep checks."""
    share = ci if ci is not None and PROFILE == "ci" else share
    return settings(max_examples=max(4, round(settings.default.max_examples * share)))


ADAPTERS = ("reference", "jax-eager", "jax-jit", "jax-interpret")
#: Which marker adds which adapter to the two every adapter test runs on (the deep profile: all).
MARKED_ADAPTERS = {"traced": "jax-jit", "kernels": "jax-interpret"}


def pytest_configure(config):
    config.addinivalue_line("markers", "traced: a traced layer/slot/flag or a folded static "
                            "option could change the answer: also on the jax-jit adapter")
    config.addinivalue_line("markers", "kernels: the rule is decided by a Pallas kernel "
                            "(victims, promotion): also on the jax-interpret adapter")


def adapters_for(definition):
    """The adapters one test runs on: reference and jax-eager, plus what its markers add."""
    if PROFILE == "deep":
        return ADAPTERS
    added = {name for marker, name in MARKED_ADAPTERS.items() if definition.get_closest_marker(marker)}
    return tuple(name for name in ADAPTERS if name in ("reference", "jax-eager") or name in added)


@pytest.fixture
def optimized_xla():
    """XLA's optimizations on for one test (one that reads the program XLA:CPU compiles, as
    users get it), whatever :data:`FAST_COMPILE` says; the compiled programs are dropped before
    and after, so none crosses from one setting to the other."""
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", FAST_COMPILE)
        jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module: the suite's thousands, kept for the
    whole session, exhaust the memory mappings (``vm.max_map_count``) and XLA crashes late."""
    yield
    jax.clear_caches()


# ---- the evictions under test ------------------------------------------------------------------

#: Evictions added to every eviction-parametrised test: name -> (library record, reference record).
EXTRA_EVICTIONS: dict = {}


def add_eviction_under_test(library_record, reference_record):
    """Put a policy under every eviction-parametrised test: the library's ``EvictionPolicy`` and
    its reference twin, one name. Call before collection, from a plugin's ``pytest_configure``
    that imports ``conftest`` there (tests/lockstep/test_harness.py)."""
    assert library_record.name == reference_record.name
    EXTRA_EVICTIONS[library_record.name] = (library_record, reference_record)
    reference.evictions.POLICIES[reference_record.name] = reference_record


def evictions_under_test(*, kernel=None, ring=None, default=None) -> list:
    """Every eviction under test, as ``pc.init`` and ``reference.init`` take it (the name of a
    built-in policy, the library record of an added one), filtered by: ``kernel`` (the fused
    kernel ranks it), ``ring`` (it keeps a token ring), ``default`` (it is LRU, the default)."""
    out = []
    for value, record in [(e.value, e.policy) for e in pc.Eviction] + [
            (lib, lib) for lib, _ in EXTRA_EVICTIONS.values()]:
        state = record.init(1, 1, 2)
        has = {"kernel": record.kernel is not None, "default": record is pc.Eviction.LRU.policy,
               "ring": state is not None and record.history_of(state) is not None}
        wanted = {"kernel": kernel, "ring": ring, "default": default}
        if all(want is None or has[k] == want for k, want in wanted.items()):
            out.append(pytest.param(value, id=record.name))
    return out


def pytest_generate_tests(metafunc):
    if "adapter" in metafunc.fixturenames:
        metafunc.parametrize("adapter", adapters_for(metafunc.definition), indirect=True)


@pytest.fixture
def adapter(request):
    return ADAPTER[request.param]


# ---- the one comparison, and readers of records ----------------------------------------------


def _np(x):
    return np.asarray(jax.device_get(x))


def assert_same(a, b, context="", path="state"):
    """Two records (states, plans, reports; library or reference) equal field by field, nested
    records included: :func:`pallas_cache.testing.record_difference` (the ring as bools, an
    eviction by name, values not dtypes)."""
    difference = record_difference(a, b, path)
    assert difference is None, f"{difference} {context}"


def slot_of(state, layer, expert):
    """The slot holding ``(layer, expert)``, None if it is not resident."""
    return int(state.residency.slot_for_id[layer, expert]) if state.residency.slot_for_id[layer, expert] >= 0 else None


def resident_slots(state) -> int:
    return int((_np(state.residency.id_of_slot) >= 0).sum())


def valid(record, name):
    """The first ``record.count`` entries of ``record.name`` (a copy plan's, a gather's...)."""
    return _np(getattr(record, name))[: int(record.count)].tolist()


def entries(plan, banks):
    """A prefill plan's valid host transfers as ``(bank, dst_slot, src_row, rows, bytes,
    whole_layer)``."""
    t = plan.transfers
    sizes = [int(b) for b in list(plan.entry_bytes(banks))[: int(t.count)]]
    return list(zip(*(valid(t, f) for f in ("bank", "dst_slot", "src_row", "rows")), sizes,
                    valid(t, "whole_layer")))


#: A prefill bank's bytes per expert row, large enough that hits are gathered and misses travel
#: as runs (docs/semantics.md §5.11).
BIG_BANK = 512 * 1024

# ---- the adapters ---------------------------------------------------------------------------

#: JAX adapters pad short 1-D routes with -1 to this width, so most tests share one compile per
#: geometry; padding is ignored everywhere (docs/semantics.md §4) and the plan is cut back.
ROUTE_WIDTH = 8
_STATIC = {"ensure": ("backend",), "ensure_hybrid": ("order", "admission", "backend"),
           "prefetch_prefill_layer": ("bank_feat_bytes",)}
_OPS = ("ensure", "ensure_hybrid", "materialize_layer", "forget_slot", "begin_prefill",
        "prefetch_prefill_layer", "release_prefill_layer", "reset", "reset_stats",
        "set_collect_routing", "reset_routing", "resize")
EAGER = {name: getattr(pc, name) for name in _OPS} | {"start_token": pc.evictions.start_token}
JITTED = {name: jax.jit(f, static_argnames=_STATIC.get(name, ())) for name, f in EAGER.items()}
#: Host-side functions (``rebuild`` changes shapes) and the reports, never jitted.
_HOST = ("rebuild", "stats", "layer_stats", "per_layer_stats", "routing_histogram",
         "routing_skew", "prefill_overlap_fits")


def _host(x):  # a JAX array as NumPy (0-d: a Python scalar); anything else as is
    return (_np(x).item() if x.ndim == 0 else _np(x)) if isinstance(x, jax.Array) else x


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One way of running the cache: the operations as functions of a state (module docstring)."""

    name: str
    pad_routes: bool = True

    __repr__ = lambda self: self.name  # noqa: E731

    def unpadded(self) -> "Adapter":
        """This adapter passing routes in the caller's shape (a drawn shape is the compiled one)."""
        return dataclasses.replace(self, pad_routes=False)

    is_jax = property(lambda self: self.name != "reference")
    Policy = property(lambda self: pc.FetchPolicy if self.is_jax else reference.ReferencePolicy)
    errors = property(lambda self: pc if self.is_jax else reference)
    ops = property(lambda self: EAGER if self.name == "jax-eager" else JITTED)
    backend = property(lambda self: "interpret" if self.name == "jax-interpret" else None)

    def __getattr__(self, name):
        """Every operation but the ensure family: the reference's function, or the library's with
        layers, slots and flags traced under jit and the plan's leaves as NumPy."""
        if name not in _OPS + _HOST + ("start_token",):
            raise AttributeError(name)
        if not self.is_jax:
            return getattr(reference, name)
        if name in _HOST:
            return lambda *args, **kw: _host(getattr(pc, name)(*args, **kw))

        def operation(state, *args):
            kwargs = {"bank_feat_bytes": tuple(args[1])} if name == "prefetch_prefill_layer" else {}
            out = self.ops[name](state, *map(self.index, args[:1]), **kwargs)
            return (out[0], jax.tree.map(_np, out[1])) if isinstance(out, tuple) else out

        return operation

    def policy(self, spec):
        """This adapter's fetch policy for a :class:`pallas_cache.testing.PolicySpec`."""
        return spec.build(self.Policy)

    def index(self, i):
        """A layer, slot or flag as this adapter passes it: traced under jit, as is eagerly."""
        if self.ops is JITTED and isinstance(i, (int, bool, np.integer, np.bool_)):
            return jnp.bool_(i) if isinstance(i, (bool, np.bool_)) else jnp.int32(i)
        return i

    def init(self, num_layers, num_experts, cache_size, **options):
        options = {k: v for k, v in options.items() if v is not None}
        if self.is_jax:
            return pc.init(num_layers, num_experts, cache_size, **options)
        added = EXTRA_EVICTIONS.get(getattr(options.get("eviction"), "name", None))
        options |= {"eviction": added[1]} if added else {}
        return reference.init(num_layers, num_experts, cache_size, **options)

    def cache(self, *args, **options) -> "Cache":
        return Cache(self, self.init(*args, **options))

    def ensure(self, state, layer, routes):
        return self._ensure("ensure", state, layer, routes)

    def ensure_hybrid(self, state, layer, routes, policy, **options):
        return self._ensure("ensure_hybrid", state, layer, routes, policy, **{
            "order": "recency", "admission": "promote_one",  # explicit: one compile with or without
            **{k: getattr(v, "value", v) for k, v in options.items()}})

    def _ensure(self, name, state, layer, routes, *args, **options):
        if not self.is_jax:
            return getattr(reference, name)(state, layer, routes, *args, **options)
        routes, shape = np.asarray(routes), np.shape(routes)
        if routes.dtype.kind in "iu":  # else the library refuses it, naming the dtype
            routes = routes.astype(np.int32)
            if self.pad_routes and routes.ndim == 1 and routes.size < ROUTE_WIDTH:
                routes = np.concatenate([routes, np.full(ROUTE_WIDTH - routes.size, -1, np.int32)])
            routes = jnp.asarray(routes)
        state, plan = self.ops[name](state, self.index(layer), routes, *args,
                                     backend=self.backend, **options)
        plan = jax.tree.map(_np, plan)
        size = int(np.prod(shape))
        width = min(size, state.num_experts)
        copy = dataclasses.replace(plan.copy, dst_slots=plan.copy.dst_slots[:width],
                                   src_rows=plan.copy.src_rows[:width])
        return state, dataclasses.replace(plan, slots=plan.slots[:size].reshape(shape),
                                          cpu=plan.cpu[:size].reshape(shape), copy=copy)


ADAPTER = {name: Adapter(name) for name in ADAPTERS}


class Cache:
    """A state under one adapter, for a test that runs a sequence: ``c.op(*args)`` runs
    ``adapter.op(c.state, *args)``, keeps the new state and returns the plan (or the report)."""

    def __init__(self, adapter: Adapter, state):
        self.adapter, self.state = adapter, state

    def apply(self, op):
        """Run one operation record (:mod:`pallas_cache.testing.operations`) on this cache;
        returns its plan, None, or the static error it raised as a string
        (``PrefillDoesNotFit``, ``RebuildRejected(requested=.., minimum=..)``)."""
        errors = self.adapter.errors
        try:
            self.state, plan = op.apply(self.adapter, self.state, policy=self.adapter.policy)
        except errors.PrefillDoesNotFit:
            return "PrefillDoesNotFit"
        except errors.RebuildRejected as error:
            return f"RebuildRejected(requested={error.requested}, minimum={error.minimum})"
        return plan

    def clone(self) -> "Cache":
        return Cache(self.adapter, self.state)  # states are values: an operation makes a new one

    def __getattr__(self, name):
        def call(*args, **kwargs):
            out = getattr(self.adapter, name)(self.state, *args, **kwargs)
            if _is_state(out) or (isinstance(out, tuple) and _is_state(out[0])):
                self.state, out = out if isinstance(out, tuple) else (out, None)
            return out
        return call


def _is_state(x):
    return isinstance(x, (pc.CacheState, reference.ReferenceCache))


# ---- the lockstep tests' operations: the kit's records on a Cache of any adapter -------------


def steps(cache, ops):
    """Run ``ops`` (operation records) on ``cache`` one at a time, yielding ``(outcome, cache)``
    after each (:meth:`Cache.apply`)."""
    for op in ops:
        yield cache.apply(op), cache


def cpu_partial_oracle(x, expert_ids, gates, plan, host_bank, expert_fn: Callable, *,
                       layer=None):
    """What ``pc.cpu_partial`` computes, as a masked evaluation of every route on the device
    (one expert evaluation per route, CPU route or not): the oracle of its tests."""
    layer = hybrid.check_bank_layer(host_bank, layer)
    tokens, ids, gate = hybrid._token_routes(x, expert_ids, gates)
    on_cpu = hybrid._plan_routes(plan, expert_ids, "cpu") & (ids >= 0)
    if layer is not None:
        on_cpu = on_cpu & hybrid._layer_in_bank(host_bank, layer)
        layer = jnp.where(hybrid._layer_in_bank(host_bank, layer), layer, 0)
    weights = jax.tree.map(
        lambda b: hybrid.gather_rows(b, jnp.where(on_cpu, ids, 0).reshape(-1), layer,
                                     hybrid.memory_space(x)),
        host_bank)
    routes = jnp.repeat(tokens, ids.shape[1], axis=0)
    y = jax.vmap(expert_fn)(weights, routes).reshape(ids.shape + (-1,))
    gated = jnp.where(on_cpu[..., None], gate[..., None].astype(y.dtype) * y, 0)
    return gated.sum(axis=1).reshape(x.shape[:-1] + y.shape[-1:])


def scan_against_xla(state, layers, routes, policy=None):
    """``pc.ensure_hybrid`` of every ``(layers[i], routes[i])`` in one jitted ``lax.scan``, once
    with the fused kernel in the interpreter and once with the XLA step: ``(ours, theirs)``, each
    ``(final state, stacked plans)``. ``policy`` defaults to ``FetchPolicy.full()``."""
    policy = pc.FetchPolicy.full() if policy is None else policy

    def run(backend):
        def body(s, x):
            return pc.ensure_hybrid(s, x[0], x[1], policy, backend=backend)
        return jax.jit(lambda s: jax.lax.scan(body, s, (jnp.asarray(layers), routes)))(state)

    return run("interpret"), run("xla")
