"""What one round of the fused kernel's searches issues, read from its SASS for sm_90a without a
GPU (docs/design.md, "The fused kernel's fixed part" and "The ring in the kernel"): a victim
round (the streamed search's above 4096 slots, the one block's below) and, under the ring
evictions, a first-use round.

Each loop is found by the Python source lines its instructions carry (the PTX assembled with
``ptxas -lineinfo``, read back with ``nvdisasm -g``): the innermost loop whose instructions
come most from the body of ``victim_round`` and the helper it calls (``_next``,
kernels/search.py) or of ``first_uses`` (kernels/ring.py). One pass of its body is walked with
benchmarks/sass_walk.py's counting (instructions per warp, barriers, cross-warp reductions,
dependent global round trips) along the round's common path: a conditional branch that skips
code holding a barrier (the exact two-reduction minimum of a round whose packed key does not
fit, or that finds no slot) is taken; every other conditional branch falls through, so the
set's maximum, taken only when a key enters a full set, is counted in every round.
``waits``: whether the round reads a register a global load of the same round fills (a ring
row loaded a round ahead is not waited on).

    python benchmarks/search_rounds.py            # the four geometries, a Markdown table
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import kernel_compile, sass_walk  # noqa: E402

# (L, E, S, k): a small and a large model at two pool sizes each; the last pool streams.
GEOMETRIES = kernel_compile.WALK_GEOMETRIES
# The functions whose lines a round's instructions carry (a name absent from a tree is skipped).
ROUNDS = {"victim": ("kernels/search.py", ("victim_round", "_next")),
          "first_use": ("kernels/ring.py", ("first_uses",))}


def _function_lines(path: str, names) -> set[int]:
    """The source lines of every function of ``names`` defined in ``pallas_cache/<path>``."""
    tree = ast.parse((REPO / "pallas_cache" / path).read_text())
    return {line for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.name in names
            for line in range(node.lineno, node.end_lineno + 1)}


def compile_with_lines(kernel) -> tuple[list, dict[int, int]]:
    """The kernel's SASS (``sass_walk.parse``) and each instruction's source line."""
    import triton
    from triton.backends.compiler import GPUTarget

    # Triton keeps a location's line but not a range's file: the ranges become points.
    ttir = re.sub(r'loc\("([^"]+)":(\d+):(\d+) to [^)]*\)', r'loc("\1":\2:\3)', kernel.ttir)
    with tempfile.TemporaryDirectory() as tmp:
        src, ptx, cubin = (Path(tmp) / f"kernel.{x}" for x in ("ttir", "ptx", "cubin"))
        src.write_text(ttir)
        compiled = triton.compile(str(src), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": kernel.num_warps, "num_stages": 1})
        ptx.write_text(compiled.asm["ptx"])
        subprocess.run([kernel_compile._triton_bin("ptxas-blackwell"), "-lineinfo",
                        "--gpu-name", "sm_90a", str(ptx), "-o", str(cubin)],
                       check=True, capture_output=True)
        listing = subprocess.run([kernel_compile._triton_bin("cuobjdump"), "-sass", str(cubin)],
                                 capture_output=True, text=True, check=True).stdout
        disasm = subprocess.run([kernel_compile._triton_bin("nvdisasm"), "-g", "-c", str(cubin)],
                                capture_output=True, text=True, check=True).stdout
    lines, line = {}, None
    for text in disasm.splitlines():
        found = re.search(r"//## File .*, line (\d+)", text)
        if found:
            line = int(found.group(1))
        elif (pc := re.match(r"\s+/\*([0-9a-f]{4,})\*/", text)) and line is not None:
            lines[int(pc.group(1), 16)] = line
    return sass_walk.parse(listing), lines


def find_loop(code, lines: dict[int, int], body: set[int]):
    """The innermost loop (one holding no other) whose instructions come most from ``body``'s
    lines, as a share of the loop (a long loop that merely passes through a few such lines, or
    a line of another file that happens to share a number, scores low); ``None`` below a
    half."""
    spans = sass_walk.loops(code)
    inner = [(h, t) for h, t in spans
             if not any((h, t) != (a, b) and h <= a and b <= t for a, b in spans)]
    best, share = None, 0.5
    for h, t in inner:
        pcs = [i.pc for i in code if h <= i.pc <= t]
        mine = sum(lines.get(pc) in body for pc in pcs) / len(pcs)
        if mine > share:
            best, share = (h, t), mine
    return best


@dataclasses.dataclass
class Round:
    instructions: int
    barriers: int
    reductions: int
    round_trips: int
    loads: int
    waits: bool


def walk_round(code, head: int, latch: int) -> Round:
    """One pass of the loop body ``[head, latch)`` along its common path."""
    body = [i for i in code if head <= i.pc < latch]
    end = sass_walk.Instruction(latch, "", "EXIT", "")
    out = []
    for i in body:
        target = None
        if i.name == "BRA" and i.target is not None and i.target > i.pc:
            target = min(i.target, latch)  # past the round: its end
        elif i.name == "BRA" and i.target is not None and i.target < head:
            target = latch  # out of the round (a loop entered at its middle)
        if target is not None:
            rare = i.conditional and i.target > i.pc and any(
                j.name == "BAR" for j in body if i.pc < j.pc < target)
            if rare:  # taken: an unconditional branch
                i = sass_walk.Instruction(i.pc, "", "BRA", f"{target:#x}")
            else:
                i = dataclasses.replace(i, operands=re.sub(r"0x[0-9a-f]+$", f"{target:#x}",
                                                           i.operands.strip()))
        out.append(i)
    path = sass_walk.walk(out + [end], slots=1)
    walked = [i for i in out if i.pc in set(path.path)]
    pending, waits = set(), False
    for i in walked:
        if i.registers() & pending:
            waits = True
        if i.name in ("LDG", "LD"):
            pending |= i.destination()
    return Round(path.instructions - 1, path.barriers, path.reductions, path.round_trips,
                 path.global_loads, waits)


def measure(geometry, eviction: str, variant: str = "ensure") -> dict:
    kernel = kernel_compile.lower_kernel(geometry, eviction, variant)
    code, lines = compile_with_lines(kernel)
    row = {"geometry": geometry, "eviction": eviction, "warps": kernel.num_warps}
    for name, (path, function) in ROUNDS.items():
        if name == "first_use" and not eviction.startswith("route_"):
            row[name] = None
            continue
        loop = find_loop(code, lines, _function_lines(path, function))
        row[name] = walk_round(code, *loop) if loop else None
    return row


HEADER = ("| L,E,S,k | eviction | warps | victim round: instructions | barriers "
          "| cross-warp reductions | round trips | first-use round: instructions | loads "
          "| waits on its own load |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---|")


def table_row(r: dict) -> str:
    v, f = r["victim"], r["first_use"]
    cells = [",".join(map(str, r["geometry"])), r["eviction"], str(r["warps"])]
    cells += ([str(v.instructions), str(v.barriers), str(v.reductions), str(v.round_trips)]
              if v else ["-"] * 4)
    cells += ([str(f.instructions), str(f.loads), "yes" if f.waits else "no"] if f
              else ["-"] * 3)
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("search_rounds: the triton package is missing (pip install -e '.[compile]')",
              file=sys.stderr)
        return 2
    print(HEADER, flush=True)
    for geometry in GEOMETRIES:
        for eviction in kernel_compile.EVICTIONS:
            print(table_row(measure(geometry, eviction)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
