"""Typed data passed between the passes: immutable, validated, JSON round-trip.

No torch objects live here: a Profile or a Cluster loads from JSON on a
machine without the model.

Example:
    >>> c = NodeCost(fwd_ms=1.0, bwd_ms=2.0, measured=True)
    >>> n = ProfileNode(name="fc1", op=NodeOp.CALL_MODULE, target="fc1", inputs=("x",),
    ...                 cost={"cpu": c})
    >>> p = Profile(model="toy", batch_size=1, dtype="float32", nodes=(
    ...     ProfileNode(name="x", op=NodeOp.PLACEHOLDER, target="x"), n))
    >>> Profile.from_dict(p.to_dict()) == p
    True
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, TypeVar

from .errors import OptionError, SchemaError
from .schema import CLUSTER_SCHEMA, PROFILE_SCHEMA, check_version, validate

__all__ = [
    "Host",
    "Assumption",
    "Certificate",
    "PROFILE_VERSION",
    "CLUSTER_VERSION",
    "NodeOp",
    "Schedule",
    "FrontEnd",
    "BackwardTiming",
    "Precision",
    "NodeCost",
    "ProfileNode",
    "Profile",
    "CostGraphNode",
    "Device",
    "Link",
    "Cluster",
    "base_kind",
    "variant_kind",
]

PROFILE_VERSION = 2
PROFILE_READS = (1, 2)  # version 1 files have no fixed costs, loss, optimizer or parameter sizes
CLUSTER_VERSION = 1
VARIANT_SEP = "~"
_T = TypeVar("_T")


def base_kind(kind: str) -> str:
    """The hardware kind of a device kind: ``"cpu~cpu1"`` -> ``"cpu"``, ``"A100-80GB"`` -> itself.

    A *variant* kind is one device's own copy of its kind's costs, made when
    the runtime measures that device running slower than its peers (a
    throttled or shared GPU, a busy host): the solver then sees a device
    kind of its own, while the hardware (CPU or CUDA, catalog entry, links)
    is still the base kind's.

    >>> base_kind("cpu~cpu1"), base_kind("H100-80GB")
    ('cpu', 'H100-80GB')
    """
    return kind.split(VARIANT_SEP, 1)[0]


def variant_kind(kind: str, device: str) -> str:
    """The variant kind of ``device`` (see :func:`base_kind`): ``variant_kind("cpu", "cpu1") == "cpu~cpu1"``."""
    return f"{base_kind(kind)}{VARIANT_SEP}{device}"


class Schedule(str, enum.Enum):
    """Pipeline schedule: GPipe (Huang et al. 2019), 1F1B (PipeDream-flush, Narayanan et al. 2021), ZB-H1 or
    interleaved 1F1B.

    ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each backward split into its
    input-gradient part (on the critical path) and its weight-gradient part, deferred to fill the bubble.
    Interleaved 1F1B (Narayanan et al., SC 2021; Megatron-LM's virtual pipeline): each device group holds
    ``v`` chunks of the model (a plan's ``chunks``), so the pipeline fills ``v`` times faster.
    """

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    ZB_H1 = "zb-h1"
    INTERLEAVED = "interleaved-1f1b"


class NodeOp(str, enum.Enum):
    """torch.fx node opcodes."""

    PLACEHOLDER = "placeholder"
    GET_ATTR = "get_attr"
    CALL_FUNCTION = "call_function"
    CALL_METHOD = "call_method"
    CALL_MODULE = "call_module"
    OUTPUT = "output"


class FrontEnd(str, enum.Enum):
    """How a model became a graph: ``torch.fx.symbolic_trace`` or ``torch.export``."""

    AUTO = "auto"
    FX = "fx"
    EXPORT = "export"


class BackwardTiming(str, enum.Enum):
    """How per-node backward times in a profile were obtained."""

    PER_NODE = "per_node"  # each node's backward timed in isolation
    APPORTIONED = "apportioned"  # timed per block, split by backward FLOPs
    PREDICTED = "predicted"  # no measurement: cost_models only


class Precision(str, enum.Enum):
    """How a model trains: in fp32, or under autocast to bf16 or fp16 (mixed precision).

    Under ``bf16``/``fp16`` the parameters, their gradients and the optimizer
    state stay fp32 (the master weights); the forward runs under
    ``torch.autocast`` to the compute dtype, whose activations (and their
    gradients) also cross stage boundaries in it. ``fp16`` adds loss scaling.

    >>> Precision("bf16").dtype, Precision.FP16.bytes, Precision.FP32.is_mixed
    ('bfloat16', 2, False)
    """

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> str:
        """The compute dtype's name (``float32``, ``bfloat16``, ``float16``): the catalog's key for its peak."""
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[self.value]

    @property
    def bytes(self) -> int:
        """Bytes per element of the compute dtype."""
        return 4 if self is Precision.FP32 else 2

    @property
    def is_mixed(self) -> bool:
        """Whether the forward runs under autocast (bf16 or fp16)."""
        return self is not Precision.FP32

    @classmethod
    def parse(cls, value: "Precision | str", where: str = "precision") -> "Precision":
        """``value`` as a Precision, or an OptionError naming ``where``, the value and the choices."""
        try:
            return cls(value)
        except ValueError:
            raise OptionError(f"{where}: {value!r} is not a precision; use one of "
                              f"{', '.join(p.value for p in cls)}") from None


@dataclass(frozen=True, slots=True)
class NodeCost:
    """Time of one node on one device kind, in milliseconds, for the profile's batch.

    ``*_spread_ms`` is the inter-quartile range of the repeats (0 when predicted).
    ``*_fixed_ms`` is the part of the time that does not shrink with the batch
    (reading the weights, launching kernels, Python): a slice of ``rows`` of
    the profile's ``batch`` rows costs ``fixed + (ms - fixed) * rows / batch``
    (:meth:`at`). 0 (the default, and what a version 1 profile means) is the
    old assumption that time is proportional to the rows.
    """

    fwd_ms: float
    bwd_ms: float
    measured: bool
    fwd_spread_ms: float = 0.0
    bwd_spread_ms: float = 0.0
    fwd_fixed_ms: float = 0.0
    bwd_fixed_ms: float = 0.0

    def __post_init__(self) -> None:
        for f in ("fwd_ms", "bwd_ms", "fwd_spread_ms", "bwd_spread_ms", "fwd_fixed_ms", "bwd_fixed_ms"):
            if getattr(self, f) < 0:
                raise ValueError(f"NodeCost.{f} must be >= 0, got {getattr(self, f)}")
        if self.fwd_fixed_ms > self.fwd_ms or self.bwd_fixed_ms > self.bwd_ms:
            raise ValueError(f"NodeCost: a fixed part exceeds its time ({self.fwd_fixed_ms} > {self.fwd_ms} or "
                             f"{self.bwd_fixed_ms} > {self.bwd_ms})")

    def at(self, fraction: float) -> tuple[float, float]:
        """``(fwd_ms, bwd_ms)`` of a slice holding ``fraction`` of the profile's batch rows."""
        return (self.fwd_fixed_ms + (self.fwd_ms - self.fwd_fixed_ms) * fraction,
                self.bwd_fixed_ms + (self.bwd_ms - self.bwd_fixed_ms) * fraction)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "profile", where: str = "cost") -> "NodeCost":
        """Build from a schema-checked dict (see :data:`~hpml_compile.schema.PROFILE_SCHEMA`).

        Args:
            d: the cost's fields.
            source: the file, for the message.
            where: the cost's field path, e.g. ``nodes[3].cost.cpu``.

        Returns:
            The cost.

        Raises:
            SchemaError: for a fixed part larger than its time.
        """
        for part in ("fwd", "bwd"):
            fixed, ms = d.get(f"{part}_fixed_ms", 0.0), d[f"{part}_ms"]
            if fixed > ms:
                raise SchemaError(source, f"{where}.{part}_fixed_ms", f"at most {part}_ms ({ms})", repr(fixed),
                                  fix="the fixed part of a time cannot exceed the time")
        return cls(**d)


@dataclass(frozen=True, slots=True)
class ProfileNode:
    """One fx node with its static sizes and its cost per device kind.

    ``param_bytes`` counts each parameter once, on the first node (in
    topological order) that uses it; ``params`` lists every parameter the node
    uses, so that shared (tied) parameters are visible to later passes.
    ``activation_bytes`` is what autograd saves for backward (parameters
    excluded); ``mem_bytes`` what the forward reads and writes (for roofline).
    ``compiled`` holds, for the kinds whose blocks were also timed compiled by
    ``torch.compile`` (:mod:`hpml_compile.profile.compiled`), the node's cost
    in a stage that runs compiled; the cost graph prices with it where asked.
    """

    name: str
    op: NodeOp
    target: str
    inputs: tuple[str, ...] = ()
    scope: str = ""
    op_kind: str = "other"
    flops: int = 0
    bwd_flops: int = 0
    param_bytes: int = 0
    params: tuple[str, ...] = ()
    output_bytes: int = 0
    activation_bytes: int = 0
    mem_bytes: int = 0
    output_shape: tuple[int, ...] | None = None
    output_dtype: str | None = None
    tensor_output: bool = True
    cost: Mapping[str, NodeCost] = field(default_factory=dict)
    compiled: Mapping[str, NodeCost] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["op"] = self.op.value
        d["inputs"] = list(self.inputs)
        d["params"] = list(self.params)
        d["output_shape"] = None if self.output_shape is None else list(self.output_shape)
        d["cost"] = {k: v.to_dict() for k, v in self.cost.items()}
        if self.compiled:
            d["compiled"] = {k: v.to_dict() for k, v in self.compiled.items()}
        else:
            del d["compiled"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "profile", where: str = "node") -> "ProfileNode":
        """Build from a schema-checked dict; ``source`` and ``where`` (its field path) name it in errors.

        Raises:
            SchemaError: for a cost whose fixed part exceeds its time.
        """
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["op"] = NodeOp(d["op"])
        kw["inputs"] = tuple(d["inputs"])
        kw["params"] = tuple(d.get("params", ()))
        shape = d.get("output_shape")
        kw["output_shape"] = None if shape is None else tuple(shape)
        kw["cost"] = {k: NodeCost.from_dict(v, source, f"{where}.cost.{k}") for k, v in d["cost"].items()}
        kw["compiled"] = {k: NodeCost.from_dict(v, source, f"{where}.compiled.{k}")
                          for k, v in d.get("compiled", {}).items()}
        return cls(**kw)


@dataclass(frozen=True, slots=True)
class Profile:
    """Per-node costs of one model at one batch size: what profile.json holds.

    ``devices`` describes each device kind (``{"measured": bool, ...}``);
    ``totals`` holds whole-model forward/backward times where they were
    measured (the per-node times are scaled to add up to them).
    ``micro_batch`` is the second, smaller batch the nodes were also timed at
    to split each cost into a fixed and a per-row part (None: not measured).
    ``loss`` names the loss function timed with the output node (whose cost
    is then the loss's), None when the loss was not timed.
    ``optimizer_ms`` is one optimizer step (``optimizer``) over all
    ``parameters`` (``{name: bytes}``, tied parameters once per name that
    the nodes use) per device kind; empty when not measured or predicted.
    ``threads`` is the number of torch threads the CPU was measured with
    (CPU times depend on it: a plan for ranks that run with fewer threads
    must not use them); None when the CPU was not measured, or in a file
    written before the field existed.
    ``precision`` is what the nodes were timed under (:class:`Precision`: fp32,
    or autocast to bf16/fp16); under mixed precision ``activation_bytes`` are
    what autograd saves under autocast (the compute-dtype copies of the
    weights included) and a floating output's ``output_bytes`` is its size in
    the compute dtype, what a stage boundary sends. ``dtype`` stays the
    parameters' (the fp32 master weights). A file written before the field
    existed is fp32.
    """

    model: str
    batch_size: int
    dtype: str
    nodes: tuple[ProfileNode, ...]
    seq_len: int | None = None
    front_end: FrontEnd = FrontEnd.FX
    backward_timing: BackwardTiming = BackwardTiming.PER_NODE
    repeats: int = 0
    warmup: int = 0
    devices: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    totals: Mapping[str, NodeCost] = field(default_factory=dict)
    micro_batch: int | None = None
    loss: str | None = None
    optimizer: str | None = None
    optimizer_ms: Mapping[str, float] = field(default_factory=dict)
    parameters: Mapping[str, int] = field(default_factory=dict)
    threads: int | None = None
    precision: Precision = Precision.FP32
    schema_version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision(self.precision))
        if self.threads is not None and self.threads < 1:
            raise SchemaError("profile", "threads", "the number of torch threads measured with, 1 or more",
                              repr(self.threads))
        seen: set[str] = set()
        for i, n in enumerate(self.nodes):
            if n.name in seen:
                raise SchemaError("profile", f"nodes[{i}].name", "a unique node name", repr(n.name))
            for j, inp in enumerate(n.inputs):
                if inp not in seen:
                    raise SchemaError("profile", f"nodes[{i}].inputs[{j}]",
                                      "the name of an earlier node (nodes are in topological order)", repr(inp))
            seen.add(n.name)

    @property
    def device_kinds(self) -> tuple[str, ...]:
        """Device kinds that every node has a cost for."""
        kinds: set[str] | None = None
        for n in self.nodes:
            kinds = set(n.cost) if kinds is None else kinds & set(n.cost)
        return tuple(sorted(kinds or ()))

    def node(self, name: str) -> ProfileNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r} in the profile of {self.model}")

    def total(self, kind: str) -> NodeCost:
        """Sum of the per-node costs on ``kind``."""
        if kind not in self.device_kinds:
            raise KeyError(f"device kind {kind!r} is not in this profile; it has {list(self.device_kinds)}")
        return NodeCost(
            fwd_ms=sum(n.cost[kind].fwd_ms for n in self.nodes),
            bwd_ms=sum(n.cost[kind].bwd_ms for n in self.nodes),
            measured=all(n.cost[kind].measured for n in self.nodes),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model": self.model,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "dtype": self.dtype,
            "front_end": self.front_end.value,
            "backward_timing": self.backward_timing.value,
            "repeats": self.repeats,
            "warmup": self.warmup,
            "devices": {k: dict(v) for k, v in self.devices.items()},
            "totals": {k: v.to_dict() for k, v in self.totals.items()},
            "micro_batch": self.micro_batch,
            "loss": self.loss,
            "optimizer": self.optimizer,
            "optimizer_ms": dict(self.optimizer_ms),
            "parameters": dict(self.parameters),
            "threads": self.threads,
            "precision": self.precision.value,
            "nodes": [n.to_dict() for n in self.nodes],
        }

    @classmethod
    def from_dict(cls, d: Any, source: str = "profile") -> "Profile":
        """Build from parsed JSON, checking the schema first.

        Raises:
            SchemaError: naming ``source`` and the first field that is missing, unknown, of the wrong
                type or not finite, or a node name that is repeated or used before it is defined.
        """
        check_version(d, PROFILE_READS, source)
        validate(d, PROFILE_SCHEMA, source)
        return _build(
            source, cls,
            model=d["model"],
            batch_size=d["batch_size"],
            seq_len=d.get("seq_len"),
            dtype=d["dtype"],
            front_end=FrontEnd(d.get("front_end", "fx")),
            backward_timing=BackwardTiming(d.get("backward_timing", "per_node")),
            repeats=d.get("repeats", 0),
            warmup=d.get("warmup", 0),
            devices=d.get("devices", {}),
            totals={k: NodeCost.from_dict(v, source, f"totals.{k}") for k, v in d.get("totals", {}).items()},
            micro_batch=d.get("micro_batch"),
            loss=d.get("loss"),
            optimizer=d.get("optimizer"),
            optimizer_ms=d.get("optimizer_ms", {}),
            parameters=d.get("parameters", {}),
            threads=d.get("threads"),
            precision=Precision(d.get("precision", "fp32")),
            nodes=tuple(ProfileNode.from_dict(n, source, f"nodes[{i}]") for i, n in enumerate(d["nodes"])),
        )


