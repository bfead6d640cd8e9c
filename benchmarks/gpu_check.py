"""GPU check: the Pallas backend against the XLA one on a GPU (docs/semantics.md §7), sized to
fit one 15-minute lease of GPU time with the machine's start: the run is estimated at <= 480 s
(``--budget-seconds``) with every phase in it.

Phases (``--phases``, run in the order given; default all, in this order; one module each in
benchmarks/gpu_phases/):

- ``equality``: every state and plan leaf of the candidate against XLA, small pools first: each
  eviction plain, with a low rebase threshold, a usable size below the capacity and ``vmap``;
  the random operation sequences; then 8192 slots (the streamed two-block search);
- ``mesh``: both several-devices layouts inside ``jax.shard_map(check_vma=True)``;
- ``sweep``: the LRU miss sweep at S = 512 and 16384, m = 0, 1, 8, against upstream's table;
- ``copy``: ``apply_copy_plan`` from a ``pinned_host`` bank, 0, 1, 2 and 8 of 8 rows asked:
  device time (it must scale with the rows asked) and GB/s (bytes actually moved / time);
- ``geometries``: per-call cost of each eviction at (32,8,64,2), (32,8,256,2), (58,256,2048,8),
  (61,256,16384,8) (last: the most rows, so overrun estimates cut these first).

Every cost row gives wall time (the programs as XLA compiles them, in CUDA graphs on a GPU) and
device time (the sum of the GPU events of one profiled dispatch of copies compiled without XLA
command buffers, the trivial-body floor's subtracted; ``--profile-graphs`` profiles the graph
programs themselves) for both backends, and compares their final states and plans. A row that would end past the budget is **skipped, not matched**: the report says
INCOMPLETE and the run exits 4. The report is rewritten after every row. Run from the
repository root, e.g. ``PYTHONUNBUFFERED=1 timeout 540 python benchmarks/gpu_check.py --out
$OUT/gpu_check.md``; ``--smoke`` runs on a CPU (backend ``interpret``): every equality check and
one row of every other phase (one per layout for the mesh), the first row of each phase
whatever the budget; ``--dry-run`` prints the rows and the estimate and exits. Exit status: 0
every row ran and matched; 1 a difference or a failed backend; 2 a bad argument, or a sweep row
without m misses per call; 3 no GPU; 4 incomplete (rows skipped by the budget)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import traceback
from pathlib import Path

# Parsed before jax is imported, so --smoke can pin the CPU platform (with two CPU devices, so
# the mesh phase has a mesh to shard over).
if "jax" not in sys.modules and {"--smoke", "--cpu-smoke", "--dry-run"} & set(sys.argv[1:]):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "--dry-run" not in sys.argv[1:]:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # be gentle with a shared GPU

import jax  # noqa: E402
import jaxlib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
for _path in (str(REPO / "benchmarks"), str(REPO)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

try:
    import pallas_cache as pc  # noqa: E402
    from gpu_phases import PHASES  # noqa: E402
except Exception:  # e.g. a jax without the Pallas Triton backend the kernels import
    traceback.print_exc()
    print(f"FAILED: cannot import pallas_cache from {REPO} with jax {jax.__version__}",
          file=sys.stderr)
    sys.exit(1)
from gpu_phases.common import EVICTIONS, Context, log  # noqa: E402
from results_file import write_section  # noqa: E402
from script_args import out_error  # noqa: E402

SKIPPED = "skipped (budget)"
#: Seconds before the first row: imports, the device's start, the first trace.
START_S = 15.0
EXIT_MISMATCH, EXIT_ARGS, EXIT_NO_GPU, EXIT_INCOMPLETE = 1, 2, 3, 4


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage block
        print(f"gpu_check.py: error: {message}", file=sys.stderr)
        sys.exit(EXIT_ARGS)


def _phase_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PHASES]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give distinct names from {', '.join(PHASES)}, comma separated")
    return names


def _evictions(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or set(names) - set(EVICTIONS) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct names from "
                                         f"{', '.join(EVICTIONS)}, comma separated")
    return names


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:  # the phases seed NumPy's generators with it plus offsets
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be above 0")
        return value
    return parse


def parse_args(argv=None):
    p = _Parser(description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", "--cpu-smoke", dest="smoke", action="store_true",
                   help="on the CPU, backend 'interpret' for 'pallas', tiny sizes: every "
                        "equality check and one row of every other phase (one per mesh layout)")
    p.add_argument("--phases", type=_phase_names, default=tuple(PHASES),
                   help=f"phases to run, in this order (default {','.join(PHASES)})")
    p.add_argument("--candidate", choices=pc.BACKENDS, default=None,
                   help="backend compared against 'xla' (default: pallas; interpret with --smoke)")
    p.add_argument("--budget-seconds", type=_positive(float), default=None,
                   help="skip the rows that would end after this many seconds, which makes the "
                        "run incomplete (default 480; smoke: no limit)")
    p.add_argument("--steps", type=_positive(int), default=None,
                   help="ops per random sequence (default 192, smoke 24)")
    p.add_argument("--case-steps", type=_positive(int), default=None,
                   help="calls per equality case (default 96, smoke 24)")
    p.add_argument("--op", choices=("ensure", "ensure_hybrid"), default="ensure",
                   help="the call of the LRU miss sweep (ensure_hybrid with the full policy)")
    p.add_argument("--mesh-evictions", type=_evictions, default=("lru",),
                   help="evictions of the mesh rows, comma separated (default lru)")
    p.add_argument("--calls", type=_positive(int), default=None,
                   help="layer-calls per dispatch of a cost row (default 128, smoke 4)")
    p.add_argument("--replays", type=_positive(int), default=None,
                   help="dispatches per trial (default 5, smoke 2)")
    p.add_argument("--repeats", type=_positive(int), default=None,
                   help="trials, median taken (default 3, smoke 2)")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--profile-graphs", action="store_true",
                   help="profile the programs as compiled by default, in CUDA graphs (XLA command "
                        "buffers); default: the profiled dispatches run copies compiled without "
                        "them, since tracing a graph launch faulted (docs/design.md, 'GPU check')")
    p.add_argument("--dry-run", action="store_true",
                   help="print the phases, their rows and the time estimate; run nothing")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the report as the gpu_check section of this markdown file")
    args = p.parse_args(argv)
    if out_error(args.out):  # before any work: a report that cannot be written wastes the run
        p.error(out_error(args.out))
    smoke = args.smoke
    args.candidate = args.candidate or ("interpret" if smoke else "pallas")
    args.budget_seconds = args.budget_seconds or (float("inf") if smoke else 480.0)
    args.steps = args.steps or (24 if smoke else 192)
    args.case_steps = args.case_steps or (24 if smoke else 96)
    args.calls = args.calls or (4 if smoke else 128)
    args.replays = args.replays or (2 if smoke else 5)
    args.repeats = args.repeats or (2 if smoke else 3)
    return args


def phase_plan(args, name):
    """The rows of phase ``name`` for this run, with their estimated seconds on the GPU: all of
    them, or in a smoke run the phase's ``smoke_rows`` (default its first row)."""
    rows = PHASES[name].plan(args)
    return getattr(PHASES[name], "smoke_rows", lambda rows: rows[:1])(rows) if args.smoke else rows


