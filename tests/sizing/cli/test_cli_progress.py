"""What ``pallas-cache replay`` shows while it works, and the console script's compile cache.

Progress: the first line (how many programs compile for how many configurations) comes before
any work, a redirected log holds whole lines only, a terminal gets a bar with an ETA (tqdm's
when importable), the offline optima report progress through a callback, and ``--quiet`` is
quiet. Compile cache: the console script (pyproject's ``pallas-cache``) keeps compiled programs
in the user's cache directory unless a flag or an environment variable says not to; ``cli.main``
in-process never touches it.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tomllib
import types

import jax
import numpy as np
import pytest

from pallas_cache.sizing import bounds, cli, synthetic
from pallas_cache.sizing.cli import replay as cli_replay
from pallas_cache.sizing.sweep import program as sweep_program
from pallas_cache.sizing.progress import Bar, Progress
from pallas_cache.sizing.sweep import config_grid, replay

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SMALL = ["replay", "--synthetic", "mixtral-like", "--tokens", "12", "--cache-size", "8", "128",
         "--policy", "full", "fraction:0.4", "--format", "json"]


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


class Recorder(Progress):
    def __init__(self):
        self.events = []

    def phase(self, line, total):
        self.events.append(("phase", line, total))

    def update(self, done, status=""):
        self.events.append(("update", done, status))

    def close(self):
        self.events.append(("close",))


@pytest.fixture(scope="module")
def trace():
    return synthetic.synthetic_trace("mixtral-like", num_tokens=12)


def test_the_first_line_counts_the_programs_and_comes_before_any_work(trace):
    """FAILS if the replay reports nothing before its first chunk (the compile) runs, or its
    line miscounts the programs compiled (one per cache size here: 128 is past the bucket
    ratio of 8) or the configurations."""
    report = Recorder()
    replay(trace, config_grid([8, 128], ["full", "fraction:0.4"]), chunk_calls=64,
           progress=report)
    kind, line, total = report.events[0]
    assert kind == "phase"
    assert line.startswith("compiling 2 programs for 4 configurations (384 layer-calls)")
    chunks = -(-trace.to_array()[0].shape[0] // 64)
    second = [e[0] for e in report.events].index("phase", 1)
    assert total == 2 * chunks
    assert [e[1] for e in report.events[1:second]] == list(range(1, total + 1))
    assert report.events[second][1].startswith("offline optima (Belady, bypass) for 2 cache sizes")
    assert report.events[second - 1][2] == "cache_size=128 calls 384/384"
    assert report.events[-1] == ("close",)


#: The sweep's compiled chunk program, as jax logs its compiles.
REPLAY_PROGRAM = f"jit({sweep_program.chunk_program().__name__})"


def test_the_first_line_tells_the_number_of_programs_actually_compiled(caplog):
    """FAILS if the count in the first line is not the number of replay programs jax compiles
    (a geometry no other test uses, so none of them is cached in-process)."""
    import logging

    from pallas_cache.sizing.synthetic import SyntheticParams

    odd = synthetic.synthetic_trace(SyntheticParams(num_layers=3, num_experts=5, top_k=2,
                                                    num_tokens=4))
    report = Recorder()
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles():
        replay(odd, config_grid([5, 7, 9], ["full", "fraction:0.4"]), bounds=False,
               progress=report)
    compiled = sum(record.getMessage().startswith(f"Compiling {REPLAY_PROGRAM} ")
                   for record in caplog.records)
    assert compiled >= 1
    assert report.events[0][1].startswith(
        f"compiling {compiled} program{'s' if compiled != 1 else ''} for 6 configurations")


def test_a_redirected_log_has_whole_lines_and_no_frames(trace):
    """FAILS if a bar writes ``\\r`` frames to a stream that is not a terminal (a bar redrawn
    on a timer would, after two seconds), or drops the phase lines a log should keep."""
    log = io.StringIO()
    replay(trace, config_grid([8], ["full"]), chunk_calls=16,
           progress=Bar(log, prefix="pallas-cache: ", use_tqdm=False, min_interval=0))
    text = log.getvalue()
    assert "\r" not in text and "%" not in text
    lines = text.splitlines()
    assert lines[0] == "pallas-cache: compiling 1 program for 1 configuration (384 layer-calls)..."
    assert lines[2].startswith("pallas-cache: offline optima")
    assert lines[1].startswith("pallas-cache: done in ") and len(lines) == 4


def test_a_terminal_gets_frames_with_percent_and_eta(trace):
    """FAILS if a terminal gets no bar, no ETA, or a frame without the ``\\r`` that redraws it."""
    terminal = FakeTerminal()
    replay(trace, config_grid([8], ["full"]), chunk_calls=16,
           progress=Bar(terminal, use_tqdm=False, min_interval=0))
    text = terminal.getvalue()
    assert text.startswith("compiling 1 program for 1 configuration")
    frames = text.split("\r")[1:]
    assert len(frames) >= 20
    assert any("ETA 0:" in frame for frame in frames), frames
    assert any("100%" in frame and "done in" in frame for frame in frames)
    assert any("belady cache_size=8" in frame for frame in frames)


def test_tqdm_draws_the_terminal_bar_when_importable(trace, monkeypatch):
    """FAILS if an importable tqdm is not used on a terminal, is used on a redirected stream,
    or is not driven to its total and closed."""
    made = []

    class FakeTqdm:
        def __init__(self, total, file, **kwargs):
            self.total, self.n, self.closed, self.postfix = total, 0, False, ""
            made.append(self)

        def update(self, n):
            self.n += n

        def set_postfix_str(self, text, refresh=True):
            self.postfix = text

        def close(self):
            self.closed = True

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=FakeTqdm))
    configs = config_grid([8], ["full"])
    replay(trace, configs, chunk_calls=64, progress=Bar(io.StringIO()))
    assert made == []
    replay(trace, configs, chunk_calls=64, progress=Bar(FakeTerminal()))
    assert [bar.total for bar in made] == [6, 2000]  # the replay's chunks; the optima's permille
    assert all(bar.n == bar.total and bar.closed for bar in made)
    assert made[1].postfix == "bypass optimum cache_size=8"


@pytest.mark.parametrize("bound", [bounds.belady, bounds.bypass_optimum])
@pytest.mark.parametrize("size", [16, 256])  # 256 = L*E: the everything-fits shortcut
def test_the_optima_report_progress_through_a_callback(trace, bound, size, monkeypatch):
    """FAILS if an optimum does not call ``progress`` up to ``(total, total)`` with ``total``
    its accesses, calls it out of order, or computes anything different when asked to."""
    monkeypatch.setattr(bounds, "_CHUNK", 100)
    calls = []
    with_progress = bound(trace, size, progress=lambda done, total: calls.append((done, total)))
    assert with_progress.missing == bound(trace, size).missing
    assert calls[-1] == (with_progress.active, with_progress.active)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    if size < trace.num_layers * trace.num_experts:
        assert len(calls) >= with_progress.active // 100


def test_the_cli_draws_to_stderr_and_quiet_silences_it(capsys):
    """FAILS if the CLI's first stderr line does not say the work started (once every check
    passed: the trace is generated while its programs compile, which once kept a log silent
    for 66-83 s on a fine-grained model) or the second is not the compile line, if it writes
    ``\\r`` to a redirected stderr, or if ``--quiet`` lets progress through."""
    assert cli.main(SMALL) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[:2] == [
        "pallas-cache: generating the mixtral-like trace while its programs compile...",
        "pallas-cache: compiling 2 programs for 4 configurations (384 layer-calls)..."]
    assert "\r" not in err
    assert cli.main(SMALL + ["--quiet"]) == 0
    assert capsys.readouterr().err == ""


# ---- the persistent compilation cache --------------------------------------------------------

def _entry_point():
    """The function pyproject's ``pallas-cache`` script runs, as ``(module, name)``."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        target = tomllib.load(handle)["project"]["scripts"]["pallas-cache"]
    module, _, name = target.partition(":")
    return module, name


