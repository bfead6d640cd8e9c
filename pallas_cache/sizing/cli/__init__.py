"""The ``pallas-cache`` command line (``pallas-cache = pallas_cache.sizing.cli:console_main``):
:mod:`.entry` (the entry points), :mod:`.parser`, :mod:`.request` (``replay``'s typed request
and every check made before reading), :mod:`.sizes` (what a ``--cache-size`` means, decided
once), :mod:`.replay` (load -> sizes -> configurations -> memory checks -> replay ->
findings -> output), :mod:`.findings` (what the results tell beyond the rows, computed),
:mod:`.output` (printed), :mod:`.devices`, :mod:`.checks`, :mod:`.bench` and :mod:`.decode`
(the bench commands, each with its typed request), :mod:`.process` (signals, exit, the compile
cache) and :mod:`.names`.

This module's first lines put a handler on SIGINT that only records it, so that a Ctrl-C while
the rest imports is reported by the entry point as one line and exit 130, not a traceback from
inside an import; its last lines put Python's handler back and hand what it recorded to
:data:`.entry.IMPORT_INTERRUPTS`.
"""

from __future__ import annotations

import signal
import threading

_INTERRUPTS: list[int] = []


def _record(signum, frame) -> None:
    _INTERRUPTS.append(signum)


_BEFORE = None
if (threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    _BEFORE = signal.signal(signal.SIGINT, _record)

from pallas_cache.sizing.cli.entry import IMPORT_INTERRUPTS, console_main, main  # noqa: E402
from pallas_cache.sizing.cli.process import (EXIT_INTERRUPTED,  # noqa: E402
                                             NO_COMPILE_CACHE_ENV, compile_cache_dir,
                                             private_cache_problem)

if _BEFORE is not None:
    signal.signal(signal.SIGINT, _BEFORE)
IMPORT_INTERRUPTS.extend(_INTERRUPTS)

__all__ = ["EXIT_INTERRUPTED", "NO_COMPILE_CACHE_ENV", "compile_cache_dir", "console_main",
           "main", "private_cache_problem"]
