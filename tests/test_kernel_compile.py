"""The fused kernel compiled for Hopper on a CPU host (benchmarks/kernel_compile.py): the Triton
IR Pallas emits is compiled for sm_90a by the ``triton`` package (the ``test`` and ``compile``
extras pin it) and assembled by its ptxas. Runs wherever ``triton`` is installed; a Triton IR
that fails to parse or assemble fails here, it does not skip. The full matrix (every
``ensure_hybrid`` variant, more geometries) is the benchmark's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the compile check needs the triton package "
                                     "(pip install -e '.[compile]')")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kernel_compile  # noqa: E402

CASES = [(geometry, eviction, variant) for geometry in kernel_compile.TEST_GEOMETRIES
         for eviction in kernel_compile.EVICTIONS
         for variant in kernel_compile.variants(eviction, ci=True)]


@pytest.mark.parametrize("geometry,eviction,variant", CASES,
                         ids=[f"{'-'.join(map(str, g))}-{e}-{v}" for g, e, v in CASES])
def test_the_kernel_compiles_for_sm90a_without_a_spill(geometry, eviction, variant):
    """FAILS if the kernel's Triton IR does not parse or compile for sm_90a, or ptxas spills a
    register (a spill is local memory traffic on every victim round) at the geometries
    (L, E, S, k) = (8, 16, 64, 8), (48, 128, 4096, 8) and (64, 512, 16384, 8)."""
    row = kernel_compile.measure(geometry, eviction, variant)
    assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
    assert row["stack"] == 0, row
    assert row["registers"] > 0 and row["sass"] > 0, row  # the ptxas and SASS parsing ran
    assert row["walk_instructions"] > 0 and row["walk_barriers"] > 0, row  # the no-miss walk


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