def _run_script(tmp_path, argv, **env):
    """Run the console script's function in a fresh process with a temporary home."""
    module, name = _entry_point()
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items()
            if k not in ("XDG_CACHE_HOME", cli.NO_COMPILE_CACHE_ENV, "JAX_COMPILATION_CACHE_DIR")}
    code = (f"import os, sys, jax; from {module} import {name} as entry; "
            f"sys.argv = {['pallas-cache', *argv]!r}; status = entry(); "
            f"print('CACHE_DIR', jax.config.jax_compilation_cache_dir); sys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          timeout=600, env={**base, "HOME": str(home), "JAX_PLATFORMS": "cpu",
                                            "PYTHONPATH": REPO, **env})
    return done, home


def test_the_console_script_caches_compiled_programs_in_the_user_cache_dir(tmp_path):
    """FAILS if pyproject's script does not turn the persistent cache on in
    ``$XDG_CACHE_HOME/pallas-cache/jax``, or leaves small programs out of it (the default
    thresholds skip programs compiled in under a second)."""
    xdg = tmp_path / "xdg"
    done, home = _run_script(tmp_path, ["replay", "--synthetic", "mixtral-like", "--tokens", "2",
                                        "--cache-size", "8", "--policy", "full", "--quiet"],
                             XDG_CACHE_HOME=str(xdg))
    assert done.returncode == 0, done.stderr[-3000:]
    cache = xdg / "pallas-cache" / "jax"
    assert f"CACHE_DIR {cache}" in done.stdout
    entries = os.listdir(cache)
    program = f"jit_{sweep_program.chunk_program().__name__}-"  # the replay program
    assert any(name.startswith(program) for name in entries), entries
    assert any(not name.startswith(program) for name in entries), entries  # small ones too
    assert not os.listdir(home)


