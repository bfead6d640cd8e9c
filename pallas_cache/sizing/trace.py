"""Routing traces: what a cache replay feeds on.

(Why one module of ~600 lines: most of it is input validation -- one precise, located message per
way a JSONL record or an array can be malformed -- and the readers funnel into the checks of the
:class:`Trace` constructor, so the type, its readers and their messages are read together.)

Sizing an expert cache means replaying what the router actually asked for. A *routing trace* is
that record: for every MoE layer-call, in the order the decode loop made them, the layer index and
the experts the router picked (docs/semantics.md §2: layer-local ids in ``[0, E)``, ``-1`` = padding route).

This module turns the formats traces come in into one dense, validated :class:`Trace`, because
the replay runs a ``lax.scan`` over calls and wants two plain arrays -- ``layers`` int32 ``[C]``
and ``routes`` int32 ``[C, K]`` -- not a ragged list of records. Everything here is NumPy; of
the cache it uses only the input validators (:mod:`pallas_cache.validate`).

Formats (:func:`load_trace` picks one from the file suffix):

* **JSONL** (``.jsonl``, ``.ndjson``): one JSON object per line and per (token, layer)::

      {"layer": 3, "token_idx": 17, "experts": [5, 1], "sequence": "prompt-42"}

  ``layer``, ``token_idx`` and ``experts`` are required; ``sequence`` (or, when absent,
  ``problem_id``) optionally names the sequence the token belongs to; any other key is ignored.
  Blank lines are skipped. Calls are ordered by sequence (in order of first appearance in the
  file), then ``token_idx`` ascending, then ``layer`` ascending -- the order a layer-by-layer
  decode loop makes them, whatever order the file was written in. A missing (token, layer) record
  is simply absent (no call); a record whose ``experts`` list is shorter than the longest one is
  padded with ``-1``.
* **NumPy** (``.npy``, or ``.npz`` with an array named ``routes`` or ``experts``, else its first
  array): an integer array ``[tokens, layers, top_k]`` with ``-1`` padding, read token-major then
  layer. Every cell is a call, including one that is all padding (it is a call with no active
  expert, as an empty batch would be).

Geometry (``num_layers``, ``num_experts``) is either declared by the caller -- then every value
is checked against it -- or inferred as ``max + 1`` of what the trace contains (for an array, the
layer count is its second dimension).

Malformed input never escapes as a bare ``json``/``numpy`` traceback: it raises
:class:`TraceError` (a ``ValueError``) whose message names the file, the line (JSONL) or array
index (NumPy), and the offending field, so a user can fix the trace without reading this code.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from pallas_cache.validate import INT32_MAX, is_int

__all__ = [
    "Trace",
    "TraceError",
    "load_trace",
    "load_jsonl_trace",
    "load_array_trace",
    "save_trace",
    "JSONL_SUFFIXES",
    "ARRAY_SUFFIXES",
]

#: File suffixes read as one-record-per-line JSON.
JSONL_SUFFIXES = (".jsonl", ".ndjson")
#: File suffixes read as a dense ``[tokens, layers, top_k]`` integer array.
ARRAY_SUFFIXES = (".npy", ".npz")

#: Keys that name a record's sequence, in order of precedence.
SEQUENCE_KEYS = ("sequence", "problem_id")
#: Array names an ``.npz`` is searched for, in order, before falling back to its first array.
NPZ_ROUTE_KEYS = ("routes", "experts")

_TOKEN_MAX = 2**62


class TraceError(ValueError):
    """A trace file or trace array that cannot be read as a routing trace.

    The message says where (file, line or array index) and what (the field and the value), e.g.
    ``"trace.jsonl:12: field 'experts': expert 9 is outside [-1, 8) (num_experts=8)"``.
    """


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
            array = np.array(value, dtype=dtype, copy=True)
            array.setflags(write=False)
            object.__setattr__(self, name, array)
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
        """Number of distinct (sequence, token) pairs that made at least one call."""
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
                   num_experts: int | None = None, source: str = "<array>") -> "Trace":
        """Build a trace from an integer array ``[tokens, layers, top_k]`` (``-1`` = padding).

        Calls are token-major, then layer. Geometry is declared or inferred as in
        :func:`load_trace`.

        Args:
            routes: integer array-like ``[tokens, layers, top_k]``.
            num_layers: declared ``L`` (must be ``>=`` the array's layer dimension), or ``None``
                to use that dimension.
            num_experts: declared ``E``, or ``None`` to infer ``max expert + 1``.
            source: label for error messages.

        Returns:
            The trace.

        Raises:
            TraceError: wrong dtype, rank, empty array, or a value outside the geometry.
        """
        return _trace_from_dense(np.asarray(routes), num_layers=num_layers,
                                 num_experts=num_experts, where=source, field_name="routes")


# ---- loading ---------------------------------------------------------------------------------


def load_trace(path: str | os.PathLike, *, num_layers: int | None = None,
               num_experts: int | None = None) -> Trace:
    """Read a routing trace file; the format follows the suffix (see the module docstring).

    Args:
        path: a ``.jsonl``/``.ndjson`` or ``.npy``/``.npz`` file.
        num_layers: declared ``L``; every layer in the trace must be below it. ``None``: infer.
        num_experts: declared ``E``; every expert must lie in ``[-1, E)``. ``None``: infer
            ``max expert + 1``.

    Returns:
        The trace, calls in replay order.

    Raises:
        TraceError: unknown suffix, unreadable file, malformed content, or an empty trace.
        ValueError: a declared geometry that is not a positive integer.
    """
    path_str = os.fspath(path)
    suffix = os.path.splitext(path_str)[1].lower()
    if suffix in JSONL_SUFFIXES:
        return load_jsonl_trace(path_str, num_layers=num_layers, num_experts=num_experts)
    if suffix in ARRAY_SUFFIXES:
        return load_array_trace(path_str, num_layers=num_layers, num_experts=num_experts)
    raise TraceError(f"{path_str}: unknown trace format {suffix or '(no suffix)'!r}; expected "
                     f"one of {', '.join(JSONL_SUFFIXES + ARRAY_SUFFIXES)}")


def load_jsonl_trace(path: str | os.PathLike, *, num_layers: int | None = None,
                     num_experts: int | None = None) -> Trace:
    """Read a JSONL trace (one ``{"layer", "token_idx", "experts"}`` record per line).

    Args and Returns: as :func:`load_trace`.

    Raises:
        TraceError: with ``file:line: field 'name': ...`` for a line that is not a JSON object,
            lacks a required key, holds a value of the wrong type (``bool`` and ``3.0`` are not
            integers), a negative layer or ``token_idx``, a layer ``>= num_layers`` (declared),
            an expert outside ``[-1, num_experts)`` (declared; ``< -1`` always), or repeats a
            (sequence, token, layer) already seen; and for a file with no records.
    """
    path_str = os.fspath(path)
    declared_layers = _optional_positive_int(num_layers, "num_layers")
    declared_experts = _optional_positive_int(num_experts, "num_experts")

    sequence_index: dict[Any, int] = {}
    seq_of: list[int] = []
    token_of: list[int] = []
    layer_of: list[int] = []
    experts_of: list[list[int]] = []
    line_of: list[int] = []

    try:
        handle = open(path_str, "rb")
    except OSError as exc:
        raise TraceError(f"{path_str}: cannot open trace file: {exc.strerror or exc}") from exc
    with handle:
        for line_no, raw in enumerate(handle, start=1):
            where = f"{path_str}:{line_no}"
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON: {exc.msg} at column "
                                 f"{exc.colno}") from None
            except (ValueError, RecursionError) as exc:  # UnicodeDecodeError, deep nesting
                raise TraceError(f"{where}: not valid JSON: {exc}") from None
            if not isinstance(record, dict):
                raise TraceError(f"{where}: expected a JSON object per line, got "
                                 f"{type(record).__name__}")

            layer = _record_int(record, "layer", where)
            if layer < 0:
                raise TraceError(f"{where}: field 'layer': layer {layer} is negative")
            if declared_layers is not None and layer >= declared_layers:
                raise TraceError(f"{where}: field 'layer': layer {layer} is outside "
                                 f"[0, {declared_layers}) (num_layers={declared_layers})")
            if layer > INT32_MAX - 1:
                raise TraceError(f"{where}: field 'layer': layer {layer} does not fit int32")
            token = _record_int(record, "token_idx", where)
            if token < 0:
                raise TraceError(f"{where}: field 'token_idx': token_idx {token} is negative")
            if token > _TOKEN_MAX:
                raise TraceError(f"{where}: field 'token_idx': token_idx {token} is too large "
                                 f"(limit 2**62)")

            experts = record.get("experts", _MISSING)
            if experts is _MISSING:
                raise TraceError(f"{where}: field 'experts': missing (required keys: 'layer', "
                                 f"'token_idx', 'experts')")
            if not isinstance(experts, list):
                raise TraceError(f"{where}: field 'experts': expected a list of integers, got "
                                 f"{type(experts).__name__} {_short(experts)}")
            for position, expert in enumerate(experts):
                if not is_int(expert):
                    raise TraceError(f"{where}: field 'experts': entry {position} is "
                                     f"{_short(expert)}, expected an integer expert id")
                if expert < -1:
                    raise TraceError(f"{where}: field 'experts': expert {expert} is below -1 "
                                     f"(-1 is the only padding value)")
                if declared_experts is not None and expert >= declared_experts:
                    raise TraceError(f"{where}: field 'experts': expert {expert} is outside "
                                     f"[-1, {declared_experts}) (num_experts={declared_experts})")
                if expert > INT32_MAX - 1:
                    raise TraceError(f"{where}: field 'experts': expert {expert} does not fit "
                                     f"int32")

            label = None
            for key in SEQUENCE_KEYS:
                if key in record and record[key] is not None:
                    label = record[key]
                    if not (isinstance(label, str) or is_int(label)):
                        raise TraceError(f"{where}: field {key!r}: expected a string or integer "
                                         f"sequence label, got {_short(label)}")
                    break
            seq_of.append(sequence_index.setdefault(label, len(sequence_index)))
            token_of.append(token)
            layer_of.append(layer)
            experts_of.append(experts)
            line_of.append(line_no)

    if not line_of:
        raise TraceError(f"{path_str}: the trace is empty (no records)")

    # Replay order: sequence (first appearance), token ascending, layer ascending.
    seq_arr = np.asarray(seq_of, dtype=np.int64)
    token_arr = np.asarray(token_of, dtype=np.int64)
    layer_arr = np.asarray(layer_of, dtype=np.int64)
    order = np.lexsort((layer_arr, token_arr, seq_arr))
    seq_arr, token_arr, layer_arr = seq_arr[order], token_arr[order], layer_arr[order]
    same = ((seq_arr[1:] == seq_arr[:-1]) & (token_arr[1:] == token_arr[:-1])
            & (layer_arr[1:] == layer_arr[:-1]))
    if same.any():
        first = int(np.argmax(same))
        lines = sorted((line_of[order[first]], line_of[order[first + 1]]))
        raise TraceError(f"{path_str}:{lines[1]}: field 'layer': duplicate record for token_idx "
                         f"{token_arr[first]}, layer {layer_arr[first]} (first seen on line "
                         f"{lines[0]})")

    top_k = max(len(e) for e in experts_of)
    if top_k == 0:
        raise TraceError(f"{path_str}: field 'experts': every record has an empty list (no "
                         f"routes to replay)")
    routes = np.full((len(order), top_k), -1, dtype=np.int64)
    for row, record_index in enumerate(order.tolist()):
        experts = experts_of[record_index]
        routes[row, :len(experts)] = experts

    inferred_layers = int(layer_arr.max()) + 1
    inferred_experts = int(routes.max()) + 1
    if declared_experts is None and inferred_experts < 1:
        raise TraceError(f"{path_str}: field 'experts': every route is padding (-1), so "
                         f"num_experts cannot be inferred; pass num_experts=")
    return Trace(routes=routes, layers=layer_arr,
                 num_layers=declared_layers if declared_layers is not None else inferred_layers,
                 num_experts=(declared_experts if declared_experts is not None
                              else inferred_experts),
                 token_idx=token_arr, sequence=seq_arr,
                 sequence_names=tuple(sequence_index), source=path_str)


def load_array_trace(path: str | os.PathLike, *, num_layers: int | None = None,
                     num_experts: int | None = None) -> Trace:
    """Read a ``.npy``/``.npz`` trace: an integer array ``[tokens, layers, top_k]``.

    For ``.npz`` the array named ``routes`` is used, else ``experts``, else the first array in
    the archive. Pickled (object) arrays are refused.

    Args and Returns: as :func:`load_trace`.

    Raises:
        TraceError: unreadable file, empty archive, non-integer dtype, a rank other than 3, an
            empty array, a layer dimension above a declared ``num_layers``, or an expert outside
            ``[-1, num_experts)`` (the message gives its ``[token, layer, k]`` index).
    """
    path_str = os.fspath(path)
    declared_layers = _optional_positive_int(num_layers, "num_layers")
    declared_experts = _optional_positive_int(num_experts, "num_experts")
    try:
        loaded = np.load(path_str, allow_pickle=False)
    except FileNotFoundError as exc:
        raise TraceError(f"{path_str}: cannot open trace file: {exc.strerror or exc}") from exc
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise TraceError(f"{path_str}: not a readable NumPy .npy/.npz file: {exc}") from None
    if isinstance(loaded, np.lib.npyio.NpzFile):
        with loaded:
            names = list(loaded.files)
            if not names:
                raise TraceError(f"{path_str}: the .npz archive holds no arrays")
            key = next((k for k in NPZ_ROUTE_KEYS if k in names), names[0])
            try:
                array = loaded[key]
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
                raise TraceError(f"{path_str}: array {key!r} cannot be read: {exc}") from None
    else:
        key, array = "routes", loaded
    return _trace_from_dense(array, num_layers=declared_layers, num_experts=declared_experts,
                             where=path_str, field_name=key)


def _trace_from_dense(array: np.ndarray, *, num_layers: int | None, num_experts: int | None,
                      where: str, field_name: str) -> Trace:
    """Validate a ``[tokens, layers, top_k]`` array and flatten it into a token-major trace."""
    declared_layers = _optional_positive_int(num_layers, "num_layers")
    declared_experts = _optional_positive_int(num_experts, "num_experts")
    label = f"{where}: array {field_name!r}"
    if not np.issubdtype(array.dtype, np.integer):
        raise TraceError(f"{label}: expected an integer array of expert ids, got dtype "
                         f"{array.dtype}")
    if array.ndim != 3:
        raise TraceError(f"{label}: expected shape [tokens, layers, top_k], got "
                         f"{array.ndim}-D shape {array.shape}")
    tokens, layers, top_k = array.shape
    if array.size == 0:
        raise TraceError(f"{label}: the trace is empty (shape {array.shape})")
    if declared_layers is not None and layers > declared_layers:
        raise TraceError(f"{label}: {layers} layers in the array but num_layers="
                         f"{declared_layers} was declared")
    values = array.astype(np.int64)
    limit = declared_experts if declared_experts is not None else INT32_MAX
    bad = (values < -1) | (values >= limit)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        value = int(values[index])
        bound = (f"[-1, {declared_experts}) (num_experts={declared_experts})"
                 if declared_experts is not None else "[-1, 2**31 - 1)")
        raise TraceError(f"{label}[token={index[0]}, layer={index[1]}, k={index[2]}]: expert "
                         f"{value} is outside {bound}")
    inferred_experts = int(values.max()) + 1
    if declared_experts is None and inferred_experts < 1:
        raise TraceError(f"{label}: every route is padding (-1), so num_experts cannot be "
                         f"inferred; pass num_experts=")
    return Trace(routes=values.reshape(tokens * layers, top_k),
                 layers=np.tile(np.arange(layers, dtype=np.int32), tokens),
                 num_layers=declared_layers if declared_layers is not None else layers,
                 num_experts=(declared_experts if declared_experts is not None
                              else inferred_experts),
                 token_idx=np.repeat(np.arange(tokens, dtype=np.int64), layers),
                 source=where)


# ---- saving ----------------------------------------------------------------------------------


def save_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Write a trace in the format its suffix names; :func:`load_trace` reads it back equal.

    JSONL writes one record per call (``sequence`` only when the trace has named sequences; the
    ``experts`` list keeps its ``-1`` padding so ``top_k`` survives the round trip). ``.npy`` and
    ``.npz`` (array ``routes``) need a full grid (:meth:`Trace.is_dense`); the declared geometry
    is not stored in them, so pass ``num_layers``/``num_experts`` when loading if the trace does
    not reach them.

    Args:
        trace: the trace to write.
        path: destination; the suffix picks the format.

    Raises:
        TraceError: unknown suffix, or a non-grid trace written as an array.
    """
    path_str = os.fspath(path)
    suffix = os.path.splitext(path_str)[1].lower()
    if suffix in JSONL_SUFFIXES:
        named = trace.sequence_names != (None,)
        with open(path_str, "w", encoding="utf-8") as handle:
            for seq, token, layer, routes in zip(trace.sequence.tolist(),
                                                  trace.token_idx.tolist(),
                                                  trace.layers.tolist(), trace.routes.tolist()):
                record: dict[str, Any] = {}
                if named:
                    record["sequence"] = trace.sequence_names[seq]
                record.update(token_idx=token, layer=layer, experts=routes)
                handle.write(json.dumps(record, separators=(",", ":")) + "\n")
    elif suffix == ".npy":
        np.save(path_str, trace.to_dense())
    elif suffix == ".npz":
        np.savez_compressed(path_str, routes=trace.to_dense())
    else:
        raise TraceError(f"{path_str}: unknown trace format {suffix or '(no suffix)'!r}; "
                         f"expected one of {', '.join(JSONL_SUFFIXES + ARRAY_SUFFIXES)}")


# ---- small helpers ---------------------------------------------------------------------------

_MISSING = object()


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _record_int(record: dict, key: str, where: str) -> int:
    if key not in record:
        raise TraceError(f"{where}: field {key!r}: missing (required keys: 'layer', "
                         f"'token_idx', 'experts')")
    value = record[key]
    if not is_int(value):
        raise TraceError(f"{where}: field {key!r}: expected an integer, got "
                         f"{type(value).__name__} {_short(value)}")
    return value


def _positive_int(value: Any, name: str, error: type[Exception], where: str) -> int:
    if not is_int(value) or value < 1:
        raise error(f"{where}: {name} must be a positive integer, got {value!r}")
    return int(value)


def _optional_positive_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    return int(value)
