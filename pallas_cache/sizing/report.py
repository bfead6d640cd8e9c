"""Replay results as records and as text: :func:`records` turns
:class:`~pallas_cache.sizing.sweep.ReplayResult` rows, their trace and the cost model into flat
dicts keyed by :data:`RECORD_KEYS`; :func:`format_records` prints them as ``table``, ``json``,
``jsonl``, ``csv`` (``pair_counts`` as one JSON cell, ``None`` as an empty cell) or
``markdown``; :data:`COLUMN_LEGEND` says what each key means, and :data:`GPU_LEGEND` the keys
a cost model with the GPU's time adds after them (docs/semantics.md §11.6)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re
import textwrap
from typing import Iterable, Sequence

from pallas_cache.sizing.units import format_bytes

__all__ = ["COLUMN_LEGEND", "CONFIG_KEYS", "FORMATS", "GPU_LEGEND", "GPU_RECORD_KEYS",
           "NOT_RECORDED", "RECORD_KEYS", "TABLE_WIDTH", "config_label", "format_records", "legend_text",
           "merged_configs", "pick_label", "records", "table_columns"]

#: The output formats of :func:`format_records` (``pallas-cache replay --format``).
FORMATS = ("table", "json", "jsonl", "csv", "markdown")

#: Every record key with its meaning, in record order.
COLUMN_LEGEND: dict[str, str] = {
    # trace metadata
    "source": "where the trace came from (a path or synthetic:PRESET(...))",
    "layers": "L, MoE layers of the trace's model",
    "experts": "E, routed experts per layer",
    "top_k": "k, route columns per layer-call (-1 padded)",
    "tokens": "complete decode tokens: distinct (sequence, token) pairs (the CLI drops a "
              "sequence's trailing partial token)",
    "calls": "layer-calls replayed (one per token and layer)",
    "sequences": "sequences (requests) in the trace",
    # configuration
    "cache_size": "S, device slots shared by all layers",
    "policy": "full | fraction:Q | cap:N: how many misses of a call are copied",
    "order": "which misses win a capped fetch: recency | lowest_id",
    "admission": "fetches beyond the split: promote_one | none | reuse",
    "eviction": "which resident a fetch evicts: lru | pair_lfu | route_knn | route_lfu (docs/semantics.md §5.16)",
    "expert_bytes": "W, bytes of one routed expert (empty without --model/--expert-bytes)",
    "link_bandwidth": "B_link in bytes/s (empty when not given)",
    "cpu_bandwidth": "B_cpu in bytes/s (empty when not given)",
    "cpu_fixed_seconds": "T_cpu, the CPU partial's fixed cost per call with CPU experts "
                         "(--cpu-fixed-cost), in seconds; 0: none",
    "device_budget": "--device-budget in bytes (empty when not given)",
    # counters, summed over layer-calls
    "routes": "non-padding routes (duplicates counted)",
    "active": "distinct experts routed, summed over calls",
    "missing": "distinct routed experts not resident when their call came",
    "fetched": "experts copied host -> device (a miss admitted into a slot)",
    "cpu_routes": "routes the CPU computed: hybrid misses not fetched (duplicates counted)",
    "cpu_experts": "distinct experts the CPU computed, summed over calls (missing - fetched)",
    "empty_slots": "slots empty at the end of the trace (never filled, or emptied)",
    # rates
    "hit_rate": "1 - missing/active",
    "belady_hit_rate": "offline optimum when every miss is admitted: bounds `full` rows only",
    "bypass_optimum_hit_rate": "offline optimum when a miss may stay on the CPU: bounds every row",
    "oracle_hit_rate": "a fixed max(1, round(S/L)) slots per layer; a reference, not a bound",
    "fetched_per_token": "fetched / tokens: expert copies per token",
    "cpu_experts_per_token": "cpu_experts / tokens: experts the CPU computes per token",
    # cost model (docs/semantics.md §11); empty without W (bytes) or the bandwidths (ms)
    "cache_bytes": "S * W, device bytes of the pool",
    "fetched_bytes_per_token": "fetched * W / tokens",
    "cpu_bytes_per_token": "cpu_experts * W / tokens",
    "modeled_ms_per_token": "per call max(fetched*W/B_link, cpu_experts*W/B_cpu), summed per token",
    "best": "the fastest row at its cache_size, by overlap_ms_per_token when every row has it, "
            "else by modeled_ms_per_token",
    "budget_best": "the fastest row (by the figure best ranks by) whose cache_bytes fits "
                   "--device-budget",
    "note": "why the row deserves a second look (e.g. S < L*k), else empty",
    "pair_counts": "[fetched, cpu_experts, calls] for every per-call pair that occurred (exact; "
                   "enough to model any bandwidths); csv: one cell of JSON",
}

#: The keys of every record, in order.
RECORD_KEYS: tuple[str, ...] = tuple(COLUMN_LEGEND)

#: The keys a cost model with the GPU's time (``--gpu-layer-ms``, ``--gpu-expert-ms``) adds
#: after :data:`RECORD_KEYS`, with their meaning; without it a record has none of them, so its
#: text is what it was before they existed.
GPU_LEGEND: dict[str, str] = {
    "gpu_layer_seconds": "A, a layer-call's GPU time outside its routed experts (--gpu-layer-ms), "
                         "in seconds",
    "gpu_expert_seconds": "C, GPU time per distinct routed expert computed on the device "
                          "(--gpu-expert-ms), in seconds",
    "overlap_ms_per_token": "calls one after the other, copies, device compute and CPU partial "
                            "overlapping inside each (docs/semantics.md §11.6); total / tokens",
    "stall_ms_per_token": "overlap_ms_per_token - (A*calls + C*device-computed experts)/tokens: "
                          "the device's wait",
    "prefetch_bound": "1 - max(gpu_busy, link_busy, cpu_busy)/overlap: the most any prefetch "
                      "moving the same bytes could save (a fraction); empty on a row with CPU "
                      "experts, where it would measure how unevenly the link and the CPU share "
                      "the work",
    "call_counts": "[hits, fetched, cpu_experts, calls] for every per-call triple that occurred "
                   "(exact; enough to re-time any A, C or bandwidths); csv: one cell of JSON",
}

#: The keys of :data:`GPU_LEGEND`, in order.
GPU_RECORD_KEYS: tuple[str, ...] = tuple(GPU_LEGEND)

#: Record keys whose value is a list of lists (csv: one cell of JSON).
_LIST_KEYS = ("pair_counts", "call_counts")
#: Result fields that are no record key: the per-layer counters a replay keeps on request
#: (``pallas-cache replay --per-layer`` adds ``layer_hit_rates`` to the records it prints).
NOT_RECORDED = ("layer_stats",)
#: Keys a csv cell holds as JSON: the list keys, and the per-layer hit rates.
_JSON_CELL_KEYS = _LIST_KEYS + ("layer_hit_rates",)

_TRACE_KEYS = ("source", "layers", "experts", "top_k", "tokens", "calls", "sequences")
_COST_KEYS = ("expert_bytes", "link_bandwidth", "cpu_bandwidth", "cpu_fixed_seconds",
              "device_budget")


def records(results: Iterable, trace, cost=None) -> list[dict]:
    """One flat dict per result, keys :data:`RECORD_KEYS` in that order.

    Args:
      results: :class:`~pallas_cache.sizing.sweep.ReplayResult` rows (from ``replay``).
      trace: the :class:`~pallas_cache.sizing.traces.Trace` they replayed (its metadata).
      cost: the :class:`~pallas_cache.sizing.sweep.cost.CostModel` used, or ``None``.

    ``pair_counts`` becomes a list of ``[fetched, cpu_experts, calls]`` lists (JSON's shape).
    With the GPU's time in ``cost`` (``cost.gpu``) the keys :data:`GPU_RECORD_KEYS` follow, the
    ``call_counts`` likewise as lists.

    Raises:
      ValueError: a result field that is not a record key (the schema and the result diverged).
    """
    meta = {"source": str(trace.source), "layers": int(trace.num_layers),
            "experts": int(trace.num_experts), "top_k": int(trace.top_k),
            "tokens": int(trace.num_tokens), "calls": int(trace.num_calls),
            "sequences": len(trace.sequence_names)}
    config = {key: (getattr(cost, key) if cost is not None else None) for key in _COST_KEYS}
    gpu = cost is not None and getattr(cost, "gpu", False)
    keys = RECORD_KEYS + (GPU_RECORD_KEYS if gpu else ())
    if gpu:
        config.update(gpu_layer_seconds=cost.gpu_layer_seconds or 0.0,
                      gpu_expert_seconds=cost.gpu_expert_seconds or 0.0)
    out = []
    for result in results:
        fields = dataclasses.asdict(result)
        for key in NOT_RECORDED:
            fields.pop(key, None)
        unknown = set(fields) - set(RECORD_KEYS) - set(GPU_RECORD_KEYS)
        if unknown:
            raise ValueError(f"result fields {sorted(unknown)} are not record keys")
        for key in _LIST_KEYS:
            fields[key] = [[int(v) for v in entry] for entry in fields[key]]
        merged = {**fields, **meta, **config}
        merged["tokens"], merged["calls"] = fields["tokens"], fields["calls"]
        out.append({key: merged.get(key) for key in keys})
    return out


def table_columns(rows: Sequence[dict]) -> list[str]:
    """The keys ``table`` and ``markdown`` show: the configuration that varies, the bounds, the
    per-token traffic (bytes when ``W`` is known, else experts), the modeled time when timed, and
    the note. Everything else is constant (printed above the table) or in the other formats."""
    weighed = any(r["cache_bytes"] is not None for r in rows)
    timed = any(r["modeled_ms_per_token"] is not None for r in rows)
    columns = ["cache_size"] + (["cache_bytes"] if weighed else []) + ["policy"]
    columns += [key for key in CONFIG_KEYS[1:] if len({r[key] for r in rows}) > 1]
    columns += ["hit_rate", "belady_hit_rate", "bypass_optimum_hit_rate", "oracle_hit_rate"]
    columns += (["fetched_bytes_per_token", "cpu_bytes_per_token"] if weighed
                else ["fetched_per_token", "cpu_experts_per_token"])
    if timed:
        columns += ["modeled_ms_per_token", "best"]
    if any(r.get("overlap_ms_per_token") is not None for r in rows):
        # best ranks by the overlapped time (ranking_figure): it stands beside that column
        at = columns.index("best") if timed else len(columns)
        columns[at:at] = ["overlap_ms_per_token"]
        columns += ([] if timed else ["best"]) + ["stall_ms_per_token", "prefetch_bound"]
    if "batch" in rows[0]:  # a batched replay (pallas_cache.sizing.batching): per B
        columns.insert(1, "batch")
        columns.insert(2, "steps")
        if timed:
            columns.insert(columns.index("best"), "modeled_ms_per_step")
    return columns + ["note"]


def _cell(key: str, value) -> str:
    """A value as the table shows it (the machine formats keep the exact value)."""
    if value is None:
        return "-"
    if key in ("cache_bytes", "fetched_bytes_per_token", "cpu_bytes_per_token"):
        return format_bytes(value)
    if key == "best":
        return "yes" if value else ""
    if key.endswith("_rate"):
        return f"{value:.4f}"
    if key in ("modeled_ms_per_token", "modeled_ms_per_step", "overlap_ms_per_token",
               "stall_ms_per_token"):
        return f"{value:.1f}"
    if key == "prefetch_bound":
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _preamble(rows: Sequence[dict]) -> list[str]:
    first = rows[0]
    shown = set(table_columns(rows))
    # The default eviction (lru) goes unsaid, so an LRU sweep prints as it always has.
    constant = "".join(f" {key}={first[key]}" for key in CONFIG_KEYS[1:]
                       if key not in shown and (key, first[key]) != ("eviction", "lru"))
    return [f"trace: {first['source']}  layers={first['layers']} experts={first['experts']} "
            f"top_k={first['top_k']} calls={first['calls']} tokens={first['tokens']} "
            f"sequences={first['sequences']}", f"cache:{constant}"]


#: The text table's width: wider with its notes inline, they go under it (docs/replay.md).
TABLE_WIDTH = 100
#: The record keys that name a configuration (the rest are its trace, costs and results).
CONFIG_KEYS = ("policy", "order", "admission", "eviction")


def _split_key(key: str, width: int) -> list[str]:
    """A record key as a header of up to three lines when it is wider than its values: split
    after underscores, so the lines read as the key (``belady_`` / ``hit_`` / ``rate``), as
    narrow as its values allow and in as few lines as that width needs."""
    if len(key) <= width:
        return [key]
    cuts = [i + 1 for i, char in enumerate(key) if char == "_"]
    splits = [[key]] + [[key[:a], key[a:]] for a in cuts] + [
        [key[:a], key[a:b], key[b:]] for a in cuts for b in cuts if a < b]
    return min(splits, key=lambda lines: (max(width, *map(len, lines)), len(lines)))


def _config(row: dict) -> tuple:
    return tuple(row[key] for key in CONFIG_KEYS)


def merged_configs(rows: Sequence[dict]) -> dict[tuple, tuple]:
    """Configurations whose rows are another's: ``{config: earlier config}`` for each one
    (``policy, order, admission, eviction``) whose record at every cache size (and batch) equals,
    in every key but those four, the record of an earlier configuration, which the text table
    shows in its place (``fraction:0.4545`` and ``fraction:0.4`` copy the same misses at top-2;
    LRU and route_knn evict the same residents when nothing is evicted). Only the text table and
    its picks merge; the records stay one per configuration."""
    groups: dict[tuple, dict] = {}
    for row in rows:
        rest = {key: value for key, value in row.items() if key not in CONFIG_KEYS}
        groups.setdefault(_config(row), {})[(row["cache_size"], row.get("batch"))] = rest
    merged: dict[tuple, tuple] = {}
    kept: list[tuple] = []
    for config, group in groups.items():
        same = next((earlier for earlier in kept if groups[earlier] == group), None)
        if same is None:
            kept.append(config)
        else:
            merged[config] = same
    return merged


def config_label(config: tuple, shown: Sequence[str] = ("policy",)) -> str:
    """``policy=fraction:0.4`` (with the other configuration keys in ``shown``)."""
    return " ".join(f"{key}={value}" for key, value in zip(CONFIG_KEYS, config) if key in shown)


def pick_label(row: dict) -> str:
    """A picked record's configuration, every key of :data:`CONFIG_KEYS` (the eviction only
    where it is not ``lru``): ``policy=full order=recency admission=promote_one``."""
    return config_label(tuple(row[key] for key in CONFIG_KEYS),
                        [key for key in CONFIG_KEYS if key != "eviction" or row[key] != "lru"])


#: Columns that depend on the cache size (and batch) alone: a table too wide for
#: :data:`TABLE_WIDTH` shows them once per size, in a second table under the first.
PER_SIZE_KEYS = ("cache_bytes", "steps", "belady_hit_rate", "bypass_optimum_hit_rate",
                 "oracle_hit_rate")
# The hit rate a cliff note quotes is the row's own hit_rate column: notes under the table are
# numbered without it, so one note serves every row it applies to.
_QUOTED_HIT_RATE = re.compile(r" \(hit rate [0-9.]+ here\)")


def _grid(rows: Sequence[dict], columns: Sequence[str]) -> tuple[list, list]:
    """``(head, body)``: the header lines (keys split to the width of their values) and the
    cells of ``rows``."""
    body = [[_cell(key, r[key]) for key in columns] for r in rows]
    names = [_split_key(key, max([len(row[i]) for row in body] + [4]))
             for i, key in enumerate(columns)]
    depth = max(len(lines) for lines in names)
    head = [[([""] * (depth - len(lines)) + lines)[level] for lines in names]
            for level in range(depth)]
    return head, body


def _lines(head: list, body: list, gap: str, last_left: bool) -> list[str]:
    """The aligned lines of a grid, a rule of dashes under its header; the last column is
    left-aligned when ``last_left`` (the note)."""
    grid = head + body
    widths = [max(len(row[i]) for row in grid) for i in range(len(grid[0]))]
    lines = []
    for i, row in enumerate(grid):
        cells = [cell.rjust(w) for cell, w in zip(row, widths)]
        if last_left:
            cells[-1] = row[-1]
        lines.append(gap.join(cells).rstrip())
        if i == len(head) - 1:
            lines.append(gap.join("-" * w for w in widths))
    return lines


def _table(rows: Sequence[dict], header_lines: Sequence[str], under_table: Sequence[str] = ()
           ) -> str:
    """The text table: within :data:`TABLE_WIDTH` columns where it can be. A configuration whose
    rows equal an earlier one's is shown once (:func:`merged_configs`); when the rows are too
    wide, their notes go under the table (numbered), then the columns close up, then the
    per-size columns (:data:`PER_SIZE_KEYS`, ``cache_bytes`` only if still too wide) go to a
    second table, one row per size, the columns closing up after each move, then the columns
    that still do not fit continue in tables under the first (:func:`_continued`). The lines above it are wrapped at that width too;
    ``under_table``'s lines go right under the rows."""
    columns = table_columns(rows)
    merged = merged_configs(rows)
    shown_keys = [key for key in CONFIG_KEYS if key in columns]
    under = [f"{config_label(config, shown_keys)}: the same rows as "
             f"{config_label(same, shown_keys)} at every size (shown once)"
             for config, same in merged.items()]
    rows = [r for r in rows if _config(r) not in merged]
    head, body = _grid(rows, columns)
    wide = max(len(line) for line in _lines(head, body, "  ", True)) > TABLE_WIDTH
    if wide and any(row[-1] not in ("", "-") for row in body):
        texts = [_QUOTED_HIT_RATE.sub("", row[-1]) if row[-1] != "-" else "" for row in body]
        numbers = {text: str(n) for n, text in enumerate(dict.fromkeys(filter(None, texts)), 1)}
        for row, text in zip(body, texts):
            row[-1] = numbers.get(text, "")
        quoted = any(_QUOTED_HIT_RATE.search(r["note"] or "") for r in rows)
        under += [f"note {n}: {text}" + (" (the row's hit_rate)" if quoted and
                                         "S < L*k" in text else "")
                  for text, n in numbers.items()]
    lines = _lines(head, body, "  ", True)
    per_size: list[str] = []
    shown, full_head, full_body = list(columns), head, body
    # Per-size columns out (cache_bytes last: a buyer reads it beside the row), the gaps closed
    # up after each move, until the rows fit.
    for moved in ([key for key in PER_SIZE_KEYS if key in columns and key != "cache_bytes"],
                  [key for key in PER_SIZE_KEYS if key in columns]):
        if max(len(line) for line in lines) <= TABLE_WIDTH or not moved:
            break
        keys = ["cache_size"] + (["batch"] if "batch" in columns else []) + moved
        kept = [i for i, key in enumerate(columns) if key not in moved]
        shown = [columns[i] for i in kept]
        head = _drop_blank_header_lines([[row[i] for i in kept] for row in full_head])
        body = [[row[i] for i in kept] for row in full_body]
        lines = _lines(head, body, "  ", True)
        sizes = list({tuple(r[key] for key in keys[:len(keys) - len(moved)]): r
                      for r in rows}.values())
        size_head, size_body = _grid(sizes, keys)
        per_size = (["per cache size (the same for every policy):"]
                    + _lines(size_head, size_body, "  ", False))
        if max(len(line) for line in lines) > TABLE_WIDTH:
            lines = _lines(head, body, " ", True)
    if max(len(line) for line in lines) > TABLE_WIDTH:
        lines = _continued(head, body, shown)
    out = [textwrap.fill(text, width=TABLE_WIDTH, subsequent_indent="  ", break_on_hyphens=False,
                         break_long_words=False) for text in (*_preamble(rows), *header_lines)]
    out += [*lines]
    out += [textwrap.fill(text, width=TABLE_WIDTH, subsequent_indent="    ",
                          break_on_hyphens=False, break_long_words=False) for text in under_table]
    out += [*per_size]
    out += [textwrap.fill(text, width=TABLE_WIDTH, subsequent_indent="    ",
                          break_on_hyphens=False, break_long_words=False) for text in under]
    return "\n".join(out)