def test_without_xdg_the_cache_is_under_home(tmp_path):
    """FAILS if the default directory is not ``~/.cache/pallas-cache/jax``."""
    done, home = _run_script(tmp_path, ["replay", "--cache-size", "1"])  # fails before the work
    assert done.returncode == 2, done.stderr
    assert f"CACHE_DIR {home / '.cache' / 'pallas-cache' / 'jax'}" in done.stdout


@pytest.mark.parametrize("argv,env", [
    (["replay", "--cache-size", "1", "--no-compile-cache"], {}),
    (["replay", "--cache-size", "1"], {cli.NO_COMPILE_CACHE_ENV: "1"}),
])
def test_a_flag_or_the_environment_turns_the_cache_off(tmp_path, argv, env):
    """FAILS if ``--no-compile-cache`` or ``PALLAS_CACHE_NO_COMPILE_CACHE=1`` leaves the
    persistent cache on or creates its directory."""
    done, home = _run_script(tmp_path, argv, XDG_CACHE_HOME=str(tmp_path / "xdg"), **env)
    assert done.returncode == 2, done.stderr
    assert "CACHE_DIR None" in done.stdout
    assert not (tmp_path / "xdg").exists() and not os.listdir(home)


def test_main_in_process_never_turns_the_cache_on(capsys):
    """FAILS if ``cli.main`` (what every test calls) switches the persistent cache on for the
    process, which would make the test session write into the home directory."""
    assert cli.main(["replay", "--synthetic", "mixtral-like", "--tokens", "2", "--cache-size",
                     "8", "--policy", "full", "--quiet"]) == 0
    assert jax.config.jax_compilation_cache_dir is None
    assert os.environ.get(cli.NO_COMPILE_CACHE_ENV) == "1"  # conftest.py, for subprocesses


def test_the_array_form_reports_its_distinct_routes():
    """FAILS if the optima's ``total`` is not the distinct non-padding routes of the calls
    (duplicates and padding left out) for a trace given as arrays."""
    layers = np.array([0, 1, 0, 1], np.int32)
    routes = np.array([[0, 1], [2, 2], [1, 3], [0, -1]], np.int32)
    ticks = []
    result = bounds.belady((layers, routes), 4, progress=lambda d, t: ticks.append((d, t)))
    assert ticks[-1] == (result.active, result.active) == (6, 6)


@pytest.mark.parametrize("terminal", [True, False])
def test_an_interrupted_phase_ends_its_line_and_claims_nothing(terminal):
    """FAILS if closing a phase cut short (Ctrl-C) writes ``done in`` to a log, or leaves a
    terminal's frame open so that the CLI's ``interrupted`` line lands on the bar."""
    stream = FakeTerminal() if terminal else io.StringIO()
    bar = Bar(stream, use_tqdm=False, min_interval=0)
    bar.phase("compiling 1 program for 1 configuration...", 4)
    bar.update(1, "cache_size=8 calls 64/256")
    bar.close()
    bar.close()  # the CLI closes again after replay did: nothing more
    text = stream.getvalue()
    assert text.endswith("\n") and "done in" not in text
    assert text.count("\n") == 2 if terminal else text == (
        "compiling 1 program for 1 configuration...\n")


