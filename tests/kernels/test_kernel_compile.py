"""The fused kernel compiled for Hopper on a CPU host (benchmarks/kernel_compile.py): the Triton
IR Pallas emits is compiled for sm_90a by the ``triton`` package (the ``test`` and ``compile``
extras pin it) and assembled by its ptxas, and a call with no miss walked through its SASS
(benchmarks/sass_walk.py). Runs wherever ``triton`` is installed; a Triton IR that fails to parse
or assemble fails here, it does not skip. Each kernel is lowered and compiled once per session
(``kernel_compile.measure`` keeps its rows); a kernel an earlier run compiled with the same
``triton`` is read from that package's cache, even where only its source lines moved."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the compile check needs the triton package "
                                     "(pip install -e '.[compile]')")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kernel_compile  # noqa: E402

# Every variant (``ensure`` and each ``ensure_hybrid`` order and admission) when
# PALLAS_CACHE_COMPILE_ALL=1 (198 kernels: about 25 minutes on 2 cores); by default ``ensure`` and
# the ``ensure_hybrid`` with the most live values per eviction (72 kernels).
ALL_VARIANTS = os.environ.get("PALLAS_CACHE_COMPILE_ALL") == "1"
CASES = [(geometry, eviction, variant) for geometry in kernel_compile.TEST_GEOMETRIES
         for eviction in kernel_compile.EVICTIONS
         for variant in kernel_compile.variants(eviction, ci=not ALL_VARIANTS)]
# Known spills, each a strict xfail: (geometry, eviction, variant) -> the reason; the case fails
# the run once it stops spilling (drop it here) (benchmarks/RESULTS.md, "Spills of the combined
# kernel" and "The kernel's operands").
KNOWN_SPILLS: dict[tuple, str] = {}


def _case(geometry, eviction, variant):
    known = KNOWN_SPILLS.get((geometry, eviction, variant))
    marks = [pytest.mark.xfail(strict=True, reason=known)] if known else []
    return pytest.param(geometry, eviction, variant, marks=marks,
                        id=f"{'-'.join(map(str, geometry))}-{eviction}-{variant}")


@pytest.mark.parametrize("geometry,eviction,variant", [_case(*c) for c in CASES])
def test_the_kernel_compiles_for_sm90a_without_a_spill(geometry, eviction, variant):
    """FAILS if the kernel's Triton IR does not parse or compile for sm_90a, or ptxas spills a
    register (local memory traffic, on every call when outside a loop) at any of the geometries
    (L, E, S, k) of ``kernel_compile.TEST_GEOMETRIES``, from one warp to eight."""
    row = kernel_compile.measure(geometry, eviction, variant)
    assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
    assert row["stack"] == 0, row
    assert row["registers"] > 0 and row["sass"] > 0, row  # the ptxas and SASS parsing ran
    assert row["walk_instructions"] > 0 and row["walk_barriers"] > 0, row  # the no-miss walk


# The no-miss path's budget (benchmarks/sass_walk.py): at one warp no barrier but the memory
# ordering's (docs/design.md, "Memory ordering": 3, and 2 more for the token ring), none changing
# layout or reducing through shared memory; at 8 warps (61, 256, 16384, 8) LRU within 12 barriers
# and 4 dependent global round trips, the ring evictions within 30 barriers.
ORDERING_BARRIERS = {"lru": 3, "pair_lfu": 3, "route_knn": 5, "route_lfu": 5}
LARGE = (61, 256, 16384, 8)
BUDGET = {"lru": (12, 4), "pair_lfu": (12, None), "route_knn": (30, None),
          "route_lfu": (30, None)}


ONE_WARP = [g for g in kernel_compile.WALK_GEOMETRIES if g[2] <= 256]


@pytest.mark.parametrize("eviction", kernel_compile.EVICTIONS)
@pytest.mark.parametrize("geometry", ONE_WARP, ids=["-".join(map(str, g)) for g in ONE_WARP])
def test_one_warp_takes_only_the_ordering_barriers(geometry, eviction):
    """FAILS if a call with no miss at one warp executes a barrier beyond the memory ordering's
    or exchanges values through shared memory."""
    row = kernel_compile.measure(geometry, eviction, "ensure")
    assert row["num_warps"] == 1, row
    assert row["walk_barriers"] == ORDERING_BARRIERS[eviction], row
    assert row["walk_reductions"] == 0, row


@pytest.mark.parametrize("eviction", kernel_compile.EVICTIONS)
def test_the_no_miss_path_at_eight_warps_is_within_budget(eviction):
    """FAILS if a call with no miss at (61, 256, 16384, 8) executes more barriers (or, under
    LRU, waits on more dependent global round trips) than its budget: a reduction over the
    layer's experts or a [routes, routes] comparison on that path costs two barriers, a load
    issued after a wait one round trip."""
    barriers, round_trips = BUDGET[eviction]
    for variant in kernel_compile.variants(eviction, ci=True):
        row = kernel_compile.measure(LARGE, eviction, variant)
        assert row["walk_barriers"] <= barriers, row
        if round_trips is not None:
            assert row["walk_round_trips"] <= round_trips, row


def test_the_reduction_counter_finds_the_loops():
    """FAILS if the TTIR reduction counter misses a loop body's reductions (it would report a
    loop free of reductions): a hand-written module with one reduction in a loop traced in
    ``victim_round`` and one outside every loop."""
    ttir = "\n".join([
        'module {',
        '  tt.func public @k() {',
        '    %0:2 = scf.while (%a = %c) : (i32) -> (i32) {',
        '      scf.condition(%t) %a : i32 loc(#loc3)',
        '    } do {',
        '      %1 = "tt.reduce"(%x) <{axis = 0 : i32}> ({',
        '        tt.reduce.return %y : i32 loc(#loc3)',
        '      }) : (tensor<16xi32>) -> i32 loc(#loc3)',
        '      scf.yield %1 : i32 loc(#loc3)',
        '    } loc(#loc4)',
        '    %2 = "tt.reduce"(%x) <{axis = 0 : i32}> ({',
        '      tt.reduce.return %y : i32 loc(#loc1)',
        '    }) : (tensor<16xi32>) -> i32 loc(#loc1)',
        '    tt.return loc(#loc)',
        '  } loc(#loc)',
        '} loc(#loc)',
        '#loc = loc(unknown)',
        '#loc1 = loc("/x/step.py":1:1 to :2)',
        '#loc2 = loc("step_kernel.<locals>.victim_round"(#loc1))',
        '#loc3 = loc("reduce_min:"(#loc2))',
        '#loc4 = loc("while:"(#loc1))',
    ])
    assert kernel_compile.reductions(ttir) == {"all": 2, "victim": 1, "order": 0,
                                              "first_uses": 0, "neighbours": 0}
