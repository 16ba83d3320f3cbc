"""Analytic per-op time: the roofline model with efficiency priors.

An op that does ``flops`` floating-point operations and moves ``mem_bytes``
bytes to and from device memory takes (Williams, Waterman, Patterson,
"Roofline", CACM 2009)::

    time = max(flops / (peak[dtype] * compute_eff),
               mem_bytes / (mem_bw * memory_eff)) * multiplier + overhead

``multiplier`` is 1 unless a :class:`~cost_models.calibrate.Calibration` is
given; ``overhead`` is the device's launch overhead (or the calibrated one).
Shape-only ops (``view``) launch no kernel and cost a tenth of the overhead.
On a GPU the host issues an op while the GPU runs the ones before it, so an
op predicted there (not measured) takes ``max(roofline * multiplier,
ops * overhead)``: the host sets the pace of small kernels, the GPU of large
ones (``ops``: the kernels the host issues for it, 2 for a node's backward;
measured in ``benchmarks/prediction/gpu.py``).

Efficiency priors (:func:`prior_efficiency`), per device category:

- GPU: compute 0.70, memory 0.80. Large cuBLAS GEMMs reach ~70-85% of the
  dense datasheet peak (NVIDIA's published cuBLAS/MLPerf GEMM rates on A100
  and H100); STREAM-like copy kernels reach ~85-92% of the HBM datasheet
  bandwidth (BabelStream on A100/H100), less for reductions and strided ops.
- CPU: compute 0.90, memory 0.90. The host CPU's peak and bandwidth are
  themselves measured with a matmul and a copy (``catalog.host_cpu``), so a
  well-shaped op nearly reaches them; 0.9 covers less friendly shapes.

Compute rate: matmul, conv and attention use ``peak_flops[dtype]``; other
kinds run on the vector units, so they use at most the float32 rate. A dtype
the device has no rate for falls back: float8 -> float16 -> bfloat16 ->
float32, and tf32/float16/bfloat16/float64 -> float32 (e.g. bfloat16 on V100
or T4 is priced at the float32 rate: no bf16 tensor cores there).

Example:
    >>> from cost_models.catalog import get_device
    >>> a100 = get_device("A100-80GB")
    >>> big = op_time_ms("matmul", 2 * 8192**3, 3 * 8192**2 * 2, a100, "bfloat16")
    >>> round(big, 1)  # compute-bound: 1.1e12 FLOP at 0.7 * 312 TFLOP/s
    5.0
    >>> op_time_ms("view", 0, 0, a100) < op_time_ms("elementwise", 1e3, 8e3, a100)
    True
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cost_models.catalog import DTYPES, DeviceCategory, DeviceSpec

if TYPE_CHECKING:  # calibrate imports this module; avoid the cycle at run time
    from cost_models.calibrate import Calibration

__all__ = ["Efficiency", "OpKind", "VIEW_OVERHEAD_FRACTION", "op_time_ms", "peak_rate",
           "prior_efficiency", "ridge_point", "roofline_ms"]

# A view changes only tensor metadata: no kernel, only dispatcher bookkeeping.
VIEW_OVERHEAD_FRACTION = 0.1


class OpKind(str, enum.Enum):
    """What an op does, as far as its cost model cares."""

    MATMUL = "matmul"
    CONV = "conv"
    ATTENTION = "attention"
    NORM = "norm"
    ELEMENTWISE = "elementwise"
    # Transcendental elementwise (GELU, SiLU, tanh, exp): FLOP counters give
    # them 0 FLOPs, yet on a CPU they cost ~10x an add per byte; their own
    # multiplier keeps them from skewing the plain elementwise one.
    ACTIVATION = "activation"
    SOFTMAX = "softmax"
    EMBEDDING = "embedding"
    REDUCTION = "reduction"
    VIEW = "view"
    OTHER = "other"


_MATRIX_KINDS = frozenset({OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION})
_FALLBACK: dict[str, tuple[str, ...]] = {
    "float8": ("float16", "bfloat16", "float32"),
    "float16": ("float32",),
    "bfloat16": ("float32",),
    "tf32": ("float32",),
    "float64": ("float32",),
    "float32": (),
}


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of the peak compute rate and memory bandwidth an op reaches.

    Attributes:
        compute: fraction of ``peak_flops[dtype]``, in (0, 1].
        memory: fraction of ``mem_bw``, in (0, 1].
    """

    compute: float
    memory: float

    def __post_init__(self) -> None:
        if not (0 < self.compute <= 1 and 0 < self.memory <= 1):
            raise ValueError(f"efficiencies must be in (0, 1], got {self.compute}, "
                             f"{self.memory}")


