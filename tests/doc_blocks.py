"""Code blocks of README.md and docs/*.md, found by the text before them, so that tests run the
documentation's examples as written and a page cannot drift from the code."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)


def doc_pages() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def doc_block(after: str, language: str) -> str:
    """The first fenced `language` block after the text `after`, which must occur in exactly one
    page (README.md or docs/)."""
    found = [(page, text) for page in doc_pages() if after in (text := page.read_text())]
    assert len(found) == 1, f"{after!r} is in {len(found)} pages ({', '.join(p.name for p, _ in found)}), not one"
    page, text = found[0]
    for match in FENCE.finditer(text, text.index(after)):
        if match.group(1) == language:
            return match.group(2)
    raise AssertionError(f"{page.relative_to(ROOT)} has no {language} block after {after!r}")


@dataclass(frozen=True)
class DocCommand:
    page: str  # relative to the repository root
    line: int  # of the block's opening fence
    text: str  # the command, continuation lines joined, a trailing comment dropped

    def argv(self) -> list[str]:
        return shlex.split(self.text)


def doc_commands() -> list[DocCommand]:
    """Every command line of every `bash` block of README.md and docs/: continuation lines (ending in
    a backslash) joined, comment lines and trailing comments dropped."""
    commands = []
    for page in doc_pages():
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) == "bash":
                line = text.count("\n", 0, match.start()) + 1
                commands += [DocCommand(str(page.relative_to(ROOT)), line, c) for c in block_commands(match.group(2))]
    return commands


def block_commands(block: str) -> list[str]:
    """The command lines of a bash block's text, as `doc_commands` reads them."""
    commands, pending = [], ""
    for raw in block.splitlines():
        if not pending and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        pending += raw.strip() if pending else raw.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
            continue
        commands.append(strip_comment(pending))
        pending = ""
    return commands


def strip_comment(command: str) -> str:
    """The command as written, less a trailing `# comment` (a `#` that starts a word outside quotes)."""
    words = shlex.split(command, comments=True)
    for match in [*re.finditer(r"\s#", command), None]:
        prefix = command if match is None else command[: match.start()]
        try:
            if shlex.split(prefix) == words:
                return prefix.strip()
        except ValueError:  # a quote opened in the comment
            continue
    raise AssertionError(f"cannot find the comment of {command!r}")


RUNS_VAR = "DS_OPTIMUS_DOC_RUNS"  # the file each run of a docs command is recorded in (set by conftest.py)


def ran(command: str) -> None:
    """Record that the running test runs `command`, a command of the docs as the page gives it, here and
    now (call it where the command is run). The session's end holds each test that `tests/test_docs.py`
    names for a command to having recorded that command (conftest.py)."""
    import json
    import os

    path = os.environ.get(RUNS_VAR)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "command": command}) + "\n")