def dry_run(args) -> str:
    """The rows of each phase in run order with their estimates (no JAX work)."""
    lines = [f"candidate {args.candidate} vs xla; budget {args.budget_seconds:.0f} s; "
             f"start {START_S:.0f} s"]
    total, counts = START_S, []
    for name in args.phases:
        rows = phase_plan(args, name)
        secs = sum(est for _, est in rows)
        total += secs
        counts.append(f"{name} {secs:.0f} s")
        lines.append(f"phase {name}: {len(rows)} rows, {secs:.0f} s")
        lines += [f"  {row['label']}: {est:.1f} s" for row, est in rows]
    fits = "fits" if total <= args.budget_seconds else "does NOT fit"
    lines.append(f"estimated {total:.0f} s ({', '.join(counts)}; {total / 60:.1f} min); "
                 f"{fits} the budget of {args.budget_seconds:.0f} s")
    return "\n".join(lines)


def device_description() -> str:
    d = jax.devices()[0]
    return f"{len(jax.devices())} x {d.platform} ({getattr(d, 'device_kind', '?')})"


def outcome(ctx, done) -> tuple[int, str]:
    """The exit status and the report's verdict: a difference or a failed backend (1), a sweep
    row without its misses (2), rows skipped by the budget (4: incomplete, never 'matched'),
    else 0."""
    results = [r for rows in done.values() for _, r in rows]
    skipped = sum(r["status"] == SKIPPED for r in results)
    ran = len(results) - skipped
    if ctx.failures or any(r["status"] not in ("match", SKIPPED) for r in results):
        return EXIT_MISMATCH, f"**MISMATCH or FAILED** ({len(ctx.failures)} failures; see below)"
    if ctx.scenario_failures:
        return 2, "**rows without m misses per call** (see below); the rows that ran matched"
    if skipped:
        return EXIT_INCOMPLETE, (f"**INCOMPLETE**: {skipped} of {len(results)} rows skipped by "
                                 f"the budget (not a pass); the {ran} that ran matched")
    return 0, f"**all matched**: {ran} rows, none skipped"


