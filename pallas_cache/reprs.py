"""Short ``repr`` of states and plans: shapes and a few counters, never the arrays.

The dataclass ``repr`` of a :class:`~pallas_cache.CacheState` prints every array of its 17
leaves; these print one line that reads under ``jit`` (traced values show as ``?``) and on a
batch (a counter per cache). Each record sets one of them as its ``__repr__`` in its class
body; this module imports none of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


__all__ = ["plan_repr", "state_repr"]


def _shape_text(leaf: Any) -> str:
    dtype = np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype)).name
    return f"{dtype}[{', '.join(str(n) for n in np.shape(leaf))}]"


def _value_text(leaf: Any) -> str:
    """A scalar's value, a small batch of them as a list, ``?`` for a traced one."""
    if isinstance(leaf, jax.core.Tracer):
        return "?"
    value = np.asarray(jax.device_get(leaf))
    if value.ndim == 0:
        return str(value.item())
    flat = value.ravel()
    if flat.size <= 8:
        return "[" + " ".join(str(v) for v in flat.tolist()) + "]"
    return f"[{flat.min()}..{flat.max()}]"


def plan_repr(plan: Any, batch_ndim: int | None = None) -> str:
    """``Name(field=..., ...)``: scalar fields by value (per cache for a batch), array fields as
    ``dtype[shape]``, nested plans the same way, static fields as they are."""
    fields = dataclasses.fields(plan)
    if batch_ndim is None:
        # The batch axes: those of the plan's error (or first) scalar field.
        anchor = getattr(plan, "error", None)
        if anchor is None:
            anchor = getattr(plan, "count", None)
        batch_ndim = np.ndim(anchor) if anchor is not None else 0
    parts = []
    for field in fields:
        value = getattr(plan, field.name)
        if field.metadata.get("static"):
            if value is not None:
                parts.append(f"{field.name}={value!r}")
        elif dataclasses.is_dataclass(value):
            parts.append(f"{field.name}={plan_repr(value, batch_ndim)}")
        elif value is None:
            continue
        elif np.ndim(value) <= batch_ndim:
            parts.append(f"{field.name}={_value_text(value)}")
        else:
            parts.append(f"{field.name}={_shape_text(value)}")
    return f"{type(plan).__name__}({', '.join(parts)})"


def state_repr(state: Any) -> str:
    """``CacheState(L=8, E=16, S=64, C=64, eviction=lru, step=12, resident=40, calls=96)``;
    ``batch=(B,)`` first, and a value per cache, for a stacked state."""
    batch = tuple(np.shape(state.residency.id_of_slot)[:-1])
    head = [f"batch={batch}"] if batch else []
    head += [f"L={state.num_layers}", f"E={state.num_experts}",
             f"S={_value_text(state.cache_size)}", f"C={state.capacity}",
             f"eviction={state.eviction.name}", f"step={_value_text(state.step)}"]
    if isinstance(state.residency.id_of_slot, jax.core.Tracer):
        return f"CacheState({', '.join(head)})"
    ids = np.asarray(jax.device_get(state.residency.id_of_slot))
    table = np.asarray(jax.device_get(state.stats))
    resident = (ids >= 0).sum(axis=-1)
    calls = table[..., 0].sum(axis=-1)
    tail = [f"resident={_value_text(resident)}", f"calls={_value_text(calls)}"]
    return f"CacheState({', '.join(head + tail)})"

