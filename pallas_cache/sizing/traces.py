"""Routing traces: what a cache replay feeds on.

Sizing an expert cache means replaying what the router actually asked for. A *routing trace* is
that record: for every MoE layer-call, in the order the decode loop made them, the layer index and
the experts the router picked (docs/semantics.md §2: layer-local ids in ``[0, E)``, ``-1`` = padding route).

This module turns the formats traces come in into one dense, validated :class:`Trace`, because
the replay runs a ``lax.scan`` over calls and wants two plain arrays -- ``layers`` int32 ``[C]``
and ``routes`` int32 ``[C, K]`` -- not a ragged list of records. Everything here is NumPy; it
does not import the cache.

Formats (:func:`load_trace` picks one from the file suffix, or takes ``trace_format=``):

* **JSONL** (``.jsonl``, ``.ndjson``): one JSON object per line and per (token, layer)::

      {"layer": 3, "token_idx": 17, "experts": [5, 1], "sequence": "prompt-42"}

  ``layer``, ``token_idx`` and ``experts`` are required; ``sequence`` (or, when absent,
  ``problem_id``) optionally names the sequence the token belongs to; any other key is ignored.
  Blank (whitespace-only) lines are skipped, however long; a line with a record may hold at most
  :data:`MAX_LINE_BYTES`. Calls are ordered by sequence (in order of first appearance in the
  file), then ``token_idx`` ascending, then ``layer`` ascending -- the order a layer-by-layer
  decode loop makes them, whatever order the file was written in. A missing (token, layer) record
  is simply absent (no call); a record whose ``experts`` list is shorter than the longest one is
  padded with ``-1``.
  Gzip-compressed JSONL (``.jsonl.gz``, or any JSONL file whose first bytes are the gzip magic)
  is read transparently.
* **NumPy** (``.npy``, or ``.npz``): integer arrays ``[tokens, layers, top_k]`` with ``-1``
  padding, read token-major then layer. An ``.npz`` holds one sequence per array (named after it,
  in archive order). Every cell is a call, including one that is all padding (it is a call with
  no active expert, as an empty batch would be).
* **vLLM routed experts** (a directory of ``.npy`` files, or ``trace_format="vllm"`` for an
  ``.npz``/``.npy``): the same layout, one int16 ``[gen_len, layers, top_k]`` array per request
  (:func:`load_vllm_trace`), every request one sequence with the same layers and ``top_k``.
* **Parquet** (``.parquet``, ``.pq``; needs ``pyarrow``): the JSONL records as columns
  (:mod:`pallas_cache.sizing.parquet`).

Geometry (``num_layers``, ``num_experts``) is either declared by the caller -- then every value
is checked against it -- or inferred as ``max + 1`` of what the trace contains (for an array, the
layer count is its second dimension); an inferred size set by one outlier id far above the rest
is refused (:data:`OUTLIER_RATIO`). Hostile sizes cannot eat the machine: the bytes of every dense
array (the trace's own, and the per-expert tables its geometry sizes downstream) are estimated
from the records or the ``.npy`` headers before anything is allocated, and a size above the memory
limit (``max_memory``, default :func:`default_memory_limit`) raises :class:`MemoryLimitError`
naming the line or array that set it.

Malformed input never escapes as a bare ``json``/``numpy`` traceback: it raises
:class:`TraceError` (a ``ValueError``) whose message names the file, the line (JSONL) or array
index (NumPy), and the offending field, so a user can fix the trace without reading this code.

(Why one module of ~1,250 lines: most of it is input validation -- one located message per way
a JSONL record, a gzip stream or an array header can be malformed or hostile, and the memory
estimate made before any allocation -- and every reader funnels into the same checks
(:func:`trace_from_records` for records, the :class:`Trace` constructor for all), so the type,
its readers and their messages are read together. Formats that need an optional dependency
live in a module of their own behind :func:`load_trace` (:mod:`pallas_cache.sizing.parquet`);
the next split, if this one grows, is the JSONL and array readers likewise.)
"""

from __future__ import annotations

import array
import gzip
import json
import lzma
import os
import re
import tokenize
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from pallas_cache.validate import INT32_MAX, is_int

__all__ = [
    "Trace",
    "TraceError",
    "load_trace",
    "load_jsonl_trace",
    "parse_fields",
    "load_array_trace",
    "load_vllm_trace",
    "trace_from_records",
    "trace_format_of",
    "save_trace",
    "JSONL_SUFFIXES",
    "ARRAY_SUFFIXES",
    "PARQUET_SUFFIXES",
    "TRACE_FORMATS",
    "MemoryLimitError",
    "default_memory_limit",
    "resolve_memory_limit",
    "check_memory",
    "trace_bytes",
    "format_bytes",
]

#: File suffixes read as one-record-per-line JSON.
JSONL_SUFFIXES = (".jsonl", ".ndjson")
#: File suffixes read as a dense ``[tokens, layers, top_k]`` integer array.
ARRAY_SUFFIXES = (".npy", ".npz")
#: File suffixes read as Parquet (``pyarrow``: the ``parquet`` extra).
PARQUET_SUFFIXES = (".parquet", ".pq")
#: What ``trace_format=`` (``--trace-format``) names; ``"auto"`` picks one by :func:`trace_format_of`.
TRACE_FORMATS = ("jsonl", "array", "vllm", "parquet")

#: Keys that name a record's sequence, in order of precedence.
SEQUENCE_KEYS = ("sequence", "problem_id")

#: The JSONL record keys a file may name otherwise (:func:`parse_fields`, ``--field``).
FIELD_KEYS = ("layer", "token_idx", "experts", "sequence")

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
        return _trace_from_dense(np.asarray(routes), num_layers=num_layers,
                                 num_experts=num_experts, where=source, field_name="routes",
                                 max_memory=max_memory)


# ---- memory budget ---------------------------------------------------------------------------