def _continued(head: list, body: list, keys: Sequence[str]) -> list[str]:
    """A grid still wider than :data:`TABLE_WIDTH` as tables one under the other, each
    repeating the columns that name a row (its size, batch and configuration) and taking the
    next columns that fit; the last column stays left-aligned where it is the note."""
    names = [i for i, key in enumerate(keys) if key in ("cache_size", "batch", *CONFIG_KEYS)]
    rest = [i for i in range(len(keys)) if i not in names]

    def part(columns):
        sub_head = _drop_blank_header_lines([[row[i] for i in columns] for row in head])
        return _lines(sub_head, [[row[i] for i in columns] for row in body], " ",
                      keys[columns[-1]] == "note")

    parts: list[list[int]] = [[]]
    for i in rest:
        if parts[-1] and max(map(len, part(names + parts[-1] + [i]))) > TABLE_WIDTH:
            parts.append([])
        parts[-1].append(i)
    lines: list[str] = []
    for n, columns in enumerate(parts):
        lines += (["the same rows, continued:"] if n else []) + part(names + columns)
    return lines


def _drop_blank_header_lines(head: list) -> list:
    """A header without its lines left empty (after columns moved out)."""
    return [line for line in head if any(line)] or head[-1:]


def _markdown(rows: Sequence[dict], header_lines: Sequence[str]) -> str:
    columns = table_columns(rows)

    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    lines = [f"{text}  " for text in (*_preamble(rows), *header_lines)] + [""]
    lines += [line(columns), line(["---:" if key not in ("policy", "note") else "---"
                                   for key in columns])]
    lines += [line([_cell(key, r[key]) for key in columns]) for r in rows]
    return "\n".join(lines)


