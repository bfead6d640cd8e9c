"""The fused kernel compiled for Hopper without a GPU (docs/design.md, "The fused kernel"): every
(geometry, eviction, ``ensure`` / ``ensure_hybrid`` variant) kernel is lowered for CUDA, its
Triton IR (TTIR, as Pallas emits it) compiled for sm_90a by the ``triton`` package's compiler
(``pip install -e '.[compile]'``), its PTX assembled by that package's ``ptxas`` with ``-v``, and
its SASS listed by its ``cuobjdump``. Per kernel: registers, spill bytes, shared memory, SASS
instructions, barrier instructions, the static count of reductions (``tt.reduce``) in the
victim loop and the fetch-order loop, and what a call with no miss issues, walked through the
SASS (benchmarks/sass_walk.py: instructions per warp, barriers, cross-warp reductions,
dependent global round trips). jaxlib bundles its own Triton, so the figures are a close
proxy of the kernel XLA builds, not the exact build.

    python benchmarks/kernel_compile.py               # the full matrix, a Markdown table
    python benchmarks/kernel_compile.py --ci          # ensure + one ensure_hybrid per eviction
    python benchmarks/kernel_compile.py --walk        # the no-miss path's cost (sass_walk.py)
    python benchmarks/kernel_compile.py --write       # ... and replace its section of RESULTS.md

Exit status: 0 no spill, 1 a spill or a failed compile.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's notice

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pallas_cache as pc  # noqa: E402
from benchmarks import sass_walk  # noqa: E402
from benchmarks.lowering import lower_cuda  # noqa: E402

# (L, E, S, k). The geometries of the no-miss walk (--walk): a small and a large model at two
# pool sizes each (1, 1, 4 and 8 warps).
WALK_GEOMETRIES = [(32, 8, 64, 2), (32, 8, 256, 2), (58, 256, 2048, 8), (61, 256, 16384, 8)]
# The table's and the no-spill test's: the walk's and five more (where a spill was once found
# or moved to), one list, so no geometry the table compiles goes untested.
GEOMETRIES = [(8, 16, 64, 8), (32, 8, 128, 2), (48, 128, 2048, 8), (48, 128, 4096, 8),
              (64, 512, 16384, 8)] + WALK_GEOMETRIES
TEST_GEOMETRIES = GEOMETRIES
EVICTIONS = ("lru", "pair_lfu", "route_knn", "route_lfu")
HYBRID = [(order, admission) for order in ("recency", "lowest_id")
          for admission in ("promote_one", "none", "reuse")]
# The loop bodies whose reductions are counted (function names in the TTIR's locations).
LOOPS = {"victim": "victim_round", "order": "order_round", "first_uses": "first_uses",
         "neighbours": "pick"}


def variants(eviction: str, ci: bool = False) -> list[str]:
    """``ensure`` and the ``ensure_hybrid/<order>/<admission>`` the eviction allows; ``ci``:
    ``ensure`` and one ``ensure_hybrid``, the one with the most live values (REUSE under LRU,
    which spilled at 16384 slots on 225a3e3; PROMOTE_ONE under PAIR_LFU)."""
    names = ["ensure"] + [f"ensure_hybrid/{o}/{a}" for o, a in HYBRID
                          if a != "reuse" or eviction == "lru"]
    if ci:
        return ["ensure", "ensure_hybrid/recency/" + ("reuse" if eviction == "lru"
                                                       else "promote_one")]
    return names


def _call(variant: str, routes):
    policy = pc.FetchPolicy.fraction(0.4)
    if variant == "ensure":
        return lambda s, layer: pc.ensure(s, layer, routes, backend="pallas")
    _, order, admission = variant.split("/")
    return lambda s, layer: pc.ensure_hybrid(s, layer, routes, policy, order=order,
                                             admission=admission, backend="pallas")


@dataclasses.dataclass
class Kernel:
    ttir: str  # with debug locations (what the reduction counts read)
    num_warps: int
    code: str = ""  # the same module without them (what is compiled); "": ``ttir``

    @property
    def source(self) -> str:
        return self.code or self.ttir


def lower_kernel(geometry, eviction: str, variant: str) -> Kernel:
    """The Triton IR of the one Pallas call of ``variant`` at ``geometry``, lowered for CUDA."""
    from jax._src.pallas.triton import lowering

    L, E, S, k = geometry
    state = pc.init(L, E, S, eviction=eviction)
    routes = jnp.arange(k, dtype=jnp.int32) % E
    modules = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        operation = result.module.operation
        modules.append((operation.get_asm(enable_debug_info=True),
                        operation.get_asm(enable_debug_info=False)))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        text = lower_cuda(_call(variant, routes), state, jnp.int32(0)).as_text()
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    if len(modules) != 1:
        raise RuntimeError(f"{variant} at {geometry}: {len(modules)} Triton modules, expected 1")
    warps = re.findall(r"num_warps = (\d+) : i32", text)
    if len(set(warps)) != 1:
        raise RuntimeError(f"{variant} at {geometry}: num_warps {warps}")
    return Kernel(modules[0][0], int(warps[0]), code=modules[0][1])


def _loc_names(ttir: str) -> dict[str, set[str]]:
    """``#locN`` -> every function name on its call stack."""
    defs = dict(re.findall(r"^(#loc\d*) = loc\((.*)\)$", ttir, flags=re.M))

    @functools.cache
    def names(ref: str) -> frozenset:
        body = defs.get(ref, "")
        out = set(re.findall(r'^"([^"]+)"\(', body))
        for inner in re.findall(r"#loc\d*", body):
            out |= names(inner)
        return frozenset(out)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20000))
    return {ref: set(names(ref)) for ref in defs}


