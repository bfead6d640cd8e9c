"""The test tree keeps its rules: ``tests/sizing/`` has a folder for each subpackage of
``pallas_cache/sizing/`` (a package, so its modules import by name), and every test file opens
with a docstring saying what it tests, not which issue asked for it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"

#: A docstring that names an issue instead of its subject: "#39", "issue 45", "Issue #65".
ISSUE = re.compile(r"#\d+|\bissue\s+#?\d+", re.IGNORECASE)


def subpackages(folder: Path) -> set[str]:
    return {path.parent.name for path in folder.glob("*/__init__.py")}


def test_the_sizing_tests_mirror_the_sizing_package():
    """FAILS if ``tests/sizing/`` lacks a folder for a subpackage of ``pallas_cache/sizing/``
    (its tests flat beside the others', as the 28 files once were) or has a folder that no
    subpackage names, or if a test folder has no ``__init__.py``."""
    folders = {path.name for path in (TESTS / "sizing").iterdir()
               if path.is_dir() and path.name != "__pycache__"}
    assert folders == subpackages(ROOT / "pallas_cache" / "sizing")
    assert folders == subpackages(TESTS / "sizing")


def docstring_problems(paths) -> list[str]:
    """The test files among ``paths`` with no module docstring or one naming an issue."""
    found = []
    for path in paths:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if not doc:
            found.append(f"{path}: no module docstring")
        elif ISSUE.search(doc):
            found.append(f"{path}: names an issue ({ISSUE.search(doc).group()})")
    return found


def test_every_test_file_says_what_it_tests():
    """FAILS if a ``test_*.py`` file under ``tests/`` has no module docstring, or its docstring
    names an issue ("(issue #39)") where it should say what the file tests."""
    assert docstring_problems(sorted(TESTS.rglob("test_*.py"))) == []


def test_the_docstring_check_finds_each_problem(tmp_path):
    """FAILS if the check above passes a file without a docstring or one naming an issue."""
    files = {"test_none.py": "import os\n", "test_hash.py": '"""Bad input (issue #39)."""\n',
             "test_word.py": '"""Issue 45: the timed replay."""\n',
             "test_fine.py": '"""What the cache evicts, and when."""\n'}
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    found = docstring_problems(sorted(tmp_path.glob("test_*.py")))
    assert [line.split(": ")[0].rsplit("/", 1)[-1] for line in found] == [
        "test_hash.py", "test_none.py", "test_word.py"]
