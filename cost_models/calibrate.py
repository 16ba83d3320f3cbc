"""Calibration: fit per-op-kind multipliers on one device, carry them to others.

Model, on the measured device, for a sample of kind ``k``::

    ms = m[k] * roofline_ms(k, flops, mem_bytes, device, dtype) + overhead_ms

(a ``view`` sample is ``VIEW_OVERHEAD_FRACTION * overhead_ms``). :func:`fit`
first solves all ``m[k]`` and ``overhead_ms`` jointly by least squares on
relative error (each row divided by its ``ms``, so a 10 us op counts as much
as a 10 ms one), then replaces each ``m[k]`` by the median over its samples of
``(ms - overhead_ms) / roofline``, weighted by ``roofline / ms`` (a sample
that is all overhead carries no information on ``m[k]``), which a few
outliers cannot move. Kinds with no samples keep 1.0. With too few samples to
separate the overhead from the multipliers, the device's own
``launch_overhead_ms`` is kept.

Transfer rule (how a CPU measurement plus a datasheet predicts a GPU): a
multiplier says how far an op kind is from its ideal roofline. Part of that is
algorithmic and carries to any device (layernorm and softmax make several
passes over memory where the byte count assumes one; a FLOP counter misses
work); part belongs to the measured device (CPU caches let small ops beat the
DRAM roofline; an unvectorized CPU kernel) and does not carry. One device
cannot tell the parts apart, so on any other device we use the geometric
midpoint of "all carries" (``m``) and "none carries" (1)::

    m_target = clamp(sqrt(m), lo=max(prior efficiencies of the target), hi=4)

which halves the log-error whichever extreme is true. The lower clamp keeps a
prediction from beating the target's datasheet peak (roofline * m >= the
ideal time once m >= the efficiency prior); the upper clamp keeps one
pathological CPU kernel from making a GPU op more than 4x its roofline. The
fitted ``overhead_ms`` is the measured device's dispatch cost; on another
device its own ``launch_overhead_ms`` is used. On the measured device (same
``kind``) the multipliers and overhead apply unchanged.

Example:
    >>> from cost_models.catalog import get_device
    >>> cpu = get_device("cpu")
    >>> truth = lambda f, b: 2.0 * roofline_ms("norm", f, b, cpu) + 0.01
    >>> samples = [OpSample("norm", 5 * n, 8 * n, truth(5 * n, 8 * n))
    ...            for n in (1e3, 1e4, 1e5, 1e6, 1e7)]
    >>> cal = fit(samples, cpu)
    >>> round(cal.multipliers["norm"], 3), round(cal.overhead_ms, 3)
    (2.0, 0.01)
    >>> round(cal.multiplier("norm", get_device("H100-80GB")), 3)  # sqrt(2.0)
    1.414
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from cost_models.catalog import DTYPES, DeviceSpec
from cost_models.roofline import (
    VIEW_OVERHEAD_FRACTION,
    OpKind,
    op_time_ms,
    prior_efficiency,
    roofline_ms,
)

__all__ = ["CALIBRATION_VERSION", "Calibration", "OpSample", "fit", "predict_ms",
           "transfer_multiplier"]

CALIBRATION_VERSION = 1
_TRANSFER_MAX = 4.0


@dataclass(frozen=True, slots=True)
class OpSample:
    """One measured op.

    Attributes:
        kind: an ``OpKind`` value.
        flops: floating-point operations.
        mem_bytes: bytes read plus written.
        ms: measured time, milliseconds.
    """

    kind: str
    flops: float
    mem_bytes: float
    ms: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OpKind(self.kind).value)
        if not (math.isfinite(self.ms) and self.ms > 0):
            raise ValueError(f"OpSample.ms must be finite and > 0, got {self.ms}")


def transfer_multiplier(m: float, target: DeviceSpec) -> float:
    """Carry a multiplier fitted on one device to ``target`` (module docstring).

    Args:
        m: the fitted multiplier, > 0.
        target: the device it is applied to.

    Returns:
        ``clamp(sqrt(m), max(prior efficiencies of target), 4)``.
    """
    prior = prior_efficiency(target.category)
    return min(max(math.sqrt(m), prior.compute, prior.memory), _TRANSFER_MAX)


def _check_number(field: str, value: Any, minimum: float, strict: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        relation = ">" if strict else ">="
        raise ValueError(f"calibration field {field!r}: expected a finite number "
                         f"{relation} {minimum}, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class Calibration:
    """Per-op-kind multipliers on the roofline plus a per-op overhead, from one device.

    Attributes:
        device_kind: the kind of the device the samples were measured on.
        dtype: the dtype the samples ran in.
        multipliers: ``OpKind`` value -> multiplier; missing kinds mean 1.0.
        overhead_ms: fitted per-op overhead on the measured device.
    """

    device_kind: str
    dtype: str
    multipliers: Mapping[str, float]
    overhead_ms: float

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"calibration field 'dtype': expected one of {DTYPES}, "
                             f"got {self.dtype!r}")
        table: dict[str, float] = {}
        for key, value in self.multipliers.items():
            try:
                name = OpKind(key).value
            except ValueError:
                raise ValueError(f"calibration field 'multipliers': unknown op kind "
                                 f"{key!r}; expected one of {[k.value for k in OpKind]}"
                                 ) from None
            table[name] = _check_number(f"multipliers.{name}", value, 0.0, strict=True)
        object.__setattr__(self, "multipliers", MappingProxyType(table))
        _check_number("overhead_ms", self.overhead_ms, 0.0, strict=False)

    def __hash__(self) -> int:  # the mapping proxy is unhashable; hash its items
        return hash((self.device_kind, self.dtype, tuple(sorted(self.multipliers.items())),
                     self.overhead_ms))

    def multiplier(self, kind: OpKind | str, device: DeviceSpec) -> float:
        """The multiplier for ``kind`` on ``device``, transferred if it is another kind.

        Args:
            kind: the op kind.
            device: the device the prediction is for.

        Returns:
            The fitted multiplier on the measured device, else its transfer.
        """
        m = self.multipliers.get(OpKind(kind).value, 1.0)
        return m if device.kind == self.device_kind else transfer_multiplier(m, device)

    def overhead_for(self, device: DeviceSpec) -> float:
        """The per-op overhead on ``device``: fitted on the measured one, else its own.

        Args:
            device: the device the prediction is for.

        Returns:
            Milliseconds.
        """
        return self.overhead_ms if device.kind == self.device_kind \
            else device.launch_overhead_ms

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form, with a ``version`` field.

        Returns:
            A dict that :meth:`from_dict` reads back to an equal Calibration.
        """
        return {"version": CALIBRATION_VERSION, "device_kind": self.device_kind,
                "dtype": self.dtype, "overhead_ms": self.overhead_ms,
                "multipliers": dict(self.multipliers)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        """Read the form :meth:`to_dict` writes.

        Args:
            data: the parsed JSON object.

        Returns:
            The Calibration.

        Raises:
            ValueError: naming the field that is missing or wrong and what was expected.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"calibration: expected a JSON object, got {type(data).__name__}")
        for field in ("version", "device_kind", "dtype", "overhead_ms", "multipliers"):
            if field not in data:
                raise ValueError(f"calibration field {field!r} is missing")
        if data["version"] != CALIBRATION_VERSION:
            raise ValueError(f"calibration field 'version': expected {CALIBRATION_VERSION}, "
                             f"got {data['version']!r}")
        if not isinstance(data["device_kind"], str):
            raise ValueError(f"calibration field 'device_kind': expected a string, "
                             f"got {data['device_kind']!r}")
        if not isinstance(data["multipliers"], Mapping):
            raise ValueError("calibration field 'multipliers': expected an object "
                             "mapping op kinds to numbers")
        return cls(data["device_kind"], data["dtype"], data["multipliers"],
                   data["overhead_ms"])


def _weighted_median(pairs: list[tuple[float, float]]) -> float:
    """The value at half the total weight of (value, weight) pairs."""
    pairs = sorted(pairs)
    half, seen = sum(w for _, w in pairs) / 2, 0.0
    for value, weight in pairs:
        seen += weight
        if seen >= half:
            return value
    return pairs[-1][0]


def fit(samples: Iterable[OpSample], device: DeviceSpec, dtype: str = "float32"
        ) -> Calibration:
    """Fit multipliers and overhead to samples measured on ``device``.

    Args:
        samples: measured ops, all on ``device`` in ``dtype``.
        device: the device they ran on.
        dtype: the dtype they ran in.

    Returns:
        The Calibration; every ``OpKind`` has an entry, 1.0 where no sample informs it.

    Raises:
        ValueError: if there are no samples.
    """
    rows = list(samples)
    if not rows:
        raise ValueError("fit needs at least one OpSample")
    roofs = [roofline_ms(s.kind, s.flops, s.mem_bytes, device, dtype) for s in rows]
    kinds = sorted({s.kind for s, r in zip(rows, roofs, strict=True) if r > 0})
    column = {k: j for j, k in enumerate(kinds)}
    design = np.zeros((len(rows), len(kinds) + 1))
    for i, (s, r) in enumerate(zip(rows, roofs, strict=True)):
        if r > 0:
            design[i, column[s.kind]] = r
        design[i, -1] = VIEW_OVERHEAD_FRACTION if s.kind == OpKind.VIEW.value else 1.0
        design[i] /= s.ms  # relative error: every sample weighs the same
    solution, _, rank, _ = np.linalg.lstsq(design, np.ones(len(rows)), rcond=None)
    if rank < design.shape[1]:  # too few samples to separate overhead from multipliers
        overhead = device.launch_overhead_ms
    else:
        overhead = max(float(solution[-1]), 0.0)
    multipliers = {k.value: 1.0 for k in OpKind}
    for kind in kinds:
        # Weight r/ms: the share of the measured time the roofline explains. A sample
        # that is all overhead says nothing about m[kind], and its ratio is all noise.
        pairs = [((s.ms - overhead) / r, r / s.ms) for s, r in zip(rows, roofs, strict=True)
                 if s.kind == kind and r > 0]
        median = _weighted_median(pairs)
        # Every sample at or below the overhead: the median is noise; keep the LS value.
        multipliers[kind] = median if median > 0 else max(float(solution[column[kind]]), 1e-3)
    return Calibration(device.kind, dtype, multipliers, overhead)


def predict_ms(kind: OpKind | str, flops: float, mem_bytes: float, device: DeviceSpec,
               dtype: str = "float32", calib: Calibration | None = None, ops: float = 1.0) -> float:
    """Predict one op's time; ``op_time_ms`` with a calibration.

    Args:
        kind: the op kind.
        flops: floating-point operations.
        mem_bytes: bytes read plus written.
        device: the target device (the measured one or another).
        dtype: the compute dtype.
        calib: the fitted calibration, or None for the bare roofline.
        ops: kernels the host issues for the op (see :func:`cost_models.roofline.op_time_ms`).

    Returns:
        Milliseconds.
    """
    return op_time_ms(kind, flops, mem_bytes, device, dtype, calib, ops)
