"""The cost model's fixed CPU term ``T_cpu`` (docs/semantics.md §11.2): 0 unless given, and
then every number is the two-bandwidth model's exactly; charged once per layer-call that has
at least one CPU expert; included in ``fraction:auto`` and the verdicts."""

import dataclasses

import numpy as np
import pytest

from pallas_cache.sizing.sweep.cost import CostModel, modeled_seconds, with_costs
from pallas_cache.sizing.sweep import ReplayResult


def two_bandwidth_seconds(pairs, w, link, cpu):
    """The model without the fixed term, written out independently."""
    total = 0.0
    for fetched, cpu_experts, calls in pairs:
        total += calls * max(fetched * w / link, cpu_experts * w / cpu)
    return total


def test_with_the_fixed_term_at_0_every_number_is_the_two_bandwidth_models_exactly():
    """FAILS if a zero fixed term changes any number in its last bit: the time (e.g. adding
    ``0.0 * ...`` terms in another order), or fraction:auto (e.g. the general balance
    ``(k*W/B_cpu + T)/(k*W/B_link + k*W/B_cpu)`` evaluated at T = 0, which rounds differently
    from ``B_link / (B_link + B_cpu)``), or the default not being 0."""
    rng = np.random.default_rng(0)
    assert CostModel().cpu_fixed_seconds == 0
    for _ in range(200):
        pairs = [tuple(int(v) for v in rng.integers(0, 9, 3)) for _ in range(6)]
        w = int(rng.integers(1, 2**30))
        link, cpu = (float(v) for v in rng.uniform(1e8, 1e11, 2))
        expected = two_bandwidth_seconds(pairs, w, link, cpu)
        assert modeled_seconds(pairs, w, link, cpu) == expected
        assert modeled_seconds(pairs, w, link, cpu, 0.0) == expected
        cost = CostModel(w, link, cpu, cpu_fixed_seconds=0.0)
        assert cost.seconds(pairs) == expected
        for k in (None, 1, 2, 8):
            assert cost.auto_fraction(k) == link / (link + cpu)


def test_the_fixed_term_is_charged_once_per_call_with_a_cpu_expert():
    """FAILS if T_cpu is charged per CPU expert, on calls with no CPU expert (a hit-only or a
    copy-only call), or outside the max (added to the copy's time too).

    W = 100 B, B_link = 1000 B/s, B_cpu = 400 B/s, T_cpu = 0.5 s:
      (fetched 1, cpu 0) x 3: max(0.1, 0)            = 0.1  -> 0.3
      (0, 2) x 2:             max(0, 2*0.25 + 0.5)   = 1.0  -> 2.0
      (2, 1) x 1:             max(0.2, 0.25 + 0.5)   = 0.75 -> 0.75
      (4, 1) x 1:             max(0.4, 0.25 + 0.5)   = 0.75 -> 0.75
      (0, 0) x 5:             0                           -> 0
    total 3.8 s. (Per expert: 2 * 0.75 + ... = 4.8; on every call: 0.5 * 3 + 2.5 + 2.0 + 1.5
    = 7.5; beside the max: 0.3 + 1.5 + 2.0 + ... .)
    """
    pairs = [(1, 0, 3), (0, 2, 2), (2, 1, 1), (4, 1, 1), (0, 0, 5)]
    assert modeled_seconds(pairs, 100, 1000.0, 400.0, 0.5) == pytest.approx(3.8)
    assert CostModel(100, 1000.0, 400.0, cpu_fixed_seconds=0.5).seconds(pairs) \
        == pytest.approx(3.8)


def row(size, pairs):
    return ReplayResult(size, "full", "recency", "promote_one", calls=sum(c for *_, c in pairs),
                        routes=0, active=0, missing=0, fetched=0, cpu_routes=0, empty_slots=0,
                        hit_rate=0.0, belady_hit_rate=None, bypass_optimum_hit_rate=None,
                        oracle_hit_rate=None, tokens=10, pair_counts=tuple(pairs))


def test_the_verdicts_include_the_fixed_term():
    """FAILS if `best` or `budget_best` ignore T_cpu.

    W = 100, B_link = 1000, B_cpu = 2000, 10 calls each: a CPU-only row (0, 1) costs 0.05 s
    per call, a copy-only row (1, 0) 0.1 s: the CPU row wins. With T_cpu = 0.1 s the CPU row
    costs 0.15 s per call and the copy row wins."""
    cpu_row = dataclasses.replace(row(4, [(0, 1, 10)]), policy="fraction:0")
    copy_row = row(4, [(1, 0, 10)])
    for fixed, winner in ((0.0, "fraction:0"), (0.1, "full")):
        out = with_costs([cpu_row, copy_row],
                         CostModel(100, 1000.0, 2000.0, 10**6, cpu_fixed_seconds=fixed))
        assert [r.policy for r in out if r.best] == [winner]
        assert [r.policy for r in out if r.budget_best] == [winner]


def test_fraction_auto_balances_a_call_of_k_misses_with_the_fixed_term():
    """FAILS if fraction:auto leaves the fixed term out, or balances per expert.

    k = 2, W = 100, B_link = 1000, B_cpu = 400, T = 0.1 s: copy 2 * 0.1 = 0.2 s, CPU
    2 * 0.25 = 0.5 s; f * 0.2 = (1 - f) * 0.5 + 0.1 -> f = 0.6 / 0.7. A large T clamps at 1."""
    cost = CostModel(100, 1000.0, 400.0, cpu_fixed_seconds=0.1)
    assert cost.auto_fraction(2) == pytest.approx(0.6 / 0.7)
    assert cost.auto_policy(2) == "fraction:0.8571"
    assert CostModel(100, 1000.0, 400.0, cpu_fixed_seconds=10.0).auto_fraction(2) == 1.0
    with pytest.raises(ValueError, match="routes per call"):
        cost.auto_fraction()


@pytest.mark.parametrize("bad", [-1e-3, float("nan"), float("inf")])
def test_a_negative_or_non_finite_fixed_term_is_refused(bad):
    """FAILS if a negative or non-finite T_cpu is accepted (it would reward CPU calls)."""
    with pytest.raises(ValueError, match="cpu_fixed_seconds"):
        CostModel(100, 1000.0, 400.0, cpu_fixed_seconds=bad)
