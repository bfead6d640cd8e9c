"""``pallas-cache bench-decode``: a decode at a tiny geometry whose counts equal the replay's on
the same routes, its JSON columns, the model beside it, and its refusals (one line, exit 2,
before any bank is made)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json

import numpy as np
import pytest

from pallas_cache.sizing import cli

TINY = ["bench-decode", "--small", "--d-model", "64", "--d-expert", "128", "--layers", "2",
        "--tokens", "8", "--cache-size", "8", "--repeats", "1", "--rounds", "1",
        "--time-limit", "1", "--format", "json", "-q"]
COLUMNS = {"measured_ms_per_token", "modeled_ms_per_token", "fetched_per_token",
           "cpu_experts_per_token", "tokens_per_second", "compile_seconds",
           "measured_over_modeled", "row", "cache_size", "policy", "eviction"}


@functools.lru_cache(maxsize=None)
def _tiny_run(model=None, policies=()):
    """The JSON rows of one tiny run (2 layers, 8 tokens, d_model 64, one cache size), of
    ``--model`` when given (``--small``: float32), with ``--policy`` and both evictions when
    ``policies`` are given (else the default rows)."""
    argv = TINY + (["--model", model] if model else [])
    if policies:
        argv += ["--policy", *policies, "--eviction", "lru", "route_knn"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(argv)
    assert status == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def tiny_rows():
    return _tiny_run()


def _tiny_trace():
    from pallas_cache.sizing import PRESETS, Trace, synthetic_trace

    params = dataclasses.replace(PRESETS["mixtral-realistic"], num_layers=2, num_experts=8,
                                 top_k=2, num_tokens=8)
    return Trace.from_dense(synthetic_trace(params, seed=0).to_dense(), num_experts=8)


def test_rows_have_the_columns_and_the_default_configurations(tiny_rows):
    """FAILS if a row lacks a column the JSON promises, or the default rows are not the floor,
    no cache, full with lru and route_knn, and the recommended split with lru."""
    for row in tiny_rows:
        assert COLUMNS <= set(row), COLUMNS - set(row)
        assert row["measured_ms_per_token"] > 0 and row["modeled_ms_per_token"] > 0
        assert row["tokens_per_second"] == pytest.approx(1e3 / row["measured_ms_per_token"])
        assert row["measured_over_modeled"] == pytest.approx(
            row["measured_ms_per_token"] / row["modeled_ms_per_token"])
    kinds = [(r["kind"], r["policy"].split(":")[0], r["eviction"]) for r in tiny_rows]
    assert kinds == [("resident", "full", "lru"), ("no-cache", "full", "lru"),
                     ("cache", "full", "lru"), ("cache", "full", "route_knn"),
                     ("cache", "fraction", "lru")]


@pytest.mark.parametrize("model", [None, "mixtral-8x7b:int8", "mixtral-8x7b:int4"])
def test_counts_equal_the_replays_on_the_same_routes(model):
    """FAILS if the decode's fetched or CPU experts per token differ from a replay of the same
    routes and configuration (e.g. a decode that ignores the eviction, or the split), or the
    no-cache row does not copy every distinct routed expert of every call, or the floor fetches
    anything; for int8 and int4 banks (scale leaves copied with their rows, read in place by
    the CPU partial) as for float32 ones, or if those formats are refused."""
    from pallas_cache.sizing import ReplayConfig, replay

    tiny_rows = _tiny_run(model, ("full", "fraction:0.5"))  # a fixed split: CPU experts

    trace = _tiny_trace()
    cached = [r for r in tiny_rows if r["kind"] == "cache"]
    results = replay(trace, [ReplayConfig(r["cache_size"], r["policy"], eviction=r["eviction"])
                             for r in cached], bounds=False, progress=lambda line: None)
    for row, result in zip(cached, results):
        assert row["fetched_per_token"] == pytest.approx(result.fetched_per_token), row["row"]
        assert row["cpu_experts_per_token"] == pytest.approx(result.cpu_experts_per_token)
    assert any(r["cpu_experts_per_token"] > 0 for r in cached)  # the split row has CPU experts
    dense = trace.to_dense()
    distinct = sum(len(set(call[call >= 0].tolist())) for call in dense.reshape(-1, 2))
    by_kind = {r["kind"]: r for r in tiny_rows}
    assert by_kind["no-cache"]["fetched_per_token"] == distinct / dense.shape[0]
    assert by_kind["resident"]["fetched_per_token"] == 0
    assert by_kind["resident"]["cpu_experts_per_token"] == 0


def test_gap_line_names_the_parameter_that_closes_the_gap():
    """FAILS if a row twice as slow as a copy-bound model is not put on B_link (the parameter
    that closes it with the smallest change), or a row within 15% gets a line."""
    from pallas_cache.sizing.decode import Parameters, Row, gap_line

    params = Parameters(copy_bandwidth=1e9, cpu_bandwidth=1e9, cpu_fixed_seconds=0.0,
                        gpu_layer_seconds=1e-6, gpu_expert_seconds=1e-6)
    counts = ((0, 2, 0, 10),)  # 10 calls copying 2 experts of 1 MB: 20 ms, all copies
    model = params.ms_per_token(counts, 10**6, 1)

    def row(measured):
        return Row("r", "cache", 8, "full", "lru", measured, 1e3 / measured, 20, 0, 0.0, model,
                   measured / model, "the replay's", counts)

    line = gap_line(row(2 * model), params, counts, 10**6, 1)
    assert line is not None and "B_link" in line and "x0.5" in line
    assert gap_line(row(1.1 * model), params, counts, 10**6, 1) is None


def _refusal(capsys, monkeypatch, argv):
    from pallas_cache.sizing.decode import decoder

    def no_bank(*args, **kwargs):
        raise AssertionError("a bank was made before the refusal")

    monkeypatch.setattr(decoder, "expert_fn_and_bank", no_bank)
    status = cli.main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv, words", [
    (["--model", "deepseek-v3"], "no expert function for fp8-b128"),
    (["--model", "gpt-oss-120b"], "no expert function for mxfp4"),
    (["--model", "mixtral-8x7b:fp16"], "no expert function for fp16"),
    (["--model", "mixtral-8x7b:fp8"], "no expert function for fp8"),
    (["--small", "--model", "mixtral-8x7b:int4", "--d-model", "63"], "d_model must be even"),
    (["--small", "--host-memory", "1MiB"], "fits no layer"),
    (["--small", "--bank-memory", "pinned_host"], "needs a GPU"),
    (["--small", "--cache-size", "4"], "outside [8, 32]"),
    (["--small", "--layers", "33"], "32 MoE layers"),
])
def test_refusals_are_one_line_before_any_bank(capsys, monkeypatch, argv, words):
    """FAILS if a refused command line makes a bank first, prints more than one line, or exits
    with another status than 2."""
    assert words in _refusal(capsys, monkeypatch, ["bench-decode", *argv])


def test_a_trace_with_fewer_layers_than_asked_is_refused(capsys, monkeypatch, tmp_path):
    """FAILS if --layers past the trace's layers decodes (or pads) instead of refusing."""
    path = tmp_path / "routes.npy"
    routes = np.random.default_rng(0).integers(0, 8, size=(8, 2, 2))
    routes[0, 0] = [6, 7]
    np.save(path, routes)
    err = _refusal(capsys, monkeypatch, ["bench-decode", "--small", "--trace", str(path),
                                         "--layers", "3"])
    assert "2 layers, fewer than --layers 3" in err