@dataclass(frozen=True, slots=True)
class CostGraphNode:
    """What a cost-graph node carries: one fx node, or a block of merged ones.

    Read with :meth:`hpml_compile.costgraph.CostGraph.node`; the graph stores these
    fields as networkx node attributes, and only ``costgraph`` reads those.

    Attributes:
        members: the fx node names, in topological order.
        cost: ``{kind: (fwd_ms, bwd_ms)}`` for the profile's full batch.
        params: the parameter names the members use.
        scope: the module path of the first member.
        op: the fx op of a single member (a :class:`NodeOp` value), ``"block"`` for merged nodes.
        flops, bwd_flops: forward and backward FLOPs (sums over the members).
        param_bytes, activation_bytes, output_bytes, mem_bytes: bytes (sums over the members).
        fixed: ``{kind: (fwd_ms, bwd_ms)}``, the part of ``cost`` that a slice of the batch still
            costs in full (a kind absent: 0).
        shard: ``{tp: hpml_compile.tp.ShardPart}``: what a tensor-parallel degree divides of the members and
            the collectives it adds (a degree absent: nothing shards at it).
        split: ``{kind: (weight_ms, extra_ms, extra_weight_ms)}``, ZB-H1's backward split as the profile measured
            it (:mod:`hpml_compile.profile.split`): the weight-gradient part of ``cost``'s backward, the split's
            own cost per microbatch, and that cost's weight-gradient part (a kind absent: not measured).

    Raises:
        ValueError: for a node without members.

    >>> n = CostGraphNode(("fc",), {"cpu": (1.0, 2.0)}, ("fc.weight",), "fc", "call_module", 8, 16, 4, 4, 4, 12)
    >>> n.fixed_at("cpu"), sum(n.cost["cpu"])
    ((0.0, 0.0), 3.0)
    """

    members: tuple[str, ...]
    cost: Mapping[str, tuple[float, float]]
    params: tuple[str, ...]
    scope: str
    op: str
    flops: int
    bwd_flops: int
    param_bytes: int
    activation_bytes: int
    output_bytes: int
    mem_bytes: int
    fixed: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    shard: Mapping[int, Any] = field(default_factory=dict)
    split: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("a cost-graph node needs at least one member (fx node)")

    def fixed_at(self, kind: str) -> tuple[float, float]:
        """``(fwd_ms, bwd_ms)`` of the fixed part on ``kind`` (0 when the node has none there)."""
        return self.fixed.get(kind, (0.0, 0.0))


