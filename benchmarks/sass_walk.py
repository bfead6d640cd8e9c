"""What one call of the fused kernel issues, read from its SASS (``cuobjdump -sass``) along the
path of a call with no miss (m = 0): the program is walked instruction by instruction from its
entry, with fixed rules for the branches, since an offline listing has no predicate values.

Walk rules (docs/design.md, "The kernel's cost, offline"):

- a conditional forward branch that skips a loop (a backward branch lies wholly between the
  branch and its target) is taken: the rebase not due, no victim round, no ring loop;
- every other conditional forward branch falls through, ``BRA.DIV`` (the shuffles' divergent
  slow path) included;
- a loop latch (a backward branch) whose loop holds an inner loop is taken
  ``ceil(S / STREAM_BLOCK) - 1`` times (the streamed search's block loop: each block is loaded
  even when no victim is searched), every other latch falls through;
- an unconditional branch is followed; ``CALL`` / ``RET`` call and return; the walk ends at an
  unconditional ``EXIT``.

Counted along the walk, per warp: instructions (``NOP`` padding not counted), barriers executed
(``BAR.*``), cross-warp reductions (a barrier with a shared-memory store since the previous
barrier and a shared-memory load before the next: the exchange of per-warp partials a
reduction across warps needs), and dependent global round trips: the warp issues in order, so
an instruction that reads (or overwrites) a register a global load has not yet filled waits
for it, and a load issued after such a wait starts a new round trip; the count is the most
round trips behind any one load.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_cache.kernels.common import MAX_BLOCK  # noqa: E402

__all__ = ["STREAM_BLOCK", "Instruction", "Walk", "loops", "parse", "walk"]

#: Slots the streamed victim search loads per block: the kernel's own block width.
STREAM_BLOCK = MAX_BLOCK

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_REG = re.compile(r"\bR(\d+)(?:\.(64|128))?\b")
_WIDTH = {"64": 2, "128": 4}


@dataclasses.dataclass(frozen=True)
class Instruction:
    pc: int  # byte address
    guard: str  # "" or the predicate guard, e.g. "@!P2"
    opcode: str  # e.g. "LDG.E.128"
    operands: str

    @property
    def name(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def conditional(self) -> bool:
        """A branch that may fall through: a predicate guard, a predicate operand or
        ``BRA.DIV``."""
        if self.guard and self.guard.lstrip("@") != "PT":
            return True
        return self.opcode.startswith("BRA.DIV") or bool(
            re.match(r"!?U?P[0-6]\b", self.operands.strip()))

    @property
    def target(self) -> int | None:
        """A branch's or call's target address."""
        if self.name not in ("BRA", "CALL", "JMP"):
            return None
        found = re.findall(r"0x([0-9a-f]+)", self.operands)
        return int(found[-1], 16) if found else None

    def registers(self) -> set[int]:
        """The general registers the instruction names, a pair or quad in full: ``R2.64`` is
        R2 and R3; a memory instruction's data operand (outside the brackets) is as wide as
        its access (``LDG.E.128 R4``: R4 to R7)."""
        data = self.width if self.name in _MEMORY else 1
        out = set()
        for part in re.split(r"(\[[^\]]*\])", self.operands):
            for number, suffix in _REG.findall(part):
                n, width = int(number), _WIDTH.get(suffix, 1 if part.startswith("[") else data)
                out.update(range(n, n + width))
        return out

    def destination(self) -> set[int]:
        """A global load's destination registers."""
        first = self.operands.split(",")[0]
        match = _REG.search(first)
        if not match:
            return set()
        return set(range(int(match.group(1)), int(match.group(1)) + self.width))

    @property
    def width(self) -> int:
        """Registers per operand of a memory instruction (``.64``: 2, ``.128``: 4)."""
        match = re.search(r"\.(64|128)(?:\.|$)", self.opcode)
        return _WIDTH[match.group(1)] if match else 1


_MEMORY = {"LDG", "LD", "STG", "ST", "ATOMG", "ATOM", "RED", "LDS", "STS"}
_GLOBAL_LOADS = {"LDG", "LD", "ATOMG", "ATOM"}


