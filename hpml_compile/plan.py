"""The Plan IR: pipeline stages, their devices and options, and plan.json.

A plan is versioned JSON keyed by fx node names: loading one needs neither the
model nor a process group. :func:`validate_plan` checks a plan against the
profile it was made for (every node placed once, producers before consumers,
devices used once, memory within budget).

Example:
    >>> from hpml_compile.ir import Cluster, Device
    >>> c = Cluster(devices=(Device("cpu0", "cpu", 4.0),), name="one")
    >>> st = Stage(0, ("cpu0",), ("x", "fc", "output"))
    >>> p = Plan("toy", c, Schedule.ONE_F_ONE_B, 4, (st,))
    >>> Plan.from_dict(p.to_dict()) == p
    True
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from .errors import OptionError, PlanError, SchemaError
from .ir import Assumption, Certificate, Cluster, Precision, Profile, Schedule, base_kind
from .cluster import overlap_efficiency
from .compression import check_sync, parse_compress
from .memory import (GiB, MemoryBreakdown, ZeroStage, compute_bytes, dtype_bytes, process_bytes, tied_elsewhere,
                     tied_shared, tied_shm_bytes)
from .interleave import peak_in_flight
from .schema import CLUSTER_SCHEMA, check_version, read_json, validate, write_json_atomic
from .stagecost import device_memory, in_flight, tp_bytes
from .tp import TensorParallel, analyze as analyze_tp

__all__ = [
    "PLAN_VERSION",
    "COMPILE_STAGES",
    "PLAN_SCHEMA",
    "Schedule",
    "SolverStatus",
    "AllReduce",
    "ZeroStage",
    "StagePrediction",
    "Stage",
    "PlanPrediction",
    "SolverInfo",
    "Plan",
    "PlanError",
    "validate_plan",
    "with_comm",
    "check_comm",
    "check_reduce_dtype",
    "check_wire",
    "sync_overlap",
    "check_placement",
    "check_chunks",
    "hierarchy_problem",
    "zero_shards",
    "node_stages",
    "tied_groups",
    "tied_members",
    "tp_problem",
    "stage_memory",
    "stage_breakdown",
    "device_need",
    "fit_deferral",
    "save_plan",
    "load_plan",
]

PLAN_VERSION = 3
#: How a plan's stages may be planned to run (:attr:`Plan.compile_stages`).
COMPILE_STAGES = ("auto", "on", "off")
#: The versions this hpml-compile reads: 1 lacks ``certificate`` and ``assumptions`` (both optional); 1 and 2
#: lack a stage's ``tp`` (every stage of theirs has ``tp = 1``).
PLAN_VERSIONS = (1, 2, 3)


class SolverStatus(str, enum.Enum):
    """What a solver can say about its plan."""

    OPTIMAL = "optimal"  # proven optimal for the solver's model
    FEASIBLE = "feasible"  # a plan, with a gap to the best bound
    INFEASIBLE = "infeasible"
    HEURISTIC = "heuristic"  # a baseline: no optimality claim


class AllReduce(str, enum.Enum):
    """How a replicated stage's replicas sum their gradients (ZeRO-0 or ZeRO-1).

    ``flat``: one ring all-reduce over all of them (ZeRO-1: one reduce-scatter and one all-gather over all
    ``d``, the optimizer sharded ``1 / d``). ``hierarchical``: for replicas spread over hosts, each
    holding the same number ``L``, a reduce-scatter inside each host, an all-reduce of each shard between the
    hosts, an all-gather inside each host (:func:`hpml_compile.runtime.sync.comm.hierarchical_all_reduce`): the
    same sum, with only ``1 / L`` of the bytes crossing each link between hosts. Under ZeRO-1 it is HSDP-like:
    the optimizer state and step are sharded over the ``L`` ranks of each host (``1 / L`` each, replicated
    across hosts); the first two levels leave each rank the summed gradient of its shard, it steps the shard,
    and the third level all-gathers the new parameters inside the host (:mod:`hpml_compile.runtime.sync.zero`). Not
    for ZeRO-2/3, whose reduce-scatter and parameter gathers stay flat.
    """

    FLAT = "flat"
    HIERARCHICAL = "hierarchical"


@dataclass(frozen=True, slots=True)
class StagePrediction:
    """Predicted per-microbatch times of a stage, the peak memory of each of its devices, and its bubble as a
    rank measures it: the idle share of its own pipeline phase, from the step's start to its last backward
    (None: not predicted)."""

    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    memory_bytes: int = 0
    bubble: float | None = None


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage.

    Attributes:
        index: position in the pipeline, from 0.
        devices: the data-parallel group running it (one device: no replication).
        nodes: fx node names, in topological order.
        zero: ZeRO stage over ``devices``.
        recompute: activation checkpointing of the whole stage.
        swap: fx nodes whose saved activations go to host memory between forward and backward.
        offload_optimizer: Adam state kept in host memory.
        predicted: the simulator's numbers for this stage.
        rows: the rows of each microbatch that each device of ``devices`` trains on, in the same order
            (uneven data parallelism: a faster or larger device takes more); ``()`` splits every
            microbatch equally among the devices.
        compress: the gradient compression of a replicated stage (``powersgd:RANK`` or ``topk:RATIO``,
            :mod:`hpml_compile.compression`); ``""`` sends the gradients whole.
        allreduce: how the replicas all-reduce their gradients (:class:`AllReduce`).
        tp: the tensor-parallel degree: ``devices`` is ``replicas x tp``, replica ``r`` being the ``tp``
            consecutive devices ``devices[r * tp:(r + 1) * tp]``, each of one kind on one host
            (:func:`validate_plan`), which share the stage's sharded layers (:mod:`hpml_compile.tp`); the
            data-parallel group of a device is the devices at its position in every replica. 1: none.
        max_deferred: ZB-H1: the most weight-gradient parts the stage holds back at once (memory-capped ZB-H1,
            :mod:`hpml_compile.schedule`): from 0 (each ``W`` right after its ``I``, 1F1B's order) to the
            stage's index (ZB-H1's own); None: ZB-H1's own (plans written without the field).
    """

    index: int
    devices: tuple[str, ...]
    nodes: tuple[str, ...]
    zero: ZeroStage = ZeroStage.NONE
    recompute: bool = False
    swap: tuple[str, ...] = ()
    offload_optimizer: bool = False
    predicted: StagePrediction = field(default_factory=StagePrediction)
    rows: tuple[int, ...] = ()
    compress: str = ""
    allreduce: AllReduce = AllReduce.FLAT
    tp: int = 1
    max_deferred: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "zero", ZeroStage(self.zero))
        object.__setattr__(self, "tp", int(self.tp))
        object.__setattr__(self, "allreduce", AllReduce(self.allreduce))
        object.__setattr__(self, "rows", tuple(int(r) for r in self.rows))
        c = parse_compress(self.compress, f"stage {self.index}: compress")  # OptionError naming the forms
        object.__setattr__(self, "compress", str(c) if c is not None else "")
        if self.index < 0 or not self.devices:
            raise ValueError(f"stage {self.index}: index must be >= 0 and devices non-empty")
        if self.tp < 1 or len(self.devices) % self.tp:
            raise ValueError(f"stage {self.index}: tp must be >= 1 and divide its {len(self.devices)} devices "
                             f"(replicas x tp), got tp={self.tp}")
        if self.tp > 1 and self.rows:
            raise ValueError(f"stage {self.index}: rows per replica are not combined with tp={self.tp}; leave rows "
                             "out (an equal split) or set tp to 1")
        if self.max_deferred is not None and not 0 <= self.max_deferred <= self.index:
            raise ValueError(f"stage {self.index}: max_deferred must be from 0 to the stage's index {self.index} "
                             f"(the weight-gradient parts ZB-H1 holds back on it), got {self.max_deferred}")
        if self.rows and (len(self.rows) != len(self.devices) or min(self.rows) < 1):
            raise ValueError(f"stage {self.index}: rows must give each of its {len(self.devices)} devices at least "
                             f"one row, got {list(self.rows)}")

    @property
    def replicas(self) -> int:
        """The data-parallel degree: the stage's devices over its tensor-parallel degree."""
        return len(self.devices) // self.tp

    def tp_groups(self) -> tuple[tuple[str, ...], ...]:
        """The devices of each replica (each tensor-parallel group), in replica order."""
        return tuple(self.devices[r * self.tp:(r + 1) * self.tp] for r in range(self.replicas))

    def sync_group(self) -> tuple[str, ...]:
        """The first data-parallel group (every device when ``tp`` is 1): what a sync's links and hosts are
        priced on, every group being laid out alike."""
        return self.devices[::self.tp]

    def dp_groups(self) -> tuple[tuple[str, ...], ...]:
        """The data-parallel group of each tensor-parallel position: the devices that sum each other's gradients."""
        return tuple(self.devices[j::self.tp] for j in range(self.tp))

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "devices": list(self.devices), "nodes": list(self.nodes),
            "zero": int(self.zero), "recompute": self.recompute, "swap": list(self.swap),
            "offload_optimizer": self.offload_optimizer,
            "predicted": {"fwd_ms": self.predicted.fwd_ms, "bwd_ms": self.predicted.bwd_ms,
                          "memory_bytes": self.predicted.memory_bytes,
                          **({} if self.predicted.bubble is None else {"bubble": self.predicted.bubble})},
            **({"rows": list(self.rows)} if self.rows else {}),
            **({"compress": self.compress} if self.compress else {}),
            **({"allreduce": self.allreduce.value} if self.allreduce is not AllReduce.FLAT else {}),
            **({"tp": self.tp} if self.tp > 1 else {}),
            **({"max_deferred": self.max_deferred} if self.max_deferred is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Stage":
        pr = d.get("predicted", {})
        return cls(d["index"], tuple(d["devices"]), tuple(d["nodes"]), ZeroStage(d.get("zero", 0)),
                   d.get("recompute", False), tuple(d.get("swap", ())), d.get("offload_optimizer", False),
                   StagePrediction(pr.get("fwd_ms", 0.0), pr.get("bwd_ms", 0.0), pr.get("memory_bytes", 0),
                                   pr.get("bubble")),
                   tuple(d.get("rows", ())), d.get("compress", ""), AllReduce(d.get("allreduce", "flat")),
                   int(d.get("tp", 1)), d.get("max_deferred"))


@dataclass(frozen=True, slots=True)
class PlanPrediction:
    """Whole-step prediction: step time, slowest stage, idle fraction of the pipeline."""

    step_ms: float = 0.0
    bottleneck_stage: int = 0
    bubble: float = 0.0


@dataclass(frozen=True, slots=True)
class SolverInfo:
    """Which solver made the plan, what it proved, and how long it took."""

    name: str = "manual"
    status: SolverStatus = SolverStatus.HEURISTIC
    gap: float = 0.0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", SolverStatus(self.status))


@dataclass(frozen=True, slots=True)
class Plan:
    """A placement plan: what plan.json holds.

    ``sync_every`` > 1 is local SGD (post-local SGD, Lin et al., ICLR 2020): after ``sync_warmup`` steps of
    per-step gradient sync, the replicas of every replicated stage step on their own gradients and average
    their parameters every ``sync_every`` steps (:mod:`hpml_compile.runtime.sync.compress`). 1: every step, plain
    data parallelism (the default; written to plan.json only when set).
    ``tied_allreduce``: how the gradients of parameters shared by several stages (a tied embedding and LM
    head) are summed over the devices of those stages: ``hierarchical`` makes every such group whose
    devices span hosts, each holding the same number, reduce-scatter inside each host, all-reduce between
    hosts and all-gather (:class:`AllReduce`); a group on one host stays flat.
    ``allow_compress``: the gradient compression the user let the solver choose per stage
    (``--allow-compress``; ``""``: none), kept so that a re-plan offers it again
    (:func:`hpml_compile.driver.replan`); the stages it was chosen for say so in their ``compress``.
    ``certificate``: the simulated step against a lower bound on every plan's (:mod:`hpml_compile.certify`);
    None for a plan made elsewhere (by hand, or written before version 2).
    ``assumptions``: the costs the plan uses that were not measured on this machine
    (:func:`hpml_compile.assumptions.assumptions`).
    ``reduce_dtype``: the dtype the replicated stages' gradient collectives (all-reduce, reduce-scatter) run in
    (``--reduce-dtype``): ``fp32``, the gradients' own (the default; written to plan.json only when set), or
    ``bf16``/``fp16``, half the bytes on the wire, the sum rounded to it (:func:`check_reduce_dtype`).
    ``compile_stages``: how the stages were planned to run (:data:`COMPILE_STAGES`): ``auto`` (the default,
    written to plan.json only when not: compiled on CUDA devices, not on CPUs), ``on`` (compiled by
    ``torch.compile``; CPU stages priced at the profile's compiled block times where it has them) or ``off``;
    ``hpml-compile run`` runs the build so unless told otherwise.
    ``chunks``: interleaved 1F1B's ``v`` (written to plan.json only when above 1): the ``S * v`` stages are the
    model's pieces in order, and stage ``k`` runs on stage ``k % S``'s devices, so each device group holds ``v``
    of them (:func:`check_chunks`; :func:`hpml_compile.schedule.rank_stages`).
    """

    model: str
    cluster: Cluster
    schedule: Schedule
    microbatches: int
    stages: tuple[Stage, ...]
    predicted: PlanPrediction = field(default_factory=PlanPrediction)
    solver: SolverInfo = field(default_factory=SolverInfo)
    precision: Precision = Precision.FP32
    tied_allreduce: AllReduce = AllReduce.FLAT
    schema_version: int = PLAN_VERSION
    sync_every: int = 1
    sync_warmup: int = 0
    allow_compress: str = ""
    certificate: Certificate | None = None
    assumptions: tuple[Assumption, ...] = ()
    reduce_dtype: Precision = Precision.FP32
    compile_stages: str = "auto"
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.compile_stages not in COMPILE_STAGES:
            raise ValueError(f"plan: compile_stages must be one of {', '.join(COMPILE_STAGES)}, "
                             f"got {self.compile_stages!r}")
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        object.__setattr__(self, "reduce_dtype", Precision.parse(self.reduce_dtype, "reduce_dtype"))
        allowed = parse_compress(self.allow_compress, "allow_compress")  # OptionError naming the forms
        object.__setattr__(self, "allow_compress", str(allowed) if allowed is not None else "")
        object.__setattr__(self, "precision", Precision(self.precision))
        check_sync(self.sync_every, self.sync_warmup)
        object.__setattr__(self, "tied_allreduce", AllReduce(self.tied_allreduce))
        if self.microbatches < 1:
            raise ValueError(f"plan: microbatches must be >= 1, got {self.microbatches}")
        for i, st in enumerate(self.stages):
            if st.index != i:
                raise ValueError(f"plan: stages[{i}].index is {st.index}; stages must be listed in order")
        check_chunks(self.schedule, self.chunks, self.stages, self.microbatches)
        if self.schedule is Schedule.ZB_H1:
            _check_zero_bubble(self.stages)
        elif capped := [st.index for st in self.stages if st.max_deferred is not None]:
            raise PlanError(f"schedule {self.schedule.value}: stage(s) {capped} set max_deferred, the cap on the "
                            "weight-gradient parts ZB-H1 holds back; use schedule zb-h1, or leave max_deferred out")

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version, "model": self.model, "cluster": self.cluster.to_dict(),
            "schedule": self.schedule.value, "microbatches": self.microbatches,
            "precision": self.precision.value,
            "stages": [s.to_dict() for s in self.stages],
            "predicted": {"step_ms": self.predicted.step_ms, "bottleneck_stage": self.predicted.bottleneck_stage,
                          "bubble": self.predicted.bubble},
            "solver": {"name": self.solver.name, "status": self.solver.status.value, "gap": self.solver.gap,
                       "seconds": self.solver.seconds},
            **({"sync_every": self.sync_every, "sync_warmup": self.sync_warmup} if self.sync_every > 1 else {}),
            **({"tied_allreduce": self.tied_allreduce.value} if self.tied_allreduce is not AllReduce.FLAT else {}),
            **({"allow_compress": self.allow_compress} if self.allow_compress else {}),
            **({"certificate": self.certificate.to_dict()} if self.certificate is not None else {}),
            **({"assumptions": [a.to_dict() for a in self.assumptions]} if self.assumptions else {}),
            **({"reduce_dtype": self.reduce_dtype.value} if self.reduce_dtype is not Precision.FP32 else {}),
            **({"compile_stages": self.compile_stages} if self.compile_stages != "auto" else {}),
            **({"chunks": self.chunks} if self.chunks > 1 else {}),
        }

    @classmethod
    def from_dict(cls, d: Any, source: str = "plan") -> "Plan":
        """Build from parsed JSON, checking the schema first.

        Args:
            d: parsed plan.json.
            source: the file, for the message.

        Returns:
            The plan.

        Raises:
            hpml_compile.errors.SchemaError: naming the first bad field, e.g. ``plan.json: stages[0].zero:
                expected ...``, or the first stage that breaks a rule of :func:`check_placement`.
        """
        check_version(d, PLAN_VERSIONS, source)
        validate(d, PLAN_SCHEMA, source)
        try:
            cluster = Cluster.from_dict(d["cluster"], source=source)
        except SchemaError as e:  # name the field from the top of plan.json
            raise SchemaError(source, f"cluster.{e.field}", e.expected, e.got, e.fix) from None
        check_placement(d, source)
        pr, so = d["predicted"], d["solver"]
        for k, st in enumerate(d["stages"]):
            try:
                parse_compress(st.get("compress"))
            except OptionError as e:
                raise SchemaError(source, f"stages[{k}].compress", "powersgd:RANK (>= 1) or topk:RATIO (0 < RATIO < 1)",
                                  repr(st.get("compress")), fix=str(e)) from None
        try:
            parse_compress(d.get("allow_compress"), "allow_compress")
        except OptionError as e:
            raise SchemaError(source, "allow_compress", "powersgd:RANK (>= 1) or topk:RATIO (0 < RATIO < 1)",
                              repr(d.get("allow_compress")), fix=str(e)) from None
        return cls(
            model=d["model"], cluster=cluster,
            schedule=Schedule(d["schedule"]), microbatches=d["microbatches"],
            stages=tuple(Stage.from_dict(s) for s in d["stages"]),
            predicted=PlanPrediction(pr["step_ms"], pr["bottleneck_stage"], pr["bubble"]),
            solver=SolverInfo(so["name"], SolverStatus(so["status"]), so.get("gap", 0.0), so.get("seconds", 0.0)),
            precision=Precision(d.get("precision", "fp32")),  # plans written before the field are fp32
            sync_every=d.get("sync_every", 1), sync_warmup=d.get("sync_warmup", 0),
            tied_allreduce=AllReduce(d.get("tied_allreduce", "flat")),
            allow_compress=d.get("allow_compress", ""),
            certificate=Certificate.from_dict(d["certificate"]) if "certificate" in d else None,
            assumptions=tuple(Assumption.from_dict(a) for a in d.get("assumptions", ())),
            reduce_dtype=Precision(d.get("reduce_dtype", "fp32")),  # plans without the field sync in fp32
            compile_stages=d.get("compile_stages", "auto"),  # plans without the field were planned for auto
            chunks=d.get("chunks", 1),  # plans without the field hold one chunk per device group
        )


