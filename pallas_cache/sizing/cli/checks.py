"""The checks of ``pallas-cache``'s command line, each raising ``ValueError`` with the one line
the CLI prints (exit 2): those the flags alone decide, run before the trace is read
(:func:`check_source`, :func:`check_sweep` and the ones they name), and those of the modeled numbers and the
memory a replay would take, once the trace's geometry is known. Imports no JAX or NumPy (its
functions import what they need): ``bench-bandwidth`` refuses its flags with them before they
start."""

from __future__ import annotations

import math
import os
import re
import tempfile
from importlib import metadata

from pallas_cache.formats import bytes_per_expert
from pallas_cache.sizing.cli.parser import DEFAULT_PLOT_NAME
from pallas_cache.sizing.units import NUMBER, format_bytes, parse_duration, scaled

__all__ = ["COMPILE_BYTES_PER_WIDTH", "COMPILE_BYTES_PER_WIDTH_WIDE", "COMPILE_FACTOR_JAXLIB_0_11",
           "COMPILE_WIDE_ABOVE", "INT32_MAX", "check_batch_memory",
           "check_bench_memory", "check_gpu_policies", "check_grid",
           "check_knn_legend", "check_modeled_numbers", "check_per_layer",
           "check_plot_path", "check_source", "check_state_memory", "check_step_memory",
           "check_sweep", "clamped",
           "compile_factor", "milliseconds", "policy_warnings"]

#: The largest slot count, layer count or expert count the cache state holds (int32).
INT32_MAX = 2**31 - 1


def _check_count(flag: str, value, low: int = 1) -> None:
    if value is not None and not low <= value <= INT32_MAX:
        raise ValueError(f"{flag} {value} is outside [{low}, {INT32_MAX}]")


def check_source(path: str | None, layers: int | None, experts: int | None) -> None:
    """The trace's flags, before it is read or generated: ``path`` is ``--trace`` (``None`` for
    a synthetic trace), ``layers`` and ``experts`` the ``--num-layers`` and ``--num-experts``
    given.

    Raises:
        ValueError: the one-line reason, naming the flag and the value.
    """
    if path is not None and path == "":
        raise ValueError("--trace '' is an empty path (an unset shell variable?); give a trace "
                         "file, or leave --trace out for the synthetic trace")
    _check_count("--num-layers", layers)
    _check_count("--num-experts", experts)
    if layers and experts and layers * experts > INT32_MAX:
        raise ValueError(f"--num-layers {layers} x --num-experts {experts} = "
                         f"{layers * experts} experts, above the cache's {INT32_MAX}")


def check_sweep(cost, policies, axes) -> None:
    """The sweep's flags, before the trace is read or generated: ``cost`` the
    :class:`~pallas_cache.sizing.sweep.cost.CostModel` of the flags, ``policies`` the resolved
    policy texts and ``axes`` the orders, admissions and evictions (enum members).

    Raises:
        ValueError: the one-line reason, naming the flag and the value.
    """
    from pallas_cache.sizing.sweep.records import config_grid

    for text in policies:
        if not re.fullmatch(r"[a-z]+(:[0-9eE+.-]+)?", str(text)):
            raise ValueError(f"bad policy {text!r}: expected full, fraction:Q (0 <= Q <= 1) or "
                             f"cap:N, in ASCII digits")
    check_grid(config_grid([1], policies, *axes), axes[2])
    check_gpu_policies(cost, policies)
    check_modeled_numbers(cost, 1, 1)


def check_grid(configs, evictions) -> None:
    """An empty grid of configurations: every admission was ``reuse``, which only LRU takes
    (``evictions``: the :class:`~pallas_cache.Eviction` members swept)."""
    if not configs:
        raise ValueError(f"admission reuse needs eviction lru; got --eviction "
                         f"{' '.join(eviction.value for eviction in evictions)}")


