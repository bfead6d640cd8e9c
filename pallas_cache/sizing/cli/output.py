"""What ``pallas-cache replay`` prints: the records in the asked format, or the text table with
the lines above it (the expert size, the bandwidths, the sizes, the devices) and under it (what
the trace can tell, the cliffs, the cost model, the picks, the GPU's time, route_knn, the hit
rates per layer); warnings; and the plot, written whole or not at all."""

from __future__ import annotations

import os
import stat
import sys
import tempfile
import textwrap

from pallas_cache.sizing.cli.devices import device_header
from pallas_cache.sizing.cli.findings import (Cliffs, Coverage, EvictionBounds, Findings,
                                              Frontier, KnnChanges, Prefetch)
from pallas_cache.sizing.cli.parser import UsageError
from pallas_cache.sizing.report import (CONFIG_KEYS, config_label, format_records, merged_configs,
                                       pick_label)
from pallas_cache.sizing.sweep.cost import figure_words, ranking_figure
from pallas_cache.sizing.units import format_bandwidth, format_bytes, format_duration

__all__ = ["KNN_POINTER", "budget_pick_lines", "cliff_lines", "eviction_line",
           "frontier_lines", "knn_line", "legend", "model_mismatch", "per_layer_lines",
           "prefetch_lines", "print_rows", "stops_copying_lines", "trace_lines", "write_plot"]


def print_rows(request, rows, found: Findings, size_lines, auto_k) -> None:
    """The rows of one replay on stdout: records in the asked format (the lines about the trace
    on stderr, unless quiet), or the table under its header lines with its legend; the hit
    rates per layer under them, or in the records, with ``--per-layer``. ``found``: what the
    replay tells beyond the rows (:func:`~pallas_cache.sizing.cli.findings.findings`)."""
    fmt = request.output.format
    per_layer = []
    if request.output.per_layer and fmt in ("table", "markdown"):
        per_layer = per_layer_lines(found.layer_hit_rates, rows)
    elif request.output.per_layer:
        rows = [dict(row, layer_hit_rates=rates)
                for row, rates in zip(rows, found.layer_hit_rates)]
    about_trace = trace_lines(found.coverage)
    if fmt != "table":
        print(format_records(rows, fmt))
        for line in per_layer:
            print(line)
        for line in [] if request.output.quiet else about_trace:
            print(f"pallas-cache: {line}", file=sys.stderr)
        return
    header = _header_lines(request, auto_k) + [f"size: {line}" for line in size_lines]
    per_device = request.parallel == "tensor"
    # The answer: with a budget its pick, above the table (the first screen); without one,
    # the fastest size within each common budget, right under the table.
    picks = budget_pick_lines(rows, request.cost, per_device)
    print(format_records(rows, "table", header + device_header(request) + picks,
                         under_table=() if picks else frontier_lines(found.frontier,
                                                                     per_device)))
    knn = knn_line(found.knn, request.lru_only)
    print("\n".join(legend(found, request.cost, knn, about_trace) + per_layer))


def _header_lines(request, auto_k) -> list[str]:
    """The lines above the table: what ``W`` is, the bandwidths, the GPU's times, and how
    ``fraction:auto`` was resolved."""
    cost, header = request.cost, []
    if request.weight_label:
        header.append(f"expert: {request.weight_label}")
    if cost.link_bandwidth or cost.cpu_bandwidth:
        header.append("bandwidth: " + "  ".join(
            f"{name}={format_bandwidth(value)}" for name, value in
            (("B_link", cost.link_bandwidth), ("B_cpu", cost.cpu_bandwidth)) if value)
            + (f"  T_cpu={format_duration(cost.cpu_fixed_seconds)}"
               if cost.cpu_fixed_seconds else ""))
    if cost.gpu:
        header.append(f"gpu: A={format_duration(cost.gpu_layer_seconds or 0.0)} per "
                      f"layer-call  C={format_duration(cost.gpu_expert_seconds or 0.0)} per "
                      f"device-computed expert (estimates you gave)")
    if request.policies is None or "fraction:auto" in request.policies:
        if cost.link_bandwidth and cost.cpu_bandwidth and not cost.cpu_fixed_seconds:
            header.append(f"fraction:auto = B_link/(B_link+B_cpu) = "
                          f"{cost.auto_fraction():.4f} -> {cost.auto_policy()}")
        elif cost.link_bandwidth and cost.cpu_bandwidth:
            header.append(f"fraction:auto = (k*W/B_cpu + T_cpu)/(k*W/B_link + k*W/B_cpu) at "
                          f"k = {auto_k} = {cost.auto_fraction(auto_k):.4f} -> "
                          f"{cost.auto_policy(auto_k)}")
    return header