_NUM = {"type": "number", "minimum": 0}
_NAMES = {"type": "array", "items": {"type": "string", "minLength": 1}}
_SHARE = {"type": "number", "minimum": 0, "maximum": 1}

PLAN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema_version", "model", "cluster", "schedule", "microbatches", "stages", "predicted", "solver"],
    "properties": {
        "schema_version": {"type": "integer"},
        "model": {"type": "string"},
        "cluster": CLUSTER_SCHEMA,
        "schedule": {"enum": [s.value for s in Schedule]},
        "microbatches": {"type": "integer", "minimum": 1},
        "precision": {"enum": [p.value for p in Precision]},
        "tied_allreduce": {"enum": [a.value for a in AllReduce]},
        "reduce_dtype": {"enum": [p.value for p in Precision]},
        "compile_stages": {"enum": list(COMPILE_STAGES)},
        "chunks": {"type": "integer", "minimum": 1},
        "stages": {
            "type": "array", "minItems": 1,
            "items": {
                "type": "object",
                "required": ["index", "devices", "nodes"],
                "properties": {
                    "index": {"type": "integer", "minimum": 0},
                    "devices": {**_NAMES, "minItems": 1},
                    "nodes": _NAMES,
                    "zero": {"enum": [0, 1, 2, 3]},
                    "recompute": {"type": "boolean"},
                    "swap": _NAMES,
                    "offload_optimizer": {"type": "boolean"},
                    "rows": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                    "compress": {"type": "string", "pattern": "^(powersgd:[0-9]+|topk:[0-9.eE+-]+)$"},
                    "allreduce": {"enum": [a.value for a in AllReduce]},
                    "tp": {"type": "integer", "minimum": 1},
                    "max_deferred": {"type": "integer", "minimum": 0},
                    "predicted": {"type": "object", "additionalProperties": False, "properties": {
                        "fwd_ms": _NUM, "bwd_ms": _NUM, "memory_bytes": {"type": "integer", "minimum": 0},
                        "bubble": _SHARE}},
                },
                "additionalProperties": False,
            },
        },
        "predicted": {"type": "object", "required": ["step_ms", "bottleneck_stage", "bubble"], "properties": {
            "step_ms": _NUM, "bottleneck_stage": {"type": "integer", "minimum": 0},
            "bubble": _SHARE}, "additionalProperties": False},
        "solver": {"type": "object", "required": ["name", "status"], "properties": {
            "name": {"type": "string"}, "status": {"enum": [s.value for s in SolverStatus]},
            "gap": _NUM, "seconds": _NUM}, "additionalProperties": False},
        "sync_every": {"type": "integer", "minimum": 1},
        "sync_warmup": {"type": "integer", "minimum": 0},
        "allow_compress": {"type": "string", "pattern": "^(powersgd:[0-9]+|topk:[0-9.eE+-]+)$"},
        "certificate": {"type": "object", "required": ["step_ms", "bound", "bound_ms"], "properties": {
            "step_ms": _NUM, "bound_ms": {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "null"}]},
            "bound": {"type": "string"}, "within": {"anyOf": [_NUM, {"type": "null"}]}},
            "additionalProperties": False},
        "assumptions": {"type": "array", "items": {
            "type": "object", "required": ["name", "value", "source"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "minLength": 1}, "value": {"type": "string"},
                           "source": {"type": "string", "minLength": 1}}}},
    },
    "additionalProperties": False,
}