def check_plot_path(path: str) -> str:
    """The file ``--plot`` will write, checked now: matplotlib importable, a known image format,
    an existing, writable directory, and an existing file there writable and replaceable (the
    plot is renamed over it). A directory gets
    :data:`~pallas_cache.sizing.cli.parser.DEFAULT_PLOT_NAME` inside it.

    Raises:
        ValueError: the one-line reason.
    """
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'pallas-cache[plot]'") from None

    if os.path.isdir(path):
        path = os.path.join(path, DEFAULT_PLOT_NAME)
    elif path.endswith(("/", os.sep)):
        raise ValueError(f"--plot {path}: no such directory")
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in formats:
        raise ValueError(f"--plot {path}: unknown image format "
                         f"{('.' + extension) if extension else '(no extension)'}; use one of "
                         f"{', '.join('.' + f for f in formats)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--plot {path}: no such directory {folder}")
    try:  # a real write: permission bits say nothing to root or on a read-only mount
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".pallas-cache-probe-")
        os.close(handle)
        os.remove(probe)
    except OSError as error:
        raise ValueError(f"--plot {path}: cannot write in {folder}: "
                         f"{error.strerror or error}") from None
    if os.path.lexists(path):
        if not os.access(path, os.W_OK, follow_symlinks=False):
            raise ValueError(f"--plot {path}: the existing file is not writable")
        try:
            _rename_aside_and_back(path, folder)
        except OSError as error:
            raise ValueError(f"--plot {path}: cannot replace the existing file: "
                             f"{error.strerror or error}") from None
    return path


def _rename_aside_and_back(path: str, folder: str) -> None:
    """Rename the existing ``path`` to a temporary name in ``folder`` and back: the checks a
    rename over it meets (an immutable file, a sticky directory, a read-only mount) are the
    checks this meets, and the file ends where it was, same inode, same bytes."""
    handle, aside = tempfile.mkstemp(dir=folder, prefix=".pallas-cache-probe-")
    os.close(handle)
    try:
        os.replace(path, aside)
    except OSError:
        os.remove(aside)
        raise
    try:
        os.replace(aside, path)
    except OSError as error:
        raise OSError(error.errno, f"{error.strerror}; the file is now {aside}") from None


def policy_warnings(policies) -> list[str]:
    """One line per ``fraction:Q`` whose clamping or rounding changes what it means
    (docs/semantics.md §5.3: ``q`` clamps to ``[0, 1]`` and is kept in 1/65536 steps)."""
    from pallas_cache.policy import ONE
    from pallas_cache.sizing.sweep.records import parse_policy

    lines = []
    for text in policies:
        kind, _, value = str(text).partition(":")
        try:
            requested, f16 = float(value), int(parse_policy(text).fraction16)
        except ValueError:
            continue  # not a fraction, or malformed: config_grid reports it
        if kind != "fraction":
            continue
        if f16 == 0 and requested != 0:
            lines.append(f"pallas-cache: warning: {text} means fetch fraction 0 (q clamps to "
                         f"[0, 1] in steps of 1/{ONE}): the split fetches no miss")
        elif f16 == ONE and requested > 1:
            lines.append(f"pallas-cache: warning: {text} means fetch fraction 1 (q clamps to "
                         f"[0, 1]): the split fetches every miss, as 'full'")
    return lines


def clamped(policy: str) -> str:
    """``fraction:Q`` as the fraction it runs when clamping or rounding changes it
    (``fraction:1.5`` -> ``fraction:1``, ``fraction:-1`` -> ``fraction:0``; see
    :func:`policy_warnings`), so a row shows what it ran; anything else unchanged."""
    from pallas_cache.policy import ONE
    from pallas_cache.sizing.sweep.records import parse_policy

    kind, _, value = policy.partition(":")
    if kind != "fraction":
        return policy
    try:
        requested, f16 = float(value), int(parse_policy(policy).fraction16)
    except ValueError:
        return policy  # malformed: config_grid reports it
    if f16 == 0 and requested != 0:
        return "fraction:0"
    if f16 == ONE and requested > 1:
        return "fraction:1"
    return policy


_BARE_MILLISECONDS = re.compile(rf"\s*([+-]?(?:{NUMBER}|nan|inf|infinity))\s*", re.IGNORECASE)


def milliseconds(flag: str, text: str) -> float:
    """A ``--gpu-*-ms`` value in seconds: a bare number (ASCII digits, as every flag reads
    them) is milliseconds, or a duration with its unit (``70us``); finite and at least 0. Both
    read the decimal exactly: ``0.07`` and ``0.07ms`` are ``7e-05`` s."""
    bare = _BARE_MILLISECONDS.fullmatch(text)
    if bare is not None:
        seconds = scaled(bare.group(1), "1e-3")
    else:
        try:
            seconds = parse_duration(text, finite=False)
        except ValueError:
            raise ValueError(f"{flag} {text!r}: expected milliseconds such as 0.07 in ASCII "
                             f"digits (or a duration such as 70us)") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{flag} {text!r}: must be a finite time of at least 0 ms")
    return seconds + 0.0  # -0 is 0