def write_plot(request, rows) -> int:
    """Draw the plot, if asked (its path checked before the replay); 0, or a
    :class:`UsageError` when it could not be written."""
    path = request.output.plot
    if not path:
        return 0
    try:
        _plot(rows, path)
    except OSError as error:  # checked before the replay; changed since
        raise UsageError(f"pallas-cache: --plot {path}: {error.strerror or error}") from None
    print(f"plot written to {path}", file=sys.stderr)
    return 0


def model_mismatch(model, trace) -> str | None:
    """A warning when the trace's geometry is not the model's, else ``None``."""
    ours = (trace.num_layers, trace.num_experts, trace.top_k)
    theirs = (model.moe_layers, model.routed_experts, model.top_k)
    if ours == theirs:
        return None
    return (f"pallas-cache: warning: the trace has {ours[0]} layers x {ours[1]} experts, "
            f"top-{ours[2]}, but {model.name} has {theirs[0]} MoE layers x {theirs[1]} routed "
            f"experts, top-{theirs[2]}: W comes from the model, the routing from the trace")


#: The legend's last line of an LRU-only table without ``--route-knn-legend``.
KNN_POINTER = ("route_knn (the eviction that wins on real Mixtral routing): add --eviction lru "
               "route_knn to see its rows, or --route-knn-legend for one line of its changes.")


def knn_line(knn: KnnChanges | None, lru_table: bool) -> str | None:
    """The legend's line: route_knn's hit rate minus LRU's at each size of its series. Without
    companions (``knn`` ``None``), an LRU-only table (``lru_table``) gets :data:`KNN_POINTER`,
    any other ``None``."""
    if knn is None:
        return KNN_POINTER if lru_table else None
    changes = ", ".join(f"{change:+.3f} at {size}" for size, change in knn.changes)
    return (f"route_knn (the eviction that wins on real Mixtral routing) on this trace, policy "
            f"{knn.policy}: hit rate {changes} (add --eviction lru route_knn to see its rows).")


def legend(found: Findings, cost, knn_line: str | None = None, about_trace=()) -> list[str]:
    """What a newcomer needs to read the table: the bounds, the model, how its verdicts rank,
    and (an LRU sweep) what route_knn changes (wrapped as the rest; the verdicts themselves are
    above or right under the table). ``about_trace``: what the trace can tell (first)."""
    covered = found.coverage
    k = min(covered.top_k, covered.num_experts)
    paragraphs = [
        "hit_rate = 1 - missing/active per layer-call. Bounds: belady_hit_rate bounds the `full` "
        "rows (every miss admitted); bypass_optimum_hit_rate bounds every row (a miss may be "
        "served without being admitted); oracle_hit_rate (a fixed max(1, round(S/L)) slots per "
        f"layer) is a reference, not a bound. L*k = {covered.num_layers * k} slots hold one "
        "token's experts.",
    ]
    if not cost.expert_bytes:
        paragraphs.append("For bytes and ms per token add --model NAME (or --expert-bytes 336MiB) "
                          "and --link-bandwidth 25GB/s --cpu-bandwidth 60GB/s (your machine's "
                          "numbers: see the README).")
    elif not cost.timed:
        paragraphs.append("For modeled ms per token add --link-bandwidth and --cpu-bandwidth.")
    else:
        fixed = " + T_cpu if cpu_experts > 0" if cost.cpu_fixed_seconds else ""
        key = found.ranking
        paragraphs.append("modeled_ms_per_token: per layer-call max(fetched*W/B_link, "
                          f"cpu_experts*W/B_cpu{fixed}), summed per token (docs/semantics.md "
                          f"§11); best = the fastest row at its cache_size, by {key}"
                          + (" (the GPU's time included, below)." if key and
                             key.startswith("overlap") else "."))
    paragraphs += stops_copying_lines(found.stops_copying)
    if cost.gpu:
        paragraphs.append(
            "overlap_ms_per_token: the layer-calls one after the other, each taking A, then its "
            "copies (tau = W/B_link each, one link) while the device computes each expert (C) "
            "once it is there and the CPU partial runs beside; stall_ms_per_token = the "
            "device's wait; prefetch_bound = 1 - busiest resource/overlap, on rows whose CPU "
            "computes no expert (- where it does: there it would measure how unevenly the link "
            "and the CPU share the work, not what prefetch saves) (docs/semantics.md §11.6).")
        paragraphs += prefetch_lines(found.prefetch)
        paragraphs += eviction_line(found.eviction)
    return [textwrap.fill(text, width=100, break_on_hyphens=False)
            for text in [*about_trace, *cliff_lines(found.cliffs), *paragraphs,
                         *([knn_line] if knn_line else [])]]


