"""Ctrl-C at every phase of ``pallas-cache replay``: a SIGINT sent just after each
phase line on stderr (reading, compiling, offline optima, the output, the plot) exits 130 with
one line and no output file, or, once everything is written, 0; never a traceback and never
the abort of a process whose teardown stopped a thread inside XLA (``terminate called ...``,
exit 134). Whatever background threads the phase has. Runs the console script in a fresh
interpreter (the abort happens at the real exit): 1 run per phase under the ``ci`` profile,
3 under ``deep``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.harness import PROFILE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RUNS = 3 if PROFILE == "deep" else 1

#: The console script with the reading phase's line shown from the first block (it waits
#: READ_PROGRESS_AFTER seconds otherwise), so every phase has a line to interrupt after.
CONSOLE = ("import sys; from pallas_cache.sizing import cli; from pallas_cache.sizing.cli import "
           "replay as cli_replay; "
           "cli_replay.READ_PROGRESS_AFTER = 0.0; sys.argv[0] = 'pallas-cache'; "
           "sys.exit(cli.console_main())")

#: (what starts the phase line, which occurrence): SIGINT is sent once it is on stderr.
PHASES = [("reading", 1), ("compiling", 1), ("offline optima", 1), ("done in", 3),
          ("plot written", 1)]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """8 layers x 16 experts, top-2, 1500 tokens of random routes (synthetic: a load for the
    phases, not a finding)."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("interrupt") / "routes.jsonl"
    with open(path, "w", encoding="ascii") as handle:
        for token in range(1500):
            for layer in range(8):
                experts = rng.choice(16, size=2, replace=False).tolist()
                handle.write(json.dumps({"layer": layer, "token_idx": token,
                                         "experts": experts}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One compile cache for the module's runs: a run that gets past compiling leaves its
    programs for the later ones (the phases after compiling do not need a cold compile)."""
    return str(tmp_path_factory.mktemp("xdg"))


@pytest.mark.parametrize("run", range(RUNS))
@pytest.mark.parametrize("phase, occurrence", PHASES)
def test_sigint_after_each_phase_line_exits_130_without_an_abort(tmp_path, trace, compile_cache,
                                                                  phase, occurrence, run):
    """FAILS if a SIGINT after a phase line ends in a traceback, or in an abort at exit
    (``terminate called ...``/``FATAL: exception not rethrown``, exit -6/134: the process
    exits while a thread it interrupted a join of still runs in XLA), or leaves a partial
    plot; and if one during reading or compiling does not end the run with 130."""
    plot = tmp_path / "plot.png"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO,
           "XDG_CACHE_HOME": compile_cache}
    env.pop("PALLAS_CACHE_NO_COMPILE_CACHE", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    process = subprocess.Popen(
        [sys.executable, "-c", CONSOLE, "replay", "--trace", trace, "--cache-size", "32", "64",
         "96", "--plot", str(plot)],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, env=env)
    seen = b""
    while True:
        lines = [line for line in seen.decode(errors="replace").splitlines()
                 if line.removeprefix("pallas-cache: ").startswith(phase)]
        if len(lines) >= occurrence:
            break
        chunk = process.stderr.read1(4096)
        if not chunk:
            break
        seen += chunk
    assert len(lines) >= occurrence, seen.decode(errors="replace")
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=600)
    text = (seen + err).decode(errors="replace")
    code = process.returncode
    assert "Traceback" not in text and "terminate called" not in text and "FATAL" not in text, \
        text
    if phase in ("reading", "compiling"):
        assert code == 130, text
    assert code in (0, 130), (code, text)
    if code == 130:
        assert text.rstrip().endswith("pallas-cache: interrupted"), text
    if code == 130 and phase != "plot written":
        assert out == b"" and not plot.exists(), text
    else:  # the signal came after the last write: the run is complete
        assert b"hit_rate" in out and plot.exists()


BUSY_THREAD = r"""
import sys, threading, time
import jax, jax.numpy as jnp
from pallas_cache.sizing import cli
from pallas_cache.sizing.cli import entry

def busy():
    x = jnp.ones((1500, 1500))
    f = jax.jit(lambda x: jax.lax.fori_loop(0, 400, lambda i, y: jnp.tanh(y @ x), x))
    f(x).block_until_ready()

def interrupted_replay(args):
    threading.Thread(target=busy, daemon=True).start()
    time.sleep(1.0)  # the thread compiles or runs in XLA
    raise KeyboardInterrupt

entry.run_replay = interrupted_replay
sys.argv = ["pallas-cache", "replay", "--no-compile-cache"]
sys.exit(cli.console_main())
"""


def test_ctrl_c_while_any_thread_runs_in_xla_exits_130_not_an_abort():
    """FAILS if the console script, after Ctrl-C, leaves through the interpreter's teardown
    while a background thread of the interrupted phase is inside XLA (whichever thread: here
    one the CLI does not know about): ``terminate called ... FATAL: exception not rethrown``,
    exit 134, every time."""
    done = subprocess.run([sys.executable, "-c", BUSY_THREAD], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                         "PYTHONPATH": REPO}, timeout=300)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "pallas-cache: interrupted", done.stderr


IGNORED_IN_A_FINALIZER = r"""
import signal, sys
from pallas_cache.sizing.cli.process import InterruptLatch

class Interrupts:
    def __del__(self):  # Ctrl-C while the garbage collector runs a finalizer
        signal.raise_signal(signal.SIGINT)
        for _ in range(10000):
            pass

class Fails:
    def __del__(self):
        raise ValueError("another ignored error")

with InterruptLatch() as latch:
    Fails()
    Interrupts()
    print("fired", latch.fired, flush=True)
    try:
        latch.check()
    except KeyboardInterrupt:
        print("raised by check", flush=True)
print("hook restored", sys.unraisablehook is sys.__unraisablehook__, flush=True)
"""


def test_ctrl_c_inside_a_finalizer_is_held_by_the_latch_not_printed():
    """FAILS if a SIGINT that lands in a finalizer or a weak reference's callback (where Python
    cannot raise, and prints "Exception ignored in" with a traceback) is printed, or is lost
    (the latch must still raise it), or if the latch hides any other ignored error or leaves
    its hook installed."""
    result = subprocess.run([sys.executable, "-c", IGNORED_IN_A_FINALIZER], capture_output=True,
                            text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                            timeout=120)
    assert result.stdout.split("\n")[:3] == ["fired True", "raised by check",
                                             "hook restored True"], (result.stdout, result.stderr)
    assert "KeyboardInterrupt" not in result.stderr, result.stderr
    assert "another ignored error" in result.stderr, result.stderr