def _plan(argv, platform="cpu", device_memory=None):
    from pallas_cache.sizing.cli.decode import build_decode_request, plan_run
    from pallas_cache.sizing.cli.parser import build_parser

    return plan_run(build_decode_request(build_parser().parse_args(["bench-decode", *argv])),
                    platform, device_memory)


def test_the_layer_count_is_what_the_host_budget_fits():
    """FAILS if the layer count is not the most the --host-memory budget fits (on a CPU the
    floor's pool beside the bank, and one leaf while it moves: 7/3 of a layer's experts each),
    or the count is not printed."""
    layer = 8 * 3 * 64 * 128 * 4  # E experts of fp32 w1, w3, w2 [64 x 128]
    argv = ["--model", "mixtral-8x7b:fp32", "--d-model", "64", "--d-expert", "128",
            "--tokens", "4", "--host-memory", str(int(5.5 * layer * 7 / 3))]
    plan = _plan(argv)
    assert plan.geometry.num_layers == 5
    assert "L=5 of 32 MoE layers" in plan.lines[0] and "fits 5" in plan.lines[0]
    on_gpu = _plan(argv, platform="gpu", device_memory=10 * 2**30)  # the bank alone counts
    assert on_gpu.geometry.num_layers == 12 and on_gpu.floor


