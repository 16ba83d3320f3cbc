"""Cost models for hpml-compile: device catalog, roofline op cost, comm cost, calibration.

A separate package that imports nothing from ``hpml_compile``: it prices ops
and messages on devices that may not be present, from datasheets
(:mod:`cost_models.catalog`), the roofline model (:mod:`cost_models.roofline`),
the alpha-beta model (:mod:`cost_models.comm`), and multipliers fitted to
measurements (:mod:`cost_models.calibrate`).

Example:
    >>> import cost_models as cm
    >>> h100 = cm.get_device("H100-80GB")
    >>> ms = cm.op_time_ms("matmul", flops=2 * 4096**3, mem_bytes=3 * 4096**2 * 2,
    ...                    device=h100, dtype="bfloat16")
    >>> 0.1 < ms < 1.0
    True
    >>> link = cm.default_link("H100-80GB", "H100-80GB", same_host=True)
    >>> link.name, round(cm.allreduce_ms(2**30, 8, link), 2)
    ('nvlink4', 4.22)
"""

from cost_models.calibrate import (
                                   CALIBRATION_VERSION,
                                   Calibration,
                                   OpSample,
                                   fit,
                                   predict_ms,
                                   transfer_multiplier,
)
from cost_models.catalog import (
                                   DTYPES,
                                   DeviceCategory,
                                   DeviceSpec,
                                   LinkSpec,
                                   UnknownDeviceKind,
                                   UnknownLink,
                                   BACKWARD_OPS_PER_NODE,
                                   COLLECTIVE_OPS,
                                   EAGER_GPU_OP_MS,
                                   default_link,
                                   get_device,
                                   get_link,
                                   host_cpu,
                                   kind_from_cuda_name,
                                   known_kinds,
                                   known_links,
)
from cost_models.comm import (
                                   CollectiveAlgo,
                                   all_gather_ms,
                                   allreduce_ms,
                                   broadcast_ms,
                                   p2p_ms,
                                   reduce_scatter_ms,
)
from cost_models.roofline import (
                                   VIEW_OVERHEAD_FRACTION,
                                   Efficiency,
                                   OpKind,
                                   op_time_ms,
                                   peak_rate,
                                   prior_efficiency,
                                   ridge_point,
                                   roofline_ms,
)

__all__ = [
    # catalog
    "DTYPES", "DeviceCategory", "DeviceSpec", "LinkSpec", "UnknownDeviceKind", "UnknownLink",
    "BACKWARD_OPS_PER_NODE", "COLLECTIVE_OPS", "EAGER_GPU_OP_MS", "default_link", "get_device", "get_link", "host_cpu", "kind_from_cuda_name",
    "known_kinds", "known_links",
    # roofline
    "VIEW_OVERHEAD_FRACTION", "Efficiency", "OpKind", "op_time_ms", "peak_rate",
    "prior_efficiency", "ridge_point", "roofline_ms",
    # comm
    "CollectiveAlgo", "all_gather_ms", "allreduce_ms", "broadcast_ms", "p2p_ms",
    "reduce_scatter_ms",
    # calibrate
    "CALIBRATION_VERSION", "Calibration", "OpSample", "fit", "predict_ms",
    "transfer_multiplier",
]
