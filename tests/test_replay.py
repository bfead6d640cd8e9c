"""The replay engine and the CLI: exact against the reference, sharded equals unsharded."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pallas_cache.sizing import cli
from pallas_cache.sizing.sweep import ReplayConfig, config_grid, parse_policy, replay
from pallas_cache.sizing.traces import Trace
from reference import ReferenceCache, ReferencePolicy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_trace():
    rng = np.random.default_rng(3)
    tokens, layers, top_k, experts = 40, 3, 3, 6
    routes = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens * layers)])
    routes[rng.random(routes.shape) < 0.1] = -1  # some padding routes
    routes[::5, 1] = routes[::5, 0]  # calls with duplicate routes (CPU routes count each one)
    return Trace.from_dense(routes.reshape(tokens, layers, top_k), num_layers=layers,
                            num_experts=experts)


def reference_replay(trace, config):
    """The same replay, one call at a time, through the NumPy reference."""
    cache = ReferenceCache(trace.num_layers, trace.num_experts, config.cache_size)
    kind, _, value = config.policy.partition(":")
    policy = {"full": ReferencePolicy.full,
              "fraction": lambda: ReferencePolicy.fraction(float(value)),
              "cap": lambda: ReferencePolicy.fixed_cap(int(value))}[kind]()
    cpu = 0
    pairs = {}
    layers, routes = trace.to_array()
    for layer, route in zip(layers, routes):
        plan = cache.ensure_hybrid(int(layer), route, policy, order=config.order,
                                   admission=config.admission)
        cpu += int(plan.cpu.sum())
        # The cost model's per-call pair: copies made, distinct experts the CPU computes.
        pair = (int(plan.count), len(set(np.asarray(route)[np.asarray(plan.cpu)].tolist())))
        pairs[pair] = pairs.get(pair, 0) + 1
    stats = cache.stats()
    return dict(calls=stats.calls, active=stats.active, missing=stats.missing,
                fetched=stats.fetched, cpu_routes=cpu, empty_slots=int((cache.id_of_slot < 0).sum()),
                pair_counts=sorted((f, c, n) for (f, c), n in pairs.items()))


@pytest.mark.parametrize("threads", [1, 3])
def test_a_compiled_replay_counts_exactly_what_the_reference_counts(threads):
    """FAILS if configurations sharing a program leak into each other, if padding calls of the
    last chunk count, if cpu routes are counted per distinct expert instead of per route, if
    the per-call (fetched, cpu_experts) pairs of the cost model count CPU routes instead of
    distinct CPU experts, if a rule the lanes do not all share is compiled in as if they did,
    or if a part of the lanes run on another host thread is lost or mixed up with another
    (three parts: the lanes do not divide evenly, so the last part is padded)."""
    trace = small_trace()
    configs = config_grid([6, 9], ["full", "fraction:0.4", "cap:1"], ["recency", "lowest_id"],
                          ["promote_one", "reuse"])
    results = replay(trace, configs, chunk_calls=64, progress=lambda s: None, threads=threads)
    for config, result in zip(configs, results):
        expected = reference_replay(trace, config)
        got = {k: getattr(result, k) for k in expected}
        got["pair_counts"] = sorted(got["pair_counts"])
        assert got == expected, config
        assert result.routes == int((trace.routes >= 0).sum())
        assert result.hit_rate == pytest.approx(1 - expected["missing"] / expected["active"])
        assert result.hit_rate <= result.belady_hit_rate + 1e-12, "nothing beats the optimum"


def test_parse_policy_names_the_bad_policy():
    assert int(parse_policy("cap:3").cap) == 3
    with pytest.raises(ValueError, match="'fraction:x'"):
        parse_policy("fraction:x")
    with pytest.raises(ValueError, match="'sometimes'"):
        ReplayConfig(8, policy="sometimes")


SHARDED = textwrap.dedent("""
    import json, jax
    from pallas_cache.sizing.sweep import config_grid, replay
    from pallas_cache.sizing.synthetic import synthetic_trace
    assert len(jax.devices()) == 4, jax.devices()
    trace = synthetic_trace("mixtral-like", num_tokens=24)
    configs = config_grid([8, 32], ["fraction:0.25", "fraction:0.5", "cap:1"], ["recency"],
                          ["promote_one", "none"])
    sharded = replay(trace, configs, progress=lambda s: None)
    single = replay(trace, configs, devices=jax.devices()[:1], progress=lambda s: None)
    print(json.dumps([[r.as_dict() for r in sharded], [r.as_dict() for r in single]]))
""")


def test_a_replay_sharded_over_four_devices_equals_the_single_device_one():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sharded, single = json.loads(done.stdout.strip().splitlines()[-1])
    assert sharded == single
    assert len(sharded) == 12


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
