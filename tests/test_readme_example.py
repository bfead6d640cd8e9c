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
