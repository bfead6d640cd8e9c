"""The CLI fails before the work, with one line: plot paths, memory limits, Ctrl-C, odd fractions.

Each test calls ``cli.main`` in-process. Where a failure used to surface only after the replay
(a bad ``--plot`` path), the replay is replaced by a sentinel that fails the test if it runs.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys

import pytest

from pallas_cache.sizing import cli
replay_mod = importlib.import_module("pallas_cache.sizing.sweep")  # the module of replay()

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["replay", "--synthetic", "mixtral-like", "--tokens", "4", "--cache-size", "64",
         "--policy", "full"]


@pytest.fixture
def no_replay(monkeypatch):
    """Make any replay fail the test: the error must come before the work."""
    def replay(*args, **kwargs):
        raise AssertionError("the replay ran before the argument error was reported")

    monkeypatch.setattr(replay_mod, "replay", replay)


def one_line_error(capsys, code):
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pallas-cache: "), err
    assert "Traceback" not in err
    return lines[0]


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
    assert capsys.readouterr().err.strip().splitlines() == ["pallas-cache: interrupted"]


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
    """FAILS if --tokens 100000000 or --cache-size 3000000000 start allocating (MemoryError or a
    raw RESOURCE_EXHAUSTED traceback after minutes)."""
    line = one_line_error(capsys, cli.main(["replay", "--tokens", "100000000"]))
    assert "num_tokens=100000000" in line and "above the memory limit" in line
    line = one_line_error(capsys, cli.main(SMALL[:-3] + ["3000000000"]))
    assert line.startswith("pallas-cache: --cache-size 3000000000: ") and "memory limit" in line


def test_max_memory_flag_sets_the_limit(tmp_path, capsys, no_replay):
    """FAILS if there is no way to lower (or raise) the limit from the command line, or a bad
    value is accepted."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"layer": 0, "token_idx": t, "experts": [1, 2]}) + "\n"
                            for t in range(100)))
    line = one_line_error(capsys, cli.main(["replay", "--trace", str(path), "--max-memory",
                                            "1KiB"]))
    assert "t.jsonl:" in line and "above the memory limit of 1.0 KiB" in line
    line = one_line_error(capsys, cli.main(["replay", "--max-memory", "lots"]))
    assert "'lots' is not a memory size" in line
    assert cli._memory_size("8GiB") == 8 * 2**30 and cli._memory_size("2e9") == 2 * 10**9
    assert cli._memory_size("512 MiB") == 512 * 2**20


def test_state_memory_counts_every_configuration_of_a_size():
    """FAILS if the cache-state estimate ignores the configuration batch or the geometry."""
    one = 32 * 8 * 16 + 1024 * 8 + 32 * 16
    cli._check_state_memory([1024], 1, 32, 8, 3 * one)
    with pytest.raises(ValueError, match=r"--cache-size 1024: 2 cache state"):
        cli._check_state_memory([64, 1024], 2, 32, 8, 3 * one)
    with pytest.raises(ValueError, match=r"10000 layers x 8 experts"):
        cli._check_state_memory([64], 1, 10_000, 8, 3 * one)


def test_hostile_trace_through_the_cli_is_one_line(tmp_path, capsys, no_replay):
    """FAILS if a one-record outlier id reaches the replay as a giant geometry."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"layer": 0, "token_idx": 0, "experts": [1, 2]}\n'
                    '{"layer": 10000000, "token_idx": 0, "experts": [1, 2]}\n')
    line = one_line_error(capsys, cli.main(["replay", "--trace", str(path)]))
    assert "t.jsonl:2: field 'layer': layer 10000000 is an outlier" in line


def test_a_ctrl_c_swallowed_inside_the_replay_still_interrupts(tmp_path, capsys, monkeypatch):
    """FAILS if a SIGINT whose KeyboardInterrupt is swallowed inside the replay (a callback of
    XLA's compiler can swallow it) lets the run go on to print its table and write its plot:
    under load the real-SIGINT test below once saw exit status 0 and a plot written."""
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
    compile, ``--no-compile-cache``) prints "interrupted" and then aborts (exit 134 or -6, in
    every run here before): the interpreter's exit stopped the thread mid-compile. The marker
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
