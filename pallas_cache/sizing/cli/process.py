"""The ``pallas-cache`` process: how it ends (exit statuses, a failed write of the output, leaving
without the interpreter's teardown while XLA works on a thread), Ctrl-C (a latch that never loses
one) and JAX's persistent compilation cache (a private folder, or none). No JAX, no NumPy."""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys
import tempfile
import threading

from pallas_cache.sizing.progress import Progress

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_INTERRUPTED", "NO_COMPILE_CACHE_ENV", "CheckedProgress",
           "InterruptLatch", "compile_cache_dir", "compile_cache_wanted", "compile_started",
           "enable_compile_cache", "exit_now_if_compiling", "exit_without_teardown",
           "is_output_error", "output_failed", "private_cache_problem"]

#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130
#: Exit status when stdout's reader went away (``| head``): 128 + SIGPIPE, as a shell reports
#: a process the signal ended, and without a message (the reader asked for no more).
EXIT_BROKEN_PIPE = 128 + 13


#: Set to anything but ``""`` or ``"0"`` to keep the console script off JAX's persistent
#: compilation cache (as ``--no-compile-cache`` does).
NO_COMPILE_CACHE_ENV = "PALLAS_CACHE_NO_COMPILE_CACHE"


def output_failed(error: OSError) -> int:
    """The exit status after stdout could not be written: the pipe's (no message) when its
    reader went away, else 2 with one line. Stdout is pointed at ``/dev/null`` so the
    interpreter's final flush fails no more."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    if isinstance(error, BrokenPipeError) or error.errno == errno.EPIPE:
        return EXIT_BROKEN_PIPE
    print(f"pallas-cache: cannot write the output: {error.strerror or error}", file=sys.stderr)
    return 2


def is_output_error(error: OSError) -> bool:
    """Whether ``error`` is a failed write of the output (a closed pipe, a full or failing
    device), which :func:`output_failed` reports."""
    return isinstance(error, BrokenPipeError) or error.errno in (
        errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG)


def exit_without_teardown(status: int) -> None:
    """Flush the output and end the process with ``status`` without the interpreter's teardown
    (a thread still inside XLA's C++ code would abort it: see
    :func:`exit_now_if_compiling`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


#: One event per precompile thread, set by the thread as it ends. (``Thread.is_alive()`` is no
#: witness: a ``join()`` interrupted by Ctrl-C can leave it False while the thread compiles.)
_COMPILES: list[threading.Event] = []


def compile_started() -> threading.Event:
    """An event for a precompile thread to set as it ends (:func:`exit_now_if_compiling` waits
    for none, but leaves at once while one is unset)."""
    finished = threading.Event()
    _COMPILES.append(finished)
    return finished


def exit_now_if_compiling(status: int) -> None:
    """End the process with ``status`` at once if a precompile thread is still running.

    The interpreter's normal exit stops daemon threads wherever they are; one inside XLA's C++
    code then aborts the process (``terminate called ...``, exit 134) after the CLI has printed
    its line. A refusal starts no such thread, but a Ctrl-C can arrive while one compiles, so
    the console script flushes its output and leaves without the interpreter's teardown."""
    if not all(finished.is_set() for finished in _COMPILES):
        exit_without_teardown(status)


class InterruptLatch:
    """Ctrl-C that is never lost. Python raises ``KeyboardInterrupt`` at the next bytecode of the
    main thread, which may run inside a callback of XLA's compiler that swallows it (a SIGINT
    during the first compile can let the replay finish and write its plot). The latch also
    records the signal, and :meth:`check` raises again wherever the CLI looks (every progress
    report, and before any output is written). Installed only over Python's default handler, in
    the main thread.

    The next bytecode may also be a finalizer's or a weak reference's callback (the garbage
    collector runs them anywhere), where Python cannot raise: it prints "Exception ignored in"
    with a traceback and goes on. While the latch is installed, such an ignored
    ``KeyboardInterrupt`` is not printed (the latch holds it; :meth:`check` raises it); every
    other ignored exception goes to the hook that was there."""

    def __init__(self):
        self.fired = False
        self._previous = None
        self._previous_unraisable = None

    def __enter__(self):
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous_unraisable = sys.unraisablehook
            sys.unraisablehook = self._unraisable
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc_info):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            if sys.unraisablehook == self._unraisable:
                sys.unraisablehook = self._previous_unraisable
        return False

    def _handle(self, signum, frame):
        self.fired = True
        raise KeyboardInterrupt

    def _unraisable(self, unraisable) -> None:
        if self.fired and isinstance(unraisable.exc_value, KeyboardInterrupt):
            return
        self._previous_unraisable(unraisable)

    def check(self) -> None:
        if self.fired:
            raise KeyboardInterrupt


