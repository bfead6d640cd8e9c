"""``pallas-cache`` in-process: what ``replay`` prints (records with every key, the table and its
legend, bytes, modeled ms per token, best, notes, budgets), and how a bad command line fails
before the work with one line (plot paths, memory limits, odd fractions, hostile traces), Ctrl-C
included. Where a failure could surface only after the replay (a bad ``--plot`` path), the
replay is replaced by a sentinel that fails the test if it runs.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys

import numpy as np
import pytest

from tests.sizing.conftest import one_line_error
from pallas_cache.sizing import cli
from pallas_cache.sizing.cli.checks import check_state_memory
from pallas_cache.sizing.cli.parser import memory_size
from pallas_cache.sizing.traces import RUN_FIXED_BYTES

replay_mod = importlib.import_module("pallas_cache.sizing.sweep")  # the module of replay()

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SMALL = ["replay", "--synthetic", "mixtral-like", "--tokens", "4", "--cache-size", "64",
         "--policy", "full"]


@pytest.mark.parametrize("make_path,message", [
    (lambda tmp: tmp / "missing" / "plot.png", r"no such directory"),
    (lambda tmp: tmp / "plot.bmp", r"unknown image format \.bmp; use one of .*\.png"),
    (lambda tmp: tmp / "plot", r"unknown image format \(no extension\)"),
    (lambda tmp: "/proc/plot.png", r"cannot write in /proc"),
], ids=["missing-dir", "bad-extension", "no-extension", "unwritable"])
def test_a_bad_plot_path_fails_before_the_replay(tmp_path, capsys, no_replay, make_path, message):
    """FAILS if --plot is only checked when the figure is saved, after the whole replay."""
    path = make_path(tmp_path)
    line = one_line_error(capsys, cli.main(SMALL + ["--plot", str(path)]))
    assert str(path) in line
    assert re.search(message, line), line


def test_plot_without_matplotlib_fails_before_the_replay(capsys, no_replay, monkeypatch,
                                                         tmp_path):
    """FAILS if a missing matplotlib is discovered after the replay."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    line = one_line_error(capsys, cli.main(SMALL + ["--plot", str(tmp_path / "p.png")]))
    assert "--plot needs matplotlib" in line


