"""The memory budget of a trace: the limit, and the estimates checked before an array exists."""

from __future__ import annotations

import os

import numpy as np

from pallas_cache.sizing.traces.errors import TraceError

__all__ = ["MemoryLimitError", "DEFAULT_MEMORY_FRACTION", "FALLBACK_MEMORY_LIMIT",
           "BYTES_PER_FLAT_ID", "RUN_FIXED_BYTES", "ProcessBudget", "default_memory_limit",
           "resolve_memory_limit", "format_bytes", "trace_bytes", "check_memory"]

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
#: The peak resident memory of a minimal ``pallas-cache replay`` (a trace of a few records, on the
#: CPU backend): the interpreter, NumPy, JAX, and XLA compiling and running the replay's program,
#: whatever the inputs add. ``--max-memory`` limits the whole process, so the inputs may add the
#: limit less this, and a limit below it is refused. Measured at 366 to 458 MiB (two series of
#: fresh runs, medians 410 and 444 MiB, benchmarks/RESULTS.md), rounded up (docs/design.md).
RUN_FIXED_BYTES = 512 * 2**20


class MemoryLimitError(TraceError):
    """A trace, or the tables its geometry sizes, would need more memory than the limit allows.

    Raised before the array is allocated; the message names the file and the line (JSONL) or
    array (NumPy) that set the size, the estimate and the limit.
    """


class ProcessBudget(int):
    """What a memory limit on the whole process leaves for the inputs: ``limit - fixed`` bytes,
    the int every estimate is checked against, which keeps ``limit`` and ``fixed`` for the
    messages. Build it with :meth:`of`."""

    limit: int
    fixed: int

    @classmethod
    def of(cls, limit: int, fixed: int = RUN_FIXED_BYTES) -> "ProcessBudget":
        """The budget ``limit - fixed`` (``ValueError`` when ``limit < fixed``)."""
        if limit < fixed:
            raise ValueError(f"memory limit {format_bytes(limit)} is below the "
                             f"{format_bytes(fixed)} a minimal run takes")
        budget = super().__new__(cls, int(limit) - int(fixed))
        budget.limit, budget.fixed = int(limit), int(fixed)
        return budget


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
    """``None`` -> :func:`default_memory_limit`; a :class:`ProcessBudget` as it is (it may be 0);
    else ``max_memory`` bytes (a positive int)."""
    if max_memory is None:
        return default_memory_limit()
    if isinstance(max_memory, ProcessBudget):
        return max_memory
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
    ``nbytes > limit``. A :class:`ProcessBudget` is named as the process's limit less the fixed
    cost."""
    if nbytes > limit:
        if isinstance(limit, ProcessBudget):
            bound = (f"the memory limit of {format_bytes(limit.limit)} less the "
                     f"{format_bytes(limit.fixed)} a minimal run takes")
        else:
            bound = f"the memory limit of {format_bytes(limit)}"
        raise MemoryLimitError(f"{where}: {what} would need about {format_bytes(nbytes)}, above "
                               f"{bound} (raise it with max_memory= or --max-memory)")
