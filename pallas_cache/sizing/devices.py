"""Sizing the caches of several devices (docs/semantics.md §5.17): the pieces a replay of the
two mesh layouts is built from.

- Expert-parallel: :func:`device_traces` gives each device's trace (every call of the model,
  its own routes as local ids, the others padding), so a one-device replay of trace ``d`` sizes
  device ``d``'s cache exactly: the mesh layout's device ``d`` is one cache fed those routes.
- Tensor-parallel: :func:`tensor_parallel_slots` is the slot count of a per-device budget
  (``floor(B * T / W)``, the same on every device), and :func:`tensor_parallel_seconds` the
  modeled time of a one-device replay's counts when each copy moves ``W / T`` bytes over each of
  ``T`` links in parallel while the CPU experts run once on the shared host CPU.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from pallas_cache import validate
from pallas_cache.mesh import ExpertSharding
from pallas_cache.sizing.sweep.cost import ordered_sum
from pallas_cache.sizing.traces import Trace

__all__ = ["device_traces", "tensor_parallel_seconds", "tensor_parallel_slots"]


def device_traces(trace: Trace, sharding: ExpertSharding) -> list[Trace]:
    """Each device's trace of the expert-parallel layout, one per device of ``sharding``.

    Trace ``d`` has every call of ``trace`` (same layers, tokens and sequences: an all-padding
    call is still a call), its routes to device ``d``'s experts as local ids (ascending global
    id, as :func:`pallas_cache.mesh.local_routes`) and every other route ``-1``, and
    ``num_experts = sharding.num_local``.

    Raises:
      ValueError: ``sharding`` is for another number of experts than the trace's.
    """
    if sharding.num_experts != trace.num_experts:
        raise ValueError(f"the owner map is for {sharding.num_experts} experts, the trace has "
                         f"{trace.num_experts}")
    owner = np.asarray(sharding.owner, np.int64)
    local = np.asarray(sharding.local_id, np.int64)
    routes = np.asarray(trace.routes, np.int64)
    index = np.clip(routes, 0, trace.num_experts - 1)
    out = []
    for d in range(sharding.num_devices):
        mine = (routes >= 0) & (owner[index] == d)
        out.append(Trace(routes=np.where(mine, local[index], -1).astype(np.int32),
                         layers=trace.layers, num_layers=trace.num_layers,
                         num_experts=sharding.num_local, token_idx=trace.token_idx,
                         sequence=trace.sequence, sequence_names=trace.sequence_names,
                         source=f"{trace.source} (device {d} of {sharding.num_devices})"))
    return out


def tensor_parallel_slots(device_budget: int, num_devices: int, expert_bytes: int) -> int:
    """``floor(B * T / W)``: the slots a per-device budget ``B`` holds when each device keeps
    ``1/T`` of every expert of ``W`` bytes (the same count on every device)."""
    budget = validate.positive_int("device_budget", device_budget)
    devices = validate.positive_int("num_devices", num_devices)
    width = validate.positive_int("expert_bytes", expert_bytes)
    return budget * devices // width


def tensor_parallel_seconds(pair_counts: Iterable[tuple[int, int, int]], expert_bytes: int,
                            num_devices: int, link_bandwidth: float,
                            cpu_bandwidth: float) -> float:
    """``sum(calls * max(fetched * (W / T) / B_link, cpu_experts * W / B_cpu))``: a one-device
    replay's ``(fetched, cpu_experts, calls)`` counts timed for ``T`` devices that each copy
    their ``W / T`` slice of every fetched expert over their own link, in parallel, while the
    ``T`` slices of each CPU expert (``W`` bytes in all) stream through the one host's memory
    bus at ``B_cpu``."""
    T = validate.positive_int("num_devices", num_devices)
    for name, rate in (("link_bandwidth", link_bandwidth), ("cpu_bandwidth", cpu_bandwidth)):
        if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)) \
                or not 0 < rate < float("inf"):
            raise ValueError(f"{name} must be a positive, finite number of bytes per second, "
                             f"got {rate!r}")
    return ordered_sum(calls * max(fetched * expert_bytes / T / link_bandwidth,
                                   cpu_experts * expert_bytes / cpu_bandwidth)
                       for fetched, cpu_experts, calls in pair_counts)
