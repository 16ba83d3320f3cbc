"""The steps a segment ran after a replica was lost in place, and the plan they ran on, for its report.

``run --adapt`` answers a rank lost while it was one replica of a replicated
stage in place (:mod:`hpml_compile.runtime.job.hostranks`): the others take
its rows and go on in their own processes. The segment's folder then holds
the lost rank's steps up to its death and the survivors' steps to the end,
and the job's ``events.jsonl`` (in the segment folder's parent) says which
rank, which device and at which step (``replica_lost``). A summary that cut
every rank at the lost rank's last step would leave out everything the
survivors did; :func:`after_losses` gives the report the survivors' steps
since the last loss instead, against the plan without the lost devices
(each stage that lost a replica split evenly over the replicas left, as the
survivors split it).

Example:
    >>> from pathlib import Path
    >>> lost_in_place(Path("out/runs/a"))  # not a segment of a supervised job: nothing lost in place
    []
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from ...plan import Plan
from .monitor import StepMetrics
from .runfolder import RunFolder

__all__ = ["lost_in_place", "after_losses"]

_SEGMENT = re.compile(r"seg(\d+)")


def lost_in_place(run_dir: Path) -> list[dict[str, Any]]:
    """The ``replica_lost`` events of segment folder ``run_dir`` (from its job's ``events.jsonl``; [] elsewhere)."""
    m = _SEGMENT.fullmatch(run_dir.name)
    if m is None:
        return []
    return [e for e in RunFolder(run_dir.parent).read_events()
            if e["event"] == "replica_lost" and int(e["segment"]) == int(m.group(1))]


def after_losses(run_dir: Path, plan: Plan, rows: Mapping[int, Sequence[StepMetrics]]
                 ) -> tuple[Plan, dict[int, list[StepMetrics]], str | None]:
    """What to summarise of a segment where replicas were lost in place: the survivors' steps since the last loss.

    Args:
        run_dir: the segment's folder.
        plan: its plan.json (the plan before any loss).
        rows: every rank's measurements, by the rank it started as.

    Returns:
        ``(plan, rows, note)``: the plan the survivors ran (the lost devices out, rows even), their steps from the
        failed step (run again on them) on, by their rank after the loss, and a line saying so; the arguments as
        they are, and None, where no replica was lost in place.
    """
    lost = lost_in_place(run_dir)
    gone = {str(e["device"]) for e in lost}
    ranks = {int(e["rank"]) for e in lost}
    since = max((int(e["step"]) for e in lost), default=1) - 1  # 0-based: the failed step, done again
    kept = [[m for m in ms if m.step >= since] for r, ms in sorted(rows.items()) if r not in ranks]
    if not lost or not kept or not all(kept):
        return plan, {r: list(ms) for r, ms in rows.items()}, None
    stages = tuple(replace(st, devices=tuple(d for d in st.devices if d not in gone), rows=())
                   if gone & set(st.devices) else st for st in plan.stages)
    note = (f"since step {since + 1}, when {', '.join(sorted(gone))} was lost in place, on the replicas left "
            "(predicted: the plan before the loss)")
    return replace(plan, stages=stages), dict(enumerate(kept)), note
