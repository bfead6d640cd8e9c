"""One round of the fused kernel's searches, compiled for sm_90a on a CPU host
(benchmarks/search_rounds.py): a streamed victim round's barriers and a first-use round's loads.
Runs wherever the ``triton`` package is installed (the ``test`` and ``compile`` extras pin it)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the round walk needs the triton package "
                                     "(pip install -e '.[compile]')")

SCRIPT = "search_rounds"

STREAMED = (61, 256, 16384, 8)  # four blocks of 4096 slots


def test_a_streamed_lru_victim_round_takes_one_cross_warp_reduction(script):
    """FAILS if a victim round of the streamed search (LRU) takes more than one reduction
    across warps or two barriers: it took two reductions and four barriers with the
    lexicographic minimum of ``(usage, slot)`` as two dependent reductions."""
    row = script.measure(STREAMED, "lru")
    assert row["victim"] is not None, row
    assert row["victim"].reductions == 1, row
    assert row["victim"].barriers <= 2, row
    assert row["first_use"] is None, row  # no ring under LRU


def test_a_first_use_round_waits_on_no_load_it_issued(script):
    """FAILS if a round of the ring's first-use loop reads a ring row it loaded itself (it
    loaded the next row and used it at once), or loads other than one row per neighbour."""
    row = script.measure(STREAMED, "route_knn")
    assert row["first_use"] is not None, row
    assert not row["first_use"].waits, row
    assert row["first_use"].loads == 3 and row["first_use"].barriers == 0, row
