"""The type aliases of the public signatures (for readers and type checkers; nothing checks
them at run time, the functions validate their inputs themselves)."""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import jax
import numpy as np

__all__ = ["Backend", "ExpertFn", "IndexLike", "PyTree", "RoutesLike"]

IndexLike = Union[int, np.integer, np.ndarray, jax.Array]
"""An integer scalar index (a layer, a slot, a size); a ``jax.Array`` may be traced."""

RoutesLike = Union[jax.Array, np.ndarray, Sequence[Any], int]
"""Routes: integer layer-local expert ids of any shape (-1 = padding), an array or nested lists."""

PyTree = Any
"""An array or any pytree of arrays (weights, pools, banks, plans)."""

ExpertFn = Callable[[Any, jax.Array], jax.Array]
"""``expert_fn(weights, x_row) -> y_row``: one expert (its weights pytree) on one token."""

Backend = Union[str, None]
"""``"xla"``, ``"pallas"``, ``"interpret"``, or None for the platform default."""
