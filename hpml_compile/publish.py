"""Output folders: never destroy what the tool did not make, and publish whole or not at all.

Every folder the tool writes (a build, a re-planned build, the demo's output)
goes through :func:`publish_dir`:

- the target must not exist, be empty, or hold *only* what an earlier run of
  the same command wrote there (the caller's ``made_by`` recognises it, for a
  build by its manifest); anything else is refused with the path and the
  first foreign entry, before anything is written. A folder with a user's
  ``thesis.tex`` in it is never replaced;
- the content is written into a hidden sibling (``.NAME.tmp-*``) and renamed
  into place only when complete, so a crash or a refused plan leaves the
  previous output as it was. Replacing an earlier output takes two renames
  (old aside, new in); a crash between them leaves the old one whole in
  ``.NAME.old-*`` next to it.

Why our own: ``shutil`` and ``tempfile`` give the pieces, but the rule of what
may be replaced is this tool's.

Example:
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> made = lambda p: {"a.txt"} if (p / "a.txt").is_file() else None
    >>> publish_dir(root / "out", lambda d: (d / "a.txt").write_text("1"), made_by=made, what="toy output")
    1
    >>> publish_dir(root / "out", lambda d: (d / "a.txt").write_text("2"), made_by=made, what="toy output")
    1
    >>> (root / "out" / "a.txt").read_text()
    '2'
    >>> (root / "out" / "notes.md").write_text("mine")
    4
    >>> publish_dir(root / "out", lambda d: (d / "a.txt").write_text("3"), made_by=made, what="toy output")
    Traceback (most recent call last):
    ...
    hpml_compile.errors.OutputError: ...out holds notes.md, which hpml-compile did not write beside the toy output: ...
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
import json
from typing import Any, Callable, TypeVar

from .errors import OutputError

__all__ = ["check_output_dir", "publish_dir", "fresh_path", "read_json_lines"]

T = TypeVar("T")
MadeBy = Callable[[Path], "set[str] | None"]


def check_output_dir(path: str | os.PathLike[str], *, made_by: MadeBy, what: str) -> None:
    """Refuse ``path`` unless it is new, empty, or holds only an earlier output of the same kind.

    Args:
        path: the folder about to be written.
        made_by: the names an earlier output of this kind wrote in a folder, or None when it is not one.
        what: what is written, for the message (``"build folder"``).

    Raises:
        OutputError: ``path`` is a file, or a folder with content the tool did not write (named).
    """
    p = Path(path)
    if not p.exists():
        return
    if not p.is_dir():
        raise OutputError(f"{p} is a file, not a folder: choose a new path for the {what} "
                          f"(e.g. {fresh_path(p)})")
    entries = sorted(e.name for e in p.iterdir())
    if not entries:
        return
    ours = made_by(p)
    if ours is None:
        raise OutputError(f"{p} is not empty and is not a {what} that hpml-compile wrote (it holds "
                          f"{', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}): nothing was written; "
                          f"choose a new path, e.g. {fresh_path(p)}")
    foreign = [e for e in entries if e not in ours]
    if foreign:
        raise OutputError(f"{p} holds {foreign[0]}{f' (and {len(foreign) - 1} more)' if len(foreign) > 1 else ''}, "
                          f"which hpml-compile did not write beside the {what}: nothing was replaced; move it "
                          f"away or choose a new path, e.g. {fresh_path(p)}")


def publish_dir(final: str | os.PathLike[str], fill: Callable[[Path], T], *, made_by: MadeBy, what: str) -> T:
    """Write a folder with ``fill`` into a hidden sibling, then rename it to ``final`` (replacing an earlier one).

    Args:
        final: the folder to publish.
        fill: writes the content into the folder it is given (not ``final``); its result is returned.
        made_by: as for :func:`check_output_dir`.
        what: as for :func:`check_output_dir`.

    Returns:
        What ``fill`` returned.

    Raises:
        OutputError: ``final`` may not be replaced, or its parent cannot be written.
    """
    out = Path(final)
    check_output_dir(out, made_by=made_by, what=what)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise OutputError(f"cannot write the {what} {out}: {e.strerror or e}; choose a folder you can write") \
            from None
    try:
        result = fill(tmp)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old)  # an empty folder is replaced by a rename on POSIX
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return result


def fresh_path(p: Path) -> Path:
    """A sibling of ``p`` that does not exist yet (``build`` -> ``build2``, ``build3``, ...), for advice."""
    stem = p.name.rstrip("0123456789") or p.name
    digits = p.name[len(stem):]
    k = int(digits) + 1 if digits else 2
    while (p.parent / f"{stem}{k}").exists():
        k += 1
    return p.parent / f"{stem}{k}"


def read_json_lines(path: Path) -> list[Any]:
    """The rows of a JSON-lines file a rank appends to. A rank stopped mid-write (a kill, Ctrl-C) leaves its
    last line without its newline: that line is left out and the steps before it are kept.

    Raises:
        OutputError: a complete line does not parse (the file was damaged, not cut short).
    """
    lines = path.read_text().split("\n")
    rows = []
    for i, line in enumerate(lines[:-1]):  # the part after the last newline is a line still being written
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            raise OutputError(f"{path}: line {i + 1} is not JSON ({line[:60]!r}); the file is damaged: remove "
                              "that line to read the rest of the run") from None
    return rows