def budget_pick_lines(rows, cost, per_device: bool = False) -> list[str]:
    """The ``--device-budget`` answer for a table's records: its pick (one per batch), or that
    nothing fits; none without a budget or a figure to rank by."""
    if cost.device_budget is None or ranking_figure(rows) is None:
        return []
    budget = format_bytes(cost.device_budget)
    if not any(r["budget_best"] for r in rows):
        smallest = min(r["cache_bytes"] for r in rows)
        return [f"No configuration fits the {budget} device budget (the smallest pool takes "
                f"{format_bytes(smallest)})."]
    return _budget_picks(rows, budget, per_device)


def _budget_picks(rows, budget: str, per_device: bool) -> list[str]:
    """One line per budget pick (one per batch), naming its batch and, for a configuration
    whose rows another's equal, both; a budget per device says so. The ms/token is the figure
    the pick was ranked by (:func:`ranking_figure`)."""
    key = ranking_figure(rows)
    merged = merged_configs(rows)
    lines = []
    for r in rows:
        config = tuple(r[key] for key in CONFIG_KEYS)
        if not r["budget_best"] or config in merged:
            continue
        same = [" ".join(f"{key}={mine}" for key, mine, theirs in zip(CONFIG_KEYS, other, kept)
                         if mine != theirs)
                for other, kept in merged.items() if kept == config]
        where = (f"Best within {budget}{' per device' if per_device else ''}"
                 f"{' at batch=' + str(r['batch']) if 'batch' in r else ''}")
        lines.append(
            f"{where}: cache_size={r['cache_size']} ({format_bytes(r['cache_bytes'])}) "
            f"{pick_label(r)}: {r[key]:.1f} {figure_words(key)}"
            + (f" (the same rows as {', '.join(same)})." if same else "."))
    return lines


def frontier_lines(found: Frontier | None, per_device: bool = False) -> list[str]:
    """The lines right under a table without ``--device-budget``: for each expert-pool budget
    of :func:`~pallas_cache.sizing.cli.findings.frontier`, the size that fits with the lowest
    ms/token, with its bytes and ms/token; per batch in a batched table. None without bytes or
    a figure."""
    if found is None:
        return []
    key = found.key
    lines = [f"Fastest within each expert-pool budget{' per device' if per_device else ''}, by "
             f"{key} (--device-budget B names one):"]
    for group in found.groups:
        at = "" if group.batch is None else f" at batch={group.batch}"
        if group.below is not None:
            lines.append(f"  {format_bytes(group.below)}{at}: nothing fits (the smallest pool "
                         f"takes {format_bytes(group.smallest)})")
        for budget, pick in group.picks:
            lines.append(f"  {format_bytes(budget)}{at}: cache_size={pick['cache_size']} "
                         f"({format_bytes(pick['cache_bytes'])}) "
                         f"{config_label(tuple(pick[k] for k in CONFIG_KEYS), found.varying)}: "
                         f"{pick[key]:.1f} ms/token")
    return lines


