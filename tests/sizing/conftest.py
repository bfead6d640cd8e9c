"""The sizing tests' own fixtures and helpers (the CLI's refusals): pytest finds the fixtures
here; test files import the helpers by name (``from tests.sizing.conftest import
one_line_error``). The suite's shared ones stay in tests/harness.py."""

from __future__ import annotations

import importlib

import pytest


def one_line_error(capsys, code):
    """The one line a refused ``pallas-cache`` call wrote to stderr, after checking its exit 2,
    its prefix and that no traceback came with it."""
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pallas-cache: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def no_replay(monkeypatch):
    """Make any replay fail the test: a refusal must come before the work (and before what a
    memory limit forbids it to allocate)."""
    def replay(*args, **kwargs):
        raise AssertionError("the replay ran before the refusal was reported")

    monkeypatch.setattr(importlib.import_module("pallas_cache.sizing.sweep"), "replay", replay)
