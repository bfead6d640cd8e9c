"""Routing records read as columns (JSONL lines, Parquet rows) into a :class:`Trace`."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from pallas_cache.sizing.traces.geometry import (OUTLIER_FLOOR, check_geometry, check_outlier,
                                                 expert_out_of_range, id_past_int32, next_largest,
                                                 optional_positive_int)
from pallas_cache.sizing.traces.memory import check_memory, resolve_memory_limit, trace_bytes
from pallas_cache.sizing.traces.base import Trace
from pallas_cache.sizing.traces.errors import TraceError
from pallas_cache.validate import INT32_MAX

__all__ = ["SEQUENCE_KEYS", "FIELD_KEYS", "TOKEN_MAX", "parse_fields", "trace_from_records"]

#: Keys that name a record's sequence, in order of precedence.
SEQUENCE_KEYS = ("sequence", "problem_id")

#: The JSONL record keys a file may name otherwise (:func:`parse_fields`, ``--field``).
FIELD_KEYS = ("layer", "token_idx", "experts", "sequence")

TOKEN_MAX = 2**62


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
    declared_layers = optional_positive_int(num_layers, "num_layers")
    declared_experts = optional_positive_int(num_experts, "num_experts")
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
                                    ("token_idx", token_idx, 0, TOKEN_MAX + 1)):
        if int(column.min()) < low or int(column.max()) >= high:
            where, index = first((column < low) | (column >= high))
            value = int(column[index])
            if value < 0:
                raise TraceError(f"{where}: field {name!r}: {name} {value} is negative")
            if name == "layer" and declared_layers is not None and value >= declared_layers:
                raise TraceError(f"{where}: field 'layer': layer {value} is outside "
                                 f"[0, {declared_layers}) (num_layers={declared_layers})")
            if name == "layer":
                raise TraceError(f"{where}: field 'layer': {id_past_int32('layer', value)}")
            raise TraceError(f"{where}: field {name!r}: {name} {value} is too large "
                             f"(limit 2**62)")
    if experts.size:
        limit_expert = declared_experts if declared_experts is not None else INT32_MAX
        if int(experts.min()) < -1 or int(experts.max()) >= limit_expert:
            where, index = first((experts < -1) | (experts >= limit_expert), flat=True)
            raise expert_out_of_range(where, int(experts[index]), declared_experts)
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
        check_outlier("layer", max_layer, next_largest(layer_file, max_layer), layer_where)
    if declared_experts is None and max_expert >= OUTLIER_FLOOR:
        check_outlier("expert", max_expert, next_largest(flat, max_expert), expert_where)
    geometry = (declared_layers or max_layer + 1, declared_experts or max_expert + 1)
    # Name the line of the inferred size that makes the geometry large.
    if declared_layers is not None and declared_experts is not None:
        geometry_where, note = path_str, " (declared)"
    elif declared_experts is not None or (declared_layers is None
                                          and geometry[0] >= geometry[1]):
        geometry_where, note = layer_where, ""
    else:
        geometry_where, note = expert_where, ""
    check_geometry(*geometry, limit, geometry_where, note)
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
