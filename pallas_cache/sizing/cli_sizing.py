"""``pallas-cache replay``'s sizing flags (the legend's route_knn line, the model geometry of a
synthetic trace, the exact-fit size of a device budget, batched decode, the CPU's fixed cost,
the GPU's time):
their argument group and the checks that refuse a bad value or combination before the trace is
read (each as a ``ValueError`` whose text is the one line the CLI prints, exit 2)."""

from __future__ import annotations

import argparse
import decimal
import math

from pallas_cache.sizing.units import parse_duration

__all__ = ["add_sizing_arguments", "batches", "budget_fit", "check_gpu_policies", "cliff_lines",
           "cpu_fixed_seconds", "gpu_seconds", "layer_hit_rates", "per_layer_lines",
           "prefetch_lines",
           "synthetic_geometry", "with_budget_fit"]


def add_sizing_arguments(replay: argparse.ArgumentParser) -> None:
    """Add the sizing flags to the ``replay`` subcommand's parser, as one argument group."""
    group = replay.add_argument_group("sizing")
    group.add_argument("--route-knn-legend", dest="knn_legend",
                       action=argparse.BooleanOptionalAction, default=False,
                       help="end an LRU-only table's legend with route_knn's hit rate change at "
                            "each size: route_knn replayed beside the sweep, in the same "
                            "compiled programs (one more program to compile; off by default)")
    group.add_argument("--per-layer", action="store_true",
                       help="also give each configuration's hit rate per layer "
                            "(pallas_cache.per_layer_stats of its final state): lines under a "
                            "table or markdown, a layer_hit_rates list in each json, jsonl or "
                            "csv record (only with this flag)")
    group.add_argument("--top-k", type=int, default=None, metavar="K",
                       help="routes per layer-call of a synthetic trace (with --num-layers and "
                            "--num-experts, its geometry; default: --model's, else the "
                            "preset's); a --trace's routes give its own")
    group.add_argument("--batch", type=int, nargs="+", default=None, metavar="B",
                       help="replay B requests decoding together (continuous batching: a "
                            "finished request's place goes to the next), each layer-call "
                            "carrying every active request's token; a sweep axis like "
                            "--cache-size (default: 1, one token per call)")
    group.add_argument("--requests", type=int, default=None, metavar="N",
                       help="cut a synthetic trace into N requests of unequal length (for "
                            "--batch; a --trace's sequences are its requests)")
    group.add_argument("--cpu-fixed-cost", metavar="TIME", default=None,
                       help="T_cpu, the CPU partial's fixed cost per layer-call that has at "
                            "least one CPU expert, e.g. 0.08ms (pallas-cache bench-bandwidth "
                            "measures it; needs W and both bandwidths; default 0)")
    group.add_argument("--gpu-layer-ms", metavar="A", default=None,
                       help="A, a layer-call's GPU time outside its routed experts (attention, "
                            "router, norms, the cache step), in ms (e.g. 0.07, an estimate: "
                            "docs/replay.md); with --gpu-expert-ms, times the decode with "
                            "copies and compute overlapping (overlap_ms_per_token, "
                            "stall_ms_per_token, prefetch_bound; docs/semantics.md §11.6); "
                            "needs W and --link-bandwidth")
    group.add_argument("--gpu-expert-ms", metavar="C", default=None,
                       help="C, the GPU time of one routed expert computed on the device, in "
                            "ms (e.g. 0.09); either flag turns the GPU-time model on, the "
                            "other then counting as 0")


#: The GPU-time flags, as (attribute, flag).
_GPU_FLAGS = (("gpu_layer_ms", "--gpu-layer-ms"), ("gpu_expert_ms", "--gpu-expert-ms"))


