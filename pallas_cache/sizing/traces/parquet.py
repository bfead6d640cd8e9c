"""Parquet routing traces: the JSONL records as columns, read and written with the optional
``pyarrow`` (``pip install 'pallas-cache[parquet]'``), imported only when a Parquet file is
touched."""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from pallas_cache.sizing.traces.memory import check_memory, resolve_memory_limit
from pallas_cache.sizing.traces.records import FIELD_KEYS, SEQUENCE_KEYS, trace_from_records
from pallas_cache.sizing.traces.base import Trace
from pallas_cache.sizing.traces.errors import TraceError
from pallas_cache.sizing.traces.jsonl import LABEL_BYTES

__all__ = ["load_parquet_trace", "save_parquet_trace", "PARQUET_EXTRA"]

#: The install command named when ``pyarrow`` is missing.
PARQUET_EXTRA = "pip install 'pallas-cache[parquet]'"
#: Bytes per row held while reading (sequence, token, layer, position, count), plus 4 per expert.
_ROW_BYTES = 28


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ValueError(f"reading or writing a Parquet trace needs pyarrow: {PARQUET_EXTRA}") \
            from None
    return pyarrow, pyarrow.parquet


def _int64(values, path: str, name: str, row_of) -> np.ndarray:
    """An integer column as int64; a uint64 value above int64's range is refused naming its row
    (``row_of(index)``) rather than wrapped (``2**64 - 1`` would read as the padding ``-1``)."""
    if values.dtype == np.uint64:
        too_big = values > np.iinfo(np.int64).max
        if too_big.any():
            index = int(np.argmax(too_big))
            raise TraceError(f"{path}: row {row_of(index)}: column {name!r}: {int(values[index])}"
                             f" is outside the int64 range of a layer, token or expert id")
    return values.astype(np.int64, copy=False)


