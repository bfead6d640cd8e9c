"""The text table of ``pallas-cache replay`` reads on a terminal: within 100 columns (notes
numbered under it, per-size columns in a second table when needed), a configuration whose rows
equal another's shown once, picks that name their batch, and a line that says why a
``fraction:Q`` marked best stops copying. The records (json, jsonl, csv) keep every row."""

from __future__ import annotations

import json
import types

from pallas_cache.sizing.cli import output as cli_output
from pallas_cache.sizing.cli.findings import stops_copying
from pallas_cache.sizing.report import (RECORD_KEYS, TABLE_WIDTH, _split_key, format_records,
                                        merged_configs)

W = 336 * 2**20
NOTE = "S < L*k = 64: LRU thrashes on the cyclic layer sweep (hit rate {:.3f} here)"


def _row(size, policy, hit, batch=None, eviction="lru", ms=None, best=False, budget=False,
         note=""):
    row = dict.fromkeys(RECORD_KEYS)
    row.update(source="synthetic:mixtral-realistic(tokens=512, seed=0)", layers=32, experts=8,
               top_k=2, tokens=512, calls=16384, sequences=8, cache_size=size, policy=policy,
               order="recency", admission="promote_one", eviction=eviction, expert_bytes=W,
               link_bandwidth=25e9, cpu_bandwidth=60e9, device_budget=48 * 2**30,
               routes=32768, active=30000, missing=round(30000 * (1 - hit)), fetched=100,
               cpu_routes=10, cpu_experts=10, empty_slots=0, hit_rate=hit,
               belady_hit_rate=0.9, bypass_optimum_hit_rate=0.91, oracle_hit_rate=0.8,
               fetched_per_token=1.0, cpu_experts_per_token=2.0, cache_bytes=size * W,
               fetched_bytes_per_token=1.5 * 2**30, cpu_bytes_per_token=12.5 * 2**30,
               modeled_ms_per_token=ms if ms is not None else 100 * (1 - hit), best=best,
               budget_best=budget, note=note, pair_counts=[[1, 0, 5]])
    if batch is not None:
        row.update(batch=batch, steps=44 if batch > 1 else 512,
                   modeled_ms_per_step=row["modeled_ms_per_token"] * batch)
    return row


def _sweep(batch=None, notes=False):
    rows = []
    for size in (64, 128, 146):
        for policy, hit in (("full", 0.4), ("fraction:0.2941", 0.6), ("fraction:0.4", 0.55)):
            rate = hit + size / 1000
            rows.append(_row(size, policy, rate, batch, best=policy == "fraction:0.2941",
                             budget=size == 146 and policy == "fraction:0.2941",
                             note=NOTE.format(rate) if notes and size < 128 else ""))
    return rows


def test_a_timed_batched_table_with_notes_is_within_100_columns():
    """FAILS if a line of the table (or of the lines above it) is wider than 100 columns (it was
    about 230 with its notes inline), or a note is lost instead of numbered under the table."""
    rows = _sweep(batch=1, notes=True) + _sweep(batch=8, notes=True)
    text = format_records(rows, "table", ["devices: a header line of many words " * 6])
    assert max(len(line) for line in text.splitlines()) <= TABLE_WIDTH, text
    under = [line for line in text.splitlines() if line.startswith("note ")]
    # one note for the rows it applies to: the hit rate it quoted is the row's own column
    assert under == ["note 1: S < L*k = 64: LRU thrashes on the cyclic layer sweep (the row's "
                     "hit_rate)"], text
    assert "per cache size" in text and "belady_" in text


def test_a_narrow_table_keeps_its_notes_and_columns_inline():
    """FAILS if a table that fits in 100 columns moves its notes or bounds out of the rows."""
    rows = [dict(_row(64, "full", 0.4, note="short note"), expert_bytes=None, cache_bytes=None,
                 fetched_bytes_per_token=None, cpu_bytes_per_token=None,
                 modeled_ms_per_token=None)]
    text = format_records(rows, "table")
    assert "short note" in text.splitlines()[-1] and "per cache size" not in text, text


