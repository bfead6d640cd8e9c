"""The one pytree idiom of the library: a frozen dataclass registered with JAX.

:func:`pytree_dataclass` makes every field a traced leaf unless :func:`static_field` declares it
part of the tree structure; instances gain ``replace(**changes)``. :func:`varying_like` gives a
constant the mesh-axis type of the values it stands beside (inside ``jax.shard_map``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, dataclass_transform

import jax
from jax import lax

_T = TypeVar("_T")

__all__ = ["Record", "pytree_dataclass", "static_field", "varying_axes", "varying_like",
           "varying_shape"]


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is static pytree metadata (not a leaf): hashable, fixed per trace."""
    metadata = dict(kwargs.pop("metadata", None) or {}, static=True)
    return dataclasses.field(metadata=metadata, **kwargs)


def _replace(self: _T, **changes: Any) -> _T:
    return dataclasses.replace(self, **changes)  # type: ignore[type-var]


class Record:
    """The base of every :func:`pytree_dataclass` class: declares ``replace`` for type checkers
    (the decorator adds it at run time as well, for classes without this base)."""

    __slots__ = ()

    def replace(self: _T, **changes: Any) -> _T:
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return _replace(self, **changes)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, static_field))
def pytree_dataclass(cls: type[_T]) -> type[_T]:
    """Decorate ``cls`` as a frozen dataclass and register it as a JAX pytree node.

    Data fields are inferred: every field is a leaf unless declared with :func:`static_field`.
    Adds a ``replace`` method unless the class defines one.
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    if "replace" not in cls.__dict__:
        cls.replace = _replace
    return jax.tree_util.register_dataclass(cls)


def varying_axes(*operands) -> frozenset:
    """The mesh axes that any leaf of ``operands`` varies over inside a ``shard_map`` with
    ``check_vma`` (empty outside one)."""
    axes = set()
    for operand in jax.tree.leaves(operands):
        axes |= _varying_axes(operand)
    return frozenset(axes)


def varying_like(value, *operands):
    """``value`` made to vary over every mesh axis that any of ``operands`` varies over. Inside a
    ``shard_map`` with ``check_vma`` a constant (zeros) then has the type of the values computed
    from the operands, as a switch's or cond's branches and a loop's carry must; elsewhere there
    are no such axes and it is ``value`` (docs/design.md, "Several devices")."""
    axes = varying_axes(*operands)
    return jax.tree.map(lambda leaf: _cast(leaf, axes), value)


def varying_shape(shape, dtype, *, axes: frozenset) -> jax.ShapeDtypeStruct:
    """An output's shape and dtype that varies over the mesh ``axes`` (a ``pallas_call``'s
    ``out_shape``: inside a ``shard_map`` with ``check_vma`` the call's outputs must say how they
    vary, and they vary as its inputs do; elsewhere the type is ignored)."""
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=jax.sharding.ManualAxisType(varying=axes))


def _cast(leaf, axes):
    missing = axes - _varying_axes(leaf)
    return lax.pcast(leaf, tuple(sorted(missing, key=str)), to="varying") if missing else leaf


def _varying_axes(value) -> set:
    """The mesh axes a traced value varies over inside a ``shard_map`` (empty outside one)."""
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    return set(getattr(manual, "varying", None) or getattr(aval, "vma", None) or ())