def load_parquet_trace(path: str | os.PathLike, *, num_layers: int | None = None,
                       num_experts: int | None = None, max_memory: int | None = None,
                       fields: Mapping[str, str] | None = None) -> Trace:
    """Read a Parquet trace: one row per (token, layer) call.

    ==========================  ====================================  ========
    column                      type                                  required
    ==========================  ====================================  ========
    ``layer``                   integer                               yes
    ``token_idx``               integer                               yes
    ``experts``                 list of integer (``-1`` = padding)    yes
    ``sequence``/``problem_id`` string or integer (null: no label)    no
    ==========================  ====================================  ========

    Other columns are ignored; ``fields`` (``--field``) names columns that are called otherwise,
    as for JSONL. Rows are ordered, checked and padded exactly as JSONL records
    (:func:`~pallas_cache.sizing.traces.records.trace_from_records`); messages name the file, the
    0-based row (``df.iloc[row]`` in pandas) and the column. The schema and the row count are
    checked, and the memory the records need is estimated from the file's metadata, before any
    data is read.

    Args and Returns: as :func:`~pallas_cache.sizing.traces.load_trace`.

    Raises:
        ValueError: ``pyarrow`` is not installed (naming the extra), or ``fields`` names an
            unknown key.
        TraceError: an unreadable file, a missing column or one of the wrong type (naming the
            file, the column and its type), a null value (naming the row), no rows, or as
            :func:`~pallas_cache.sizing.traces.records.trace_from_records`.
    """
    pa, pq = _pyarrow()
    path_str = os.fspath(path)
    fields = dict(fields or {})
    unknown = set(fields) - set(FIELD_KEYS)
    if unknown:
        raise ValueError(f"fields: unknown keys {sorted(unknown)}; the keys are "
                         f"{', '.join(FIELD_KEYS)}")
    limit = resolve_memory_limit(max_memory)
    try:
        reader = pq.ParquetFile(path_str)
        schema = reader.schema_arrow
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise TraceError(f"{path_str}: not a readable Parquet file: {exc}") from None

    column = {key: fields.get(key, key) for key in ("layer", "token_idx", "experts")}
    for key, name in column.items():
        if name not in schema.names:
            raise TraceError(f"{path_str}: column {name!r}: missing (required columns: "
                             f"{', '.join(repr(n) for n in column.values())}; the file has "
                             f"{', '.join(schema.names) or 'none'})")
        kind = schema.field(name).type
        if key == "experts":
            ok = (pa.types.is_list(kind) or pa.types.is_large_list(kind)
                  or pa.types.is_fixed_size_list(kind)) and pa.types.is_integer(kind.value_type)
        else:
            ok = pa.types.is_integer(kind)
        if not ok:
            want = "a list of integers" if key == "experts" else "integers"
            raise TraceError(f"{path_str}: column {name!r}: expected {want}, got {kind}")
    sequence_candidates = [fields["sequence"]] if "sequence" in fields else list(SEQUENCE_KEYS)
    sequence_column = next((n for n in sequence_candidates if n in schema.names), None)
    if sequence_column is not None:
        kind = schema.field(sequence_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or pa.types.is_integer(kind)):
            raise TraceError(f"{path_str}: column {sequence_column!r}: expected strings or "
                             f"integers (sequence labels), got {kind}")

    metadata = reader.metadata
    rows = metadata.num_rows
    if rows == 0:
        raise TraceError(f"{path_str}: the trace is empty (no rows)")
    values = sum(metadata.row_group(g).column(_leaf(metadata, g, column["experts"])).num_values
                 for g in range(metadata.num_row_groups))
    held = rows * _ROW_BYTES + 4 * values
    check_memory(held, limit, path_str, f"reading {rows} rows with {values} expert entries")

    names = [column["layer"], column["token_idx"], column["experts"]]
    table = reader.read(columns=names + ([sequence_column] if sequence_column else []))
    parts: dict[str, Any] = {}
    for key in ("layer", "token_idx"):
        data = table.column(column[key]).combine_chunks()
        _no_nulls(pa, data, path_str, column[key])
        parts[key] = _int64(data.to_numpy(zero_copy_only=False), path_str, column[key],
                            lambda index: index)
    lists = table.column(column["experts"]).combine_chunks()
    _no_nulls(pa, lists, path_str, column["experts"])
    if pa.types.is_fixed_size_list(lists.type):
        counts = np.full(len(lists), lists.type.list_size, np.int64)
    else:
        counts = lists.value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
    flat = lists.flatten()
    if flat.null_count:
        index = int(np.argmax(flat.is_null().to_numpy(zero_copy_only=False)))
        row = int(np.searchsorted(np.cumsum(counts), index, side="right"))
        raise TraceError(f"{path_str}: row {row}: column {column['experts']!r}: a null expert "
                         f"id (use -1 for padding)")
    experts = _int64(flat.to_numpy(zero_copy_only=False), path_str, column["experts"],
                     lambda index: int(np.searchsorted(np.cumsum(counts), index, side="right")))
    if sequence_column is not None:
        labels = table.column(sequence_column).combine_chunks().dictionary_encode(
            null_encoding="encode")  # indices in order of first appearance
        sequence = labels.indices.to_numpy(zero_copy_only=False).astype(np.int32)
        sequence_names = tuple(labels.dictionary.to_pylist())
        held += sum(LABEL_BYTES + (len(name) if isinstance(name, str) else 0)
                    for name in sequence_names)
        check_memory(held, limit, path_str, f"{rows} rows with {len(sequence_names)} distinct "
                     f"sequence labels")
    else:
        sequence, sequence_names = np.zeros(rows, np.int32), (None,)
    del table, lists, flat

    try:
        return trace_from_records(
            path_str, sequence=sequence, token_idx=parts["token_idx"], layer=parts["layer"],
            experts=experts, counts=counts, sequence_names=sequence_names,
            positions=np.arange(rows), locate=lambda row: f"{path_str}: row {row}", unit="row",
            num_layers=num_layers, num_experts=num_experts, max_memory=limit, held=held)
    except TraceError as error:
        if type(error) is not TraceError or not fields:
            raise
        message = str(error)
        for key, name in fields.items():
            message = message.replace(f"field '{key}'", f"field '{name}'")
        raise TraceError(message) from None


def save_parquet_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Write ``trace`` as Parquet (columns ``sequence`` when the trace has named sequences,
    ``token_idx``, ``layer``, ``experts`` keeping the ``-1`` padding); :func:`load_parquet_trace`
    reads it back equal.

    Raises:
        ValueError: ``pyarrow`` is not installed (naming the extra).
    """
    pa, pq = _pyarrow()
    columns: dict[str, Any] = {}
    if trace.sequence_names != (None,):
        columns["sequence"] = pa.array([trace.sequence_names[i] for i in trace.sequence.tolist()])
    columns["token_idx"] = pa.array(trace.token_idx)
    columns["layer"] = pa.array(trace.layers)
    columns["experts"] = pa.FixedSizeListArray.from_arrays(
        pa.array(trace.routes.reshape(-1)), trace.top_k)
    pq.write_table(pa.table(columns), os.fspath(path))


def _leaf(metadata: Any, group: int, name: str) -> int:
    """The index of the leaf column of ``name`` (a list's values) in a row group."""
    row_group = metadata.row_group(group)
    for index in range(row_group.num_columns):
        if row_group.column(index).path_in_schema.split(".")[0] == name:
            return index
    return 0


def _no_nulls(pa: Any, data: Any, path_str: str, name: str) -> None:
    if data.null_count:
        row = int(np.argmax(data.is_null().to_numpy(zero_copy_only=False)))
        raise TraceError(f"{path_str}: row {row}: column {name!r}: null (every row needs a "
                         f"value)")
