"""What the benchmark scripts share: timed runs (warm-up, repeats, variants interleaved), medians
and spreads, timed subprocesses, the machine/date/load line of a RESULTS.md section, tables."""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable, NamedTuple

from results_file import write_section


class Summary(NamedTuple):
    """A sample's median and range, in the samples' unit."""
    median: float
    low: float
    high: float
    count: int

    def spread(self) -> float:
        """``(high - low) / median``: how far apart the runs were (0 for one run)."""
        return (self.high - self.low) / self.median if self.median else 0.0


def summarize(samples) -> Summary:
    samples = list(samples)
    return Summary(statistics.median(samples), min(samples), max(samples), len(samples))


def interleaved(variants: dict[str, Callable[[], object]], rounds: int, *,
                warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each variant's call, ``rounds`` times, the variants taking turns within a
    round (so a change in the machine's load hits them alike); ``warmup`` untimed calls of
    each first. A variant must block until its work is done (``jax.block_until_ready``)."""
    for _ in range(warmup):
        for run in variants.values():
            run()
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def repeat_seconds(run: Callable, rounds: int, *, warmup: int = 1,
                   setup: Callable[[], object] | None = None) -> list[float]:
    """Seconds of ``rounds`` calls of ``run`` after ``warmup`` untimed ones. With ``setup``, each
    call is ``run(setup())`` and only ``run`` is timed (e.g. a fresh cache per decode)."""
    times = []
    for i in range(warmup + rounds):
        arg = () if setup is None else (setup(),)
        start = time.perf_counter()
        run(*arg)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def median_seconds(run: Callable, rounds: int, *, warmup: int = 1,
                   setup: Callable[[], object] | None = None) -> float:
    """The median of :func:`repeat_seconds`."""
    return statistics.median(repeat_seconds(run, rounds, warmup=warmup, setup=setup))


def timed_subprocess(argv: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run ``argv`` (``subprocess.run`` keywords pass through); returns the process, its wall
    seconds and its CPU seconds (user + system: a loaded machine inflates it far less than the
    wall time)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, **kwargs)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def python_child(code: str, *argv: str) -> dict:
    """Run ``python -c code argv...`` in a fresh process on the CPU backend and return the JSON
    object its last line of output prints (a figure taken inside the child, without the
    parent's imports or pages)."""
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def load_average() -> float:
    """The 1-minute load average (nan where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def machine() -> str:
    """Processor, cores, OS, Python and, once it is imported, JAX with its default device."""
    text = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{platform.system()} {platform.machine()}; Python {platform.python_version()}")
    if "jax" in sys.modules:
        import jax
        device = jax.devices()[0]
        text += f", jax {jax.__version__} on {device.platform} ({device.device_kind})"
    return text


def run_header(command: str, *, load: float | None = None, note: str = "") -> str:
    """The line every RESULTS.md section opens with: the command, the UTC date and time, the
    load average (``load``, e.g. the highest seen during the run, or now), the machine."""
    load = load_average() if load is None else load
    now = datetime.datetime.now(datetime.timezone.utc)
    return (f"`{command}` on {now:%Y-%m-%d %H:%M} UTC{note} (1-minute load average "
            f"{load:.1f}). Machine: {machine()}.")


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table; cells are written with ``str``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def section(title: str, header: str, *blocks: str) -> str:
    """A RESULTS.md section's text: its title, the run header, then the blocks (tables, notes)."""
    return "\n\n".join([f"## {title}", header, *blocks])


def publish(name: str, text: str, write: bool) -> None:
    """Print ``text``; with ``write``, make it the section ``name`` of benchmarks/RESULTS.md."""
    print(text)
    if write:
        write_section(name, text)
