"""The SASS walk of the no-miss path (benchmarks/sass_walk.py) on a hand-written listing: every
walk rule, and each count, on a program small enough to count by hand. Needs no compiler."""

from __future__ import annotations

import pytest

SCRIPT = "sass_walk"

# cuobjdump's layout: address comment, optional guard, opcode and operands, encoding comment.
PROGRAM = [
    "LDG.E R2, desc[UR4][R4.64]",  # 0x000 A: round trip 1
    "LDG.E R3, desc[UR4][R6.64]",  # 0x010 B: round trip 1 (no wait between A and B)
    "IADD3 R8, R2, 0x1, RZ",  # 0x020 waits for A
    "LDG.E.64 R10, desc[UR4][R8.64]",  # 0x030 C: round trip 2 (fills R10 and R11)
    "@P0 BRA 0x80",  # 0x040 forward, skips no loop: falls through
    "STS [R1], R3",  # 0x050 waits for B; the partials to shared memory
    "BAR.SYNC.DEFER_BLOCKING 0x0",  # 0x060 barrier 1
    "LDS R12, [R1]",  # 0x070 the partials back: one cross-warp reduction
    "@!P1 BRA 0xc0",  # 0x080 forward over the loop 0x90-0xb0: taken
    "IADD3 R13, R13, 0x1, RZ",  # 0x090 (never walked)
    "ISETP.GE.AND P2, PT, R13, 0x4, PT",  # 0x0a0 (never walked)
    "@!P2 BRA 0x90",  # 0x0b0 the inner loop's latch (never walked)
    "BAR.SYNC.DEFER_BLOCKING 0x0",  # 0x0c0 a barrier per block
    "@P3 BRA 0x80",  # 0x0d0 the latch of a loop holding a loop: ceil(S / STREAM_BLOCK) blocks
    "BRA.DIV UR6, 0x140",  # 0x0e0 the divergent slow path (over a loop): falls through
    "IADD3 R14, R11, R12, RZ",  # 0x0f0 waits for C (through R11, the pair's high half)
    "LDG.E R15, desc[UR4][R14.64]",  # 0x100 D: round trip 3
    "@P5 BRA 0xf0",  # 0x110 the latch of a loop with no inner loop: falls through
    "STG.E desc[UR4][R4.64], R15",  # 0x120 waits for D
    "EXIT",  # 0x130
    "IADD3 R16, R16, 0x1, RZ",  # 0x140 the slow path (never walked)
    "@P6 BRA 0x140",  # 0x150
    "BRA 0xf0",  # 0x160
    "BRA 0x170",  # 0x170 the trap after the code
]


def listing(program=PROGRAM) -> str:
    lines = ["        Function : kernel", "        .headerflags    @\"EF_CUDA_SM90\""]
    for n, text in enumerate(program):
        guard, _, rest = text.partition(" ") if text.startswith("@") else ("", "", text)
        body = f"{guard:>6} {rest} ;" if guard else f"       {rest} ;"
        lines.append(f"        /*{16 * n:04x}*/  {body:<60} /* 0x000000040e027981 */")
        lines.append("                                                   /* 0x000fe8000c1e1900 */")
    return "\n".join(lines)


def walked(script, slots):
    return script.walk(script.parse(listing()), slots=slots)


def test_parse_reads_guards_opcodes_and_targets(script):
    """FAILS if the listing's guard, opcode or branch target is misread."""
    code = script.parse(listing())
    assert len(code) == len(PROGRAM)
    assert (code[4].guard, code[4].opcode, code[4].target) == ("@P0", "BRA", 0x80)
    assert code[3].destination() == {10, 11}
    assert code[14].conditional and not code[22].conditional
    assert script.loops(code) == [(0x90, 0xb0), (0x80, 0xd0), (0xf0, 0x110),
                                     (0x140, 0x150), (0xf0, 0x160), (0x170, 0x170)]


