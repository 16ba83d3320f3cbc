"""Pass 2, profile: per-node costs of a traced model on every device kind asked for.

``profile()`` = static facts on meta tensors (:mod:`.static`: op kind, FLOPs,
bytes) + times measured on the devices that are present (:mod:`.timing`: the
CPU always, a CUDA GPU when there is one) + predictions from ``cost_models``
for device kinds that are not present, calibrated on the measured ones and
marked ``"measured": false``. The result is a :class:`~hpml_compile.ir.Profile`,
saved as profile.json; re-planning needs only that file, not the model.

Example:
    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())
    >>> p = profile(m, (torch.randn(8, 32),), device_kinds=("cpu", "A100-80GB"), repeats=3, progress=False)
    >>> p.node("_0").cost["cpu"].measured, p.node("_0").cost["A100-80GB"].measured
    (True, False)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.fx as fx

import cost_models
from cost_models.calibrate import Calibration, OpSample, fit, predict_ms

from ..errors import HpmlError, UnknownDeviceError
from ..ir import BackwardTiming, FrontEnd, NodeCost, NodeOp, Profile, ProfileNode
from ..schema import read_json, write_json_atomic
from ..trace import node_info, trace
from .static import NodeFacts, analyze
from .timing import measure

__all__ = ["profile", "predict_kinds", "check_kinds", "local_kinds", "save_profile", "load_profile"]

# A backward pass reads the saved inputs and the output gradient and writes the
# input and weight gradients: about twice the forward's traffic.
_BWD_MEM_FACTOR = 2.0


def check_kinds(kinds: Sequence[str], known: Sequence[str] = (), where: str = "the profile") -> None:
    """Raise UnknownDeviceError unless every kind is in ``known`` (found in ``where``) or the catalog."""
    catalog = set(cost_models.known_kinds())
    for kind in kinds:
        if kind not in catalog and kind not in known:
            raise UnknownDeviceError(
                f"unknown device kind {kind!r}: it is neither in {where} ({', '.join(known) or 'none'}) "
                f"nor in the cost_models catalog ({', '.join(sorted(catalog))}); use one of those names "
                "or profile on that device")


def local_kinds() -> dict[str, torch.device]:
    """Device kinds present on this machine and where to measure them: the CPU, and each CUDA GPU kind."""
    kinds = {"cpu": torch.device("cpu")}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            kind = cost_models.kind_from_cuda_name(props.name, props.total_memory) or props.name
            kinds.setdefault(kind, torch.device("cuda", i))
    return kinds


def _is_meta(model: torch.nn.Module, inputs: Sequence[Any]) -> bool:
    tensors = [*model.parameters(), *model.buffers(), *(x for x in inputs if isinstance(x, torch.Tensor))]
    return any(t.is_meta for t in tensors)


def _infer_sizes(inputs: Sequence[Any]) -> tuple[int, int | None]:
    first = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    if first is None:
        return 1, None
    seq = int(first.shape[1]) if first.dim() >= 2 and not first.is_floating_point() else None
    return int(first.shape[0]), seq


def _dtype(model: torch.nn.Module) -> str:
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    return str(p.dtype).removeprefix("torch.") if p is not None else "float32"


def _measure_on(gm: fx.GraphModule, inputs: Sequence[Any], device: torch.device, repeats: int, warmup: int,
                progress: bool) -> tuple[dict[str, NodeCost], NodeCost]:
    if device.type == "cpu":
        return measure(gm, inputs, device=device, repeats=repeats, warmup=warmup, progress=progress)
    import copy  # a GPU gets its own copy so the user's model stays where it is

    return measure(copy.deepcopy(gm).to(device), inputs, device=device, repeats=repeats, warmup=warmup,
                   progress=progress)


def profile(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor,
    *,
    name: str | None = None,
    device_kinds: Sequence[str] = ("cpu",),
    batch_size: int | None = None,
    seq_len: int | None = None,
    repeats: int = 5,
    warmup: int = 2,
    leaf_modules: Sequence[type | str] = (),
    front_end: FrontEnd | str = FrontEnd.AUTO,
    progress: bool = True,
) -> Profile:
    """Trace (unless given a traced GraphModule) and profile ``model``.

    Args:
        model: an nn.Module, possibly on the meta device (then nothing is
            measured and every cost is predicted), or the output of
            :func:`hpml_compile.trace`.
        example_inputs: positional inputs of one training batch.
        name: model name written to the profile (default: the class name).
        device_kinds: kinds to give costs for; kinds present here (``cpu``, a
            local GPU's kind) are measured, the others predicted.
        batch_size, seq_len: recorded in the file (default: read off the inputs).
        repeats, warmup: timed and untimed calls per node.
        leaf_modules, front_end: passed to :func:`hpml_compile.trace`.
        progress: progress bar while measuring.

    Returns:
        The Profile, nodes in topological order.

    Raises:
        UnknownDeviceError: a kind is neither present nor in the catalog.
        TraceError: the model cannot be traced.
    """
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    kinds = list(dict.fromkeys(device_kinds))
    present = local_kinds()
    check_kinds(kinds, known=list(present), where="this machine's devices")
    gm = model if isinstance(model, fx.GraphModule) and "hpml_front_end" in model.meta else \
        trace(model, inputs, leaf_modules=leaf_modules, front_end=front_end)
    facts = analyze(gm)
    meta = _is_meta(gm, inputs)
    measured: dict[str, dict[str, NodeCost]] = {}
    totals: dict[str, NodeCost] = {}
    if not meta:
        for kind in kinds:
            if kind in present:
                measured[kind], totals[kind] = _measure_on(gm, inputs, present[kind], repeats, warmup, progress)
    b, s = _infer_sizes(inputs)
    nodes = _nodes(gm, facts, measured)
    devices = {k: {"measured": True, "device": str(present[k])} for k in measured}
    prof = Profile(
        model=name or type(model).__name__, batch_size=batch_size or b, seq_len=seq_len if seq_len else s,
        dtype=_dtype(gm), nodes=nodes, front_end=gm.meta["hpml_front_end"],
        backward_timing=BackwardTiming.PER_NODE if measured else BackwardTiming.PREDICTED,
        repeats=repeats if measured else 0, warmup=warmup if measured else 0, devices=devices, totals=totals,
    )
    return predict_kinds(prof, kinds)


def _nodes(gm: fx.GraphModule, facts: dict[str, NodeFacts], measured: dict[str, dict[str, NodeCost]]
           ) -> tuple[ProfileNode, ...]:
    out = []
    for node in gm.graph.nodes:
        info, f = node_info(node), facts[node.name]
        out.append(ProfileNode(
            name=node.name, op=NodeOp(node.op), target=_target_str(node),
            inputs=tuple(n.name for n in node.all_input_nodes), scope=info.scope, op_kind=f.op_kind,
            flops=f.flops, bwd_flops=f.bwd_flops, param_bytes=f.param_bytes, params=f.params,
            output_bytes=info.output_bytes, activation_bytes=f.activation_bytes, mem_bytes=f.mem_bytes,
            output_shape=info.shape, output_dtype=info.dtype, tensor_output=info.tensor_output,
            cost={k: costs[node.name] for k, costs in measured.items()},
        ))
    return tuple(out)


def _target_str(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    module = getattr(t, "__module__", None)
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None)
    return f"{module}.{name}" if module and name else str(t)


def _calibrations(p: Profile) -> dict[str, tuple[Calibration, Calibration]]:
    """(forward, backward) calibrations fitted on each measured kind of a profile."""
    out = {}
    for kind, info in p.devices.items():
        if not info.get("measured") or kind not in cost_models.known_kinds():
            continue  # a measured GPU the catalog lacks has no datasheet roofline to calibrate against
        spec = cost_models.get_device(kind)
        live = [n for n in p.nodes if n.op not in (NodeOp.PLACEHOLDER, NodeOp.OUTPUT, NodeOp.GET_ATTR)
                and kind in n.cost]
        fwd = [OpSample(n.op_kind, n.flops, n.mem_bytes, n.cost[kind].fwd_ms) for n in live if n.cost[kind].fwd_ms > 0]
        bwd = [OpSample(n.op_kind, n.bwd_flops, _BWD_MEM_FACTOR * n.mem_bytes, n.cost[kind].bwd_ms)
               for n in live if n.cost[kind].bwd_ms > 0]
        if fwd and bwd:
            out[kind] = (fit(fwd, spec, p.dtype), fit(bwd, spec, p.dtype))
    return out


def predict_kinds(p: Profile, kinds: Sequence[str]) -> Profile:
    """Add predicted costs for the ``kinds`` the profile lacks.

    Predictions use the roofline of each kind's datasheet with multipliers
    fitted on a measured kind of the same profile (the CPU first), so they
    need only the profile, not the model. A profile with nothing measured
    uses the bare roofline with the catalog's efficiency priors.

    Raises:
        UnknownDeviceError: a kind is in neither the profile nor the catalog.
    """
    missing = [k for k in dict.fromkeys(kinds) if k not in p.device_kinds]
    if not missing:
        return p
    check_kinds(missing, known=p.device_kinds)
    calibs = _calibrations(p)
    source = "cpu" if "cpu" in calibs else next(iter(calibs), None)
    fwd_cal, bwd_cal = calibs[source] if source else (None, None)
    devices = dict(p.devices)
    new_nodes = []
    specs = {k: cost_models.get_device(k) for k in missing}
    for n in p.nodes:
        cost = dict(n.cost)
        for k in missing:
            if n.op in (NodeOp.PLACEHOLDER, NodeOp.OUTPUT, NodeOp.GET_ATTR):
                cost[k] = NodeCost(0.0, 0.0, False)
                continue
            fwd = predict_ms(n.op_kind, n.flops, n.mem_bytes, specs[k], p.dtype, fwd_cal)
            bwd = predict_ms(n.op_kind, n.bwd_flops, _BWD_MEM_FACTOR * n.mem_bytes, specs[k], p.dtype, bwd_cal) \
                if n.bwd_flops or n.activation_bytes or n.param_bytes else 0.0
            cost[k] = NodeCost(fwd, bwd, False)
        new_nodes.append(ProfileNode(**{**{f: getattr(n, f) for f in ProfileNode.__slots__}, "cost": cost}))
    for k in missing:
        devices[k] = {"measured": False, "predicted_from": f"{source} calibration + datasheet" if source
                      else "datasheet roofline with prior efficiencies"}
    if source:
        devices[source] = {**devices[source], "calibration_fwd": fwd_cal.to_dict(),  # type: ignore[union-attr]
                           "calibration_bwd": bwd_cal.to_dict()}  # type: ignore[union-attr]
    return Profile(**{**{f: getattr(p, f) for f in Profile.__slots__}, "nodes": tuple(new_nodes),
                      "devices": devices})


def save_profile(p: Profile, path: str | os.PathLike[str]) -> Path:
    """Write profile.json atomically (a crash mid-write leaves any previous file whole)."""
    return write_json_atomic(p.to_dict(), path)


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and schema-check a profile.json (raises SchemaError naming the bad field)."""
    try:
        return Profile.from_dict(read_json(path), source=str(path))
    except HpmlError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise HpmlError(f"{path}: not a valid profile: {e}") from e