def reductions(ttir: str) -> dict[str, int]:
    """Static ``tt.reduce`` counts: in all, and inside each loop of ``LOOPS``: the outermost
    ``scf.for`` / ``scf.while`` holding an op traced in that loop body function (nested loops
    included, e.g. the per-block scans of a victim round)."""
    stacks = _loc_names(ttir)
    lines = ttir.splitlines()

    def indent(x):
        return len(x) - len(x.lstrip())

    def names(line):
        loc = re.search(r"loc\((#loc\d*)\)\s*$", line)
        return stacks.get(loc.group(1), set()) if loc else set()

    def traced_in(line, fn):
        return any(n == fn or n.endswith("." + fn) for n in names(line))

    loops = []  # (first line, last line)
    for i, line in enumerate(lines):
        if re.search(r"= scf\.(for|while) |^\s*scf\.(for|while) ", line):
            pad = " " * indent(line)
            end = next(j for j in range(i + 1, len(lines))
                       if lines[j].startswith(pad + "}") and "loc(" in lines[j])
            loops.append((i, end))
    reduce_at = [i for i, line in enumerate(lines) if '"tt.reduce"(' in line]
    counts = {"all": len(reduce_at)}
    for key, fn in LOOPS.items():
        mine = [(a, b) for a, b in loops if any(traced_in(x, fn) for x in lines[a:b + 1])]
        outer = [(a, b) for a, b in mine if not any(c < a and b < d for c, d in mine)]
        counts[key] = sum(any(a < i < b for a, b in outer) for i in reduce_at)
    return counts


def _triton_bin(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path}: the triton package ships no {name}")
    return str(path)


