"""The replay's cost-model parameters, measured at the bank's geometry in the run
(:func:`measure_parameters`): ``B_link``, ``B_cpu``, ``T_cpu``, ``A`` and ``C`` as
:class:`Parameters`, the bandwidths from slopes over expert counts (:func:`slope_rate`)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp

import pallas_cache as pc
from pallas_cache.hybrid import device_partial
from pallas_cache.moe import apply_copy_plan
from pallas_cache.sizing.decode.decoder import Decoder, RowSpec, median_seconds
from pallas_cache.sizing.sweep.cost import CostModel, overlap_times
from pallas_cache.sizing.units import format_bandwidth

__all__ = ["SLOPE_TIME_LIMIT", "Parameters", "measure_parameters", "slope_rate"]

#: Seconds a slope measurement may spend on more batches before it reports what it has.
SLOPE_TIME_LIMIT = 120.0


@dataclasses.dataclass(frozen=True)
class Parameters:
    """The model's parameters, measured in the run.

    Attributes:
      copy_bandwidth: ``B_link``, bytes per second ``apply_copy_plan`` moves (every byte moved
        counted) inside a compiled call.
      cpu_bandwidth: ``B_cpu``, expert bytes per second of ``cpu_partial`` at the bank's dtype.
      cpu_fixed_seconds: ``T_cpu``, what a call with CPU experts adds beyond its experts.
      gpu_layer_seconds: ``A``, one layer-call of the decode with no routes (the cache step,
        both partials' empty branches, the norm).
      gpu_expert_seconds: ``C``, one more distinct expert in ``device_partial``.
      lines: how each was measured, one line each.
    """

    copy_bandwidth: float
    cpu_bandwidth: float
    cpu_fixed_seconds: float
    gpu_layer_seconds: float
    gpu_expert_seconds: float
    lines: tuple = ()

    #: The fields the gap line may name, with their labels.
    NAMES = {"copy_bandwidth": "B_link (copy path)", "cpu_bandwidth": "B_cpu (cpu_partial)",
             "cpu_fixed_seconds": "T_cpu", "gpu_layer_seconds": "A (layer outside experts)",
             "gpu_expert_seconds": "C (per device expert)"}

    def cost(self, expert_bytes: int) -> CostModel:
        """The replay's cost model with these parameters."""
        return CostModel(expert_bytes=expert_bytes, link_bandwidth=self.copy_bandwidth,
                         cpu_bandwidth=self.cpu_bandwidth,
                         cpu_fixed_seconds=self.cpu_fixed_seconds,
                         gpu_layer_seconds=self.gpu_layer_seconds,
                         gpu_expert_seconds=self.gpu_expert_seconds)

    def ms_per_token(self, call_counts, expert_bytes: int, tokens: int) -> float:
        """The event rules' time per token over ``(hits, fetched, cpu_experts, calls)``."""
        times = overlap_times(call_counts, expert_bytes, self.copy_bandwidth, self.cpu_bandwidth,
                              self.cpu_fixed_seconds, self.gpu_layer_seconds,
                              self.gpu_expert_seconds)
        return 1e3 * times.total / max(tokens, 1)


def slope_rate(what, expert_bytes, seconds, rounds, time_limit=SLOPE_TIME_LIMIT,
               counts=(0, 1, 2)):
    """Bytes per second from the slope of ``counts`` experts: ``seconds(n, rounds)`` is one
    batch's median seconds for ``n`` experts. A loaded machine can swamp one batch (the most
    experts no slower than the fewest), so batches are added until the medians over the batches
    give a positive slope (and there are at least two, for a spread), or ``time_limit`` seconds
    have passed.

    Returns:
      ``(rate, line)``: the rate from the medians over the batches and a line with the batch
      count and the per-batch rates' range; or ``None`` and why, when no positive slope came
      within the time limit (the caller then uses another figure).
    """
    rate, line, _ = _slope(what, expert_bytes, seconds, rounds, time_limit, counts)
    return rate, line


def _slope(what, expert_bytes, seconds, rounds, time_limit, counts):
    """:func:`slope_rate` with the medians over the batches, one per count."""
    start = time.perf_counter()
    batches = []
    span = counts[-1] - counts[0]
    while True:
        batches.append([seconds(n, rounds) for n in counts])
        medians = [statistics.median(batch[i] for batch in batches) for i in range(len(counts))]
        slope = (medians[-1] - medians[0]) / span
        elapsed = time.perf_counter() - start
        if (slope > 0 and len(batches) >= 2) or elapsed > time_limit:
            break
    rates = sorted(expert_bytes * span / (b[-1] - b[0]) for b in batches if b[-1] > b[0])
    spread = (f"per-batch {format_bandwidth(rates[0])} to {format_bandwidth(rates[-1])}"
              if rates else "no batch had a positive slope")
    where = f"{len(batches)} batches of {rounds} rounds in {elapsed:.0f} s; {spread}"
    if slope <= 0:
        return None, (f"{what}: {counts[-1]} experts took no longer than {counts[0]} over "
                      f"{where} (the load swamped the slope)"), medians
    return (expert_bytes / slope, f"{what}: {format_bandwidth(expert_bytes / slope)} ({where})",
            medians)


def measure_parameters(decoder: Decoder, spec: RowSpec, rounds: int, time_limit: float,
                       progress) -> Parameters:
    """``B_link``, ``B_cpu``, ``T_cpu``, ``A`` and ``C`` (see :class:`Parameters`), each from
    compiled calls at the bank's geometry and dtype, in this process. ``spec``: the cache whose
    decode, with every route padding, gives ``A``."""
    g, bank, x0 = decoder.geometry, decoder.bank, decoder.x0
    width = g.expert_bytes
    # Up to a call's most distinct experts, K' = min(k, E): the plans and branches the decode runs
    # (XLA:CPU copies 3 or more host rows in a loop that 1 or 2 never enter: measured, the slope
    # of 1 to 3 rows was 10x that of 1 to 2).
    most = max(2, min(g.top_k, g.num_experts))
    lines = []

    progress(f"B_link: apply_copy_plan moving 1 to {most} experts per compiled call")
    copy = jax.jit(apply_copy_plan, donate_argnums=0)

    pools = [decoder.pool(g.num_experts)]  # one pool, written in place call after call, as a decode's

    def copy_seconds(n, rounds):
        plan = pc.CopyPlan(dst_slots=jnp.arange(n, dtype=jnp.int32),
                           src_rows=jnp.arange(n, dtype=jnp.int32), count=jnp.int32(n))

        def run():
            pools[0] = jax.block_until_ready(copy(pools[0], bank, plan, layer=jnp.int32(0)))

        return median_seconds(run, rounds)

    link, line, copy_medians = _slope("the copy path (apply_copy_plan, bytes moved)", width,
                                      copy_seconds, rounds, time_limit, counts=(1, most))
    lines.append(line)
    if link is None:  # the load swamped the slope: the whole time of one expert stands in
        link = width / max(copy_medians[0], 1e-9)
        lines.append(f"B_link: {format_bandwidth(link)}, one expert's whole copy time instead")

    progress(f"B_cpu, T_cpu: cpu_partial with 0 to {most} CPU experts of one token, {g.dtype}")
    ids = jnp.arange(most, dtype=jnp.int32)[None]
    gates = jnp.full((1, most), 1.0 / most, jnp.float32)

    @functools.partial(jax.jit, static_argnums=0)
    def cpu_call(n, x, bank):
        plan = SimpleNamespace(cpu=jnp.arange(most)[None] < n,
                               copy=SimpleNamespace(num_experts=g.num_experts))
        return pc.cpu_partial(x, ids, gates, plan, bank, decoder.expert_fn, layer=jnp.int32(0))

    def cpu_seconds(n, rounds):
        return median_seconds(lambda: jax.block_until_ready(cpu_call(n, x0, bank)), rounds)

    cpu, line, medians = _slope("cpu_partial", width, cpu_seconds, rounds, time_limit,
                                counts=tuple(range(most + 1)))
    lines.append(line)
    if cpu is None:
        cpu = most * width / max(medians[-1], 1e-9)
        lines.append(f"B_cpu: {format_bandwidth(cpu)}, {most} experts' whole time instead")
    per_cpu = (medians[-1] - medians[1]) / (most - 1) if most > 1 else 0.0
    fixed = max(0.0, medians[1] - per_cpu - medians[0])

    progress(f"C: device_partial with 0 to {most} resident experts of one token")
    resident = pc.CopyPlan(dst_slots=jnp.arange(most, dtype=jnp.int32),
                           src_rows=jnp.arange(most, dtype=jnp.int32), count=jnp.int32(most))
    pool = jax.jit(apply_copy_plan)(decoder.pool(most), bank, resident, layer=jnp.int32(0))

    @functools.partial(jax.jit, static_argnums=0)
    def device_call(n, x, pool):
        plan = SimpleNamespace(slots=jnp.where(jnp.arange(most) < n, jnp.arange(most), -1)[None],
                               copy=SimpleNamespace(num_slots=most, num_experts=g.num_experts))
        return device_partial(x, ids, gates, plan, pool, decoder.expert_fn)

    def device_seconds(n, rounds):
        return median_seconds(lambda: jax.block_until_ready(device_call(n, x0, pool)), rounds)

    rate, line, _ = _slope("device_partial", width, device_seconds, rounds, time_limit,
                           counts=tuple(range(most + 1)))
    per_device = width / rate if rate else 0.0
    lines.append(line.replace("device_partial: ", "device_partial: W / ", 1))

    progress(f"A: the decode of {spec.label} with every route padding")
    empty = jnp.full_like(decoder.routes, -1)
    seconds, _, _ = decoder.run(spec, "full", rounds, routes=empty)
    calls = g.num_layers * decoder.routes.shape[0]
    layer = seconds / calls
    lines.append(f"A: {layer * 1e3:.4g} ms per layer-call ({spec.label}'s decode with no routes, "
                 f"median of {rounds})")
    return Parameters(link, cpu, fixed, layer, per_device, tuple(lines))