def stops_copying_lines(stops) -> list[str]:
    """Why a ``fraction:Q`` marked best copies no miss once the pool is full (``stops``:
    ``(policy, k)`` pairs, :func:`~pallas_cache.sizing.cli.findings.stops_copying`): at ``k``
    routes per call its split rounds every call's misses down to 0 (docs/semantics.md §5.3), so
    only the admission rule fills empty slots, and the CPU computes every miss after."""
    return [f"{policy} is marked best, but at {k} routes per call its balanced split copies "
            f"none of a call's 1-{k} misses (docs/semantics.md §5.3): only the admission rule "
            f"fills empty slots, so once the pool is full it stops copying and the CPU computes "
            f"every miss, which the model finds fastest there." for policy, k in stops]


def prefetch_lines(found: Prefetch | None) -> list[str]:
    """The line under a table with the GPU's time (docs/semantics.md §11.6): at each cache size,
    the fastest row's ``prefetch_bound`` among rows whose CPU computes no expert (what any
    prefetch of the next layers could save), then the regime: one expert's copy time beside
    one layer's GPU work."""
    if found is None:
        return []
    prefetch = ", ".join(f"{100 * bound:.1f}% at S = {size}" for size, bound in found.bounds)
    tau, layer = found.tau, found.layer
    ratio = f"{tau / layer:.3g}x" if layer > 0 else "unbounded"
    text = (f"prefetch_bound: any prefetch of the next layers could save at most {prefetch} "
            f"here (the fastest row whose CPU computes no expert at each size, by "
            f"overlap_ms_per_token). " if found.bounds else "")
    text += (f"One expert's copy takes tau = W/B_link = {1e3 * tau:.3g} ms, one layer's GPU "
             f"work A + k*C = {1e3 * layer:.3g} ms ({ratio}): prefetch can pay only where "
             f"they are near (docs/replay.md).")
    return [text]


def eviction_line(found: EvictionBounds | None) -> list[str]:
    """The line under a table with the GPU's time on what better eviction could save, per cache
    size (:func:`~pallas_cache.sizing.cli.findings.eviction_bounds`), and the sizes where the
    ``full`` row already misses no more than Belady; without timed ``full`` rows, a line saying
    how to get them."""
    if found is None:
        return []
    if not found.has_full:
        return (["Eviction: Belady's optimum bounds only the full rows, and this sweep has none: "
                 "add --policy full to see what better eviction could save."]
                if found.timed else [])
    parts = []
    if found.bounds:
        bounds = ", ".join(f"{100 * bound:.0f}% at S = {size}" for size, bound in found.bounds)
        parts.append(f"better eviction could save the full rows up to {bounds} "
                     f"(Belady's misses as demand copies)")
    if found.reached:
        parts.append(f"at S = {', '.join(map(str, found.reached))} the full row already misses "
                     f"no more than Belady's optimum: no eviction does better there")
    return ["Eviction: " + "; ".join(parts) + "."]


def cliff_lines(found: Cliffs | None) -> list[str]:
    """The lines under the table that name the sizes past a cliff (docs/semantics.md §11.3):
    below ``L*k`` slots, one token's working set, where global LRU thrashes (with each size's
    best hit rate); and, beside the stationary per-layer oracle, sizes whose ``round(S/L)``
    slots per layer are below ``3 * top_k``, where per-layer LRU falls far below the oracle
    (peers measured about no hits there on fine-grained models), with per-layer LRU's hit rate
    measured on this trace."""
    if found is None:
        return []
    lines = []
    if found.below:
        lines.append(f"Below one token's working set (S < L*k = {found.working_set}): "
                     + ", ".join(f"S = {size} (hit rate {rate:.3f})" for size, rate in found.below)
                     + ": LRU evicts what the next token's same layer needs.")
    if found.thin:
        measured = [f"S = {size}: {per_layer} < top_k slots per layer" if rate is None
                    else f"S = {size}: {rate:.3f}" for size, per_layer, rate in found.thin]
        lines.append(f"Per-layer cliff (round(S/L) < 3*top_k = {found.per_layer_floor} slots per "
                     f"layer; oracle_hit_rate assumes each layer's best fixed set): per-layer LRU "
                     f"measured on this trace, {'; '.join(measured)}.")
    return lines


