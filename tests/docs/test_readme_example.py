"""Every code block of README.md and docs/*.md runs as written, or says why not.

Python blocks are executed; ``pallas-cache`` commands followed by a ``text`` block are run and
their output compared with it, the others checked against ``--help``; the set-up commands are
checked against what CI runs (``.ci/run``). A block that cannot run here carries a
``<!-- not run: REASON -->`` line with one of the reasons of :data:`NOT_RUN`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

#: The reasons a block may give for not running, each with a phrase a block so marked must
#: contain, so that a marker cannot hide a block that would run here.
NOT_RUN = {
    "needs vLLM and a GPU": "from vllm import",
    "needs a transformers MoE model": "output_router_logits=True",
}

#: Blocks that another test runs and checks further: a phrase that finds the block, and the test
#: file that must contain it.
RUN_ELSEWHERE = {"init_recorder(": "tests/core/test_recorder.py",
                 "def test_decode_step_keeps_the_rules(": "tests/docs/test_testing_docs.py"}


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None  # the reason of a ``<!-- not run: ... -->`` line just above the fence

    def __str__(self):
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(text: str, path: Path = README) -> list[Block]:
    """The fenced blocks of a Markdown text, in order."""
    found = []
    for match in re.finditer(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", text, re.M | re.S):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        note = re.fullmatch(r"<!-- not run: (.*) -->", before.strip())
        found.append(Block(path, line, match.group(1), match.group(2),
                           note.group(1) if note else None))
    return found


def all_blocks() -> list[Block]:
    return [b for path in DOCS for b in blocks_of(path.read_text(encoding="utf-8"), path)]


def example_block(text: str) -> str | None:
    """The first ```python block after a '## Example' heading (before the next '## ' heading)."""
    section = _section_or_none(text, "Example")
    if section is None:
        return None
    block = re.search(r"^```python[ \t]*\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    return block.group(1) if block else None


def _section_or_none(text: str, heading: str) -> str | None:
    start = re.search(rf"^##\s+{re.escape(heading)}\s*$", text, flags=re.MULTILINE)
    if start is None:
        return None
    rest = text[start.end():]
    end = re.search(r"^##\s", rest, flags=re.MULTILINE)
    return rest[: end.start()] if end else rest


def _section(text: str, heading: str) -> str:
    section = _section_or_none(text, heading)
    assert section is not None, f"README.md has no '## {heading}' section"
    return section


