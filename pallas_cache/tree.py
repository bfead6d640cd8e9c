"""The one pytree idiom of the library: a frozen dataclass registered with JAX.

Every state, plan and policy of ``pallas_cache`` is declared with :func:`pytree_dataclass`: a
frozen :func:`dataclasses.dataclass` passed to :func:`jax.tree_util.register_dataclass`, which
infers the fields. Every field is a traced leaf (an array, or a nested pytree dataclass) unless it
is declared with :func:`static_field`, which makes it part of the tree structure (hashable, fixed
at trace time). The instances gain ``replace(**changes)`` (``dataclasses.replace``), as optax and
flax structs have.
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
