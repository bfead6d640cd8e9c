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

from pallas_cache.sizing.cli.checks import INT32_MAX
from pallas_cache.sizing.report import format_records, pick_label
from pallas_cache.sizing.sweep.cost import CostModel, figure_words, ranking_figure
from pallas_cache.sizing.units import format_bytes

__all__ = ["budget_lines", "check_device_count", "device_cost", "device_header",
           "print_expert_parallel", "tensor_records"]


def device_cost(devices: int | None, parallel: str | None, plot: bool,
                cost: CostModel) -> CostModel:
    """Check ``--devices`` and ``--parallel`` (before the trace is read; ValueError, one line)
    and return the cost model each device's replay runs with: a slot of ``W / T`` bytes
    (tensor-parallel) and the host bandwidth's per-device share ``B_cpu / D``. Unchanged
    without the flags."""
    if devices is None and parallel is None:
        return cost
    if devices is None or parallel is None:
        raise ValueError("--devices and --parallel go together (e.g. --devices 2 --parallel "
                         "tensor)")
    if devices < 1:
        raise ValueError(f"--devices must be at least 1, got {devices}")
    if devices > INT32_MAX:
        raise ValueError(f"--devices {devices} is above {INT32_MAX}")
    if plot:
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


def check_device_count(devices: int | None, parallel: str | None,
                       num_experts: int | None) -> None:
    """``--devices D --parallel expert`` needs ``D <= E``: each device owns at least one expert
    of every layer (the default share); more devices than experts would own nothing, and the
    per-device work grows with ``D``. Refused before that work (ValueError, one line naming
    ``--devices``); a device that owns experts the trace never routes still gets its rows."""
    if parallel != "expert" or num_experts is None:
        return
    if devices > num_experts:
        raise ValueError(f"--devices {devices} --parallel expert: more devices than the "
                         f"{num_experts} experts per layer, so some device would own none; "
                         f"give --devices {num_experts} or fewer")


def device_header(request) -> list[str]:
    """The lines above the table that say what the per-device columns mean."""
    if request.devices is None:
        return []
    D, cost = request.devices, request.cost
    if request.parallel == "tensor":
        slot = (f"a slot is W/{D} = {format_bytes(cost.expert_bytes)} on each device, "
                if cost.expert_bytes else "")
        return [f"devices: {D}, tensor-parallel: one cache for all, each device 1/{D} of every "
                f"expert; {slot}cache_size and cache_bytes per device; B_cpu is the host's "
                f"share per slice (B_cpu/{D}), cpu_bytes_per_token the host's bytes"]
    return [f"devices: {D}, expert-parallel: each device its own experts and cache; rows per "
            f"device, then the busiest device per configuration; B_cpu is each device's share "
            f"of the host (B_cpu/{D})"]


def tensor_records(rows: list[dict], devices: int | None, parallel: str | None) -> list[dict]:
    """Tensor-parallel rows: ``cpu_bytes_per_token`` counts the host's bytes (all ``T`` slices
    of each CPU expert), not one device's slice."""
    if parallel != "tensor":
        return rows
    return [dict(row, cpu_bytes_per_token=None if row["cpu_bytes_per_token"] is None
                 else row["cpu_bytes_per_token"] * devices) for row in rows]


def budget_lines(rows: list[dict], cost: CostModel) -> list[str]:
    """The legend's ``--device-budget`` lines for record rows (one table's): the pick
    (``budget_best``), or that nothing fits; none without a budget or modeled times."""
    key = ranking_figure(rows)
    if cost.device_budget is None or key is None:
        return []
    budget = format_bytes(cost.device_budget)
    chosen = [row for row in rows if row["budget_best"]]
    if not chosen:
        smallest = min(row["cache_bytes"] for row in rows)
        return [f"No configuration fits the {budget} device budget (the smallest pool takes "
                f"{format_bytes(smallest)})."]
    return [f"Best within {budget}: cache_size={row['cache_size']} "
            f"({format_bytes(row['cache_bytes'])}) {pick_label(row)}: "
            f"{row[key]:.1f} {figure_words(key)}." for row in chosen]


def _pick(rows: list[dict], cost: CostModel) -> list[dict]:
    """``best`` (the fastest row at its cache size) and ``budget_best`` (the fastest that fits
    ``--device-budget``) picked among ``rows`` themselves, as :func:`with_costs` picks them for
    one replay's rows; unchanged without modeled times."""
    key = ranking_figure(rows)
    if key is None:
        return rows
    fastest: dict = {}
    for row in rows:
        ms = row[key]
        fastest[row["cache_size"]] = min(fastest.get(row["cache_size"], ms), ms)
    fits = [row[key] for row in rows
            if cost.device_budget is not None and row["cache_bytes"] <= cost.device_budget]
    floor = min(fits, default=None)
    return [dict(row, best=row[key] == fastest[row["cache_size"]],
                 budget_best=(None if cost.device_budget is None else
                              row["cache_bytes"] <= cost.device_budget
                              and row[key] == floor))
            for row in rows]


def print_expert_parallel(request, trace, sharding, per_device: list[list[dict]],
                          size_lines: list[list[str]]) -> None:
    """The expert-parallel replay's rows: each device's, then, per configuration, the busiest
    device's row (the largest modeled time, or without timing the lowest hit rate: the slowest
    device sets the step), with its picks; as records, or a table per device and one of the
    busiest rows. A ``--device-budget`` is per device: each table names its pick."""
    cost = request.cost
    busiest = []
    for rows in zip(*per_device):
        timed = rows[0]["modeled_ms_per_token"] is not None
        worst = max(range(len(rows)), key=lambda d: (rows[d]["modeled_ms_per_token"] if timed
                                                     else -rows[d]["hit_rate"], -d))
        busiest.append(dict(rows[worst], source=f"{trace.source} (busiest of {len(rows)} "
                                                f"devices)", note="; ".join(
            filter(None, [f"busiest: device {worst}", rows[worst]["note"]]))))
    busiest = _pick(busiest, cost)
    header = device_header(request)
    if request.output.format != "table":
        print(format_records([row for rows in per_device for row in rows] + busiest,
                             request.output.format))
        return
    for d, rows in enumerate(per_device):
        experts = sharding.experts(d)
        print(format_records(rows, "table", header + [
            f"device {d}: experts {experts[0]}..{experts[-1]} of every layer" if experts
            else f"device {d}: no experts"] + [f"size: {line}" for line in size_lines[d]]))
        for line in budget_lines(rows, cost):
            print(line)
        print()
    print(format_records(busiest, "table", header + ["the busiest device per configuration"]))
    for line in budget_lines(busiest, cost):
        print(line)
