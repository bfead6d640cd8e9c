"""The README's example must run as written.

The test reads the first fenced ``python`` block under the ``## Example`` heading of README.md
and executes it, so the front-page example can never drift from the API.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def example_block(text: str) -> str | None:
    """The first ```python block after a '## Example' heading (before the next '## ' heading)."""
    heading = re.search(r"^##\s+Example\s*$", text, flags=re.MULTILINE)
    if heading is None:
        return None
    rest = text[heading.end():]
    next_heading = re.search(r"^##\s", rest, flags=re.MULTILINE)
    section = rest[: next_heading.start()] if next_heading else rest
    block = re.search(r"^```python[ \t]*\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    return block.group(1) if block else None


def test_the_example_block_is_found_by_the_extractor():
    text = "# T\n\n## Example\n\nSome words.\n\n```python\nx = 1\n```\n\n## Next\n```python\ny\n```\n"
    assert example_block(text) == "x = 1\n"
    assert example_block("## Examples\n```python\nx\n```\n") is None
    assert example_block("## Example\ntext\n## Other\n```python\nx\n```\n") is None


def test_the_readme_example_runs():
    assert README.exists(), f"{README} is missing"
    code = example_block(README.read_text())
    if code is None:
        pytest.fail(f"{README.name} has no ```python block under a '## Example' heading")
    exec(compile(code, f"{README.name}:## Example", "exec"), {"__name__": "readme_example"})


def _section(text: str, heading: str) -> str:
    start = re.search(rf"^##\s+{re.escape(heading)}\s*$", text, flags=re.MULTILINE)
    assert start is not None, f"README.md has no '## {heading}' section"
    rest = text[start.end():]
    end = re.search(r"^##\s", rest, flags=re.MULTILINE)
    return rest[: end.start()] if end else rest


def test_the_reference_section_says_truthfully_whether_pip_installs_it():
    """FAILS if the README's `from reference import ...` claims to work outside a checkout while
    `pip install .` does not package `reference` (or says it needs a checkout once it does), or
    the block no longer runs from the repository root."""
    import tomllib

    from setuptools import find_packages

    root = README.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"].get("include", ["*"])
    installed = "reference" in find_packages(str(root), include=include)
    section = _section(README.read_text(), "The NumPy reference")
    says_checkout_only = "not installed by `pip install .`" in section
    assert says_checkout_only != installed, (installed, section[:300])
    block = re.search(r"^```python[ \t]*\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    assert block is not None
    exec(compile(block.group(1), "README.md:reference", "exec"), {"__name__": "readme_reference"})
