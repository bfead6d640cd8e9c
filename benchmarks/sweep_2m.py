"""Wall time, CPU time and peak memory of a 2M-call fine-grained ``pallas-cache replay`` sweep
(trace generation, compiling and both offline optima included) in a fresh process; ``--baseline
DIR`` runs the same command with another checkout, interleaved, for a ratio from one series."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import load_average, markdown_table, publish, run_header, timed_subprocess  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs the console script's function (what `pallas-cache` runs) in-process, then prints the
# process's own peak RSS on stderr's last line.
_WRAPPER = """
import sys
from pallas_cache.sizing.cli import console_main
sys.argv = ["pallas-cache"] + sys.argv[1:]
rc = console_main()
hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]
print('VMHWM_KB', hwm, file=sys.stderr)
sys.exit(rc)
"""


def run(tokens: int, repo: str = REPO):
    """``(wall s, CPU s, peak GB, result rows)`` of one run of the sweep with ``repo``'s code."""
    argv = ["replay", "--synthetic", "fine-grained", "--tokens", str(tokens),
            "--cache-size", "256", "1024", "2048", "--policy", "full", "fraction:0.4",
            "--format", "json", "--quiet", "--no-compile-cache"]
    env = dict(os.environ, PYTHONPATH=repo)
    proc, seconds, cpu = timed_subprocess([sys.executable, "-c", _WRAPPER, *argv], env=env,
                                          cwd=repo, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"replay failed ({proc.returncode}): {proc.stderr[-2000:]}")
    kb = int(proc.stderr.strip().splitlines()[-1].split()[1])
    records = json.loads(proc.stdout)
    rows = records["results"] if isinstance(records, dict) else records
    return seconds, cpu, kb / 1e6, rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=41_667)
    parser.add_argument("--runs", type=int, default=1, help="runs of each build (median shown)")
    parser.add_argument("--baseline", metavar="DIR", help="another checkout to run as well")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    load = load_average()
    builds = {"this checkout": REPO} | ({"baseline": args.baseline} if args.baseline else {})
    runs = {name: [] for name in builds}
    for _ in range(args.runs):
        for name, repo in builds.items():
            runs[name].append(run(args.tokens, repo))
            print(name, runs[name][-1][:3], flush=True)
    same = all(r[3] == runs["this checkout"][0][3] for rs in runs.values() for r in rs)
    table = [[name, " / ".join(f"{r[0]:.1f}" for r in rs), " / ".join(f"{r[1]:.1f}" for r in rs),
              f"{max(r[2] for r in rs):.2f}"] for name, rs in runs.items()]
    if args.baseline:
        wall = {name: statistics.median(r[0] for r in rs) for name, rs in runs.items()}
        table.append(["this checkout / baseline (median wall)",
                      f"{wall['this checkout'] / wall['baseline']:.2f}x", "", ""])
    table.append(["target", "<= 60", "", "<= 1.5"])
    command = (f"python benchmarks/sweep_2m.py --tokens {args.tokens} --runs {args.runs}"
               + (" --baseline DIR" if args.baseline else "") + " --write")
    text = "\n".join([
        "## 2M-call fine-grained sweep (`benchmarks/sweep_2m.py`)",
        "",
        run_header(command, load=load) + " Load average at the start.",
        "",
        f"`pallas-cache replay --synthetic fine-grained --tokens {args.tokens} --cache-size 256 "
        "1024 2048 --policy full fraction:0.4 --format json --no-compile-cache` in a fresh "
        f"process ({args.tokens * 48:,} layer-calls); runs interleaved.",
        "",
        markdown_table(["build", "wall s (each run)", "CPU s (user + sys)", "peak RSS GB"], table),
        "",
        f"{len(runs['this checkout'][0][3])} result rows, "
        + ("identical in every run." if same else "NOT identical between runs."),
    ])
    publish("sweep_2m", text, args.write)


if __name__ == "__main__":
    main()