def check_gpu_policies(cost, policies) -> None:
    """With the GPU's time and no ``--cpu-bandwidth``, every policy must copy every miss
    (``full``): another leaves experts to the CPU, whose time is then unknown (ValueError)."""
    from pallas_cache.policy import ONE
    from pallas_cache.sizing.sweep.records import parse_policy

    if not cost.gpu or cost.cpu_bandwidth is not None:
        return
    for policy in policies:
        if int(parse_policy(policy).fraction16) != ONE:
            raise ValueError(f"--gpu-layer-ms/--gpu-expert-ms time the CPU partial of policy "
                             f"{policy}: give --cpu-bandwidth, or --policy full")


def check_knn_legend(fmt: str, evictions, batched, parallel: str | None) -> None:
    """``--route-knn-legend`` ends the legend of an LRU-only table of one-token calls; refuse it
    where there is no such legend (ValueError, one line). ``evictions``: the
    :class:`~pallas_cache.Eviction` members swept."""
    if fmt != "table":
        raise ValueError(f"--route-knn-legend is a line of the table's legend; --format {fmt} "
                         f"has none")
    from pallas_cache.evictions import Eviction

    if set(evictions) != {Eviction.LRU}:
        raise ValueError(f"--route-knn-legend compares route_knn with an LRU-only sweep; "
                         f"--eviction {' '.join(eviction.value for eviction in evictions)} "
                         f"shows each eviction's rows")
    if batched:
        raise ValueError("--route-knn-legend is not computed for --batch; add --eviction lru "
                         "route_knn to see its rows")
    if parallel == "expert":
        raise ValueError("--route-knn-legend is a line of the one-device table's legend; "
                         "--parallel expert prints a table per device without it (add "
                         "--eviction lru route_knn to see its rows)")


def check_per_layer(batched, parallel: str | None) -> None:
    """``--per-layer`` gives the layers of one device's one-token replay; refuse it where the
    rows are another's (ValueError, one line)."""
    if batched:
        raise ValueError("--per-layer is not computed for --batch (the rows of a batched "
                         "decode); leave out one or the other")
    if parallel == "expert":
        raise ValueError("--per-layer is not computed for --parallel expert (a table per "
                         "device and the busiest device's rows); leave out one or the other")