def check_chunks(schedule: Schedule, chunks: int, stages: Sequence[Stage], microbatches: int) -> None:
    """Interleaved 1F1B's layout: ``S * v`` stages over ``S >= 2`` device groups, stage ``k`` on stage ``k % S``'s
    devices (the same devices in the same order, ``tp`` and rows). Any microbatch count runs: Megatron-LM's order
    wants a multiple of ``S``, and fills the last round of another count with empty slots
    (:func:`hpml_compile.interleave.order`).

    Args:
        schedule: the plan's schedule.
        chunks: the plan's ``v``.
        stages: the plan's stages.
        microbatches: the plan's microbatch count (any; kept in the signature for the rules of other orders).

    Raises:
        PlanError: naming what is wrong and what would be right.

    Example:
        >>> one = lambda k, d: Stage(k, (d,), (f"n{k}",))
        >>> check_chunks(Schedule.INTERLEAVED, 2, [one(0, "a"), one(1, "b"), one(2, "a"), one(3, "b")], 4)
        >>> check_chunks(Schedule.INTERLEAVED, 2, [one(0, "a"), one(1, "b"), one(2, "b"), one(3, "a")], 4)
        Traceback (most recent call last):
        ...
        hpml_compile.errors.PlanError: interleaved 1F1B over 2 device groups: stage 2 runs on ('b',) with tp 1, but stage 0 on ('a',) with tp 1: stage k runs on stage k % 2's devices (same devices in the same order, tp and rows)
    """
    if chunks < 1:
        raise PlanError(f"plan: chunks must be >= 1 (the model chunks each device group holds), got {chunks}")
    if (chunks > 1) != (schedule is Schedule.INTERLEAVED):
        raise PlanError(f"schedule {schedule.value} with chunks {chunks}: chunks above 1 go with schedule "
                        f"{Schedule.INTERLEAVED.value}, which needs them (for one chunk per device group use 1f1b)")
    if chunks == 1:
        return
    s = len(stages) // chunks
    if len(stages) % chunks or s < 2:
        raise PlanError(f"interleaved 1F1B with {chunks} chunks: the plan has {len(stages)} stages; it needs "
                        f"S x {chunks} of them for S >= 2 device groups (e.g. {2 * chunks})")
    for st in stages[s:]:
        first = stages[st.index % s]
        if (st.devices, st.tp, st.rows) != (first.devices, first.tp, first.rows):
            raise PlanError(f"interleaved 1F1B over {s} device groups: stage {st.index} runs on {st.devices} with tp "
                            f"{st.tp}{f' and rows {st.rows}' if st.rows else ''}, but stage {first.index} on "
                            f"{first.devices} with tp {first.tp}{f' and rows {first.rows}' if first.rows else ''}: "
                            f"stage k runs on stage k % {s}'s devices (same devices in the same order, tp and rows)")


