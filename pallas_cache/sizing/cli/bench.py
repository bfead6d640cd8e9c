"""``pallas-cache bench-bandwidth``: measure B_link, B_cpu and T_cpu roughly (the library's own
CPU path with its experts at the bank's format, :func:`~pallas_cache.sizing.bandwidth.
cpu_partial_timing`) and print them as replay flags, a line on stderr per phase."""

from __future__ import annotations

import contextlib
import dataclasses
import sys

from pallas_cache.formats import FORMATS, bytes_per_expert, canonical_format
from pallas_cache.sizing.cli.checks import check_bench_memory
from pallas_cache.sizing.cli.parser import UsageError
from pallas_cache.sizing.models import DEFAULT_DTYPE, resolve_model
from pallas_cache.sizing.units import format_bandwidth, format_bytes, format_duration

# Nothing above imports JAX or NumPy: a refused flag answers at once; run_bench imports them.

__all__ = ["BENCH_EXPERT_BYTES", "BENCH_MARGIN_BYTES", "MOST_CPU_EXPERTS", "BandwidthRequest",
           "available_memory", "bench_bank_columns", "bench_d_expert", "bench_dtype",
           "build_bandwidth_request", "run_bench"]


@dataclasses.dataclass(frozen=True)
class BandwidthRequest:
    """What ``pallas-cache bench-bandwidth`` was asked, checked.

    Attributes:
      mib: MiB copied per B_link measurement.
      dtype: the bank's format (canonical: ``fp32``, ``bf16``, ``int8``, ``int4``).
      d_model: the experts' rows' width.
      d_expert: the experts' hidden units (``None``: the default bank, sized to the memory).
      repeats: timed runs, median.
    """

    mib: int
    dtype: str
    d_model: int
    d_expert: int | None
    repeats: int


def build_bandwidth_request(args) -> BandwidthRequest:
    """The :class:`BandwidthRequest` of the ``bench-bandwidth`` subcommand's namespace, after
    every check the flags alone decide.

    Raises:
      UsageError: the first refusal, as the one line the CLI prints.
    """
    dtype, d_model = bench_dtype(args)
    d_expert = args.d_expert if args.d_expert is not None else bench_d_expert(d_model, dtype)
    if min(args.mib, d_model, d_expert, args.repeats) < 1:
        raise UsageError("pallas-cache: --mib, --d-model, --d-expert and --repeats must be >= 1")
    if dtype == "int4" and d_model % 2:
        raise UsageError(f"pallas-cache: --d-model {d_model}: int4 packs two weights per byte, "
                         f"so the rows need an even width")
    return BandwidthRequest(args.mib, dtype, d_model, args.d_expert, args.repeats)


def bench_dtype(args) -> tuple[str, int]:
    """``(format, d_model)`` of the bank to measure: ``--dtype``, else ``--model``'s (its
    spelling, else its released format), else bf16; ``--d-model``, else the model's, else 4096.
    A format no expert function reads is a :class:`UsageError`."""
    model = dtype = None
    if args.model is not None:
        try:
            model, dtype = resolve_model(args.model)
        except ValueError as error:
            raise UsageError(f"pallas-cache: --model: {error}") from None
    dtype = args.dtype or dtype or DEFAULT_DTYPE
    try:
        dtype = canonical_format(dtype)
    except ValueError:
        raise UsageError(f"pallas-cache: bench-bandwidth: no expert function reads dtype "
                         f"{dtype!r} (the library's read {', '.join(FORMATS)}), so B_cpu cannot "
                         f"be measured for it") from None
    d_model = args.d_model or (model.d_model if model is not None else 4096)
    return dtype, d_model