def check_modeled_numbers(cost, num_layers: int, top_k: int) -> None:
    """Refuse an expert size and bandwidths whose modeled time overflows a float: the most a
    token can take, every route of every layer copied and computed on the CPU at the slower
    bandwidth, must be finite (a record would otherwise hold ``inf``, which JSON cannot)."""
    width = cost.expert_bytes
    rates = [rate for rate in (cost.link_bandwidth, cost.cpu_bandwidth) if rate]
    if not width or not rates:
        return
    worst = float(width) * num_layers * top_k * 2e3 / min(rates)
    if not math.isfinite(worst):
        raise ValueError(f"the expert size {float(width):.4g} bytes over the bandwidth "
                         f"{min(rates):g} B/s gives a modeled time that overflows a float; "
                         f"check --expert-bytes and the bandwidths")
    layer = getattr(cost, "gpu_layer_seconds", None) or 0.0
    expert = getattr(cost, "gpu_expert_seconds", None) or 0.0
    worst += (float(layer) + top_k * float(expert)) * num_layers * 1e3
    if not math.isfinite(worst):
        flags = [flag for flag, value in (("--gpu-layer-ms", layer), ("--gpu-expert-ms", expert))
                 if value]
        raise ValueError(f"--gpu-layer-ms {layer * 1e3:g} and --gpu-expert-ms "
                         f"{expert * 1e3:g} over {num_layers} layers of top-{top_k} give a "
                         f"modeled time per token that overflows a float; check "
                         f"{' and '.join(flags)}")
    fixed = float(cost.cpu_fixed_seconds or 0.0)
    if not math.isfinite(worst + fixed * num_layers * 2e3):
        raise ValueError(f"--cpu-fixed-cost {fixed:g}s per layer-call gives a modeled time that "
                         f"overflows a float (a row would show none); check --cpu-fixed-cost")


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
    try:
        major, minor = (int(part) for part in metadata.version("jaxlib").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return COMPILE_FACTOR_JAXLIB_0_11
    return COMPILE_FACTOR_JAXLIB_0_11 if (major, minor) >= (0, 11) else 1


#: Bytes of one cache state per flat id (slot map, recency, routing histogram and prefill
#: snapshot: int32 [L, E] each) and per slot (id_of_slot, usage: int32 [S] each).
_STATE_BYTES_PER_ID = 16
_STATE_BYTES_PER_SLOT = 8


def check_state_memory(sizes, configs_per_size: int, num_layers: int, num_experts: int,
                        limit: int) -> int:
    """Refuse cache sizes whose replay state would exceed ``limit``, before any is allocated;
    returns the largest bucket's bytes (what the replay step's check adds to its own).

    A bucket of sizes replays its ``n`` configurations (``configs_per_size`` per size) as one
    batch of states at the bucket's largest size (``sweep.capacity_buckets``): the stacked
    states, the program's output batch and the initial state, ``2 * n + 1`` states in all.
    """
    from pallas_cache.sizing.sweep.records import capacity_buckets
    from pallas_cache.sizing.traces import check_memory

    largest = 0
    for bucket in reversed(capacity_buckets(sizes)):
        size, count = bucket[-1], configs_per_size * len(bucket)
        state = (num_layers * num_experts * _STATE_BYTES_PER_ID + size * _STATE_BYTES_PER_SLOT
                 + num_layers * 16)
        check_memory((2 * count + 1) * state, limit, f"--cache-size {size}",
                     f"{count} cache state(s) of {size} slots for {num_layers} "
                     f"layers x {num_experts} experts")
        largest = max(largest, (2 * count + 1) * state)
    return largest


def check_step_memory(sizes, configs_per_size: int, num_experts: int, top_k: int,
                      limit: int, held: int = 0, flag: str | None = None,
                      hit_counts: bool = False) -> None:
    """Refuse a replay whose step would need more than ``limit`` to compile and run, before
    any is allocated: a call that routes ``top_k`` experts (a trace with one call of 100k routes
    pads every call to that width) costs the compiler about ``top_k ** 1.5`` times
    :data:`COMPILE_BYTES_PER_WIDTH`, every configuration of a bucket ``K' x C`` and ``K' x E``
    tables, and each chunk its routes. ``held``: bytes alive beside them (the trace and the
    cache states, :func:`~pallas_cache.sizing.cli.parser.check_state_memory`'s), counted too.
    ``flag``: the flag that set ``top_k`` (``--batch B``), named before the size.
    ``hit_counts``: each configuration also holds the GPU-time model's packed table of calls
    (input, output and one copy of it)."""
    from pallas_cache.sizing.sweep import DEFAULT_CHUNK_CALLS, capacity_buckets
    from pallas_cache.sizing.sweep.program import MAX_HIT_DISTINCT, hit_table_size
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
#: (B_link); the CPU partial's bank of four experts, made in device memory, and its host copy
#: (T_cpu).
BENCH_LINK_COPIES = 2
BENCH_BANK_COPIES = 2 * 4


def check_bench_memory(mib: int, d_model: int, d_expert: int, limit: int,
                       dtype: str = "fp32", *, d_expert_given: bool = True) -> None:
    """Refuse ``bench-bandwidth`` flags whose arrays cannot fit ``limit`` (the machine's memory),
    before any is allocated: ``--mib`` sizes the copied buffer, ``--d-model x --d-expert`` the
    SwiGLU experts in format ``dtype``. ValueError, the one line the CLI prints, naming the flags
    the user gave (``d_expert_given`` False: ``d_expert`` is the default bank's, not a flag's)."""
    link = BENCH_LINK_COPIES * mib * 2**20
    bank = BENCH_BANK_COPIES * bytes_per_expert(d_model, d_expert, dtype)
    columns = (f"--d-expert {d_expert}" if d_expert_given else
               f"the default bank's {d_expert} columns (shrunk to fit, give --d-expert to choose)")
    for nbytes, what in ((link, f"--mib {mib}: the copied buffer and its device copy"),
                         (bank, f"--d-model {d_model} x {columns}: four {dtype} "
                                f"SwiGLU experts and their copies")):
        if nbytes > limit:
            raise ValueError(f"{what} would need about {format_bytes(nbytes)}, above this "
                             f"machine's {format_bytes(limit)} of memory")