@dataclass(frozen=True, slots=True)
class Device:
    """One device a plan may use. ``kind`` names a cost_models catalog entry or a profile's kind."""

    name: str
    kind: str
    memory_gib: float
    host: str = "node0"

    def __post_init__(self) -> None:
        if self.memory_gib <= 0:
            raise ValueError(f"device {self.name}: memory_gib must be > 0, got {self.memory_gib}")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def is_cpu(self) -> bool:
        """Whether the device is a CPU (its base kind is ``cpu``)."""
        return base_kind(self.kind).lower() == "cpu"


@dataclass(frozen=True, slots=True)
class Link:
    """A link between two devices: bandwidth in GB/s (one direction) and latency.

    ``shared``: the two ends draw on one pool of bandwidth (processes of one host over loopback), so a
    collective costs the traffic of every rank (cost_models' ``LinkSpec.shared``). ``source``: where the
    figures come from (``measured: ...`` where ``hpml-compile devices --measure`` timed them).
    ``collectives``: ``(op, gbps, latency_us)`` measured for the reduce-scatter and the all-gather on their
    own, where the backend runs them slower than the link's ring (``LinkSpec.collectives``); in JSON
    ``{"reduce_scatter": {"gbps": .., "latency_us": ..}, ...}``. ``tp_reduce_per_ms``: what each ms of
    compute before a tensor-parallel layer's all-reduce adds to it (``LinkSpec.tp_reduce_per_ms``).
    """

    a: str
    b: str
    gbps: float
    latency_us: float = 5.0
    shared: bool = False
    source: str = ""
    collectives: tuple[tuple[str, float, float], ...] = ()
    tp_reduce_per_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "gbps": self.gbps, "latency_us": self.latency_us,
                **({"shared": True} if self.shared else {}), **({"source": self.source} if self.source else {}),
                **({"collectives": collectives_dict(self.collectives)} if self.collectives else {}),
                **({"tp_reduce_per_ms": self.tp_reduce_per_ms} if self.tp_reduce_per_ms else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Link":
        """From a validated JSON object (``collectives`` as an object of fits)."""
        fits = d.get("collectives") or {}
        return cls(**{**d, "collectives": tuple((op, float(f["gbps"]), float(f["latency_us"]))
                                                 for op, f in fits.items())})


def collectives_dict(fits: tuple[tuple[str, float, float], ...]) -> dict[str, dict[str, float]]:
    """``Link.collectives`` as JSON: ``{op: {"gbps", "latency_us"}}``."""
    return {op: {"gbps": gbps, "latency_us": lat} for op, gbps, lat in fits}


@dataclass(frozen=True, slots=True)
class Host:
    """A host as cluster.json may describe it, so that the links between its devices follow from it.

    Attributes:
        name: the host (the ``host`` of its devices).
        fabric: the cost_models link between two devices of this host (``nvlink4``, ``pcie4``; "" : the
            catalog default for their kinds).
        nic: the cost_models link of its network cards (``ib-ndr``, ``eth100``; "": not described, the catalog
            default between hosts).
        nics: how many network cards it has; its devices share them equally (``devices / nics`` per card).
        nic_gbps: each card's bandwidth in GB/s where it differs from the ``nic`` link's (None: the link's).
    """

    name: str
    fabric: str = ""
    nic: str = ""
    nics: int = 1
    nic_gbps: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **({"fabric": self.fabric} if self.fabric else {}),
                **({"nic": self.nic, "nics": self.nics} if self.nic else {}),
                **({"nic_gbps": self.nic_gbps} if self.nic_gbps is not None else {})}


