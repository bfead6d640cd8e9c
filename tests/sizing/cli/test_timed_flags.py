"""The timed flags (``--gpu-layer-ms``, ``--gpu-expert-ms``, ``--cpu-fixed-cost``) read numbers
as every other flag does (ASCII digits, the decimal read exactly), and refuse what they cannot
time in one line, exit 2, before the replay (docs/semantics.md §11.1)."""

from __future__ import annotations

import pytest

from tests.sizing.conftest import one_line_error
from pallas_cache.sizing import cli
from pallas_cache.sizing.cli import checks
from pallas_cache.sizing.units import parse_duration

SMALL = ["replay", "--synthetic", "mixtral-like", "--tokens", "6", "--cache-size", "16",
         "--model", "mixtral-8x7b", "--link-bandwidth", "25GB/s", "--policy", "full", "-q"]


@pytest.mark.parametrize("flag", ["--gpu-layer-ms", "--gpu-expert-ms"])
@pytest.mark.parametrize("text", ["٠.٠٧", "０.０７", "0.0٧", "1_0"],
                         ids=["arabic-indic", "full-width", "mixed", "underscore"])
def test_a_timed_flag_reads_ascii_digits_only(capsys, no_replay, flag, text):
    """FAILS if ``--gpu-layer-ms ٠.٠٧`` (Arabic-Indic) or ``０.０７`` (full-width) is read as 0.07
    (``Decimal`` takes any Unicode digit) while ``--cpu-fixed-cost ٠.٠٨ms`` and every integer
    flag refuse them: one line naming the flag and ASCII digits."""
    line = one_line_error(capsys, cli.main(SMALL + [flag, text]))
    assert f"{flag} {text!r}: expected milliseconds" in line and "ASCII digits" in line


def test_a_duration_reads_its_decimal_exactly():
    """FAILS if ``0.07ms`` is ``0.07 * 1e-3 = 7.000000000000001e-05`` s where the bare ``0.07``
    is ``7e-05``: both are the double nearest the decimal's seconds."""
    assert checks.milliseconds("--gpu-layer-ms", "0.07ms") == 7e-05
    assert checks.milliseconds("--gpu-layer-ms", "0.07") == 7e-05
    assert parse_duration("0.07ms") == 7e-05
    assert parse_duration("70us") == 7e-05
    assert parse_duration("0.3us") == 3e-07


@pytest.mark.parametrize("text", ["1e1000003", "1e99999999999999999999", "1e1000003ms"])
def test_an_exponent_past_any_decimal_is_one_line(capsys, no_replay, text):
    """FAILS if ``--gpu-layer-ms 1e1000003`` ends in a ``decimal.Overflow`` traceback: one
    line saying the time must be finite."""
    line = one_line_error(capsys, cli.main(SMALL + ["--gpu-layer-ms", text]))
    assert "--gpu-layer-ms" in line and "finite" in line


def test_a_gpu_time_whose_token_time_overflows_is_refused_by_name(capsys, no_replay):
    """FAILS if ``--gpu-layer-ms 1e307`` (finite) gives ``overlap_ms_per_token: null``, or is
    refused naming the expert size and the bandwidths it did not come from: one line naming
    the GPU flag."""
    line = one_line_error(capsys, cli.main(SMALL + ["--gpu-layer-ms", "1e307"]))
    assert "check --gpu-layer-ms" in line and "--expert-bytes" not in line
