"""Routing traces: the :class:`Trace` type, the format registry (:mod:`.formats`) with one reader
module per format, the geometry rules and the memory budget every reader checks before it
allocates.

The names load on first use (PEP 562): the command line's parser reads the format registry
without importing NumPy.
"""

from __future__ import annotations

from pallas_cache.sizing.lazy import lazy_names

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

#: The module of each public name.
_HOMES = {
    "Trace": ".base",
    "TraceError": ".errors",
    "load_trace": ".formats", "trace_format_of": ".formats", "save_trace": ".formats",
    "JSONL_SUFFIXES": ".formats", "ARRAY_SUFFIXES": ".formats", "PARQUET_SUFFIXES": ".formats",
    "TRACE_FORMATS": ".formats",
    "load_jsonl_trace": ".jsonl",
    "load_array_trace": ".arrays", "load_vllm_trace": ".arrays",
    "parse_fields": ".records", "trace_from_records": ".records", "FIELD_KEYS": ".records",
    "SEQUENCE_KEYS": ".records",
    "MemoryLimitError": ".memory", "ProcessBudget": ".memory", "RUN_FIXED_BYTES": ".memory",
    "default_memory_limit": ".memory", "resolve_memory_limit": ".memory", "check_memory": ".memory",
    "trace_bytes": ".memory", "format_bytes": ".memory",
}


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