def parse(listing: str) -> list[Instruction]:
    """The instructions of a ``cuobjdump -sass`` listing of one kernel, in address order."""
    out = []
    for line in listing.splitlines():
        m = _LINE.match(line)
        if m:
            out.append(Instruction(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3),
                                   m.group(4).strip()))
    if not out:
        raise ValueError("no SASS instruction in the listing")
    return out


def loops(code: list[Instruction]) -> list[tuple[int, int]]:
    """Every loop as ``(head, latch)`` addresses: a backward branch and its target."""
    return [(i.target, i.pc) for i in code
            if i.name == "BRA" and i.target is not None and i.target <= i.pc]


@dataclasses.dataclass
class Walk:
    instructions: int = 0
    barriers: int = 0
    reductions: int = 0  # cross-warp: shared-memory exchanges across a barrier
    round_trips: int = 0  # dependent global round trips
    global_loads: int = 0
    path: list = dataclasses.field(default_factory=list)  # the addresses walked, in order


def walk(code: list[Instruction], slots: int, stream_block: int = STREAM_BLOCK,
         max_steps: int = 1_000_000) -> Walk:
    """The no-miss path through ``code`` (a pool of ``slots`` slots), by the module's rules."""
    at = {ins.pc: n for n, ins in enumerate(code)}
    spans = loops(code)

    def skips_loop(ins):
        return any(ins.pc < head and latch < ins.target for head, latch in spans)

    def holds_loop(head, latch):
        return any(head <= h and l < latch for h, l in spans if (h, l) != (head, latch))

    repeats = -(-slots // stream_block) - 1
    left: dict[int, int] = {}  # latch -> repeats still to take
    out = Walk()
    pending: dict[int, int] = {}  # register -> round trip of the load filling it
    floor = 0  # round trips the warp has waited for
    stored = loaded = False  # shared memory since the last barrier
    barrier_stored = None  # whether the segment before the last barrier stored to shared
    stack: list[int] = []
    n = 0
    for _ in range(max_steps):
        ins = code[n]
        out.path.append(ins.pc)
        if ins.opcode != "NOP":
            out.instructions += 1
        touched = ins.registers()
        for r in touched & pending.keys():
            floor = max(floor, pending.pop(r))
        if ins.name in _GLOBAL_LOADS:
            depth = floor + 1
            out.global_loads += 1
            out.round_trips = max(out.round_trips, depth)
            for r in ins.destination():
                pending[r] = depth
        if ins.name == "STS":
            stored = True
        elif ins.name == "LDS":
            loaded = True
        elif ins.name == "BAR":
            if barrier_stored and loaded:
                out.reductions += 1
            out.barriers += 1
            barrier_stored, stored, loaded = stored, False, False
        nxt = n + 1
        if ins.name == "EXIT" and not ins.conditional:
            break
        if ins.name == "RET":
            nxt = stack.pop() if stack else len(code)
        elif ins.name == "CALL":
            stack.append(n + 1)
            nxt = at[ins.target]
        elif ins.name == "BRA":
            if ins.target is None or ins.target not in at:
                raise ValueError(f"an indirect branch at {ins.pc:#x}")
            if ins.target > ins.pc:
                if not ins.conditional or (not ins.opcode.startswith("BRA.DIV")
                                           and skips_loop(ins)):
                    nxt = at[ins.target]
            elif ins.target == ins.pc and not ins.conditional:
                break  # the trap after the last EXIT
            elif holds_loop(ins.target, ins.pc):
                left.setdefault(ins.pc, repeats)
                if left[ins.pc] > 0:
                    left[ins.pc] -= 1
                    nxt = at[ins.target]
                else:
                    del left[ins.pc]
        if nxt >= len(code):
            raise ValueError(f"the walk ran past the last instruction ({ins.pc:#x}) with no EXIT")
        n = nxt
    else:
        raise RuntimeError(f"the walk did not end within {max_steps} instructions")
    out.reductions += bool(barrier_stored and loaded)  # the last exchange, no barrier after
    return out
