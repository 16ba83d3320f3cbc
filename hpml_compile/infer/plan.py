"""Inference plans: versioned JSON with ``kind: "inference"``, its stages, idle devices and predictions.

A plan places contiguous ranges of a decoder's blocks on devices, in
pipeline order; the first stage also holds the token table, the last the
final norm and the output projection. It carries the workload it was made
for (batch, prompt and output lengths, microbatch lanes, serving dtype), the
objective, each stage's predicted times and memory, every device left idle
with the reason, and how a rank rebuilds the model (``model``: a zoo name;
``seed``; optionally ``weights``, a safetensors file).

Loading checks the version and the schema and names the first bad field, as
the training plan's loader does; a training plan handed to
:func:`load_inference_plan` is refused by its ``kind``.

Example:
    >>> from hpml_compile.cluster import load_cluster
    >>> from hpml_compile.models.gpt import PRESETS
    >>> from hpml_compile.infer.place import place
    >>> p = place(DecoderShape.from_config(PRESETS["gpt-tiny"]), load_cluster("hetero-4"), Workload(4, 8, 8))
    >>> InferencePlan.from_dict(p.to_dict()) == p
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import SchemaError
from ..ir import Cluster
from ..schema import check_version, read_json, validate, write_json_atomic
from .cost import DecoderShape, Objective, Workload
from .timing import BlockTiming

__all__ = ["INFERENCE_VERSION", "InferenceStage", "Prediction", "InferencePlan", "save_inference_plan",
           "load_inference_plan", "is_inference_plan"]

INFERENCE_VERSION = 1

_NUM = {"type": "number", "minimum": 0}
_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema_version", "kind", "objective", "model", "shape", "workload", "cluster", "stages",
                 "predicted"],
    "properties": {
        "kind": {"const": "inference"},
        "objective": {"enum": [o.value for o in Objective]},
        "model": {"type": "string", "minLength": 1},
        "seed": {"type": "integer"},
        "weights": {"type": ["string", "null"]},
        "shape": {"type": "object"},
        "workload": {"type": "object", "required": ["batch", "prompt_len", "new_tokens", "microbatches", "dtype"]},
        "cluster": {"type": "object"},
        "stages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["device", "blocks", "embed", "head", "stream"],
            "properties": {"device": {"type": "string"},
                           "blocks": {"type": "array", "items": {"type": "integer", "minimum": 0},
                                      "minItems": 2, "maxItems": 2},
                           "embed": {"type": "boolean"}, "head": {"type": "boolean"}, "stream": {"type": "boolean"},
                           "prefill_ms": _NUM, "decode_ms": _NUM, "memory_bytes": _NUM}}},
        "idle": {"type": "array", "items": {"type": "object", "required": ["device", "why"]}},
        "predicted": {"type": "object", "required": ["tokens_per_s", "ttft_ms", "token_ms", "total_ms"]},
        "latency_bound_ms": {"type": ["number", "null"]},
        "planning_ms": _NUM,
        "cpu_timing": {"type": ["object", "null"],
                       "required": ["prefill_ms", "decode_ms", "step_ms", "rows", "prompt_len", "new_tokens",
                                    "threads"]},
    },
}


@dataclass(frozen=True, slots=True)
class InferenceStage:
    """Blocks ``[first, end)`` on ``device``; ``embed``/``head`` mark the first and last stage's extras."""

    device: str
    first: int
    end: int
    embed: bool
    head: bool
    stream: bool = False
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    memory_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "blocks": [self.first, self.end], "embed": self.embed, "head": self.head,
                "stream": self.stream, "prefill_ms": self.prefill_ms, "decode_ms": self.decode_ms,
                "memory_bytes": self.memory_bytes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "InferenceStage":
        return cls(d["device"], d["blocks"][0], d["blocks"][1], d["embed"], d["head"], d["stream"],
                   float(d.get("prefill_ms", 0.0)), float(d.get("decode_ms", 0.0)), int(d.get("memory_bytes", 0)))


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the plan predicts for its workload (see :func:`hpml_compile.infer.place.score`)."""

    tokens_per_s: float  # generated tokens per second over the whole batch, prefill included
    ttft_ms: float  # prefill of the whole batch: when every sequence has its first token
    token_ms: float  # one decode step: the time between two tokens of one sequence
    total_ms: float  # prefill plus every decode step


@dataclass(frozen=True, slots=True)
class InferencePlan:
    """A forward-only pipeline plan (see the module docstring)."""

    objective: Objective
    model: str
    shape: DecoderShape
    workload: Workload
    cluster: Cluster
    stages: tuple[InferenceStage, ...]
    predicted: Prediction
    idle: tuple[tuple[str, str], ...] = ()
    latency_bound_ms: float | None = None
    planning_ms: float = 0.0
    seed: int = 0
    weights: str | None = None
    cpu_timing: BlockTiming | None = None  # a block timed on this host's CPU, which priced its CPU stages
    schema_version: int = INFERENCE_VERSION
    kind: str = field(default="inference")

    def to_dict(self) -> dict[str, Any]:
        p = self.predicted
        return {
            "schema_version": self.schema_version, "kind": self.kind, "objective": self.objective.value,
            "model": self.model, "seed": self.seed, "weights": self.weights, "shape": self.shape.to_dict(),
            "workload": self.workload.to_dict(), "cluster": self.cluster.to_dict(),
            "stages": [s.to_dict() for s in self.stages],
            "idle": [{"device": d, "why": why} for d, why in self.idle],
            "predicted": {"tokens_per_s": p.tokens_per_s, "ttft_ms": p.ttft_ms, "token_ms": p.token_ms,
                          "total_ms": p.total_ms},
            "latency_bound_ms": self.latency_bound_ms, "planning_ms": self.planning_ms,
            "cpu_timing": self.cpu_timing.to_dict() if self.cpu_timing else None,
        }

    @classmethod
    def from_dict(cls, d: Any, source: str = "inference plan") -> "InferencePlan":
        """From parsed JSON, checked against the schema first.

        Raises:
            SchemaError: naming ``source`` and the first bad field (a training plan: its ``kind``).
        """
        if isinstance(d, dict) and d.get("kind", "training") != "inference":
            raise SchemaError(source, "kind", '"inference" (written by `compile --inference` or '
                              '`plan --inference`)', repr(d.get("kind", "training")),
                              "a training plan runs with `hpml-compile run`")
        check_version(d, INFERENCE_VERSION, source)
        validate(d, _SCHEMA, source)
        try:
            plan = cls(Objective(d["objective"]), d["model"], DecoderShape(**d["shape"]), Workload(**d["workload"]),
                       Cluster.from_dict(d["cluster"], source=f"{source} (cluster)"),
                       tuple(InferenceStage.from_dict(s) for s in d["stages"]), Prediction(**d["predicted"]),
                       tuple((x["device"], x["why"]) for x in d.get("idle", ())), d.get("latency_bound_ms"),
                       float(d.get("planning_ms", 0.0)), int(d.get("seed", 0)), d.get("weights"),
                       BlockTiming.from_dict(d["cpu_timing"]) if d.get("cpu_timing") else None)
        except TypeError as e:  # a field of shape/workload/predicted missing or unknown
            raise SchemaError(source, "shape/workload/predicted", "the fields a plan writes", str(e)) from None
        plan.check(source)
        return plan

    def check(self, source: str = "inference plan") -> None:
        """Stages cover blocks ``0..n_layer`` in order on distinct devices of the cluster.

        Raises:
            SchemaError: naming the stage that breaks the rule.
        """
        names = {d.name for d in self.cluster.devices}
        at = 0
        for k, s in enumerate(self.stages):
            if s.device not in names:
                raise SchemaError(source, f"stages[{k}].device", f"a device of the cluster {sorted(names)}",
                                  repr(s.device))
            if s.first != at or s.end <= s.first:
                raise SchemaError(source, f"stages[{k}].blocks", f"[{at}, n) with n > {at}",
                                  str([s.first, s.end]))
            at = s.end
        if at != self.shape.n_layer:
            raise SchemaError(source, "stages", f"blocks 0..{self.shape.n_layer} covered", f"0..{at}")
        if len({s.device for s in self.stages}) != len(self.stages):
            raise SchemaError(source, "stages", "one stage per device", str([s.device for s in self.stages]))

    def with_model(self, model: str, seed: int = 0, weights: str | None = None) -> "InferencePlan":
        """The same plan, recording how a rank rebuilds the model."""
        return replace(self, model=model, seed=seed, weights=weights)

    def specs(self) -> dict[str, Any] | None:
        """The device specs its stages were priced with: the CPU fitted to :attr:`cpu_timing` when it has one
        (:func:`hpml_compile.infer.timing.timed_specs`), else None (the catalog's)."""
        from .timing import timed_specs

        return timed_specs(self.shape, self.cpu_timing, self.workload.dtype)


def is_inference_plan(d: Any) -> bool:
    """Whether parsed plan JSON is an inference plan (training plans carry no ``kind``, or ``"training"``)."""
    return isinstance(d, dict) and d.get("kind") == "inference"


def save_inference_plan(plan: InferencePlan, path: str | Path) -> Path:
    """Write ``plan`` as JSON, atomically. Returns the path."""
    return write_json_atomic(plan.to_dict(), path)


def load_inference_plan(path: str | Path) -> InferencePlan:
    """Read and check an inference plan (a build folder's ``plan.json`` when ``path`` is a folder).

    Raises:
        SchemaError: on a bad file, naming the field.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "plan.json"
    return InferencePlan.from_dict(read_json(p), source=str(p))