def _check_zero_bubble(stages: Sequence[Stage]) -> None:
    """ZB-H1 runs each backward in two parts (:mod:`hpml_compile.backsplit`); what it does not run yet.

    Raises:
        PlanError: naming the stage and the option, and what to do.
    """
    for st in stages:
        what = [name for name, on in (("swap", bool(st.swap)), ("an offloaded optimizer", st.offload_optimizer),
                                      ("ZeRO-3", st.zero == ZeroStage.OS_G_P)) if on]
        if what:
            raise PlanError(f"schedule zb-h1: stage {st.index} uses {' and '.join(what)}, which the zero-bubble "
                            "schedule does not run yet (its weight-gradient part would need to swap in, fetch "
                            "or gather again what the input-gradient part used); use schedule 1f1b for this plan, "
                            "or drop the option from the stage")


def check_placement(d: Any, source: str = "plan") -> None:
    """Check a schema-valid plan.json against itself and its own cluster, before anything uses it.

    The rules that need no profile: stages are listed in order; every stage has
    nodes; every device a stage names is in the plan's cluster, and in no other
    stage; every node is in one stage only; a stage swaps only its own nodes;
    the predicted bottleneck is one of the stages. (:func:`validate_plan` adds
    the rules that need the profile: every node placed, edges, memory.)

    Args:
        d: parsed plan.json, already checked against :data:`PLAN_SCHEMA`.
        source: the file, for the message.

    Raises:
        SchemaError: naming the file, the field (stage, device or node), what was found and the fix.
    """
    cluster = [dev["name"] for dev in d["cluster"]["devices"]]
    groups = len(d["stages"]) // d.get("chunks", 1) or 1  # the device groups S (interleaved: S * chunks stages)
    device_stage: dict[str, int] = {}
    node_stage: dict[str, int] = {}
    for k, st in enumerate(d["stages"]):
        at = f"stages[{k}]"
        if st["index"] != k:
            raise SchemaError(source, f"{at}.index", f"{k} (stages are listed in pipeline order)", repr(st["index"]),
                              fix=f"number the stages 0 to {len(d['stages']) - 1} in the order they are listed")
        if not st["nodes"]:
            raise SchemaError(source, f"{at}.nodes", "at least one fx node", "none",
                              fix=f"move nodes into stage {k} or remove it and renumber the later stages")
        for j, dev in enumerate(st["devices"]):
            if dev not in cluster:
                raise SchemaError(source, f"{at}.devices[{j}]",
                                  f"a device of the plan's cluster ({', '.join(cluster)})", repr(dev),
                                  fix=f"place stage {k} on one of them, or add {dev} to cluster.devices")
            if dev in device_stage and not (k >= groups and device_stage[dev] == k % groups):
                raise SchemaError(source, f"{at}.devices[{j}]", "a device that no other stage uses",
                                  f"{dev!r}, which stage {device_stage[dev]} uses too",
                                  fix=f"give stage {k} a device of its own (a device runs one stage; under "
                                      "interleaved 1F1B stage k runs on stage k % S's devices)")
            device_stage.setdefault(dev, k)
        for j, node in enumerate(st["nodes"]):
            if node in node_stage:
                raise SchemaError(source, f"{at}.nodes[{j}]", "a node that no other stage holds",
                                  f"{node!r}, which stage {node_stage[node]} holds too",
                                  fix=f"keep {node} in one stage and remove it from the other")
            node_stage[node] = k
        rows = st.get("rows", [])
        tp = st.get("tp", 1)
        if len(st["devices"]) % tp or (tp > 1 and rows):
            raise SchemaError(source, f"{at}.tp", f"a degree dividing stage {k}'s {len(st['devices'])} devices "
                              "(replicas x tp), on a stage without rows", f"{tp}" + (" with rows" if rows else ""),
                              fix=f"give stage {k} a multiple of {tp} devices and no rows, or set tp to 1")
        if rows and len(rows) != len(st["devices"]):
            raise SchemaError(source, f"{at}.rows", f"one row count per device of stage {k} ({len(st['devices'])})",
                              f"{len(rows)} counts", fix="give each device its rows per microbatch, in device order, "
                              "or leave rows out for an equal split")
        if st.get("allreduce", "flat") == AllReduce.HIERARCHICAL.value:
            hosts = {dev["name"]: dev.get("host", "node0") for dev in d["cluster"]["devices"]}
            why = hierarchy_problem(st["devices"][::st.get("tp", 1)], hosts, ZeroStage(st.get("zero", 0)))
            if why:
                raise SchemaError(source, f"{at}.allreduce", "flat, or hierarchical for a ZeRO-0 or ZeRO-1 stage whose "
                                  "devices span hosts, each holding the same number", f"hierarchical, but {why}",
                                  fix=f"set stage {k}'s allreduce to flat (or leave it out)")
        cap = st.get("max_deferred")
        if cap is not None and (cap > k or d["schedule"] != Schedule.ZB_H1.value):
            raise SchemaError(source, f"{at}.max_deferred", f"from 0 to {k} (stage {k}'s index) under schedule zb-h1",
                              f"{cap} under schedule {d['schedule']}",
                              fix="cap the weight-gradient parts held back at the stage's index, or leave "
                                  "max_deferred out (ZB-H1's own; no cap under the other schedules)")
        for j, node in enumerate(st.get("swap", ())):
            if node not in st["nodes"]:
                raise SchemaError(source, f"{at}.swap[{j}]", f"one of stage {k}'s nodes", repr(node),
                                  fix=f"swap only nodes that stage {k} runs")
    bottleneck = d["predicted"]["bottleneck_stage"]
    if bottleneck >= len(d["stages"]):
        raise SchemaError(source, "predicted.bottleneck_stage", f"a stage index below {len(d['stages'])}",
                          repr(bottleneck), fix="name one of the plan's stages")


