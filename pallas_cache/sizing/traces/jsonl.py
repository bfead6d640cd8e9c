"""JSONL routing traces (gzipped or not): one record per line, read in blocks, and written."""

from __future__ import annotations

import array
import gzip
import json
import os
import re
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from pallas_cache.sizing.traces.geometry import (expert_out_of_range, id_past_int32,
                                                 optional_positive_int)
from pallas_cache.sizing.traces.memory import check_memory, resolve_memory_limit
from pallas_cache.sizing.traces.records import (FIELD_KEYS, SEQUENCE_KEYS, TOKEN_MAX,
                                                trace_from_records)
from pallas_cache.sizing.traces.base import Trace
from pallas_cache.sizing.traces.errors import READ_ERRORS, TraceError
from pallas_cache.validate import INT32_MAX, is_int

__all__ = ["MAX_LINE_BYTES", "numbered_lines", "load_jsonl_trace", "save_jsonl_trace"]

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


def numbered_lines(path_str: str,
                   progress: Callable[[int, int], None] | None = None, *,
                   block_bytes: int | None = None, max_line_bytes: int | None = None
                   ) -> Iterator[tuple[int, bytes]]:
    """Yield ``(line number, raw line)`` of every line that is not blank (whitespace only, as
    ``bytes.strip`` sees it); gzip input is recognised by its magic bytes.

    The file is read in blocks of ``block_bytes`` (``None``: 1 MiB); a run of blank lines is
    counted and skipped inside a block (C-level scans), so blank content costs no Python per
    line, and a whitespace-only stretch is not held (only a line with a record counts towards
    ``max_line_bytes``, ``None``: :data:`MAX_LINE_BYTES`). ``progress(bytes of the file read,
    file size)`` is called after every block and once at the end.

    Raises:
        TraceError: the file cannot be opened or read (a corrupt gzip stream: naming the line
            reached), or a line with a record is longer than ``max_line_bytes``.
    """
    block_bytes = _BLOCK_BYTES if block_bytes is None else block_bytes
    max_line_bytes = MAX_LINE_BYTES if max_line_bytes is None else max_line_bytes
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
            return TraceError(f"{path_str}:{line_no}: line is longer than {max_line_bytes} "
                              f"bytes; not a routing record")

        line_no = 1  # the line `pending` is on
        pending = b""  # the start of that line, not yet ended by a newline
        dropped = 0  # whitespace at that line's start not kept in `pending` (past the limit)
        while True:
            try:  # read1: what a truncated stream decodes is still yielded before its error
                block = stream.read1(block_bytes)
            except READ_ERRORS as exc:
                kind = "gzip data" if compressed else "trace file"
                raise TraceError(f"{path_str}:{line_no}: cannot read {kind}: {exc}") from None
            if progress is not None:
                progress(size if not block else min(handle.tell(), size), size)
            if not block:
                if pending.strip():
                    if dropped + len(pending) > max_line_bytes:
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
                if dropped + len(pending) > max_line_bytes:
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
                    if dropped + len(pending) > max_line_bytes:
                        dropped, pending = dropped + len(pending), b""
                    break
                newline = buffer.find(b"\n", first)
                if newline < 0:  # the line goes on in the next block
                    pending = buffer[pos:]
                    if dropped + len(pending) > max_line_bytes:
                        raise too_long(line_no)
                    break
                if dropped + newline + 1 - pos > max_line_bytes:
                    raise too_long(line_no)
                yield line_no, buffer[pos:newline + 1]
                line_no, pos, dropped = line_no + 1, newline + 1, 0


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
    declared_layers = optional_positive_int(num_layers, "num_layers")
    declared_experts = optional_positive_int(num_experts, "num_experts")
    limit = resolve_memory_limit(max_memory)

    sequence_index: dict[Any, int] = {}
    seq_of, layer_of, count_of = array.array("i"), array.array("i"), array.array("i")
    token_of, line_of = array.array("q"), array.array("q")
    experts_flat = array.array("i")
    held = 0

    for line_no, raw in numbered_lines(path_str, progress):
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
            raise TraceError(f"{where}: field 'layer': {id_past_int32('layer', layer)}")
        token = _record_int(record, "token_idx", where)
        if token < 0:
            raise TraceError(f"{where}: field 'token_idx': token_idx {token} is negative")
        if token > TOKEN_MAX:
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
                raise expert_out_of_range(where, expert, declared_experts)

        label = None
        for key in SEQUENCE_KEYS:
            if key in record and record[key] is not None:
                label = record[key]
                if not (isinstance(label, str) or is_int(label)):
                    raise TraceError(f"{where}: field {key!r}: expected a string or integer "
                                     f"sequence label, got {_short(label)}")
                break
        held += _RECORD_BYTES + 4 * len(experts)
        sequence = sequence_index.get(label)
        if sequence is None:
            sequence = sequence_index[label] = len(sequence_index)
            held += LABEL_BYTES + (len(label) if isinstance(label, str) else 0)
        check_memory(held, limit, where, "reading the records up to this line")
        seq_of.append(sequence)
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

_MISSING = object()
#: Bytes one distinct sequence label costs beyond its characters, from reading to the report
#: (its string, the label index, the sequence name and the per-sequence work of the replay):
#: measured as a 1M-label trace's peak over a one-label one's, (1578 - 266) MiB / 10^6.
LABEL_BYTES = 1400


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


def save_jsonl_trace(trace: Trace, path: str | os.PathLike) -> None:
    """One record per call (``sequence`` only when the trace has named sequences; the
    ``experts`` list keeps its ``-1`` padding so ``top_k`` survives the round trip)."""
    named = trace.sequence_names != (None,)
    with open(os.fspath(path), "w", encoding="utf-8") as handle:
        for seq, token, layer, routes in zip(trace.sequence.tolist(), trace.token_idx.tolist(),
                                             trace.layers.tolist(), trace.routes.tolist()):
            record: dict[str, Any] = {}
            if named:
                record["sequence"] = trace.sequence_names[seq]
            record.update(token_idx=token, layer=layer, experts=routes)
            handle.write(json.dumps(record, separators=(",", ":")) + "\n")
