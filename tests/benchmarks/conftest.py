"""The fixture of the benchmark scripts' tests: ``script``, the script a test module names."""

import importlib

import pytest


@pytest.fixture(scope="module")
def script(request):
    """``benchmarks/<SCRIPT>.py`` for the test module's ``SCRIPT``, imported as
    ``benchmarks.<SCRIPT>`` (the name the scripts import each other by, so a script another one
    loads is the same module)."""
    return importlib.import_module(f"benchmarks.{request.module.SCRIPT}")
