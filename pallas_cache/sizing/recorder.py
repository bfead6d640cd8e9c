"""Record the routes of a JAX decode loop into a routing trace (docs/replay.md).

:class:`RouteRecorder` (:func:`init_recorder`, then :func:`record_routes` under ``jax.jit`` with
a traced token and layer) or a ``lax.scan``'s stacked routes; :func:`trace_from_routes` turns
either into a :class:`~pallas_cache.sizing.traces.Trace` on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pallas_cache.sizing.traces import Trace, TraceError

__all__ = ["RouteRecorder", "init_recorder", "record_routes", "trace_from_routes"]


@dataclasses.dataclass(frozen=True)
class RouteRecorder:
    """The routes of up to ``max_tokens`` tokens, filled inside a jitted decode loop.

    Attributes:
      routes: int32 ``[max_tokens, num_layers, top_k]``; the experts of each (token, layer) call,
        ``-1`` padded (and ``-1`` where nothing was recorded).
      written: bool ``[max_tokens, num_layers]``; whether the (token, layer) call was recorded
        (only those become calls of the trace).
      dropped: int32 ``[]``; records whose token or layer lay outside the buffer (nothing was
        written for them; :func:`trace_from_routes` refuses a recorder that dropped any).
    """

    routes: jax.Array
    written: jax.Array
    dropped: jax.Array


jax.tree_util.register_dataclass(RouteRecorder, data_fields=["routes", "written", "dropped"],
                                 meta_fields=[])


def init_recorder(max_tokens: int, num_layers: int, top_k: int) -> RouteRecorder:
    """An empty recorder for ``max_tokens`` tokens of ``num_layers`` calls of up to ``top_k``
    routes each (for a batch of ``B`` rows per call, ``top_k = B * k``).

    Raises:
      ValueError: a size that is not a positive int.
    """
    for name, value in (("max_tokens", max_tokens), ("num_layers", num_layers),
                        ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"init_recorder: {name} must be a positive int, got {value!r}")
    return RouteRecorder(routes=jnp.full((max_tokens, num_layers, top_k), -1, jnp.int32),
                         written=jnp.zeros((max_tokens, num_layers), bool),
                         dropped=jnp.zeros((), jnp.int32))


def record_routes(recorder: RouteRecorder, token: Any, layer: Any, routes: Any) -> RouteRecorder:
    """The recorder with the routes of call ``(token, layer)`` written in; pure and jittable.

    Args:
      recorder: from :func:`init_recorder` (carried through the loop).
      token: int scalar (traced or not): the token's position, ``[0, max_tokens)``.
      layer: int scalar (traced or not): the layer, ``[0, num_layers)``.
      routes: integer array of any shape with at most ``top_k`` elements (e.g. ``[B, k]`` for a
        batch of rows): the call's experts, ``-1`` = padding; flattened and ``-1`` padded.

    Returns:
      The new recorder. A ``token`` or ``layer`` outside the buffer (any integer width: an int64
      ``2**32`` included) writes nothing and counts in ``dropped``; writing a call twice keeps
      the last routes. An expert id outside ``[-1, 2**31)`` (a uint32 ``0xFFFFFFFF``) is stored
      as :data:`OUT_OF_RANGE_ID`, which :func:`trace_from_routes` refuses.

    Raises:
      TypeError: non-integer routes, token or layer (at trace time).
      ValueError: more routes than ``top_k`` (at trace time; both shapes named).
    """
    raw, routes = routes, jnp.asarray(routes)
    max_tokens, num_layers, top_k = recorder.routes.shape
    if not jnp.issubdtype(routes.dtype, jnp.integer):
        raise TypeError(f"record_routes: routes must be integer expert ids, got dtype "
                        f"{routes.dtype} (shape {routes.shape})")
    if routes.size > top_k:
        raise ValueError(f"record_routes: routes of shape {routes.shape} hold {routes.size} "
                         f"experts but the recorder's calls hold top_k={top_k} (shape "
                         f"{recorder.routes.shape}); init_recorder with top_k >= {routes.size}")
    token, layer = _host_index(token), _host_index(layer)
    for name, value in (("token", token), ("layer", layer)):
        if value.ndim != 0 or not jnp.issubdtype(value.dtype, jnp.integer):
            raise TypeError(f"record_routes: {name} must be an integer scalar, got "
                            f"{value.dtype} {value.shape}")
    row = jnp.full((top_k,), -1, jnp.int32).at[:routes.size].set(
        _int32_ids(raw).reshape(-1))
    inside = (token >= 0) & (token < max_tokens) & (layer >= 0) & (layer < num_layers)
    # Outside the buffer: an index past the end, which mode="drop" skips (a negative one would
    # wrap around to the last row instead).
    token = jnp.where(inside, token, max_tokens).astype(jnp.int32)
    layer = jnp.where(inside, layer, num_layers).astype(jnp.int32)
    return RouteRecorder(
        routes=recorder.routes.at[token, layer].set(row, mode="drop"),
        written=recorder.written.at[token, layer].set(True, mode="drop"),
        dropped=recorder.dropped + (~inside).astype(jnp.int32))


#: What an expert id outside int32's range is recorded as: below ``-1``, so
#: :func:`trace_from_routes` refuses it as it refuses any id outside ``[-1, E)`` (a plain cast
#: would wrap ``0xFFFFFFFF`` onto the padding ``-1``).
OUT_OF_RANGE_ID = int(np.iinfo(np.int32).min)


def _host_index(value):
    """A token or layer as a JAX array. A concrete integer outside int32's range (an int64
    ``2**32``) becomes ``-1``, which is outside the buffer and counts in ``dropped``, instead of
    wrapping onto ``0`` in the int32 cast; a traced one is compared in its own dtype."""
    if not isinstance(value, jax.core.Tracer):
        host = np.asarray(value)
        if host.ndim == 0 and np.issubdtype(host.dtype, np.integer):
            if not np.iinfo(np.int32).min <= int(host) <= np.iinfo(np.int32).max:
                return jnp.asarray(-1, jnp.int32)
    return jnp.asarray(value)


def _int32_ids(routes):
    """Integer ``routes`` as int32, every id outside ``[-1, 2**31)`` as :data:`OUT_OF_RANGE_ID`
    (compared in the ids' own width: concrete on the host, traced in their JAX dtype)."""
    if not isinstance(routes, jax.core.Tracer) and not isinstance(routes, jax.Array):
        host = np.asarray(routes)
        bad = (host < -1) | (host > np.iinfo(np.int32).max) if host.size else np.zeros((), bool)
        ids = np.full(host.shape, OUT_OF_RANGE_ID, np.int32)  # not np.where: NumPy 2.5 refuses
        ids[~bad] = host[~bad]  # OUT_OF_RANGE_ID in an unsigned dtype
        return jnp.asarray(ids)
    routes = jnp.asarray(routes)
    info = jnp.iinfo(routes.dtype)
    bad = jnp.zeros(routes.shape, bool)
    if info.min < -1:
        bad = bad | (routes < -1)
    if info.max > np.iinfo(np.int32).max:
        bad = bad | (routes > np.iinfo(np.int32).max)
    return jnp.where(bad, OUT_OF_RANGE_ID, routes.astype(jnp.int32))


def trace_from_routes(routes: Any, num_experts: int, *, num_layers: int | None = None,
                      source: str = "<recorded routes>") -> Trace:
    """Turn recorded routes into a trace (on the host, after the loop).

    Args:
      routes: one sequence's routes -- a :class:`RouteRecorder`, or an integer array ``[tokens,
        layers, ...]`` (a scan's stacked expert ids; the trailing dims, e.g. ``[B, k]``, are one
        call's routes) in which every (token, layer) is a call -- or several sequences: a list
        of them, or a dict from sequence name to them (the names become the trace's
        ``sequence_names``). Calls are token-major, then layer, sequence after sequence.
      num_experts: ``E``, experts per layer (every id must lie in ``[-1, E)``).
      num_layers: ``L`` when it exceeds the arrays' layer dimension (default: that dimension).
      source: label for messages.

    Returns:
      The trace (every sequence the same ``top_k``: the widest, narrower ones ``-1`` padded).

    Raises:
      TraceError: a recorder that dropped records, an array of rank below 2 or non-integer
        dtype, sequences with different layer counts, nothing recorded, or ids outside the
        geometry (as :class:`~pallas_cache.sizing.traces.Trace`).
    """
    if isinstance(routes, Mapping):
        names, parts = tuple(routes), list(routes.values())
    elif isinstance(routes, (list, tuple)):
        names, parts = tuple(range(len(routes))), list(routes)
    else:
        names, parts = (None,), [routes]
    if not parts:
        raise TraceError(f"{source}: no sequences")
    columns = [_calls(part, f"{source}[{name!r}]" if name is not None else source)
               for name, part in zip(names, parts)]
    layer_counts = {cols[3] for cols in columns}
    if len(layer_counts) > 1:
        raise TraceError(f"{source}: the sequences have different layer counts "
                         f"{sorted(layer_counts)}: record one model's routes")
    width = max(cols[0].shape[1] for cols in columns)
    routes_column = np.concatenate([np.pad(cols[0], ((0, 0), (0, width - cols[0].shape[1])),
                                           constant_values=-1) for cols in columns])
    return Trace(routes=routes_column,
                 layers=np.concatenate([cols[1] for cols in columns]),
                 num_layers=num_layers if num_layers is not None else layer_counts.pop(),
                 num_experts=num_experts,
                 token_idx=np.concatenate([cols[2] for cols in columns]),
                 sequence=np.concatenate([np.full(len(cols[1]), i, np.int32)
                                          for i, cols in enumerate(columns)]),
                 sequence_names=names, source=source)


def _calls(part: Any, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``(routes [C, K], layers [C], token_idx [C], L)`` of one sequence, token-major."""
    if isinstance(part, RouteRecorder):
        dropped = int(part.dropped)
        if dropped:
            raise TraceError(f"{where}: {dropped} record(s) fell outside the recorder's "
                             f"{part.written.shape[0]} tokens x {part.written.shape[1]} layers "
                             f"and were not written; init_recorder with more tokens")
        grid, written = np.asarray(part.routes), np.asarray(part.written)
        wide = (grid == OUT_OF_RANGE_ID) & written[..., None]
        if wide.any():
            token, layer, _ = (int(i) for i in np.argwhere(wide)[0])
            raise TraceError(f"{where}: token {token}, layer {layer}: an expert id outside "
                             f"[-1, 2**31) was recorded (stored as {OUT_OF_RANGE_ID}); expert "
                             f"ids are layer-local, in [-1, num_experts)")
    else:
        grid = np.asarray(part)
        if grid.ndim < 2 or not np.issubdtype(grid.dtype, np.integer):
            raise TraceError(f"{where}: expected integer routes [tokens, layers, ...], got "
                             f"{grid.dtype} {grid.shape}")
        grid = grid.reshape(grid.shape[0], grid.shape[1], -1)
        written = np.ones(grid.shape[:2], bool)
    tokens, layers = np.nonzero(written)  # row-major: token-major, then layer
    return grid[tokens, layers], layers.astype(np.int32), tokens.astype(np.int64), grid.shape[1]