#: Share of the machine's physical memory the default limit lets one trace (and the tables its
#: geometry sizes) take.
DEFAULT_MEMORY_FRACTION = 0.5
#: The limit when the machine's memory cannot be read.
FALLBACK_MEMORY_LIMIT = 4 * 2**30
#: Bytes a replay holds per flat id (layer, expert) however short the trace: one cache state's four
#: int32 ``[L, E]`` tables (slot map, recency, routing histogram, prefill snapshot) and the int64
#: ``[L, E]`` histograms of the bounds and reports. A floor, used to refuse a geometry before any
#: of them is allocated.
BYTES_PER_FLAT_ID = 32
#: Outlier rule for inferred geometry: the largest id ``m`` (layer or expert) is refused when
#: ``m >= OUTLIER_FLOOR`` and ``m + 1 > OUTLIER_RATIO * (n + 1)``, ``n`` being the next distinct
#: largest id (``-1`` when there is none), i.e. when the size it implies is more than 4x the size
#: the rest of the trace implies. Declaring the geometry skips the rule.
OUTLIER_RATIO = 4
OUTLIER_FLOOR = 1024
#: Longest JSONL line read (a record with ~100k experts); a longer "line" is not a record.
#: Whitespace is not counted against it: a blank stretch of any length is skipped.
MAX_LINE_BYTES = 1 << 20
#: Bytes a JSONL reader decodes at a time (its blank lines are skipped a block at a time).
_BLOCK_BYTES = 1 << 20
#: What ``bytes.strip()`` removes: a line of only these is blank.
_BLANK_BYTES = b" \t\n\r\x0b\x0c"
_BLANK_RUN = re.compile(rb"[ \t\n\r\x0b\x0c]*")
#: Bytes per call a JSONL reader holds before the dense arrays exist (sequence, token, layer,
#: line, expert count), plus 4 per expert.
_RECORD_BYTES = 28
_GZIP_MAGIC = b"\x1f\x8b"
_ZIP_MAGIC = b"PK"
#: What a corrupt or hostile file can raise while being read (gzip, zip, npy header parsing).
_READ_ERRORS = (OSError, EOFError, ValueError, TypeError, SyntaxError, RecursionError,
                OverflowError, zipfile.BadZipFile, zlib.error, lzma.LZMAError,
                tokenize.TokenError, NotImplementedError, RuntimeError)


class MemoryLimitError(TraceError):
    """A trace, or the tables its geometry sizes, would need more memory than the limit allows.

    Raised before the array is allocated; the message names the file and the line (JSONL) or
    array (NumPy) that set the size, the estimate and the limit.
    """


def default_memory_limit() -> int:
    """The default memory limit: :data:`DEFAULT_MEMORY_FRACTION` of the physical memory.

    Read from ``os.sysconf`` (else ``/proc/meminfo``); :data:`FALLBACK_MEMORY_LIMIT` when neither
    answers.
    """
    total = 0
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    if total <= 0:
        try:
            with open("/proc/meminfo", encoding="ascii") as handle:
                for line in handle:
                    if line.startswith("MemTotal:"):
                        total = int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            total = 0
    return int(total * DEFAULT_MEMORY_FRACTION) if total > 0 else FALLBACK_MEMORY_LIMIT


def resolve_memory_limit(max_memory: int | None) -> int:
    """``None`` -> :func:`default_memory_limit`; else ``max_memory`` bytes (a positive int)."""
    if max_memory is None:
        return default_memory_limit()
    if isinstance(max_memory, bool) or not isinstance(max_memory, (int, np.integer)) \
            or max_memory < 1:
        raise ValueError(f"max_memory must be a positive number of bytes or None, got "
                         f"{max_memory!r}")
    return int(max_memory)