def test_a_terminal_sees_the_trace_being_read_and_then_only_what_follows(monkeypatch):
    """FAILS if a terminal sees nothing while the trace is read or generated, or if that passing
    note is not erased before the compile line or an error (nor kept out of logs: see the
    redirected-stderr test above)."""
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(SMALL) == 0
    note, erase, rest = terminal.getvalue().split("\r", 3)[1:]
    assert note == "pallas-cache: generating the mixtral-like trace..."
    assert erase == " " * len(note) and rest.startswith("pallas-cache: compiling 2 programs")
    terminal.seek(0)
    terminal.truncate()
    assert cli.main(["replay", "--trace", "/no/such/routes.jsonl"]) == 2
    shown = terminal.getvalue().split("\r")
    assert shown[1] == "pallas-cache: reading /no/such/routes.jsonl..."
    assert shown[2].strip() == "" and shown[3].startswith("pallas-cache: /no/such/routes.jsonl")
    bar = Bar(FakeTerminal())
    bar.note("reading x...")
    bar.phase("compiling 1 program for 1 configuration...", None)
    assert bar.stream.getvalue() == ("\rreading x...\r" + " " * 12 + "\r"
                                     "compiling 1 program for 1 configuration...\n")
    terminal.seek(0)
    terminal.truncate()
    assert cli.main(SMALL[:-4] + ["fraction:2", "--format", "json"]) == 0  # a policy warning
    assert "\r" + " " * len(note) + "\rpallas-cache: warning: fraction:2" in terminal.getvalue()


def test_a_long_read_shows_its_progress_as_a_phase_and_a_short_one_does_not(tmp_path, capsys,
                                                                             monkeypatch):
    """FAILS if a trace that takes a while to read shows nothing on stderr until its end (a
    gzip of blank lines read for minutes in silence), or if a quick read adds a line. The read
    is "long" here by setting the threshold to 0 s and the block to 64 KiB, so the file spans
    several blocks."""
    import gzip

    from pallas_cache.sizing.traces import jsonl as traces

    path = tmp_path / "blank.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n" * (1 << 20)))
    assert cli.main(["replay", "--trace", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pallas-cache: {path}: the trace is empty (no records)"]  # quick: one line
    monkeypatch.setattr(cli_replay, "READ_PROGRESS_AFTER", 0.0)
    monkeypatch.setattr(traces, "_BLOCK_BYTES", 1 << 16)
    updates = []
    real_update = Bar.update
    monkeypatch.setattr(Bar, "update", lambda self, done, status="": (
        updates.append((done, status)), real_update(self, done, status)))
    assert cli.main(["replay", "--trace", str(path)]) == 2
    size = os.path.getsize(path)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"pallas-cache: reading {path} ({size / 1024:.1f}KiB)...", lines
    assert re.fullmatch(r"pallas-cache: done in \d+\.\d s", lines[1]), lines
    assert lines[2:] == [f"pallas-cache: {path}: the trace is empty (no records)"], lines
    assert len(updates) >= 2 and updates[-1][0] == size, updates  # block by block, to the end


def test_the_cli_compiles_a_synthetic_sweep_while_it_generates_the_trace(caplog):
    """FAILS if the CLI compiles the replay's program only once the synthetic trace exists (on
    the main thread, after generating it), or if the program it compiles ahead is not the one
    the replay runs (the replay would compile a second one)."""
    import logging

    sweep_program.clear_compiled()
    caplog.clear()
    # Logged from every thread (the context manager would switch the log on for this one only).
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            assert cli.main(["replay", "--synthetic", "mixtral-like", "--tokens", "3",
                             "--cache-size", "8", "16", "--policy", "full", "fraction:0.4",
                             "--quiet", "--route-knn-legend"]) == 0
    finally:
        jax.config.update("jax_log_compiles", False)
    compiles = [r for r in caplog.records if "Compiling jit(_replay_chunk)" in r.getMessage()]
    # Two programs, both compiled ahead: the LRU sweep's and the legend's route_knn lanes'.
    assert [r.threadName for r in compiles] == ["pallas-cache-precompile"] * 2
