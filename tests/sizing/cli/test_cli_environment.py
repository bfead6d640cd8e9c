"""The ``pallas-cache`` command in a hostile environment: an unknown JAX platform is one line
and exit 2, and an ASCII-only stream still prints every line (the legend's ``§`` in ASCII)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[3]
REPLAY = ["replay", "--synthetic", "mixtral-like", "--tokens", "4", "--cache-size", "64",
          "--model", "mixtral-8x7b", "--link-bandwidth", "25GB/s", "--cpu-bandwidth", "60GB/s",
          "-q", "--no-compile-cache"]


def _cli(args, **env):
    return subprocess.run([sys.executable, "-m", "pallas_cache.sizing.cli", *args], cwd=REPO,
                          env={**os.environ, **env}, capture_output=True, text=True,
                          encoding="utf-8", errors="replace", timeout=600)


def test_an_unknown_jax_platform_is_one_line():
    """FAILS if ``JAX_PLATFORMS=nosuchplatform pallas-cache replay`` ends in JAX's RuntimeError
    traceback (71 lines): one line naming the variable, exit 2, nothing on stdout."""
    done = _cli(REPLAY, JAX_PLATFORMS="nosuchplatform")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("pallas-cache: JAX_PLATFORMS='nosuchplatform'")
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_an_ascii_stream_prints_the_legend_in_ascii():
    """FAILS if ``PYTHONIOENCODING=ascii pallas-cache replay ...`` ends in a
    ``UnicodeEncodeError`` on the legend's ``§``: the table and its legend are printed, the
    section sign spelled out, exit 0."""
    done = _cli(REPLAY, PYTHONIOENCODING="ascii")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "docs/semantics.md sec. 11" in done.stdout
    assert done.stdout.isascii()