@dataclass(frozen=True, slots=True)
class Cluster:
    """Devices, optionally their hosts (:class:`Host`) and links between pairs of them: what cluster.json holds.

    A pairwise link wins over what the hosts imply (:func:`hpml_compile.cluster.link_spec`)."""

    devices: tuple[Device, ...]
    links: tuple[Link, ...] = ()
    name: str = "custom"
    schema_version: int = CLUSTER_VERSION
    hosts: tuple[Host, ...] = ()
    # name -> device, built once: the planners look devices up by name millions of times on large clusters
    _by_name: Mapping[str, Device] = field(default_factory=dict, init=False, repr=False, compare=False)
    _host_by_name: Mapping[str, Host] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [d.name for d in self.devices]
        index: dict[str, Device] = {}
        for i, d in enumerate(self.devices):
            if d.name in index:
                raise SchemaError(self.name, f"devices[{i}].name", "a unique device name", repr(d.name))
            index[d.name] = d
        for i, link in enumerate(self.links):
            for end in ("a", "b"):
                if getattr(link, end) not in index:
                    raise SchemaError(self.name, f"links[{i}].{end}", f"one of the devices {names}",
                                      repr(getattr(link, end)))
        object.__setattr__(self, "_by_name", index)
        used = {d.host for d in self.devices}
        for i, h in enumerate(self.hosts):
            if h.name not in used:
                raise SchemaError(self.name, f"hosts[{i}].name", f"the host of some device ({', '.join(sorted(used))})",
                                  repr(h.name))
            if h.nics < 1:
                raise SchemaError(self.name, f"hosts[{i}].nics", "at least 1 network card", repr(h.nics))
        object.__setattr__(self, "_host_by_name", {h.name: h for h in self.hosts})

    def host(self, name: str) -> Host | None:
        """The description of host ``name``, or None where the cluster gives none."""
        return self._host_by_name.get(name)

    def device(self, name: str) -> Device:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no device named {name!r} in cluster {self.name}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "name": self.name,
            "devices": [{"name": d.name, "kind": d.kind, "memory_gib": d.memory_gib, "host": d.host}
                        for d in self.devices],
            "links": [x.to_dict() for x in self.links],
            **({"hosts": [h.to_dict() for h in self.hosts]} if self.hosts else {}),
        }

    @classmethod
    def from_dict(cls, d: Any, source: str = "cluster") -> "Cluster":
        """Build from parsed JSON, checking the schema first.

        Args:
            d: parsed cluster.json (or the ``cluster`` field of plan.json).
            source: the file, for the message.

        Returns:
            The cluster.

        Raises:
            SchemaError: naming ``source`` and the first field that is missing, unknown, of the wrong
                type or not finite, a repeated device name, or a link to a device not in the cluster.
        """
        check_version(d, CLUSTER_VERSION, source)
        validate(d, CLUSTER_SCHEMA, source)
        return _build(
            source, cls,
            name=d.get("name", source),
            devices=tuple(Device(**dev) for dev in d["devices"]),
            links=tuple(Link.from_dict(x) for x in d.get("links", ())),
            hosts=tuple(Host(**h) for h in d.get("hosts", ())),
        )


