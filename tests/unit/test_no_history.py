"""The project speaks to its users: no development history in code, comments, docs, tests or output.

Phrases that date a line by the team's own process (a work period and its number, a ticket number, a lettered
benchmark run) tell a reader when something was written, not what it does; that belongs in CHANGELOG.md, the
one file left out here. The pattern is built from pieces so that this file does not match itself.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tracked_text_files() -> dict[str, str]:
    """Every tracked file that reads as UTF-8 text, by its path relative to the repository root.

    Returns:
        ``{path: text}``; binary files (pictures) are left out.

    Raises:
        pytest.skip.Exception: outside a git checkout (an unpacked source archive has no index to list).
    """
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout, so there is no list of tracked files: {e}")
    files: dict[str, str] = {}
    for name in out.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        try:
            files[name] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return files

_PERIOD = "sess" + "ion [0-9]"
_TICKET = "iss" + "ue [0-9]+"
_RUN = r"(?-i:\bru" + r"n A[A-Z]\b)"  # a run letter is two capitals: "run as" is English
HISTORY = re.compile("|".join((_PERIOD, _TICKET, _RUN)), re.IGNORECASE)
EXEMPT = frozenset({"CHANGELOG.md"})


def history_hits(files: dict[str, str]) -> list[str]:
    """``path:line: text`` of every line that matches :data:`HISTORY`, outside :data:`EXEMPT`."""
    hits = []
    for name, text in sorted(files.items()):
        if name in EXEMPT:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{name}:{i}: {line.strip()[:160]}")
    return hits


def test_the_pattern_finds_what_it_is_meant_to_find() -> None:
    found = history_hits({"a.py": "x = 1  # fixed in Sess" + "ion 12\n", "b.md": "see iss" + "ue 40 here\n",
                          "c.md": "measured in ru" + "n AX\n", "CHANGELOG.md": "Sess" + "ion 3 notes\n",
                          "d.py": "a sessions table, an issue tracker, a running average, it is run as one plan\n"})
    assert [h.split(":")[0] for h in found] == ["a.py", "b.md", "c.md"]


def test_no_tracked_file_carries_development_history() -> None:
    hits = history_hits(tracked_text_files())
    assert not hits, ("development history belongs in CHANGELOG.md; say what the code does and why instead:\n"
                      + "\n".join(hits))
