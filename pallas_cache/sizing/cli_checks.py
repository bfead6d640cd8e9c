"""Checks of ``pallas-cache``'s command line that decide without the trace, run before it is read
(each raises ``ValueError`` with the one line the CLI prints, exit 2), the checks of the modeled
numbers once the trace's geometry is known, and the writing of the output (a full disk or a
closed pipe is one line or the pipe's exit, never a traceback)."""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import sys

__all__ = ["COMPILE_BYTES_PER_WIDTH", "COMPILE_BYTES_PER_WIDTH_WIDE", "COMPILE_FACTOR_JAXLIB_0_11",
           "COMPILE_WIDE_ABOVE", "compile_factor",
           "EXIT_BROKEN_PIPE", "INT32_MAX", "ascii_int", "check_batch_memory",
           "check_before_reading", "check_bench_memory", "check_geometry",
           "check_modeled_numbers", "check_step_memory", "exit_without_teardown",
           "output_failed", "use_ascii_ints"]

#: The largest slot count, layer count or expert count the cache state holds (int32).
INT32_MAX = 2**31 - 1
#: Exit status when stdout's reader went away (``| head``): 128 + SIGPIPE, as a shell reports
#: a process the signal ended, and without a message (the reader asked for no more).
EXIT_BROKEN_PIPE = 128 + 13

_ASCII_INT = re.compile(r"[+-]?[0-9]+")
_ASCII_SLOTS = re.compile(r"[0-9]+")


def ascii_int(text: str) -> int:
    """argparse type: an integer in ASCII digits (``int()`` also takes ``'٣'``, and ``'²'``
    fails with Python's own message)."""
    if not _ASCII_INT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (ASCII digits)")
    return int(text)


