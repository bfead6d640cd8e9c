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


@pytest.mark.parametrize("argv, dtype, d_model", [
    ([], "bf16", 64),
    (["--dtype", "int8"], "int8", 64),
    (["--model", "mixtral-8x7b:int4"], "int4", 64),
    (["--model", "qwen3-30b-a3b", "--dtype", "fp32"], "fp32", 64),
])
def test_b_cpu_is_measured_at_the_dtype_asked_and_the_flags_line_says_which(
        monkeypatch, capsys, argv, dtype, d_model):
    """FAILS if bench-bandwidth measures another dtype than --dtype (or --model's, or bf16, the
    presets' released format) or its flags line does not say which dtype B_cpu is for."""
    asked = []
    timing = bandwidth.CpuPartialTiming((0.003, 0.005, 0.007, 0.009), 0.001, 0.002, 1000)

    def record(d_model, d_expert, repeats, progress=None, dtype="fp32"):
        asked.append((dtype, d_model))
        return timing

    monkeypatch.setattr(bandwidth, "cpu_partial_timing", record)
    assert cli.main(TINY + argv) == 0
    assert asked == [(dtype, d_model)]
    flags = next(line for line in capsys.readouterr().out.splitlines()
                 if line.startswith("flags:"))
    assert f"# B_cpu of {dtype} experts" in flags


@pytest.mark.parametrize("argv, dtype", [
    (["--dtype", "fp8"], "fp8"), (["--dtype", "fp16"], "fp16"),
    (["--model", "deepseek-v3"], "fp8-b128"), (["--model", "gpt-oss-120b"], "mxfp4"),
    (["--model", "mixtral-8x7b:mxfp4"], "mxfp4")])
def test_a_dtype_with_no_expert_function_is_refused_in_one_line(capsys, argv, dtype):
    """FAILS if a dtype the library's experts do not read (fp8, fp16, block formats) is measured
    as something else, or refused with more than one line or another exit status than 2."""
    assert cli.main(TINY + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pallas-cache: bench-bandwidth: no expert function reads dtype {dtype!r} "
                   f"(the library's read fp32, bf16, int8, int4), so B_cpu cannot be measured "
                   f"for it"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "int4"])
def test_the_default_expert_is_past_the_last_level_cache_at_every_dtype(dtype):
    """FAILS if the default bench expert shrinks with the dtype's bytes below 96 MiB (an int4
    expert of the fp32 bench's columns would fit a large last-level cache and measure it, not
    memory), or is needlessly larger than the next multiple of 128 columns."""
    from pallas_cache.formats import bytes_per_expert

    d_expert = bench.bench_d_expert(4096, dtype)
    assert d_expert % 128 == 0
    assert bytes_per_expert(4096, d_expert, dtype) >= bench.BENCH_EXPERT_BYTES
    assert bytes_per_expert(4096, d_expert - 128, dtype) < bench.BENCH_EXPERT_BYTES


def test_the_measurement_runs_at_each_dtype():
    """FAILS if the library's CPU path cannot run the bench's bank at a dtype (a filler bank the
    expert function refuses, an int4 row not split into groups)."""
    for dtype in ("bf16", "int8", "int4"):
        timing = bandwidth.cpu_partial_timing(64, 256, repeats=1, calls=1, dtype=dtype)
        assert timing.dtype == dtype and timing.bandwidth > 0
        assert timing.expert_bytes == bandwidth.bank_bytes(64, 256, dtype) // bandwidth.MOST
