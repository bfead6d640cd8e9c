"""The routing trace type (:class:`Trace`); the error every trace reader raises is
:class:`~pallas_cache.sizing.traces.errors.TraceError`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from pallas_cache.sizing.traces.dense import dense_fields
from pallas_cache.sizing.traces.errors import TraceError
from pallas_cache.validate import is_int

__all__ = ["Trace"]


@dataclass(frozen=True, eq=False)
class Trace:
    """A routing trace: one row per MoE layer-call, in call order.

    Fields (arrays are converted on construction, validated, and made read-only):

    Attributes:
        routes: int32 ``[calls, top_k]``; layer-local expert ids in ``[0, num_experts)``, ``-1`` =
            padding route (ignored by the cache, docs/semantics.md §2).
        layers: int32 ``[calls]``; the layer each call routes, in ``[0, num_layers)``.
        num_layers: ``L``, the number of MoE layers of the model (layers that never appear are
            allowed: a trace may cover a subset).
        num_experts: ``E``, experts per layer.
        token_idx: int64 ``[calls]``; the token position of each call within its sequence, for
            reporting only (a replay does not read it). Defaults to ``0`` for every call.
        sequence: int32 ``[calls]``; index into ``sequence_names`` of each call's sequence.
            Defaults to ``0`` for every call.
        sequence_names: the sequence labels as they appeared in the source (a JSON string or
            integer, or ``None`` for records without a sequence key), in order of first
            appearance. Defaults to ``(None,)``.
        source: where the trace came from (a path, or a short description), used in messages.

    Raises:
        TraceError: if the arrays are inconsistent with each other or with the geometry, or the
            trace has no calls.
    """

    routes: np.ndarray
    layers: np.ndarray
    num_layers: int
    num_experts: int
    token_idx: np.ndarray | None = None
    sequence: np.ndarray | None = None
    sequence_names: tuple[Any, ...] = (None,)
    source: str = field(default="<in-memory trace>")

    def __post_init__(self) -> None:
        where = self.source
        num_layers = _positive_int(self.num_layers, "num_layers", TraceError, where)
        num_experts = _positive_int(self.num_experts, "num_experts", TraceError, where)

        routes = np.asarray(self.routes)
        if routes.ndim != 2:
            raise TraceError(f"{where}: field 'routes': expected a 2-D [calls, top_k] array, "
                             f"got shape {routes.shape}")
        if not np.issubdtype(routes.dtype, np.integer):
            raise TraceError(f"{where}: field 'routes': expected an integer array, got dtype "
                             f"{routes.dtype}")
        calls, top_k = routes.shape
        if calls == 0:
            raise TraceError(f"{where}: the trace is empty (no layer-calls)")
        if top_k == 0:
            raise TraceError(f"{where}: field 'routes': top_k is 0 (no route columns)")
        bad = (routes < -1) | (routes >= num_experts)
        if bad.any():
            call, col = (int(i) for i in np.argwhere(bad)[0])
            raise TraceError(f"{where}: field 'routes': expert {int(routes[call, col])} at call "
                             f"{call}, route {col} is outside [-1, {num_experts}) "
                             f"(num_experts={num_experts})")

        layers = np.asarray(self.layers)
        if layers.shape != (calls,):
            raise TraceError(f"{where}: field 'layers': expected shape ({calls},) to match "
                             f"routes, got {layers.shape}")
        if not np.issubdtype(layers.dtype, np.integer):
            raise TraceError(f"{where}: field 'layers': expected an integer array, got dtype "
                             f"{layers.dtype}")
        bad = (layers < 0) | (layers >= num_layers)
        if bad.any():
            call = int(np.argmax(bad))
            raise TraceError(f"{where}: field 'layers': layer {int(layers[call])} at call {call} "
                             f"is outside [0, {num_layers}) (num_layers={num_layers})")

        token_idx = (np.zeros(calls, np.int64) if self.token_idx is None
                     else np.asarray(self.token_idx))
        if token_idx.shape != (calls,) or not np.issubdtype(token_idx.dtype, np.integer):
            raise TraceError(f"{where}: field 'token_idx': expected an integer array of shape "
                             f"({calls},), got {token_idx.dtype} {token_idx.shape}")

        names = tuple(self.sequence_names)
        if not names:
            raise TraceError(f"{where}: field 'sequence_names': needs at least one name")
        sequence = (np.zeros(calls, np.int32) if self.sequence is None
                    else np.asarray(self.sequence))
        if sequence.shape != (calls,) or not np.issubdtype(sequence.dtype, np.integer):
            raise TraceError(f"{where}: field 'sequence': expected an integer array of shape "
                             f"({calls},), got {sequence.dtype} {sequence.shape}")
        if ((sequence < 0) | (sequence >= len(names))).any():
            raise TraceError(f"{where}: field 'sequence': indices must lie in "
                             f"[0, {len(names)}) (one per sequence name)")

        for name, value, dtype in (("routes", routes, np.int32), ("layers", layers, np.int32),
                                   ("token_idx", token_idx, np.int64),
                                   ("sequence", sequence, np.int32)):
            column = np.array(value, dtype=dtype, copy=True)
            column.setflags(write=False)
            object.__setattr__(self, name, column)
        object.__setattr__(self, "num_layers", num_layers)
        object.__setattr__(self, "num_experts", num_experts)
        object.__setattr__(self, "sequence_names", names)

    # ---- shape ---------------------------------------------------------------------------

    @property
    def top_k(self) -> int:
        """Route columns per call (``K``); shorter calls are ``-1`` padded."""
        return int(self.routes.shape[1])

    @property
    def num_calls(self) -> int:
        """Number of layer-calls (``C``); the replay's scan length."""
        return int(self.routes.shape[0])

    @property
    def num_tokens(self) -> int:
        """Number of distinct (sequence, token) pairs that made at least one call (the CLI first
        drops a sequence's trailing partial token: :meth:`without_partial_tokens`)."""
        pairs = np.stack([self.sequence.astype(np.int64), self.token_idx], axis=1)
        return int(np.unique(pairs, axis=0).shape[0])

    def __len__(self) -> int:
        return self.num_calls

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        """Yield ``(layer, routes)`` per call in call order; ``routes`` is int32 ``[top_k]``."""
        for layer, routes in zip(self.layers.tolist(), self.routes):
            yield layer, routes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return (self.num_layers == other.num_layers and self.num_experts == other.num_experts
                and self.sequence_names == other.sequence_names
                and np.array_equal(self.routes, other.routes)
                and np.array_equal(self.layers, other.layers)
                and np.array_equal(self.token_idx, other.token_idx)
                and np.array_equal(self.sequence, other.sequence))

    __hash__ = None  # type: ignore[assignment]  # mutable-looking arrays; compare, don't hash

    def __repr__(self) -> str:
        return (f"Trace(calls={self.num_calls}, num_layers={self.num_layers}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"sequences={len(self.sequence_names)}, source={self.source!r})")

    # ---- views for a replay --------------------------------------------------------------

    def to_array(self) -> tuple[np.ndarray, np.ndarray]:
        """The two arrays a replay scans over.

        Returns:
            ``(layers, routes)``: int32 ``[C]`` and int32 ``[C, K]`` (read-only views; copy before
            mutating). Feed them to ``lax.scan`` as ``xs=(layers, routes)``.
        """
        return self.layers, self.routes

    def flat_ids(self) -> np.ndarray:
        """Flat ids ``layer * E + expert`` per route (docs/semantics.md §2), ``-1`` where the route is padding.

        Returns:
            int64 ``[C, K]``.
        """
        flat = self.layers.astype(np.int64)[:, None] * self.num_experts + self.routes
        return np.where(self.routes >= 0, flat, -1)

    def routing_histogram(self) -> np.ndarray:
        """Routes per (layer, expert), duplicates counted, padding ignored (docs/semantics.md §5.2 step 9).

        This is what the cache's ``routing_freq`` would hold after replaying the whole trace with
        collection on.

        Returns:
            int64 ``[num_layers, num_experts]``.
        """
        flat = self.flat_ids()
        counts = np.bincount(flat[flat >= 0], minlength=self.num_layers * self.num_experts)
        return counts.astype(np.int64).reshape(self.num_layers, self.num_experts)

    def is_dense(self) -> bool:
        """Whether the trace is a full ``[tokens, layers, top_k]`` grid.

        True when it has one sequence and its calls are tokens ``0..T-1`` each calling layers
        ``0..L-1`` in order -- the shape :func:`save_trace` can store as ``.npy``/``.npz``.
        """
        calls, layers = self.num_calls, self.num_layers
        if len(self.sequence_names) != 1 or calls % layers:
            return False
        tokens = calls // layers
        return (np.array_equal(self.layers, np.tile(np.arange(layers), tokens))
                and np.array_equal(self.token_idx, np.repeat(np.arange(tokens), layers)))

    def without_partial_tokens(self) -> tuple["Trace", int, int]:
        """The trace without its sequences' trailing partial tokens, with how many tokens and
        calls that dropped: ``(trace, tokens, calls)``.

        A token is partial when its calls cover fewer distinct layers than the trace's calls do
        (a trace cut in the middle of a forward pass); only a sequence's last token is dropped
        so (a partial token elsewhere is kept: its calls happened between complete tokens).
        Per-token figures of the result divide by complete tokens. Unchanged (the same object,
        0, 0) when no last token is partial.
        """
        span = int(self.token_idx.max()) - int(self.token_idx.min()) + 1
        pair = self.sequence.astype(np.int64) * span + self.token_idx - int(self.token_idx.min())
        layers_of = np.unique(np.stack([pair, self.layers.astype(np.int64)], axis=1), axis=0)
        pairs, covered = np.unique(layers_of[:, 0], return_counts=True)
        partial = covered < np.unique(self.layers).size
        last = np.zeros(pairs.shape, bool)  # each sequence's last token (pairs are sorted)
        sequence_of = pairs // span
        last[:-1] = sequence_of[:-1] != sequence_of[1:]
        last[-1] = True
        dropped = pairs[partial & last]
        if not dropped.size:
            return self, 0, 0
        keep = ~np.isin(pair, dropped)
        if not keep.any():
            return self, 0, 0  # nothing complete to keep: the trace as it is
        trace = Trace(routes=self.routes[keep], layers=self.layers[keep],
                      num_layers=self.num_layers, num_experts=self.num_experts,
                      token_idx=self.token_idx[keep], sequence=self.sequence[keep],
                      sequence_names=self.sequence_names, source=self.source)
        return trace, int(dropped.size), int((~keep).sum())

    def to_dense(self) -> np.ndarray:
        """The trace as an int32 ``[tokens, layers, top_k]`` array (the ``.npy`` layout).

        Raises:
            TraceError: if the trace is not a full grid (see :meth:`is_dense`).
        """
        if not self.is_dense():
            raise TraceError(f"{self.source}: the trace is not a full [tokens, layers, top_k] "
                             f"grid (one sequence, every token calling layers 0..L-1 in order); "
                             f"store it as JSONL instead")
        return self.routes.reshape(-1, self.num_layers, self.top_k)

    @classmethod
    def from_dense(cls, routes: Any, *, num_layers: int | None = None,
                   num_experts: int | None = None, source: str = "<array>",
                   max_memory: int | None = None) -> "Trace":
        """Build a trace from an integer array ``[tokens, layers, top_k]`` (``-1`` = padding).

        Calls are token-major, then layer. Geometry is declared or inferred as in
        :func:`load_trace`.

        Args:
            routes: integer array-like ``[tokens, layers, top_k]``.
            num_layers: declared ``L`` (must be ``>=`` the array's layer dimension), or ``None``
                to use that dimension.
            num_experts: declared ``E``, or ``None`` to infer ``max expert + 1``.
            source: label for error messages.
            max_memory: as in :func:`load_trace` (the trace and its geometry's tables).

        Returns:
            The trace.

        Raises:
            TraceError: wrong dtype, rank, empty array, or a value outside the geometry.
        """
        return cls(**dense_fields(np.asarray(routes), num_layers=num_layers,
                                  num_experts=num_experts, where=source, field_name="routes",
                                  max_memory=max_memory))


def _positive_int(value: Any, name: str, error: type[Exception], where: str) -> int:
    if not is_int(value) or value < 1:
        raise error(f"{where}: {name} must be a positive integer, got {value!r}")
    return int(value)
