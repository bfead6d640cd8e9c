"""The one pytree idiom of the library: a frozen dataclass registered with JAX.

:func:`pytree_dataclass` makes every field a traced leaf unless :func:`static_field` declares it
part of the tree structure; instances gain ``replace(**changes)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, dataclass_transform

import jax

_T = TypeVar("_T")

__all__ = ["Record", "pytree_dataclass", "static_field"]


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
