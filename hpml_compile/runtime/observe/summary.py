"""Read a run folder: a per-stage table against the plan, the bottleneck, advice, and a measured profile.

:func:`analyse` takes every rank's ``metrics/rank<r>.jsonl``, drops the
first steps (warm-up: allocator, caches, lazy initialisation), takes each
rank's median per quantity, and averages the replicas of a stage (peak
memory: the largest). A stage whose replicas train on different rows
(``Stage.rows``) is not averaged: its replicas are not alike, so a mean would
blur a slowed replica with the others; the stage is summarised by its slowest
replica (the one the others wait for, which is what the simulator predicts
for the stage), and each replica gets its own line (:class:`ReplicaSummary`). Predicted per-stage times come from the plan in the
run folder: the simulator's per-microbatch times x the microbatches run.

:func:`measured_profile` turns the measurements into a profile ``replan`` can
use: the plan's own profile, with the costs of every node of stage ``k``
on that stage's device kind scaled by stage ``k``'s measured / predicted
ratio (forward and backward separately). The per-node split inside a stage
stays the profiler's; the stage totals become the measured ones.

A busy host is told apart from a slow plan: each rank recorded the host's
CPU steal and the load of other processes per step, and the time it lost to
them (:mod:`.host`). :func:`host_contention` finds the steps a host was busy;
the advice then takes the time lost off each rank's step
(:func:`~.policy.contention_discount`) before it compares the step with the
prediction, and says "host busy: 22% steal ... during steps 3-12" instead of
advising a re-plan: on a busy host the step's error is not the plan's to
answer for (a rank also waits for peers the host descheduled, which no
counter sees), so the advice is to measure again on a quiet host. A rank that alone computes far
over its prediction (:func:`slow_ranks`) is named: contention slows every rank
on a host alike, a slow device only its own.

Example:
    >>> tip = suggest_microbatches(stages=2, microbatches=2, bubble=0.4, rows=8)
    >>> tip.split(":")[0], "with 8 microbatches a 2-stage pipeline idles about 11%" in tip
    ('more microbatches', True)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ...ir import Cluster, NodeCost, Profile, variant_kind
from ...plan import Plan, Stage, load_plan
from ...profile import load_profile, save_profile
from ...report import host_summary, human_bytes
from .inplace import after_losses
from .monitor import StepMetrics, read_metrics
from .runfolder import RunFolder
from .policy import contention_discount, lost_share, memory_shortfalls

#: The per-stage table's columns (:func:`format_summary`) and what each shows; ``report --help`` lists them.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("stage", "the stage's index in the plan"),
    ("devices", "its devices, one per replica"),
    ("fwd ms", "forward compute per step over every microbatch, less receive waits and the collectives run "
               "inside it (a ZeRO-3 stage's parameter all-gathers)"),
    ("bwd ms", "backward compute per step, likewise"),
    ("pred f+b", "the plan's predicted forward + backward per step"),
    ("meas/pred", "measured over predicted compute (1.00: the cost model was right)"),
    ("comm ms", "point-to-point transfers, posting sends, the gradient sync, and collectives inside the compute"),
    ("idle ms", "waiting: for pipeline peers in the pipeline phase, and for the slowest member at each collective"),
    ("allred", "the gradient sync after the last backward (all-reduce, or ZeRO's reduce-scatter), ms per step"),
    ("bubble", "the idle share of the pipeline phase, as the simulator defines it"),
    ("peak mem", "the step's peak: the CUDA allocator's on a GPU, the process's resident set (RSS) on a CPU"),
)
BUSY = 0.10  # a step on a host that lost at least this share of its CPU to steal and other programs was "busy"
SLOW_RANK = 1.5  # a rank computing this many times the others' measured/predicted ratio is slow itself ...
MIN_SHARE = 0.1  # ... when the excess is at least this share of its step

__all__ = ["COLUMNS", "StageSummary", "ReplicaSummary", "RunSummary", "HostContention", "host_contention", "slow_ranks", "BUSY", "analyse", "format_summary", "predicted_bubble", "measured_profile", "export_profile",
           "suggest_microbatches", "summarise", "wall_ms", "held_peaks", "format_memory", "device_slowdowns", "measured_setup", "next_build_path"]


@dataclass(frozen=True, slots=True)
class ReplicaSummary:
    """Medians of one replica of a stage with uneven rows (ms per step)."""

    device: str
    rows: int
    fwd_ms: float
    bwd_ms: float
    allreduce_ms: float
    lost_ms: float = 0.0

    @property
    def compute_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms

    @property
    def per_row_ms(self) -> float:
        """Compute per row of a microbatch (comparable across replicas whatever their rows)."""
        return self.compute_ms / self.rows if self.rows else float("nan")


@dataclass(frozen=True, slots=True)
class StageSummary:
    """Medians of one stage over the measured steps (ms per step; predicted from the plan)."""

    stage: int
    devices: tuple[str, ...]
    fwd_ms: float
    bwd_ms: float
    comm_ms: float
    idle_ms: float
    allreduce_ms: float
    bubble: float
    peak_memory_bytes: int
    memory_kind: str
    predicted_fwd_ms: float
    predicted_bwd_ms: float
    lost_ms: float = 0.0  # time the stage's ranks waited for a core (other programs, steal), mostly inside compute
    replicas: tuple[ReplicaSummary, ...] = ()  # uneven rows: each replica (the stage's figures: its slowest one's)
    # collectives inside the forward and backward (ZeRO-3's parameter all-gathers): in comm_ms, not in fwd/bwd;
    # and the wait there for the other replicas, in idle_ms
    inner_comm_ms: float = 0.0
    inner_wait_ms: float = 0.0

    @property
    def compute_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms

    @property
    def slowest(self) -> str | None:
        """The device of the slowest replica (uneven rows; None for a stage summarised by its mean)."""
        return max(self.replicas, key=lambda r: r.compute_ms).device if self.replicas else None

    @property
    def predicted_compute_ms(self) -> float:
        return self.predicted_fwd_ms + self.predicted_bwd_ms

    @property
    def ratio(self) -> float:
        """Measured / predicted compute (1.0: the cost model was right)."""
        return self.compute_ms / self.predicted_compute_ms if self.predicted_compute_ms > 0 else float("nan")


@dataclass(frozen=True, slots=True)
class HostContention:
    """How busy one host was over the measured steps (shares of its CPU; steps counted from 1)."""

    host: str
    steal: float
    others: float
    first_step: int
    last_step: int
    busy_steps: int
    lost: float

    def describe(self) -> str:
        """``host busy: 22% steal and 31% other processes during steps 3-12 (on HOST)``."""
        parts = [f"{self.steal:.0%} steal"] if self.steal >= 0.01 else []
        parts += [f"{self.others:.0%} used by other processes"] if self.others >= 0.01 else []
        return (f"host busy: {' and '.join(parts) or 'contended'} during steps {self.first_step}-{self.last_step} "
                f"(on {self.host or 'this host'}; {self.busy_steps} busy steps)")


def host_contention(rows: Mapping[int, Sequence[StepMetrics]], busy: float = BUSY) -> list[HostContention]:
    """The hosts that were busy during the steps in ``rows`` (rank -> its measured steps).

    Per step and host the largest steal and other-process load any of its ranks saw; a host is busy when at
    least a third of the steps lost ``busy`` or more of its CPU.

    >>> row = lambda s, st, o: StepMetrics(s, 0, 0, 0, "cpu", 1, 8, 10.0, 10.0, 3.0, 6.0, host="h", steal=st,
    ...                                    others_load=o)
    >>> [c.describe() for c in host_contention({0: [row(2, 0.0, 0.0), row(3, 0.2, 0.1), row(4, 0.24, 0.1)]})]
    ['host busy: 22% steal and 10% used by other processes during steps 4-5 (on h; 2 busy steps)']
    """
    per: dict[str, dict[int, tuple[float, float]]] = {}
    for rs in rows.values():
        for m in rs:
            old = per.setdefault(m.host, {}).get(m.step, (0.0, 0.0))
            per[m.host][m.step] = (max(old[0], m.steal), max(old[1], m.others_load))
    out = []
    for host, steps in sorted(per.items()):
        hot = sorted(s for s, (st, o) in steps.items() if lost_share(st, o) >= busy)
        if not hot or len(hot) * 3 < len(steps):
            continue
        out.append(HostContention(
            host, statistics.fmean(steps[s][0] for s in hot), statistics.fmean(steps[s][1] for s in hot),
            hot[0] + 1, hot[-1] + 1, len(hot), statistics.fmean(lost_share(*v) for v in steps.values())))
    return out


def _chunks(plan: Plan, stage: int) -> list[Stage]:
    """The stages a rank of ``stage`` runs: that one, or under an interleaved plan every chunk of its device group
    (what its measured forward and backward times add up)."""
    groups = len(plan.stages) // plan.chunks
    return list(plan.stages[stage % groups::groups])


def slow_ranks(plan: Plan, rows: Mapping[int, Sequence[StepMetrics]], factor: float = SLOW_RANK,
               min_share: float = MIN_SHARE) -> dict[int, tuple[float, float]]:
    """Ranks whose compute, against their stage's prediction, is ``factor`` times the other ranks' (median).

    A rank is named only when what it computes beyond the others' ratio is at least ``min_share`` of its step:
    a stage of a few small nodes is dominated by per-call overheads the cost model leaves out, so its ratio
    can be large while the time it stands for is not.

    Returns:
        rank -> (its measured/predicted compute, the other ranks' median of it).
    """
    micro = next((rs[0].microbatches for rs in rows.values() if rs), plan.microbatches)
    ratio: dict[int, float] = {}
    pred: dict[int, float] = {}
    step: dict[int, float] = {}
    for rank, rs in rows.items():
        if not rs:
            continue
        pred[rank] = sum(c.predicted.fwd_ms + c.predicted.bwd_ms for c in _chunks(plan, rs[0].stage)) * micro
        step[rank] = _median(list(rs), lambda m: m.step_ms)
        if pred[rank] > 0:  # what it computed less what it waited for a core: a busy host is not a slow device
            ratio[rank] = _median(list(rs), lambda m: max(m.fwd_ms + m.bwd_ms - m.contention_ms,
                                                          0.1 * (m.fwd_ms + m.bwd_ms))) / pred[rank]
    out = {}
    for rank, r in ratio.items():
        others = [v for k, v in ratio.items() if k != rank]
        if not others:
            continue
        usual = statistics.median(others)
        if r > factor * usual and (r - usual) * pred[rank] >= min_share * step[rank]:
            out[rank] = (r, usual)
    return out


@dataclass(frozen=True, slots=True)
class RunSummary:
    """A run, summarised (see :func:`analyse`)."""

    plan: Plan
    steps: int
    skipped: int
    microbatches: int
    step_ms: float
    samples_per_s: float
    bubble: float
    stages: tuple[StageSummary, ...]
    bottleneck: int
    advice: tuple[str, ...]
    contention: tuple[HostContention, ...] = ()
    slow: tuple[tuple[int, float, float], ...] = ()
    held: Mapping[str, int] = field(default_factory=dict)
    host: str | None = None  # where the plan's profile was measured (report.host_summary)
    # per replicated stage: (stage, bytes its ranks put into the gradient sync per step, uncompressed figure),
    # means over the measured steps and the stage's ranks (local SGD: its averages amortised over the steps)
    sync_bytes: tuple[tuple[int, float, float], ...] = ()
    # per hierarchical all-reduce's stage: (stage, bytes a rank sent inside its host, between hosts, what a flat
    # ring would have sent) per step, means over the measured steps and the stage's ranks, as the runtime counted
    sync_levels: tuple[tuple[int, float, float, float], ...] = ()
    note: str | None = None  # which steps these are, where not all of the run's (a replica lost in place)

    @property
    def shortfalls(self) -> dict[str, int]:
        """Devices whose measured peak (``held``) exceeded their capacity, with the bytes over."""
        return memory_shortfalls(self.held, {d.name: d.memory_bytes for d in self.plan.cluster.devices})

    @property
    def predicted_step_ms(self) -> float:
        return self.plan.predicted.step_ms

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted step time."""
        p = self.predicted_step_ms
        return (self.step_ms - p) / p if p > 0 else float("nan")


def _median(rows: list[StepMetrics], get: Callable[[StepMetrics], float]) -> float:
    return float(statistics.median(get(r) for r in rows))


def suggest_microbatches(stages: int, microbatches: int, bubble: float, rows: int) -> str | None:
    """Advice to raise the microbatch count when the bubble is large and the batch allows it."""
    if stages < 2 or bubble < 0.25 or microbatches * 2 > rows:
        return None
    target = min(rows, microbatches * 4)
    ideal = (stages - 1) / (target + stages - 1)
    return (f"more microbatches: the bubble is {bubble:.0%} of the pipeline phase; with {target} microbatches a "
            f"{stages}-stage pipeline idles about {ideal:.0%} (hpml-compile compile ... --microbatches {target})")


def next_build_path(run_dir: Path) -> Path:
    """Where advice tells a re-planned build to go: a path next to the run's build that does not exist yet.

    Args:
        run_dir: the run folder (its ``run.json`` names the build it ran).

    Returns:
        ``build2`` beside ``build``, ``build4`` beside ``build3``, ...; beside ``run_dir`` without a run.json.
    """
    from ...errors import HpmlError
    from ...publish import fresh_path
    from ...schema import read_json

    build = run_dir.parent / "build"
    run_json = RunFolder(run_dir).run_json
    if run_json.is_file():
        try:
            named = read_json(run_json).get("build")
        except (HpmlError, AttributeError):
            named = None
        if isinstance(named, str) and named:
            build = Path(named)
    return fresh_path(build)


def _advice(plan: Plan, stages: list[StageSummary], bubble: float, step_ms: float, comm_ms: float,
            error: float, rows: int, run_dir: Path, busy: Sequence[HostContention] = (),
            slow: Mapping[int, tuple[float, float]] | None = None, quiet_error: float | None = None) -> list[str]:
    out: list[str] = []
    compute = [s.compute_ms for s in stages]
    mean = sum(compute) / len(compute)
    ratios = [s.ratio for s in stages if s.ratio == s.ratio]
    replan = (f"hpml-compile replan {run_dir / 'plan.json'} --profile {run_dir / 'profile.json'} "
              f"-o {next_build_path(run_dir)}")
    devices = [(st.index, d) for st in plan.stages for d in st.devices]
    for rank, (r, others) in sorted((slow or {}).items()):
        k, d = devices[rank] if rank < len(devices) else (-1, "?")
        out.append(f"slow rank: rank {rank} ({d}, stage {k}) computes {r:.2f}x its prediction where the other ranks "
                   f"run {others:.2f}x: that device is slow (a busy host slows all its ranks alike); re-plan with it "
                   f"measured: {replan}")
    quiet_error = error if quiet_error is None else quiet_error  # the step without what contention took
    if len(stages) > 1 and max(compute) > 1.15 * mean:
        b = max(range(len(stages)), key=lambda i: compute[i])
        lost = f"; it waited {stages[b].lost_ms:.0f} ms a step for a core" if stages[b].lost_ms >= 1 else ""
        out.append(f"imbalance: stage {b} computes {compute[b] / mean - 1:+.0%} against the mean stage{lost}; "
                   f"re-plan with the measured costs: {replan}")
    elif ratios and max(ratios) > 1.2 * min(ratios):
        out.append(f"the cost model is off unevenly (measured/predicted {min(ratios):.2f}..{max(ratios):.2f} "
                   f"across stages): re-plan with the measured costs: {replan}")
    tip = suggest_microbatches(len(stages), plan.microbatches, bubble, rows)
    if tip:
        out.append(tip)
    if step_ms > 0 and comm_ms / step_ms > 0.3:
        out.append(f"communication takes {comm_ms / step_ms:.0%} of the step: a bigger batch (more compute per "
                   "byte sent) or fewer stages")
    # A busy host makes the step's error unattributable: the time a rank waited for a core is counted
    # (quiet_error), but a rank that waits on a descheduled peer loses more than that, and nothing counts it. So
    # a busy host never gets step-error re-plan advice: the prediction is checked on a quiet host.
    explained = bool(busy) and error > 0.25
    for c in busy:
        if not explained:
            out.append(c.describe() + "; its steps ran slower than its devices can")
        elif quiet_error <= 0.25:
            out.append(c.describe() + f": the step's {error:+.0%} against the prediction is what it explains "
                       f"(about {max(quiet_error, -0.99):+.0%} on a quiet host), not the plan; run again on a "
                       "quiet host rather than re-planning")
        else:
            out.append(c.describe() + f": the step's {error:+.0%} against the prediction cannot be told from the "
                       f"contention (the time ranks waited for a core leaves {quiet_error:+.0%}, but ranks also "
                       "wait for peers the host descheduled, which is not counted); run again on a quiet host "
                       "before re-planning")
    if abs(error) > 0.25 and not explained:
        out.append(f"the measured step is {error:+.0%} against the prediction"
                   + (f" ({quiet_error:+.0%} with the host's contention taken off)" if busy else "")
                   + f": re-plan from the measured profile ({replan}) so the solver sees these costs")
    return out or ["balanced, and close to the plan: nothing to change"]


def analyse(run_dir: str | Path, *, skip: int | None = None) -> RunSummary:
    """Summarise a run folder.

    Where the closed loop moved rows in place (``replans.jsonl``), plan.json holds the new rows: only the steps
    since the last move are summarised against it (their first ``skip`` as warm-up). Where a replica was lost in
    place (a segment of ``run --adapt``), the survivors' steps since the loss are, on the replicas left
    (:func:`~.inplace.after_losses`).

    Args:
        run_dir: the folder ``hpml-compile run`` wrote.
        skip: warm-up steps to leave out (default: 2, or fewer for short runs).

    Raises:
        HpmlError: no measurements, or no plan.json, in ``run_dir``.
    """
    from ...errors import HpmlError

    run = Path(run_dir)
    rows = read_metrics(run)
    if not rows:
        raise HpmlError(f"{run}: no measurements (metrics/rank*.jsonl); is it the folder `hpml-compile run "
                        "--run-dir` wrote, and did a step finish?")
    if not (run / "plan.json").is_file():
        raise HpmlError(f"{run}: no plan.json; `hpml-compile run` copies the build's plan there")
    plan, rows, note = after_losses(run, load_plan(run / "plan.json"), rows)  # replicas lost in place: survivors
    moved = [e["step"] for e in RunFolder(run).read_replans() if e.get("in_place")]
    if moved:  # plan.json holds the rows moved in place at that step (runtime/job/adapt.py): the steps run on them
        since = {r: [m for m in ms if m.step >= moved[-1]] for r, ms in rows.items()}
        rows = since if all(since.values()) else rows
    s = replace(summarise(plan, rows, skip=skip, run_dir=run), note=note)
    if (run / "plan_profile.json").is_file():  # the profile the plan was predicted from (launcher copies it)
        s = replace(s, host=host_summary(load_profile(run / "plan_profile.json")))
    return s


def wall_ms(m: StepMetrics) -> float:
    """The step a rank took as its caller sees it: ``Pipeline.step``'s wall clock (``wall_ms``), or the executor's
    span (``step_ms``) in rows that predate it. What the plan's predicted step is compared with."""
    return m.wall_ms if m.wall_ms > 0 else m.step_ms


def summarise(plan: Plan, rows: Mapping[int, Sequence[StepMetrics]], *, skip: int | None = None,
              run_dir: Path = Path("RUN_DIR")) -> RunSummary:
    """Summarise measured rows (rank -> its steps, in order) against ``plan``.

    Args:
        plan: the plan the rows were measured under.
        rows: every rank's measurements (the same steps on every rank).
        skip: leading steps to leave out (default: 2, or fewer for short runs).
        run_dir: named in the advice's commands.
    """
    n = min(len(r) for r in rows.values())
    k = skip if skip is not None else min(2, max(0, n - 3))
    kept = {rank: list(rs[k:n]) for rank, rs in rows.items()}
    by_stage: dict[int, list[list[StepMetrics]]] = {}
    for _, rs in sorted(kept.items()):
        by_stage.setdefault(rs[0].stage, []).append(rs)
    micro = kept[min(kept)][0].microbatches
    stages = []
    for st in plan.stages[:len(plan.stages) // plan.chunks]:  # interleaved: a rank's rows are its chunks' sum
        ranks = by_stage.get(st.index, [])
        chunks = _chunks(plan, st.index)

        uneven = bool(st.rows) and len(set(st.rows)) > 1 and len(ranks) == len(st.devices)
        replicas: tuple[ReplicaSummary, ...] = ()
        if uneven:  # replicas with different rows are not alike: summarise the stage by its slowest one
            by_replica = sorted(ranks, key=lambda rs: rs[0].replica)
            replicas = tuple(ReplicaSummary(st.devices[j], st.rows[j], _median(rs, lambda m: m.fwd_ms),
                                            _median(rs, lambda m: m.bwd_ms), _median(rs, lambda m: m.allreduce_ms),
                                            _median(rs, lambda m: m.contention_ms))
                             for j, rs in enumerate(by_replica))
            slowest = max(range(len(replicas)), key=lambda j: replicas[j].compute_ms)
            ranks = [by_replica[slowest]]

        def med(get: Callable[[StepMetrics], float], ranks: list[list[StepMetrics]] = ranks) -> float:
            return sum(_median(rs, get) for rs in ranks) / len(ranks) if ranks else 0.0

        every = by_stage.get(st.index, [])
        stages.append(StageSummary(
            st.index, st.devices, med(lambda m: m.fwd_ms), med(lambda m: m.bwd_ms), med(lambda m: m.comm_ms),
            med(lambda m: m.idle_ms), med(lambda m: m.allreduce_ms), med(lambda m: m.bubble),
            int(max((_median(rs, lambda m: m.peak_memory_bytes) for rs in every), default=0)),
            ranks[0][0].memory_kind if ranks else "rss",
            sum(c.predicted.fwd_ms for c in chunks) * micro, sum(c.predicted.bwd_ms for c in chunks) * micro,
            med(lambda m: m.contention_ms), replicas, med(lambda m: m.inner_comm_ms), med(lambda m: m.inner_wait_ms)))
    all_rows = [m for rs in kept.values() for m in rs]
    step_ms = max(_median(rs, wall_ms) for rs in kept.values())
    samples = all_rows[0].samples
    bubble = sum(s.bubble for s in stages) / len(stages)
    comm = max(s.comm_ms for s in stages)
    bottleneck = max(range(len(stages)), key=lambda i: stages[i].compute_ms)
    pred = plan.predicted.step_ms
    error = (step_ms - pred) / pred if pred > 0 else 0.0  # no prediction: nothing to compare
    busy = host_contention(kept)
    slow = slow_ranks(plan, kept) if len(kept) > 1 else {}
    # per step: the slowest rank's time less the most any rank lost to other programs and the hypervisor (the
    # ranks of a pipeline wait for each other, so one rank's lost time delays the step for all)
    by_step = list(zip(*kept.values()))
    quiet_ms = float(statistics.median(contention_discount(max(wall_ms(m) for m in ms), max(m.contention_ms for m in ms))
                                       for ms in by_step)) if by_step else step_ms
    quiet_error = (quiet_ms - pred) / pred if pred > 0 else 0.0
    advice = _advice(plan, stages, bubble, step_ms, comm, error, samples, run_dir, busy, slow, quiet_error)
    return RunSummary(plan, n, k, micro, step_ms, samples / (step_ms / 1e3) if step_ms else 0.0, bubble,
                      tuple(stages), bottleneck, tuple(advice), tuple(busy),
                      tuple((r, a, b) for r, (a, b) in sorted(slow.items())), held_peaks(plan, rows),
                      sync_bytes=sync_bytes(plan, kept), sync_levels=sync_levels(plan, kept))


def sync_bytes(plan: Plan, rows: Mapping[int, Sequence[StepMetrics]]) -> tuple[tuple[int, float, float], ...]:
    """``(stage, sent, uncompressed)`` bytes per step and rank of each replicated stage's gradient sync."""
    out = []
    for st in plan.stages:
        mine = [m for rs in rows.values() for m in rs if m.stage == st.index]
        if len(st.devices) > 1 and mine and any(m.sync_dense_bytes for m in mine):
            out.append((st.index, sum(m.sync_bytes for m in mine) / len(mine),
                        sum(m.sync_dense_bytes for m in mine) / len(mine)))
    return tuple(out)


def sync_levels(plan: Plan, rows: Mapping[int, Sequence[StepMetrics]]
                ) -> tuple[tuple[int, float, float, float], ...]:
    """``(stage, inside the host, between hosts, flat ring)`` bytes per step and rank of each stage whose ranks ran
    hierarchical all-reduces (its own, or a tied group's), as the runtime counted them."""
    out = []
    for st in plan.stages:
        mine = [m for rs in rows.values() for m in rs if m.stage == st.index]
        if mine and any(m.sync_flat_bytes for m in mine):
            n = len(mine)
            out.append((st.index, sum(m.sync_intra_bytes for m in mine) / n, sum(m.sync_inter_bytes for m in mine) / n,
                        sum(m.sync_flat_bytes for m in mine) / n))
    return tuple(out)


def format_sync(s: RunSummary) -> list[str]:
    """One line per replicated stage: the bytes its gradient sync sent per step against the uncompressed figure; the
    time of the collectives run inside a stage's forward and backward (ZeRO-3's gathers); hierarchical syncs' bytes."""
    p = s.plan
    lines = []
    for k, sent, dense in s.sync_bytes:
        zero = int(p.stages[k].zero)
        how = p.stages[k].compress or (f"local SGD every {p.sync_every}" if p.sync_every > 1 else
                                       f"reduce-scatter, ZeRO-{zero}" if zero else "all-reduce")
        lines.append(f"  gradient sync, stage {k} ({how}): {human_bytes(sent)} per step per rank against "
                     f"{human_bytes(dense)} uncompressed ({sent / dense:.1%})")
    for st in s.stages:
        if st.inner_comm_ms > 0 or st.inner_wait_ms > 0:
            what = ("ZeRO-3's parameter all-gathers, one per microbatch's forward and one per backward"
                    if int(p.stages[st.stage].zero) == 3 else "the parameter all-gathers waited for there")
            lines.append(f"  collectives inside the forward and backward, stage {st.stage} ({what}): "
                         f"{st.inner_comm_ms:.1f} ms per step (in comm ms, not in fwd/bwd; the plan prices them "
                         f"with the stage's sync), {st.inner_wait_ms:.1f} ms waiting for the replicas (in idle ms)")
    for k, intra, inter, flat in s.sync_levels:
        what = "hierarchical reduce-scatter + all-gather (ZeRO-1)" if p.stages[k].zero else "hierarchical all-reduce"
        lines.append(f"  {what}, stage {k}: {human_bytes(inter)} between hosts + {human_bytes(intra)} "
                     f"inside the host per step per rank; a flat ring: {human_bytes(flat)}, every byte over its "
                     f"slowest hop, between hosts ({inter / flat:.1%} of it crosses the hosts now)")
    return lines


def held_peaks(plan: Plan, rows: Mapping[int, Sequence[StepMetrics]]) -> dict[str, int]:
    """Each device's measured peak: the most bytes its rank's tensors held in any step (warm-up included:
    the first step allocates the optimizer state, and a peak is a peak). Devices without the count are left out."""
    out: dict[str, int] = {}
    for rs in rows.values():
        held = [m.held_bytes for m in rs if m.held_bytes > 0]
        if held and rs[0].stage < len(plan.stages) and rs[0].replica < len(plan.stages[rs[0].stage].devices):
            out[plan.stages[rs[0].stage].devices[rs[0].replica]] = max(held)
    return out


def format_memory(s: RunSummary) -> list[str]:
    """The memory lines of :func:`format_summary`: each device's peak against its capacity and the prediction,
    then every device over its capacity with the shortfall."""
    if not s.held:
        return []
    where = {d: st for st in s.plan.stages for d in st.devices}
    rss = {st.stage: st.peak_memory_bytes for st in s.stages if st.memory_kind == "rss"}
    parts = []
    for d, b in s.held.items():
        pred = where[d].predicted.memory_bytes if d in where else 0
        # a CPU device's memory is its process's: the prediction counts it (memory.process_bytes), so the
        # process's peak resident set is what it is compared with; the tensors are shown beside it
        proc = rss.get(where[d].index) if d in where and s.plan.cluster.device(d).is_cpu else None
        parts.append(f"{d} {human_bytes(b)}" + (f" in tensors, its process {human_bytes(proc)} (peak RSS)"
                                                 if proc else "")
                     + f" of {human_bytes(s.plan.cluster.device(d).memory_bytes)}"
                     + (f" (predicted {human_bytes(pred)})" if pred else ""))
    lines = ["  memory held at the peak (tensors, by storage): " + ", ".join(parts)]
    for d, over in s.shortfalls.items():
        dev = s.plan.cluster.device(d)
        lines.append(f"over memory: {d} ({dev.kind}) held {human_bytes(s.held[d])} at its peak, above its capacity "
                     f"of {human_bytes(dev.memory_bytes)}: short by {human_bytes(over)}; the plan does not fit "
                     "there: re-plan with less memory for it (the closed loop, run --adapt, does), or give it more")
    return lines


def predicted_bubble(plan: Plan) -> float:
    """The bubble the plan predicts as the ranks measure it: the mean over stages of the idle share of each
    stage's own pipeline phase (a plan without per-stage bubbles: its whole-pipeline bubble)."""
    own = [st.predicted.bubble for st in plan.stages]
    return plan.predicted.bubble if any(b is None for b in own) else sum(own) / len(own)  # type: ignore[arg-type]


def format_summary(s: RunSummary) -> str:
    """The per-stage table, measured against predicted, then the bottleneck and the advice."""
    p = s.plan
    lines = [f"{p.model}: {len(p.stages)} stages, {s.microbatches} microbatches, {p.schedule.value}; "
             f"{s.steps - s.skipped} steps measured (first {s.skipped} skipped as warm-up)"
             + (f"; {s.note}" if s.note else ""),
             f"  {'stage':>5s} {'devices':12s} {'fwd ms':>8s} {'bwd ms':>8s} {'pred f+b':>9s} {'meas/pred':>9s} "
             f"{'comm ms':>8s} {'idle ms':>8s} {'allred':>7s} {'bubble':>7s} {'peak mem':>10s}"]
    for st in s.stages:
        none = f"{'-':>9s} {'-':>9s}"
        pred = f"{st.predicted_compute_ms:9.1f} {st.ratio:9.2f}" if st.predicted_compute_ms > 0 else none
        lines.append(f"  {st.stage:5d} {','.join(st.devices)[:12]:12s} {st.fwd_ms:8.1f} {st.bwd_ms:8.1f} "
                     f"{pred} {st.comm_ms:8.1f} {st.idle_ms:8.1f} "
                     f"{st.allreduce_ms:7.1f} {st.bubble:7.1%} {human_bytes(st.peak_memory_bytes):>10s}"
                     + (" (RSS)" if st.memory_kind == "rss" else ""))
        for r in st.replicas:  # uneven rows: each replica, the stage's line being its slowest one's
            lines.append(f"  {'':5s}   {r.device[:10]:10s} {r.fwd_ms:8.1f} {r.bwd_ms:8.1f}   rows {r.rows}, "
                         f"{r.per_row_ms:.2f} ms per row{' (the slowest: the stage line)' if r.device == st.slowest else ''}"
                         + (f", waited {r.lost_ms:.0f} ms for a core" if r.lost_ms >= 1 else ""))
    step_pred = s.predicted_step_ms
    vs = f"predicted {step_pred:.1f} ms ({s.error:+.1%})" if step_pred > 0 else "no prediction in the plan"
    lines.append(f"  step: measured {s.step_ms:.1f} ms, {vs}; {s.samples_per_s:.1f} samples/s; "
                 f"bubble {s.bubble:.1%}" + (f" (predicted {predicted_bubble(p):.1%})" if step_pred > 0 else ""))
    lines += format_memory(s)
    lines += format_sync(s)
    if s.host:
        lines.append(f"  prediction {s.host}")
    b = s.stages[s.bottleneck]
    lines.append(f"bottleneck: stage {b.stage} on {', '.join(b.devices)}, {b.compute_ms:.1f} ms of compute per step"
                 + (f" (predicted {b.predicted_compute_ms:.1f} ms)" if b.predicted_compute_ms > 0 else ""))
    lines += [f"advice: {a}" for a in s.advice]
    return "\n".join(lines)


def measured_profile(profile: Profile, s: RunSummary, *, source: str = "runtime",
                     slow: Mapping[str, float] | None = None) -> Profile:
    """The plan's profile with each stage's node costs scaled to the measured stage times.

    Args:
        profile: the profile the plan was made for.
        s: the run's summary.
        source: recorded in ``devices[kind]["measured_from"]``.
        slow: device -> slow-down of that device itself (:func:`device_slowdowns`); divided out of its
            stage's ratio, so the nodes keep the costs of a healthy device of the kind.

    Returns:
        A profile of the same nodes; the stage devices' kinds carry measured costs.
    """
    plan, slow = s.plan, slow or {}
    scale: dict[str, tuple[str, float, float]] = {}
    for st, m in zip(plan.stages, s.stages):
        kinds = {plan.cluster.device(d).kind for d in st.devices}
        # the stage's figures are its slowest replica's under uneven rows, the mean of its replicas otherwise
        own = slow.get(m.slowest, 1.0) if m.slowest else statistics.fmean(slow.get(d, 1.0) for d in st.devices)
        f = m.fwd_ms / m.predicted_fwd_ms / own if m.predicted_fwd_ms > 0 else 1.0
        b = m.bwd_ms / m.predicted_bwd_ms / own if m.predicted_bwd_ms > 0 else 1.0
        for node in (n for c in _chunks(plan, st.index) for n in c.nodes):  # interleaved: every chunk of the group
            for kind in kinds:
                scale[f"{node}\0{kind}"] = (kind, f, b)
    nodes = []
    touched: set[str] = set()
    for n in profile.nodes:
        cost = dict(n.cost)
        for kind, c in n.cost.items():
            key = f"{n.name}\0{kind}"
            if key in scale:
                _, f, b = scale[key]
                cost[kind] = _scaled(c, f, b)
                touched.add(kind)
        nodes.append(replace(n, cost=cost))
    devices = {k: dict(v) for k, v in profile.devices.items()}
    for kind in touched:
        devices.setdefault(kind, {})
        devices[kind].update(measured=True, measured_from=source)
    return _with_totals(replace(profile, nodes=tuple(nodes), devices=devices), touched)


def _scaled(c: NodeCost, f: float, b: float) -> NodeCost:
    """``c`` with every forward time (total, spread, fixed part) times ``f`` and every backward one times ``b``."""
    return replace(c, measured=True, **{x.name: getattr(c, x.name) * (f if x.name.startswith("fwd_") else b)
                                        for x in fields(c) if x.name.startswith(("fwd_", "bwd_"))})


def _with_totals(p: Profile, kinds: set[str]) -> Profile:
    totals = dict(p.totals)
    for kind in kinds:
        totals[kind] = NodeCost(sum(n.cost[kind].fwd_ms for n in p.nodes if kind in n.cost),
                                sum(n.cost[kind].bwd_ms for n in p.nodes if kind in n.cost), True)
    return replace(p, totals=totals)


def _own_compute(m: StepMetrics) -> float:
    """A step's compute less what the rank waited for a core (at least a tenth of it), as :func:`slow_ranks`."""
    return max(m.fwd_ms + m.bwd_ms - m.contention_ms, 0.1 * (m.fwd_ms + m.bwd_ms))


def device_slowdowns(plan: Plan, baseline: Mapping[int, Sequence[StepMetrics]],
                     recent: Mapping[int, Sequence[StepMetrics]], threshold: float) -> dict[str, float]:
    """Devices whose own compute grew by more than ``threshold`` since the baseline steps.

    Each rank runs the same nodes in every step of a plan, so a stage whose
    compute time grows while the plan stays the same is a device that became
    slower (throttled, shared, failing), not a cost model that was wrong.
    A step's compute counts less the time the rank waited for a core
    (``contention_ms``, as :func:`slow_ranks` counts it): that waiting comes
    and goes with the host's other programs, and in the few steps of a
    window it moved the ratio, which is the slowed kind's cost multiplier
    and so decides a row move's split, from 2.6x to 6.2x for one injected
    slow-down (benchmarks/uneven_rows, ``--splits``).

    Args:
        plan: the plan both windows ran (ranks in its device order).
        baseline: rank -> early steps of the plan (after warm-up).
        recent: rank -> the latest steps.
        threshold: recent / baseline compute above which a device counts as slowed.

    Returns:
        device name -> recent / baseline compute (only the slowed devices).

    >>> from hpml_compile.testing import chain_graph, cluster_of
    >>> from hpml_compile.solve import solve
    >>> plan = solve(chain_graph([{"cpu": (1.0, 2.0)}] * 4), cluster_of(["cpu", "cpu"]), solver="uniform")
    >>> row = lambda r, c: StepMetrics(0, r, r, 0, "cpu", 1, 8, 10.0, 10.0, c / 3, 2 * c / 3)
    >>> device_slowdowns(plan, {0: [row(0, 3.0)], 1: [row(1, 3.0)]}, {0: [row(0, 3.1)], 1: [row(1, 9.0)]}, 1.25)
    {'d1': 3.0}
    """
    devices = [d for st in plan.stages for d in st.devices]
    out: dict[str, float] = {}
    for rank, rs in recent.items():
        before = statistics.median(_own_compute(m) for m in baseline.get(rank, ())) if baseline.get(rank) else 0
        now = statistics.median(_own_compute(m) for m in rs) if rs else 0.0
        if before > 0 and now / before > threshold:
            out[devices[rank]] = now / before
    return out


def measured_setup(profile: Profile, s: RunSummary, slow: Mapping[str, float], *,
                   source: str = "runtime") -> tuple[Profile, Cluster]:
    """The measured profile and the cluster as the job sees it now: slowed devices get a kind of their own.

    A device in ``slow`` becomes a :func:`~hpml_compile.ir.variant_kind` of its
    kind (``cpu~cpu1``) whose every node costs ``slow[device]`` times the
    measured cost on a healthy device of the kind, so the solver moves work
    off that device, not off the nodes it happened to run.

    Returns:
        The profile (with the variant kinds' costs) and the plan's cluster with those kinds.
    """
    prof = measured_profile(profile, s, source=source, slow=slow)
    cluster = s.plan.cluster
    variants = {d: variant_kind(cluster.device(d).kind, d) for d in slow}
    base_of = {d: cluster.device(d).kind for d in slow}
    nodes = []
    for n in prof.nodes:
        cost = dict(n.cost)
        for d, kind in variants.items():
            cost[kind] = _scaled(n.cost[base_of[d]], slow[d], slow[d])
        nodes.append(replace(n, cost=cost))
    devices = {k: dict(v) for k, v in prof.devices.items()}
    for d, kind in variants.items():
        devices[kind] = {"measured": True, "measured_from": source, "device": d, "base_kind": base_of[d],
                         "slowdown": round(slow[d], 4)}
    prof = _with_totals(replace(prof, nodes=tuple(nodes), devices=devices), set(variants.values()))
    opt = dict(getattr(prof, "optimizer_ms", {}) or {})  # the optimizer step runs on the slowed device too
    if opt:
        opt.update({kind: opt[base_of[d]] * slow[d] for d, kind in variants.items() if base_of[d] in opt})
        prof = replace(prof, optimizer_ms=opt)
    new_cluster = replace(cluster, devices=tuple(replace(x, kind=variants[x.name]) if x.name in variants else x
                                                 for x in cluster.devices))
    return prof, new_cluster


def export_profile(run_dir: str | Path, s: RunSummary | None = None) -> Path | None:
    """Write ``RUN_DIR/profile.json``, the measured profile (None when the run folder has no plan profile)."""
    run = Path(run_dir)
    src = run / "plan_profile.json"
    if not src.is_file():
        return None
    s = s or analyse(run)
    prof = measured_profile(load_profile(src), s, source=str(run))
    return save_profile(prof, run / "profile.json")
