"""``pallas-cache``'s start: ``--help``, ``--version`` and a refused command line answer without
importing JAX (or NumPy), and a Ctrl-C while JAX is being imported, once work starts, is one
line and exit 130, not a traceback from inside JAX's import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import pallas_cache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HEAVY = ("jax", "jaxlib", "numpy")


def _python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PALLAS_CACHE_NO_COMPILE_CACHE="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.mark.parametrize("argv", [["--help"], ["replay", "--help"], ["--version"],
                                  ["bench-bandwidth", "--help"],
                                  ["replay", "--synthetic", "no-such-preset"]],
                         ids=["help", "replay-help", "version", "bench-help", "refused"])
def test_answers_without_importing_jax(argv):
    """FAILS if the command line (its module, the parser, the answer) imports JAX or NumPy: JAX's
    import alone is 2-9 s on a loaded machine, for a question the parser answers."""
    done = _python(f"""
        import atexit, sys
        atexit.register(lambda: print("HEAVY", sorted(m for m in {HEAVY!r} if m in sys.modules),
                                      file=sys.stderr))
        sys.argv = ["pallas-cache"] + {argv!r}
        from pallas_cache.sizing.cli import console_main
        sys.exit(console_main())
    """)
    assert done.returncode in (0, 2), done.stderr
    assert "HEAVY []" in done.stderr, done.stderr
    if argv == ["--version"]:
        assert done.stdout.strip() == f"pallas-cache {pallas_cache.__version__}"


def test_importing_the_package_imports_no_jax():
    """FAILS if ``import pallas_cache`` (which the console script's import runs first) imports
    JAX; its names still resolve, with their short reprs, on first use."""
    done = _python("""
        import sys
        import pallas_cache as pc
        import pallas_cache.sizing
        assert "jax" not in sys.modules, "import pallas_cache imported jax"
        state = pc.init(2, 4, 4)
        assert repr(state).startswith("CacheState("), repr(state)
        assert pc.sizing.replay is pallas_cache.sizing.sweep.replay
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_ctrl_c_while_jax_imports_exits_130_with_one_line():
    """FAILS if a Ctrl-C during JAX's import prints a traceback from inside it (the CLI once
    imported JAX before its signal handling started). The interrupt is sent the moment
    ``import jax`` begins, wherever that is."""
    done = _python("""
        import os, signal, sys

        class InterruptJaxImport:
            def find_spec(self, name, path=None, target=None):
                if name == "jax":
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        sys.meta_path.insert(0, InterruptJaxImport())
        sys.argv = ["pallas-cache", "replay", "--no-compile-cache", "--synthetic", "mixtral-like",
                    "--tokens", "2000"]
        from pallas_cache.sizing.cli import console_main
        sys.exit(console_main())
    """)
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr.strip() == "pallas-cache: interrupted", done.stderr


@pytest.mark.parametrize("module", ["pallas_cache.sizing.units", "argparse"])
def test_ctrl_c_while_the_cli_module_imports_exits_130_with_one_line(module):
    """FAILS if a Ctrl-C during the import of the console script's own module (before
    ``console_main`` runs: the parser, its checks, argparse) prints Python's traceback instead
    of one line and exit 130. The interrupt is sent the moment ``module`` starts importing
    there."""
    done = _python(f"""
        import os, signal, sys
        sys.modules.pop({module!r}, None)

        class InterruptImport:
            def find_spec(self, name, path=None, target=None):
                if name == {module!r} and "pallas_cache.sizing.cli" in sys.modules:
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        sys.meta_path.insert(0, InterruptImport())
        sys.argv = ["pallas-cache", "--version"]
        from pallas_cache.sizing.cli import console_main
        sys.exit(console_main())
    """)
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr == "pallas-cache: interrupted\n", done.stderr
    assert done.stdout == "", done.stdout
