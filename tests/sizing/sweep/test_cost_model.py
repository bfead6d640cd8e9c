"""The cost model of docs/semantics.md §11 on traces small enough to work out by hand.

Every expected number below is derived in the test's comments from the cache's rules, not read
back from the code: which call fetches what, which experts the CPU computes, and the seconds that
``max(fetched * W / B_link, cpu_experts * W / B_cpu)`` gives per call.
"""

import math

import numpy as np
import pytest

from pallas_cache.sizing.sweep.cost import CostModel, modeled_seconds
from pallas_cache.sizing.models import MODELS, resolve_model
from pallas_cache.sizing.sweep import ReplayConfig, auto_cache_sizes, config_grid, replay
from pallas_cache.sizing.traces import Trace
from pallas_cache.sizing.units import parse_bandwidth, parse_bytes

QUIET = dict(progress=lambda s: None)


def one_layer_trace(calls):
    """L = 1, E = 4: one call per token, so per-token numbers are per-call numbers."""
    routes = np.array(calls, dtype=np.int32)[:, None, :]
    return Trace.from_dense(routes, num_layers=1, num_experts=4)


# Five tokens of one layer, top-2 (-1 = padding):
#   call 1 [0, 1]   call 2 [2, 3]   call 3 [0, 2]   call 4 [1, 3]   call 5 [3, -1]
CALLS = [[0, 1], [2, 3], [0, 2], [1, 3], [3, -1]]


def test_modeled_time_takes_the_max_per_call_not_of_the_totals():
    """FAILS if the model adds copy and CPU time within a call (no overlap), takes the max of
    the trace's totals instead of per call, or counts CPU work per route instead of per
    distinct expert.

    Policy cap:1, order lowest_id, admission none, S = 4 (room for every expert):
      call 1: 0, 1 miss -> fetch 0 (lowest id), CPU 1          (fetched 1, cpu 1)
      call 2: 2, 3 miss -> fetch 2, CPU 3                      (1, 1)
      call 3: 0, 2 resident                                    (0, 0)
      call 4: 1, 3 miss (never admitted) -> fetch 1, CPU 3     (1, 1)
      call 5: 3 misses -> fetch 3                              (1, 0)
    W = 100 B, B_link = 1000 B/s, B_cpu = 400 B/s: (1, 1) costs max(0.1, 0.25) = 0.25 s,
    (1, 0) costs 0.1 s: 3 * 0.25 + 0.1 = 0.85 s over 5 tokens = 170 ms per token.
    (Totals: max(4 * 0.1, 3 * 0.25) = 0.75 s; no overlap: 0.4 + 0.75 = 1.15 s.)
    """
    trace = one_layer_trace(CALLS)
    cost = CostModel(expert_bytes=100, link_bandwidth=1000.0, cpu_bandwidth=400.0)
    [result] = replay(trace, [ReplayConfig(4, "cap:1", "lowest_id", "none")], cost=cost, **QUIET)
    assert sorted(result.pair_counts) == [(0, 0, 1), (1, 0, 1), (1, 1, 3)]
    assert (result.fetched, result.cpu_experts, result.tokens) == (4, 3, 5)
    assert result.modeled_ms_per_token == pytest.approx(170.0)
    assert result.fetched_bytes_per_token == pytest.approx(4 * 100 / 5)
    assert result.cpu_bytes_per_token == pytest.approx(3 * 100 / 5)
    assert result.cache_bytes == 400


def test_pure_offload_costs_only_link_time():
    """FAILS if a fully fetched call is charged CPU time, or hits are charged anything.

    Policy full, S = 4: call 1 fetches 0, 1; call 2 fetches 2, 3; calls 3-5 hit (everything is
    resident). 2 calls x 2 experts x 100 B / 1000 B/s = 0.4 s over 5 tokens = 80 ms per token.
    """
    trace = one_layer_trace(CALLS)
    cost = CostModel(expert_bytes=100, link_bandwidth=1000.0, cpu_bandwidth=400.0)
    [result] = replay(trace, [ReplayConfig(4, "full")], cost=cost, **QUIET)
    assert sorted(result.pair_counts) == [(0, 0, 3), (2, 0, 2)]
    assert result.modeled_ms_per_token == pytest.approx(80.0)
    assert result.cpu_bytes_per_token == 0.0