def test_a_configuration_with_another_s_rows_is_shown_once_in_the_table_only():
    """FAILS if two configurations with equal rows at every size both print (tensor-parallel
    fraction:0.4545 and fraction:0.4 at top-2), or the records lose one, or rows equal at some
    sizes only are merged."""
    rows = _sweep()
    twin = [dict(r, policy="fraction:0.45") for r in rows if r["policy"] == "fraction:0.4"]
    partial = [dict(r, policy="cap:1", hit_rate=0.1 if r["cache_size"] == 64 else r["hit_rate"])
               for r in rows if r["policy"] == "full"]
    rows += twin + partial
    assert merged_configs(rows) == {("fraction:0.45", "recency", "promote_one", "lru"):
                                    ("fraction:0.4", "recency", "promote_one", "lru")}
    text = format_records(rows, "table")
    assert "fraction:0.45 " not in text.split("policy=fraction:0.45")[0]
    assert ("policy=fraction:0.45: the same rows as policy=fraction:0.4 at every size (shown "
            "once)") in text
    assert text.count(" cap:1") == 3
    assert len(json.loads(format_records(rows, "json"))) == len(rows)


def test_header_keys_split_into_up_to_three_lines_as_narrow_as_their_values():
    """FAILS if a long key stays one wide line above narrow values, or splits mid-word."""
    assert _split_key("bypass_optimum_hit_rate", 6) == ["bypass_", "optimum_", "hit_rate"]
    assert _split_key("belady_hit_rate", 6) == ["belady_", "hit_", "rate"]
    assert _split_key("policy", 15) == ["policy"]
    assert _split_key("note", 4) == ["note"]


def test_budget_picks_name_their_batch_and_merge_equal_configurations():
    """FAILS if two batches' picks print the same words (`Best within 48GiB` twice, no batch),
    or two configurations with equal rows print two picks quoting the same time."""
    rows = _sweep(batch=1) + _sweep(batch=8)
    lines = cli_output._budget_picks(rows, "48.0GiB", per_device=False)
    assert [line.split(":")[0] for line in lines] == ["Best within 48.0GiB at batch=1",
                                                      "Best within 48.0GiB at batch=8"]
    rows = _sweep()
    rows += [dict(r, policy="fraction:0.45") for r in rows if r["policy"] == "fraction:0.2941"]
    lines = cli_output._budget_picks(rows, "24.0GiB", per_device=True)
    assert len(lines) == 1 and lines[0].startswith("Best within 24.0GiB per device: ")
    assert lines[0].endswith("(the same rows as policy=fraction:0.45).")


def test_a_fraction_that_copies_nothing_at_this_width_says_so_when_best():
    """FAILS if fraction:auto at top-2 (0.2941: its split copies 0 of 1 or 2 misses) is marked
    best with no word that it stops copying once the pool is full, or a fraction that does
    copy (0.4 copies 1 of 2) gets that line."""
    trace = types.SimpleNamespace(top_k=2, num_experts=8)
    lines = cli_output.stops_copying_lines(stops_copying(_sweep(), trace))
    assert len(lines) == 1 and lines[0].startswith("fraction:0.2941 is marked best")
    assert "stops copying" in lines[0]
    rows = [dict(r, best=r["policy"] == "fraction:0.4", budget_best=False) for r in _sweep()]
    assert stops_copying(rows, trace) == ()
    # merged into one call of 8 requests' routes, 0.2941 copies some of up to 16 misses
    assert stops_copying(_sweep(batch=8), trace) == ()


def test_the_printer_replays_nothing_and_runs_no_array_code():
    """FAILS if ``cli/output.py`` computes what it prints (per-layer LRU replayed for the
    cliffs, NumPy over the trace's routes, JAX for the split, the budget's fit): it takes the
    results of ``cli/findings.py`` and ``cli/sizes.py`` and turns them into text."""
    import ast
    import pathlib

    source = pathlib.Path(cli_output.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    heavy = {name for name in imported if name.split(".")[0] in ("jax", "numpy")
             or name in ("pallas_cache.sizing.trace_stats", "pallas_cache.sizing.sweep.records")}
    assert not heavy, heavy
    assert not hasattr(cli_output, "budget_fit") and not hasattr(cli_output, "with_budget_fit")