def _milliseconds(flag: str, text: str) -> float:
    """A ``--gpu-*-ms`` value in seconds: a bare number is milliseconds, or a duration with
    its unit (``70us``); finite and at least 0."""
    try:  # the double nearest the decimal's seconds: 0.07 ms is 7e-05 s, not 7.000000000000001e-05
        seconds = float(decimal.Decimal(text.strip()) / 1000)
    except (decimal.InvalidOperation, ValueError):
        try:
            seconds = parse_duration(text)
        except ValueError:
            raise ValueError(f"{flag} {text!r}: expected milliseconds such as 0.07 (or a "
                             f"duration such as 70us)") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{flag} {text!r}: must be a finite time of at least 0 ms")
    return seconds + 0.0  # -0 is 0


def gpu_seconds(args, cost) -> tuple[float | None, float | None]:
    """``(A, C)`` in seconds from ``--gpu-layer-ms`` and ``--gpu-expert-ms`` (``None`` for a
    flag not given; ``(None, None)``: no GPU-time model). Refuses, naming the flag, a bad
    value, a missing expert size or link bandwidth, and ``--devices`` above 1."""
    given = [(flag, getattr(args, name, None)) for name, flag in _GPU_FLAGS]
    if all(text is None for _, text in given):
        return None, None
    values = [None if text is None else _milliseconds(flag, text) for flag, text in given]
    flag = next(flag for flag, text in given if text is not None)
    if cost.expert_bytes is None or cost.link_bandwidth is None:
        raise ValueError(f"{flag} needs an expert size (--model or --expert-bytes) and "
                         f"--link-bandwidth")
    devices = getattr(args, "devices", None)
    if devices is not None and devices > 1:
        raise ValueError(f"{flag} times one device's decode; it does not combine with "
                         f"--devices {devices} (yet)")
    return values[0], values[1]


def check_gpu_policies(cost, policies) -> None:
    """With the GPU's time and no ``--cpu-bandwidth``, every policy must copy every miss
    (``full``): another leaves experts to the CPU, whose time is then unknown (ValueError)."""
    from pallas_cache.policy import ONE
    from pallas_cache.sizing.sweep_records import parse_policy

    if not cost.gpu or cost.cpu_bandwidth is not None:
        return
    for policy in policies:
        if int(parse_policy(policy).fraction16) != ONE:
            raise ValueError(f"--gpu-layer-ms/--gpu-expert-ms time the CPU partial of policy "
                             f"{policy}: give --cpu-bandwidth, or --policy full")


def prefetch_lines(results, trace, cost) -> list[str]:
    """The line under a table with the GPU's time (docs/semantics.md §11.6): at each cache size,
    the fastest row's ``prefetch_bound`` (what any prefetch of the next layers could save) and,
    for a ``full`` row, what better eviction could save at most (Belady's misses as demand
    copies), then the regime: one expert's copy time beside one layer's GPU work."""
    timed = [r for r in results if r.overlap_ms_per_token is not None]
    if not timed:
        return []
    fastest = {}
    for r in timed:  # the first of equally fast rows
        best = fastest.get(r.cache_size)
        if best is None or r.overlap_ms_per_token < best.overlap_ms_per_token:
            fastest[r.cache_size] = r
    rows = [fastest[size] for size in sorted(fastest)]
    prefetch = ", ".join(f"{100 * r.prefetch_bound:.1f}% at S = {r.cache_size}" for r in rows)
    eviction = [(r, _eviction_bound(r, cost)) for r in rows]
    eviction = ", ".join(f"{100 * bound:.0f}% at S = {r.cache_size}" for r, bound in eviction
                         if bound is not None)
    A = cost.gpu_layer_seconds or 0.0
    C = cost.gpu_expert_seconds or 0.0
    k = min(trace.top_k, trace.num_experts)
    tau = cost.expert_bytes / cost.link_bandwidth
    layer = A + k * C
    ratio = f"{tau / layer:.3g}x" if layer > 0 else "unbounded"
    text = (f"prefetch_bound: any prefetch of the next layers could save at most {prefetch} "
            f"here (the fastest row at each size, by overlap_ms_per_token)")
    if eviction:
        text += f"; better eviction could save up to {eviction} (Belady's misses, full rows)"
    text += (f". One expert's copy takes tau = W/B_link = {1e3 * tau:.3g} ms, one layer's GPU "
             f"work A + k*C = {1e3 * layer:.3g} ms ({ratio}): prefetch can pay only where "
             f"they are near (docs/replay.md).")
    return [text]


