"""The copy path moves only the misses: ``apply_copy_plan`` (jitted, the pool donated) from a
host-memory bank (``put_host_bank``) of 8 rows of ``--mib`` MiB, timed for ``count`` = 0, 1, 2,
4 and 8 of 8 entries, and under ``vmap`` over 1, 2 and 4 caches each copying one row, all
variants interleaved in rounds (medians). The targets are ratios within the run: t(1) <= 0.35
t(8), t(0) <= 0.10 t(8), and 4 vmapped caches copying 1 row each <= 1.5x one cache copying 4.

``--baseline REV`` also times revision ``REV``'s ``pallas_cache/moe.py`` (loaded beside this
tree's) on the same plans, and a second table compares the fixed cost of the counted loop with
tiny rows (``--small-kib``): this tree at ``count = 0`` and 8, ``REV``'s, and a donated identity
(the floor of a jitted call).

    python benchmarks/copy_path.py [--mib 32] [--rounds 15] [--baseline 467dc03] [--write]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pallas_cache as pc  # noqa: E402
from pallas_cache.moe import host_memory_kind, put_host_bank  # noqa: E402
from timing import interleaved, load_average, markdown_table, publish, run_header  # noqa: E402

ROWS = 8  # bank rows, pool slots and plan entries
COUNTS = (0, 1, 2, 4, 8)
CACHES = (1, 2, 4)
VMAP_SLOTS = 2  # each vmapped cache's pool (one row copied into it)


def load_moe(rev):
    """Revision ``rev``'s ``pallas_cache/moe.py`` as a module of its own (it imports only
    ``pallas_cache.hints`` and ``pallas_cache.tree`` from this tree)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:pallas_cache/moe.py"],
                            check=True, capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as file:
        file.write(source)
    spec = importlib.util.spec_from_file_location(f"moe_{rev}", file.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan(count, width=ROWS, seed=0):
    """A full-width plan (every entry a real fetch) of which the first ``count`` are counted."""
    order = np.random.default_rng(seed).permutation(width)
    return pc.CopyPlan(dst_slots=jnp.asarray(order, jnp.int32),
                       src_rows=jnp.asarray(order[::-1].copy(), jnp.int32),
                       count=jnp.int32(count))


def chained(step, state, bank, plan):
    """A variant: ``step`` on the pool in ``state`` (donated: the variants sharing a state pass
    one pool along, so a run holds one pool, not one per variant), blocking until it is done."""
    def run():
        state["pool"] = jax.block_until_ready(step(state["pool"], bank, plan))
    return run


def vmap_plans(caches):
    """``caches`` plans of width ``VMAP_SLOTS``, each copying one row (a different one)."""
    return pc.CopyPlan(dst_slots=jnp.tile(jnp.arange(VMAP_SLOTS, dtype=jnp.int32), (caches, 1)),
                       src_rows=jnp.asarray([[c % ROWS, (c + 1) % ROWS] for c in range(caches)],
                                            jnp.int32),
                       count=jnp.ones((caches,), jnp.int32))


def variants(width, baseline, counts, caches):
    """The timed calls: ``width`` floats per row; ``baseline`` an old moe module or None."""
    bank = put_host_bank(np.arange(ROWS * width, dtype=np.float32).reshape(ROWS, width)
                         / width)
    out = {}
    shared = {"pool": jnp.zeros((ROWS, width), jnp.float32)}
    steps = {"new": jax.jit(pc.apply_copy_plan, donate_argnums=0)}
    if baseline is not None:
        steps["old"] = jax.jit(baseline.apply_copy_plan, donate_argnums=0)
    for name, step in steps.items():
        for count in counts:
            out[f"{name} {count}"] = chained(step, shared, bank, plan(count))
    batched = jax.jit(jax.vmap(pc.apply_copy_plan, in_axes=(0, None, 0)), donate_argnums=0)
    for n in caches:
        out[f"vmap {n}"] = chained(batched,
                                   {"pool": jnp.zeros((n, VMAP_SLOTS, width), jnp.float32)},
                                   bank, vmap_plans(n))
    out["floor"] = chained(jax.jit(lambda pool, bank, plan: pool, donate_argnums=0), shared,
                           bank, plan(0))
    return out


def check(width, baseline):
    """The new path's pools equal the reference's (and the old path's) for every count."""
    from pallas_cache.reference import moe as reference_moe
    host = np.arange(ROWS * width, dtype=np.float32).reshape(ROWS, width) / width
    bank = put_host_bank(host)
    for count in COUNTS:
        want = reference_moe.apply_copy_plan(np.zeros((ROWS, width), np.float32), host,
                                             plan(count))
        got = np.asarray(pc.apply_copy_plan(jnp.zeros((ROWS, width)), bank, plan(count)))
        assert np.array_equal(got, want), count
        if baseline is not None:
            old = baseline.apply_copy_plan(jnp.zeros((ROWS, width)), bank, plan(count))
            assert np.array_equal(np.asarray(old), want), count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=32.0, help="MiB per bank row (default 32)")
    parser.add_argument("--small-kib", type=float, default=4.0,
                        help="KiB per row of the fixed-cost table (default 4)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--baseline", default=None, help="a git revision to time beside")
    parser.add_argument("--write", action="store_true", help="write the RESULTS.md section")
    args = parser.parse_args(argv)
    if args.mib <= 0 or args.small_kib <= 0 or args.rounds < 1:
        parser.error("--mib and --small-kib must be > 0 and --rounds >= 1")
    warnings.simplefilter("ignore")  # backends without donation warn
    baseline = load_moe(args.baseline) if args.baseline else None
    width = int(args.mib * 2**20) // 4
    small = int(args.small_kib * 2**10) // 4
    check(small, baseline)
    loads = [load_average()]

    big = variants(width, baseline, COUNTS, CACHES)
    times = interleaved(big, args.rounds, warmup=2)
    loads.append(load_average())
    del big
    med = {name: statistics.median(t) for name, t in times.items()}
    spread = {name: (max(t) - min(t)) / statistics.median(t) for name, t in times.items()}

    tiny = variants(small, baseline, (0, 8), ())
    tiny_times = interleaved(tiny, args.rounds * 10, warmup=2)
    loads.append(load_average())
    tiny_med = {name: statistics.median(t) for name, t in tiny_times.items()}

    t8 = med["new 8"]
    rows = []
    for count in COUNTS:
        row = [f"{count} of {ROWS}", f"{med[f'new {count}'] * 1e3:.1f}",
               f"{med[f'new {count}'] / t8:.3f}", f"{spread[f'new {count}']:.2f}"]
        if baseline is not None:
            row += [f"{med[f'old {count}'] * 1e3:.1f}", f"{med[f'old {count}'] / med['old 8']:.3f}"]
        row.append(f"{count * args.mib:g}")
        rows.append(row)
    header = ["rows asked", "ms", "t / t(8)", "spread"]
    if baseline is not None:
        header += [f"{args.baseline} ms", f"{args.baseline} t / t(8)"]
    header.append("MiB moved (this tree)")
    vmap_rows = [[f"{n} x 1 row", f"{med[f'vmap {n}'] * 1e3:.1f}",
                  f"{med[f'vmap {n}'] / med['new 4']:.3f}", f"{spread[f'vmap {n}']:.2f}"]
                 for n in CACHES]
    targets = [("t(1) <= 0.35 t(8)", med["new 1"] / t8, 0.35),
               ("t(0) <= 0.10 t(8)", med["new 0"] / t8, 0.10),
               ("vmap 4 x 1 row <= 1.5 t(4)", med["vmap 4"] / med["new 4"], 1.5)]
    target_rows = [[name, f"{value:.3f}", "met" if value <= bound else "NOT MET"]
                   for name, value, bound in targets]
    tiny_rows = [[name, f"{tiny_med[name] * 1e6:.1f}"] for name in tiny_med]
    kind = host_memory_kind() or "device (no host memory kind)"
    text = "\n\n".join([
        f"## The copy path: only the misses move (benchmarks/copy_path.py, jax {jax.__version__})",
        run_header(f"python benchmarks/copy_path.py --mib {args.mib:g} --rounds {args.rounds}"
                   + (f" --baseline {args.baseline}" if args.baseline else ""),
                   load=max(loads), note=" (highest load seen during the run)"),
        f"`apply_copy_plan` jitted with the pool donated, the bank {ROWS} rows of {args.mib:g} "
        f"MiB in `{kind}` memory, a plan of {ROWS} entries of which `count` are counted; "
        f"medians of {args.rounds} interleaved rounds (spread = (max - min) / median).",
        markdown_table(header, rows),
        f"Under `vmap` (pools of {VMAP_SLOTS} slots, one plan each copying one row; ratio to "
        "one cache copying 4 rows):",
        markdown_table(["caches", "ms", "t / t(4 rows, one cache)", "spread"], vmap_rows),
        markdown_table(["target", "ratio", ""], target_rows),
        f"Fixed cost with {args.small_kib:g} KiB rows (us, medians of {args.rounds * 10} "
        "rounds; `floor`: a donated identity, the cost of any jitted call):",
        markdown_table(["variant", "us"], tiny_rows),
    ])
    publish(f"copy_path jax {jax.__version__}", text, args.write)  # a section per JAX version
    return 0 if all(value <= bound for _, value, bound in targets) else 1


if __name__ == "__main__":
    raise SystemExit(main())
