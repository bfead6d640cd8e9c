"""One operation sequence run on the NumPy reference and on the library together, compared after
every step: :func:`assert_lockstep`, and the comparison of a reference record with a library one
(:func:`record_difference`) that the project's own lockstep tests use too.

The reference (:mod:`pallas_cache.reference`) has the library's field names and nesting, int64
where the library has int32, and the token ring as bools where the library keeps bitmask words;
:func:`record_difference` compares values across those (a dtype is not a difference) and names
the first differing field and index in :func:`~pallas_cache.testing.assert_states_equal`'s
style. Host-side, no hypothesis; NumPy only at import (the functions that run or read the
library import JAX), as the reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Sequence

import numpy as np

import pallas_cache as pc  # its names load on first use: nothing here reads one at import
from pallas_cache import reference
from pallas_cache.testing.operations import Geometry, Operation, run_operation

__all__ = ["assert_lockstep", "record_difference"]

def _evictions() -> tuple[type, ...]:
    return pc.Eviction, pc.evictions.EvictionPolicy, reference.EvictionPolicy


def _fields(record: Any) -> dict[str, Any]:
    if isinstance(record, reference.ReferenceCache):
        # The library state's fields, read off the reference: a part missing there differs.
        return {f.name: getattr(record, f.name, None) for f in dataclasses.fields(pc.CacheState)}
    # No reference twin: a copy plan's static geometry, the ring's incremental ``match``.
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)
            if f.name not in ("num_slots", "num_experts", "match")}


def record_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The first difference of two records (states, plans, reports; library or reference, nested
    records included) as one line (``"state.residency.usage[0, 3]: 5 != 7"``), or None when equal.

    Values compare exactly, not dtypes (the reference is int64). The library's ring is bitmask
    words (``masks``), the reference's bools (``ring``): compared as bools. An eviction compares
    by name."""
    evictions = _evictions()
    if isinstance(a, evictions) or isinstance(b, evictions):
        names = [x.policy.name if isinstance(x, pc.Eviction) else getattr(x, "name", x)
                 for x in (a, b)]
        return None if names[0] == names[1] else f"{path}: {names[0]!r} != {names[1]!r}"
    if isinstance(a, reference.ReferenceCache) or dataclasses.is_dataclass(a):
        if not (isinstance(b, reference.ReferenceCache) or dataclasses.is_dataclass(b)):
            return f"{path}: a record != {type(b).__name__}"
        fa, fb = _fields(a), _fields(b)
        for mine, theirs in ((fa, fb), (fb, fa)):
            if "masks" in mine and "ring" in theirs:
                mine["ring"] = pc.evictions.ring_bits(mine.pop("masks"), theirs["ring"].shape[-1])
        if fa.keys() != fb.keys():
            return f"{path}: fields only in one: {sorted(fa.keys() ^ fb.keys())}"
        for name in fa:
            difference = record_difference(fa[name], fb[name], f"{path}.{name}")
            if difference is not None:
                return difference
        return None
    if a is None or b is None:
        return None if a is None and b is None else f"{path}: on one side only"
    import jax

    from pallas_cache.testing.assertions import leaf_difference

    x, y = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
    if x.dtype != y.dtype and x.dtype.kind in "biu" and y.dtype.kind in "biu":
        x, y = x.astype(np.int64), y.astype(np.int64)
    return leaf_difference(path, x, y, dtypes=False)


# ---- the two implementations, one step each ----------------------------------------------------

def _reference_step(state: Any, op: Operation) -> tuple[Any, Any]:
    # The routes as written: the reference reads a nested tuple exactly (no int64 cast to
    # overflow or wrap), as the library does.
    return op.apply(reference, state, policy=lambda spec: spec.build(reference.ReferencePolicy))


_JITTED: dict[str, Callable[..., Any]] = {}
#: The library's functions jitted with static arguments, and the argument each traces.
_STATIC = {"ensure": ("backend",), "ensure_hybrid": ("order", "admission", "backend"),
           "prefetch_prefill_layer": ("bank_feat_bytes",)}
