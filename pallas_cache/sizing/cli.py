"""The ``pallas-cache`` command: ``replay`` (size an expert cache by replaying a routing trace,
:mod:`~pallas_cache.sizing.cli_replay`), ``scenarios`` and ``bench-bandwidth``; the console
script (:func:`console_main`) keeps JAX's compiled programs in the user's cache directory, and
:func:`main`, called in-process, never does. The parser is :mod:`~pallas_cache.sizing.cli_args`.
"""

from __future__ import annotations

import os
import sys

from pallas_cache.sizing.cli_args import NO_COMPILE_CACHE_ENV, UsageError, build_parser
from pallas_cache.sizing.cli_replay import exit_now_if_compiling, run_replay
from pallas_cache.sizing.units import format_bandwidth

__all__ = ["EXIT_INTERRUPTED", "NO_COMPILE_CACHE_ENV", "compile_cache_dir", "console_main",
           "main"]

#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130


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
    if min(args.mib, args.d_model, args.d_expert, args.repeats) < 1:
        print("pallas-cache: --mib, --d-model, --d-expert and --repeats must be >= 1",
              file=sys.stderr)
        return 2
    import jax

    from pallas_cache.sizing.bandwidth import cpu_bandwidth, cpu_fixed_cost, link_bandwidth
    from pallas_cache.sizing.units import format_duration

    device = jax.devices()[0]
    link = link_bandwidth(args.mib * 2**20, args.repeats, device)
    cpu = cpu_bandwidth(args.d_model, args.d_expert, args.repeats)
    fixed, per_expert = cpu_fixed_cost(args.d_model, args.d_expert, args.repeats)
    print(f"device: {device.platform}:{device.id} ({device.device_kind})")
    where = "host -> device" if device.platform != "cpu" else "host -> host (no accelerator)"
    print(f"B_link ~ {format_bandwidth(link)}  ({where} copy of {args.mib}MiB, pageable memory, "
          f"median of {args.repeats})")
    print(f"B_cpu  ~ {format_bandwidth(cpu)}  (one-token float32 x @ W, W {args.d_model} x "
          f"{args.d_expert}, median of {args.repeats})")
    print(f"T_cpu  ~ {format_duration(fixed)}  (fixed cost per layer-call of cpu_partial: the "
          f"intercept of a line through its time with 1-4 CPU experts, "
          f"{format_duration(per_expert)} per expert; median of {args.repeats})")
    print(f"flags: --link-bandwidth {format_bandwidth(link)} --cpu-bandwidth {format_bandwidth(cpu)}"
          f" --cpu-fixed-cost {format_duration(fixed)}")
    return 0


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
    left as it is; one that cannot be created means running without the cache."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return
    path = compile_cache_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def main(argv=None) -> int:
    """Run ``pallas-cache``; returns the exit status (``130`` after Ctrl-C, with one line on
    stderr and no partial output file). Never touches JAX's persistent compilation cache (the
    console script, :func:`console_main`, does)."""
    return _main(argv, compile_cache=False)


def console_main() -> int:
    """The ``pallas-cache`` console script: :func:`main` with JAX's persistent compilation cache
    on (see :func:`compile_cache_dir`) unless ``--no-compile-cache`` is given or
    ``PALLAS_CACHE_NO_COMPILE_CACHE`` is set to anything but ``""`` or ``"0"``."""
    status = _main(None, compile_cache=True)
    exit_now_if_compiling(status)
    return status


def _main(argv, *, compile_cache: bool) -> int:
    try:
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


if __name__ == "__main__":
    sys.exit(console_main())