def compile_sm90a(kernel: Kernel) -> dict:
    """``triton.compile`` of the TTIR for sm_90a, ``ptxas -v`` of its PTX, the SASS listing.
    Raises on a TTIR that fails to parse or a failed assembly. The TTIR compiled is the one
    without source locations (:attr:`Kernel.source`; the same SASS): ``triton``'s own cache of
    compiled kernels (``~/.triton/cache``, keyed by the text and the ``triton`` build) then
    serves a later run whose kernels moved only in their source lines (a comment edited)."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ttir"
        src.write_text(kernel.source)
        compiled = triton.compile(str(src), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": kernel.num_warps, "num_stages": 1})
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        cubin = Path(tmp) / "kernel.cubin"
        # triton 3.9 emits PTX 9.x, which its Blackwell ptxas assembles (for sm_90a as well).
        log = None
        for assembler in ("ptxas-blackwell", "ptxas"):
            with contextlib.suppress(FileNotFoundError):
                run = subprocess.run([_triton_bin(assembler), "-v", "--gpu-name", "sm_90a",
                                      str(ptx), "-o", str(cubin)], capture_output=True, text=True)
                if run.returncode == 0:
                    log = run.stdout + run.stderr
                    break
        if log is None:
            raise RuntimeError(f"ptxas failed: {run.stderr.strip()}")
        sass = subprocess.run([_triton_bin("cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    instructions = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass, flags=re.M)
    number = lambda pattern: sum(int(x) for x in re.findall(pattern, log))  # noqa: E731
    return {
        "registers": number(r"Used (\d+) registers"),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
        "stack": number(r"(\d+) bytes stack frame"),
        "shared": int(compiled.metadata.shared),
        "sass": len(instructions),
        "barriers": sum(1 for x in instructions if re.search(r"\bBAR\.", x)),
        "listing": sass,
    }


@functools.lru_cache(maxsize=None)
def _compiled(code: str, num_warps: int, slots: int) -> tuple:
    """:func:`compile_sm90a` and the no-miss walk of one Triton IR (without source locations),
    once per process (variants whose rules coincide, e.g. every LOWEST_ID admission, lower to
    the same IR)."""
    row = compile_sm90a(Kernel(code, num_warps))
    path = sass_walk.walk(sass_walk.parse(row.pop("listing")), slots=slots)
    row.update({"walk_instructions": path.instructions, "walk_barriers": path.barriers,
                "walk_reductions": path.reductions, "walk_round_trips": path.round_trips})
    return tuple(row.items())


def measure(geometry, eviction: str, variant: str) -> dict:
    """One table row: the kernel of ``variant`` at ``geometry`` compiled, assembled, counted
    (lowered once per process: a second call returns a copy of the first's row)."""
    return dict(_measured(tuple(geometry), eviction, variant))


@functools.lru_cache(maxsize=None)
def _measured(geometry: tuple, eviction: str, variant: str) -> tuple:
    kernel = lower_kernel(geometry, eviction, variant)
    row = {"geometry": geometry, "eviction": eviction, "variant": variant,
           "num_warps": kernel.num_warps}
    row.update(_compiled(kernel.source, kernel.num_warps, geometry[2]))
    row.update({f"reduce_{k}": v for k, v in reductions(kernel.ttir).items()})
    return tuple(row.items())


HEADER = ("| L,E,S,k | eviction | call | warps | regs | spill B (st/ld) | smem B | SASS | BAR "
          "| reduce: victim loop | fetch-order loop | ring first uses | neighbours | all |\n"
          "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(r: dict) -> str:
    return (f"| {','.join(map(str, r['geometry']))} | {r['eviction']} | {r['variant']} "
            f"| {r['num_warps']} | {r['registers']} | {r['spill_stores']}/{r['spill_loads']} "
            f"| {r['shared']} | {r['sass']} | {r['barriers']} | {r['reduce_victim']} "
            f"| {r['reduce_order']} | {ring(r, 'first_uses')} | {ring(r, 'neighbours')} "
            f"| {r['reduce_all']} |")


WALK_HEADER = ("| L,E,S,k | eviction | call | warps | regs | spill B (st/ld) | smem B "
               "| instructions / warp | barriers | cross-warp reductions | global round trips |\n"
               "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def walk_row(r: dict) -> str:
    """A row of the no-miss walk's table (benchmarks/sass_walk.py)."""
    return (f"| {','.join(map(str, r['geometry']))} | {r['eviction']} | {r['variant']} "
            f"| {r['num_warps']} | {r['registers']} | {r['spill_stores']}/{r['spill_loads']} "
            f"| {r['shared']} | {r['walk_instructions']} | {r['walk_barriers']} "
            f"| {r['walk_reductions']} | {r['walk_round_trips']} |")


def ring(r: dict, loop: str) -> str:
    """A ring loop's column: ``-`` for an eviction without a token ring."""
    return str(r[f"reduce_{loop}"]) if r["eviction"].startswith("route_") else "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ci", action="store_true",
                   help="the test geometries, ensure and one ensure_hybrid per eviction")
    p.add_argument("--walk", action="store_true",
                   help="the no-miss path's cost per kernel (benchmarks/sass_walk.py) at the "
                        "walk geometries, ensure and one ensure_hybrid per eviction")
    p.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    geometries = (WALK_GEOMETRIES if args.walk else TEST_GEOMETRIES if args.ci
                  else GEOMETRIES)
    import triton

    lines = [f"triton {triton.__version__}, jax {jax.__version__}, target sm_90a, "
             f"ptxas from the triton package", "", WALK_HEADER if args.walk else HEADER]
    print("\n".join(lines), flush=True)
    bad = 0
    for geometry in geometries:
        for eviction in EVICTIONS:
            for variant in variants(eviction, ci=args.ci or args.walk):
                try:
                    row = measure(geometry, eviction, variant)
                    line = (walk_row if args.walk else table_row)(row)
                    bad += bool(row["spill_stores"] or row["spill_loads"])
                except Exception as exc:  # a failed compile is a row, and a failed run
                    line = f"| {geometry} | {eviction} | {variant} | FAILED: {exc!r} |"
                    bad += 1
                lines.append(line)
                print(line, flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
