"""Wall time of one ``pallas-cache replay`` from a cold and from a warm compile cache.

Runs the console script's function (pyproject's ``pallas-cache``, in a fresh subprocess each
time, as a user runs the command) with ``XDG_CACHE_HOME`` in a temporary directory: ``cold``
starts from an empty cache directory each round, ``warm`` reruns on the cache the cold run left,
``off`` passes ``--no-compile-cache`` (compiles every time, writes nothing). Rounds interleave
the three, and each figure is a median over rounds; the whole process's wall time is measured
(imports, trace, compile or cache read, replay, offline optima, printing).

    python benchmarks/compile_cache.py [--rounds 3] [--write] [-- REPLAY ARGS...]

The default command is issue #12's target, ``pallas-cache replay --synthetic mixtral-like
--cache-size 64 128 --policy full fraction:0.4``. ``--write`` replaces the compile_cache
section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_file import write_section  # noqa: E402

DEFAULT = ["replay", "--synthetic", "mixtral-like", "--cache-size", "64", "128", "--policy",
           "full", "fraction:0.4"]
CHILD = ("import sys; from pallas_cache.sizing.cli import console_main; "
         "sys.argv = ['pallas-cache'] + sys.argv[1:]; sys.exit(console_main())")


def run_once(argv, xdg: str) -> tuple[float, float]:
    """``(wall seconds, CPU seconds)`` of one run of the command (CPU: user + system of the
    child, which a loaded machine inflates far less than the wall time)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PALLAS_CACHE_NO_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    env.update(XDG_CACHE_HOME=xdg, PYTHONPATH=REPO)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD, *argv], check=True, cwd=REPO, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("replay_args", nargs="*", default=None)
    args = parser.parse_args()
    argv = args.replay_args or DEFAULT
    times = {"cold": [], "warm": [], "off": []}
    cpu = {"cold": [], "warm": [], "off": []}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as root:
        xdg = os.path.join(root, "xdg")
        for _ in range(args.rounds):
            shutil.rmtree(xdg, ignore_errors=True)
            for name, extra in (("cold", []), ("warm", []), ("off", ["--no-compile-cache"])):
                wall, used = run_once(argv + extra, xdg)
                times[name].append(wall)
                cpu[name].append(used)
            print({k: f"{v[-1]:.1f} s" for k, v in times.items()}, flush=True)
        size = sum(os.path.getsize(os.path.join(d, f))
                   for d, _, files in os.walk(xdg) for f in files)
    load = max(load, os.getloadavg()[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    command = "pallas-cache " + " ".join(argv)
    rounds = "; ".join(f"{c:.1f}, {w:.1f}, {o:.1f} s"
                       for c, w, o in zip(times["cold"], times["warm"], times["off"]))
    text = "\n".join([
        "## Compile cache: cold vs warm `pallas-cache replay` (`benchmarks/compile_cache.py`)",
        "",
        f"`python benchmarks/compile_cache.py --rounds {args.rounds}` on "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M} (1-minute load average up to {load:.1f}). "
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.system()} {platform.machine()}; Python {platform.python_version()}, CPU "
        f"backend.",
        "",
        f"`{command}`, the whole process in a fresh subprocess (imports, trace, compile or cache "
        f"read, replay, offline optima, output), median of {args.rounds} interleaved rounds. "
        f"cold: empty `$XDG_CACHE_HOME/pallas-cache/jax`; warm: the cache the cold run left "
        f"({size / 2**20:.1f} MiB); off: `--no-compile-cache`.",
        "",
        "| | cold | warm | off | cold / warm |",
        "|---|---|---|---|---|",
        f"| wall | {med['cold']:.1f} s | {med['warm']:.1f} s | {med['off']:.1f} s | "
        f"{med['cold'] / med['warm']:.1f}x |",
        f"| CPU (user + sys) | {med_cpu['cold']:.1f} s | {med_cpu['warm']:.1f} s | "
        f"{med_cpu['off']:.1f} s | {med_cpu['cold'] / med_cpu['warm']:.1f}x |",
        "",
        f"Wall time per round (cold, warm, off): {rounds}.",
    ])
    print(text)
    if args.write:
        write_section("compile_cache", text)


if __name__ == "__main__":
    main()