def _csv(rows: Sequence[dict]) -> str:
    buffer = io.StringIO()
    # RECORD_KEYS, then any keys a batched replay adds (pallas_cache.sizing.batching).
    keys = list(RECORD_KEYS) + [key for key in (rows[0] if rows else {}) if key not in RECORD_KEYS]
    writer = csv.DictWriter(buffer, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({key: ("" if r[key] is None else
                               json.dumps(r[key]) if key in _JSON_CELL_KEYS else r[key])
                         for key in keys})
    return buffer.getvalue().rstrip("\n")


def _json_safe(row: dict) -> dict:
    """``row`` with every float that is not finite as ``None`` (JSON has no ``Infinity`` or
    ``NaN``; the CLI refuses inputs whose modeled numbers overflow before the replay)."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in row.items()}


def format_records(rows: Sequence[dict], fmt: str = "table", header_lines: Sequence[str] = (),
                   under_table: Sequence[str] = ()) -> str:
    """``rows`` (from :func:`records`) as text in one of :data:`FORMATS`.

    ``json``: a list of records; ``jsonl``: one record per line; ``csv``: a header of
    :data:`RECORD_KEYS` and one line per record; ``table`` (for a terminal) and ``markdown``:
    the :func:`table_columns` of the records under the trace line and ``header_lines``
    (``table``: with ``under_table``'s lines right under its rows).

    Raises:
      ValueError: an unknown format, or no rows for ``table``/``markdown``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    if fmt == "json":
        return json.dumps([_json_safe(r) for r in rows], indent=1, allow_nan=False)
    if fmt == "jsonl":
        return "\n".join(json.dumps(_json_safe(r), allow_nan=False) for r in rows)
    if fmt == "csv":
        return _csv(rows)
    if not rows:
        raise ValueError(f"no results to show as a {fmt}")
    return (_table(rows, header_lines, under_table) if fmt == "table"
            else _markdown(rows, header_lines))


def legend_text(width: int = 100) -> str:
    """:data:`COLUMN_LEGEND`, then :data:`GPU_LEGEND`, as an aligned, wrapped block (``--help``,
    docs/replay.md)."""
    legend = {**COLUMN_LEGEND, **GPU_LEGEND}
    pad = max(len(key) for key in legend) + 2
    return "\n".join(textwrap.fill(text, width=width, initial_indent=f"  {key.ljust(pad)}",
                                   subsequent_indent=" " * (pad + 2))
                     for key, text in legend.items())
