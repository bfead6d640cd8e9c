"""The capacity issue's scale target: a 2M-call fine-grained sweep, wall time and peak memory.

A fresh subprocess runs what a user would type::

    pallas-cache replay --synthetic fine-grained --tokens 41667 \\
        --cache-size 256 1024 2048 --policy full fraction:0.4 --format json --no-compile-cache

(48 layers x 128 experts, top-8: 41,667 tokens = 2,000,016 layer-calls, the trace generated in
the process, both offline optima included, no persistent compile cache so compiling counts) and
reports its wall time, CPU time (the 2 cores are shared: the fairer figure) and peak resident
set size (``VmHWM`` of the subprocess itself, read by a wrapper at exit). Targets (docs: issue
#12): <= 60 s and <= 1.5 GB on the 2-core machine; before the capacity work the same sweep took
470.8 s and 3.0 GB.

    python benchmarks/sweep_2m.py [--tokens 41667] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_file import write_section  # noqa: E402

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


def run(tokens: int):
    argv = ["replay", "--synthetic", "fine-grained", "--tokens", str(tokens),
            "--cache-size", "256", "1024", "2048", "--policy", "full", "fraction:0.4",
            "--format", "json", "--quiet", "--no-compile-cache"]
    env = dict(os.environ, PYTHONPATH=REPO)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, *argv], env=env, cwd=REPO,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        sys.exit(f"replay failed ({proc.returncode}): {proc.stderr[-2000:]}")
    kb = int(proc.stderr.strip().splitlines()[-1].split()[1])
    records = json.loads(proc.stdout)
    rows = records["results"] if isinstance(records, dict) else records
    return seconds, cpu, kb / 1e6, rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=41_667)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    seconds, cpu, gb, rows = run(args.tokens)
    calls = args.tokens * 48
    lines = [
        "## 2M-call fine-grained sweep (`benchmarks/sweep_2m.py`)",
        "",
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, {os.cpu_count()} cores "
        f"(1-minute load average {load:.1f} at the start), Python {platform.python_version()}. "
        f"`pallas-cache replay --synthetic fine-grained --tokens {args.tokens} --cache-size 256 "
        "1024 2048 --policy full fraction:0.4 --format json --no-compile-cache` in a fresh "
        f"process ({calls:,} layer-calls; trace generation, compiling and both offline optima "
        "included).",
        "",
        "| | wall s | CPU s (user + sys) | peak RSS GB |",
        "|---|---:|---:|---:|",
        "| before the capacity work (issue #12's measurement) | 470.8 | | 3.0 |",
        "| after the capacity work (2026-11-30 19:31, load 1.8) | 436.8 | 326.5 | 1.29 |",
        "| after the replay speed work (2026-11-30 22:35, load 0.4) | 105.5 | 163.0 | 1.23 |",
        f"| now | {seconds:.1f} | {cpu:.1f} | {gb:.2f} |",
        "| target | <= 60 | | <= 1.5 |",
        "",
        f"{len(rows)} result rows.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("sweep_2m", text)


if __name__ == "__main__":
    main()
