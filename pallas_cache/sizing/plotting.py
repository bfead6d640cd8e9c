"""One picture of a replay sweep: hit rate against cache size next to both offline optima, and
the per-token traffic and modeled milliseconds.

:func:`plot` draws on a bare :class:`matplotlib.figure.Figure` (no pyplot state); ``pallas-cache
replay --plot`` and the example notebook call it. Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from pallas_cache.sizing.report import CONFIG_KEYS

__all__ = ["plot", "series_style"]

#: Ten colours (matplotlib's tab10), four line styles and seven markers: series ``i`` takes
#: colour ``i % 10``, marker ``i % 7`` and line style ``(i // 10) % 4``, so the first 70 series
#: differ in (colour, marker) and the first 40 also in (colour, line style). Given an eviction,
#: the line style is the eviction's instead (``i`` then counts the other options).
_COLOURS = tuple(f"C{i}" for i in range(10))
_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
#: One line style per eviction policy.
EVICTION_LINESTYLES = {"lru": "-", "pair_lfu": "--", "route_knn": "-.", "route_lfu": ":"}
#: The marker of the CPU-computed traffic (the fetched traffic keeps the series' marker).
CPU_MARKER = "x"

#: ``gid`` of the bound and reference lines, so a caller (or a test) can find them.
BELADY_GID, BYPASS_GID, ORACLE_GID = "belady_hit_rate", "bypass_optimum_hit_rate", "oracle_hit_rate"


def series_style(index: int, eviction: str | None = None) -> dict:
    """Line keyword arguments of series ``index`` (colour x marker x line style); with an
    ``eviction``, its line style from :data:`EVICTION_LINESTYLES`."""
    linestyle = (EVICTION_LINESTYLES[eviction] if eviction is not None else
                 _LINESTYLES[(index // len(_COLOURS)) % len(_LINESTYLES)])
    return {"color": _COLOURS[index % len(_COLOURS)], "marker": _MARKERS[index % len(_MARKERS)],
            "linestyle": linestyle}


#: ``gid`` of the legend's entries that explain the right panel's markers.
MARKER_KEY_GID = "marker-key"


def _marker_labels(weighed: bool, timed: bool) -> list[str]:
    unit = "GiB" if weighed else "experts"
    labels = [f"right: fetched {unit} per token (series marker)",
              f"right: CPU-computed {unit} per token ({CPU_MARKER}; none drawn where 0)"]
    return labels + (["right: modeled ms per token (thin line, hollow marker)"] if timed else [])


def _marker_keys(weighed: bool, timed: bool) -> list:
    """Legend entries for the right panel's markers: grey proxies of the fetched (filled), CPU
    (:data:`CPU_MARKER`) and modeled-ms (hollow, thin) series."""
    from matplotlib.lines import Line2D

    keys = [Line2D([], [], color="0.3", marker="o", linestyle="-", gid=MARKER_KEY_GID),
            Line2D([], [], color="0.3", marker=CPU_MARKER, linestyle="-", gid=MARKER_KEY_GID)]
    if timed:
        keys.append(Line2D([], [], color="0.3", marker="o", markerfacecolor="none",
                           linewidth=0.8, alpha=0.7, linestyle="-", gid=MARKER_KEY_GID))
    return keys


def _rows(results: Iterable) -> list[dict]:
    rows = [r if isinstance(r, dict) else dataclasses.asdict(r) for r in results]
    if not rows:
        raise ValueError("plot needs at least one replay result")
    return rows


def _gib(value):
    return None if value is None else value / 2**30


def plot(results: Sequence, axes=None, *, title: str | None = None):
    """Draw a sweep and return the :class:`~matplotlib.figure.Figure`.

    Left panel: ``hit_rate`` against the cache size (GiB when every row knows ``cache_bytes``,
    else slots), one line per (policy, order, admission, eviction): a colour and marker per
    (policy, order, admission), a line style per eviction (:data:`EVICTION_LINESTYLES`), with
    ``bypass_optimum_hit_rate`` (a bound for every row), ``belady_hit_rate`` (a bound for
    ``full`` rows) and the stationary ``oracle_hit_rate`` (a reference). Right panel: per token,
    the host-to-device traffic (``fetched_bytes_per_token`` in GiB, or ``fetched_per_token``
    experts without ``W``; the series' marker) beside the experts the CPU computes
    (``cpu_bytes_per_token`` or ``cpu_experts_per_token``; marker :data:`CPU_MARKER`; not drawn
    for a series whose CPU traffic is 0 at every size, e.g. ``full``), and, when the rows are
    timed, ``modeled_ms_per_token`` on a second y axis (thin, hollow markers). The legend sits
    outside the data, right of the panels, and ends with an entry per marker kind of the right
    panel. The title is left-aligned above the left panel.

    Args:
      results: :class:`~pallas_cache.sizing.sweep.ReplayResult` rows or their records
        (:func:`pallas_cache.sizing.report.records`).
      axes: a pair of matplotlib Axes to draw on (default: a new 12 x 4.5 inch figure).
      title: the figure's title (default: the records' ``source`` when given records).

    Raises:
      ValueError: no results, or ``axes`` is not a pair.
    """
    rows = _rows(results)
    if axes is None:
        from matplotlib.figure import Figure

        figure = Figure(figsize=(12, 4.5), layout="constrained")
        axes = figure.subplots(1, 2)
        own = True
    else:
        if len(axes) != 2:
            raise ValueError(f"axes must be a pair of Axes, got {len(axes)}")
        figure, own = axes[0].figure, False
    hit_axes, traffic_axes = axes
    weighed = all(r.get("cache_bytes") is not None for r in rows)
    timed = all(r.get("modeled_ms_per_token") is not None for r in rows)

    def x(r):
        return _gib(r["cache_bytes"]) if weighed else r["cache_size"]

    # One line per eviction too: a line through two evictions' points would zig-zag.
    options: dict[str, int] = {}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        option = " / ".join(str(r[key]) for key in CONFIG_KEYS if key != "eviction")
        options.setdefault(option, len(options))
        groups.setdefault((option, r.get("eviction", "lru")), []).append(r)
    ms_axes = traffic_axes.twinx() if timed else None
    for (option, eviction), group in groups.items():
        label = f"{option} / {eviction}"
        group = sorted(group, key=lambda r: r["cache_size"])
        style = series_style(options[option], eviction if eviction in EVICTION_LINESTYLES
                             else None)
        xs = [x(r) for r in group]
        hit_axes.plot(xs, [r["hit_rate"] for r in group], label=label, gid=f"series:{label}",
                      **style)
        traffic = [_gib(r["fetched_bytes_per_token"]) if weighed else r["fetched_per_token"]
                   for r in group]
        traffic_axes.plot(xs, traffic, gid=f"traffic:{label}", **style)
        cpu = [_gib(r["cpu_bytes_per_token"]) if weighed else r["cpu_experts_per_token"]
               for r in group]
        if any(cpu):  # a series that never computes on the CPU (`full`) draws no zero line
            traffic_axes.plot(xs, cpu, gid=f"cpu:{label}", **{**style, "marker": CPU_MARKER})
        if ms_axes is not None:
            ms_axes.plot(xs, [r["modeled_ms_per_token"] for r in group], gid=f"ms:{label}",
                         linewidth=0.8, alpha=0.7, markerfacecolor="none", **style)

    by_size = {r["cache_size"]: r for r in rows}
    sizes = sorted(by_size)
    xs = [x(by_size[s]) for s in sizes]
    # Wide and pale under a thin dashed line: both stay visible where the two optima coincide.
    bounds = ((BYPASS_GID, "bypass optimum (bounds every row)",
               {"color": "0.55", "linewidth": 4.0, "linestyle": "-", "alpha": 0.6, "zorder": 1}),
              (BELADY_GID, "Belady (bounds `full` rows)",
               {"color": "black", "linewidth": 1.2, "linestyle": "--", "zorder": 3}),
              (ORACLE_GID, "stationary oracle (reference)",
               {"color": "0.4", "linewidth": 1.0, "linestyle": ":", "zorder": 1}))
    for key, label, style in bounds:
        values = [by_size[s][key] for s in sizes]
        if all(v is not None for v in values):
            hit_axes.plot(xs, values, label=label, gid=key, **style)

    unit = "cache size (GiB)" if weighed else "cache size (slots)"
    hit_axes.set_xlabel(unit)
    hit_axes.set_ylabel("hit rate (1 - missing / active)")
    hit_axes.set_ylim(0, 1.02)
    hit_axes.grid(alpha=0.3)
    traffic_axes.set_xlabel(unit)
    traffic_axes.set_ylabel("GiB per token" if weighed else "experts per token")
    traffic_axes.set_ylim(bottom=0)
    traffic_axes.grid(alpha=0.3)
    if ms_axes is not None:
        ms_axes.set_ylabel("modeled ms per token")
        ms_axes.set_ylim(bottom=0)
    if title is None:
        title = rows[0].get("source")
    if title:  # left-aligned, above the left panel: clear of the right panel's axis labels
        figure.suptitle(str(title), fontsize=9, x=0.01, horizontalalignment="left")
    handles, labels = hit_axes.get_legend_handles_labels()
    handles, labels = handles + _marker_keys(weighed, timed), labels + _marker_labels(weighed,
                                                                                      timed)
    columns = -(-len(labels) // 16)  # at most 16 entries a column: the legend fits the height
    if own:
        figure.set_figwidth(12 + 2.8 * (columns - 1))
        figure.legend(handles, labels, loc="outside right upper", fontsize=8, ncols=columns)
    else:
        (ms_axes or traffic_axes).legend(handles, labels, loc="upper left", fontsize=8,
                                         ncols=columns,
                                         bbox_to_anchor=(1.15 if ms_axes else 1.02, 1),
                                         borderaxespad=0)
    return figure