@pytest.mark.parametrize("blocks", [1, 3])
def test_the_walk_follows_its_rules(script, blocks):
    """FAILS if a rule is broken: the branch over the inner loop not taken, the other forward
    branches (BRA.DIV included) taken, the outer latch repeated other than once per further
    pool block, the plain latch taken, the walk running past EXIT."""
    w = walked(script, slots=blocks * script.STREAM_BLOCK)
    head = [0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70]
    block = [0x80, 0xc0, 0xd0]
    tail = [0xe0, 0xf0, 0x100, 0x110, 0x120, 0x130]
    assert w.path == head + block * blocks + tail
    assert w.instructions == len(head) + 3 * blocks + len(tail)
    assert w.barriers == 1 + blocks


def test_the_walk_counts_round_trips_and_reductions(script):
    """FAILS if a load issued after a wait is not a new round trip, two loads with no wait
    between them are two, a register pair's high half is not waited for, or the shared-memory
    exchange across a barrier is not one cross-warp reduction (and a plain barrier is)."""
    w = walked(script, slots=2 * script.STREAM_BLOCK)
    assert (w.round_trips, w.global_loads, w.reductions) == (3, 4, 1)


def test_a_partial_pool_block_is_a_block(script):
    """FAILS if the block count is not ``ceil(S / STREAM_BLOCK)``."""
    assert walked(script, slots=script.STREAM_BLOCK + 1).barriers == 3
    assert walked(script, slots=1).barriers == 2


def test_the_walk_refuses_a_program_it_cannot_end(script):
    """FAILS if a walk that runs off the code, or past its step limit, returns a count."""
    with pytest.raises(ValueError, match="no EXIT"):
        script.walk(script.parse(listing(["NOP", "BRA 0x0"])), slots=1)
    with pytest.raises(RuntimeError, match="did not end"):
        script.walk(script.parse(listing()), slots=1, max_steps=10)


def test_stream_block_is_the_kernels_block(script):
    """FAILS if the walk's block differs from the kernel's streamed-search block."""
    from pallas_cache.kernels import common

    assert script.STREAM_BLOCK == common.default_block(10**6, interpret=False)


def test_a_pair_operand_and_a_barrier_without_an_exchange(script):
    """FAILS if an address pair's high half is not waited for, or a barrier with no shared store
    before it counts as a reduction (and the last exchange, no barrier after it, does not)."""
    w = script.walk(script.parse(listing([
        "LDG.E R21, desc[UR4][R4.64]",
        "LDG.E R30, desc[UR4][R20.64]",  # R20:R21, the high half still loading
        "LDS R1, [R2]",
        "BAR.SYNC.DEFER_BLOCKING 0x0",
        "LDS R3, [R2]",
        "BAR.SYNC.DEFER_BLOCKING 0x0",
        "STS [R2], R1",
        "BAR.SYNC.DEFER_BLOCKING 0x0",
        "LDS R4, [R2]",
        "EXIT",
    ])), slots=1)
    assert (w.round_trips, w.barriers, w.reductions) == (2, 3, 1)


def test_an_address_pair_is_two_registers_and_wide_data_four(script):
    """FAILS if a wide access's address pair is read as wide as its data (a false wait), or
    a wide store's data registers past the first are not waited for."""
    w = script.walk(script.parse(listing([
        "LDG.E R12, desc[UR4][R2.64]",  # round trip 1, into R12
        "LDG.E.128 R20, desc[UR4][R10.64]",  # reads R10, R11 only: still round trip 1
        "LDG.E R14, desc[UR4][R4.64]",  # round trip 1, into R14
        "STG.E.128 desc[UR4][R6.64], R16",  # writes R16 to R19: no wait
        "LDG.E R30, desc[UR4][R8.64]",  # round trip 1
        "STG.E.64 desc[UR4][R6.64], R13",  # R13 and R14: waits for R14
        "LDG.E R31, desc[UR4][R8.64]",  # round trip 2
        "EXIT",
    ])), slots=1)
    assert w.round_trips == 2
