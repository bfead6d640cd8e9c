"""Progress of a sweep's long passes (the replay, the offline optima), as a person reads it: a
pass reports to a :class:`Progress` (:meth:`~Progress.phase`, :meth:`~Progress.update`,
:meth:`~Progress.note`, :meth:`~Progress.close`), and :class:`Bar` draws that on a stream: a
bar with percentage and ETA on a terminal (``tqdm``'s when importable), whole lines only when
redirected. :func:`as_progress` adapts a callback."""

from __future__ import annotations

import shutil
import sys
import time
from typing import Callable, TextIO

__all__ = ["Progress", "Bar", "as_progress"]


class Progress:
    """The interface a long pass reports to; this base class draws nothing (the silent one)."""

    def phase(self, line: str, total: int | None) -> None:
        """A pass starts: ``line`` says what it does, ``total`` counts its units (``None``:
        unknown, no bar). Ends the previous phase, if any."""

    def update(self, done: float, status: str = "") -> None:
        """``done`` of the phase's ``total`` units are complete; ``status`` says where it is."""

    def note(self, line: str) -> None:
        """A passing status before the first phase (e.g. reading the trace): shown on a
        terminal until the next line replaces it, never written to a log."""

    def log(self, line: str) -> None:
        """The line a :meth:`note` shows on a terminal, kept where there is none (a log): the
        work has started, with nothing left to refuse (so a one-line error stays one line)."""

    def close(self) -> None:
        """The last phase ended."""


class _Lines(Progress):
    """A plain ``Callable[[str], None]`` as a :class:`Progress`: called with each phase line
    and each status (the ``progress`` argument :func:`~pallas_cache.sizing.sweep.replay` had
    before this module, kept working)."""

    def __init__(self, write: Callable[[str], None]):
        self.write = write

    def phase(self, line, total):
        self.write(line)

    def update(self, done, status=""):
        if status:
            self.write(status)


def as_progress(progress: Progress | Callable[[str], None] | None) -> Progress:
    """``None`` -> a :class:`Bar` on stderr; a :class:`Progress` -> itself; a callable taking a
    status line -> that callable, called with every phase line and status."""
    if progress is None:
        return Bar()
    if isinstance(progress, Progress):
        return progress
    if callable(progress):
        return _Lines(progress)
    raise TypeError(f"progress must be a Progress, a callable taking a str, or None, got "
                    f"{progress!r}")


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Bar(Progress):
    """Phase lines and, on a terminal, a bar with percentage and ETA.

    Args:
      stream: where to draw (default: ``sys.stderr`` at each write).
      prefix: put before each line, e.g. ``"pallas-cache: "``.
      use_tqdm: draw the terminal bar with ``tqdm`` (default: when it is importable).
      min_interval: seconds between two plain frames (the last frame is always drawn).

    The ETA comes from the rate since the phase's first update, not since its start: the first
    unit of a replay includes compiling, which the remaining units do not repeat.
    """

    def __init__(self, stream: TextIO | None = None, *, prefix: str = "",
                 use_tqdm: bool | None = None, min_interval: float = 0.1):
        self._stream = stream
        self.prefix = prefix
        self.use_tqdm = use_tqdm
        self.min_interval = min_interval
        self._line = None
        self._total = None
        self._tqdm = None
        self._frame_width = 0
        self._drawn_at = -float("inf")
        self._start = self._first = None
        self._done = 0

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    @property
    def tty(self) -> bool:
        """Whether the stream is a terminal (the only place frames are drawn)."""
        isatty = getattr(self.stream, "isatty", None)
        try:
            return bool(isatty and isatty())
        except (ValueError, OSError):  # a closed stream
            return False

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def note(self, line):
        if self.tty and self._line is None:
            self._clear_note()
            text = f"{self.prefix}{line}"[:self._columns() - 1]
            self._write("\r" + text)
            self._frame_width = len(text)

    def log(self, line):
        if not self.tty and self._line is None:
            self._write(f"{self.prefix}{line}\n")

    def _clear_note(self):
        if self._line is None and self._frame_width:
            self._write("\r" + " " * self._frame_width + "\r")
            self._frame_width = 0

    def phase(self, line, total):
        self._end_phase()
        self._clear_note()
        self._write(f"{self.prefix}{line}\n")
        self._line, self._total = line, total
        self._start, self._first, self._done = time.perf_counter(), None, 0
        if total and self.tty and self._tqdm_class() is not None:
            self._tqdm = self._tqdm_class()(
                total=total, file=self.stream, leave=True, ncols=self._columns(),
                nrows=shutil.get_terminal_size().lines,
                bar_format="{percentage:3.0f}%|{bar}| ETA {remaining}{postfix}")

    def _tqdm_class(self):
        if self.use_tqdm is False:
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm

    def update(self, done, status=""):
        if not self._total:
            return
        now = time.perf_counter()
        self._done = done
        if self._first is None:
            self._first = (now, done)
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(status, refresh=False)
            self._tqdm.update(done - self._tqdm.n)
            return
        if not self.tty or (now - self._drawn_at < self.min_interval and done < self._total):
            return
        self._drawn_at = now
        fraction = min(max(done / self._total, 0.0), 1.0)
        frame = f"[{'#' * int(20 * fraction):.<20}] {100 * fraction:3.0f}%  {self._eta(now, done)}"
        if status:
            frame += f"  {status}"
        frame = frame[:self._columns() - 1]
        self._write("\r" + frame.ljust(self._frame_width))
        self._frame_width = len(frame)

    @staticmethod
    def _columns() -> int:
        """The terminal's width, 80 where it reports none (a frame must not wrap; tqdm draws
        nothing on a terminal that reports no size)."""
        return max(shutil.get_terminal_size().columns, 21)

    def _eta(self, now: float, done: float) -> str:
        start, first_done = self._first
        if done >= self._total:
            return f"done in {_clock(now - self._start)}"
        if done <= first_done:
            return "ETA ?"
        return f"ETA {_clock((now - start) / (done - first_done) * (self._total - done))}"

    def _end_phase(self):
        if self._line is None:
            return
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
        elif self._frame_width:
            self._write("\n")
        self._frame_width = 0
        if self._total and not self.tty and self._done >= self._total:  # a log: the duration
            self._write(f"{self.prefix}done in {time.perf_counter() - self._start:.1f} s\n")
        self._line = None

    def close(self):
        """End the phase; after an interruption too (a terminal's frame gets its newline, a
        log no ``done in`` line)."""
        self._end_phase()
        self._clear_note()
