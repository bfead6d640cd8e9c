"""The ``pallas-cache`` command's entry points: :func:`main` (in-process, never touching JAX's
persistent compilation cache) and :func:`console_main` (the console script, which keeps compiled
programs in the user's cache directory). They parse the command line, build the request of
``replay`` (:mod:`~pallas_cache.sizing.cli.request`) and run it
(:mod:`~pallas_cache.sizing.cli.replay`), ``bench-bandwidth``
(:mod:`~pallas_cache.sizing.cli.bench`) or ``scenarios``; every refusal is printed here, one
line and exit 2."""

from __future__ import annotations

import codecs
import os
import signal
import sys

from pallas_cache.sizing.cli.parser import UsageError, build_parser
from pallas_cache.sizing.cli.process import (EXIT_INTERRUPTED, compile_cache_wanted,
                                             enable_compile_cache, exit_now_if_compiling,
                                             exit_without_teardown, is_output_error,
                                             output_failed)

# Nothing above imports JAX or NumPy: the parser answers --help, --version and a refused command
# line at once, and JAX's import (seconds) starts with the work, inside the Ctrl-C handling.

__all__ = ["IMPORT_INTERRUPTS", "console_main", "main", "run_replay"]

#: SIGINTs that arrived while the package imported (its ``__init__`` records them): reported by
#: the next :func:`main` or :func:`console_main` as Ctrl-C, one line and exit 130.
IMPORT_INTERRUPTS: list[int] = []


def run_replay(request) -> int:
    """``pallas-cache replay``: :func:`pallas_cache.sizing.cli.replay.run_replay`, imported when
    the work starts (it imports JAX), inside the CLI's Ctrl-C handling."""
    from pallas_cache.sizing.cli import replay

    return replay.run_replay(request)


def _replay(args) -> int:
    from pallas_cache.sizing.cli.request import build_request

    return run_replay(build_request(args))


def _bench_bandwidth(args) -> int:
    from pallas_cache.sizing.cli.bench import build_bandwidth_request, run_bench

    return run_bench(build_bandwidth_request(args))


def _bench_decode(args) -> int:
    from pallas_cache.sizing.cli.decode import build_decode_request, run_bench_decode

    return run_bench_decode(build_decode_request(args))


def _scenarios(_args) -> int:
    from pallas_cache.sizing.scenarios import promotion_table

    rows = promotion_table()
    width = max(len(name) for name, _, _ in rows)
    print("Promotion scenarios: fraction 0.4, L=8, E=16, S=64, top-8, 256 steps per active layer")
    print(f"{'scenario'.ljust(width)}  {'NONE':>6}  {'PROMOTE_ONE':>11}")
    for name, none, promote in rows:
        print(f"{name.ljust(width)}  {none:>6}  {promote:>11}")
    return 0


_COMMANDS = {"replay": _replay, "bench-bandwidth": _bench_bandwidth,
             "bench-decode": _bench_decode, "scenarios": _scenarios}


def main(argv=None) -> int:
    """Run ``pallas-cache``; returns the exit status (``130`` after Ctrl-C, with one line on
    stderr and no partial output file). Never touches JAX's persistent compilation cache (the
    console script, :func:`console_main`, does)."""
    return _main(argv, compile_cache=False)


def console_main() -> int:
    """The ``pallas-cache`` console script: :func:`main` with JAX's persistent compilation cache
    on (see :func:`~pallas_cache.sizing.cli.process.compile_cache_dir`) unless
    ``--no-compile-cache`` is given or ``PALLAS_CACHE_NO_COMPILE_CACHE`` is set to anything but
    ``""`` or ``"0"``."""
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
    exit_now_if_compiling(status)  # only a replay compiles
    return status


#: The non-ASCII characters of the CLI's text and what a stream that cannot encode them gets.
_ASCII_FALLBACK = {"§": "sec. ", "µ": "u", "×": "x", "≤": "<=", "≥": ">=", "—": "--", "–": "-",
                   "→": "->", "…": "...", "·": ".", "≈": "~", "±": "+-", "−": "-"}


def _ascii_fallback(error: UnicodeEncodeError):
    """The codecs error handler of :func:`_printable_streams`: known characters spelled in
    ASCII, any other as ``?``."""
    bad = error.object[error.start:error.end]
    return "".join(_ASCII_FALLBACK.get(ch, "?") for ch in bad), error.end


def _printable_streams() -> None:
    """Make stdout and stderr print the CLI's text (the legend's ``§``, ``µs``) in any stream
    encoding (``PYTHONIOENCODING=ascii``, a C locale): where the encoding lacks them, they are
    written in ASCII rather than ending the run in a UnicodeEncodeError."""
    try:
        codecs.lookup_error("pallas_cache_ascii")
    except LookupError:
        codecs.register_error("pallas_cache_ascii", _ascii_fallback)
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None)
        if not encoding or not hasattr(stream, "reconfigure"):
            continue
        try:
            "".join(_ASCII_FALLBACK).encode(encoding)
        except UnicodeEncodeError:
            stream.reconfigure(errors="pallas_cache_ascii")
        except LookupError:
            continue


def _check_jax_platforms() -> None:
    """A ``JAX_PLATFORMS`` naming no platform this JAX can start: one line, before any work
    (JAX's own report is a RuntimeError from the first computation, 70 lines deep). Unset, or
    the CPU alone (always there), it is not checked: JAX is then imported with the work, not
    before a refusal the parser or the request gives."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if {name.strip() for name in platforms.split(",")} <= {"", "cpu"}:
        return
    import jax

    try:
        jax.devices()
    except RuntimeError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(f"pallas-cache: JAX_PLATFORMS={platforms!r}: {first}") from None


def _main(argv, *, compile_cache: bool) -> int:
    try:
        if IMPORT_INTERRUPTS:
            IMPORT_INTERRUPTS.clear()
            raise KeyboardInterrupt
        _printable_streams()
        args = build_parser().parse_args(argv)
        if compile_cache and compile_cache_wanted(args.no_compile_cache):
            enable_compile_cache()
        _check_jax_platforms()
        return _COMMANDS[args.command](args)
    except UsageError as error:  # every refusal: one line, exit 2
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
        if not is_output_error(error):
            raise
        return output_failed(error)