def _eviction_bound(result, cost) -> float | None:
    """For a ``full`` row with its Belady hit rate: ``1 - (A * calls + max(C * active,
    tau * Belady's misses)) / overlap``, the most any eviction with demand copies could save
    (each call takes at least ``A`` plus the larger of its device work and its copies, and no
    eviction misses less than Belady); ``None`` for other rows."""
    if (result.policy not in ("full", "fraction:1") or result.belady_hit_rate is None
            or not result.overlap_ms_per_token):
        return None
    A = cost.gpu_layer_seconds or 0.0
    C = cost.gpu_expert_seconds or 0.0
    tau = cost.expert_bytes / cost.link_bandwidth
    misses = result.active * (1.0 - result.belady_hit_rate)
    floor = A * result.calls + max(C * result.active, tau * misses)
    total = result.overlap_ms_per_token * max(result.tokens, 1) / 1e3
    return max(0.0, 1.0 - floor / total)


def cpu_fixed_seconds(args, timed: bool) -> float:
    """``--cpu-fixed-cost`` in seconds (0 when not given); ``timed``: whether ``W`` and both
    bandwidths are known, without which the flag does not apply (an error naming it)."""
    text = getattr(args, "cpu_fixed_cost", None)
    if text is None:
        return 0.0
    try:
        seconds = parse_duration(text)
    except ValueError as error:
        raise ValueError(f"--cpu-fixed-cost: {error}") from None
    if not timed:
        raise ValueError("--cpu-fixed-cost needs an expert size (--model or --expert-bytes) and "
                         "both --link-bandwidth and --cpu-bandwidth")
    return seconds


_GEOMETRY_FLAGS = (("num_layers", "--num-layers", "moe_layers", "MoE layers"),
                   ("num_experts", "--num-experts", "routed_experts", "routed experts"),
                   ("top_k", "--top-k", "top_k", "top-k"))


def synthetic_geometry(args, default_preset: str) -> dict:
    """The geometry a synthetic trace (named by ``--synthetic``, or the default one) is
    generated with: ``{"num_layers": L, "num_experts": E, "top_k": k}`` for the fields that
    differ from the preset, from ``--model`` (its MoE layers, routed experts and top-k) and the
    explicit ``--num-layers`` / ``--num-experts`` / ``--top-k``; ``{}`` for a ``--trace``, whose
    ``--num-layers`` / ``--num-experts`` declare its counts and whose routes give its top-k.

    Raises ValueError naming the flag: ``--top-k`` with a ``--trace``; an explicit count that
    contradicts ``--model``'s; a count below 1; a top-k above the experts."""
    from pallas_cache.sizing.models import resolve_model

    if getattr(args, "trace", None):
        if getattr(args, "top_k", None) is not None:
            raise ValueError("--top-k applies to a synthetic trace; a --trace's routes give its "
                             "top-k")
        return {}
    geometry = {}
    model = resolve_model(args.model)[0] if getattr(args, "model", None) else None
    for field, flag, model_field, what in _GEOMETRY_FLAGS:
        value = getattr(args, field, None)
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
        if model is not None:
            theirs = getattr(model, model_field)
            if value is not None and value != theirs:
                raise ValueError(f"{flag} {value} contradicts --model {model.name} ({theirs} "
                                 f"{what}); give one or the other (--expert-bytes sets W "
                                 f"without a geometry)")
            value = theirs
        if value is not None:
            geometry[field] = value
    from pallas_cache.sizing import synthetic

    preset = synthetic.PRESETS.get(args.synthetic or default_preset)
    if preset is not None:
        experts = geometry.get("num_experts", preset.num_experts)
        top_k = geometry.get("top_k", preset.top_k)
        if top_k > experts:  # a model's own geometry never does this: explicit flags only
            raise ValueError(f"--top-k {top_k} exceeds --num-experts {experts} (the experts per "
                             f"layer of the synthetic trace)")
    return geometry



