"""Cold ``pallas-cache replay`` processes of the sizing answer (issue #63), interleaved per round:
the 500k-call three-size table on this tree and, with ``--old TREE``, on another commit's tree
(``git archive ec70e6a | tar -x -C TREE``: what moved it, the code or the machine), and
``--eviction lru`` against ``--eviction lru route_knn`` on a trace of a real Mixtral trace's
shape (338 tokens, 32 x 8, top-2). Wall and CPU (user + system) seconds of each whole process,
from an empty compile cache; the load is printed per run (the machine is shared: the ratios
within one round are what count)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import load_average, markdown_table, publish, run_header, timed_subprocess  # noqa: E402

CHILD = ("import sys; from pallas_cache.sizing.cli import console_main; "
         "sys.argv = ['pallas-cache'] + sys.argv[1:]; sys.exit(console_main())")
BIG = ["replay", "--synthetic", "fine-grained", "--tokens", "10417", "--cache-size", "256",
       "1024", "2048", "--policy", "full", "fraction:0.4"]
MIXTRAL = ["replay", "--synthetic", "mixtral-realistic", "--tokens", "338", "--eviction"]
COMMANDS = {"500k table": BIG, "lru": MIXTRAL + ["lru"],
            "lru route_knn": MIXTRAL + ["lru", "route_knn"]}


def run_once(tree: str, argv: list[str]) -> tuple[float, float, float]:
    """``(wall s, CPU s, load before)`` of one cold process of ``argv`` on ``tree``."""
    load = load_average()
    with tempfile.TemporaryDirectory() as xdg:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PALLAS_CACHE_NO_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
        env.update(XDG_CACHE_HOME=xdg, PYTHONPATH=tree)
        _, wall, cpu = timed_subprocess([sys.executable, "-c", CHILD, *argv], check=True,
                                        cwd=tree, env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
    return wall, cpu, load


SPLIT = """
import json, sys, time
from pallas_cache.sizing import synthetic, sweep
from pallas_cache.sizing.sweep import ReplayConfig, auto_cache_sizes
trace = synthetic.synthetic_trace("mixtral-realistic", num_tokens=338, seed=0)
configs = [ReplayConfig(size, policy, eviction=sys.argv[1])
           for size in auto_cache_sizes(32, 8, 2) for policy in ("full", "fraction:0.4")]
sweep.replay(trace, configs[:1])  # the backend, the optima's code: warm for both
times = {}
for phase in ("compile", "run"):
    wall, cpu = time.perf_counter(), time.process_time()
    if phase == "compile":
        sweep.precompile(32, 8, 2, configs)
    else:
        sweep.replay(trace, configs)
    times[phase] = [time.perf_counter() - wall, time.process_time() - cpu]
print(json.dumps(times))
"""


def split(eviction: str) -> dict:
    """``{"compile": [wall, cpu], "run": [wall, cpu]}`` of one eviction's lanes (10: the five
    auto sizes x full, fraction:0.4) on the 338-token trace, in a child of its own."""
    import json

    out = subprocess.run([sys.executable, "-c", SPLIT, eviction], check=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--old", help="another commit's tree to time the 500k table on")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--split", action="store_true",
                        help="only time the compile and the run of each eviction's lanes")
    args = parser.parse_args()
    if args.split:
        for _ in range(args.rounds):
            for eviction in ("lru", "route_knn"):
                load = load_average()
                times = split(eviction)
                print(f"{eviction}: compile {times['compile'][0]:.1f} s wall / "
                      f"{times['compile'][1]:.1f} s CPU, run {times['run'][0]:.1f} s wall / "
                      f"{times['run'][1]:.1f} s CPU (load {load:.1f})", flush=True)
        return
    runs: dict[str, list] = {}
    trees = [("this tree", REPO)] + ([("old tree", args.old)] if args.old else [])
    for _ in range(args.rounds):
        for name, argv in COMMANDS.items():
            for label, tree in trees if name == "500k table" else trees[:1]:
                key = f"{name} ({label})" if name == "500k table" else name
                runs.setdefault(key, []).append(run_once(tree, argv))
                wall, cpu, load = runs[key][-1]
                print(f"{key}: {wall:.1f} s wall, {cpu:.1f} s CPU, load {load:.1f}", flush=True)
    rows = []
    for key, samples in runs.items():
        rows.append([key, ", ".join(f"{w:.1f} / {c:.1f} ({l:.1f})" for w, c, l in samples),
                     f"{statistics.median(w for w, _, _ in samples):.1f} s",
                     f"{statistics.median(c for _, c, _ in samples):.1f} s"])
    ratios = []
    if "lru" in runs:
        ratios.append("lru route_knn / lru, per round: wall " + ", ".join(
            f"{k[0] / l[0]:.2f}x" for k, l in zip(runs["lru route_knn"], runs["lru"]))
            + "; CPU " + ", ".join(f"{k[1] / l[1]:.2f}x"
                                   for k, l in zip(runs["lru route_knn"], runs["lru"])))
    if args.old:
        new, old = runs["500k table (this tree)"], runs["500k table (old tree)"]
        ratios.append("500k table, this tree / old tree, per round: wall " + ", ".join(
            f"{n[0] / o[0]:.2f}x" for n, o in zip(new, old)) + "; CPU " + ", ".join(
            f"{n[1] / o[1]:.2f}x" for n, o in zip(new, old)))
    text = "\n\n".join([
        "## The sizing answer's commands, cold (issue #63)",
        run_header("python benchmarks/sizing_answer.py --rounds "
                   f"{args.rounds}" + (" --old TREE" if args.old else ""),
                   note=", on a shared machine: the load before each run is in the table"),
        markdown_table(["command", "runs (wall / CPU s (1-min load before))", "median wall",
                        "median CPU"], rows),
        "\n".join(f"- {line}" for line in ratios)])
    publish("sizing_answer", text, args.write)


if __name__ == "__main__":
    main()
