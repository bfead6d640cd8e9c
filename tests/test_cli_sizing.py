"""``pallas-cache replay``'s sizing flags in-process: the legend's route_knn line from the
sweep's own programs (one replay, nothing beside it), and how the sizing flags fail before the
trace is read (one line, exit 2)."""

from __future__ import annotations

import importlib
import json

import pytest

from pallas_cache.sizing import cli

sweep_mod = importlib.import_module("pallas_cache.sizing.sweep")  # the module of replay()

KNN_SWEEP = ["--synthetic", "mixtral-realistic", "--tokens", "24", "--cache-size", "64", "96",
             "128", "--policy", "full", "fraction:0.4", "-q"]


def run(capsys, *argv):
    code = cli.main(["replay", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def knn_lines(out):
    return [line for line in out.splitlines() if line.startswith("route_knn (")]


@pytest.fixture
def replays(monkeypatch):
    """Every call of the sweep's ``replay``, as the list of its configurations' evictions and
    sizes (the call itself runs)."""
    calls = []
    real = sweep_mod.replay

    def spy(trace, configs, **kwargs):
        calls.append([(c.eviction, c.cache_size, c.policy) for c in configs])
        return real(trace, configs, **kwargs)

    monkeypatch.setattr(sweep_mod, "replay", spy)
    return calls


def test_the_route_knn_legend_comes_from_the_sweeps_own_replay(capsys, replays, monkeypatch):
    """FAILS if the legend's route_knn line is computed by anything but the sweep's one replay
    (a second engine beside it: a replay of the library's step outside ``replay``), or if the
    sweep's route_knn lanes are not the line's series (policy full, every size)."""
    import pallas_cache.ops as ops

    outside = []
    real_step = ops.ensure_with_rules

    def step(*args, **kwargs):  # the sweep's program holds its own reference: not this one
        outside.append(1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(ops, "ensure_with_rules", step)
    code, out, err = run(capsys, *KNN_SWEEP)
    assert code == 0, err
    [line] = knn_lines(out)
    assert len(replays) == 1
    knn = [(size, policy) for eviction, size, policy in replays[0] if eviction == "route_knn"]
    assert knn == [(64, "full"), (96, "full"), (128, "full")]
    assert outside == []


def test_no_route_knn_legend_turns_the_line_and_its_lanes_off(capsys, replays):
    """FAILS if --no-route-knn-legend still replays route_knn lanes or prints the line, or
    changes anything else of the table."""
    code, with_line, _ = run(capsys, *KNN_SWEEP)
    assert code == 0
    code, without, _ = run(capsys, *KNN_SWEEP, "--no-route-knn-legend")
    assert code == 0
    assert knn_lines(without) == [] and len(knn_lines(with_line)) == 1
    assert [line for line in with_line.splitlines() if not line.startswith("route_knn (")] \
        == without.splitlines()
    assert [e for e, _, _ in replays[1]] == ["lru"] * 6


def test_the_route_knn_lanes_are_counted_in_the_replays_progress(capsys):
    """FAILS if the legend's route_knn replay runs outside the replay's reported phases (its
    lanes not among the configurations the compile line counts)."""
    argv = [a for a in KNN_SWEEP if a != "-q"]
    code, _, err = run(capsys, *argv)
    assert code == 0
    assert "compiling 2 programs for 9 configurations" in err
    code, _, err = run(capsys, *argv, "--format", "json")
    assert code == 0
    assert "compiling 1 program for 6 configurations" in err