def trace_lines(found: Coverage) -> list[str]:
    """The lines under the table (or on stderr) that say what the trace can tell: that it is
    synthetic, and from which generator (``mixtral-realistic`` is calibrated on Mixtral-8x7B
    decode traces, and stretched to another geometry it is that calibration's guess); and the
    cache sizes it is too short for, where more than half of a ``full`` row's misses are cold
    (the first use of each of the distinct experts it routes), short of a pool of every
    expert."""
    lines = []
    geometry = f"{found.num_layers} layers x {found.num_experts} experts, top-{found.top_k}"
    preset = found.synthetic_preset
    if preset is not None:
        calibrated = preset == "mixtral-realistic"
        stretched = (found.num_layers, found.num_experts, found.top_k) != (32, 8, 2)
        lines.append(
            f"The trace is synthetic ({preset}, {found.num_tokens} tokens, {geometry}): " + (
                "a generator calibrated on Mixtral-8x7B decode traces"
                + (", stretched to this geometry, so its hit rates are a guess for this model"
                   if stretched else "") if calibrated else
                "a generator calibrated on no model's routing")
            + ". Replay a recorded trace of your model (--trace) before trusting a size.")
    if found.short_sizes:
        lines.append(
            f"The trace is too short for cache_size {', '.join(map(str, found.short_sizes))}: "
            f"there more than half of the misses are cold, the first use of one of the "
            f"{found.distinct_experts} experts it routes, which any cache pays once; a longer "
            f"trace (--tokens, or more requests) shows what those sizes hold in steady state.")
    return lines


def per_layer_lines(layer_rates, rows, per_line: int = 12) -> list[str]:
    """The lines under the table of ``--per-layer``: for each row, its cache size and the
    configuration keys that vary, then its hit rate per layer (``layer_rates``, one list per
    row), ``per_line`` layers a line after their range (``-`` for a layer no call routed);
    within 100 columns for any layer count."""

    varying = [key for key in CONFIG_KEYS if len({row[key] for row in rows}) > 1]
    lines = ["Hit rate per layer (- where no call routed the layer):"]
    for layer_rate, row in zip(layer_rates, rows):
        lines.append(" ".join([f"cache_size={row['cache_size']}"]
                              + [f"{key}={row[key]}" for key in varying]))
        rates = ["-" if rate is None else f"{rate:.3f}" for rate in layer_rate]
        width = len(str(max(len(rates) - 1, 0)))
        for first in range(0, len(rates), per_line):
            last = min(first + per_line, len(rates)) - 1
            lines.append(f"  layers {first:>{width}}-{last:<{width}}  "
                         + " ".join(f"{rate:>5}" for rate in rates[first:last + 1]))
    return lines


def _write_atomically(path: str, write) -> None:
    """``write(temp_path)`` next to ``path``, then rename over it: an interrupt or error leaves
    no partial file behind."""
    folder, name = os.path.split(os.path.abspath(path))
    handle, temp = tempfile.mkstemp(dir=folder, prefix=f".{name}.",
                                    suffix=os.path.splitext(name)[1])
    os.close(handle)
    try:
        write(temp)
        try:  # the temporary file is 0600: give it the mode the file has, or a new file gets
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            mode = _new_file_mode()
        os.chmod(temp, mode)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


def _new_file_mode() -> int:
    """The mode a newly created file gets from the process umask (0o644 under umask 022).
    Read from /proc where Linux has it, so the umask is never changed, even for a moment."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _plot(rows, path: str) -> None:
    from pallas_cache.sizing.plotting import plot

    figure = plot(rows)
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    _write_atomically(path, lambda temp: figure.savefig(temp, dpi=120, format=extension))