def test_plot_into_a_directory_writes_the_default_name(tmp_path, capsys):
    """FAILS if --plot DIR tries to write the directory itself (IsADirectoryError after the
    replay) instead of a file inside it."""
    assert cli.main(SMALL + ["--json", "--plot", str(tmp_path)]) == 0
    written = os.listdir(tmp_path)
    assert len(written) == 1 and written[0].endswith(".png"), written
    assert (tmp_path / written[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(json.loads(capsys.readouterr().out)) == 1


def test_ctrl_c_prints_one_line_exits_130_and_leaves_no_partial_plot(tmp_path, capsys,
                                                                     monkeypatch):
    """FAILS if Ctrl-C escapes as a KeyboardInterrupt traceback, or an interrupted plot leaves a
    partial (or temporary) file behind."""
    import matplotlib.figure

    def interrupted_savefig(self, fname, *args, **kwargs):
        with open(fname, "wb") as handle:
            handle.write(b"\x89PNG partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", interrupted_savefig)
    target = tmp_path / "plot.png"
    assert cli.main(SMALL + ["--plot", str(target)]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "pallas-cache: interrupted" and "Traceback" not in err
    assert os.listdir(tmp_path) == []

    def interrupted_replay(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(replay_mod, "replay", interrupted_replay)
    assert cli.main(SMALL) == 130
    # the progress line a log gets once the work starts, then the interrupt's one line
    assert capsys.readouterr().err.strip().splitlines() == [
        "pallas-cache: generating the mixtral-like trace while its programs compile...",
        "pallas-cache: interrupted"]


@pytest.mark.parametrize("policy,meaning", [
    ("fraction:-1", "fetch fraction 0"), ("fraction:1e-9", "fetch fraction 0"),
    ("fraction:2", "fetch fraction 1"),
])
def test_a_clamped_fraction_warns_what_it_means(capsys, monkeypatch, policy, meaning):
    """FAILS if fraction:-1 / fraction:1e-9 run silently as "never fetch"."""
    monkeypatch.setattr(replay_mod, "replay", lambda trace, configs, **options: [])
    argv = ["replay", "--synthetic", "mixtral-like", "--tokens", "2", "--cache-size", "64",
            "--json", "--policy", "fraction:0.4", policy, "fraction:0"]
    assert cli.main(argv) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"pallas-cache: warning: {policy} means {meaning}")


def test_huge_tokens_and_cache_sizes_are_refused_before_allocation(capsys, no_replay):
    """FAILS if --tokens 100000000 or --cache-size 2000000000 start allocating (MemoryError or a
    raw RESOURCE_EXHAUSTED traceback after minutes)."""
    line = one_line_error(capsys, cli.main(["replay", "--tokens", "100000000"]))
    assert "num_tokens=100000000" in line and "above the memory limit" in line


def test_a_huge_cache_size_is_clamped_to_every_expert_before_allocation(capsys):
    """FAILS if --cache-size 2000000000 allocates a state of two billion slots (or is refused):
    past every expert (L*E slots) a pool holds nothing more, so it is replayed as L*E."""
    assert cli.main(SMALL[:-3] + ["2000000000", "--policy", "full", "--json", "-q"]) == 0
    assert [row["cache_size"] for row in json.loads(capsys.readouterr().out)] == [32 * 8]


def test_max_memory_flag_sets_the_limit(tmp_path, capsys, no_replay):
    """FAILS if there is no way to lower (or raise) the limit from the command line, or a bad
    value is accepted."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"layer": 0, "token_idx": t, "experts": [1, 2]}) + "\n"
                            for t in range(100)))
    # the limit covers the whole process: 1 KiB above a minimal run's fixed cost is all the
    # trace may add
    line = one_line_error(capsys, cli.main(["replay", "--trace", str(path), "--max-memory",
                                            str(RUN_FIXED_BYTES + 1024)]))
    assert "t.jsonl:" in line and "above the memory limit of 512.0 MiB less the 512.0 MiB" in line
    line = one_line_error(capsys, cli.main(["replay", "--max-memory", "lots"]))
    assert "'lots' is not a memory size" in line
    assert memory_size("8GiB") == 8 * 2**30 and memory_size("2e9") == 2 * 10**9
    assert memory_size("512 MiB") == 512 * 2**20


def test_state_memory_counts_every_configuration_of_a_size():
    """FAILS if the cache-state estimate ignores the configuration batch or the geometry."""
    one = 32 * 8 * 16 + 1024 * 8 + 32 * 16
    check_state_memory([1024], 1, 32, 8, 3 * one)
    with pytest.raises(ValueError, match=r"--cache-size 1024: 2 cache state"):
        check_state_memory([64, 1024], 2, 32, 8, 3 * one)
    with pytest.raises(ValueError, match=r"10000 layers x 8 experts"):
        check_state_memory([64], 1, 10_000, 8, 3 * one)


def test_hostile_trace_through_the_cli_is_one_line(tmp_path, capsys, no_replay):
    """FAILS if a one-record outlier id reaches the replay as a giant geometry."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"layer": 0, "token_idx": 0, "experts": [1, 2]}\n'
                    '{"layer": 10000000, "token_idx": 0, "experts": [1, 2]}\n')
    line = one_line_error(capsys, cli.main(["replay", "--trace", str(path)]))
    assert "t.jsonl:2: field 'layer': layer 10000000 is an outlier" in line


def test_a_ctrl_c_swallowed_inside_the_replay_still_interrupts(tmp_path, capsys, monkeypatch):
    """FAILS if a SIGINT whose KeyboardInterrupt is swallowed inside the replay (a callback of
    XLA's compiler can swallow it) lets the run go on to print its table and write its plot
    (under load, the real-SIGINT test below can then see exit status 0 and a plot written)."""
    import signal
    import time

    real_replay = replay_mod.replay

    def swallowing_replay(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(200):  # the handler runs at the next bytecode of this thread
                time.sleep(0.005)
        except KeyboardInterrupt:
            pass
        return real_replay(*args, **kwargs)

    monkeypatch.setattr(replay_mod, "replay", swallowing_replay)
    target = tmp_path / "plot.png"
    assert cli.main(SMALL + ["--plot", str(target)]) == 130
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines()[-1] == "pallas-cache: interrupted"
    assert os.listdir(tmp_path) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_real_sigint_during_the_replay_exits_130_without_a_traceback(tmp_path):
    """FAILS if SIGINT during a running replay ends in a KeyboardInterrupt traceback (the
    40-82 lines seen before) or leaves a plot file: the whole process, as a user runs it."""
    import signal
    import subprocess

    target = tmp_path / "plot.png"
    process = subprocess.Popen(
        [sys.executable, "-m", "pallas_cache.sizing.cli", "replay", "--synthetic",
         "fine-grained", "--tokens", "2000", "--cache-size", "1024", "2048", "--plot",
         str(target)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO})
    seen = b""
    while b"compiling" not in seen:  # the replay's first line: it is running
        chunk = process.stderr.read1(256)
        assert chunk, seen.decode(errors="replace")
        seen += chunk
    process.send_signal(signal.SIGINT)
    seen += process.stderr.read()
    assert process.wait(timeout=120) == 130, seen.decode(errors="replace")
    text = seen.decode(errors="replace")
    assert "Traceback" not in text and text.rstrip().endswith("pallas-cache: interrupted"), text
    assert os.listdir(tmp_path) == []


def _console(argv_or_code, **popen):
    """The console script in a fresh interpreter (an abort at exit needs the real exit)."""
    import subprocess

    command = ([sys.executable, "-c", argv_or_code] if isinstance(argv_or_code, str) else
               [sys.executable, "-m", "pallas_cache.sizing.cli", *argv_or_code])
    return subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=REPO,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO},
                            **popen)


def test_a_refused_synthetic_trace_exits_2_with_one_line_not_an_abort():
    """FAILS if a refused --synthetic command prints its line and then aborts at interpreter
    exit (``terminate called after throwing ...`` / ``FATAL: exception not rethrown``, exit
    134): the precompile thread was started before the trace was checked and was still inside
    XLA when the interpreter exited."""
    cases = {"--tokens 0": "num_tokens must be a positive integer, got 0",
             "--seed -1": "seed must be a non-negative integer, got -1",
             f"--tokens {10**12}": "above the memory limit"}
    processes = {flags: _console(["replay", "--synthetic", "mixtral-like", *flags.split()])
                 for flags in cases}  # side by side: each is mostly the import of JAX
    for flags, process in processes.items():
        err = process.stderr.read().decode(errors="replace")
        assert process.wait(timeout=120) == 2, (flags, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pallas-cache: "), (flags, err)
        assert cases[flags] in lines[0], (flags, err)


def test_ctrl_c_while_the_precompile_thread_compiles_exits_130_not_an_abort():
    """FAILS if a SIGINT that arrives while the background precompile is inside XLA (a cold
    compile, ``--no-compile-cache``) prints "interrupted" and then aborts (exit 134 or -6): the
    interpreter's exit stopped the thread mid-compile. The marker
    is written by the precompile thread as it enters XLA's compile, so the signal lands there."""
    import signal

    code = ("import sys, threading\n"
            "import jax.stages\n"
            "from pallas_cache.sizing import cli\n"
            "real = jax.stages.Lowered.compile\n"
            "def compile(self, *args, **kwargs):\n"
            "    if threading.current_thread().name == 'pallas-cache-precompile':\n"
            "        print('precompile compiling', file=sys.stderr, flush=True)\n"
            "    return real(self, *args, **kwargs)\n"
            "jax.stages.Lowered.compile = compile\n"
            "sys.argv = ['pallas-cache', 'replay', '--no-compile-cache']\n"
            "sys.exit(cli.console_main())\n")
    process = _console(code)
    seen = b""
    while b"precompile compiling" not in seen:
        chunk = process.stderr.read1(256)
        assert chunk, seen.decode(errors="replace")
        seen += chunk
    process.send_signal(signal.SIGINT)
    seen += process.stderr.read()
    text = seen.decode(errors="replace")
    assert process.wait(timeout=120) == 130, text
    assert text.rstrip().endswith("pallas-cache: interrupted"), text
    assert "terminate" not in text and "FATAL" not in text and "Traceback" not in text, text


@pytest.mark.parametrize("size", ["-5", "-0.5"])
def test_a_negative_cache_size_says_it_must_be_positive(capsys, no_replay, size):
    """FAILS if --cache-size -5 is read as a byte size and refused as "bad byte size" instead
    of saying that a cache size must be positive."""
    line = one_line_error(capsys, cli.main(SMALL[:-3] + [size, "--policy", "full"]))
    assert f"cache size {size!r} must be positive" in line, line


def test_a_clamped_fraction_runs_and_is_shown_resolved(tmp_path, capsys, monkeypatch):
    """FAILS if fraction:1.5 (or fraction:-1) runs with its warning but every row keeps the
    label fraction:1.5 instead of the fraction it ran, fraction:1 (fraction:0), as
    fraction:auto is shown resolved; an unchanged fraction keeps its label. (A trace file, so
    no precompile runs for the replay that is replaced.)"""
    ran = []
    monkeypatch.setattr(replay_mod, "replay",
                        lambda trace, configs, **options: ran.extend(configs) or [])
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"layer": layer, "token_idx": 0, "experts": [0, 1]}) + "\n"
                            for layer in range(2)))
    argv = ["replay", "--trace", str(path), "--num-experts", "8", "--cache-size", "8", "--policy",
            "fraction:1.5", "fraction:-1", "fraction:0.4", "--json"]
    assert cli.main(argv) == 0
    assert [config.policy for config in ran] == ["fraction:1", "fraction:0", "fraction:0.4"]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert [w.split()[2] for w in warnings] == ["fraction:1.5", "fraction:-1"], warnings


