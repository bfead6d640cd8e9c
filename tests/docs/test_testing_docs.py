"""docs/testing.md's property test of a jitted decode step runs as written, here and from an
installed package: the block is the test."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "testing.md"
PHRASE = "def test_decode_step_keeps_the_rules("


def property_test_block(text: str) -> str:
    """The python block of the page that defines the property test (exactly one)."""
    blocks = [b for b in re.findall(r"^```python[ \t]*\n(.*?)^```", text, re.M | re.S)
              if PHRASE in b]
    assert len(blocks) == 1, f"{PAGE.name}: {len(blocks)} blocks define the property test"
    return blocks[0]


def test_the_docs_property_test_passes():
    """FAILS if the page's property test raises: a renamed strategy or assertion, a plan the
    checks reject, or a jitted step that differs from the eager one. It runs with the settings
    the page shows (deadline=None: without it, the compiling first call fails the test)."""
    code = property_test_block(PAGE.read_text(encoding="utf-8"))
    assert "deadline=None" in code
    namespace: dict = {"__name__": "docs_testing"}
    exec(compile(code, f"{PAGE.name}:property test", "exec"), namespace)
    namespace["test_decode_step_keeps_the_rules"]()


def test_the_block_is_about_twenty_lines():
    """FAILS if the page's example grows past what a reader takes in at once."""
    code = property_test_block(PAGE.read_text(encoding="utf-8"))
    lines = [line for line in code.splitlines() if line.strip()]
    assert len(lines) <= 26, len(lines)


def test_the_docs_lockstep_example_passes():
    """FAILS if the page's ``assert_lockstep`` block raises: a renamed argument or strategy, or a
    drawn sequence on which the library and the reference part."""
    blocks = [b for b in re.findall(r"^```python[ \t]*\n(.*?)^```",
                                    PAGE.read_text(encoding="utf-8"), re.M | re.S)
              if "pct.assert_lockstep(" in b]
    assert len(blocks) == 1, f"{PAGE.name}: {len(blocks)} blocks call assert_lockstep"
    exec(compile(blocks[0], f"{PAGE.name}:assert_lockstep", "exec"), {"__name__": "docs_lockstep"})
