"""Trace files: the format a path names; :func:`load_trace` and :func:`save_trace` for each."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

import numpy as np

from pallas_cache.sizing.traces.arrays import load_array_trace, load_vllm_trace
from pallas_cache.sizing.traces.jsonl import load_jsonl_trace
from pallas_cache.sizing.traces.base import Trace, TraceError

__all__ = ["JSONL_SUFFIXES", "ARRAY_SUFFIXES", "PARQUET_SUFFIXES", "TRACE_FORMATS",
           "trace_format_of", "load_trace", "save_trace"]

#: File suffixes read as one-record-per-line JSON.
JSONL_SUFFIXES = (".jsonl", ".ndjson")
#: File suffixes read as a dense ``[tokens, layers, top_k]`` integer array.
ARRAY_SUFFIXES = (".npy", ".npz")
#: File suffixes read as Parquet (``pyarrow``: the ``parquet`` extra).
PARQUET_SUFFIXES = (".parquet", ".pq")
#: What ``trace_format=`` (``--trace-format``) names; ``"auto"`` picks one by :func:`trace_format_of`.
TRACE_FORMATS = ("jsonl", "array", "vllm", "parquet")


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
    kind = trace_format_of(path_str) if trace_format == "auto" else trace_format
    geometry = dict(num_layers=num_layers, num_experts=num_experts, max_memory=max_memory)
    if kind == "jsonl":
        return load_jsonl_trace(path_str, fields=fields, progress=progress, **geometry)
    if kind == "parquet":
        from pallas_cache.sizing.traces.parquet import load_parquet_trace  # pyarrow: optional

        return load_parquet_trace(path_str, fields=fields, **geometry)
    if fields:
        raise TraceError(f"{path_str}: field names apply to JSONL and Parquet traces only")
    if kind == "vllm":
        return load_vllm_trace(path_str, **geometry)
    return load_array_trace(path_str, **geometry)


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
        from pallas_cache.sizing.traces.parquet import save_parquet_trace  # pyarrow: optional

        save_parquet_trace(trace, path_str)
    else:
        raise TraceError(f"{path_str}: unknown trace format {suffix or '(no suffix)'!r}; "
                         f"expected one of "
                         f"{', '.join(JSONL_SUFFIXES + ARRAY_SUFFIXES + PARQUET_SUFFIXES)}")