@pytest.fixture
def umask():
    """Set the process umask for a test, and restore it."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


def test_a_new_plot_follows_the_umask_and_an_existing_one_keeps_its_mode(tmp_path, capsys,
                                                                          umask):
    """FAILS if the plot keeps the temporary file's mode 0600 whatever the umask (a new file
    must be 0644 under umask 022 and 0640 under 027), or an existing writable file ends 0600
    instead of keeping its mode."""
    for mask, mode in ((0o022, 0o644), (0o027, 0o640)):
        umask(mask)
        target = tmp_path / f"new-{mask:o}.png"
        assert cli.main(SMALL + ["--json", "--plot", str(target)]) == 0
        assert oct(os.stat(target).st_mode & 0o777) == oct(mode)
    umask(0o022)
    existing = tmp_path / "existing.png"
    existing.write_bytes(b"old")
    os.chmod(existing, 0o664)
    assert cli.main(SMALL + ["--json", "--plot", str(existing)]) == 0
    assert existing.read_bytes()[:4] == b"\x89PNG"
    assert oct(os.stat(existing).st_mode & 0o777) == oct(0o664)
    assert sorted(os.listdir(tmp_path)) == ["existing.png", "new-22.png", "new-27.png"]
    capsys.readouterr()


def test_a_plot_target_that_cannot_be_replaced_is_refused_before_the_replay(
        tmp_path, capsys, no_replay, monkeypatch):
    """FAILS if an existing --plot file whose directory refuses the rename over it is found out
    only after the whole replay (a 20-line PermissionError traceback from os.replace); the
    file is left as it was."""
    target = tmp_path / "plot.png"
    target.write_bytes(b"keep me")
    real_replace = os.replace

    def refusing_replace(src, dst, **kwargs):
        if str(target) in (str(src), str(dst)):
            raise PermissionError(1, "Operation not permitted")
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", refusing_replace)
    monkeypatch.setattr(os, "rename", refusing_replace)
    line = one_line_error(capsys, cli.main(SMALL + ["--plot", str(target)]))
    assert f"--plot {target}: cannot replace the existing file: Operation not permitted" in line
    assert target.read_bytes() == b"keep me" and os.listdir(tmp_path) == ["plot.png"]


def test_an_immutable_plot_target_is_refused_before_the_replay(tmp_path, capsys, no_replay):
    """FAILS if an immutable (chattr +i) --plot file is refused only after the replay, by a
    traceback. Needs chattr and the right to use it (root here); skipped elsewhere."""
    import shutil
    import subprocess

    target = tmp_path / "plot.png"
    target.write_bytes(b"keep me")
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(target)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        line = one_line_error(capsys, cli.main(SMALL + ["--plot", str(target)]))
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)
    assert f"--plot {target}: " in line and ("cannot replace" in line or "not writable" in line)
    assert target.read_bytes() == b"keep me" and os.listdir(tmp_path) == ["plot.png"]


@pytest.mark.parametrize("argv", [
    ["replay", "--tokens", "abc"],
    ["replay", "--cache-size", "-5GiB"],
    ["replay", "--eviction", "fifo"],
    ["bogus"],
    [],
], ids=["bad-int", "option-like-value", "bad-choice", "unknown-command", "no-command"])
def test_a_command_line_argparse_refuses_is_one_line_and_exit_2(capsys, no_replay, argv):
    """FAILS if argparse's own refusals print its usage block before the error (several lines)
    or leave by SystemExit instead of returning 2."""
    line = one_line_error(capsys, cli.main(argv))
    assert "--help" in line, line


# ---- what replay prints ---------------------------------------------------------------------

MIB = 2**20
W_MIXTRAL = 3 * 4096 * 14336 * 2  # bytes of one Mixtral-8x7B expert in bf16 (336 MiB)
TIMED = ["--model", "mixtral-8x7b", "--link-bandwidth", "25GB/s", "--cpu-bandwidth", "60GB/s"]
KEYS = {"cache_size", "policy", "order", "admission", "calls", "routes", "active", "missing",
        "fetched", "cpu_routes", "empty_slots", "hit_rate", "belady_hit_rate",
        "bypass_optimum_hit_rate", "oracle_hit_rate", "tokens", "cpu_experts", "pair_counts",
        "cache_bytes", "fetched_bytes_per_token", "cpu_bytes_per_token", "modeled_ms_per_token",
        "best", "budget_best", "note"}


def table_keys(out, which: int = 0):
    """The column names of a printed table (the ``which``-th of the output: a table too wide
    for 100 columns has its per-size columns in a second one): a header may wrap onto up to
    three lines above the rule of dashes; the rule's dash runs give each column's span."""
    lines = out.splitlines()
    rules = [i for i, line in enumerate(lines) if set(line) <= {"-", " "} and "---" in line]
    rule = rules[which]
    spans, start = [], None
    for i, char in enumerate(lines[rule] + " "):
        if char == "-" and start is None:
            start = i
        elif char != "-" and start is not None:
            spans.append((start, i))
            start = None
    top = rule - 1  # header lines hold keys only; the preamble's lines hold ":" or "="
    while top - 1 >= 0 and rule - top < 3 and lines[top - 1].strip() and not (
            ":" in lines[top - 1] or "=" in lines[top - 1]):
        top -= 1
    header = lines[top:rule]
    return ["".join(line[a:b].strip() for line in header) for a, b in spans[:-1]] + [
        "".join(line[spans[-1][0]:].strip() for line in header)]


def all_table_keys(out):
    """The column names of every table of the output."""
    count = sum(1 for line in out.splitlines() if set(line) <= {"-", " "} and "---" in line)
    return [key for which in range(count) for key in table_keys(out, which)]


def run(capsys, *argv):
    code = cli.main(["replay", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_rows_carry_every_cost_key_and_flag_undersized_rows(capsys):
    """FAILS if a key is missing, cache_bytes is not S*W, the modeled time is not the per-call
    max summed per token, fraction:auto is not resolved, `best` is not per cache size, the
    budget pick ignores cache_bytes, or a size below L*k (= 64 on mixtral-like) is not flagged
    while one at L*k is."""
    code, out, err = run(capsys, "--synthetic", "mixtral-like", "--tokens", "6", *TIMED,
                         "--cache-size", "8", "64", "--device-budget", "2688MiB", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert len(rows) == 6
    for row in rows:
        assert KEYS <= set(row), KEYS - set(row)
        assert row["cache_bytes"] == row["cache_size"] * W_MIXTRAL
        seconds = sum(n * max(f * W_MIXTRAL / 25e9, c * W_MIXTRAL / 60e9)
                      for f, c, n in row["pair_counts"])
        assert row["modeled_ms_per_token"] == pytest.approx(1e3 * seconds / 6)
        assert row["fetched_bytes_per_token"] == pytest.approx(row["fetched"] * W_MIXTRAL / 6)
        assert row["cpu_bytes_per_token"] == pytest.approx(
            (row["missing"] - row["fetched"]) * W_MIXTRAL / 6)
    # Default policies once both bandwidths are known; auto = 25 / (25 + 60) = 0.2941.
    assert [r["policy"] for r in rows[:3]] == ["full", "fraction:0.2941", "fraction:0.4"]
    for size in (8, 64):
        group = [r for r in rows if r["cache_size"] == size]
        fastest = min(r["modeled_ms_per_token"] for r in group)
        assert [r["best"] for r in group] == [r["modeled_ms_per_token"] == fastest for r in group]
    # 2688 MiB holds the 8-slot pool (2.6 GiB, its exact fit: no size added) but not the
    # 64-slot one (21 GiB).
    small = [r for r in rows if r["cache_size"] == 8]
    assert [r["budget_best"] for r in rows[3:]] == [False] * 3
    assert [r["budget_best"] for r in small] == [r["best"] for r in small]
    assert all("L*k = 64" in r["note"] and "oracle" in r["note"] for r in small)
    assert all(r["note"] == "" for r in rows if r["cache_size"] == 64)


def test_the_table_names_the_columns_by_their_keys_and_says_what_bounds_what(capsys):
    """FAILS if the table loses a cost column, hides the resolved auto split or the byte-size
    rounding, or does not say which bound applies to which rows and which row the budget picks.

    12 GiB of 336 MiB experts: 12 * 1024 / 336 = 36.57 -> 36 slots; the 24 GiB budget's exact
    fit, 73 slots, is replayed beside it and picked."""
    code, out, err = run(capsys, "--synthetic", "mixtral-like", "--tokens", "4", *TIMED,
                         "--cache-size", "12GiB", "--device-budget", "24GiB")
    assert code == 0, err
    flat = " ".join(out.split())
    for key in ("cache_size", "cache_bytes", "hit_rate", "belady_hit_rate",
                "bypass_optimum_hit_rate", "oracle_hit_rate", "fetched_bytes_per_token",
                "cpu_bytes_per_token", "modeled_ms_per_token", "best", "note"):
        assert key in all_table_keys(out), key
    assert "12GiB = 36 slots of 336MiB" in out
    assert "fraction:auto = B_link/(B_link+B_cpu) = 0.2941" in out
    assert "belady_hit_rate bounds the `full` rows" in flat
    assert "bypass_optimum_hit_rate bounds every row" in flat
    assert "Best within 24.0GiB: cache_size=73" in flat
    assert "S < L*k = 64" in out


def test_cli_mistakes_fail_before_the_replay_with_one_line(capsys):
    """FAILS if a cost flag that cannot be honoured reaches the replay (or a traceback)."""
    cases = [
        (["--policy", "fraction:auto"], "fraction:auto needs both"),
        (["--cache-size", "12GiB"], "give --model or --expert-bytes"),
        (["--model", "mixtral-8x7b", "--device-budget", "24GiB"], "--device-budget needs"),
        (["--link-bandwidth", "25Gb/s"], "means bits"),
        (["--model", "mixtral-8x7b", "--cache-size", "2GiB"], "fewer than one layer's 8"),
        (["--model", "gpt-5"], "unknown model"),
    ]
    for argv, message in cases:
        code, out, err = run(capsys, "--synthetic", "mixtral-like", "--tokens", "2", *argv)
        assert code == 2 and out == "", argv
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_a_model_that_does_not_match_the_trace_is_warned_about(tmp_path, capsys):
    """FAILS if a geometry mismatch between --model and a trace file passes silently, or a
    match is warned about. (A synthetic trace takes --model's geometry:
    tests/sizing/cli/test_cli_sizing.py.)"""
    path = tmp_path / "mixtral.npy"
    np.save(path, np.random.default_rng(0).integers(0, 8, size=(2, 32, 2)).astype(np.int32))
    code, _, err = run(capsys, "--trace", str(path), "--num-experts", "8", "--cache-size",
                       "128", "--policy", "full", "--model", "qwen3-30b-a3b", "--json")
    assert code == 0 and "warning" in err and "qwen3-30b-a3b has 48 MoE layers" in err
    code, _, err = run(capsys, "--trace", str(path), "--num-experts", "8", "--cache-size",
                       "64", "--policy", "full", "--model", "mixtral-8x7b", "--json")
    assert code == 0 and "warning" not in err


def test_the_default_sizes_are_the_auto_grid_of_the_trace(tmp_path, capsys):
    """FAILS if `--cache-size` does not default to auto, i.e. max(E, L*k) .. L*E by sqrt(2).

    L = 2, E = 4, top-1: from max(4, 2) = 4: 4, 5.66 -> 6, then L*E = 8."""
    path = tmp_path / "tiny.npy"
    rng = np.random.default_rng(0)
    np.save(path, rng.integers(0, 4, size=(20, 2, 1)).astype(np.int32))
    code, out, err = run(capsys, "--trace", str(path), "--num-experts", "4", "--policy", "full",
                         "--json")
    assert code == 0, err
    assert [r["cache_size"] for r in json.loads(out)] == [4, 6, 8]


def test_bench_bandwidth_prints_flags_that_replay_accepts(capsys):
    """FAILS if the measured bandwidths are printed in a form --link-bandwidth/--cpu-bandwidth
    refuse (e.g. bits, or no /s), or a bad size reaches the measurement."""
    from pallas_cache.sizing.units import parse_bandwidth

    assert cli.main(["bench-bandwidth", "--mib", "1", "--d-model", "64", "--d-expert", "128",
                     "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    flags = next(line for line in out.splitlines() if line.startswith("flags:")).split()
    assert flags[1] == "--link-bandwidth" and flags[3] == "--cpu-bandwidth"
    assert parse_bandwidth(flags[2]) > 0 and parse_bandwidth(flags[4]) > 0
    assert cli.main(["bench-bandwidth", "--mib", "0"]) == 2
    assert ">= 1" in capsys.readouterr().err


KNN_BASE = ["--synthetic", "mixtral-realistic", "--tokens", "24", "--cache-size", "64", "96",
             "128", "--policy", "full", "fraction:0.4", "-q"]
KNN_SWEEP = KNN_BASE + ["--route-knn-legend"]


def knn_legend_lines(out):
    """The legend's route_knn paragraph (its last, wrapped within 100 columns) as one line."""
    lines = out.splitlines()
    return [" ".join(lines[i:]) for i, line in enumerate(lines) if line.startswith("route_knn (")]


