"""The one pytree idiom of the library: a frozen dataclass registered with JAX.

:func:`pytree_dataclass` makes every field a traced leaf unless :func:`static_field` declares it
part of the tree structure; instances gain ``replace(**changes)``.
"""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["pytree_dataclass", "static_field"]


def static_field(**kwargs):
    """A dataclass field that is static pytree metadata (not a leaf): hashable, fixed per trace."""
    metadata = dict(kwargs.pop("metadata", None) or {}, static=True)
    return dataclasses.field(metadata=metadata, **kwargs)


def _replace(self, **changes):
    return dataclasses.replace(self, **changes)


def pytree_dataclass(cls):
    """Decorate ``cls`` as a frozen dataclass and register it as a JAX pytree node.

    Data fields are inferred: every field is a leaf unless declared with :func:`static_field`.
    Adds a ``replace`` method unless the class defines one.
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    if "replace" not in cls.__dict__:
        cls.replace = _replace
    return jax.tree_util.register_dataclass(cls)
