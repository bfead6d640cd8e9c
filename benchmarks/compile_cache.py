"""Wall and CPU time of one ``pallas-cache replay`` process from a cold, a warm and no persistent
compile cache, the three interleaved per round (``-- REPLAY ARGS`` replaces the default command)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import load_average, markdown_table, publish, run_header, timed_subprocess  # noqa: E402

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
    _, wall, cpu = timed_subprocess([sys.executable, "-c", CHILD, *argv], check=True, cwd=REPO,
                                    env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("replay_args", nargs="*", default=None)
    args = parser.parse_args()
    argv = args.replay_args or DEFAULT
    times = {"cold": [], "warm": [], "off": []}
    cpu = {"cold": [], "warm": [], "off": []}
    load = load_average()
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
    load = max(load, load_average())
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    command = "pallas-cache " + " ".join(argv)
    rounds = "; ".join(f"{c:.1f}, {w:.1f}, {o:.1f} s"
                       for c, w, o in zip(times["cold"], times["warm"], times["off"]))
    text = "\n".join([
        "## Compile cache: cold vs warm `pallas-cache replay` (`benchmarks/compile_cache.py`)",
        "",
        run_header(f"python benchmarks/compile_cache.py --rounds {args.rounds} --write",
                   load=load) + " Load average: the highest at the start or the end.",
        "",
        f"`{command}`, the whole process in a fresh subprocess (imports, trace, compile or cache "
        f"read, replay, offline optima, output), median of {args.rounds} interleaved rounds. "
        f"cold: empty `$XDG_CACHE_HOME/pallas-cache/jax`; warm: the cache the cold run left "
        f"({size / 2**20:.1f} MiB); off: `--no-compile-cache`.",
        "",
        markdown_table(["", "cold", "warm", "off", "cold / warm"], [
            ["wall", f"{med['cold']:.1f} s", f"{med['warm']:.1f} s", f"{med['off']:.1f} s",
             f"{med['cold'] / med['warm']:.1f}x"],
            ["CPU (user + sys)", f"{med_cpu['cold']:.1f} s", f"{med_cpu['warm']:.1f} s",
             f"{med_cpu['off']:.1f} s", f"{med_cpu['cold'] / med_cpu['warm']:.1f}x"]]),
        "",
        f"Wall time per round (cold, warm, off): {rounds}.",
    ])
    publish("compile_cache", text, args.write)


if __name__ == "__main__":
    main()