def test_cpu_experts_are_distinct_experts_per_call_over_a_token_of_two_layers():
    """FAILS if duplicate routes are charged twice, or if a token's time is not the sum of its
    layer-calls.

    L = 2, E = 4, cap:0 (nothing is ever fetched, every routed expert runs on the CPU):
      token 0: layer 0 [1, 1] (1 distinct), layer 1 [2, 3] (2)
      token 1: layer 0 [0, -1] (1),         layer 1 [3, 2] (2)
    6 CPU experts x 100 B = 600 B over 2 tokens = 300 B per token; at 500 B/s the calls take
    0.2 + 0.4 + 0.2 + 0.4 = 1.2 s, 600 ms per token.
    """
    routes = np.array([[[1, 1], [2, 3]], [[0, -1], [3, 2]]], dtype=np.int32)
    trace = Trace.from_dense(routes, num_layers=2, num_experts=4)
    cost = CostModel(expert_bytes=100, link_bandwidth=1000.0, cpu_bandwidth=500.0)
    [result] = replay(trace, [ReplayConfig(4, "cap:0")], cost=cost, **QUIET)
    assert result.cpu_experts == 6 and result.cpu_routes == 7
    assert result.cpu_bytes_per_token == pytest.approx(300.0)
    assert result.modeled_ms_per_token == pytest.approx(600.0)


def test_modeled_seconds_from_pairs_is_the_formula():
    """FAILS if the pair arithmetic swaps the bandwidths or drops the call counts.

    (2 fetched, 1 cpu) x 3 calls at W = 10, B_link = 20, B_cpu = 5: max(1.0, 2.0) = 2 s each,
    6 s; (1, 0) x 4 calls: 0.5 s each, 2 s. Total 8 s.
    """
    assert modeled_seconds([(2, 1, 3), (1, 0, 4)], 10, 20.0, 5.0) == pytest.approx(8.0)


def test_auto_fraction_is_link_over_link_plus_cpu():
    """FAILS if the split is inverted (cpu / (link + cpu)) or not shown to 4 digits.

    25 GB/s and 60 GB/s: 25 / 85 = 0.294117...; as a policy, fraction:0.2941."""
    cost = CostModel(link_bandwidth=25e9, cpu_bandwidth=60e9)
    assert cost.auto_fraction() == pytest.approx(25 / 85)
    assert cost.auto_policy() == "fraction:0.2941"
    with pytest.raises(ValueError, match="both"):
        CostModel(link_bandwidth=25e9).auto_fraction()


def test_the_auto_size_grid_steps_by_root_two_from_one_tokens_working_set():
    """FAILS if the grid starts below L*k (or below E), skips the whole-model size L*E, does
    not round to the nearest slot, or repeats a size.

    L = 32, E = 8, k = 2: 64, 64*1.414 = 90.5 -> 91, 128, 181.02 -> 181, then L*E = 256.
    L = 3, E = 4, k = 1: max(E, L*k) = 4, 5.66 -> 6, 8, 11.31 -> 11, then 12.
    L = 1, E = 2, k = 2: L*k = 2 = L*E: just [2].
    """
    assert auto_cache_sizes(32, 8, 2) == [64, 91, 128, 181, 256]
    assert auto_cache_sizes(3, 4, 1) == [4, 6, 8, 11, 12]
    assert auto_cache_sizes(1, 2, 2) == [2]


def test_byte_sizes_and_bandwidths_parse_with_decimal_and_binary_prefixes():
    """FAILS if GB is taken as 2**30, MiB as 10**6, bits are accepted as bytes, or a bandwidth
    without /s is accepted."""
    assert parse_bytes("336MiB") == 336 * 2**20
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("12GB") == 12 * 10**9
    assert parse_bytes("1.5KiB") == 1536
    assert parse_bytes("4096") == 4096
    assert parse_bandwidth("25GB/s") == 25e9
    assert parse_bandwidth("60 GB/s") == 60e9
    assert parse_bandwidth("12GiB/s") == 12 * 2**30
    assert parse_bandwidth("800MB/s") == 800e6
    for bad in ("25Gb/s", "25GB", "fast/s", "0GB/s", "-1GB/s"):
        with pytest.raises(ValueError, match="bandwidth"):
            parse_bandwidth(bad)
    for bad in ("12G", "12 gigs", "0B", "-3MiB"):
        with pytest.raises(ValueError, match="byte size"):
            parse_bytes(bad)


