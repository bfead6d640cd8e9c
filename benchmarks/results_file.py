"""Writing one benchmark's section of benchmarks/RESULTS.md, leaving the others as they are.

Each section sits between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` markers, so a
benchmark rerun replaces exactly its own numbers.
"""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(name: str, markdown: str, path: Path = RESULTS) -> None:
    """Replace (or append) the section ``name`` of ``path`` with ``markdown``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    section = f"{begin}\n{markdown.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