def commands(block: Block) -> list[str]:
    """The shell lines of a bash block: continuations joined, comments and blank lines dropped."""
    joined = block.code.replace("\\\n", " ")
    lines = [line.split(" #")[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _cli(argv: list[str]) -> tuple[int, str]:
    from pallas_cache.sizing import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(argv)
        except SystemExit as exit_:  # --help
            status = exit_.code
    return status, out.getvalue()


def _pallas_cache_argv(line: str) -> list[str]:
    words = shlex.split(line)
    if ">" in words:  # a redirection to a file is the shell's, not the command's
        words = words[: words.index(">")]
    assert words[0] == "pallas-cache", line
    return words[1:]


# ---- the extractor -----------------------------------------------------------------------------


def test_the_extractors_find_the_blocks_and_their_markers():
    """FAILS if the block extractor misses a fence, a language or a not-run marker, or the
    example extractor reads past its section."""
    text = "# T\n\n## Example\n\nSome words.\n\n```python\nx = 1\n```\n\n## Next\n```python\ny\n```\n"
    assert example_block(text) == "x = 1\n"
    assert example_block("## Examples\n```python\nx\n```\n") is None
    assert example_block("## Example\ntext\n## Other\n```python\nx\n```\n") is None
    found = blocks_of("a\n<!-- not run: why -->\n```python\nx\n```\n\n```bash\ny \\\n  z # c\n```\n")
    assert [(b.line, b.lang, b.code, b.not_run) for b in found] == [
        (3, "python", "x\n", "why"), (7, "bash", "y \\\n  z # c\n", None)]
    assert commands(found[1]) == ["y    z"]


# ---- every block is one of the kinds below -----------------------------------------------------


def _kind(block: Block, following: Block | None) -> str:
    if block.not_run is not None:
        return "not run"
    if block.lang == "python":
        if any(phrase in block.code for phrase in RUN_ELSEWHERE):
            return "run elsewhere"
        return "python"
    if block.lang == "bash":
        lines = commands(block)
        if all(line.startswith("pallas-cache ") or line == "pallas-cache" for line in lines):
            if following is not None and following.lang == "text" and len(lines) == 1:
                return "command with output"
            return "commands"
        return "set-up"
    if block.lang == "text":
        return "output"
    return f"unknown ({block.lang!r})"


def classified() -> list[tuple[Block, str]]:
    blocks = all_blocks()
    return [(b, _kind(b, blocks[i + 1] if i + 1 < len(blocks) else None))
            for i, b in enumerate(blocks)]


def test_every_block_is_run_checked_or_says_why_not():
    """FAILS if a block has no language or one no test handles, a ``text`` block is not the
    output of the single ``pallas-cache`` command just above it, a not-run reason is unknown or
    marks a block without its phrase, or a block said to run elsewhere is not found there."""
    kinds = classified()
    for i, (block, kind) in enumerate(kinds):
        assert not kind.startswith("unknown"), f"{block}: {kind}"
        if kind == "output":
            assert i > 0 and kinds[i - 1][1] == "command with output", str(block)
        if kind == "not run":
            assert block.not_run in NOT_RUN, f"{block}: unknown reason {block.not_run!r}"
            assert NOT_RUN[block.not_run] in block.code, f"{block}: {block.not_run!r}?"
            compile(block.code, str(block), "exec")
        if kind == "run elsewhere":
            phrase = next(p for p in RUN_ELSEWHERE if p in block.code)
            assert phrase in (ROOT / RUN_ELSEWHERE[phrase]).read_text(), block
    # The README's example and the reference block run in tests of their own below.
    assert sum(kind == "python" for _, kind in kinds) >= 3


def _unmarked_python_blocks():
    readme = README.read_text(encoding="utf-8")
    separate = {example_block(readme), _python_in(_section(readme, "The NumPy reference"))}
    return [b for b, kind in classified() if kind == "python" and b.code not in separate]


def _python_in(section: str) -> str:
    block = re.search(r"^```python[ \t]*\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    assert block is not None
    return block.group(1)


@pytest.mark.parametrize("block", _unmarked_python_blocks(), ids=str)
def test_the_python_blocks_of_the_docs_run(block, tmp_path, monkeypatch):
    """FAILS if a python block of the README or docs/ raises (a renamed API, a missing import,
    an undefined name): each runs as written, in an empty working directory."""
    monkeypatch.chdir(tmp_path)
    exec(compile(block.code, str(block), "exec"), {"__name__": "docs_block"})


def test_the_readme_example_runs():
    assert README.exists(), f"{README} is missing"
    code = example_block(README.read_text())
    if code is None:
        pytest.fail(f"{README.name} has no ```python block under a '## Example' heading")
    exec(compile(code, f"{README.name}:## Example", "exec"), {"__name__": "readme_example"})


def test_the_reference_section_says_truthfully_that_pip_installs_it(tmp_path):
    """FAILS if `pip install .` does not package ``pallas_cache.reference`` (a user could not
    hold their decode loop to it), if the README's section says it needs a checkout, or if the
    block, saved as a script and run outside the checkout, does not run."""
    import fnmatch
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"].get("include", ["*"])
    # setuptools' find_packages, which Python 3.12+ venvs do not ship: every folder with an
    # __init__.py under a package, its dotted name kept if it matches an include pattern.
    found = [".".join(init.parent.relative_to(ROOT).parts) for init in ROOT.rglob("__init__.py")
             if not any(part.startswith(".") or part in ("build", "tests")
                        for part in init.relative_to(ROOT).parts)]
    packages = {name for name in found
                if all(".".join(name.split(".")[:i]) in found
                       for i in range(1, name.count(".") + 1))
                and any(fnmatch.fnmatchcase(name, pattern) for pattern in include)}
    assert {"pallas_cache.reference", "pallas_cache.reference.evictions"} <= set(packages)
    assert "reference" not in packages, "a top-level `reference` would claim a generic name"
    section = _section(README.read_text(), "The NumPy reference")
    assert "not installed" not in section and "PYTHONPATH" not in section, section[:300]
    script = tmp_path / "script.py"
    script.write_text(_python_in(section))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "[False  True]", run.stdout


# ---- the commands ------------------------------------------------------------------------------


def _with_output():
    kinds = classified()
    return [(block, kinds[i + 1][0]) for i, (block, kind) in enumerate(kinds)
            if kind == "command with output"]


@pytest.mark.parametrize("command, output", _with_output(), ids=lambda b: str(b))
def test_the_commands_print_what_the_docs_show(command, output):
    """FAILS if a ``pallas-cache`` command shown with its output prints anything else today
    (the README's default run included): a changed count, column, legend line or format."""
    (line,) = commands(command)
    status, out = _cli(_pallas_cache_argv(line))
    assert status == 0
    assert out == output.code, f"{command}: the output differs from {output}"


def test_every_pallas_cache_command_of_the_docs_names_real_flags():
    """FAILS if a ``pallas-cache`` command of the README or docs/ names a subcommand or a flag
    that ``pallas-cache SUBCOMMAND --help`` does not list (a renamed or removed option)."""
    helps: dict[str, str] = {}
    lines = [line for b, _ in classified() if b.lang == "bash" and b.not_run is None
             for line in commands(b) if line.split()[0] == "pallas-cache"]
    assert len(lines) >= 5
    for line in lines:
        argv = _pallas_cache_argv(line)
        sub = argv[0] if argv else ""
        if sub not in helps:
            status, helps[sub] = _cli([sub, "--help"])
            assert status == 0 and helps[sub], line
        for word in argv[1:]:
            if word.startswith("--"):
                flag = word.split("=")[0]
                assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", helps[sub]), (line, flag)


def test_the_set_up_commands_are_what_ci_runs():
    """FAILS if the README's install or test command differs from what ``.ci/run`` runs (CI
    runs the README's test command verbatim), or the README has a second install instruction."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_command = ci[ci.index("# The README's test command, verbatim:") + 1]
    ci_extra = re.search(r"pip install [^']*'(\.\[\w+\])'", "\n".join(ci)).group(1)
    set_up = [line for b, kind in classified() if kind == "set-up" and b.path == README
              for line in commands(b)]
    installs = [line for line in set_up if "pip install" in line]
    assert len(installs) == 1, installs
    assert f"'{ci_extra}'" in installs[0], (ci_extra, installs)
    assert test_command in set_up, (test_command, set_up)
    other = [b for b, kind in classified() if kind == "set-up" and b.path != README]
    assert not other, [str(b) for b in other]