class CheckedProgress(Progress):
    """A :class:`Progress` that checks the interrupt latch at every report."""

    def __init__(self, inner: Progress, latch: InterruptLatch):
        self.inner, self.latch = inner, latch

    def phase(self, line, total):
        self.latch.check()
        self.inner.phase(line, total)

    def update(self, done, status=""):
        self.latch.check()
        self.inner.update(done, status)

    def note(self, line):
        self.latch.check()
        self.inner.note(line)

    def log(self, line):
        self.latch.check()
        self.inner.log(line)

    def close(self):
        self.inner.close()


def compile_cache_dir() -> str:
    """Where the console script keeps compiled programs: ``$XDG_CACHE_HOME/pallas-cache/jax``,
    or ``~/.cache/pallas-cache/jax`` when ``XDG_CACHE_HOME`` is unset or not absolute."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pallas-cache", "jax")


def compile_cache_wanted(no_compile_cache: bool) -> bool:
    """Whether the console script keeps compiled programs: not with ``--no-compile-cache``, nor
    with :data:`NO_COMPILE_CACHE_ENV` set to anything but ``""`` or ``"0"``."""
    return not no_compile_cache and os.environ.get(NO_COMPILE_CACHE_ENV, "") in ("", "0")


def enable_compile_cache() -> None:
    """Turn on JAX's persistent compilation cache in :func:`compile_cache_dir`, for programs of
    any size and compile time (a replay's programs take seconds to compile, a reread takes
    milliseconds). A cache directory the user set for JAX (``JAX_COMPILATION_CACHE_DIR``) is
    left as it is. A compiled program is native code the next run executes, so the folder is
    used only where no one else can write it (:func:`private_cache_problem`); otherwise, and
    where it cannot be created or written, one warning line (shown with ``-q`` too) and the run
    goes on without the cache."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return
    path = compile_cache_dir()
    problem = private_cache_problem(path, os.path.dirname(os.path.dirname(path)))
    if problem is not None:
        print(f"pallas-cache: warning: running without the compile cache: {problem}",
              file=sys.stderr)
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def private_cache_problem(path: str, base: str) -> str | None:
    """Make ``path`` (a folder under ``base``) a private cache folder; ``None`` when it is one,
    else the one-line reason it is not used.

    Missing folders from ``base`` down are created ``0700``. ``base`` and every folder below it
    down to ``path`` must belong to the user and be writable by neither group nor others (anyone
    who can write one could swap in a program the next run executes); ``path`` must be writable
    (a real write: permission bits say nothing on a read-only mount)."""
    base, path = os.path.abspath(base), os.path.abspath(path)
    relative = os.path.relpath(path, base)
    folders = [base] + [os.path.join(base, *relative.split(os.sep)[:i + 1])
                        for i in range(len(relative.split(os.sep)))]
    user = os.geteuid()
    for folder in folders:
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError as error:
            return f"cannot create {folder}: {error.strerror or error}"
        try:
            info = os.stat(folder)
        except OSError as error:
            return f"cannot read {folder}: {error.strerror or error}"
        if not os.path.isdir(folder):
            return f"{folder} is not a folder"
        if info.st_uid != user:
            return f"{folder} belongs to another user (uid {info.st_uid})"
        if info.st_mode & 0o022:
            return (f"{folder} is writable by {'group' if info.st_mode & 0o020 else 'others'} "
                    f"(mode {oct(info.st_mode & 0o777)}); chmod go-w it to use the cache")
    problem = _resolved_chain_problem(path, base, user)
    if problem is not None:
        return problem
    try:
        handle, probe = tempfile.mkstemp(dir=path, prefix=".pallas-cache-probe-")
        os.close(handle)
        os.remove(probe)
    except OSError as error:
        return f"cannot write in {path}: {error.strerror or error}"
    return None


def _resolved_chain_problem(path: str, base: str, user: int) -> str | None:
    """The folders ``path`` and ``base`` really are (every symlink resolved) and every parent of
    them, up to ``/``: each must belong to the user or to root, and none may be writable by
    group or others, except a sticky one (``/tmp``: no one renames another's entry there) above
    the cache folder itself. A symlink that leads into a folder someone else can write, where
    anyone can rename the target and put another folder in its place, is refused here (the
    checks above follow the link and see only the target)."""
    real_path = os.path.realpath(path)
    seen = set()
    for real in (os.path.realpath(base), real_path):
        parts = real.split(os.sep)
        for i in range(1, len(parts) + 1):
            folder = os.sep.join(parts[:i]) or os.sep
            if folder in seen:
                continue
            seen.add(folder)
            try:
                info = os.lstat(folder)
            except OSError as error:
                return f"cannot read {folder}: {error.strerror or error}"
            via = "" if folder == path else f" (on the way to {path})"
            if info.st_uid not in (user, 0):
                return f"{folder}{via} belongs to another user (uid {info.st_uid})"
            sticky = info.st_mode & stat.S_ISVTX and folder != real_path
            if info.st_mode & 0o022 and not sticky:
                who = " and ".join(name for name, bit in (("group", 0o020), ("others", 0o002))
                                   if info.st_mode & bit)
                return (f"{folder}{via} is writable by {who} (mode "
                        f"{oct(info.st_mode & 0o777)}); chmod go-w it to use the cache")
    return None