_TRACED = {"ensure": "layer", "ensure_hybrid": "layer", "materialize_layer": "layer",
           "prefetch_prefill_layer": "layer", "release_prefill_layer": "layer",
           "forget_slot": "slot", "resize": "cache_size", "set_collect_routing": None}


class _Jitted:
    """The library as an ``api`` of :meth:`Operation.apply` with every operation under
    ``jax.jit``: layers, slots and sizes traced, one compile per operation kind and shape
    (``rebuild``, which changes shapes, runs as is). Every value is converted as the eager call
    converts it (an index outside int32 becomes ``INT32_MIN``, refused with the op's error bit; a
    float or bool raises TypeError), so an eager and a jitted run of one record agree."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        import jax

        from pallas_cache import validate

        if name == "rebuild":
            return pc.rebuild
        function = pc.evictions.start_token if name == "start_token" else getattr(pc, name)
        if name not in _JITTED:
            _JITTED[name] = jax.jit(function, static_argnames=_STATIC.get(name, ()))
        traced = _TRACED.get(name)

        def call(state: Any, *args: Any, **kwargs: Any) -> Any:
            if traced is not None:
                args = (validate.as_index(traced, args[0]),) + args[1:]
            if name == "prefetch_prefill_layer":
                kwargs["bank_feat_bytes"] = tuple(args[1])
                args = args[:1]
            return _JITTED[name](state, *args, **kwargs)

        return call


_JIT = _Jitted()


def _jit_step(state: Any, op: Operation, backend: str) -> tuple[Any, Any]:
    """``run_operation`` under ``jax.jit`` (:class:`_Jitted`)."""
    from pallas_cache import validate

    return op.apply(_JIT, state, routes=validate.as_routes, backend=backend)


@dataclasses.dataclass(frozen=True)
class _Refused:
    """A side raised instead of running the operation (its state stays as it was)."""

    error: BaseException

    def __str__(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"


#: What a side may raise for an operation it refuses (a bad static argument); anything else is
#: a failure of that side and propagates.
_REFUSALS = (TypeError, ValueError, OverflowError)


def _steps(step: Callable[[Any, Operation], tuple[Any, Any]], state: Any,
           sequence: Sequence[Operation]) -> Iterator[tuple[Any, Any]]:
    for op in sequence:
        try:
            new_state, plan = step(state, op)
        except _REFUSALS as error:
            yield state, _Refused(error)
            continue
        state = new_state
        yield state, plan


def _compare(context: str, op: Any, expected: tuple[Any, Any], got: tuple[Any, Any]) -> None:
    mine, theirs = isinstance(expected[1], _Refused), isinstance(got[1], _Refused)
    if mine or theirs:
        if not (mine and theirs):
            refused, ran = ("reference", "library") if mine else ("library", "reference")
            raise AssertionError(f"{context}: the {refused} refused it "
                                 f"({expected[1] if mine else got[1]}) but the {ran} ran it")
        # By name: the reference raises its own twins of the library's errors (RebuildRejected).
        if type(expected[1].error).__name__ != type(got[1].error).__name__:
            raise AssertionError(f"{context}: refused differently: reference {expected[1]}, "
                                 f"library {got[1]}")
    for what, mine, theirs in (("plans", expected[1], got[1]), ("states", expected[0], got[0])):
        if isinstance(mine, _Refused):
            continue
        difference = record_difference(mine, theirs)
        if difference is not None:
            raise AssertionError(f"{context}: {what} differ at {difference} "
                                 "(reference != library)")


def assert_lockstep(sequence: Sequence[Operation], *, geometry: Geometry,
                    backend: str = "xla", jit: bool = False) -> int:
    """Run ``sequence`` (operation records, e.g. drawn by
    :func:`pallas_cache.testing.strategies.operations`) from a cold cache of ``geometry`` on the
    NumPy reference and on the library, and compare the whole plan and the whole state after
    every step. Returns the number of steps run.

    Args:
      sequence: the operations, in order.
      geometry: the cache both start from (:class:`~pallas_cache.testing.Geometry`).
      backend: the library's ensure backend (``"xla"``, ``"interpret"``, ``"pallas"``...).
      jit: run every library operation under ``jax.jit`` with layers, slots and sizes traced
        (else eagerly, as :func:`~pallas_cache.testing.run_operation`).

    An operation one side refuses by raising (TypeError, ValueError or OverflowError: a float
    id, a bad static argument) is compared as a refusal: both sides must refuse it with the same
    exception type, and the sequence goes on from the unchanged states. Values the library
    refuses with an error bit (ids, layers, slots, sizes outside their range, ``2**31`` or
    ``2**64 - 1`` included) are plans, compared as any plan; eager and jitted runs of one
    record agree.

    Raises:
      AssertionError: at the first step whose plan or state differs, or that one side refuses
        and the other runs (or refuses with another exception type), naming the step index, the
        operation, and the first differing field and index, e.g. ``op 3 Ensure(layer=0,
        routes=(1, 2)) on xla: states differ at .usage[0, 1]: 2 != 3 (reference != library)``.
      TypeError: an entry of ``sequence`` is not an operation record. ValueError: an unknown
        ``backend``.
    """
    from pallas_cache.kernels.dispatch import resolve_backend

    resolve_backend(backend)  # an unknown backend is the caller's mistake, not a refusal
    if not isinstance(geometry, Geometry):
        raise TypeError(f"geometry must be a Geometry (e.g. Geometry(num_layers=2, "
                        f"num_experts=4, cache_size=6)), got {geometry!r}")
    for index, op in enumerate(sequence):
        if not isinstance(op, Operation):
            raise TypeError(f"sequence[{index}] is not an operation record: {op!r}")
    if jit:
        library = lambda state, op: _jit_step(state, op, backend)  # noqa: E731
    else:
        library = lambda state, op: run_operation(state, op, backend=backend)  # noqa: E731
    truth = reference.init(geometry.num_layers, geometry.num_experts, geometry.cache_size,
                           capacity=geometry.capacity, eviction=geometry.eviction,
                           history=geometry.history)
    name = f"{backend}{' under jit' if jit else ''}"
    return run(sequence, _steps(_reference_step, truth, sequence),
               {name: _steps(library, geometry.init(), sequence)}, _compare)


def describe(op: Any) -> str:
    """An operation record as ``Name(field=value, ...)`` with arrays as lists, for failure
    messages; anything else as ``str(op)``."""
    if not dataclasses.is_dataclass(op):
        return str(op)
    shown = ", ".join(f"{f.name}={_shown(getattr(op, f.name))}" for f in dataclasses.fields(op))
    return f"{type(op).__name__}({shown})"


def _shown(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def run(ops: Sequence[Any], truth: Any, candidates: dict[str, Any],
        compare: Callable[[str, Any, Any, Any], None]) -> int:
    """Step ``truth`` and every candidate (``{name: per-step results}``, each an iterable with one
    item per op) through ``ops`` together (operation records, or labels :func:`describe` shows
    as they are); after every op, ``compare(context, op, expected, got)`` checks each candidate's
    result against the truth's and raises ``AssertionError`` naming ``context`` (the step, the
    op, the candidate) on the first difference. Returns the number of steps run. The project's
    lockstep tests feed it the adapters' caches, ``benchmarks/gpu_check.py`` the steps of its
    compiled scans."""
    truth = iter(truth)
    runs = {name: iter(results) for name, results in candidates.items()}
    index = -1
    for index, op in enumerate(ops):
        expected = next(truth)
        for name, results in runs.items():
            compare(f"op {index} {describe(op)} on {name}", op, expected, next(results))
    return index + 1
