"""The fixture of the benchmark scripts' tests: ``script``, the script a test module names
(``SCRIPT``); ``BENCHMARKS``, the scripts' folder, for a test that runs a script as a program."""

import importlib
import os

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