def budget_fit(cost, num_layers: int, num_experts: int) -> int | None:
    """The pool size that exactly fills ``--device-budget``: ``floor(budget / W)`` slots, at most
    ``L * E`` (every expert resident; a bigger pool holds nothing more); ``None`` without a
    budget or when it holds less than one layer's ``E`` experts."""
    if cost.device_budget is None or cost.expert_bytes is None:
        return None
    slots = min(cost.device_budget // cost.expert_bytes, num_layers * num_experts)
    return slots if slots >= num_experts else None


def with_budget_fit(sizes, lines, cost, num_layers: int, num_experts: int):
    """``(sizes, lines)`` of the sweep with :func:`budget_fit`'s size added beside the grid's
    (sorted in), and a line saying so; unchanged when the grid has it already or there is none."""
    from pallas_cache.sizing.units import format_bytes

    fit = budget_fit(cost, num_layers, num_experts)
    if fit is None or fit in sizes:
        return sizes, lines
    whole = " (every expert)" if fit == num_layers * num_experts else ""
    line = (f"--device-budget {format_bytes(cost.device_budget)} fits {fit} slots of "
            f"{format_bytes(cost.expert_bytes)} ({format_bytes(fit * cost.expert_bytes)})"
            f"{whole}: replayed beside the grid")
    return sorted([*sizes, fit]), [*lines, line]


def cliff_lines(results, trace) -> list[str]:
    """The lines under the table that name the sizes past a cliff (docs/semantics.md §11.3):
    below ``L*k`` slots, one token's working set, where global LRU thrashes (with each size's
    measured hit rate, the best row's of that size); and, beside the stationary per-layer
    oracle, sizes whose ``round(S/L)`` slots per layer are below ``3 * top_k``, where per-layer
    LRU falls far below the oracle (peers measured about no hits there on fine-grained models),
    with per-layer LRU's hit rate measured on this trace at ``round(S/L)`` slots per layer."""
    from pallas_cache.sizing.trace_stats import per_layer_lru_hit_rate

    num_layers, top_k = trace.num_layers, min(trace.top_k, trace.num_experts)
    sizes = sorted({r.cache_size for r in results})
    lines = []
    below = [size for size in sizes if size < num_layers * top_k]
    if below:
        best = {size: max(r.hit_rate for r in results if r.cache_size == size) for size in below}
        lines.append(f"Below one token's working set (S < L*k = {num_layers * top_k}): "
                     + ", ".join(f"S = {size} (hit rate {best[size]:.3f})" for size in below)
                     + ": LRU evicts what the next token's same layer needs.")
    thin = [size for size in sizes if round(size / num_layers) < 3 * top_k]
    if thin:
        measured = []
        for size in thin:
            per_layer = round(size / num_layers)
            if per_layer < trace.top_k:
                measured.append(f"S = {size}: {per_layer} < top_k slots per layer")
            else:
                rate = per_layer_lru_hit_rate(trace, per_layer * num_layers)
                measured.append(f"S = {size}: {rate:.3f}")
        lines.append(f"Per-layer cliff (round(S/L) < 3*top_k = {3 * top_k} slots per layer; "
                     f"oracle_hit_rate assumes each layer's best fixed set): per-layer LRU "
                     f"measured on this trace, {'; '.join(measured)}.")
    return lines


def batches(args) -> list[int] | None:
    """``--batch``'s sizes, distinct, in the order given; ``None`` when the replay is not batched
    (no ``--batch``, or ``--batch 1``: one token per call, the plain replay). Checks
    ``--requests`` too (ValueError naming the flag)."""
    requests = getattr(args, "requests", None)
    if requests is not None:
        if getattr(args, "trace", None):
            raise ValueError("--requests applies to a synthetic trace; a --trace's sequences "
                             "are its requests")
        if requests < 1:
            raise ValueError(f"--requests {requests}: must be at least 1")
    sizes = getattr(args, "batch", None)
    if sizes is None:
        return None
    bad = [size for size in sizes if size < 1]
    if bad:
        raise ValueError(f"--batch {bad[0]}: must be at least 1")
    sizes = list(dict.fromkeys(sizes))
    return None if sizes == [1] else sizes


#: A size is too short a trace's when more than this share of a ``full`` row's misses are cold
#: (the first use of an expert, which every cache pays once).
COLD_SHARE = 0.5


def trace_lines(rows, trace, synthetic_preset: str | None) -> list[str]:
    """The lines under the table (or on stderr) that say what the trace can tell: that it is
    synthetic, and from which generator (``mixtral-realistic`` is calibrated on Mixtral-8x7B
    decode traces, and stretched to another geometry it is that calibration's guess); and the
    cache sizes it is too short for, where more than :data:`COLD_SHARE` of a ``full`` row's
    misses are cold (the first use of each of the ``D`` distinct experts it routes), short of
    a pool of every expert."""
    import numpy as np

    lines = []
    geometry = f"{trace.num_layers} layers x {trace.num_experts} experts, top-{trace.top_k}"
    if synthetic_preset is not None:
        calibrated = synthetic_preset == "mixtral-realistic"
        stretched = (trace.num_layers, trace.num_experts, trace.top_k) != (32, 8, 2)
        lines.append(
            f"The trace is synthetic ({synthetic_preset}, {trace.num_tokens} tokens, "
            f"{geometry}): " + (
                "a generator calibrated on Mixtral-8x7B decode traces"
                + (", stretched to this geometry, so its hit rates are a guess for this model"
                   if stretched else "") if calibrated else
                "a generator calibrated on no model's routing")
            + ". Replay a recorded trace of your model (--trace) before trusting a size.")
    routes = trace.routes
    valid = routes >= 0
    flat = (np.broadcast_to(trace.layers[:, None], routes.shape).astype(np.int64)
            * trace.num_experts + routes)[valid]
    distinct = int(np.unique(flat).size)
    # (a pool of every expert, S >= L*E, misses nothing but cold: its steady state is plain)
    short = sorted({r["cache_size"] for r in rows if r["policy"] == "full" and r["missing"]
                    and distinct > COLD_SHARE * r["missing"]
                    and r["cache_size"] < trace.num_layers * trace.num_experts})
    if short:
        lines.append(
            f"The trace is too short for cache_size {', '.join(map(str, short))}: there more "
            f"than half of the misses are cold, the first use of one of the {distinct} experts "
            f"it routes, which any cache pays once; a longer trace (--tokens, or more "
            f"requests) shows what those sizes hold in steady state.")
    return lines


def layer_hit_rates(result) -> list[float | None]:
    """A replay result's hit rate per layer, ``1 - missing/active`` of each layer's counters
    (``ReplayResult.layer_stats``); ``None`` for a layer no call routed."""
    return [None if not stats.active else 1.0 - stats.missing / stats.active
            for stats in result.layer_stats]


def per_layer_lines(results, rows, per_line: int = 12) -> list[str]:
    """The lines under the table of ``--per-layer``: for each row, its cache size and the
    configuration keys that vary, then its hit rate per layer, ``per_line`` layers a line after
    their range (``-`` for a layer no call routed); within 100 columns for any layer count."""
    from pallas_cache.sizing.report import CONFIG_KEYS

    varying = [key for key in CONFIG_KEYS if len({row[key] for row in rows}) > 1]
    lines = ["Hit rate per layer (- where no call routed the layer):"]
    for result, row in zip(results, rows):
        lines.append(" ".join([f"cache_size={row['cache_size']}"]
                              + [f"{key}={row[key]}" for key in varying]))
        rates = ["-" if rate is None else f"{rate:.3f}" for rate in layer_hit_rates(result)]
        width = len(str(max(len(rates) - 1, 0)))
        for first in range(0, len(rates), per_line):
            last = min(first + per_line, len(rates)) - 1
            lines.append(f"  layers {first:>{width}}-{last:<{width}}  "
                         + " ".join(f"{rate:>5}" for rate in rates[first:last + 1]))
    return lines