@dataclass(frozen=True, slots=True)
class Certificate:
    """How far a plan can be from the best plan under the cost model (:func:`hpml_compile.certify.certify`).

    Attributes:
        step_ms: the plan's simulated step.
        bound_ms: a lower bound on the simulated step of every plan of its cluster; None: no certificate.
        bound: which bound (with ``bound_ms``), or why there is none.
    """

    step_ms: float
    bound_ms: float | None
    bound: str

    @property
    def within(self) -> float | None:
        """``X`` with ``step <= (1 + X) * best``: the step over the bound, less one; None without a bound."""
        return None if self.bound_ms is None else max(0.0, self.step_ms / self.bound_ms - 1.0)

    @property
    def text(self) -> str:
        """One line for a person: "within X% of the best plan under the cost model (...)" or "no certificate"."""
        if self.within is None:
            return f"no certificate ({self.bound})"
        return (f"within {self.within:.1%} of the best plan under the cost model (every plan takes at least "
                f"{self.bound_ms:.4g} ms: {self.bound})")

    def to_dict(self) -> dict[str, Any]:
        return {"step_ms": self.step_ms, "bound_ms": self.bound_ms, "bound": self.bound, "within": self.within}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Certificate":
        return cls(d["step_ms"], d.get("bound_ms"), d["bound"])


@dataclass(frozen=True, slots=True)
class Assumption:
    """A cost the plan uses that was not measured on this machine: what it is, its value, where it comes from.

    Attributes:
        name: what is assumed (``"H100-80GB speed"``, ``"link between hosts"``).
        value: its value, with units.
        source: where the value comes from (a datasheet, a measurement elsewhere, a default).
    """

    name: str
    value: str
    source: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "value": self.value, "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Assumption":
        return cls(d["name"], d["value"], d["source"])


def _build(source: str, make: Callable[..., _T], **fields_: Any) -> _T:
    """``make(**fields_)``, with a SchemaError from its ``__post_init__`` (which names the object, not the file)
    re-raised naming ``source``, the file being read."""
    try:
        return make(**fields_)
    except SchemaError as e:
        raise SchemaError(source, e.field, e.expected, e.got, e.fix) from None
