"""Rough measurements of the cost model's inputs (docs/semantics.md §11.1).

``B_link`` from a ``jax.device_put`` of host memory; ``B_cpu`` and ``T_cpu`` from the library's
own :func:`~pallas_cache.hybrid.cpu_partial` with its SwiGLU experts at the bank's format
(:mod:`pallas_cache.experts`) against 1-4 CPU experts (:func:`cpu_partial_timing`:
``B_cpu`` is the expert bytes over the slope of a line through its times, ``T_cpu`` the
intercept); medians after a warm-up, printed as ``pallas-cache replay`` flags.

The bank is an argument of the one compiled loop, never a constant of it: a closed-over bank is
baked into the program (hundreds of MiB of literal text to lower and compile, and a copy per
stage), which once made the command run for half an hour and peak at 20 GB.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import numpy as np

__all__ = ["CpuPartialTiming", "bank_bytes", "cpu_bandwidth", "cpu_fixed_cost",
           "cpu_partial_timing", "link_bandwidth", "median_seconds"]

#: CPU experts of the ``cpu_partial`` measurement: its line goes through 1..MOST of them.
MOST = 4


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``run`` after one warm-up call."""
    run()
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def link_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 5, device=None) -> float:
    """Bytes per second of ``jax.device_put`` from host memory to ``device`` (default: the
    first device of the default backend; on a CPU-only machine that is a host copy)."""
    import jax

    device = device if device is not None else jax.devices()[0]
    host = np.ones(int(num_bytes), np.uint8)
    return host.nbytes / median_seconds(
        lambda: jax.device_put(host, device).block_until_ready(), repeats)


def cpu_bandwidth(d_model: int = 4096, d_expert: int = 14336, repeats: int = 5) -> float:
    """Bytes per second of weights a one-token float32 ``x @ W`` streams in NumPy (``W``: one
    expert matrix of ``d_model x d_expert``). Not what ``bench-bandwidth`` prints: NumPy's
    kernel is not the library's CPU path, and ran about 2.5x faster than it on one machine;
    :func:`cpu_partial_timing` measures the path itself."""
    weights = np.ones((int(d_model), int(d_expert)), np.float32)
    x = np.ones((1, int(d_model)), np.float32)
    return weights.nbytes / median_seconds(lambda: x @ weights, repeats)


def bank_bytes(d_model: int, d_expert: int, dtype: str = "fp32") -> int:
    """Bytes of the measurement's host bank: :data:`MOST` SwiGLU experts of ``d_model x
    d_expert`` in format ``dtype`` (:func:`pallas_cache.formats.bytes_per_expert`, scales
    included). The measurement's peak adds about as much again (the bank is made in device
    memory and moved) and the runtime's few hundred MiB."""
    from pallas_cache.formats import bytes_per_expert

    return MOST * bytes_per_expert(d_model, d_expert, dtype)


@dataclasses.dataclass(frozen=True)
class CpuPartialTiming:
    """What :func:`cpu_partial_timing` measured.

    Attributes:
      seconds: median seconds of one layer-call with 1, 2, ... :data:`MOST` CPU experts.
      fixed: ``T_cpu``, the intercept of the least-squares line through ``seconds`` (clamped
        at 0): what a call pays for having a CPU partial at all.
      per_expert: its slope, seconds per CPU expert.
      expert_bytes: bytes of one expert in the bank's format, scales included.
      dtype: the bank's format (``fp32``, ``bf16``, ``int8``, ``int4``).
    """

    seconds: tuple[float, ...]
    fixed: float
    per_expert: float
    expert_bytes: int
    dtype: str = "fp32"

    @property
    def bandwidth(self) -> float:
        """``B_cpu``: expert bytes per second of the path, ``expert_bytes / per_expert``. When
        the slope is not positive (a line swamped by noise) it is the most experts' bytes over
        their whole time, a lower bound that includes the fixed cost."""
        if self.per_expert > 0:
            return self.expert_bytes / self.per_expert
        return len(self.seconds) * self.expert_bytes / self.seconds[-1]


