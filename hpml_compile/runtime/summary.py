"""Read a run folder: a per-stage table against the plan, the bottleneck, advice, and a measured profile.

:func:`analyse` takes every rank's ``metrics/rank<r>.jsonl``, drops the
first steps (warm-up: allocator, caches, lazy initialisation), takes each
rank's median per quantity, and averages the replicas of a stage (peak
memory: the largest). Predicted per-stage times come from the plan in the
run folder: the simulator's per-microbatch times x the microbatches run.

:func:`measured_profile` turns the measurements into a profile ``replan`` can
use: the plan's own profile, with the costs of every node of stage ``k``
on that stage's device kind scaled by stage ``k``'s measured / predicted
ratio (forward and backward separately). The per-node split inside a stage
stays the profiler's; the stage totals become the measured ones.

Example:
    >>> tip = suggest_microbatches(stages=2, microbatches=2, bubble=0.4, rows=8)
    >>> tip.split(":")[0], "with 8 microbatches a 2-stage pipeline idles about 11%" in tip
    ('more microbatches', True)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..ir import Cluster, NodeCost, Profile, variant_kind
from ..plan import Plan, load_plan
from ..profile import load_profile, save_profile
from ..report import host_summary, human_bytes
from .monitor import StepMetrics, read_metrics

__all__ = ["StageSummary", "RunSummary", "analyse", "format_summary", "predicted_bubble", "measured_profile", "export_profile",
           "suggest_microbatches", "summarise", "device_slowdowns", "measured_setup", "next_build_path"]


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

    @property
    def compute_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms

    @property
    def predicted_compute_ms(self) -> float:
        return self.predicted_fwd_ms + self.predicted_bwd_ms

    @property
    def ratio(self) -> float:
        """Measured / predicted compute (1.0: the cost model was right)."""
        return self.compute_ms / self.predicted_compute_ms if self.predicted_compute_ms > 0 else float("nan")


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
    host: str | None = None  # where the plan's profile was measured (report.host_summary)

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
    from ..errors import HpmlError
    from ..publish import fresh_path
    from ..schema import read_json

    build = run_dir.parent / "build"
    if (run_dir / "run.json").is_file():
        try:
            named = read_json(run_dir / "run.json").get("build")
        except (HpmlError, AttributeError):
            named = None
        if isinstance(named, str) and named:
            build = Path(named)
    return fresh_path(build)


def _advice(plan: Plan, stages: list[StageSummary], bubble: float, step_ms: float, comm_ms: float,
            error: float, rows: int, run_dir: Path) -> list[str]:
    out: list[str] = []
    compute = [s.compute_ms for s in stages]
    mean = sum(compute) / len(compute)
    ratios = [s.ratio for s in stages if s.ratio == s.ratio]
    replan = (f"hpml-compile replan {run_dir / 'plan.json'} --profile {run_dir / 'profile.json'} "
              f"-o {next_build_path(run_dir)}")
    if len(stages) > 1 and max(compute) > 1.15 * mean:
        b = max(range(len(stages)), key=lambda i: compute[i])
        out.append(f"imbalance: stage {b} computes {compute[b] / mean - 1:+.0%} against the mean stage; re-plan "
                   f"with the measured costs: {replan}")
    elif ratios and max(ratios) > 1.2 * min(ratios):
        out.append(f"the cost model is off unevenly (measured/predicted {min(ratios):.2f}..{max(ratios):.2f} "
                   f"across stages): re-plan with the measured costs: {replan}")
    tip = suggest_microbatches(len(stages), plan.microbatches, bubble, rows)
    if tip:
        out.append(tip)
    if step_ms > 0 and comm_ms / step_ms > 0.3:
        out.append(f"communication takes {comm_ms / step_ms:.0%} of the step: a bigger batch (more compute per "
                   "byte sent) or fewer stages")
    if abs(error) > 0.25:
        out.append(f"the measured step is {error:+.0%} against the prediction: re-plan from the measured "
                   f"profile ({replan}) so the solver sees these costs")
    return out or ["balanced, and close to the plan: nothing to change"]


def analyse(run_dir: str | Path, *, skip: int | None = None) -> RunSummary:
    """Summarise a run folder.

    Args:
        run_dir: the folder ``hpml-compile run`` wrote.
        skip: warm-up steps to leave out (default: 2, or fewer for short runs).

    Raises:
        HpmlError: no measurements, or no plan.json, in ``run_dir``.
    """
    from ..errors import HpmlError

    run = Path(run_dir)
    rows = read_metrics(run)
    if not rows:
        raise HpmlError(f"{run}: no measurements (metrics/rank*.jsonl); is it the folder `hpml-compile run "
                        "--run-dir` wrote, and did a step finish?")
    if not (run / "plan.json").is_file():
        raise HpmlError(f"{run}: no plan.json; `hpml-compile run` copies the build's plan there")
    s = summarise(load_plan(run / "plan.json"), rows, skip=skip, run_dir=run)
    if (run / "plan_profile.json").is_file():  # the profile the plan was predicted from (launcher copies it)
        s = replace(s, host=host_summary(load_profile(run / "plan_profile.json")))
    return s


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
    for st in plan.stages:
        ranks = by_stage.get(st.index, [])

        def med(get: Callable[[StepMetrics], float], ranks: list[list[StepMetrics]] = ranks) -> float:
            return sum(_median(rs, get) for rs in ranks) / len(ranks) if ranks else 0.0

        stages.append(StageSummary(
            st.index, st.devices, med(lambda m: m.fwd_ms), med(lambda m: m.bwd_ms), med(lambda m: m.comm_ms),
            med(lambda m: m.idle_ms), med(lambda m: m.allreduce_ms), med(lambda m: m.bubble),
            int(max((_median(rs, lambda m: m.peak_memory_bytes) for rs in ranks), default=0)),
            ranks[0][0].memory_kind if ranks else "rss",
            st.predicted.fwd_ms * micro, st.predicted.bwd_ms * micro))
    all_rows = [m for rs in kept.values() for m in rs]
    step_ms = max(_median(rs, lambda m: m.step_ms) for rs in kept.values())
    samples = all_rows[0].samples
    bubble = sum(s.bubble for s in stages) / len(stages)
    comm = max(s.comm_ms for s in stages)
    bottleneck = max(range(len(stages)), key=lambda i: stages[i].compute_ms)
    pred = plan.predicted.step_ms
    error = (step_ms - pred) / pred if pred > 0 else 0.0  # no prediction: nothing to compare
    advice = _advice(plan, stages, bubble, step_ms, comm, error, samples, run_dir)
    return RunSummary(plan, n, k, micro, step_ms, samples / (step_ms / 1e3) if step_ms else 0.0, bubble,
                      tuple(stages), bottleneck, tuple(advice))


def predicted_bubble(plan: Plan) -> float:
    """The bubble the plan predicts as the ranks measure it: the mean over stages of the idle share of each
    stage's own pipeline phase (a plan without per-stage bubbles: its whole-pipeline bubble)."""
    own = [st.predicted.bubble for st in plan.stages]
    return plan.predicted.bubble if any(b is None for b in own) else sum(own) / len(own)  # type: ignore[arg-type]