def test_an_lru_only_table_says_in_one_paragraph_what_route_knn_changes_at_each_size(capsys):
    """FAILS if the legend of an LRU-only table lacks the route_knn paragraph, wraps it beyond
    100 columns or puts it anywhere but last, gives a size's change other than route_knn's hit rate (from its own rows of
    a sweep that includes it) minus LRU's, or prints the line when another eviction is swept."""
    code, out, _ = run(capsys, *KNN_BASE, "--format", "json")
    lru = {r["cache_size"]: r["hit_rate"] for r in json.loads(out) if r["policy"] == "full"}
    code, out, _ = run(capsys, *KNN_BASE, "--eviction", "lru", "route_knn", "--format", "json")
    assert code == 0
    knn = {r["cache_size"]: r["hit_rate"] for r in json.loads(out)
           if r["policy"] == "full" and r["eviction"] == "route_knn"}
    changes = [knn[size] - lru[size] for size in (64, 96, 128)]
    assert any(abs(change) >= 0.001 for change in changes)  # the trace tells them apart
    code, out, _ = run(capsys, *KNN_SWEEP)
    assert code == 0
    [line] = knn_legend_lines(out)
    assert max(map(len, out.splitlines())) <= 100
    assert "policy full: hit rate " + ", ".join(
        f"{change:+.3f} at {size}" for change, size in zip(changes, (64, 96, 128))) in line
    assert line.endswith("(add --eviction lru route_knn to see its rows).")
    code, out, _ = run(capsys, *KNN_BASE, "--eviction", "route_knn")  # compiled above
    assert code == 0 and "hit_rate = 1 - missing/active" in out
    assert knn_legend_lines(out) == []


