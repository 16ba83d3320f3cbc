"""The run folder: every path and file of a run, and of the protocol between the supervisor and the ranks.

A run folder is what ``hpml-compile run`` writes and ``report`` reads. One
type names all of it, so that a file is spelled once:

- ``run.json``: the run's facts and its options (:class:`~hpml_compile.runtime.job.options.RunOptions`),
  written once before any rank starts and read by every rank;
- ``plan.json``, ``plan_profile.json``: the plan the ranks run and the profile it was made for;
  ``profile.json``: the measured profile ``report`` writes;
- ``metrics/rank<r>.jsonl`` and ``tb/``: each rank's steps (:mod:`.monitor`);
- ``errors/rank<r>.txt``: a failing rank's message, so that the launcher can name the rank that failed first;
- ``started.json``: when rank 0's first step finished (the cost of a (re)start);
- ``replans.jsonl``: every decision of the closed loop; ``next.json``: the build to restart on after a switch;
- for ``run --adapt``: ``seg<k>/`` (a run folder per segment), ``checkpoints/``, ``builds/seg<k>/`` and
  ``events.jsonl``, the supervisor's log of segments, failures, re-plans and switches; across hosts,
  ``.shared-token``, by which each host checks that it reads the folder host 0 writes.

Example:
    >>> import tempfile
    >>> run = RunFolder(Path(tempfile.mkdtemp()))
    >>> run.write_error(1, "lost the peer", kind="comm"); run.read_error(1)["kind"]
    'comm'
    >>> run.append_event({"event": "segment", "segment": 0}); [e["event"] for e in run.read_events()]
    ['segment']
    >>> run.segment(2).path.name, run.error(3).relative_to(run.path).as_posix()
    ('seg2', 'errors/rank3.txt')
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...schema import write_json_atomic

__all__ = ["RunFolder", "RUN_FILE", "NEXT_FILE", "REPLANS_FILE", "EVENTS_FILE", "PROGRESS_FILE", "RUN_FILES"]

RUN_FILE = "run.json"
NEXT_FILE = "next.json"
REPLANS_FILE = "replans.jsonl"
EVENTS_FILE = "events.jsonl"
PROGRESS_FILE = "started.json"
# What one launch writes into its folder (an ``--adapt`` job's segments, events and checkpoints are not one launch's).
RUN_FILES = ("metrics", "errors", "tb", RUN_FILE, "plan.json", "plan_profile.json", "profile.json", PROGRESS_FILE,
             NEXT_FILE)


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file; a line cut short (a writer that died mid-line) is skipped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(d, dict):
            out.append(d)
    return out


def _append(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


@dataclass(frozen=True, slots=True)
class RunFolder:
    """A run folder (see the module docstring): its paths, and reading and writing its protocol files.

    Attributes:
        path: the folder.
    """

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    # --- paths -------------------------------------------------------------------------------------------------
    @property
    def run_json(self) -> Path:
        """``run.json``: the run's facts and options."""
        return self.path / RUN_FILE

    @property
    def plan(self) -> Path:
        """``plan.json``: the plan the ranks run (re-published when rows move in place)."""
        return self.path / "plan.json"

    @property
    def next(self) -> Path:
        """``next.json``: the build the next segment runs after a switch."""
        return self.path / NEXT_FILE

    @property
    def replans(self) -> Path:
        """``replans.jsonl``: the closed loop's decisions."""
        return self.path / REPLANS_FILE

    @property
    def events(self) -> Path:
        """``events.jsonl``: a supervised job's segments, failures and re-plans."""
        return self.path / EVENTS_FILE

    @property
    def started(self) -> Path:
        """``started.json``: when rank 0's first step finished."""
        return self.path / PROGRESS_FILE

    @property
    def checkpoints(self) -> Path:
        """``checkpoints/``: a supervised job's checkpoints, shared by its segments."""
        return self.path / "checkpoints"

    @property
    def shared_token(self) -> Path:
        """``.shared-token``: what host 0 of a multi-host job writes for the other hosts to read back."""
        return self.path / ".shared-token"

    @property
    def lead_file(self) -> Path:
        """``.lead``: the endpoint of the store of the host that takes a multi-host job's decisions."""
        return self.path / ".lead"

    def error(self, rank: int) -> Path:
        """``errors/rank<r>.txt``: where a failing rank writes its message."""
        return self.path / "errors" / f"rank{rank}.txt"

    def segment(self, k: int) -> RunFolder:
        """Segment ``k`` of a supervised job: a run folder of its own."""
        return RunFolder(self.path / f"seg{k}")

    def build_for(self, k: int) -> Path:
        """Where a supervised job writes the build segment ``k`` runs after a re-plan."""
        return self.path / "builds" / f"seg{k}"

    def segments(self) -> list[int]:
        """The segments this folder holds, in order."""
        return sorted(int(p.name[3:]) for p in self.path.glob("seg*") if p.name[3:].isdigit())

    # --- files ---------------------------------------------------------------------------------------------------
    def read_info(self) -> dict[str, Any]:
        """``run.json`` as written ({} when there is none)."""
        return json.loads(self.run_json.read_text()) if self.run_json.is_file() else {}

    def write_error(self, rank: int, message: str, *, kind: str) -> None:
        """Record why ``rank`` failed: ``kind`` is ``comm``, ``user``, ``crash`` or ``killed``."""
        path = self.error(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rank": rank, "time": time.time(), "message": message, "kind": kind,
                                    "user_error": kind == "user"}))

    def read_error(self, rank: int) -> dict[str, Any] | None:
        """What ``rank`` wrote when it failed, or None."""
        path = self.error(rank)
        return json.loads(path.read_text()) if path.is_file() else None

    def write_started(self, record: dict[str, Any]) -> None:
        """Rank 0's first step of this launch: ``launched_at``, ``first_step_at``, ``start_step``, ``checkpoint``."""
        write_json_atomic(record, self.started)

    def read_started(self) -> dict[str, Any] | None:
        """What :meth:`write_started` wrote, or None."""
        return json.loads(self.started.read_text()) if self.started.is_file() else None

    def write_next(self, record: dict[str, Any]) -> None:
        """Ask the supervisor to restart on another build: ``reason``, ``step``, ``build``, ``event``."""
        write_json_atomic(record, self.next)

    def read_next(self) -> dict[str, Any] | None:
        """What :meth:`write_next` wrote, or None (the segment did not switch)."""
        return json.loads(self.next.read_text()) if self.next.is_file() else None

    def append_replan(self, record: dict[str, Any]) -> None:
        """Append one closed-loop decision to ``replans.jsonl``."""
        _append(self.replans, record)

    def read_replans(self) -> list[dict[str, Any]]:
        """The closed loop's decisions, in order (a line cut short by a failure left out)."""
        return _json_lines(self.replans)

    def append_event(self, record: dict[str, Any]) -> None:
        """Append one event of a supervised job to ``events.jsonl``."""
        _append(self.events, record)

    def read_events(self) -> list[dict[str, Any]]:
        """A supervised job's events, in order."""
        return _json_lines(self.events)
