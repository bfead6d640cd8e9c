"""``benchmarks/gpu_check.py`` without a GPU: the dry run fits its budget with every phase in
it, a row cut by the budget is reported as skipped and the run exits non-zero (never "all
matched"), a smoke run runs its first equality check whatever the budget, a bad ``--phases`` is
one line and exit 2, and the device time is read from a trace's GPU stream lines, one sum per
profiled dispatch."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.benchmarks.conftest import BENCHMARKS

SCRIPT = "gpu_check"


def test_the_dry_run_fits_the_budget_with_every_phase(script, capsys):
    """FAILS if the estimate exceeds the 480 s budget (659 s before the split; 416 s before the
    profiled copies without CUDA graphs) or a phase has no row in it."""
    assert script.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    total = float(re.search(r"^estimated (\d+) s \(", out, re.M).group(1))
    assert total <= 480, out
    for name in ("equality", "mesh", "geometries", "sweep", "copy"):
        rows = int(re.search(rf"^phase {name}: (\d+) rows", out, re.M).group(1))
        assert rows >= 1, out
    # equality runs first, and its small pools before the 8192-slot ones
    assert out.index("phase equality") < out.index("phase mesh")
    assert out.index("LRU, vmap") < out.index("8192 slots")


def test_rows_cut_by_the_budget_are_skipped_not_matched(script, capsys, tmp_path):
    """FAILS if a row the budget cut counts as matched: before, every check "skipped (budget)"
    still printed "all matched" and exited 0. Here the budget cuts every row (no JAX work)."""
    out_file = tmp_path / "report.md"
    status = script.main(["--candidate", "interpret", "--budget-seconds", "0.001",
                             "--out", str(out_file)])
    captured = capsys.readouterr()
    report = out_file.read_text()
    assert status == script.EXIT_INCOMPLETE == 4
    assert "all matched" not in report and "INCOMPLETE" in report
    for phase in ("equality", "mesh", "geometries", "sweep", "copy"):
        assert re.search(rf"phase {phase}: 0 of [1-9]\d* rows ran", report), phase
    assert report.count("skipped (budget)") >= 5
    assert "FAILED (exit 4)" in captured.err


def test_a_smoke_run_runs_the_first_check_of_a_phase_and_cuts_the_rest(script, capsys):
    """FAILS if --smoke lets the budget cut its first check, or calls a cut run a pass: the
    first equality case runs (interpret against xla, on the CPU) and matches, every later one
    is reported as skipped, and the run exits 4."""
    status = script.main(["--smoke", "--phases", "equality", "--budget-seconds", "0.001",
                             "--case-steps", "4"])
    out = capsys.readouterr().out
    assert status == 4
    assert "- LRU: match" in out
    assert "- LRU, rebase threshold 80: skipped (budget)" in out
    assert "8192 slots (two blocks): skipped (budget)" in out
    assert "INCOMPLETE" in out and "all matched" not in out


@pytest.mark.parametrize("argv", [["--phases", "equality,nope"], ["--phases", "copy,copy"],
                                  ["--budget-seconds", "0"], ["--mesh-evictions", "fifo"]])
def test_a_bad_argument_is_one_line_and_exit_2(script, capsys, argv):
    with pytest.raises(SystemExit) as stop:
        script.main(["--dry-run", *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("gpu_check.py: error:"), err


def test_device_time_sums_the_gpu_stream_lines_one_cluster_per_dispatch(script):
    """FAILS if the host's events, or the derived module/op lines that repeat the kernels, are
    counted, or two dispatches run apart are summed as one."""
    from gpu_phases.common import cluster_sums, clusters, events_by_name, gpu_events, kernel_mean_us

    def meta(pid, tid, what, name):
        return {"ph": "M", "pid": pid, "tid": tid, "name": what, "args": {"name": name}}

    events = [meta(1, 0, "process_name", "/host:CPU"), meta(2, 0, "process_name",
                                                             "/device:GPU:0"),
              meta(2, 7, "thread_name", "Stream #7(Compute)"),
              meta(2, 9, "thread_name", "XLA Ops"), meta(1, 3, "thread_name", "python")]
    x = [(2, 7, 1000.0, 5.0), (2, 7, 1010.0, 3.0), (2, 9, 1000.0, 13.0),  # dispatch 1
         (2, 7, 60000.0, 4.0), (2, 9, 60000.0, 4.0),                      # dispatch 2
         (1, 3, 1000.0, 900.0)]                                           # the host
    names = ["pallas_cache_step", "copy_fusion", "k", "pallas_cache_step", "k", "k"]
    events += [{"ph": "X", "pid": p, "tid": t, "ts": ts, "dur": d, "name": n}
               for (p, t, ts, d), n in zip(x, names)]
    spans, lines = gpu_events(events)
    assert lines == ["Stream #7(Compute)"]
    assert sorted(spans) == [(1000.0, 5.0, "pallas_cache_step"), (1010.0, 3.0, "copy_fusion"),
                             (60000.0, 4.0, "pallas_cache_step")]
    assert cluster_sums(spans, 2) == [8.0, 4.0]
    assert cluster_sums(spans, 3) is None  # not split into the runs: no figure, not a wrong one
    first = events_by_name(clusters(spans, 2)[0], iterations=1)
    assert first == {"copy_fusion": (1.0, 3.0), "pallas_cache_step": (1.0, 5.0)}
    assert kernel_mean_us(first) == 5.0  # the kernel alone, not the copy beside it


def test_a_smoke_run_of_the_cost_phases_completes_and_matches(script, capsys):
    """FAILS if a cost row's path breaks on the CPU: the sweep's row (schedule, warm-up, both
    backends, the floor program, the profiler trace read back, the lowered op count) and the
    copy row run, compare, and the complete run exits 0."""
    status = script.main(["--smoke", "--phases", "sweep,copy"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "all matched**: 2 rows, none skipped" in out
    assert "| 4, 32, 64, 8 | 0 |" in out and "0 of 40 | n/a (no device time) | match |" in out
    assert "Device trace: no GPU events: not a GPU" in out


def test_the_tables_print_a_gpu_runs_device_times_and_the_upstream_verdict(script):
    """FAILS if a table breaks on the figures only a GPU run has (device us, GB/s): each
    phase's markdown with them, and the sweep's verdict against upstream (device us at or below
    upstream's base + slope * m, one Pallas call per iteration)."""
    from gpu_phases import PHASES

    args = script.parse_args(["--candidate", "pallas"])
    cost = {"status": "match", "us": {"pallas": 9.5, "xla": 40.25},
            "device_us": {"pallas": 2.0, "xla": 30.0}, "kernels": {"pallas": (3, 1),
                                                                   "xla": (60, 0)},
            "compile_s": {"pallas": 1.0, "xla": 2.0}, "device_note": "lines Stream #7",
            "kernel_us": {"pallas": 1.25, "xla": None},
            "events": {"pallas": {"copy_fusion": (2.0, 0.5), "pallas_cache_step": (1.0, 1.25)},
                       "xla": {"fusion": (60.0, 0.5)}, "floor": {"loop_add": (1.0, 0.25)}}}
    extra = {"sweep": {"off_m": {"xla": 0, "pallas": 0}, "calls": 2048,
                       "ops": {"xla": (0, 300), "pallas": (1, 2)}},
             "geometries": {"misses": 1.5}, "mesh": {"devices": 1, "one_device": "match"},
             "copy": {"kind": "pinned_host", "wall_gbs": 20.0, "device_gbs": 25.0,
                      "device_us": 1342.2}}
    tables = {}
    for name, module in PHASES.items():
        if name == "equality":
            continue
        row = module.plan(args)[1 if name == "sweep" else 0][0]
        result = {**cost, **extra[name]} if name != "copy" else {"status": "match",
                                                                 **extra["copy"]}
        tables[name] = "\n".join(module.markdown(args, [(row, result)]))
    # S=512, m=1: upstream 1.6 + 0.56 = 2.16 us; the kernel alone 1.25 us beside it; the
    # candidate's 2.00 device us meets it
    assert "| 48, 64, 512, 8 | 1 | 2.16 | 1.25 | 2.00 | 30.00 | 9.50 | 40.25 | 3 (1); 60 (0) | " \
           "2 + 1 Pallas; 300 | 0 of 4096 | met | match |" in tables["sweep"]
    assert "| 32, 8, 64, 2 | lru | 1.50 | 1.25 | 2.00 | 30.00 | 9.50 | 40.25 |" \
        in tables["geometries"]
    # every GPU event of an iteration by name, for the candidate, the XLA step and the floor
    for name in ("sweep", "geometries"):
        assert "pallas: `copy_fusion` x2 0.50 us; `pallas_cache_step` x1 1.25 us" \
            in tables[name], tables[name]
        assert "xla: `fusion` x60 0.50 us" in tables[name]
        assert "floor: `loop_add` x1 0.25 us" in tables[name]
    assert "| expert-parallel | lru | 32, 8, 64, 2 | 1 | 2.00 | 30.00 |" in tables["mesh"]
    assert "| 4 | 1 | pinned_host | 20.00 | 25.00 | 1342.2 | match |" in tables["copy"]


@pytest.mark.parametrize("profile_graphs", [False, True])
def test_device_time_is_taken_on_copies_compiled_without_command_buffers(script, monkeypatch,
                                                                          profile_graphs):
    """FAILS if a cost row profiles the programs as compiled by default (in CUDA graphs on a
    GPU, where tracing a graph launch faulted on an H200), times the wall clock on the copies
    without graphs, or ``--profile-graphs`` does not profile the default programs."""
    import jax.numpy as jnp
    import pallas_cache as pc
    from gpu_phases import common

    ctx = common.Context(script.parse_args(["--smoke"] + ["--profile-graphs"] * profile_graphs))
    state = pc.init(2, 8, 8)
    windows = [(jnp.asarray([0, 1], jnp.int32), jnp.asarray([[1, 2], [3, 4]], jnp.int32))] * 5
    phase, ran = ["timed"], []

    def call(s, layer, routes, backend):
        return pc.ensure(s, layer, routes, backend=backend)

    def programs(name, options=None):
        real = (common.floor_program(call, state, *windows[0], options) if name == "floor" else
                common.scan_program(call, name, state, *windows[0], options)[0])

        class Program:
            def __call__(self, *args):
                ran.append((phase[0], name, options))
                return real(*args)

            def as_text(self):
                return real.as_text()
        return Program(), 0.0

    def device_profile(runs):
        phase[0] = "profiled"
        for run in runs:
            run()
        return None, "stub", None

    monkeypatch.setattr(common, "device_profile", device_profile)
    row = common.cost_scan(ctx, "t", call, state, windows, programs=programs)
    assert row["status"] == "match"
    timed = [(name, options) for when, name, options in ran if when == "timed"]
    profiled = [(name, options) for when, name, options in ran if when == "profiled"]
    assert {name for name, _ in timed} == {"xla", "interpret"}
    assert all(options is None for _, options in timed), timed
    want = None if profile_graphs else common.PROFILED
    assert [name for name, _ in profiled] == ["xla", "interpret", "floor"]
    assert all(options == want for _, options in profiled), profiled


def test_the_profiler_fault_probe_runs_each_mode_in_its_own_process(tmp_path):
    """FAILS if the probe the next GPU run carries breaks on the CPU: a traced mode and the
    fused kernel's mode (interpret here, every plan against the XLA step's) each report ``ok``
    from a process of their own into the table, and a bad mode is one line and exit 2."""
    probe = os.path.join(BENCHMARKS, "profiler_graph_fault.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    bad = subprocess.run([sys.executable, probe, "--modes", "xla,nope"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "nope" not in bad.stdout and "Traceback" not in bad.stderr
    for argv in (["--timeout", "0"], ["--timeout", "soon"]):
        bad = subprocess.run([sys.executable, probe, *argv], env=env, capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    out = tmp_path / "probe.md"
    done = subprocess.run([sys.executable, probe, "--modes", "xla-traced,pallas", "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    table = out.read_text()
    assert "| xla-traced | ok | 2 traces of 3 dispatches |" in table, table
    assert "| pallas | ok | interpret: " in table and "equal to xla" in table, table


def test_the_copy_table_has_a_row_per_count_and_says_what_each_moved(script):
    """FAILS if the copy phase loses its rows for 0, 1, 2 and 8 of 8 entries at 64 MiB rows, or
    its table divides by bytes the plan did not move (a GB/s for 0 of 8) or misses the device
    time over 8 of 8 that says whether the copies scale with the rows asked."""
    from gpu_phases import copy

    args = script.parse_args([])
    rows = [row for row, _ in copy.plan(args)]
    assert [row["m"] for row in rows if row["mib"] == 64] == [0, 1, 2, 8]
    results = {0: 50.0, 1: 1400.0, 2: 2800.0, 8: 11200.0}
    done = [(row, {"status": "match", "kind": "pinned_host", "device_us": results[row["m"]],
                   "moved_mib": 64.0 * row["m"], "wall_gbs": None if row["m"] == 0 else 40.0,
                   "device_gbs": None if row["m"] == 0 else 48.0, "wall_us": 60.0,
                   "floor_us": 20.0})
            for row in rows if row["mib"] == 64]
    table = "\n".join(copy.markdown(args, done))
    assert "| 64 | 0 | pinned_host | n/a | n/a | 50.0 | match | 0 | 0.004 | 60.0 | 20.0 |" in table
    assert "| 64 | 1 | pinned_host | 40.00 | 48.00 | 1400.0 | match | 64 | 0.125 |" in table
    assert "bytes actually moved" in table