def run_bench(request: BandwidthRequest) -> int:
    """Measure and print; a bank past the machine's memory is a :class:`UsageError` (one line,
    exit 2), before JAX starts."""
    dtype, d_model, mib, repeats = request.dtype, request.d_model, request.mib, request.repeats
    default_bank = request.d_expert is None
    d_expert = bench_d_expert(d_model, dtype) if default_bank else request.d_expert

    def progress(line: str) -> None:
        print(f"pallas-cache: bench-bandwidth: {line}", file=sys.stderr, flush=True)

    from pallas_cache.sizing.traces.memory import DEFAULT_MEMORY_FRACTION, default_memory_limit

    shrunk = False
    if default_bank:
        d_expert, shrunk = bench_bank_columns(d_model, d_expert, available_memory(), dtype)
    try:
        check_bench_memory(mib, d_model, d_expert,
                           int(default_memory_limit() / DEFAULT_MEMORY_FRACTION), dtype,
                           d_expert_given=not default_bank)
    except ValueError as error:
        raise UsageError(f"pallas-cache: {error}") from None
    if shrunk:
        progress(f"the default bank shrinks to --d-expert {d_expert} to fit this machine's "
                 f"available memory")
    progress("starting JAX")
    import jax

    from pallas_cache.sizing.bandwidth import bank_bytes, cpu_partial_timing, link_bandwidth

    device = jax.devices()[0]
    progress(f"B_link: {repeats + 1} copies of {mib}MiB to {device.platform}:"
             f"{device.id}")
    with _out_of_memory_is_one_line(f"--mib {mib}"):
        link = link_bandwidth(mib * 2**20, repeats, device)
    expert = format_bytes(bytes_per_expert(d_model, d_expert, dtype))
    progress(f"B_cpu, T_cpu: a host bank of {MOST_CPU_EXPERTS} {dtype} SwiGLU experts of 3 x "
             f"{d_model} x {d_expert} ({expert} each, "
             f"{format_bytes(bank_bytes(d_model, d_expert, dtype))}), {repeats + 1} runs "
             f"of 8 layer-calls per count")
    with _out_of_memory_is_one_line(f"--d-model {d_model} x "
                                    f"{'--d-expert ' if not default_bank else ''}{d_expert}"):
        timing = cpu_partial_timing(d_model, d_expert, repeats, progress=progress,
                                    dtype=dtype)
    cpu, fixed = timing.bandwidth, timing.fixed
    print(f"device: {device.platform}:{device.id} ({device.device_kind})")
    where = "host -> device" if device.platform != "cpu" else "host -> host (no accelerator)"
    print(f"B_link ~ {format_bandwidth(link)}  ({where} copy of {mib}MiB, pageable memory, "
          f"median of {repeats})")
    slope = (f"{format_bytes(timing.expert_bytes)} per "
             f"{format_duration(timing.per_expert)}, the slope of a line through its time"
             if timing.per_expert > 0 else
             f"no positive slope through its time (noise?): {MOST_CPU_EXPERTS} experts' bytes "
             f"over their whole {format_duration(timing.seconds[-1])}, a lower bound")
    print(f"B_cpu  ~ {format_bandwidth(cpu)}  (the library's cpu_partial, one token, {dtype} "
          f"SwiGLU experts (pallas_cache.experts.swiglu) of 3 x {d_model} x {d_expert}: {slope} "
          f"with 1-{MOST_CPU_EXPERTS} CPU experts; median of {repeats})")
    print(f"T_cpu  ~ {format_duration(fixed)}  (fixed cost per layer-call of cpu_partial: the "
          f"intercept of that line; median of {repeats})")
    print(f"flags: --link-bandwidth {format_bandwidth(link)} --cpu-bandwidth {format_bandwidth(cpu)}"
          f" --cpu-fixed-cost {format_duration(fixed)}  # B_cpu of {dtype} experts: replay "
          f"them with --model NAME:{dtype}")
    return 0


@contextlib.contextmanager
def _out_of_memory_is_one_line(sizes: str):
    """An allocation the process's memory (an address-space limit, a full device) refuses, as
    NumPy's MemoryError or XLA's RESOURCE_EXHAUSTED: one line naming the ``sizes``, exit 2."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - XLA's runtime error has no stable public type
        if not isinstance(error, MemoryError) and "RESOURCE_EXHAUSTED" not in str(error):
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else "MemoryError"
        raise UsageError(f"pallas-cache: bench-bandwidth: {sizes} ran out of memory ({first}); "
                         f"lower it") from None


#: CPU experts of bench-bandwidth's bank (pallas_cache.sizing.bandwidth.MOST, which imports
#: NumPy; a test checks they agree).
MOST_CPU_EXPERTS = 4


#: bench-bandwidth's default expert: at least this many bytes at the measured format (three
#: times a 32 MiB last-level cache), so it streams from memory as a real one does.
BENCH_EXPERT_BYTES = 96 * 2**20


#: What bench-bandwidth's peak adds to twice its bank (the bank, and the rows the CPU path copies
#: out of it): the runtime, the program, the link copy's buffers.
BENCH_MARGIN_BYTES = 768 * 2**20


def bench_d_expert(d_model: int, dtype: str) -> int:
    """The default bank's ``d_expert``: a multiple of 128, the fewest whose SwiGLU expert of
    ``d_model`` rows in format ``dtype`` holds :data:`BENCH_EXPERT_BYTES`."""
    per_128 = bytes_per_expert(d_model, 128, dtype)
    return 128 * -(-BENCH_EXPERT_BYTES // per_128)


def bench_bank_columns(d_model: int, d_expert: int, available: int | None,
                       dtype: str = "fp32") -> tuple[int, bool]:
    """``(d_expert, shrunk)``: the default bank's columns, halved while above 256 until twice the
    bank (:data:`MOST_CPU_EXPERTS` SwiGLU experts in format ``dtype``) plus
    :data:`BENCH_MARGIN_BYTES` fits half of ``available`` bytes (unknown: as is)."""
    shrunk = False
    while (available is not None and d_expert > 256
           and 2 * MOST_CPU_EXPERTS * bytes_per_expert(d_model, d_expert, dtype)
           + BENCH_MARGIN_BYTES > available // 2):
        d_expert, shrunk = d_expert // 2, True
    return d_expert, shrunk


def available_memory() -> int | None:
    """Bytes of memory available now (``MemAvailable``), or ``None`` where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