def format_bytes(nbytes: int) -> str:
    """``1536`` -> ``'1.5 KiB'``: a byte count for messages."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def trace_bytes(calls: int, top_k: int) -> int:
    """Bytes of a :class:`Trace`'s arrays: routes int32 ``[C, K]``, layers, sequence (int32) and
    token_idx (int64) ``[C]``."""
    return int(calls) * (4 * int(top_k) + 16)


def check_memory(nbytes: int, limit: int, where: str, what: str) -> None:
    """Raise :class:`MemoryLimitError` (``"{where}: {what} would need about ..."``) when
    ``nbytes > limit``."""
    if nbytes > limit:
        raise MemoryLimitError(f"{where}: {what} would need about {format_bytes(nbytes)}, above "
                               f"the memory limit of {format_bytes(limit)} (raise it with "
                               f"max_memory= or --max-memory)")


def _check_geometry(num_layers: int, num_experts: int, limit: int, where: str,
                    declared: str) -> None:
    check_memory(num_layers * num_experts * BYTES_PER_FLAT_ID, limit, where,
                 f"the geometry {num_layers} layers x {num_experts} experts{declared} (per-expert "
                 f"tables of {num_layers * num_experts} entries)")


def _check_outlier(kind: str, largest: int, next_largest: int, where: str) -> None:
    """Refuse an inferred size set by one id far above the rest (see :data:`OUTLIER_RATIO`)."""
    if largest >= OUTLIER_FLOOR and largest + 1 > OUTLIER_RATIO * (next_largest + 1):
        rest = (f"the next largest {kind} is {next_largest}" if next_largest >= 0
                else f"no other {kind} id occurs")
        raise TraceError(f"{where}: field {kind + 's' if kind == 'expert' else kind!r}: {kind} "
                         f"{largest} is an outlier ({rest}); inferring num_{kind}s="
                         f"{largest + 1} from it would size every per-{kind} table by this one "
                         f"id. Pass num_{kind}s= (--num-{kind}s) if it is real")


def _next_largest(values: np.ndarray, largest: int) -> int:
    below = values[values < largest]
    return int(below.max()) if below.size else -1


# ---- loading ---------------------------------------------------------------------------------


def trace_format_of(path: str | os.PathLike) -> str:
    """The format :func:`load_trace` reads ``path`` as: a directory is ``"vllm"``, else the
    suffix decides (``.jsonl``/``.ndjson``, gzipped or not: ``"jsonl"``; ``.npy``/``.npz``:
    ``"array"``; ``.parquet``/``.pq``: ``"parquet"``).

    Raises:
        TraceError: an unknown suffix.
    """
    path_str = os.fspath(path)
    if os.path.isdir(path_str):
        return "vllm"
    name = path_str.lower()
    gzipped = name.endswith(".gz")
    suffix = os.path.splitext(name[:-3] if gzipped else name)[1]
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in ARRAY_SUFFIXES and not gzipped:
        return "array"
    if suffix in PARQUET_SUFFIXES and not gzipped:
        return "parquet"
    raise TraceError(f"{path_str}: unknown trace format {suffix or '(no suffix)'!r}; expected "
                     f"one of {', '.join(JSONL_SUFFIXES + ARRAY_SUFFIXES + PARQUET_SUFFIXES)} "
                     f"(JSONL may be gzipped: .jsonl.gz) or a directory of vLLM .npy files, or "
                     f"name the format (--trace-format)")


def load_trace(path: str | os.PathLike, *, num_layers: int | None = None,
               num_experts: int | None = None, max_memory: int | None = None,
               fields: Mapping[str, str] | None = None, trace_format: str = "auto",
               progress: Callable[[int, int], None] | None = None) -> Trace:
    """Read a routing trace file; the format follows the suffix (see the module docstring).

    Args:
        path: a ``.jsonl``/``.ndjson`` (optionally gzip-compressed, ``.jsonl.gz``),
            ``.npy``/``.npz`` or ``.parquet`` file, or a directory of vLLM ``.npy`` files.
        num_layers: declared ``L``; every layer in the trace must be below it. ``None``: infer.
        num_experts: declared ``E``; every expert must lie in ``[-1, E)``. ``None``: infer
            ``max expert + 1`` (refusing an outlier, see :data:`OUTLIER_RATIO`).
        max_memory: bytes the trace and the tables its geometry sizes may take; ``None``:
            :func:`default_memory_limit`.
        fields: JSONL and Parquet only: the file's names of the record keys, ``{"layer":
            "layer_idx", "experts": "topk_ids"}`` (see :func:`parse_fields`); unnamed keys keep
            their names.
        trace_format: ``"auto"`` (:func:`trace_format_of`) or one of :data:`TRACE_FORMATS`:
            ``"jsonl"``, ``"array"`` (:func:`load_array_trace`), ``"vllm"``
            (:func:`load_vllm_trace`) or ``"parquet"``
            (:func:`pallas_cache.sizing.parquet.load_parquet_trace`, needs ``pyarrow``).
        progress: JSONL only: called as ``progress(bytes of the file read, file size)`` while
            the file is read (after every block of :data:`_BLOCK_BYTES` decoded bytes).

    Returns:
        The trace, calls in replay order.

    Raises:
        TraceError: ``fields`` for an array file, unknown suffix, unreadable file, malformed content, an empty trace, an
            outlier id, or (:class:`MemoryLimitError`) a size above ``max_memory``.
        ValueError: a declared geometry or limit that is not a positive integer, an unknown
            ``trace_format``, or (Parquet) ``pyarrow`` missing.
    """
    path_str = os.fspath(path)
    if trace_format not in ("auto",) + TRACE_FORMATS:
        raise ValueError(f"unknown trace format {trace_format!r}; expected auto or one of "
                         f"{', '.join(TRACE_FORMATS)}")
    kind = trace_format_of(path_str) if trace_format == "auto" else trace_format
    geometry = dict(num_layers=num_layers, num_experts=num_experts, max_memory=max_memory)
    if kind == "jsonl":
        return load_jsonl_trace(path_str, fields=fields, progress=progress, **geometry)
    if kind == "parquet":
        from pallas_cache.sizing.parquet import load_parquet_trace  # pyarrow: optional

        return load_parquet_trace(path_str, fields=fields, **geometry)
    if fields:
        raise TraceError(f"{path_str}: field names apply to JSONL and Parquet traces only")
    if kind == "vllm":
        return load_vllm_trace(path_str, **geometry)
    return load_array_trace(path_str, **geometry)


def _numbered_lines(path_str: str,
                    progress: Callable[[int, int], None] | None = None
                    ) -> Iterator[tuple[int, bytes]]:
    """Yield ``(line number, raw line)`` of every line that is not blank (whitespace only, as
    ``bytes.strip`` sees it); gzip input is recognised by its magic bytes.

    The file is read in blocks of :data:`_BLOCK_BYTES`; a run of blank lines is counted and
    skipped inside a block (C-level scans), so blank content costs no Python per line, and a
    whitespace-only stretch is not held (only a line with a record counts towards
    :data:`MAX_LINE_BYTES`). ``progress(bytes of the file read, file size)`` is called after
    every block and once at the end.
    """
    try:
        handle = open(path_str, "rb")
    except OSError as exc:
        raise TraceError(f"{path_str}: cannot open trace file: {exc.strerror or exc}") from exc
    with handle:
        try:
            compressed = handle.read(2) == _GZIP_MAGIC
            handle.seek(0)
            size = os.fstat(handle.fileno()).st_size
        except OSError as exc:
            raise TraceError(f"{path_str}: cannot read trace file: {exc.strerror or exc}") from exc
        stream = gzip.GzipFile(fileobj=handle, mode="rb") if compressed else handle

        def too_long(line_no):
            return TraceError(f"{path_str}:{line_no}: line is longer than {MAX_LINE_BYTES} "
                              f"bytes; not a routing record")

        line_no = 1  # the line `pending` is on
        pending = b""  # the start of that line, not yet ended by a newline
        dropped = 0  # whitespace at that line's start not kept in `pending` (past the limit)
        while True:
            try:  # read1: what a truncated stream decodes is still yielded before its error
                block = stream.read1(_BLOCK_BYTES)
            except _READ_ERRORS as exc:
                kind = "gzip data" if compressed else "trace file"
                raise TraceError(f"{path_str}:{line_no}: cannot read {kind}: {exc}") from None
            if progress is not None:
                progress(size if not block else min(handle.tell(), size), size)
            if not block:
                if pending.strip():
                    if dropped + len(pending) > MAX_LINE_BYTES:
                        raise too_long(line_no)
                    yield line_no, pending
                return
            if not block.translate(None, _BLANK_BYTES) and not pending.strip():  # all blank
                newlines = block.count(b"\n")
                if newlines:
                    line_no += newlines
                    pending, dropped = block[block.rfind(b"\n") + 1:], 0
                else:
                    pending += block
                if dropped + len(pending) > MAX_LINE_BYTES:
                    dropped, pending = dropped + len(pending), b""
                continue
            buffer = pending + block
            pos, end = 0, len(buffer)
            while True:
                first = _BLANK_RUN.match(buffer, pos).end()  # the first non-blank byte
                newline = buffer.rfind(b"\n", pos, first)
                if newline >= 0:  # whole blank lines before it: count them, skip them
                    line_no += buffer.count(b"\n", pos, newline + 1)
                    pos, dropped = newline + 1, 0
                if first == end:  # the rest is blank: keep the unfinished line's start
                    pending = buffer[pos:]
                    if dropped + len(pending) > MAX_LINE_BYTES:
                        dropped, pending = dropped + len(pending), b""
                    break
                newline = buffer.find(b"\n", first)
                if newline < 0:  # the line goes on in the next block
                    pending = buffer[pos:]
                    if dropped + len(pending) > MAX_LINE_BYTES:
                        raise too_long(line_no)
                    break
                if dropped + newline + 1 - pos > MAX_LINE_BYTES:
                    raise too_long(line_no)
                yield line_no, buffer[pos:newline + 1]
                line_no, pos, dropped = line_no + 1, newline + 1, 0


def parse_fields(text: str) -> dict[str, str]:
    """``"layer=layer_idx,experts=topk_ids"`` -> ``{"layer": "layer_idx", "experts": "topk_ids"}``:
    the names a JSONL file uses for the record keys :data:`FIELD_KEYS` (``--field``).

    Raises:
        ValueError: an item that is not ``KEY=NAME``, an unknown key or a key given twice.
    """
    mapping: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in str(text).split(","))):
        key, equals, name = (part.strip() for part in item.partition("="))
        if not equals or not key or not name:
            raise ValueError(f"--field {item!r}: expected KEY=NAME, e.g. layer=layer_idx")
        if key not in FIELD_KEYS:
            raise ValueError(f"--field {item!r}: unknown key {key!r}; the keys are "
                             f"{', '.join(FIELD_KEYS)}")
        if key in mapping:
            raise ValueError(f"--field: key {key!r} given twice")
        mapping[key] = name
    if not mapping:
        raise ValueError("--field: expected KEY=NAME[,KEY=NAME...], e.g. layer=layer_idx")
    return mapping


def _renamed(record: dict, fields: Mapping[str, str]) -> dict:
    """``record`` with the file's names replaced by the record keys (a renamed key is read from
    its file name only)."""
    out = {key: value for key, value in record.items() if key not in fields}
    for key, name in fields.items():
        if name in record:
            out[key] = record[name]
    return out


def load_jsonl_trace(path: str | os.PathLike, *, num_layers: int | None = None,
                     num_experts: int | None = None, max_memory: int | None = None,
                     fields: Mapping[str, str] | None = None,
                     progress: Callable[[int, int], None] | None = None) -> Trace:
    """Read a JSONL trace (one ``{"layer", "token_idx", "experts"}`` record per line), whose keys
    may carry other names (``fields``, as :func:`load_trace`); messages name the file's keys.

    Args, Returns and Raises: as :func:`_read_jsonl`.
    """
    if not fields:
        return _read_jsonl(path, num_layers=num_layers, num_experts=num_experts,
                           max_memory=max_memory, progress=progress)
    unknown = set(fields) - set(FIELD_KEYS)
    if unknown:
        raise ValueError(f"fields: unknown keys {sorted(unknown)}; the keys are "
                         f"{', '.join(FIELD_KEYS)}")
    try:
        return _read_jsonl(path, num_layers=num_layers, num_experts=num_experts,
                           max_memory=max_memory, fields=dict(fields), progress=progress)
    except TraceError as error:
        if type(error) is not TraceError:
            raise
        message = str(error)
        for key, name in fields.items():
            message = message.replace(f"field '{key}'", f"field '{name}'").replace(
                f"'{key}'", f"'{name}'")
        raise TraceError(message) from None


def _read_jsonl(path: str | os.PathLike, *, num_layers: int | None = None,
                     num_experts: int | None = None, max_memory: int | None = None,
                     fields: Mapping[str, str] | None = None,
                     progress: Callable[[int, int], None] | None = None) -> Trace:
    """Read a JSONL trace (one ``{"layer", "token_idx", "experts"}`` record per line).

    Gzip-compressed input is recognised by its magic bytes, whatever the file is called.
    Records are held as packed int32/int64 columns while reading (about 28 bytes per record plus
    4 per expert), not as Python objects.

    Args and Returns: as :func:`load_trace`.

    Raises:
        TraceError: with ``file:line: field 'name': ...`` for a line that is not a JSON object,
            lacks a required key, holds a value of the wrong type (``bool`` and ``3.0`` are not
            integers), a negative layer or ``token_idx``, a layer ``>= num_layers`` (declared),
            an expert outside ``[-1, num_experts)`` (declared; ``< -1`` always), repeats a
            (sequence, token, layer) already seen, or holds an outlier id (inferred geometry);
            for a corrupt gzip stream or an over-long line; for a file with no records; and
            (:class:`MemoryLimitError`) when the records, the routes table or the geometry would
            exceed ``max_memory``, naming the line that set the size.
    """
    path_str = os.fspath(path)
    declared_layers = _optional_positive_int(num_layers, "num_layers")
    declared_experts = _optional_positive_int(num_experts, "num_experts")
    limit = resolve_memory_limit(max_memory)

    sequence_index: dict[Any, int] = {}
    seq_of, layer_of, count_of = array.array("i"), array.array("i"), array.array("i")
    token_of, line_of = array.array("q"), array.array("q")
    experts_flat = array.array("i")
    held = 0

    for line_no, raw in _numbered_lines(path_str, progress):
        where = f"{path_str}:{line_no}"
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
        if fields:
            record = _renamed(record, fields)

        layer = _record_int(record, "layer", where)
        if layer < 0:
            raise TraceError(f"{where}: field 'layer': layer {layer} is negative")
        if declared_layers is not None and layer >= declared_layers:
            raise TraceError(f"{where}: field 'layer': layer {layer} is outside "
                             f"[0, {declared_layers}) (num_layers={declared_layers})")
        if layer > INT32_MAX - 1:
            raise TraceError(f"{where}: field 'layer': {_id_past_int32('layer', layer)}")
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
            if (expert < -1 or expert > INT32_MAX - 1
                    or (declared_experts is not None and expert >= declared_experts)):
                raise _expert_out_of_range(where, expert, declared_experts)

        label = None
        for key in SEQUENCE_KEYS:
            if key in record and record[key] is not None:
                label = record[key]
                if not (isinstance(label, str) or is_int(label)):
                    raise TraceError(f"{where}: field {key!r}: expected a string or integer "
                                     f"sequence label, got {_short(label)}")
                break
        held += _RECORD_BYTES + 4 * len(experts)
        check_memory(held, limit, where, "reading the records up to this line")
        seq_of.append(sequence_index.setdefault(label, len(sequence_index)))
        token_of.append(token)
        layer_of.append(layer)
        line_of.append(line_no)
        count_of.append(len(experts))
        experts_flat.extend(experts)

    if not line_of:
        raise TraceError(f"{path_str}: the trace is empty (no records)")
    return trace_from_records(
        path_str, sequence=np.frombuffer(seq_of, dtype=np.intc),
        token_idx=np.frombuffer(token_of, dtype=np.int64),
        layer=np.frombuffer(layer_of, dtype=np.intc),
        experts=np.frombuffer(experts_flat, dtype=np.intc),
        counts=np.frombuffer(count_of, dtype=np.intc), sequence_names=tuple(sequence_index),
        positions=np.frombuffer(line_of, dtype=np.int64),
        locate=lambda line: f"{path_str}:{line}", unit="line", num_layers=declared_layers,
        num_experts=declared_experts, max_memory=limit, held=held)


def trace_from_records(source: str, *, sequence: np.ndarray, token_idx: np.ndarray,
                       layer: np.ndarray, experts: np.ndarray, counts: np.ndarray,
                       sequence_names: tuple[Any, ...], positions: np.ndarray,
                       locate: Callable[[int], str], unit: str = "record",
                       num_layers: int | None = None, num_experts: int | None = None,
                       max_memory: int | None = None, held: int = 0) -> Trace:
    """The trace of records read as columns (what the JSONL and Parquet readers hold), in
    replay order: sequence (first appearance), ``token_idx``, then ``layer``.

    Args:
        source: the file, for messages and :attr:`Trace.source`.
        sequence: int ``[R]``, each record's index into ``sequence_names``.
        token_idx, layer: int ``[R]``.
        experts: int ``[sum(counts)]``, the records' expert lists concatenated.
        counts: int ``[R]``, the length of each record's list (shorter ones are ``-1`` padded).
        sequence_names: the sequence labels.
        positions: int ``[R]``, each record's line or row number, for ``locate``.
        locate: ``position -> "file:line"`` (or ``"file: row N"``), the start of a message.
        unit: what a position counts (``"line"``, ``"row"``), for messages.
        num_layers, num_experts, max_memory: as :func:`load_trace`.
        held: bytes the caller already holds, counted against the limit.

    Raises:
        TraceError: a negative layer or ``token_idx``, a value outside the declared geometry or
            int32, an expert below ``-1``, a repeated (sequence, token, layer), no routes, an
            outlier id (inferred geometry), each naming the record; (:class:`MemoryLimitError`)
            a size above the limit.
    """
    path_str = source
    declared_layers = _optional_positive_int(num_layers, "num_layers")
    declared_experts = _optional_positive_int(num_experts, "num_experts")
    limit = resolve_memory_limit(max_memory)
    calls = int(layer.shape[0])
    if calls == 0:
        raise TraceError(f"{path_str}: the trace is empty (no records)")
    lines = np.asarray(positions, dtype=np.int64)
    ends = np.cumsum(counts, dtype=np.int64)

    def record_of_flat(flat_index: int) -> int:
        return int(np.searchsorted(ends, flat_index, side="right"))

    def first(bad: np.ndarray, flat: bool = False) -> tuple[str, int]:
        index = int(np.argmax(bad))
        return locate(int(lines[record_of_flat(index) if flat else index])), index

    limit_layer = declared_layers if declared_layers is not None else INT32_MAX
    for name, column, low, high in (("layer", layer, 0, limit_layer),
                                    ("token_idx", token_idx, 0, _TOKEN_MAX + 1)):
        if int(column.min()) < low or int(column.max()) >= high:
            where, index = first((column < low) | (column >= high))
            value = int(column[index])
            if value < 0:
                raise TraceError(f"{where}: field {name!r}: {name} {value} is negative")
            if name == "layer" and declared_layers is not None and value >= declared_layers:
                raise TraceError(f"{where}: field 'layer': layer {value} is outside "
                                 f"[0, {declared_layers}) (num_layers={declared_layers})")
            if name == "layer":
                raise TraceError(f"{where}: field 'layer': {_id_past_int32('layer', value)}")
            raise TraceError(f"{where}: field {name!r}: {name} {value} is too large "
                             f"(limit 2**62)")
    if experts.size:
        limit_expert = declared_experts if declared_experts is not None else INT32_MAX
        if int(experts.min()) < -1 or int(experts.max()) >= limit_expert:
            where, index = first((experts < -1) | (experts >= limit_expert), flat=True)
            raise _expert_out_of_range(where, int(experts[index]), declared_experts)
    top_k = int(counts.max())
    widest_line = int(lines[int(np.argmax(counts))])
    layer_file = np.asarray(layer, dtype=np.int32)

    # Replay order: sequence (first appearance), token ascending, layer ascending.
    seq_arr = np.asarray(sequence, dtype=np.int32)
    token_arr = np.asarray(token_idx, dtype=np.int64)
    order = np.lexsort((layer_file, token_arr, seq_arr))
    seq_arr, token_arr, layer_arr = seq_arr[order], token_arr[order], layer_file[order]
    same = ((seq_arr[1:] == seq_arr[:-1]) & (token_arr[1:] == token_arr[:-1])
            & (layer_arr[1:] == layer_arr[:-1]))
    if same.any():
        first_same = int(np.argmax(same))
        pair = sorted((int(lines[order[first_same]]), int(lines[order[first_same + 1]])))
        raise TraceError(f"{locate(pair[1])}: field 'layer': duplicate record for token_idx "
                         f"{token_arr[first_same]}, layer {layer_arr[first_same]} (first seen on "
                         f"{unit} {pair[0]})")
    if top_k == 0:
        raise TraceError(f"{path_str}: field 'experts': every record has an empty list (no "
                         f"routes to replay)")

    # Geometry: refuse an outlier or a geometry above the limit, naming the line that set it.
    flat = np.asarray(experts, dtype=np.int32)
    max_layer = int(layer_file.max())
    layer_where = locate(int(lines[int(np.argmax(layer_file == max_layer))]))
    max_expert = int(flat.max()) if flat.size else -1
    expert_where = path_str
    if max_expert >= 0:
        expert_where = locate(int(lines[record_of_flat(int(np.argmax(flat == max_expert)))]))
    if declared_experts is None and max_expert < 0:
        raise TraceError(f"{path_str}: field 'experts': every route is padding (-1), so "
                         f"num_experts cannot be inferred; pass num_experts=")
    if declared_layers is None and max_layer >= OUTLIER_FLOOR:
        _check_outlier("layer", max_layer, _next_largest(layer_file, max_layer), layer_where)
    if declared_experts is None and max_expert >= OUTLIER_FLOOR:
        _check_outlier("expert", max_expert, _next_largest(flat, max_expert), expert_where)
    geometry = (declared_layers or max_layer + 1, declared_experts or max_expert + 1)
    # Name the line of the inferred size that makes the geometry large.
    if declared_layers is not None and declared_experts is not None:
        geometry_where, note = path_str, " (declared)"
    elif declared_experts is not None or (declared_layers is None
                                          and geometry[0] >= geometry[1]):
        geometry_where, note = layer_where, ""
    else:
        geometry_where, note = expert_where, ""
    _check_geometry(*geometry, limit, geometry_where, note)
    check_memory(held + 2 * trace_bytes(calls, top_k), limit, locate(widest_line),
                 f"field 'experts': the routes table [{calls} calls, top_k {top_k} set by this "
                 f"{unit}]")

    if bool((counts == top_k).all()):
        routes = flat.reshape(calls, top_k)[order]
    else:
        padded = np.full((calls, top_k), -1, dtype=np.int32)
        padded[np.arange(top_k)[None, :] < np.asarray(counts)[:, None]] = flat
        routes = padded[order]
        del padded
    return Trace(routes=routes, layers=layer_arr, num_layers=geometry[0],
                 num_experts=geometry[1], token_idx=token_arr, sequence=seq_arr,
                 sequence_names=tuple(sequence_names), source=path_str)


@dataclass(frozen=True)
class _Member:
    """One ``[tokens, layers, top_k]`` array of a NumPy trace file, known from its header."""

    name: str            # the array's name ('routes' for a .npy)
    label: str           # "file: array 'name'", for messages
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool
    read: Any            # () -> np.ndarray, reading the data (or returning the array)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=object)) * self.dtype.itemsize


def _read_npy_header(stream: Any, label: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unsupported .npy format version {version[0]}.{version[1]}")
    except _READ_ERRORS as exc:
        raise TraceError(f"{label}: not a readable NumPy .npy/.npz file: {exc}") from None
    if dtype.hasobject:
        raise TraceError(f"{label}: not a readable NumPy .npy/.npz file: object (pickled) "
                         f"arrays are refused")
    if any(int(d) < 0 for d in shape):
        raise TraceError(f"{label}: not a readable NumPy .npy/.npz file: negative shape {shape}")
    return tuple(int(d) for d in shape), bool(fortran), dtype


def _read_npy_data(stream: Any, label: str, shape: tuple[int, ...], dtype: np.dtype,
                   fortran: bool) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    try:
        data = stream.read(nbytes)
    except _READ_ERRORS as exc:
        raise TraceError(f"{label}: cannot read the array data: {exc}") from None
    if len(data) != nbytes:
        raise TraceError(f"{label}: the header claims shape {shape} ({format_bytes(nbytes)}) but "
                         f"only {len(data)} bytes of data follow (truncated or corrupt file)")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")


def _npy_members(path_str: str, name: str = "routes", label: str | None = None) -> list[_Member]:
    label = label or f"{path_str}: array {name!r}"
    try:
        with open(path_str, "rb") as handle:
            shape, fortran, dtype = _read_npy_header(handle, path_str)
            offset, size = handle.tell(), os.fstat(handle.fileno()).st_size
    except OSError as exc:
        raise TraceError(f"{path_str}: cannot open trace file: {exc.strerror or exc}") from exc

    def read() -> np.ndarray:
        try:
            with open(path_str, "rb") as handle:
                handle.seek(offset)
                return _read_npy_data(handle, label, shape, dtype, fortran)
        except OSError as exc:
            raise TraceError(f"{path_str}: cannot read trace file: {exc}") from None

    member = _Member(name, label, shape, dtype, fortran, read)
    if member.nbytes > size - offset:
        raise TraceError(f"{label}: the header claims shape {shape} "
                         f"({format_bytes(member.nbytes)}) but the file holds only "
                         f"{size - offset} bytes of data (truncated or corrupt file)")
    return [member]


def _npz_members(path_str: str) -> list[_Member]:
    try:
        with zipfile.ZipFile(path_str) as archive:
            infos = archive.infolist()
            headers = []
            for info in infos:
                name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                label = f"{path_str}: array {name!r}"
                with archive.open(info) as stream:
                    headers.append((info, name, label, *_read_npy_header(stream, label)))
    except TraceError:
        raise
    except _READ_ERRORS as exc:
        raise TraceError(f"{path_str}: not a readable NumPy .npy/.npz file: {exc}") from None
    if not headers:
        raise TraceError(f"{path_str}: the .npz archive holds no arrays")

    def reader(info: zipfile.ZipInfo, label: str, shape, dtype, fortran):
        def read() -> np.ndarray:
            try:
                with zipfile.ZipFile(path_str) as archive, archive.open(info) as stream:
                    _read_npy_header(stream, label)
                    return _read_npy_data(stream, label, shape, dtype, fortran)
            except TraceError:
                raise
            except _READ_ERRORS as exc:
                raise TraceError(f"{label}: cannot read the array data: {exc}") from None
        return read

    return [_Member(name, label, shape, dtype, fortran, reader(info, label, shape, dtype, fortran))
            for info, name, label, shape, fortran, dtype in headers]


def _check_member(member: _Member, tokens: str = "tokens", empty_tokens: bool = False) -> None:
    """Dtype, rank and emptiness, from the header alone (``empty_tokens``: a first dimension of
    0 is allowed)."""
    if member.dtype.kind not in "iu":
        raise TraceError(f"{member.label}: expected an integer array of expert ids, got dtype "
                         f"{member.dtype} (shape {member.shape})")
    if len(member.shape) != 3:
        raise TraceError(f"{member.label}: expected shape [{tokens}, layers, top_k], got "
                         f"{len(member.shape)}-D shape {member.shape}")
    if 0 in member.shape[empty_tokens:]:
        raise TraceError(f"{member.label}: the trace is empty (shape {member.shape})")


def load_array_trace(path: str | os.PathLike, *, num_layers: int | None = None,
                     num_experts: int | None = None, max_memory: int | None = None) -> Trace:
    """Read a ``.npy``/``.npz`` trace: integer arrays ``[tokens, layers, top_k]``.

    A ``.npy`` holds one sequence. In an ``.npz`` *every* array is one sequence, named after the
    array, in archive order (an archive of one array gives one unnamed sequence, as a ``.npy``);
    arrays may differ in token count, layer count (``num_layers`` is the largest) and ``top_k``
    (narrower ones are ``-1`` padded). Every array must be an integer array of rank 3. Sizes come
    from the headers and are checked against the memory limit (and the file size) before any
    data is read. Pickled (object) arrays are refused.

    Args and Returns: as :func:`load_trace`.

    Raises:
        TraceError: unreadable or truncated file, empty archive, an array of non-integer dtype,
            a rank other than 3, or empty (naming the array), a layer dimension above a declared
            ``num_layers``, an expert outside ``[-1, num_experts)`` or an outlier expert (the
            message gives its ``[token, layer, k]`` index), or (:class:`MemoryLimitError`) a
            size above ``max_memory``.
    """
    path_str = os.fspath(path)
    declared_layers = _optional_positive_int(num_layers, "num_layers")
    declared_experts = _optional_positive_int(num_experts, "num_experts")
    limit = resolve_memory_limit(max_memory)
    members = _array_file_members(path_str)
    for member in members:
        _check_member(member)
    return _assemble_dense(members, path_str, declared_layers, declared_experts, limit,
                           names=len(members) > 1)


def _array_file_members(path_str: str):
    """The arrays of one ``.npz`` (by its zip magic) or ``.npy`` file, headers only."""
    try:
        with open(path_str, "rb") as handle:
            magic = handle.read(2)
    except OSError as exc:
        raise TraceError(f"{path_str}: cannot open trace file: {exc.strerror or exc}") from exc
    return _npz_members(path_str) if magic == _ZIP_MAGIC else _npy_members(path_str)


def load_vllm_trace(path: str | os.PathLike, *, num_layers: int | None = None,
                    num_experts: int | None = None, max_memory: int | None = None) -> Trace:
    """Read vLLM's routed experts: one ``[gen_len, layers, top_k]`` array per request, each
    request one sequence.

    vLLM (``--enable-return-routed-experts``) returns each completion's ``routed_experts`` as an
    int16 array ``[gen_len, num_moe_layers, top_k]``. Saved as a directory of ``.npy`` files (one
    per request, named after the file without ``.npy``, in name order; other files are ignored),
    an ``.npz`` (one array per request, in archive order) or one ``.npy``. Unlike
    :func:`load_array_trace`, every request must have the same layers and ``top_k`` (one model's
    routing), and a request with ``gen_len`` 0 is skipped. Headers (dtype, rank, shapes) are
    checked for every request before any data is read.

    Args and Returns: as :func:`load_trace`.

    Raises:
        TraceError: no ``.npy`` in the directory, a non-integer dtype or a rank other than 3
            (naming the file and shape), requests whose layers or ``top_k`` differ (naming both
            files and shapes), every request empty, an id below ``-1`` (naming the file and
            ``[token, layer, k]``), or as :func:`load_array_trace`.
    """
    path_str = os.fspath(path)
    declared_layers = _optional_positive_int(num_layers, "num_layers")
    declared_experts = _optional_positive_int(num_experts, "num_experts")
    limit = resolve_memory_limit(max_memory)
    if os.path.isdir(path_str):
        try:
            files = sorted(f for f in os.listdir(path_str) if f.lower().endswith(".npy"))
        except OSError as exc:
            raise TraceError(f"{path_str}: cannot list the directory: {exc.strerror or exc}") from exc
        if not files:
            raise TraceError(f"{path_str}: no .npy files in the directory (vLLM routed experts: "
                             f"one [gen_len, layers, top_k] .npy per request)")
        members = [member for name in files
                   for member in _npy_members(os.path.join(path_str, name), name[:-4],
                                              os.path.join(path_str, name))]
    else:
        members = _array_file_members(path_str)
    for member in members:
        _check_member(member, tokens="gen_len", empty_tokens=True)
        if member.shape[1:] != members[0].shape[1:]:
            raise TraceError(f"{member.label}: shape {member.shape} but {members[0].label} has "
                             f"shape {members[0].shape}: every request of one model routes the "
                             f"same [layers, top_k]")
    kept = [member for member in members if member.shape[0] > 0]
    if not kept:
        raise TraceError(f"{path_str}: every request has gen_len 0 (no routes)")
    return _assemble_dense(kept, path_str, declared_layers, declared_experts, limit,
                           names=len(members) > 1 or os.path.isdir(path_str))


def _trace_from_dense(dense: np.ndarray, *, num_layers: int | None, num_experts: int | None,
                      where: str, field_name: str, max_memory: int | None = None) -> Trace:
    """Validate an in-memory ``[tokens, layers, top_k]`` array into a token-major trace."""
    label = f"{where}: array {field_name!r}"
    member = _Member(field_name, label, tuple(dense.shape), dense.dtype, False, lambda: dense)
    if dense.dtype.hasobject or member.dtype.kind not in "iu":
        raise TraceError(f"{label}: expected an integer array of expert ids, got dtype "
                         f"{dense.dtype}")
    _check_member(member)
    return _assemble_dense([member], where, _optional_positive_int(num_layers, "num_layers"),
                           _optional_positive_int(num_experts, "num_experts"),
                           resolve_memory_limit(max_memory), names=False, held=dense.nbytes)


def _assemble_dense(members: list[_Member], where: str, declared_layers: int | None,
                    declared_experts: int | None, limit: int, *, names: bool,
                    held: int = 0) -> Trace:
    """Validate the members' values and concatenate them, one sequence each, token-major."""
    for member in members:
        if declared_layers is not None and member.shape[1] > declared_layers:
            raise TraceError(f"{member.label}: {member.shape[1]} layers in the array but "
                             f"num_layers={declared_layers} was declared")
    calls = sum(m.shape[0] * m.shape[1] for m in members)
    top_k = max(m.shape[2] for m in members)
    biggest = max(members, key=lambda m: m.nbytes)
    check_memory(held + biggest.nbytes + 2 * trace_bytes(calls, top_k), limit, biggest.label,
                 f"the shape {biggest.shape} ({biggest.dtype}) in its header makes the trace "
                 f"[{calls} calls, top_k {top_k}], which")
    num_layers = declared_layers or max(m.shape[1] for m in members)
    if declared_experts is not None:
        _check_geometry(num_layers, declared_experts, limit, where, " (declared)")

    routes = np.full((calls, top_k), -1, dtype=np.int32)
    bound = declared_experts if declared_experts is not None else INT32_MAX
    offsets, row = [], 0
    for member in members:
        values = member.read()
        lo, hi = int(values.min()), int(values.max())
        if lo < -1 or hi >= bound:
            bad = (values < -1) | (values >= bound)
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            text = (f"[-1, {declared_experts}) (num_experts={declared_experts})"
                    if declared_experts is not None else "[-1, 2**31 - 1)")
            note = " (-1 is the only padding value)" if int(values[index]) < -1 else ""
            reason = f"expert {int(values[index])} is outside {text}{note}"
            if declared_experts is None and int(values[index]) >= INT32_MAX:
                reason = _id_past_int32("expert", int(values[index]))
            raise TraceError(f"{member.label}[token={index[0]}, layer={index[1]}, "
                             f"k={index[2]}]: {reason}")
        tokens, layers, width = member.shape
        routes[row:row + tokens * layers, :width] = values.reshape(tokens * layers, width)
        offsets.append(row)
        row += tokens * layers
        del values

    def locate(flat_index: int) -> str:
        call, k = divmod(flat_index, top_k)
        number = int(np.searchsorted(offsets, call, side="right")) - 1
        member = members[number]
        token, layer = divmod(call - offsets[number], member.shape[1])
        return f"{member.label}[token={token}, layer={layer}, k={k}]"

    max_expert = int(routes.max())
    if declared_experts is None:
        if max_expert < 0:
            raise TraceError(f"{members[0].label}: every route is padding (-1), so num_experts "
                             f"cannot be inferred; pass num_experts=")
        max_where = locate(int(np.argmax(routes == max_expert)))
        if max_expert >= OUTLIER_FLOOR:
            _check_outlier("expert", max_expert, _next_largest(routes, max_expert), max_where)
        _check_geometry(num_layers, max_expert + 1, limit, max_where, "")
    sequence = np.repeat(np.arange(len(members), dtype=np.int32),
                         [m.shape[0] * m.shape[1] for m in members])
    layer_column = np.concatenate([np.tile(np.arange(m.shape[1], dtype=np.int32), m.shape[0])
                                   for m in members])
    token_column = np.concatenate([np.repeat(np.arange(m.shape[0], dtype=np.int64), m.shape[1])
                                   for m in members])
    return Trace(routes=routes, layers=layer_column, num_layers=num_layers,
                 num_experts=declared_experts if declared_experts is not None else max_expert + 1,
                 token_idx=token_column, sequence=sequence,
                 sequence_names=tuple(m.name for m in members) if names else (None,),
                 source=where)