def partial_loop(calls: int):
    """The jitted loop the CPU measurement times: ``calls`` chained layer-calls of
    :func:`~pallas_cache.hybrid.cpu_partial` (one token, the library's SwiGLU experts,
    :data:`pallas_cache.experts.swiglu`, at the bank's format), taking ``(x, ids, gates, plan,
    bank)`` as arguments, so one program serves every expert count and the bank is never a
    constant of it."""
    import jax

    from pallas_cache.experts import swiglu
    from pallas_cache.hybrid import cpu_partial

    @jax.jit
    def loop(x, ids, gates, plan, bank):
        def body(h, _):
            y = cpu_partial(h, ids, gates, plan, bank, swiglu)
            return h + 1e-6 * y.sum(), None  # a chain: no call is left out
        return jax.lax.scan(body, x, None, length=calls)[0]

    return loop


def cpu_partial_timing(d_model: int = 4096, d_expert: int = 14336, repeats: int = 5,
                       calls: int = 8, progress: Callable[[str], None] | None = None,
                       dtype: str = "fp32") -> CpuPartialTiming:
    """Time one layer-call's :func:`~pallas_cache.hybrid.cpu_partial` (one token, the library's
    SwiGLU experts of ``d_model x d_expert`` in format ``dtype`` in a host bank) with 1, 2, 3 and
    4 distinct CPU experts: each point is ``calls`` layer-calls in one compiled scan, median of
    ``repeats`` runs after a warm-up, divided by ``calls``. The bank (:func:`bank_bytes`) is made
    where it lives, one buffer per leaf; ``progress`` gets a line per expert count."""
    import jax
    import jax.numpy as jnp

    from pallas_cache.experts import filler_bank
    from pallas_cache.formats import bytes_per_expert, canonical_format
    from pallas_cache.moe import host_memory_kind
    from pallas_cache.ops import ensure_hybrid
    from pallas_cache.policy import FetchPolicy
    from pallas_cache.state import init

    d_model, d_expert = int(d_model), int(d_expert)
    device = jax.devices()[0]
    sharding = jax.sharding.make_single_device_sharding(
        device, memory_kind=host_memory_kind(device))
    # The values do not matter to the time; constants (not denormals) fill buffers made by
    # JAX, with no NumPy array to stage them through (on an accelerator they are made in device
    # memory and moved to host memory; on the CPU backend the move is a no-op).
    bank = jax.device_put(filler_bank(MOST, d_model, d_expert, dtype), sharding)
    x = jnp.ones((d_model,), jnp.float32)
    gates = jnp.full((MOST,), 1.0 / MOST, jnp.float32)
    loop = partial_loop(calls)
    seconds = []
    for count in range(1, MOST + 1):
        if progress is not None:
            progress(f"cpu_partial with {count} of {MOST} CPU experts")
        ids = jnp.asarray(list(range(count)) + [-1] * (MOST - count), jnp.int32)
        # A real plan: fraction 0 copies no miss, so every routed expert runs on the CPU.
        _, plan = ensure_hybrid(init(1, MOST, MOST), 0, ids, FetchPolicy.fraction(0.0))
        seconds.append(median_seconds(
            lambda: loop(x, ids, gates, plan, bank).block_until_ready(), repeats) / calls)
    del bank
    slope, intercept = np.polyfit(np.arange(1, MOST + 1, dtype=float), np.asarray(seconds), 1)
    return CpuPartialTiming(tuple(seconds), max(float(intercept), 0.0), float(slope),
                            bytes_per_expert(d_model, d_expert, dtype), canonical_format(dtype))


def cpu_fixed_cost(d_model: int = 4096, d_expert: int = 14336, repeats: int = 5,
                   calls: int = 8) -> tuple[float, float]:
    """``(T_cpu, seconds per expert)`` of :func:`cpu_partial_timing`."""
    timing = cpu_partial_timing(d_model, d_expert, repeats, calls)
    return timing.fixed, timing.per_expert