def use_ascii_ints(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` (and its sub-commands) with every ``type=int`` option read by
    :func:`ascii_int`."""
    for action in parser._actions:  # noqa: SLF001 - argparse exposes no public walk
        if action.type is int:
            action.type = ascii_int
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in action.choices.values():
                use_ascii_ints(sub)
    return parser


def _check_count(flag: str, value, low: int = 1) -> None:
    if value is not None and not low <= value <= INT32_MAX:
        raise ValueError(f"{flag} {value} is outside [{low}, {INT32_MAX}]")


def check_before_reading(args, cost, policies) -> None:
    """Everything the flags alone decide, before the trace is read or generated.

    ``cost`` is the :class:`~pallas_cache.sizing.cost.CostModel` of the flags and ``policies``
    the resolved policy texts.

    Raises:
        ValueError: the one-line reason, naming the flag and the value.
    """
    from pallas_cache.sizing.cli_sizing import check_gpu_policies
    from pallas_cache.sizing.sweep_records import config_grid

    if args.trace is not None and args.trace == "":
        raise ValueError("--trace '' is an empty path (an unset shell variable?); give a trace "
                         "file, or leave --trace out for the synthetic trace")
    if args.trace and args.tokens is not None:
        raise ValueError(f"--tokens {args.tokens} sets the length of a --synthetic trace; a "
                         f"--trace file has its own tokens")
    _check_count("--num-layers", args.num_layers)
    _check_count("--num-experts", args.num_experts)
    if args.num_layers and args.num_experts and args.num_layers * args.num_experts > INT32_MAX:
        raise ValueError(f"--num-layers {args.num_layers} x --num-experts {args.num_experts} = "
                         f"{args.num_layers * args.num_experts} experts, above the cache's "
                         f"{INT32_MAX}")
    for text in args.cache_size:
        _cache_size_text(text, cost)
    for text in policies:
        if not re.fullmatch(r"[a-z]+(:[0-9eE+.-]+)?", str(text)):
            raise ValueError(f"bad policy {text!r}: expected full, fraction:Q (0 <= Q <= 1) or "
                             f"cap:N, in ASCII digits")
    if not config_grid([1], policies, args.order, args.admission, args.eviction):
        raise ValueError(f"admission reuse needs eviction lru; got --eviction "
                         f"{' '.join(args.eviction)}")
    check_gpu_policies(cost, policies)
    check_modeled_numbers(cost, 1, 1)


def _cache_size_text(text: str, cost) -> None:
    """One ``--cache-size`` value: ``auto``, a slot count in ``[1, 2**31)``, or bytes that make
    at least one and at most ``2**31 - 1`` slots of the expert size."""
    from pallas_cache.sizing.units import parse_bytes

    if text == "auto":
        return
    if _ASCII_SLOTS.fullmatch(text):
        if not 1 <= int(text) <= INT32_MAX:
            raise ValueError(f"cache size {text} is outside [1, {INT32_MAX}] slots")
        return
    if re.fullmatch(r"\s*-\s*[0-9.]+\s*[a-zA-Z]*\s*", text):
        raise ValueError(f"cache size {text!r} must be positive: a slot count (at least one "
                         f"layer's experts) or bytes such as 12GiB")
    try:
        wanted = parse_bytes(text)
    except ValueError:
        raise ValueError(f"cache size {text!r} is not auto, a slot count (ASCII digits) or "
                         f"bytes such as 12GiB") from None
    if cost.expert_bytes is None:
        raise ValueError(f"cache size {text!r} is in bytes: give --model or --expert-bytes to "
                         f"turn it into slots")
    slots = wanted // cost.expert_bytes
    if not 1 <= slots <= INT32_MAX:
        raise ValueError(f"cache size {text} is {slots} slots of {cost.expert_bytes} bytes, "
                         f"outside [1, {INT32_MAX}]")


def check_modeled_numbers(cost, num_layers: int, top_k: int) -> None:
    """Refuse an expert size and bandwidths whose modeled time overflows a float: the most a
    token can take, every route of every layer copied and computed on the CPU at the slower
    bandwidth, must be finite (a record would otherwise hold ``inf``, which JSON cannot)."""
    width = cost.expert_bytes
    rates = [rate for rate in (cost.link_bandwidth, cost.cpu_bandwidth) if rate]
    if not width or not rates:
        return
    worst = float(width) * num_layers * top_k * 2e3 / min(rates)
    gpu = ((getattr(cost, "gpu_layer_seconds", None) or 0.0)
           + top_k * (getattr(cost, "gpu_expert_seconds", None) or 0.0))
    worst += float(gpu) * num_layers * 1e3
    if not math.isfinite(worst):
        raise ValueError(f"the expert size {float(width):.4g} bytes over the bandwidth "
                         f"{min(rates):g} B/s gives a modeled time that overflows a float; "
                         f"check --expert-bytes and the bandwidths")
    fixed = float(cost.cpu_fixed_seconds or 0.0)
    if not math.isfinite(worst + fixed * num_layers * 2e3):
        raise ValueError(f"--cpu-fixed-cost {fixed:g}s per layer-call gives a modeled time that "
                         f"overflows a float (a row would show none); check --cpu-fixed-cost")


def check_geometry(num_layers: int, num_experts: int, sizes) -> None:
    """The trace's geometry and the cache sizes against the cache state's int32 counts."""
    if num_layers * num_experts > INT32_MAX:
        raise ValueError(f"{num_layers} layers x {num_experts} experts = "
                         f"{num_layers * num_experts} experts, above the cache's {INT32_MAX}")
    too_big = [size for size in sizes if size > INT32_MAX]
    if too_big:
        raise ValueError(f"cache size {too_big[0]} is above the cache's {INT32_MAX} slots")


#: Bytes of the replay step's temporaries per (distinct route, slot) pair of one configuration:
#: the victim search compares each of a call's ``K' = min(top_k, E)`` distinct routes with every
#: one of the bucket's ``C`` slots (int32 and bool tables, a few alive at once).
STEP_BYTES_PER_ROUTE_SLOT = 16
#: The same per (distinct route, expert of the layer) pair: the call's one-hot rows.
STEP_BYTES_PER_ROUTE_EXPERT = 8
#: Copies of one chunk's ``[chunk_calls, top_k]`` int32 routes alive while it runs (the host
#: slice, the padded chunk, the device copy).
CHUNK_ROUTE_COPIES = 3
#: Bytes XLA:CPU takes to compile the replay step, per ``top_k ** 1.5``: the step's selections
#: are unrolled over a call's routes, so the program, and the compiler's memory, grow faster than
#: the width (measured: 32 routes +51 MiB, 64 +166 MiB, 128 +463 MiB, 256 +1.3 GiB over a
#: minimal run, about 0.32 MiB x K**1.5; docs/design.md). ``_WIDE`` where the layer's experts or
#: the cache's slots pass :data:`COMPILE_WIDE_ABOVE` (a two-level selection: about 1.0 MiB x
#: K**1.5); both rounded up.
COMPILE_BYTES_PER_WIDTH = 3 * 2**17
COMPILE_BYTES_PER_WIDTH_WIDE = 9 * 2**17
#: Experts or slots above which the step's selections take their two-level form.
COMPILE_WIDE_ABOVE = 256
#: How many times as much XLA:CPU in jaxlib 0.11 and later takes to compile the same step
#: (measured with jaxlib 0.12.0.1: 16, 32, 56 and 64 routes +150 MiB, +770 MiB, +1.4 GiB and
#: +1.6 GiB over a minimal run, at most 4.25 MiB x K**1.5, against 0.38 MiB with 0.10.2;
#: docs/design.md), rounded up.
COMPILE_FACTOR_JAXLIB_0_11 = 12


def compile_factor() -> int:
    """:data:`COMPILE_FACTOR_JAXLIB_0_11` where the installed jaxlib is 0.11 or later, else 1
    (read from the package's metadata: JAX is not imported)."""
    from importlib import metadata

    try:
        major, minor = (int(part) for part in metadata.version("jaxlib").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return COMPILE_FACTOR_JAXLIB_0_11
    return COMPILE_FACTOR_JAXLIB_0_11 if (major, minor) >= (0, 11) else 1


def check_step_memory(sizes, configs_per_size: int, num_experts: int, top_k: int,
                      limit: int, held: int = 0, flag: str | None = None,
                      hit_counts: bool = False) -> None:
    """Refuse a replay whose step would need more than ``limit`` to compile and run, before
    any is allocated: a call that routes ``top_k`` experts (a trace with one call of 100k routes
    pads every call to that width) costs the compiler about ``top_k ** 1.5`` times
    :data:`COMPILE_BYTES_PER_WIDTH`, every configuration of a bucket ``K' x C`` and ``K' x E``
    tables, and each chunk its routes. ``held``: bytes alive beside them (the trace and the
    cache states, :func:`~pallas_cache.sizing.cli_args.check_state_memory`'s), counted too.
    ``flag``: the flag that set ``top_k`` (``--batch B``), named before the size.
    ``hit_counts``: each configuration also holds the GPU-time model's packed table of calls
    (input, output and one copy of it)."""
    from pallas_cache.sizing.sweep import DEFAULT_CHUNK_CALLS, capacity_buckets
    from pallas_cache.sizing.sweep_program import MAX_HIT_DISTINCT, hit_table_size
    from pallas_cache.sizing.traces import check_memory

    distinct = min(top_k, num_experts)
    if hit_counts and distinct > MAX_HIT_DISTINCT:
        raise ValueError(f"--gpu-layer-ms/--gpu-expert-ms count calls of at most "
                         f"{MAX_HIT_DISTINCT} distinct experts; these route up to {distinct}")
    chunk = DEFAULT_CHUNK_CALLS * top_k * 4 * CHUNK_ROUTE_COPIES
    for bucket in reversed(capacity_buckets(sizes)):
        size, count = bucket[-1], configs_per_size * len(bucket)
        step = count * distinct * (size * STEP_BYTES_PER_ROUTE_SLOT
                                   + num_experts * STEP_BYTES_PER_ROUTE_EXPERT)
        if hit_counts:
            step += count * hit_table_size(distinct) * 4 * 3
        per_width = (COMPILE_BYTES_PER_WIDTH_WIDE if max(size, num_experts) > COMPILE_WIDE_ABOVE
                     else COMPILE_BYTES_PER_WIDTH)
        compile_bytes = math.ceil(per_width * compile_factor() * top_k ** 1.5)
        where = f"{flag}, --cache-size {size}" if flag else f"--cache-size {size}"
        check_memory(held + step + chunk + compile_bytes, limit, where,
                     f"compiling and running the replay step of {count} configuration(s) on "
                     f"calls of up to {top_k} routes ({distinct} distinct x {size} slots each)"
                     + (", with the trace and the cache states" if held else ""))


def check_batch_memory(batches, sizes, configs_per_size: int, trace, limit: int,
                       held: int, hit_counts: bool = False) -> None:
    """Refuse a ``--batch B`` whose merged calls would not fit ``limit``, before they are built:
    a batched decode's calls carry ``B * top_k`` route columns (every active request's token),
    so the merged trace (at most one merged call per call of the trace) and the replay step
    that reads those columns are checked as :func:`check_step_memory` checks a wide trace.
    ``held``: the trace and the cache states, alive beside them."""
    from pallas_cache.sizing.traces import trace_bytes

    for batch in batches:
        width = batch * trace.top_k
        merged = trace_bytes(trace.num_calls, width)
        check_step_memory(sizes, configs_per_size, trace.num_experts, width, limit,
                          held + merged, flag=f"--batch {batch}", hit_counts=hit_counts)


#: Copies of ``bench-bandwidth``'s arrays alive at once: the host buffer and its device copy
#: (B_link); the CPU partial's bank of four experts as drawn, scaled and cast, with its device
#: copy (T_cpu; one expert matrix for B_cpu is less).
BENCH_LINK_COPIES = 2
BENCH_BANK_COPIES = 2 * 4


def check_bench_memory(mib: int, d_model: int, d_expert: int, limit: int) -> None:
    """Refuse ``bench-bandwidth`` flags whose arrays cannot fit ``limit`` (the machine's memory),
    before any is allocated: ``--mib`` sizes the copied buffer, ``--d-model x --d-expert`` the
    float32 expert matrices. ValueError, the one line the CLI prints."""
    from pallas_cache.sizing.units import format_bytes

    link = BENCH_LINK_COPIES * mib * 2**20
    bank = BENCH_BANK_COPIES * d_model * d_expert * 4
    for nbytes, what in ((link, f"--mib {mib}: the copied buffer and its device copy"),
                         (bank, f"--d-model {d_model} x --d-expert {d_expert}: four float32 "
                                f"expert matrices and their copies")):
        if nbytes > limit:
            raise ValueError(f"{what} would need about {format_bytes(nbytes)}, above this "
                             f"machine's {format_bytes(limit)} of memory")


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


def exit_without_teardown(status: int) -> None:
    """Flush the output and end the process with ``status`` without the interpreter's teardown
    (a thread still inside XLA's C++ code would abort it: see
    :func:`~pallas_cache.sizing.cli_replay.exit_now_if_compiling`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