def markdown(args, ctx, done, elapsed) -> str:
    _, verdict = outcome(ctx, done)
    lines = [
        f"## GPU check: {args.candidate} vs xla (`benchmarks/gpu_check.py`)", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"{'CPU smoke run' if args.smoke else jax.default_backend().upper() + ' run'}; "
        f"{elapsed:.0f} s in all (budget {args.budget_seconds:.0f} s)",
        f"- jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"Python {platform.python_version()}, {device_description()}",
        f"- verdict: {verdict}",
        "- timing: wall us from the programs as XLA compiles them by default (CUDA graphs on a "
        "GPU); device us from one profiled dispatch of "
        + ("the same programs (`--profile-graphs`)" if args.profile_graphs else
           "copies compiled without XLA command buffers (no CUDA graph: tracing a graph launch "
           "faulted; docs/design.md, 'GPU check')"),
    ]
    for name, rows in done.items():
        ran = [r for _, r in rows if r["status"] != SKIPPED]
        lines.append(f"- phase {name}: {len(ran)} of {len(rows)} rows ran in "
                     f"{sum(r.get('seconds', 0.0) for r in ran):.0f} s (estimated "
                     f"{sum(r.get('estimate', 0.0) for r in ran):.0f} s for them)")
    if ctx.failures:
        lines += ["", "Failures:", "", "```"] + ctx.failures + ["```"]
    if ctx.scenario_failures:
        lines += ["", "Rows without exactly m misses per call:", "", "```"]
        lines += ctx.scenario_failures + ["```"]
    for name, rows in done.items():
        lines += [""] + PHASES[name].markdown(args, rows)
    return "\n".join(lines) + "\n"


def run_phases(args, ctx, start, on_row=lambda done: None) -> dict:
    """Every row of every phase in order, while the budget lasts: ``{phase: [(row, result)]}``.
    A row whose estimate would take the run past the budget is recorded as skipped (the first
    row of a phase runs regardless in a smoke run); an exception is a failure of its row."""
    done = {name: [] for name in args.phases}
    for name in args.phases:
        phase = PHASES[name]
        for i, (row, est) in enumerate(phase_plan(args, name)):
            elapsed = time.perf_counter() - start
            if not (args.smoke and i == 0) and elapsed + est > args.budget_seconds:
                log(f"{name} [{row['label']}]: SKIPPED ({elapsed:.0f} s used of "
                    f"{args.budget_seconds:.0f} s, about {est:.0f} s needed)")
                done[name].append((row, {"status": SKIPPED}))
                continue
            t0 = time.perf_counter()
            try:
                result = phase.run(ctx, row)
            except Exception as exc:
                traceback.print_exc()
                ctx.fail(f"{name} [{row['label']}] failed: {type(exc).__name__}: {exc}")
                result = {"status": "FAIL"}
            result.update(seconds=time.perf_counter() - t0, estimate=est)
            done[name].append((row, result))
            on_row(done)
    return done


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print(dry_run(args))
        return 0
    start = time.perf_counter()
    log(f"jax {jax.__version__} on {device_description()}; comparing {args.candidate!r} "
        f"against 'xla'; phases {', '.join(args.phases)}")
    if args.candidate == "pallas" and jax.default_backend() != "gpu":
        print("No GPU here: backend 'pallas' needs one. Use --smoke (interpret) on a CPU; "
              "tests/kernels/test_kernels.py checks the CUDA lowering without a GPU.", file=sys.stderr)
        return EXIT_NO_GPU
    ctx = Context(args)

    def write_report(done):
        # Rewritten after every row, so a run killed at its time limit still leaves a report.
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_section("gpu_check", markdown(args, ctx, done, time.perf_counter() - start),
                          args.out)

    done = run_phases(args, ctx, start, write_report)
    text = markdown(args, ctx, done, time.perf_counter() - start)
    print()
    print(text)
    write_report(done)
    if args.out is not None:
        print(f"markdown report written to {args.out}")
    status, verdict = outcome(ctx, done)
    if status:
        print(f"FAILED (exit {status}): {verdict.replace('**', '')}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
