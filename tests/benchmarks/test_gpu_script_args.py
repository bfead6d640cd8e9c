"""The GPU scripts (``benchmarks/gpu_check.py``, ``benchmarks/profiler_graph_fault.py``) refuse
a bad argument in one line, exit 2, before any work: a negative seed, a report path whose
folder cannot be made, a duplicated eviction, a time limit no wait can take."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.benchmarks.conftest import BENCHMARKS

SCRIPT = "gpu_check"


def _refused(capsys, call, script):
    with pytest.raises(SystemExit) as stop:
        call()
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"{script}: error:"), err
    return err


@pytest.fixture
def no_work(script, monkeypatch):
    """Make any phase fail the test: the refusal must come before the work."""
    def run_phases(*args, **kwargs):
        raise AssertionError("the phases ran before the refusal")

    monkeypatch.setattr(script, "run_phases", run_phases)


@pytest.mark.parametrize("argv, message", [
    (["--smoke", "--phases", "copy", "--seed", "-5"], "--seed: '-5' must be >= 0"),
    (["--smoke", "--phases", "copy", "--mesh-evictions", "lru,lru"], "give distinct names"),
], ids=["negative-seed", "duplicated-eviction"])
def test_gpu_check_refuses_a_bad_argument_before_the_work(script, capsys, no_work, argv,
                                                         message):
    """FAILS if ``--seed -5`` reaches NumPy's generator (a traceback reported as a failed
    backend) or ``--mesh-evictions lru,lru`` doubles the mesh rows: one line, exit 2, before
    any phase, as a duplicated ``--phases`` is."""
    assert message in _refused(capsys, lambda: script.main(argv), "gpu_check.py")


def test_gpu_check_checks_the_report_folder_before_the_work(script, capsys, no_work,
                                                           tmp_path):
    """FAILS if ``--out <file>/sub/report.md`` fails with ``NotADirectoryError`` after the
    phases ran (on a GPU lease, device time lost): one line naming the folder, before them."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker / "sub" / "report.md"
    err = _refused(capsys, lambda: script.main(["--smoke", "--phases", "copy", "--out",
                                                   str(out)]), "gpu_check.py")
    assert f"--out {out}: cannot make its folder" in err
    folder = tmp_path / "folder"
    folder.mkdir()
    err = _refused(capsys, lambda: script.main(["--smoke", "--out", str(folder)]),
                   "gpu_check.py")
    assert "is a folder" in err


@pytest.mark.parametrize("argv, message", [
    (["--timeout", "inf"], "must be a finite number of seconds"),
    (["--timeout", "1e300"], "must be a finite number of seconds"),
    (["--out", "{blocker}/sub/fault.md"], "cannot make its folder"),
], ids=["inf", "past-the-wait", "out-under-a-file"])
def test_the_profiler_probe_refuses_a_bad_argument_before_the_work(tmp_path, argv, message):
    """FAILS if ``--timeout inf`` ends in ``OverflowError`` inside ``subprocess.run``, or
    ``--out <file>/sub/fault.md`` in ``NotADirectoryError`` after every mode ran: one line,
    exit 2, and no mode run (nothing on stdout)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = [a.format(blocker=blocker) for a in argv]
    bad = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "profiler_graph_fault.py"),
                          "--modes", "xla", *argv], env=dict(os.environ, JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], bad.stderr
    assert bad.stdout == "" and "Traceback" not in bad.stderr