def test_json_and_csv_of_an_lru_sweep_are_the_lru_replays_records_exactly(capsys):
    """FAILS if the route_knn legend's replay leaks into the machine-readable output (an extra
    record, or an LRU row's value changed, e.g. its budget pick): json and csv must be the
    records of the LRU configurations' replay, byte for byte."""
    from pallas_cache.sizing.sweep.cost import CostModel
    from pallas_cache.sizing.report import format_records, records
    from pallas_cache.sizing.sweep import config_grid, replay
    from pallas_cache.sizing.synthetic import synthetic_trace

    trace = synthetic_trace("mixtral-realistic", num_tokens=24, seed=0)
    cost = CostModel(W_MIXTRAL, 25e9, 60e9, 20 * 2**30)
    # 20 GiB of 336 MiB experts: 60 slots, the budget's exact fit, replayed beside the grid.
    results = replay(trace, config_grid([60, 64, 96, 128], ["full", "fraction:0.4"]), cost=cost,
                     progress=lambda status: None)
    rows = records(results, trace, cost)
    for fmt in ("json", "csv"):
        code, out, _ = run(capsys, *KNN_BASE, *TIMED, "--device-budget", "20GiB",
                           "--format", fmt)
        assert code == 0
        assert out == format_records(rows, fmt) + "\n"