def prior_efficiency(category: DeviceCategory | str) -> Efficiency:
    """The default efficiencies of a device category (see the module docstring).

    Args:
        category: GPU or CPU.

    Returns:
        The prior compute and memory efficiencies.
    """
    if DeviceCategory(category) is DeviceCategory.GPU:
        return Efficiency(compute=0.70, memory=0.80)
    return Efficiency(compute=0.90, memory=0.90)


def _kind(kind: OpKind | str) -> OpKind:
    try:
        return OpKind(kind)
    except ValueError:
        raise ValueError(f"unknown op kind {kind!r}; expected one of "
                         f"{[k.value for k in OpKind]}") from None


def peak_rate(device: DeviceSpec, dtype: str, kind: OpKind | str = OpKind.MATMUL) -> float:
    """The peak FLOP/s an op of ``kind`` in ``dtype`` can use on ``device``.

    Args:
        device: the device.
        dtype: a name in ``catalog.DTYPES``.
        kind: matrix kinds use the dtype's (tensor-core) rate; the others at
            most the float32 rate.

    Returns:
        FLOP/s, after the dtype fallback described in the module docstring.

    Raises:
        ValueError: if ``dtype`` or ``kind`` is unknown.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    rate = next(device.peak_flops[d] for d in (dtype, *_FALLBACK[dtype], "float32")
                if d in device.peak_flops)
    if _kind(kind) not in _MATRIX_KINDS:
        rate = min(rate, device.peak_flops["float32"])
    return rate


def roofline_ms(kind: OpKind | str, flops: float, mem_bytes: float, device: DeviceSpec,
                dtype: str = "float32") -> float:
    """The roofline time without overhead or calibration (0 for ``view``).

    Args:
        kind: the op kind.
        flops: floating-point operations, >= 0.
        mem_bytes: bytes read plus written, >= 0.
        device: the device.
        dtype: the compute dtype.

    Returns:
        Milliseconds.

    Raises:
        ValueError: on an unknown kind or dtype, or negative/non-finite sizes.
    """
    op = _kind(kind)
    if not (math.isfinite(flops) and math.isfinite(mem_bytes)) or flops < 0 or mem_bytes < 0:
        raise ValueError(f"flops and mem_bytes must be finite and >= 0, got {flops}, "
                         f"{mem_bytes}")
    rate = peak_rate(device, dtype, op)  # validates dtype even for views
    if op is OpKind.VIEW:
        return 0.0
    eff = prior_efficiency(device.category)
    seconds = max(flops / (rate * eff.compute), mem_bytes / (device.mem_bw * eff.memory))
    return seconds * 1e3


def ridge_point(device: DeviceSpec, dtype: str = "float32",
                kind: OpKind | str = OpKind.MATMUL) -> float:
    """Arithmetic intensity (FLOP/byte) where an op turns from memory- to compute-bound.

    Args:
        device: the device.
        dtype: the compute dtype.
        kind: the op kind (matrix kinds see the tensor-core rate).

    Returns:
        FLOP per byte, with the prior efficiencies applied.
    """
    eff = prior_efficiency(device.category)
    return peak_rate(device, dtype, kind) * eff.compute / (device.mem_bw * eff.memory)


def op_time_ms(kind: OpKind | str, flops: float, mem_bytes: float, device: DeviceSpec,
               dtype: str = "float32", calib: Calibration | None = None, ops: float = 1.0) -> float:
    """Predicted time of one op on one device.

    Args:
        kind: the op kind.
        flops: floating-point operations, >= 0.
        mem_bytes: bytes read plus written, >= 0.
        device: the device.
        dtype: the compute dtype.
        calib: multipliers fitted on a measured device; on another device they
            are transferred (see ``cost_models.calibrate``).
        ops: kernels the host issues for the op (a GPU's pace-setting host work is ``ops * overhead``).

    Returns:
        Milliseconds: roofline * multiplier + overhead, on a GPU not measured by ``calib``
        ``max(roofline * multiplier, ops * overhead)``; a view costs ``VIEW_OVERHEAD_FRACTION`` of the overhead.

    Raises:
        ValueError: on an unknown kind or dtype, or negative/non-finite sizes.
    """
    op = _kind(kind)
    core = roofline_ms(op, flops, mem_bytes, device, dtype)
    if calib is None:
        multiplier, overhead = 1.0, device.launch_overhead_ms
    else:
        multiplier, overhead = calib.multiplier(op, device), calib.overhead_for(device)
    if op is OpKind.VIEW:
        return VIEW_OVERHEAD_FRACTION * overhead
    if device.category is DeviceCategory.GPU and (calib is None or calib.device_kind != device.kind):
        return max(core * multiplier, ops * overhead)  # the host issues while the GPU works: the slower paces
    return core * multiplier + overhead
