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

from pallas_cache.sizing.cli_checks import INT32_MAX
from pallas_cache.sizing.cost import CostModel
from pallas_cache.sizing.units import format_bytes

__all__ = ["PARALLEL", "budget_lines", "check_device_count", "declared_experts", "device_cost",
           "device_header", "run_expert_parallel", "tensor_records"]

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
    if devices > INT32_MAX:
        raise ValueError(f"--devices {devices} is above {INT32_MAX}")
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


def declared_experts(args, default_preset: str) -> int | None:
    """The experts per layer known before the trace is read: a synthetic trace's (its preset's,
    or ``--model``'s / ``--num-experts``'), a ``--trace``'s declared ``--num-experts``; else
    ``None`` (known once it is read). Call after the synthetic geometry is checked."""
    from pallas_cache.sizing import synthetic

    if getattr(args, "trace", None):
        return getattr(args, "num_experts", None)
    geometry = getattr(args, "geometry", None) or {}
    preset = synthetic.PRESETS.get(getattr(args, "synthetic", None) or default_preset)
    return geometry.get("num_experts", preset.num_experts if preset is not None else None)


def check_device_count(args, num_experts: int | None) -> None:
    """``--devices D --parallel expert`` needs ``D <= E``: each device owns at least one expert
    of every layer (the default share); more devices than experts would own nothing, and the
    per-device work grows with ``D``. Refused before that work (ValueError, one line naming
    ``--devices``); a device that owns experts the trace never routes still gets its rows."""
    if getattr(args, "parallel", None) != "expert" or num_experts is None:
        return
    if args.devices > num_experts:
        raise ValueError(f"--devices {args.devices} --parallel expert: more devices than the "
                         f"{num_experts} experts per layer, so some device would own none; "
                         f"give --devices {num_experts} or fewer")


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


def budget_lines(rows: list[dict], cost: CostModel) -> list[str]:
    """The legend's ``--device-budget`` lines for record rows (one table's): the pick
    (``budget_best``), or that nothing fits; none without a budget or modeled times."""
    if cost.device_budget is None or not cost.timed or not rows:
        return []
    budget = format_bytes(cost.device_budget)
    chosen = [row for row in rows if row["budget_best"]]
    if not chosen:
        smallest = min(row["cache_bytes"] for row in rows)
        return [f"No configuration fits the {budget} device budget (the smallest pool takes "
                f"{format_bytes(smallest)})."]
    return [f"Best within {budget}: cache_size={row['cache_size']} "
            f"({format_bytes(row['cache_bytes'])}) policy={row['policy']} order={row['order']} "
            f"admission={row['admission']}"
            f"{'' if row['eviction'] == 'lru' else ' eviction=' + row['eviction']}: "
            f"{row['modeled_ms_per_token']:.1f} ms/token modeled." for row in chosen]


def _pick(rows: list[dict], cost: CostModel) -> list[dict]:
    """``best`` (the fastest row at its cache size) and ``budget_best`` (the fastest that fits
    ``--device-budget``) picked among ``rows`` themselves, as :func:`with_costs` picks them for
    one replay's rows; unchanged without modeled times."""
    if not cost.timed:
        return rows
    fastest: dict = {}
    for row in rows:
        ms = row["modeled_ms_per_token"]
        fastest[row["cache_size"]] = min(fastest.get(row["cache_size"], ms), ms)
    fits = [row["modeled_ms_per_token"] for row in rows
            if cost.device_budget is not None and row["cache_bytes"] <= cost.device_budget]
    floor = min(fits, default=None)
    return [dict(row, best=row["modeled_ms_per_token"] == fastest[row["cache_size"]],
                 budget_best=(None if cost.device_budget is None else
                              row["cache_bytes"] <= cost.device_budget
                              and row["modeled_ms_per_token"] == floor))
            for row in rows]


def run_expert_parallel(args, trace, cost: CostModel, policies, progress, latch,
                        warnings=()) -> int:
    """The expert-parallel replay: one replay per device of its trace, printed per device, then
    the busiest device's row of each configuration. Every check (sizes, memory) runs for every
    device before any replay; ``warnings`` are printed then, as the one-device replay does. A
    ``--device-budget`` is per device: its exact-fit size joins each device's sizes, and each
    table (the busiest rows' too) names its pick."""
    from pallas_cache.mesh import expert_sharding
    from pallas_cache.sizing.cli_args import cache_sizes, check_state_memory
    from pallas_cache.sizing.cli_checks import check_geometry, check_step_memory
    from pallas_cache.sizing.cli_sizing import with_budget_fit
    from pallas_cache.sizing.devices import device_traces
    from pallas_cache.sizing.report import format_records, records
    from pallas_cache.sizing.sweep import config_grid, replay

    plans = []
    try:
        sharding = expert_sharding(trace.num_experts, args.devices)
        traces = device_traces(trace, sharding)
        for device_trace in traces:
            sizes, size_lines = with_budget_fit(
                *cache_sizes(args.cache_size, device_trace, cost), cost,
                device_trace.num_layers, device_trace.num_experts)
            check_geometry(device_trace.num_layers, device_trace.num_experts, sizes)
            configs = config_grid(sizes, policies, args.order, args.admission, args.eviction)
            if not configs:
                raise ValueError(f"admission reuse needs eviction lru; got --eviction "
                                 f"{' '.join(args.eviction)}")
            per_size = len(configs) // len(set(sizes))
            states = check_state_memory(sizes, per_size, device_trace.num_layers,
                                        device_trace.num_experts, args.max_memory)
            held = states + sum(array.nbytes for array in (
                device_trace.routes, trace.routes, trace.layers, trace.token_idx,
                trace.sequence) if array is not None)
            check_step_memory(sizes, per_size, device_trace.num_experts, device_trace.top_k,
                              args.max_memory, held)
            plans.append((device_trace, configs, size_lines))
    except (TypeError, ValueError) as error:
        progress.close()
        print(f"pallas-cache: {error}", file=sys.stderr)
        return 2
    progress.close()  # the note: warnings follow on a clean line
    for line in warnings:
        print(line, file=sys.stderr)
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
    busiest = _pick(busiest, cost)
    header = device_header(args, cost)
    if fmt != "table":
        print(format_records([row for rows in per_device for row in rows] + busiest, fmt))
        return 0
    for d, rows in enumerate(per_device):
        experts = sharding.experts(d)
        print(format_records(rows, "table", header + [
            f"device {d}: experts {experts[0]}..{experts[-1]} of every layer" if experts
            else f"device {d}: no experts"] + [f"size: {line}" for line in plans[d][2]]))
        for line in budget_lines(rows, cost):
            print(line)
        print()
    print(format_records(busiest, "table", header + ["the busiest device per configuration"]))
    for line in budget_lines(busiest, cost):
        print(line)
    return 0