def test_the_cli_prints_json_with_the_documented_keys(capsys):
    code = cli.main(["replay", "--synthetic", "mixtral-like", "--tokens", "12", "--cache-size",
                     "8", "64", "--policy", "full", "fraction:0.4", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 4
    keys = {"cache_size", "policy", "order", "admission", "calls", "routes", "active", "missing",
            "fetched", "cpu_routes", "hit_rate", "belady_hit_rate", "empty_slots"}
    for row in rows:
        assert keys <= set(row)
        assert row["calls"] == 12 * 32 and row["routes"] == 12 * 32 * 2
        assert row["hit_rate"] == pytest.approx(1 - row["missing"] / row["active"])
    full = [r for r in rows if r["policy"] == "full"]
    assert all(r["fetched"] == r["missing"] and r["cpu_routes"] == 0 for r in full)
    big = [r for r in rows if r["cache_size"] == 64]
    assert all(r["hit_rate"] > s["hit_rate"] for r, s in zip(big, rows[:2])), "more slots help"


def test_the_cli_reports_a_malformed_trace_by_line_and_field(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"layer": 0, "token_idx": 0, "experts": [1, 2]}\n'
                    '{"layer": 0, "token_idx": 1, "experts": [1, "x"]}\n')
    code = cli.main(["replay", "--trace", str(path), "--cache-size", "8"])
    err = capsys.readouterr().err
    assert code == 2
    assert "bad.jsonl:2" in err and "experts" in err and "Traceback" not in err


def test_the_cli_refuses_a_cache_that_cannot_hold_a_layer(capsys):
    code = cli.main(["replay", "--synthetic", "mixtral-like", "--tokens", "4", "--cache-size", "4"])
    assert code == 2 and "cannot hold one layer" in capsys.readouterr().err


def test_the_scenarios_command_prints_the_promotion_table(capsys):
    assert cli.main(["scenarios"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[-2:] for line in out.splitlines()[2:]]
    assert rows == [["0", "1"], ["256", "1"], ["56", "64"], ["2104", "88"], ["8", "0"]]
