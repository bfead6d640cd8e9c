"""The fixtures of the benchmark scripts' tests: ``script``, the script a test module names, and
``gpu_check``; ``BENCHMARKS``, the scripts' folder."""

import importlib
import os
import sys

import pytest

#: benchmarks/, where the scripts the tests load live.
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks")


@pytest.fixture(scope="module")
def script(request):
    """``benchmarks/<SCRIPT>.py`` for the test module's ``SCRIPT``, imported as
    ``benchmarks.<SCRIPT>`` (the name the scripts import each other by, so a script another one
    loads is the same module)."""
    return importlib.import_module(f"benchmarks.{request.module.SCRIPT}")


@pytest.fixture(scope="module")
def gpu_check():
    """``benchmarks/gpu_check.py`` imported as its sibling scripts import it (benchmarks/ first
    on the path, removed after the module)."""
    sys.path.insert(0, BENCHMARKS)
    try:
        yield importlib.import_module("gpu_check")
    finally:
        sys.path.remove(BENCHMARKS)
