"""Routing traces: the :class:`Trace` type, its readers (one module per format), the geometry
rules and the memory budget every reader checks before it allocates."""

from pallas_cache.sizing.traces.arrays import load_array_trace, load_vllm_trace
from pallas_cache.sizing.traces.files import (ARRAY_SUFFIXES, JSONL_SUFFIXES, PARQUET_SUFFIXES,
                                              TRACE_FORMATS, load_trace, save_trace,
                                              trace_format_of)
from pallas_cache.sizing.traces.jsonl import load_jsonl_trace
from pallas_cache.sizing.traces.memory import (RUN_FIXED_BYTES, MemoryLimitError,
                                               ProcessBudget, check_memory,
                                               default_memory_limit, format_bytes,
                                               resolve_memory_limit, trace_bytes)
from pallas_cache.sizing.traces.records import (FIELD_KEYS, SEQUENCE_KEYS, parse_fields,
                                                trace_from_records)
from pallas_cache.sizing.traces.base import Trace, TraceError

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
    "FIELD_KEYS",
    "SEQUENCE_KEYS",
    "MemoryLimitError",
    "ProcessBudget",
    "RUN_FIXED_BYTES",
    "default_memory_limit",
    "resolve_memory_limit",
    "check_memory",
    "trace_bytes",
    "format_bytes",
]
