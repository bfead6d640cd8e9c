"""Whole-tree equality of states and plans, with a message that names the first difference.

``assert s1 == s2`` on two :class:`~pallas_cache.CacheState` raises "truth value of an array ...
is ambiguous"; :func:`assert_states_equal` compares every leaf exactly (and the static fields:
the eviction policy, a plan's geometry) and says which field, at which index, differs first.
Host-side: call it on concrete states, outside ``jit``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

__all__ = ["assert_plans_equal", "assert_states_equal", "first_difference"]


def _leaves(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat], treedef


def _index_text(index: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in index) + "]" if index else ""


def leaf_difference(name: str, a: Any, b: Any, *, dtypes: bool = True) -> str | None:
    """Why two leaves differ (shape, dtype unless ``dtypes`` is False, then the first unequal
    entry), or None."""
    x, y = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
    if x.shape != y.shape:
        return f"{name}: shape {x.shape} != {y.shape}"
    if dtypes and x.dtype != y.dtype:
        return f"{name}: dtype {x.dtype} != {y.dtype}"
    if x.dtype.kind in "fc":
        unequal = ~((x == y) | (np.isnan(x) & np.isnan(y)))
    else:
        unequal = x != y
    if not np.any(unequal):
        return None
    first = tuple(int(i) for i in np.argwhere(unequal)[0])
    count = int(np.count_nonzero(unequal))
    more = f" (first of {count} differing entries)" if count > 1 else ""
    return f"{name}{_index_text(first)}: {x[first].item()!r} != {y[first].item()!r}{more}"


def _static_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The first static (non-leaf) field whose values differ, for the pytree dataclasses."""
    if type(a) is not type(b):
        return f"{path or 'the tree'}: {type(a).__name__} != {type(b).__name__}"
    if not dataclasses.is_dataclass(a):
        return None
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        name = f"{path}.{field.name}"
        if field.metadata.get("static"):
            if x != y:
                return f"{name} (static): {x!r} != {y!r}"
        elif dataclasses.is_dataclass(x) or dataclasses.is_dataclass(y):
            nested = _static_difference(x, y, name)
            if nested is not None:
                return nested
    return None


def first_difference(a: Any, b: Any) -> str | None:
    """The first difference of two pytrees as one line (``".usage[3]: 5 != 7"``), or None.

    Static fields (``CacheState.eviction``, ``CopyPlan.num_slots``) are compared first, then the
    tree structures, then the leaves in tree order: shape, dtype, and the first unequal entry
    (NaN equals NaN)."""
    static = _static_difference(a, b)
    if static is not None:
        return static
    leaves_a, def_a = _leaves(a)
    leaves_b, def_b = _leaves(b)
    if def_a != def_b:
        names_a = [name for name, _ in leaves_a]
        names_b = [name for name, _ in leaves_b]
        only = sorted(set(names_a) ^ set(names_b))
        detail = f"fields only in one: {only}" if only else f"{def_a} != {def_b}"
        return f"tree structure differs: {detail}"
    for (name, x), (_, y) in zip(leaves_a, leaves_b):
        difference = leaf_difference(name, x, y)
        if difference is not None:
            return difference
    return None


def assert_states_equal(a: Any, b: Any) -> None:
    """Raise ``AssertionError`` naming the first differing field and index of two cache states.

    Exact: every leaf (the eviction bookkeeping included) and the static eviction record. Works
    on batched (stacked) states as well; the index then starts with the batch position.
    """
    difference = first_difference(a, b)
    if difference is not None:
        raise AssertionError(f"states differ at {difference}")


def assert_plans_equal(a: Any, b: Any) -> None:
    """Raise ``AssertionError`` naming the first differing field and index of two plans (any
    plan: ``EnsurePlan``, ``MaterializePlan``, ``ForgetPlan``, ``PrefillPlan``, ``ResizePlan``,
    or a stack of them from a ``scan``), the static geometry of a ``CopyPlan`` included."""
    difference = first_difference(a, b)
    if difference is not None:
        raise AssertionError(f"plans differ at {difference}")