def format_summary(s: RunSummary) -> str:
    """The per-stage table, measured against predicted, then the bottleneck and the advice."""
    p = s.plan
    lines = [f"{p.model}: {len(p.stages)} stages, {s.microbatches} microbatches, {p.schedule.value}; "
             f"{s.steps - s.skipped} steps measured (first {s.skipped} skipped as warm-up)",
             f"  {'stage':>5s} {'devices':12s} {'fwd ms':>8s} {'bwd ms':>8s} {'pred f+b':>9s} {'meas/pred':>9s} "
             f"{'comm ms':>8s} {'idle ms':>8s} {'allred':>7s} {'bubble':>7s} {'peak mem':>10s}"]
    for st in s.stages:
        none = f"{'-':>9s} {'-':>9s}"
        pred = f"{st.predicted_compute_ms:9.1f} {st.ratio:9.2f}" if st.predicted_compute_ms > 0 else none
        lines.append(f"  {st.stage:5d} {','.join(st.devices)[:12]:12s} {st.fwd_ms:8.1f} {st.bwd_ms:8.1f} "
                     f"{pred} {st.comm_ms:8.1f} {st.idle_ms:8.1f} "
                     f"{st.allreduce_ms:7.1f} {st.bubble:7.1%} {human_bytes(st.peak_memory_bytes):>10s}"
                     + (" (RSS)" if st.memory_kind == "rss" else ""))
    step_pred = s.predicted_step_ms
    vs = f"predicted {step_pred:.1f} ms ({s.error:+.1%})" if step_pred > 0 else "no prediction in the plan"
    lines.append(f"  step: measured {s.step_ms:.1f} ms, {vs}; {s.samples_per_s:.1f} samples/s; "
                 f"bubble {s.bubble:.1%}" + (f" (predicted {predicted_bubble(p):.1%})" if step_pred > 0 else ""))
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
        own = statistics.fmean(slow.get(d, 1.0) for d in st.devices)
        f = m.fwd_ms / m.predicted_fwd_ms / own if m.predicted_fwd_ms > 0 else 1.0
        b = m.bwd_ms / m.predicted_bwd_ms / own if m.predicted_bwd_ms > 0 else 1.0
        for node in st.nodes:
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


def device_slowdowns(plan: Plan, baseline: Mapping[int, Sequence[StepMetrics]],
                     recent: Mapping[int, Sequence[StepMetrics]], threshold: float) -> dict[str, float]:
    """Devices whose own compute grew by more than ``threshold`` since the baseline steps.

    Each rank runs the same nodes in every step of a plan, so a stage whose
    compute time grows while the plan stays the same is a device that became
    slower (throttled, shared, failing), not a cost model that was wrong.

    Args:
        plan: the plan both windows ran (ranks in its device order).
        baseline: rank -> early steps of the plan (after warm-up).
        recent: rank -> the latest steps.
        threshold: recent / baseline compute above which a device counts as slowed.

    Returns:
        device name -> recent / baseline compute (only the slowed devices).

    >>> from hpml_compile.solve.testing import chain_graph, cluster_of
    >>> from hpml_compile.solve import solve
    >>> plan = solve(chain_graph([{"cpu": (1.0, 2.0)}] * 4), cluster_of(["cpu", "cpu"]), solver="uniform")
    >>> row = lambda r, c: StepMetrics(0, r, r, 0, "cpu", 1, 8, 10.0, 10.0, c / 3, 2 * c / 3)
    >>> device_slowdowns(plan, {0: [row(0, 3.0)], 1: [row(1, 3.0)]}, {0: [row(0, 3.1)], 1: [row(1, 9.0)]}, 1.25)
    {'d1': 3.0}
    """
    devices = [d for st in plan.stages for d in st.devices]
    out: dict[str, float] = {}
    for rank, rs in recent.items():
        before = statistics.median(m.fwd_ms + m.bwd_ms for m in baseline.get(rank, ())) if baseline.get(rank) else 0
        now = statistics.median(m.fwd_ms + m.bwd_ms for m in rs) if rs else 0.0
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
