"""``benchmarks/hybrid_decode.py`` on a loaded machine: a bandwidth slope swamped by
the load takes more batches by itself, up to a time limit, and reports its spread; it never stops
the benchmark."""

from __future__ import annotations

import pytest

SCRIPT = "hybrid_decode"


def test_a_swamped_slope_takes_more_batches_and_reports_its_spread(script):
    """FAILS if one batch whose 2 experts took no longer than 0 stops the benchmark ("the
    machine is too loaded, rerun with more --rounds"): the first two batches here are swamped,
    the next ones are not, and the rate comes from the medians over all of them, with the
    per-batch range."""
    batches = iter([(5.0, 4.0, 3.0), (5.0, 4.5, 4.0), (1.0, 2.0, 3.0), (1.0, 2.0, 3.0),
                    (1.0, 1.5, 2.0)])
    current = {}

    def seconds(n, rounds):
        if n == 0:
            current["batch"] = next(batches)
        return current["batch"][n]

    rate, line = script.slope_rate("cpu_partial", 100, seconds, 3, time_limit=60)
    # medians over 4 batches: t0 = t2 = 3.0, not yet; over 5: t0 = 1.0, t2 = 3.0, 1 s/expert
    assert rate == pytest.approx(100.0)
    assert "5 batches of 3 rounds" in line and "per-batch" in line


def test_a_slope_that_never_comes_returns_none_at_the_time_limit(script):
    """FAILS if a slope that the load swamps in every batch loops forever or exits: at the time
    limit the measurement returns None and says why (the caller then uses bench-bandwidth's
    figure)."""
    rate, line = script.slope_rate("the copy path", 100, lambda n, rounds: 1.0, 3,
                                          time_limit=0.05)
    assert rate is None
    assert "no batch had a positive slope" in line