def test_expert_bytes_of_the_model_table():
    """FAILS if W uses the dense intermediate size, forgets one of the three matrices, or the
    dtype's width.

    Mixtral-8x7B bf16: 3 * 4096 * 14336 * 2 = 352,321,536 B = 336 MiB exactly.
    DeepSeek-V2-Lite bf16: 3 * 2048 * 1408 * 2 = 17,301,504 B (16.5 MiB).
    Qwen3-30B-A3B bf16: 3 * 2048 * 768 * 2 = 9,437,184 B (9 MiB); fp8 half, int4 a quarter plus
    the library's int4 bank's scales: a float32 per 128 weights of each of 3 * 768 rows of 2048,
    3 * 768 * 16 * 4 = 147,456 B.
    """
    model, dtype = resolve_model("mixtral-8x7b")
    assert dtype == "bf16" and model.expert_bytes(dtype) == 336 * 2**20
    assert MODELS["deepseek-v2-lite"].expert_bytes() == 17_301_504
    assert MODELS["deepseek-v2-lite"].moe_layers == 26 and MODELS["deepseek-v2-lite"].top_k == 6
    qwen, fp8 = resolve_model("qwen3-30b-a3b:fp8")
    assert qwen.expert_bytes(fp8) == 9 * 2**20 // 2
    assert qwen.expert_bytes("int4") == 9 * 2**20 // 4 + 147_456
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("gpt-5")
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_model("mixtral-8x7b:fp6")


def test_best_is_per_cache_size_and_the_budget_picks_the_fastest_that_fits():
    """FAILS if `best` is the global minimum instead of one per cache size, or the budget
    ignores cache_bytes (picking the bigger, faster pool) or excludes a pool that fits exactly.

    L = 2, E = 2, top-1, four tokens routing expert 0, 1, 0, 1 in both layers: flat ids
    0, 2, 1, 3, 0, 2, 1, 3. W = 100 B, B_link = 1000 B/s, B_cpu = 400 B/s.
      S = 2, full: LRU on a cycle of 4 ids over 2 slots misses every call: 8 x (1, 0) x 0.1 s
        = 0.8 s over 4 tokens = 200 ms. S = 4, full: 4 first misses, then hits: 100 ms.
      cap:0 (nothing fetched): 8 x (0, 1) x 0.25 s = 2 s, 500 ms, at either size.
    So `full` is best at each size (200 ms at S = 2 although S = 4 does 100 ms), and a 200 B
    budget (= 2 x W exactly) names S = 2's full row.
    """
    routes = np.array([[[0], [0]], [[1], [1]], [[0], [0]], [[1], [1]]], dtype=np.int32)
    trace = Trace.from_dense(routes, num_layers=2, num_experts=2)
    cost = CostModel(expert_bytes=100, link_bandwidth=1000.0, cpu_bandwidth=400.0,
                     device_budget=200)
    configs = [ReplayConfig(s, p) for s in (2, 4) for p in ("full", "cap:0")]
    results = replay(trace, configs, cost=cost, **QUIET)
    assert [r.modeled_ms_per_token for r in results] == pytest.approx([200.0, 500.0, 100.0, 500.0])
    assert [r.best for r in results] == [True, False, True, False]
    assert [r.budget_best for r in results] == [True, False, False, False]


def test_without_a_cost_model_the_cost_fields_stay_empty():
    """FAILS if a replay without W invents bytes, or without bandwidths invents milliseconds."""
    trace = one_layer_trace(CALLS)
    [plain] = replay(trace, [ReplayConfig(4, "full")], **QUIET)
    assert plain.cache_bytes is None and plain.modeled_ms_per_token is None and plain.best is None
    [sized] = replay(trace, [ReplayConfig(4, "full")], cost=CostModel(expert_bytes=8), **QUIET)
    assert sized.cache_bytes == 32 and sized.modeled_ms_per_token is None and sized.best is None
    assert math.isclose(sized.fetched_bytes_per_token, 4 * 8 / 5)
    [timed_only] = replay(trace, [ReplayConfig(4, "full")],
                          cost=CostModel(link_bandwidth=1.0, cpu_bandwidth=1.0), **QUIET)
    assert timed_only.cache_bytes is None and timed_only.modeled_ms_per_token is None


def test_pair_counts_cover_every_accepted_call_and_sum_to_the_totals():
    """FAILS if padding calls of the last chunk are counted, or a pair is dropped."""
    trace = one_layer_trace(CALLS * 7)  # 35 calls, chunks of 16: the last chunk is padded
    configs = config_grid([4, 6], ["full", "fraction:0.5", "cap:1"], ["recency", "lowest_id"])
    for r in replay(trace, configs, chunk_calls=16, **QUIET):
        assert sum(n for _, _, n in r.pair_counts) == r.calls == 35
        assert sum(f * n for f, _, n in r.pair_counts) == r.fetched
        assert sum(c * n for _, c, n in r.pair_counts) == r.cpu_experts == r.missing - r.fetched
