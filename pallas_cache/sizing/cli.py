"""The ``pallas-cache`` command: ``replay`` (size an expert cache by replaying a routing trace,
:mod:`~pallas_cache.sizing.cli_replay`), ``scenarios`` and ``bench-bandwidth``; the console
script (:func:`console_main`) keeps JAX's compiled programs in the user's cache directory, and
:func:`main`, called in-process, never does. The parser is :mod:`~pallas_cache.sizing.cli_args`.
"""

from __future__ import annotations

import signal
import threading

#: SIGINTs that arrived while this module was imported (the console script imports it before
#: :func:`console_main` runs): reported by :func:`console_main` and :func:`main` as one line and
#: exit 130, where Python's own handler would have printed a traceback from inside the import.
_INTERRUPTED_WHILE_IMPORTING: list[int] = []


def _defer_interrupt(signum, frame) -> None:
    _INTERRUPTED_WHILE_IMPORTING.append(signum)


_HANDLER_BEFORE_IMPORT = None
if (threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    _HANDLER_BEFORE_IMPORT = signal.signal(signal.SIGINT, _defer_interrupt)

import errno  # noqa: E402 - after the handler: a Ctrl-C from here on is one line
import os  # noqa: E402
import stat  # noqa: E402
import sys  # noqa: E402

from pallas_cache.sizing.cli_checks import exit_without_teardown, output_failed  # noqa: E402
from pallas_cache.sizing.cli_args import (NO_COMPILE_CACHE_ENV, UsageError,  # noqa: E402
                                          build_parser)
from pallas_cache.sizing.units import format_bandwidth  # noqa: E402

if _HANDLER_BEFORE_IMPORT is not None:
    signal.signal(signal.SIGINT, _HANDLER_BEFORE_IMPORT)

# Nothing above imports JAX or NumPy: the parser answers --help, --version and a refused command
# line at once, and JAX's import (seconds) starts with the work, inside the Ctrl-C handling.

__all__ = ["EXIT_INTERRUPTED", "NO_COMPILE_CACHE_ENV", "compile_cache_dir", "console_main",
           "main", "private_cache_problem"]

#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130


def run_replay(args) -> int:
    """``pallas-cache replay``: :func:`pallas_cache.sizing.cli_replay.run_replay`, imported when
    the work starts (it imports JAX), inside the CLI's Ctrl-C handling."""
    from pallas_cache.sizing import cli_replay

    return cli_replay.run_replay(args)


def _scenarios(_args) -> int:
    from pallas_cache.sizing.scenarios import promotion_table

    rows = promotion_table()
    width = max(len(name) for name, _, _ in rows)
    print("Promotion scenarios: fraction 0.4, L=8, E=16, S=64, top-8, 256 steps per active layer")
    print(f"{'scenario'.ljust(width)}  {'NONE':>6}  {'PROMOTE_ONE':>11}")
    for name, none, promote in rows:
        print(f"{name.ljust(width)}  {none:>6}  {promote:>11}")
    return 0


def _bench_bandwidth(args) -> int:
    default_bank = args.d_expert is None
    if default_bank:
        args.d_expert = BENCH_D_EXPERT
    if min(args.mib, args.d_model, args.d_expert, args.repeats) < 1:
        print("pallas-cache: --mib, --d-model, --d-expert and --repeats must be >= 1",
              file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(f"pallas-cache: bench-bandwidth: {line}", file=sys.stderr, flush=True)

    from pallas_cache.sizing.units import format_bytes, format_duration

    d_expert = args.d_expert
    if default_bank:
        d_expert, shrunk = bench_bank_columns(args.d_model, d_expert, _available_memory())
        if shrunk:
            progress(f"the default bank shrinks to --d-expert {d_expert} to fit this machine's "
                     f"available memory")
    from pallas_cache.sizing.cli_checks import check_bench_memory
    from pallas_cache.sizing.traces.memory import DEFAULT_MEMORY_FRACTION, default_memory_limit

    try:
        check_bench_memory(args.mib, args.d_model, d_expert,
                           int(default_memory_limit() / DEFAULT_MEMORY_FRACTION))
    except ValueError as error:
        print(f"pallas-cache: {error}", file=sys.stderr)
        return 2
    progress("starting JAX")
    import jax

    from pallas_cache.sizing.bandwidth import bank_bytes, cpu_partial_timing, link_bandwidth

    device = jax.devices()[0]
    progress(f"B_link: {args.repeats + 1} copies of {args.mib}MiB to {device.platform}:"
             f"{device.id}")
    link = link_bandwidth(args.mib * 2**20, args.repeats, device)
    progress(f"B_cpu, T_cpu: a host bank of {MOST_CPU_EXPERTS} experts of {args.d_model} x "
             f"{d_expert} float32 ({format_bytes(bank_bytes(args.d_model, d_expert))}), "
             f"{args.repeats + 1} runs of 8 layer-calls per count")
    timing = cpu_partial_timing(args.d_model, d_expert, args.repeats, progress=progress)
    cpu, fixed = timing.bandwidth, timing.fixed
    print(f"device: {device.platform}:{device.id} ({device.device_kind})")
    where = "host -> device" if device.platform != "cpu" else "host -> host (no accelerator)"
    print(f"B_link ~ {format_bandwidth(link)}  ({where} copy of {args.mib}MiB, pageable memory, "
          f"median of {args.repeats})")
    slope = (f"{format_bytes(timing.expert_bytes)} per "
             f"{format_duration(timing.per_expert)}, the slope of a line through its time"
             if timing.per_expert > 0 else
             f"no positive slope through its time (noise?): {MOST_CPU_EXPERTS} experts' bytes "
             f"over their whole {format_duration(timing.seconds[-1])}, a lower bound")
    print(f"B_cpu  ~ {format_bandwidth(cpu)}  (the library's cpu_partial, one token, float32 "
          f"x @ W experts of {args.d_model} x {d_expert}: {slope} with 1-{MOST_CPU_EXPERTS} CPU "
          f"experts; median of {args.repeats})")
    print(f"T_cpu  ~ {format_duration(fixed)}  (fixed cost per layer-call of cpu_partial: the "
          f"intercept of that line; median of {args.repeats})")
    print(f"flags: --link-bandwidth {format_bandwidth(link)} --cpu-bandwidth {format_bandwidth(cpu)}"
          f" --cpu-fixed-cost {format_duration(fixed)}")
    return 0


#: CPU experts of bench-bandwidth's bank (pallas_cache.sizing.bandwidth.MOST, which imports
#: NumPy; a test checks they agree).
MOST_CPU_EXPERTS = 4
#: bench-bandwidth's default expert matrix: half a Mixtral-8x7B expert matrix (4096 x 14336),
#: 112 MiB, far past any CPU cache, so it streams from memory as the whole one does.
BENCH_D_EXPERT = 7168
#: What bench-bandwidth's peak adds to twice its bank (the bank, and the rows the CPU path copies
#: out of it): the runtime, the program, the link copy's buffers.
BENCH_MARGIN_BYTES = 768 * 2**20


def bench_bank_columns(d_model: int, d_expert: int, available: int | None) -> tuple[int, bool]:
    """``(d_expert, shrunk)``: the default bank's columns, halved while above 256 until twice the
    bank plus :data:`BENCH_MARGIN_BYTES` fits half of ``available`` bytes (unknown: as is)."""
    shrunk = False
    while (available is not None and d_expert > 256
           and 2 * MOST_CPU_EXPERTS * d_model * d_expert * 4 + BENCH_MARGIN_BYTES > available // 2):
        d_expert, shrunk = d_expert // 2, True
    return d_expert, shrunk


def _available_memory() -> int | None:
    """Bytes of memory available now (``MemAvailable``), or ``None`` where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def compile_cache_dir() -> str:
    """Where the console script keeps compiled programs: ``$XDG_CACHE_HOME/pallas-cache/jax``,
    or ``~/.cache/pallas-cache/jax`` when ``XDG_CACHE_HOME`` is unset or not absolute."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pallas-cache", "jax")


def _enable_compile_cache() -> None:
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
    import tempfile

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


def main(argv=None) -> int:
    """Run ``pallas-cache``; returns the exit status (``130`` after Ctrl-C, with one line on
    stderr and no partial output file). Never touches JAX's persistent compilation cache (the
    console script, :func:`console_main`, does)."""
    return _main(argv, compile_cache=False)


def console_main() -> int:
    """The ``pallas-cache`` console script: :func:`main` with JAX's persistent compilation cache
    on (see :func:`compile_cache_dir`) unless ``--no-compile-cache`` is given or
    ``PALLAS_CACHE_NO_COMPILE_CACHE`` is set to anything but ``""`` or ``"0"``."""
    try:
        status = _main(None, compile_cache=True)
        try:  # a failed write is reported here, not as a traceback in the interpreter's exit
            sys.stdout.flush()
        except OSError as error:
            status = output_failed(error)
    except KeyboardInterrupt:  # between the replay's own handling and here
        print("pallas-cache: interrupted", file=sys.stderr)
        status = EXIT_INTERRUPTED
    # Everything is written or refused: a Ctrl-C from here on would only turn the exit into a
    # traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if status == EXIT_INTERRUPTED:
        # Whatever background thread the interrupted phase had (a precompile, the replay's
        # lanes, the offline optima) may still be inside XLA's C++ code, where the
        # interpreter's teardown would abort it (exit 134) after the CLI printed its line.
        exit_without_teardown(status)
    replay = sys.modules.get("pallas_cache.sizing.cli_replay")  # only a replay compiles
    if replay is not None:
        replay.exit_now_if_compiling(status)
    return status


def _main(argv, *, compile_cache: bool) -> int:
    try:
        if _INTERRUPTED_WHILE_IMPORTING:
            _INTERRUPTED_WHILE_IMPORTING.clear()
            raise KeyboardInterrupt
        args = build_parser().parse_args(argv)
        if (compile_cache and not args.no_compile_cache
                and os.environ.get(NO_COMPILE_CACHE_ENV, "") in ("", "0")):
            _enable_compile_cache()
        if args.command == "replay":
            return run_replay(args)
        if args.command == "bench-bandwidth":
            return _bench_bandwidth(args)
        return _scenarios(args)
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pallas-cache: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except MemoryError as error:  # an estimate fell short: still one line, never a traceback
        print(f"pallas-cache: out of memory: {error or 'an allocation failed'} (lower the sizes, "
              f"or give --max-memory to have them checked)", file=sys.stderr)
        return 2
    except OSError as error:
        if not _is_output_error(error):
            raise
        return output_failed(error)


def _is_output_error(error: OSError) -> bool:
    """Whether ``error`` is a failed write of the output (a closed pipe, a full or failing
    device), which :func:`~pallas_cache.sizing.cli_checks.output_failed` reports."""
    return isinstance(error, BrokenPipeError) or error.errno in (
        errno.EPIPE, errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG)


if __name__ == "__main__":
    sys.exit(console_main())