def hierarchy_problem(devices: list[str] | tuple[str, ...], hosts: dict[str, str], zero: ZeroStage) -> str | None:
    """Why a stage on ``devices`` cannot all-reduce hierarchically (None: it can).

    Args:
        devices: the stage's devices.
        hosts: each device's host.
        zero: the stage's ZeRO stage (ZeRO-0, or ZeRO-1 sharded over each host's devices; ZeRO-2/3 are flat).

    Returns:
        The reason, naming the hosts, or None.

    >>> hierarchy_problem(["a", "b"], {"a": "n0", "b": "n0"}, ZeroStage.NONE)
    'its 2 devices are all on host n0'
    >>> hierarchy_problem(["a", "b"], {"a": "n0", "b": "n1"}, ZeroStage.OS_G)
    'it uses ZeRO-2, whose reduce-scatter and all-gather are flat (hierarchical is ZeRO-0 or ZeRO-1)'
    """
    by_host: dict[str, list[str]] = {}
    for name in devices:
        by_host.setdefault(hosts.get(name, "node0"), []).append(name)
    if zero not in (ZeroStage.NONE, ZeroStage.OS):
        return (f"it uses ZeRO-{int(zero)}, whose reduce-scatter and all-gather are flat (hierarchical is ZeRO-0 or "
                "ZeRO-1)")
    if len(by_host) < 2:
        return f"its {len(devices)} devices are all on host {next(iter(by_host))}"
    counts = {h: len(v) for h, v in by_host.items()}
    if len(set(counts.values())) > 1:
        return f"its hosts hold different numbers of its devices ({counts})"
    return None


def zero_shards(cluster: Cluster, stage: Stage) -> int:
    """The ranks a stage's optimizer state is split over: all its devices under flat ZeRO-1 and up, the devices
    of one host under a hierarchical ZeRO-1 (each host holds every shard), its devices otherwise too (ZeRO-0
    divides nothing: :func:`hpml_compile.stagecost.memory_parts` reads the ZeRO stage).

    >>> from hpml_compile.cluster import load_cluster
    >>> c = load_cluster("2node-a100-16")
    >>> devs = tuple(f"gpu{i}" for i in range(16))
    >>> hier = Stage(0, devs, ("x",), ZeroStage.OS, allreduce=AllReduce.HIERARCHICAL)
    >>> zero_shards(c, Stage(0, devs, ("x",), ZeroStage.OS)), zero_shards(c, hier)
    (16, 8)
    """
    if stage.zero == ZeroStage.OS and stage.allreduce is AllReduce.HIERARCHICAL and len(stage.devices) > 1:
        hosts = {x.name: x.host for x in cluster.devices}
        return stage.replicas // len({hosts.get(d, "node0") for d in stage.devices})
    return stage.replicas


def stage_memory(plan: Plan, profile: Profile, stage: Stage, device: str | None = None,
                 tensor_parallel: TensorParallel | None = None) -> int:
    """Peak bytes on a device of ``stage`` under the memory model of :mod:`hpml_compile.stagecost`.

    Args:
        plan: the plan (for the schedule, microbatches and stage count).
        profile: the profile the plan was made for.
        stage: one of ``plan.stages``.
        device: one of the stage's devices (with uneven rows each holds the activations of its own rows);
            None: the device that holds the most.

    Returns:
        Peak bytes on that device.
    """
    return stage_breakdown(plan, profile, stage, device, tensor_parallel).total


def _process(plan: Plan, profile: Profile, device: str, params: int) -> int:
    """What ``device``'s process holds besides its stage's tensors (:func:`hpml_compile.memory.process_bytes`), as
    :meth:`hpml_compile.costgraph.CostGraph.process_bytes` counts it: 0 off a CPU or without a measured baseline."""
    dev = plan.cluster.device(device)
    info = profile.devices.get(dev.kind) or profile.devices.get(base_kind(dev.kind)) or {}
    base = (info.get("process") or {}).get("bytes")
    if not dev.is_cpu or not isinstance(base, int):
        return 0
    stage = next(st for st in plan.stages if device in st.devices)
    whole = params if (info.get("process") or {}).get("stage_only") else sum(n.param_bytes for n in profile.nodes)
    return process_bytes(base, whole, params, replicas=stage.replicas,
                         zero=int(stage.zero), largest_param=max(profile.parameters.values(), default=None))