def test_the_floor_is_left_out_where_the_device_cannot_hold_it():
    """FAILS if the every-expert-resident row is planned on a GPU whose free memory its L*E
    slots do not fit (it would fail mid-run), or left out silently."""
    argv = ["--small", "--d-model", "64", "--d-expert", "128"]
    floor = 32 * 3 * 64 * 128 * 4
    assert _plan(argv, "gpu", floor).floor
    plan = _plan(argv, "gpu", floor - 1)
    assert not plan.floor and any("floor row is left out" in line for line in plan.lines)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "int4"])
def test_the_bank_is_the_experts_format_random_per_expert_in_host_memory(dtype):
    """FAILS if the bank is not in the host memory kind the backend offers (pinned_host), is not
    a bank of ``dtype`` in pallas_cache.experts' layout (``[L, E, F, H]`` rows, bf16 bits,
    int8/int4 codes with their scale leaves), if the model's W differs from the bytes stored per
    expert, if two experts or two layers hold the same weights, or if their scale is not
    1/sqrt(fan_in)."""
    from pallas_cache import experts
    from pallas_cache.moe import host_memory_kind
    from pallas_cache.sizing.decode.bank import Geometry, expert_fn_and_bank

    geometry = Geometry(2, 4, 2, 64, 32, dtype)
    expert_fn, bank = expert_fn_and_bank(geometry)
    assert expert_fn is experts.swiglu
    assert experts.bank_format(bank, lead=2) == dtype
    for leaf in bank.values():
        assert leaf.sharding.memory_kind == host_memory_kind()
    assert sum(leaf.nbytes for leaf in bank.values()) == 8 * geometry.expert_bytes
    weights = experts.dequantize({n: np.asarray(v) for n, v in bank.items()})
    assert {n: v.shape for n, v in weights.items()} == {n: (2, 4, 32, 64) for n in weights}
    w1 = np.asarray(weights["w1"])
    assert len({row.tobytes() for row in w1.reshape(8, -1)}) == 8
    assert np.std(w1) == pytest.approx(1 / np.sqrt(64), rel=0.05)
    assert np.std(np.asarray(weights["w2"])) == pytest.approx(1 / np.sqrt(32), rel=0.05)
    assert not np.array_equal(w1, np.asarray(weights["w3"]))


def test_the_pool_is_the_experts_pool_of_the_bank():
    """FAILS if a row's pool is not ``experts.pool_like`` of the bank (an int4 pool without its
    scale leaves, or of other shapes or dtypes, could not take apply_copy_plan's rows)."""
    from pallas_cache import experts
    from pallas_cache.sizing.decode.bank import Geometry
    from pallas_cache.sizing.decode.decoder import Decoder

    geometry = Geometry(1, 8, 2, 64, 32, "int4")
    decoder = Decoder(geometry, np.zeros((2, 1, 2), np.int32), 0, lambda line: None)
    pool = decoder.pool(3)
    want = experts.pool_like(decoder.bank, 3, layer_axis=True)
    assert {n: (v.shape, v.dtype) for n, v in pool.items()} == {
        n: (v.shape, v.dtype) for n, v in want.items()}
    assert experts.bank_format(pool, lead=1) == "int4"