# ---- saving ----------------------------------------------------------------------------------


def save_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Write a trace in the format its suffix names; :func:`load_trace` reads it back equal.

    JSONL writes one record per call (``sequence`` only when the trace has named sequences; the
    ``experts`` list keeps its ``-1`` padding so ``top_k`` survives the round trip). ``.npy`` and
    ``.npz`` (array ``routes``) need a full grid (:meth:`Trace.is_dense`); the declared geometry
    is not stored in them (nor in JSONL or Parquet), so pass ``num_layers``/``num_experts`` when
    loading if the trace does not reach them. ``.parquet`` writes the JSONL records as columns
    (needs ``pyarrow``).

    Args:
        trace: the trace to write.
        path: destination; the suffix picks the format.

    Raises:
        TraceError: unknown suffix, or a non-grid trace written as an array.
        ValueError: ``.parquet`` without ``pyarrow``.
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
    elif suffix in PARQUET_SUFFIXES:
        from pallas_cache.sizing.parquet import save_parquet_trace  # pyarrow: optional

        save_parquet_trace(trace, path_str)
    else:
        raise TraceError(f"{path_str}: unknown trace format {suffix or '(no suffix)'!r}; "
                         f"expected one of "
                         f"{', '.join(JSONL_SUFFIXES + ARRAY_SUFFIXES + PARQUET_SUFFIXES)}")


# ---- small helpers ---------------------------------------------------------------------------

_MISSING = object()


def _expert_out_of_range(where: str, expert: int, declared_experts: int | None) -> TraceError:
    """The one message for an expert id outside ``[-1, num_experts)`` or past int32, for the
    per-record and the vectorised readers alike."""
    if expert < -1:
        return TraceError(f"{where}: field 'experts': expert {expert} is below -1 (-1 is the only "
                          f"padding value)")
    if declared_experts is not None and expert >= declared_experts:
        return TraceError(f"{where}: field 'experts': expert {expert} is outside "
                          f"[-1, {declared_experts}) (num_experts={declared_experts})")
    return TraceError(f"{where}: field 'experts': {_id_past_int32('expert', expert)}")


def _id_past_int32(name: str, value: int) -> str:
    """Why an id at or past ``2**31 - 1`` is refused: past it the id itself does not fit int32;
    at it the id fits, but the count it implies (``max + 1``) does not."""
    if value > INT32_MAX:
        return f"{name} {value} does not fit int32"
    count = "num_layers" if name == "layer" else "num_experts"
    return (f"{name} {value} fits int32, but {count} = {value} + 1 = 2**31 would not (ids "
            f"must be below 2**31 - 1)")


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
