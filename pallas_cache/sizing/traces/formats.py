"""Trace file formats: a registry of records (:data:`FORMATS`: name, suffixes, load, save), the
format a path names, and :func:`load_trace` / :func:`save_trace` for any of them. No NumPy here:
the command line's parser takes ``--trace-format``'s choices and help from the registry."""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import TYPE_CHECKING, Callable, Mapping

from pallas_cache.sizing.traces.errors import TraceError

if TYPE_CHECKING:
    from pallas_cache.sizing.traces.base import Trace

__all__ = ["ARRAY_SUFFIXES", "FORMATS", "JSONL_SUFFIXES", "PARQUET_SUFFIXES", "TRACE_FORMATS",
           "TraceFormat", "format_named", "load_trace", "save_trace", "trace_format_of"]


def _late(module: str, name: str) -> Callable:
    """``module.name``, imported at the first call (the readers import NumPy; Parquet's,
    pyarrow, which is optional)."""
    def call(*args, **kwargs):
        return getattr(importlib.import_module(f"pallas_cache.sizing.traces.{module}"),
                       name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


@dataclasses.dataclass(frozen=True)
class TraceFormat:
    """One trace file format.

    Attributes:
      name: what ``trace_format=`` (``--trace-format``) names it.
      suffixes: the file suffixes :func:`trace_format_of` reads as it (none: a directory).
      load: ``load(path, *, num_layers, num_experts, max_memory, **options)`` -> ``Trace``;
        ``options`` are ``fields`` where :attr:`fields`, ``progress`` where :attr:`progress`.
      save: ``save(trace, path)``, or ``None`` (not written).
      about: what ``--trace-format``'s help says of it after its name ("" for nothing).
      gzip: a gzipped file of its suffixes (``.jsonl.gz``) is it too.
      fields: it takes the file's names of the record keys (``--field``).
      progress: it reports its reading (bytes read, file size).
    """

    name: str
    suffixes: tuple[str, ...]
    load: Callable
    save: Callable | None = None
    about: str = ""
    gzip: bool = False
    fields: bool = False
    progress: bool = False


#: Every format, in the order ``--trace-format`` lists them.
FORMATS: tuple[TraceFormat, ...] = (
    TraceFormat("jsonl", (".jsonl", ".ndjson"), _late("jsonl", "load_jsonl_trace"),
                _late("jsonl", "save_jsonl_trace"), gzip=True, fields=True, progress=True),
    TraceFormat("array", (".npy", ".npz"), _late("arrays", "load_array_trace"),
                _late("arrays", "save_array_trace"), about="(.npy/.npz [tokens, layers, top_k])"),
    TraceFormat("vllm", (), _late("arrays", "load_vllm_trace"),
                about="(the array layout, one request per file or .npz array, every request the "
                      "same layers and top_k)"),
    TraceFormat("parquet", (".parquet", ".pq"), _late("parquet", "load_parquet_trace"),
                _late("parquet", "save_parquet_trace"), fields=True),
)
#: What ``trace_format=`` (``--trace-format``) names; ``"auto"`` picks one by
#: :func:`trace_format_of`.
TRACE_FORMATS = tuple(f.name for f in FORMATS)
#: File suffixes read as one-record-per-line JSON.
JSONL_SUFFIXES = FORMATS[0].suffixes
#: File suffixes read as a dense ``[tokens, layers, top_k]`` integer array.
ARRAY_SUFFIXES = FORMATS[1].suffixes
#: File suffixes read as Parquet (``pyarrow``: the ``parquet`` extra).
PARQUET_SUFFIXES = FORMATS[3].suffixes
#: The directory format (a folder of vLLM ``.npy`` files).
_DIRECTORY = "vllm"


def format_named(name: str) -> TraceFormat:
    """The format ``name`` names (KeyError for none)."""
    for trace_format in FORMATS:
        if trace_format.name == name:
            return trace_format
    raise KeyError(name)


def _suffixes() -> str:
    return ", ".join(suffix for f in FORMATS for suffix in f.suffixes)


def trace_format_of(path: str | os.PathLike) -> str:
    """The format :func:`load_trace` reads ``path`` as: a directory is ``"vllm"``, else the
    suffix decides (``.jsonl``/``.ndjson``, gzipped or not: ``"jsonl"``; ``.npy``/``.npz``:
    ``"array"``; ``.parquet``/``.pq``: ``"parquet"``).

    Raises:
        TraceError: an unknown suffix.
    """
    path_str = os.fspath(path)
    if os.path.isdir(path_str):
        return _DIRECTORY
    name = path_str.lower()
    gzipped = name.endswith(".gz")
    suffix = os.path.splitext(name[:-3] if gzipped else name)[1]
    for trace_format in FORMATS:
        if suffix in trace_format.suffixes and (trace_format.gzip or not gzipped):
            return trace_format.name
    raise TraceError(f"{path_str}: unknown trace format {suffix or '(no suffix)'!r}; expected "
                     f"one of {_suffixes()} (JSONL may be gzipped: .jsonl.gz) or a directory of "
                     f"vLLM .npy files, or name the format (--trace-format)")


def load_trace(path: str | os.PathLike, *, num_layers: int | None = None,
               num_experts: int | None = None, max_memory: int | None = None,
               fields: Mapping[str, str] | None = None, trace_format: str = "auto",
               progress: Callable[[int, int], None] | None = None) -> Trace:
    """Read a routing trace file into one dense, validated :class:`Trace`, calls in replay order.

    Formats (the suffix picks one, or ``trace_format=``):

    * **JSONL** (``.jsonl``, ``.ndjson``; gzipped, ``.jsonl.gz`` or any file starting with the
      gzip magic): one JSON object per line and per (token, layer)::

          {"layer": 3, "token_idx": 17, "experts": [5, 1], "sequence": "prompt-42"}

      ``layer``, ``token_idx`` and ``experts`` are required; ``sequence`` (or, when absent,
      ``problem_id``) optionally names the sequence the token belongs to; any other key is
      ignored. Blank (whitespace-only) lines are skipped, however long; a line with a record may
      hold at most :data:`~pallas_cache.sizing.traces.jsonl.MAX_LINE_BYTES`. Calls are ordered
      by sequence (in order of first appearance in the file), then ``token_idx`` ascending, then
      ``layer`` ascending, whatever order the file was written in. A missing (token, layer)
      record is simply absent (no call); a record whose ``experts`` list is shorter than the
      longest one is padded with ``-1``.
    * **NumPy** (``.npy``, ``.npz``): integer arrays ``[tokens, layers, top_k]`` with ``-1``
      padding, read token-major then layer (:func:`load_array_trace`). An ``.npz`` holds one
      sequence per array (named after it, in archive order). Every cell is a call, including one
      that is all padding.
    * **vLLM routed experts** (a directory of ``.npy`` files, or ``trace_format="vllm"``): one
      int16 ``[gen_len, layers, top_k]`` array per request, each request one sequence
      (:func:`load_vllm_trace`).
    * **Parquet** (``.parquet``, ``.pq``; needs ``pyarrow``): the JSONL records as columns
      (:func:`~pallas_cache.sizing.traces.parquet.load_parquet_trace`).

    Geometry (``num_layers``, ``num_experts``) is either declared -- then every value is checked
    against it -- or inferred as ``max + 1`` of what the trace holds (for an array, the layer
    count is its second dimension); an inferred size set by one outlier id far above the rest is
    refused (:data:`~pallas_cache.sizing.traces.geometry.OUTLIER_RATIO`). The bytes of every
    dense array (the trace's and the per-expert tables its geometry sizes) are estimated from the
    records or the ``.npy`` headers before anything is allocated. Malformed input raises
    :class:`TraceError` naming the file, the line (JSONL) or array index (NumPy) and the field.

    Args:
        path: a ``.jsonl``/``.ndjson`` (optionally gzip-compressed, ``.jsonl.gz``),
            ``.npy``/``.npz`` or ``.parquet`` file, or a directory of vLLM ``.npy`` files.
        num_layers: declared ``L``; every layer in the trace must be below it. ``None``: infer.
        num_experts: declared ``E``; every expert must lie in ``[-1, E)``. ``None``: infer
            ``max expert + 1`` (refusing an outlier).
        max_memory: bytes the trace and the tables its geometry sizes may take; ``None``:
            :func:`~pallas_cache.sizing.traces.memory.default_memory_limit`.
        fields: JSONL and Parquet only: the file's names of the record keys, ``{"layer":
            "layer_idx", "experts": "topk_ids"}`` (see
            :func:`~pallas_cache.sizing.traces.records.parse_fields`); unnamed keys keep their
            names.
        trace_format: ``"auto"`` (:func:`trace_format_of`) or one of :data:`TRACE_FORMATS`:
            ``"jsonl"``, ``"array"`` (:func:`load_array_trace`), ``"vllm"``
            (:func:`load_vllm_trace`) or ``"parquet"``
            (:func:`~pallas_cache.sizing.traces.parquet.load_parquet_trace`, needs ``pyarrow``).
        progress: JSONL only: called as ``progress(bytes of the file read, file size)`` while
            the file is read (after every block of decoded bytes the reader takes).

    Returns:
        The trace, calls in replay order.

    Raises:
        TraceError: ``fields`` for an array file, unknown suffix, unreadable file, malformed content, an empty trace, an
            outlier id, or (:class:`~pallas_cache.sizing.traces.memory.MemoryLimitError`) a size
            above ``max_memory``.
        ValueError: a declared geometry or limit that is not a positive integer, an unknown
            ``trace_format``, or (Parquet) ``pyarrow`` missing.
    """
    path_str = os.fspath(path)
    if trace_format not in ("auto",) + TRACE_FORMATS:
        raise ValueError(f"unknown trace format {trace_format!r}; expected auto or one of "
                         f"{', '.join(TRACE_FORMATS)}")
    reader = format_named(trace_format_of(path_str) if trace_format == "auto" else trace_format)
    options = {}
    if reader.fields:
        options["fields"] = fields
    elif fields:
        raise TraceError(f"{path_str}: field names apply to JSONL and Parquet traces only")
    if reader.progress:
        options["progress"] = progress
    return reader.load(path_str, num_layers=num_layers, num_experts=num_experts,
                       max_memory=max_memory, **options)


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
    writer = next((f for f in FORMATS if suffix in f.suffixes and f.save is not None), None)
    if writer is None:
        raise TraceError(f"{path_str}: unknown trace format {suffix or '(no suffix)'!r}; "
                         f"expected one of {_suffixes()}")
    writer.save(trace, path_str)
