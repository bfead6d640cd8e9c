"""``pallas-cache bench-bandwidth``: seconds, not half an hour. The CPU bank is an argument of the
one compiled loop (a closed-over bank is baked into the program), each phase says what it does
on stderr, the printed ``B_cpu`` is the library's own ``cpu_partial`` path's, and the default
bank fits the machine's memory."""

from __future__ import annotations

import jax
import pytest

from pallas_cache.sizing import bandwidth, cli
from pallas_cache.sizing.cli import bench
from pallas_cache.sizing.units import format_bandwidth, format_duration, parse_bandwidth

TINY = ["bench-bandwidth", "--mib", "1", "--d-model", "64", "--d-expert", "128", "--repeats", "1"]


def test_the_bank_is_an_argument_of_the_loop_not_a_constant(monkeypatch):
    """FAILS if the timed loop closes over the host bank: jit then bakes its bytes into the
    program as a literal (4.3 M characters of lowered text for a 2 MiB bank, and for the default
    bank a 29-minute, 20 GB compile)."""
    sizes = []
    real_jit = jax.jit

    def recording_jit(fun=None, **kwargs):
        compiled = real_jit(fun, **kwargs)
        if getattr(fun, "__name__", "") != "loop":
            return compiled

        def call(*args, **kw):
            sizes.append(len(compiled.lower(*args, **kw).as_text()))
            return compiled(*args, **kw)
        return call

    monkeypatch.setattr(jax, "jit", recording_jit)
    bandwidth.cpu_fixed_cost(d_model=256, d_expert=512, repeats=1, calls=2)  # a 2 MiB bank
    assert sizes, "the measurement did not run its loop"
    assert max(sizes) < 400_000, sizes


def test_the_printed_cpu_rate_is_the_cpu_partial_path_s(monkeypatch, capsys):
    """FAILS if --cpu-bandwidth comes from anything but cpu_partial's own times (it once came
    from NumPy's x @ W, about 2.5x what the library's path achieved in the same run), or T_cpu
    from another line."""
    timing = bandwidth.CpuPartialTiming(seconds=(0.003, 0.005, 0.007, 0.009), fixed=0.001,
                                        per_expert=0.002, expert_bytes=64 * 128 * 4)
    monkeypatch.setattr(bandwidth, "cpu_partial_timing", lambda *a, **k: timing)
    assert cli.main(TINY) == 0
    flags = next(line for line in capsys.readouterr().out.splitlines()
                 if line.startswith("flags:")).split()
    assert flags[4] == format_bandwidth(64 * 128 * 4 / 0.002)
    assert flags[6] == format_duration(0.001)


def test_a_swamped_slope_still_prints_a_positive_rate():
    """FAILS if a non-positive slope (noise on a loaded machine) gives a negative or infinite
    B_cpu instead of the lower bound of all experts' bytes over their whole time."""
    timing = bandwidth.CpuPartialTiming((0.004, 0.004, 0.003, 0.004), 0.004, -1e-5, 1000)
    assert timing.bandwidth == pytest.approx(4 * 1000 / 0.004)


def test_each_phase_says_what_it_does_on_stderr(capsys):
    """FAILS if bench-bandwidth runs silent (it once printed nothing for 29 minutes), or its
    measured rates are not replay flags."""
    assert cli.main(TINY) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert any("B_link" in line for line in lines) and any("B_cpu" in line for line in lines)
    assert sum("cpu_partial with" in line for line in lines) == bandwidth.MOST
    assert all(line.startswith("pallas-cache: bench-bandwidth: ") for line in lines)
    flags = next(line for line in captured.out.splitlines() if line.startswith("flags:")).split()
    assert parse_bandwidth(flags[4]) > 0


def test_the_default_bank_shrinks_to_the_machine():
    """FAILS if the default bank is kept where twice it plus the margin exceeds half the
    available memory, or shrinks where it fits; the CLI's expert count is the measurement's."""
    assert bench.MOST_CPU_EXPERTS == bandwidth.MOST
    assert bench.bench_bank_columns(4096, 7168, None) == (7168, False)
    assert bench.bench_bank_columns(4096, 7168, 64 * 2**30) == (7168, False)
    columns, shrunk = bench.bench_bank_columns(4096, 7168, 3 * 2**30)
    assert shrunk and columns < 7168
    assert 2 * bandwidth.bank_bytes(4096, columns) + bench.BENCH_MARGIN_BYTES <= 3 * 2**30 // 2
    assert bench.bench_bank_columns(4096, 7168, 1) == (224, True)  # never below 256 columns' half
