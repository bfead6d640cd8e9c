"""Argument checks the GPU scripts share (gpu_check.py, profiler_graph_fault.py): each returns
why a value cannot be used, or ``None``, so a script refuses it in one line, exit 2, before any
work (a GPU lease's time is not spent on a run whose report cannot be written)."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def out_error(path: Path | None) -> str | None:
    """Why the report cannot be written at ``path`` (``None``: no report, or it can): its
    folder is made now, as the report's write would make it, and must be writable, and
    ``path`` must not be a folder."""
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"--out {path}: cannot make its folder {path.parent}: {error.strerror or error}"
    if path.is_dir():
        return f"--out {path} is a folder; give a file"
    if not os.access(path.parent, os.W_OK):
        return f"--out {path}: its folder {path.parent} is not writable"
    return None


def seconds_error(text: str, value: float) -> str | None:
    """Why ``value`` (read from ``text``) is no time limit: not above 0, or past what a wait
    can take (``inf``; ``threading.TIMEOUT_MAX``)."""
    if not value > 0:
        return f"{text!r} must be above 0"
    if not value <= threading.TIMEOUT_MAX:
        return f"{text!r} must be a finite number of seconds (at most {threading.TIMEOUT_MAX:g})"
    return None
