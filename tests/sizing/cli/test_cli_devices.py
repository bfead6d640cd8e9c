"""``pallas-cache replay --devices D --parallel expert|tensor`` (docs/replay.md, "Several
devices"): the tensor-parallel rows are a one-device replay of T times the bytes, the
expert-parallel rows are replays of each device's routes, and a wrong flag or combination exits
2 with one line before the trace is read."""

from __future__ import annotations

import importlib
import json
import re

import numpy as np
import pytest

from pallas_cache.sizing import ReplayConfig, cli, replay, synthetic
from pallas_cache.sizing.devices import tensor_parallel_seconds
from pallas_cache.sizing.models import resolve_model
from pallas_cache.sizing.traces import Trace

replay_mod = importlib.import_module("pallas_cache.sizing.sweep")
TRACE = ["--synthetic", "mixtral-like", "--tokens", "6", "--seed", "3"]
RATES = ["--link-bandwidth", "25GB/s", "--cpu-bandwidth", "60GB/s", "--policy", "full",
         "fraction:0.4"]
COUNTS = ("cache_size", "policy", "calls", "active", "missing", "fetched", "cpu_experts",
          "hit_rate", "pair_counts")


def _json(capsys, argv):
    assert cli.main(["replay", *argv, "-q", "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_tensor_parallel_rows_are_the_one_device_replay_of_t_times_the_bytes(capsys):
    """FAILS if a per-device size B is turned into B / W slots (not B * T / W), or if the
    modeled time charges a fetch W (not W / T per device, in parallel) or a CPU expert W / T."""
    W = resolve_model("mixtral-8x7b")[0].expert_bytes("bf16")
    tensor = _json(capsys, [*TRACE, "--model", "mixtral-8x7b", "--cache-size", "10GiB",
                            "20GiB", "--devices", "2", "--parallel", "tensor", *RATES])
    single = _json(capsys, [*TRACE, "--model", "mixtral-8x7b", "--cache-size", "20GiB",
                            "40GiB", *RATES])
    assert [r["cache_size"] for r in tensor] == [r["cache_size"] for r in single] != []
    for t, s in zip(tensor, single):
        assert {k: t[k] for k in COUNTS} == {k: s[k] for k in COUNTS}
        assert t["cache_bytes"] == t["cache_size"] * W // 2  # per device
        assert t["cpu_bytes_per_token"] == pytest.approx(s["cpu_bytes_per_token"])
        pairs = [tuple(p) for p in t["pair_counts"]]
        assert t["modeled_ms_per_token"] == pytest.approx(
            1e3 * tensor_parallel_seconds(pairs, W, 2, 25e9, 60e9) / t["tokens"])
    assert any(r["cpu_experts"] for r in tensor) and any(r["fetched"] for r in tensor)


def test_expert_parallel_rows_are_replays_of_each_devices_routes_then_the_busiest(capsys):
    """FAILS if a device's rows are not a one-device replay of its routes (derived here from
    the default share: contiguous blocks), or the busiest row is not the slowest device's."""
    D = 4
    rows = _json(capsys, [*TRACE, "--expert-bytes", "1MiB", "--cache-size", "2", "6",
                          "--devices", str(D),
                          "--parallel", "expert", *RATES])
    trace = synthetic.synthetic_trace("mixtral-like", num_tokens=6, seed=3)
    E = trace.num_experts
    share = E // D  # mixtral-like: 8 experts, 2 per device
    per_config = len(rows) // (D + 1)
    configs = [ReplayConfig(r["cache_size"], r["policy"]) for r in rows[:per_config]]
    for d in range(D):
        mine = (trace.routes >= d * share) & (trace.routes < (d + 1) * share)
        routes = np.where(mine, trace.routes - d * share, -1)
        device_trace = Trace(routes=routes, layers=trace.layers, num_layers=trace.num_layers,
                             num_experts=share, token_idx=trace.token_idx)
        expected = replay(device_trace, configs, progress=lambda _: None)
        got = rows[d * per_config:(d + 1) * per_config]
        for g, e in zip(got, expected):
            assert [g[k] for k in COUNTS[:-1]] == [getattr(e, k) for k in COUNTS[:-1]], d
    for i, busiest in enumerate(rows[D * per_config:]):
        candidates = [rows[d * per_config + i] for d in range(D)]
        slowest = max(c["modeled_ms_per_token"] for c in candidates)
        assert busiest["modeled_ms_per_token"] == slowest
        assert busiest["note"].startswith("busiest: device ")


@pytest.mark.parametrize("argv, message", [
    (["--devices", "2"], "--devices and --parallel go together"),
    (["--parallel", "tensor"], "--devices and --parallel go together"),
    (["--devices", "0", "--parallel", "expert"], "--devices must be at least 1, got 0"),
    (["--devices", "two", "--parallel", "expert"], "--devices: 'two' is not an integer"),
    (["--devices", "2", "--parallel", "pipeline"], "--parallel: invalid choice: 'pipeline'"),
    (["--devices", "3", "--parallel", "tensor", "--expert-bytes", "1000"],
     "an expert of 1000 bytes does not split into 3 equal slices"),
    (["--devices", "2", "--parallel", "tensor", "--plot", "out.png"],
     "--plot .* does not combine with --devices"),
    (["--devices", "2", "--parallel", "expert", "--route-knn-legend"],
     "--route-knn-legend is a line of the one-device table's legend; --parallel expert"),
    (["--devices", "12", "--parallel", "expert", "--num-experts", "8"],
     "--devices 12 --parallel expert: more devices than the 8 experts per layer"),
    (["--devices", "2147483648", "--parallel", "tensor"], "--devices 2147483648 is above"),
])
def test_a_wrong_device_flag_fails_with_one_line_before_the_trace_is_read(
        capsys, monkeypatch, tmp_path, no_replay, argv, message):
    """FAILS if a device flag is checked only after reading the trace (the trace here does not
    exist) or fails with more than one line."""
    monkeypatch.chdir(tmp_path)
    code = cli.main(["replay", "--trace", str(tmp_path / "missing.jsonl"), *argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("pallas-cache: ") and "missing.jsonl" not in lines[0], err
    assert re.search(message, lines[0]), lines[0]


def _e8_trace(path, tokens=12):
    """2 layers, top-2, routing only experts 0..7."""
    with open(path, "w", encoding="ascii") as handle:
        for token in range(tokens):
            for layer in range(2):
                handle.write(json.dumps({"layer": layer, "token_idx": token, "experts": [
                    (token + layer) % 8, (3 * token + 1) % 8]}) + "\n")
    return str(path)


@pytest.mark.parametrize("argv", [["--synthetic", "mixtral-like", "--tokens", "4"],
                                  ["--trace", "TRACE"]])
def test_more_devices_than_experts_is_refused_before_the_device_work(
        capsys, monkeypatch, tmp_path, argv):
    """FAILS if ``--devices 12 --parallel expert`` on 8 experts replays every device (13 s;
    ``--devices 100000`` a silent minute, growing with D) and then exits 2 with "(device 8 of
    12): no non-padding route": one line naming --devices, before any device's trace is made."""
    from pallas_cache.sizing import devices

    def no_work(*args, **kwargs):
        raise AssertionError("the per-device work started before the refusal")

    monkeypatch.setattr(devices, "device_traces", no_work)
    monkeypatch.setattr(replay_mod, "replay", no_work)
    argv = [_e8_trace(tmp_path / "e8.jsonl") if a == "TRACE" else a for a in argv]
    for count in ("12", "100000"):
        code = cli.main(["replay", *argv, "--devices", count, "--parallel", "expert", "-q"])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"pallas-cache: --devices {count} --parallel expert: more devices "
                              f"than the 8 experts per layer"), err


def test_a_device_whose_experts_the_trace_never_routes_gets_its_rows(capsys, tmp_path):
    """FAILS if device 1 of ``--devices 2 --num-experts 16`` on a trace that routes only
    experts 0..7 ends the replay with exit 2 ("no non-padding route, no oracle to compute"),
    while the one-device replay of the same trace runs: its rows say it had nothing to do
    (no active expert, hit rate 1, no oracle), device 0's are the trace's."""
    trace = _e8_trace(tmp_path / "e8.jsonl")
    rows = _json(capsys, ["--trace", trace, "--num-experts", "16", "--cache-size", "8",
                          "--policy", "full", "--devices", "2", "--parallel", "expert"])
    device0, device1, busiest = rows
    assert device1["source"].endswith("(device 1 of 2)")
    assert (device1["active"], device1["hit_rate"], device1["oracle_hit_rate"]) == (0, 1.0, None)
    assert device0["active"] > 0 and busiest["note"] == "busiest: device 0"
    single = _json(capsys, ["--trace", trace, "--num-experts", "16", "--cache-size", "16",
                            "--policy", "full"])
    assert single[0]["active"] == device0["active"]


@pytest.mark.parametrize("devices", [[], ["--devices", "2", "--parallel", "expert"],
                                     ["--devices", "2", "--parallel", "tensor"]])
def test_warnings_are_the_same_with_and_without_devices(capsys, tmp_path, devices):
    """FAILS if the expert-parallel replay drops the trace/model mismatch warning (and the
    clamped-fraction one) that the one-device run prints."""
    trace = _e8_trace(tmp_path / "e8.jsonl")
    assert cli.main(["replay", "--trace", trace, "--model", "deepseek-v3", "--cache-size", "8",
                     "--policy", "fraction:1.5", *devices, "-q", "--format", "json"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("pallas-cache: warning: fraction:1.5 means fetch fraction 1")
    assert lines[1].startswith("pallas-cache: warning: the trace has 2 layers x 8 experts, "
                               "top-2, but deepseek-v3 has 58 MoE layers")


def test_the_device_budget_applies_per_device_under_expert_parallel(capsys):
    """FAILS if ``--device-budget`` has no effect with ``--parallel expert`` (every row the
    all-resident size, no budget line, ``budget_best`` false everywhere), though cache sizes
    and the budget are per device: its exact-fit size joins each device's grid, each table
    names its pick, and the busiest rows get their own pick."""
    W = resolve_model("mixtral-8x7b")[0].expert_bytes(None)
    flags = [*TRACE, "--model", "mixtral-8x7b", "--device-budget", "12GiB", "--devices", "2",
             "--parallel", "expert", "--link-bandwidth", "25GB/s", "--cpu-bandwidth", "60GB/s",
             "--policy", "full", "fraction:0.4"]
    rows = _json(capsys, flags)
    fit = 12 * 2**30 // W
    per_device = len(rows) // 3
    for part in range(3):
        mine = rows[part * per_device:(part + 1) * per_device]
        assert fit in [r["cache_size"] for r in mine]
        picked = [r for r in mine if r["budget_best"]]
        assert picked and all(r["cache_bytes"] <= 12 * 2**30 for r in picked), part
        assert min(r["modeled_ms_per_token"] for r in mine if r["cache_bytes"] <= 12 * 2**30) \
            == picked[0]["modeled_ms_per_token"]
    assert cli.main(["replay", *flags, "-q"]) == 0
    out = capsys.readouterr().out
    assert out.count(f"size: --device-budget 12.0GiB fits {fit} slots") == 2
    assert out.count("Best within 12.0GiB: cache_size=") >= 3, out
