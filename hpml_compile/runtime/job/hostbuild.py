"""``run --adapt`` across hosts: what each segment runs (a build's ranks) and what the lead decides between them.

The hosts' machinery (the job's store, beats, one decider, a lost host 0
taken over) is :mod:`.multihost`'s; this is the part that is ``run``'s own:
each segment is one torchrun launch per host of a build's ranks, and between
segments the lead re-plans (solve and codegen) as :func:`~.supervisor.supervise`
does on one host: a lost host's devices dropped, a failed rank blamed and its
device dropped or restarted, a switch the ranks chose followed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from ...plan import Plan, load_plan
from ..observe.policy import FailureLedger
from ..observe.runfolder import RunFolder
from .hosts import LOST_AFTER_S
from .launcher import LaunchSpec, launch
from .multihost import HostWork, host_job
from .options import RunOptions
from .supervisor import after_failure, after_success, plan_devices, record_moves, replan_without, start_segment

__all__ = ["supervise_hosts", "BuildWork"]


def supervise_hosts(build_dir: Path, run_dir: Path, options: RunOptions, *, host: int, nnodes: int, nproc: int,
                    endpoint: str, max_failures: int = 2, solver: str = "ilp",
                    lost_after_s: float = LOST_AFTER_S, run_info: dict[str, Any] | None = None,
                    log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run ``build_dir`` for ``options.steps`` steps on ``nnodes`` hosts, this one being ``host``.

    Args:
        build_dir: the first build (its plan's devices split over the hosts in rank order, ``nproc`` each).
        run_dir: the job's folder, the same on every host (a shared file system).
        options: the job's options (as :func:`~.supervisor.supervise`).
        host: this host's rank, 0..nnodes-1 (host 0 holds the job's store at ``endpoint`` and decides).
        nnodes: the hosts.
        nproc: ranks per host in the first segment.
        endpoint: ``HOST:PORT`` of host 0.
        max_failures: failures of one device (other than a death) before it is dropped.
        solver: the solver for re-planning after a failure.
        lost_after_s: silence after which a host is lost.
        run_info: extra facts for each segment's run.json.
        log: progress lines.

    Returns:
        The job's events on host 0 (as written to ``RUN_DIR/events.jsonl``); [] on the other hosts.

    Raises:
        SupervisorError: the run folder is not shared, host 0 was lost, or no plan fits on what is left.
        LaunchError: a rank failed on bad input.
    """
    work = BuildWork(build_dir, run_dir, options, max_failures=max_failures, solver=solver, run_info=run_info,
                     log=log)
    return host_job(work, host=host, nnodes=nnodes, nproc=nproc, endpoint=endpoint, lost_after_s=lost_after_s,
                    log=log)



class BuildWork(HostWork):
    """``run --adapt`` across hosts: each segment runs a build's ranks; the lead re-plans (solve and codegen)
    between segments, as :func:`~.supervisor.supervise` does on one host.

    Args:
        build_dir: the first build.
        run_dir: the job's folder, the same on every host.
        options: the job's options.
        max_failures: failures of one device (other than a death) before it is dropped.
        solver: the solver for re-planning after a failure.
        run_info: extra facts for each segment's run.json.
        log: progress lines.
    """

    def __init__(self, build_dir: Path, run_dir: Path, options: RunOptions, *, max_failures: int, solver: str,
                 run_info: dict[str, Any] | None, log: Callable[[str], None]) -> None:
        super().__init__(run_dir, log)
        self.build, self.options, self.solver, self.run_info = build_dir, options, solver, run_info
        self.ledger = FailureLedger(max_failures)
        self.first: list[str] = []
        self.carried: Plan | None = None
        self.plan: Plan | None = None

    def first_devices(self, nnodes: int, nproc: int) -> list[str]:
        self.first = plan_devices(load_plan(self.build / "plan.json"))
        return self.first

    def begin(self, seg: int, held: dict[int, list[str]]) -> tuple[list[str], dict[str, Any]]:
        self.plan = start_segment(self.job, self.options, self.first, self.build, seg, self.reason, self.carried,
                                  self.run_info)
        self.carried = None
        return plan_devices(self.plan), {"build": str(self.build)}

    def part(self, go: dict[str, Any], seg: int, node: int, nnodes: int) -> None:
        launch(LaunchSpec(Path(go["build"]), self.run.segment(seg).path, go["nproc"][node], nnodes=nnodes,
                          node_rank=node, rdzv_endpoint=go["endpoint"]))

    def hosts_lost(self, seg: int, lost: list[int], held: dict[int, list[str]], lost_after_s: float) -> None:
        """Drop the lost hosts' devices and re-plan for the rest."""
        assert self.plan is not None
        job = self.job
        detected = time.time()
        seg_dir = job.run.segment(seg).path
        record_moves(job, seg, seg_dir)
        devices = [d for h in lost for d in held[h]]
        ranks = plan_devices(self.plan)
        reports = [info["time"] for r in range(len(ranks)) for info in [RunFolder(seg_dir).read_error(r)] if info]
        failed_at = min(reports, default=detected - lost_after_s)  # the survivors' ranks saw it first
        for h in lost:
            job.event("failure", segment=seg, host=h, device=", ".join(held[h]), devices=held[h], cause="host lost",
                      message=f"host {h} stopped beating for {lost_after_s:g} s", failed_at=failed_at,
                      detected_at=detected, dropped=True, rank=ranks.index(held[h][0]) if held[h] else None)
            job.log(f"segment {seg}: host {h} lost (its devices {', '.join(held[h])}); dropping them")
        self.build = replan_without(job, self.plan, self.build, seg, devices, self.options, self.solver,
                                    trigger="host lost")
        self.reason = f"host(s) {', '.join(map(str, lost))} lost"

    def failed(self, seg: int, failures: dict[int, tuple[int, str]]) -> None:
        assert self.plan is not None
        self.build, self.reason, self.carried = after_failure(self.job, self.ledger, self.plan, self.build, seg,
                                                              failures, self.options, self.solver)

    def finished(self, seg: int) -> bool:
        switch = after_success(self.job, seg)
        if switch is None:
            self.job.event("done", segment=seg, steps=self.options.steps)
            return True
        self.build, self.reason = switch
        return False

    def resume(self, segments: list[dict[str, Any]]) -> None:
        self.first = list(segments[0]["devices"])
        self.build = Path(segments[-1]["build"])
        self.plan = load_plan(self.build / "plan.json")
