"""``pallas-cache replay --devices D --parallel expert|tensor``: the replay of the caches of
several devices (docs/replay.md, "Several devices"; docs/semantics.md §5.17).

- ``tensor``: one cache decision for all ``T`` devices, each holding ``1/T`` of every expert. It
  is the one-device replay of the same trace with a slot of ``W / T`` bytes per device: a
  per-device size ``B`` gives ``floor(B * T / W)`` slots, ``--device-budget`` is per device, a
  fetch moves ``W / T`` over each device's own link (in parallel), and each CPU expert's ``T``
  slices (``W`` bytes) stream through the one host at ``B_cpu``.
- ``expert``: device ``d`` owns the default share of every layer's experts
  (:func:`pallas_cache.mesh.expert_sharding`) and replays its own trace
  (:func:`pallas_cache.sizing.devices.device_traces`); its rows are a one-device replay of its
  routes. The ``D`` devices' CPU experts share the host's memory bus: each device's stream at
  ``B_cpu / D``. Then, per configuration, the busiest device's row (the largest modeled time,
  or without timing the lowest hit rate): the slowest device sets the step.
"""

from __future__ import annotations

import dataclasses
import sys

from pallas_cache.sizing.cost import CostModel
from pallas_cache.sizing.units import format_bytes

__all__ = ["PARALLEL", "device_cost", "device_header", "run_expert_parallel",
           "tensor_records"]

PARALLEL = ("expert", "tensor")


def device_cost(args, cost: CostModel) -> CostModel:
    """Check ``--devices`` and ``--parallel`` (before the trace is read; ValueError, one line)
    and return the cost model each device's replay runs with: a slot of ``W / T`` bytes
    (tensor-parallel) and the host bandwidth's per-device share ``B_cpu / D``. Unchanged
    without the flags."""
    devices, parallel = getattr(args, "devices", None), getattr(args, "parallel", None)
    if devices is None and parallel is None:
        return cost
    if devices is None or parallel is None:
        raise ValueError("--devices and --parallel go together (e.g. --devices 2 --parallel "
                         "tensor)")
    if devices < 1:
        raise ValueError(f"--devices must be at least 1, got {devices}")
    if args.plot:
        raise ValueError("--plot draws the rows of one device: it does not combine with "
                         "--devices")
    width = cost.expert_bytes
    if parallel == "tensor" and width is not None:
        if width % devices:
            raise ValueError(f"--devices {devices} --parallel tensor: an expert of {width} bytes "
                             f"does not split into {devices} equal slices")
        width //= devices
    cpu = None if cost.cpu_bandwidth is None else cost.cpu_bandwidth / devices
    return dataclasses.replace(cost, expert_bytes=width, cpu_bandwidth=cpu)


def device_header(args, cost: CostModel) -> list[str]:
    """The lines above the table that say what the per-device columns mean."""
    if getattr(args, "devices", None) is None:
        return []
    D = args.devices
    if args.parallel == "tensor":
        slot = (f"a slot is W/{D} = {format_bytes(cost.expert_bytes)} on each device, "
                if cost.expert_bytes else "")
        return [f"devices: {D}, tensor-parallel: one cache for all, each device 1/{D} of every "
                f"expert; {slot}cache_size and cache_bytes per device; B_cpu is the host's "
                f"share per slice (B_cpu/{D}), cpu_bytes_per_token the host's bytes"]
    return [f"devices: {D}, expert-parallel: each device its own experts and cache; rows per "
            f"device, then the busiest device per configuration; B_cpu is each device's share "
            f"of the host (B_cpu/{D})"]


def tensor_records(rows: list[dict], args) -> list[dict]:
    """Tensor-parallel rows: ``cpu_bytes_per_token`` counts the host's bytes (all ``T`` slices
    of each CPU expert), not one device's slice."""
    if getattr(args, "parallel", None) != "tensor":
        return rows
    return [dict(row, cpu_bytes_per_token=None if row["cpu_bytes_per_token"] is None
                 else row["cpu_bytes_per_token"] * args.devices) for row in rows]


def run_expert_parallel(args, trace, cost: CostModel, policies, progress, latch) -> int:
    """The expert-parallel replay: one replay per device of its trace, printed per device, then
    the busiest device's row of each configuration."""
    from pallas_cache.mesh import expert_sharding
    from pallas_cache.sizing.cli_args import cache_sizes, check_state_memory
    from pallas_cache.sizing.devices import device_traces
    from pallas_cache.sizing.report import format_records, records
    from pallas_cache.sizing.sweep import config_grid, replay

    sharding = expert_sharding(trace.num_experts, args.devices)
    traces = device_traces(trace, sharding)
    plans = []
    try:
        for device_trace in traces:
            sizes, size_lines = cache_sizes(args.cache_size, device_trace, cost)
            configs = config_grid(sizes, policies, args.order, args.admission, args.eviction)
            if not configs:
                raise ValueError(f"admission reuse needs eviction lru; got --eviction "
                                 f"{' '.join(args.eviction)}")
            check_state_memory(sizes, len(configs) // len(set(sizes)), device_trace.num_layers,
                               device_trace.num_experts, args.max_memory)
            plans.append((device_trace, configs, size_lines))
    except (TypeError, ValueError) as error:
        progress.close()
        print(f"pallas-cache: {error}", file=sys.stderr)
        return 2
    per_device = []
    for device_trace, configs, _ in plans:
        results = replay(device_trace, configs, cost=cost, progress=progress)
        per_device.append(records(results, device_trace, cost))
    latch.check()
    progress.close()
    fmt = args.format or ("json" if args.json else "table")
    busiest = []
    for rows in zip(*per_device):
        timed = rows[0]["modeled_ms_per_token"] is not None
        worst = max(range(len(rows)), key=lambda d: (rows[d]["modeled_ms_per_token"] if timed
                                                     else -rows[d]["hit_rate"], -d))
        busiest.append(dict(rows[worst], source=f"{trace.source} (busiest of {len(rows)} "
                                                f"devices)", note="; ".join(
            filter(None, [f"busiest: device {worst}", rows[worst]["note"]]))))
    header = device_header(args, cost)
    if fmt != "table":
        print(format_records([row for rows in per_device for row in rows] + busiest, fmt))
        return 0
    for d, rows in enumerate(per_device):
        experts = sharding.experts(d)
        print(format_records(rows, "table", header + [
            f"device {d}: experts {experts[0]}..{experts[-1]} of every layer" if experts
            else f"device {d}: no experts"] + [f"size: {line}" for line in plans[d][2]]))
        print()
    print(format_records(busiest, "table", header + ["the busiest device per configuration"]))
    return 0