def stage_breakdown(plan: Plan, profile: Profile, stage: Stage, device: str | None = None,
                    tensor_parallel: TensorParallel | None = None) -> MemoryBreakdown:
    """:func:`stage_memory` by part (parameters, gradients, optimizer state, activations): what
    benchmarks/memory_truth puts beside the bytes a rank holds. ``tensor_parallel``: the profile's
    :func:`hpml_compile.tp.analyze` (None: found again where the stage has ``tp > 1``). Under interleaved 1F1B the
    stage's microbatches in flight are those its device group holds at the peak of all its chunks' activations
    (:func:`hpml_compile.interleave.peak_in_flight`); :func:`device_need` sums a device's chunks."""
    if device is None:
        return max((stage_breakdown(plan, profile, stage, d, tensor_parallel) for d in stage.devices),
                   key=lambda b: b.total)
    mem = _breakdown(plan, profile, stage, device, tensor_parallel)
    if plan.chunks == 1:
        return mem
    groups = len(plan.stages) // plan.chunks
    g = stage.index % groups
    stored = [mem.stored_per_microbatch if st.index == stage.index else
              _breakdown(plan, profile, st, device, tensor_parallel).stored_per_microbatch
              for st in plan.stages[g::groups]]
    held = peak_in_flight(g, groups, plan.chunks, plan.microbatches, stored)
    return replace(mem, in_flight=held[stage.index // groups])


def device_need(plan: Plan, profile: Profile, device: str, tensor_parallel: TensorParallel | None = None) -> int:
    """Peak bytes on ``device`` over every stage it holds: its stage's :func:`stage_memory`, or under interleaved
    1F1B the sum over its chunks, with its process counted once and one backward's working buffers (the largest
    chunk's: the device runs one backward at a time).

    Raises:
        PlanError: no stage uses ``device``.
    """
    held = [st for st in plan.stages if device in st.devices]
    if not held:
        raise PlanError(f"no stage of the plan uses device {device!r}")
    if tensor_parallel is None and any(st.tp > 1 for st in held):
        tensor_parallel = analyze_tp(profile)
    parts = [_breakdown(plan, profile, st, device, tensor_parallel) for st in held]
    if plan.chunks > 1:  # one group's chunks: the microbatches each holds at the group's peak
        counts = peak_in_flight(held[0].index, len(plan.stages) // plan.chunks, plan.chunks,
                                plan.microbatches, [b.stored_per_microbatch for b in parts])
        parts = [replace(b, in_flight=n) for b, n in zip(parts, counts)]
    extra = sum(b.process for b in parts[1:]) + sum(b.working for b in parts) - max(b.working for b in parts)
    return sum(b.total for b in parts) - extra


def _breakdown(plan: Plan, profile: Profile, stage: Stage, device: str,
               tensor_parallel: TensorParallel | None = None) -> MemoryBreakdown:
    """One device's breakdown for ``stage`` with the schedule's count in flight (interleaved 1F1B: 1F1B's, which
    :func:`stage_breakdown` replaces)."""
    j = stage.devices.index(device)
    names = set(stage.nodes)
    nodes = [n for n in profile.nodes if n.name in names]
    swapped = set(stage.swap)
    m = plan.microbatches
    if stage.tp > 1 and tensor_parallel is None:
        tensor_parallel = analyze_tp(profile)  # once, not once a node
    sharded = [n for n in nodes if tensor_parallel.role(n.name, stage.tp) is not None] \
        if stage.tp > 1 and tensor_parallel is not None else []
    params = tp_bytes(sum(n.param_bytes for n in nodes), sum(n.param_bytes for n in sharded), stage.tp) \
        + tied_elsewhere(((n.name, n.params) for n in profile.nodes), profile.parameters, names)
    mem = device_memory(
        param_bytes=params,
        activation_bytes=tp_bytes(sum(n.activation_bytes for n in nodes), sum(n.activation_bytes for n in sharded),
                                  stage.tp),
        input_bytes=_input_bytes(profile, names),
        dtype_bytes=dtype_bytes(profile.dtype), replicas=stage.replicas, zero=stage.zero,
        shards=zero_shards(plan.cluster, stage), microbatches=m,
        in_flight=in_flight(plan.schedule, m, len(plan.stages) - stage.index - 1, len(plan.stages),
                            stage.max_deferred),
        recompute=stage.recompute,
        swapped_bytes=sum(n.activation_bytes for n in nodes if n.name in swapped),
        offload_optimizer=stage.offload_optimizer,
        host_is_device=plan.cluster.device(device).is_cpu,
        share=(stage.rows[j], profile.batch_size) if stage.rows else None,
        compute_bytes=compute_bytes(plan.precision.value),  # autocast's weight copies per microbatch in flight
        process_bytes=_process(plan, profile, device, params),
    )
    # the gradients of parameters tied to another stage are all-reduced through a flat buffer kept across steps;
    # on CPU ranks of one host through shared memory too, which the process holds (where its baseline is measured)
    shared = tied_shared(((n.name, n.params) for n in profile.nodes), profile.parameters, names)
    shm = tied_shm_bytes(shared, tied_members(plan, ((n.name, n.params) for n in profile.nodes), stage.index)) \
        if mem.process else 0
    return replace(mem, grads=mem.grads + shared, process=mem.process + shm) if shared else mem


def _input_bytes(profile: Profile, names: set[str]) -> int:
    outside = {i for n in profile.nodes if n.name in names for i in n.inputs if i not in names}
    return sum(profile.node(i).output_bytes for i in outside)


def tied_groups(plan: Plan, users: Iterable[tuple[str, Sequence[str]]]) -> list[tuple[int, ...]]:
    """The groups of stages that share a parameter (each group's gradients are all-reduced over its devices).

    Args:
        plan: the plan.
        users: ``(fx node, parameter names it uses)`` for every node.

    Returns:
        The stage tuples, sorted, each once.
    """
    where = {n: st.index for st in plan.stages for n in st.nodes}
    stages: dict[str, set[int]] = {}
    for node, names in users:
        for name in names:
            if node in where:
                stages.setdefault(name, set()).add(where[node])
    return sorted({tuple(sorted(v)) for v in stages.values() if len(v) > 1})


def tied_members(plan: Plan, users: Iterable[tuple[str, Sequence[str]]], index: int) -> int:
    """The ranks that sum the tied gradients of stage ``index`` through one host's shared memory: every device of
    the stages it shares parameters with, where all are CPUs of one host (else 0: no shared memory).

    Args:
        plan: the plan.
        users: ``(fx node, parameter names it uses)`` for every node.
        index: the stage.
    """
    stages = sorted({i for group in tied_groups(plan, users) if index in group for i in group})
    devices = [plan.cluster.device(d) for i in stages for d in plan.stages[i].devices]
    if len(devices) < 2 or not all(d.is_cpu for d in devices) or len({d.host for d in devices}) > 1:
        return 0
    return len(devices)


def node_stages(plan: Plan) -> dict[str, int]:
    """Each fx node's stage index.

    Raises:
        PlanError: a node placed in two stages.
    """
    where: dict[str, int] = {}
    for st in plan.stages:
        for n in st.nodes:
            if n in where:
                raise PlanError(f"node {n!r} is placed in stage {where[n]} and stage {st.index}; "
                                "each node must be in exactly one stage")
            where[n] = st.index
    return where


def validate_plan(plan: Plan, profile: Profile) -> None:
    """Check a plan against its profile.

    Args:
        plan: the plan.
        profile: the profile the plan was made for.

    Raises:
        PlanError: naming the first rule broken: a precision other than the
            profile's; a node placed twice, unknown or never; an edge from a
            later stage to an earlier one; a device unknown or used twice;
            optimizer offload on a CPU device (the host is the device); rows
            per replica that do not sum to a microbatch's rows; a device over
            its memory (with uneven rows, from its own rows); ZeRO-3 together
            with optimizer offload, which the runtime does not combine; a
            hierarchical all-reduce on a stage whose devices are on one host
            (or unevenly spread, or ZeRO-sharded); a tensor-parallel group
            spanning hosts or kinds (:func:`tp_problem`); a sharded unit
            (:mod:`hpml_compile.tp`) cut between stages, one of them with
            ``tp > 1``.
    """
    if plan.precision is not profile.precision:
        raise PlanError(f"the plan trains in {plan.precision.value} but the profile of {profile.model} was timed in "
                        f"{profile.precision.value}: its times and activation sizes are for that precision; profile "
                        f"again with --precision {plan.precision.value}, or plan with --precision "
                        f"{profile.precision.value}")
    check_reduce_dtype(plan)
    where = node_stages(plan)
    for st in plan.stages:
        why = tp_problem(plan.cluster, st)
        if why:
            raise PlanError(f"stage {st.index} has tp={st.tp}, but {why}: a tensor-parallel group is devices of one "
                            f"kind on one host (its collectives run on every layer); list each group's {st.tp} "
                            "devices together from one host and kind, or set its tp to 1")
        if st.zero == ZeroStage.OS_G_P and st.offload_optimizer:
            raise PlanError(f"stage {st.index} asks for ZeRO-3 with optimizer offload, which the runtime does not "
                            "combine (runtime/sync/zero3.py): use ZeRO-3 without offload, or ZeRO-1 with it")
        for s in st.swap:
            if s not in st.nodes:
                raise PlanError(f"stage {st.index} swaps {s!r}, which is not one of its nodes")
        _check_comm_options(plan, st)
        if st.allreduce is AllReduce.HIERARCHICAL:
            why = hierarchy_problem(st.sync_group(), {x.name: x.host for x in plan.cluster.devices}, st.zero)
            if why:
                raise PlanError(f"stage {st.index} asks for a hierarchical all-reduce, but {why}: it needs a ZeRO-0 "
                                "or ZeRO-1 stage whose devices span two or more hosts, each holding the same number; "
                                "set its allreduce to flat")
    if plan.tied_allreduce is AllReduce.HIERARCHICAL:
        hosts = {x.name: x.host for x in plan.cluster.devices}
        groups = tied_groups(plan, ((n.name, n.params) for n in profile.nodes))
        spans = [g for g in groups if hierarchy_problem([d for k in g for d in plan.stages[k].devices], hosts,
                                                        ZeroStage.NONE) is None]
        if not spans:
            raise PlanError(f"the plan asks for a hierarchical all-reduce of tied parameters, but none of its groups "
                            f"of stages sharing parameters ({[list(g) for g in groups]}) has devices spread over "
                            "hosts holding the same number of them; set tied_allreduce to flat")
    names = [n.name for n in profile.nodes]
    unknown = [n for n in where if n not in set(names)]
    if unknown:
        raise PlanError(f"nodes {unknown[:5]} are not in the profile of {profile.model}")
    missing = [n for n in names if n not in where]
    if missing:
        raise PlanError(f"nodes {missing[:5]} ({len(missing)} in all) are in no stage; every node needs one")
    for n in profile.nodes:
        for i in n.inputs:
            if where[i] > where[n.name]:
                raise PlanError(f"edge {i} -> {n.name} runs from stage {where[i]} back to stage {where[n.name]}; "
                                "a producer must be in the same or an earlier stage")
    for st in plan.stages:
        cpus = [d for d in st.devices if d in {x.name for x in plan.cluster.devices} and plan.cluster.device(d).is_cpu]
        if st.offload_optimizer and cpus:
            raise PlanError(f"stage {st.index} offloads its optimizer to host memory, but runs on CPU device "
                            f"{cpus[0]}, whose host memory is its own memory: offload would save nothing and is not "
                            "performed there; set offload_optimizer to false for this stage (the solver offers "
                            "offload only on GPUs)")
    _check_devices(plan)
    for st in plan.stages:
        if not st.rows:
            continue
        per_mb = profile.batch_size // plan.microbatches
        if profile.batch_size % plan.microbatches or sum(st.rows) != per_mb:
            raise PlanError(f"stage {st.index} splits each microbatch into rows {list(st.rows)} (sum {sum(st.rows)}) "
                            f"over {', '.join(st.devices)}, but a microbatch of the profile's batch of "
                            f"{profile.batch_size} in {plan.microbatches} microbatches holds "
                            f"{profile.batch_size / plan.microbatches:g} rows: give rows summing to that (with a "
                            "microbatch count that divides the batch), or leave rows out for an equal split")
    sharding = analyze_tp(profile) if any(st.tp > 1 for st in plan.stages) else None
    for unit in sharding.units if sharding is not None else ():
        held = sorted({where[n] for n in unit.nodes if n in where})
        if len(held) > 1 and any(plan.stages[k].tp > 1 for k in held):
            raise PlanError(f"the {unit.kind} unit at {unit.scope} is split between stages {held}, one of them "
                            "tensor-parallel: its sharded intermediate would cross a stage boundary; move the cut "
                            "before or after the unit, or set those stages' tp to 1")
    _check_memory(plan, profile, sharding)

def _check_devices(plan: Plan) -> None:
    """:func:`validate_plan`'s rule for devices: each in the cluster, one stage per device (under interleaved 1F1B,
    stage ``k`` on stage ``k % S``'s devices)."""
    used: dict[str, int] = {}
    groups = len(plan.stages) // plan.chunks
    devices = {d.name for d in plan.cluster.devices}
    for st in plan.stages:
        for d in st.devices:
            if d not in devices:
                raise PlanError(f"stage {st.index} uses device {d!r}, which is not in cluster "
                                f"{plan.cluster.name} ({sorted(devices)})")
            if d in used and not (st.index >= groups and used[d] == st.index % groups):
                raise PlanError(f"device {d} is used by stage {used[d]} and stage {st.index}; one stage per device "
                                "(under interleaved 1F1B: stage k on stage k % S's devices)")
            used.setdefault(d, st.index)


def _check_memory(plan: Plan, profile: Profile, sharding: TensorParallel | None) -> None:
    """:func:`validate_plan`'s rule for memory: every device within its capacity (:func:`device_need`; equal
    devices of a stage hold equal bytes, an interleaved device its chunks together)."""
    needs: dict[tuple[int, str, int | None], int] = {}  # equal devices of a stage hold equal bytes
    for st in plan.stages[:len(plan.stages) // plan.chunks]:  # interleaved 1F1B: a device's chunks together
        for j, name in enumerate(st.devices):
            dev = plan.cluster.device(name)
            key = (st.index, dev.kind, st.rows[j] if st.rows else None)
            if key not in needs:
                needs[key] = device_need(plan, profile, name, sharding)
            need = needs[key]
            if need > dev.memory_bytes:
                rows = f" with its {st.rows[st.devices.index(name)]} rows per microbatch" if st.rows else ""
                fix = ("give it fewer rows (more to the stage's other devices), or enable ZeRO, recompute, offload"
                       if st.rows else "enable ZeRO, recompute, offload, or add a device")
                if plan.chunks > 1:
                    fix += f", or interleave fewer than {plan.chunks} chunks"
                held = ", ".join(str(k) for k in range(st.index, len(plan.stages), len(plan.stages) // plan.chunks))
                raise PlanError(f"stage{'s' if plan.chunks > 1 else ''} {held} need{'' if plan.chunks > 1 else 's'} "
                                f"{need / GiB:.2f} GiB on {name} ({dev.kind}, "
                                f"{dev.memory_gib:.1f} GiB){rows}: over by {(need - dev.memory_bytes) / GiB:.2f} "
                                f"GiB; {fix}")


def fit_deferral(plan: Plan, profile: Profile) -> Plan:
    """A ZB-H1 plan with each stage's cap on held-back weight-gradient parts (:attr:`Stage.max_deferred`) set to
    the largest that fits every device of the stage, as :func:`stage_memory` prices it.

    A stage holds the activations of ``S - i + w`` microbatches for ``w`` parts held back (``S`` uncapped):
    memory grows with ``w``, so the largest that fits is found by bisection. A stage where ZB-H1's own ``i``
    fits keeps no cap; one where even ``0`` (1F1B's count) does not fit gets ``0``, and :func:`validate_plan`
    names what it needs.

    Args:
        plan: a plan under schedule ZB-H1 (its caps are ignored: each is chosen again).
        profile: the profile it was made for.

    Returns:
        The plan with the caps (the same plan where every stage fits uncapped).

    Raises:
        PlanError: ``plan`` is not under ZB-H1.
    """
    if plan.schedule is not Schedule.ZB_H1:
        raise PlanError(f"a cap on held-back weight-gradient parts needs schedule zb-h1, not {plan.schedule.value}")
    sharding = analyze_tp(profile) if any(st.tp > 1 for st in plan.stages) else None
    stages = []
    for st in plan.stages:
        def fits(w: int | None, st: Stage = st) -> bool:
            capped = replace(st, max_deferred=w)
            return all(stage_memory(plan, profile, capped, d, sharding) <= plan.cluster.device(d).memory_bytes
                       for d in st.devices)

        if fits(None):
            stages.append(replace(st, max_deferred=None))
            continue
        lo, hi = 0, st.index  # fits(lo) is searched for; hi does not fit
        while lo < hi - 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        stages.append(replace(st, max_deferred=lo))
    return replace(plan, stages=tuple(stages))


def tp_problem(cluster: Cluster, st: Stage) -> str | None:
    """Why stage ``st``'s tensor-parallel groups are not possible (None: they can, or ``tp`` is 1).

    Args:
        cluster: the plan's cluster.
        st: the stage.

    Returns:
        The first group spanning hosts or kinds, named; None.

    >>> from hpml_compile.cluster import load_cluster
    >>> c = load_cluster("2node-a100-16")
    >>> tp_problem(c, Stage(0, ("gpu6", "gpu7", "gpu8", "gpu9"), ("x",), tp=4))
    'its group gpu6, gpu7, gpu8, gpu9 spans hosts node0, node1'
    >>> tp_problem(c, Stage(0, ("gpu0", "gpu1", "gpu8", "gpu9"), ("x",), tp=2)) is None
    True
    """
    if st.tp == 1:
        return None
    known = {d.name for d in cluster.devices}
    for group in st.tp_groups():
        if not set(group) <= known:
            return None  # unknown devices are named by the device check
        hosts = sorted({cluster.device(d).host for d in group})
        kinds = sorted({cluster.device(d).kind for d in group})
        if len(hosts) > 1:
            return f"its group {', '.join(group)} spans hosts {', '.join(hosts)}"
        if len(kinds) > 1:
            return f"its group {', '.join(group)} mixes kinds {', '.join(kinds)}"
    return None


def with_comm(plan: Plan, *, compress: str | None = None, sync_every: int | None = None,
              sync_warmup: int | None = None, reduce_dtype: Precision | str | None = None) -> Plan:
    """``plan`` with the user's communication options: ``compress`` on every replicated ZeRO-0 stage, local SGD.

    Args:
        plan: the plan.
        compress: ``powersgd:RANK`` / ``topk:RATIO`` for every replicated stage without ZeRO; ``"none"``
            removes compression; None keeps the plan's.
        sync_every: local SGD's period (1: per-step sync); None keeps the plan's.
        sync_warmup: steps of per-step sync first; None keeps the plan's.
        reduce_dtype: the dtype of the gradient collectives (``fp32``, ``bf16``, ``fp16``); None keeps the plan's.

    Returns:
        The plan, checked by :func:`check_comm`.

    Raises:
        OptionError: a bad value, compression asked of a plan with no replicated ZeRO-0 stage, or a reduce dtype
            other than fp32 asked of a plan with no replicated stage.
        PlanError: a combination the runtime does not perform (:func:`check_comm`).
    """
    c = parse_compress(compress) if compress is not None else None
    stages = plan.stages
    if compress is not None:
        fit = [st.index for st in plan.stages if st.replicas > 1 and st.zero == ZeroStage.NONE]
        if c is not None and not fit:
            raise OptionError(f"--compress {compress}: the plan has no replicated stage without ZeRO, so no gradient "
                              "crosses between replicas: compress needs data parallelism (a stage on >= 2 devices)")
        # a compressed stage's sync replaces its all-reduce, and the runtime compresses over the flat group
        stages = tuple(replace(st, compress=str(c), allreduce=AllReduce.FLAT) if (c is not None and st.index in fit)
                       else replace(st, compress="") for st in plan.stages)
    every = plan.sync_every if sync_every is None else sync_every
    warm = plan.sync_warmup if sync_warmup is None else sync_warmup
    check_sync(every, warm)
    wire = plan.reduce_dtype if reduce_dtype is None else Precision.parse(reduce_dtype, "--reduce-dtype")
    if wire is not Precision.FP32 and not any(st.replicas > 1 for st in stages):
        raise OptionError(f"--reduce-dtype {wire.value}: the plan has no replicated stage, so no gradient crosses "
                          "between replicas: a reduce dtype needs data parallelism (a stage on >= 2 devices); "
                          "drop --reduce-dtype")
    out = replace(plan, stages=stages, sync_every=every, sync_warmup=warm, reduce_dtype=wire)
    check_comm(out)
    return out


def check_comm(plan: Plan) -> None:
    """The compression and local SGD of a plan are ones the runtime performs (see :func:`_check_comm_options`).

    Raises:
        PlanError: naming the stage and the fix.
    """
    check_reduce_dtype(plan)
    for st in plan.stages:
        _check_comm_options(plan, st)


def check_reduce_dtype(plan: Plan) -> None:
    """The plan's reduce dtype is one the runtime performs safely (fp32 always is).

    ``bf16`` keeps fp32's exponent range: a gradient sum neither overflows nor underflows, it loses mantissa
    (8 bits against 24). ``fp16`` has 5 exponent bits: gradients below ~6e-8 flush to zero and sums above 65504
    overflow, so it needs the loss scaling of an fp16 plan (whose skipped steps then catch an overflow of the
    sum as well). Compression and local SGD send payloads of their own (top-k values, PowerSGD's factors, the
    replicas' averaged parameters), which a reduce dtype does not apply to.

    Raises:
        PlanError: fp16 without loss scaling, or a reduce dtype together with compression or local SGD.
    """
    wire = plan.reduce_dtype
    if wire is Precision.FP32:
        return
    check_wire(wire, plan.precision)
    if plan.sync_every > 1:
        raise PlanError(f"--reduce-dtype {wire.value} with local SGD (sync every {plan.sync_every}): local SGD "
                        "averages parameters, not gradients, and keeps them fp32; choose one of them")
    for st in plan.stages:
        if st.compress and st.replicas > 1:
            raise PlanError(f"--reduce-dtype {wire.value}, but stage {st.index} compresses its gradients "
                            f"({st.compress}), whose payload is its own (top-k values, PowerSGD's factors): "
                            "choose one of them for the stage")


def check_wire(wire: Precision, precision: Precision) -> None:
    """Refuse an fp16 reduce dtype on a plan without loss scaling (one that does not train in fp16).

    Raises:
        PlanError: naming both and the two ways out.
    """
    if wire is Precision.FP16 and precision is not Precision.FP16:
        raise PlanError(f"--reduce-dtype fp16 on a plan that trains in {precision.value}, without loss "
                        "scaling: fp16 flushes gradients below ~6e-8 to zero and overflows past 65504; use "
                        "--reduce-dtype bf16 (fp32's range), or train with --precision fp16 (loss-scaled)")


def _check_comm_options(plan: Plan, st: Stage) -> None:
    """Compression and local SGD are performed on a ZeRO-0 stage's flat gradient buffer only."""
    if st.compress and st.replicas < 2:
        raise PlanError(f"stage {st.index} compresses its gradients ({st.compress}), but runs on one device, so "
                        "it sends none: drop compress from this stage (it applies to replicated stages only)")
    if st.compress and st.zero != ZeroStage.NONE:
        raise PlanError(f"stage {st.index} compresses its gradients ({st.compress}) under ZeRO-{int(st.zero)}, "
                        "whose reduce-scatter the runtime does not compress: use zero 0 for a compressed stage")
    if st.compress and st.allreduce is AllReduce.HIERARCHICAL:
        raise PlanError(f"stage {st.index} compresses its gradients ({st.compress}) and asks for a hierarchical "
                        "all-reduce, but the runtime runs the compressed collectives over the stage's flat group: "
                        "use allreduce flat for a compressed stage (or drop compress)")
    if plan.sync_every > 1 and st.replicas > 1 and st.zero != ZeroStage.NONE:
        raise PlanError(f"the plan averages parameters every {plan.sync_every} steps (local SGD), but stage "
                        f"{st.index} shards its optimizer (ZeRO-{int(st.zero)}), so its replicas cannot step on "
                        "their own: use zero 0 with --sync-every, or --sync-every 1")
    if plan.sync_every > 1 and len(st.devices) > 1 and st.rows and len(set(st.rows)) > 1:
        raise PlanError(f"the plan runs local SGD (sync every {plan.sync_every}), but stage {st.index} splits its "
                        f"rows unevenly ({list(st.rows)}), so its replicas' gradients are not means over equal "
                        "shares: split evenly, or use --sync-every 1")
    if plan.sync_every > 1 and st.compress:
        raise PlanError(f"stage {st.index} compresses its gradients ({st.compress}) and the plan runs local SGD "
                        f"(sync every {plan.sync_every}): choose one of them")


def sync_overlap(plan: Plan, k: int) -> float:
    """The fraction of stage ``k``'s last backward that hides its gradient sync: one rule for plan and runtime.

    The cost model hides that much of the backward behind the stage's bucketed collective
    (:func:`hpml_compile.stagecost.sync_ms`, through :mod:`hpml_compile.simulate`), and the runtime
    launches the stage's buckets during the backward exactly where it is above 0
    (:class:`hpml_compile.runtime.Pipeline`, unless told otherwise), else runs one collective after the
    backward, which is what the cost model then prices.

    Args:
        plan: the plan.
        k: a stage index.

    Returns:
        0 where the stage's sync is not bucketed (one device; compressed; local SGD; ZeRO-3: all run after
        the backward), else the overlap efficiency of its devices (:func:`hpml_compile.cluster.overlap_efficiency`:
        0 with a CPU in the group, 1 for GPUs), for a flat all-reduce as for a hierarchical one (each bucket
        a chain of three collectives, :class:`hpml_compile.runtime.sync.comm.ChainQueue`; a hierarchical ZeRO-1's of
        two, its parameter all-gather after the optimizer step).

    Example:
        >>> from hpml_compile.cluster import load_cluster
        >>> from hpml_compile.ir import Schedule
        >>> c = load_cluster("local-cpu-2")
        >>> p = Plan("mlp", c, Schedule.GPIPE, 1, (Stage(0, ("cpu0", "cpu1"), ("x",)),))
        >>> sync_overlap(p, 0)
        0.0
    """
    st = plan.stages[k]
    if st.replicas < 2 or st.compress or plan.sync_every > 1 or st.zero == ZeroStage.OS_G_P:
        return 0.0
    return overlap_efficiency(plan.cluster, st.devices)


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write plan.json atomically (a crash leaves any previous file whole)."""
    return write_json_atomic(plan.to_dict(), path)


def load_plan(path: str | Path) -> Plan:
    """Read plan.json, checking its schema and its stages against its own cluster.

    Args:
        path: the file.

    Returns:
        The plan.

    Raises:
        SchemaError: naming the file and the first bad field, or the stage, device or node that breaks a
            rule of :func:`check_placement`, with the fix.
    """
    d = read_json(path)
    if isinstance(d, dict) and d.get("kind") == "inference":
        raise SchemaError(str(path), "kind", "a training plan", '"inference"',
                          "an inference plan runs with `hpml-compile generate`, `infer` or `serve`")
    return Plan.from_dict(d, source=str(path))

