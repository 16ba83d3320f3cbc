"""Device and link catalog: datasheet specs for GPUs, a measured spec for the host CPU.

Numbers are dense (non-sparse) peaks from NVIDIA datasheets; each entry cites
its source. ``"float32"`` is the plain FP32 rate, not TF32: torch does not use
TF32 for float32 matmuls by default (``torch.backends.cuda.matmul.allow_tf32``
is False), so a float32 model runs at the FP32 rate. Memory sizes are the
datasheet figure read as GiB; torch reports slightly less (reserved/ECC).

The kind ``"cpu"`` is the host CPU, measured once per process by
:func:`host_cpu` (a float32 matmul, a large copy, the RAM size).

Example:
    >>> a100 = get_device("A100-80GB")
    >>> a100.memory_bytes // 2**30, a100.peak_flops["bfloat16"] / 1e12
    (80, 312.0)
    >>> default_link("A100-80GB", "A100-80GB", same_host=True).name
    'nvlink3'
    >>> default_link("cpu", "cpu", same_host=True).name
    'gloo-loopback'
"""

from __future__ import annotations

import enum
import functools
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "DTYPES", "DeviceCategory", "DeviceSpec", "LinkSpec", "UnknownDeviceKind",
    "UnknownLink", "default_link", "get_device", "get_link", "host_cpu",
    "kind_from_cuda_name", "known_kinds", "known_links",
]

DTYPES: tuple[str, ...] = ("float64", "float32", "tf32", "float16", "bfloat16", "float8")
_GiB = 2**30
_T = 1e12  # TFLOP/s
_G = 1e9  # GB/s


class DeviceCategory(str, enum.Enum):
    """Broad device class; selects the roofline efficiency priors."""

    GPU = "gpu"
    CPU = "cpu"


class UnknownDeviceKind(LookupError):
    """A device kind that is neither in the catalog nor ``"cpu"``."""

    def __init__(self, kind: str) -> None:
        super().__init__(
            f"unknown device kind {kind!r}; known kinds: {', '.join(known_kinds())}")
        self.kind = kind


class UnknownLink(LookupError):
    """A link name that is not in the catalog."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown link {name!r}; known links: {', '.join(known_links())}")
        self.name = name


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """What the cost models need to know about one device.

    Attributes:
        kind: catalog name, e.g. ``"A100-80GB"`` or ``"cpu"``.
        category: GPU or CPU.
        memory_bytes: device memory (host RAM for the CPU).
        mem_bw: memory bandwidth, bytes/s.
        peak_flops: dense FLOP/s per dtype name in :data:`DTYPES`; a dtype the
            device has no rate for is absent (see ``roofline.op_time_ms``).
        launch_overhead_ms: fixed cost of one op (kernel launch / dispatch).
        host_link: link name to the host CPU (GPUs) or the loopback (CPU).
        peer_link: link to a same-kind peer on the same host, None if none.
        measured: True when the numbers were measured, not read from a datasheet.
        source: where the numbers come from.
    """

    kind: str
    category: DeviceCategory
    memory_bytes: int
    mem_bw: float
    peak_flops: Mapping[str, float] = field(hash=False)  # a mapping proxy: unhashable
    launch_overhead_ms: float
    host_link: str
    peer_link: str | None
    measured: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "category", DeviceCategory(self.category))
        # A read-only copy: a shared catalog entry must not be mutated by a caller.
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        if self.memory_bytes <= 0 or self.mem_bw <= 0 or self.launch_overhead_ms < 0:
            raise ValueError(f"{self.kind}: memory_bytes and mem_bw must be > 0 and "
                             f"launch_overhead_ms >= 0, got {self.memory_bytes}, "
                             f"{self.mem_bw}, {self.launch_overhead_ms}")
        for dtype, rate in self.peak_flops.items():
            if dtype not in DTYPES or not rate > 0:
                raise ValueError(f"{self.kind}: peak_flops[{dtype!r}]={rate}; expected a "
                                 f"dtype in {DTYPES} with a rate > 0")
        if "float32" not in self.peak_flops:
            raise ValueError(f"{self.kind}: peak_flops needs a 'float32' rate (the fallback)")


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """A communication link for the alpha-beta model (``comm.py``).

    Attributes:
        name: catalog name, e.g. ``"nvlink3"``.
        gbps: bandwidth in GB/s (1e9 bytes/s), one direction.
        latency_us: per-message latency (alpha), microseconds.
        source: where the numbers come from.
        shared: True when all ranks on the link draw from one bandwidth pool
            (processes on one host over loopback): a collective then costs its
            total traffic over ``gbps`` rather than one rank's traffic.
        collectives: ``(op, gbps, latency_us)`` fitted for a collective timed on its
            own (:data:`COLLECTIVE_OPS`; see :meth:`for_collective`), which prices it
            instead of the link's figures. Measured: gloo's reduce-scatter and
            all-gather between two CPU processes took 1.2-1.7x and 2-3x its all-reduce
            of the same bytes, where the ring model says half; and the all-reduce's own
            timings are what an all-reduce is priced by, not a fit shared with send/recv.
        tp_reduce_per_ms: what each ms of compute before a tensor-parallel layer's
            all-reduce adds to it beyond its ``tp_reduce`` fit (the group waiting for
            its later rank), where a probe timed it at two lengths of compute.
    """

    name: str
    gbps: float
    latency_us: float
    source: str
    shared: bool = False
    collectives: tuple[tuple[str, float, float], ...] = ()
    tp_reduce_per_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.gbps > 0 or self.latency_us < 0 or self.tp_reduce_per_ms < 0:
            raise ValueError(f"link {self.name}: gbps must be > 0, latency_us and tp_reduce_per_ms >= 0, "
                             f"got {self.gbps}, {self.latency_us}, {self.tp_reduce_per_ms}")
        for op, gbps, lat in self.collectives:
            if op not in COLLECTIVE_OPS or not gbps > 0 or lat < 0:
                raise ValueError(f"link {self.name}: collective fit ({op!r}, {gbps}, {lat}) needs an op in "
                                 f"{COLLECTIVE_OPS}, gbps > 0 and latency_us >= 0")

    def for_collective(self, op: str) -> "LinkSpec":
        """The link as collective ``op`` sees it: its own fit where one was measured, else the link itself.

        Example:
            >>> lo = LinkSpec("lo", 2.0, 50.0, "example", shared=True, collectives=(("all_gather", 0.8, 90.0),))
            >>> lo.for_collective("all_gather").gbps, lo.for_collective("reduce_scatter").gbps
            (0.8, 2.0)
        """
        for name, gbps, lat in self.collectives:
            if name == op:
                return LinkSpec(f"{self.name} ({op})", gbps, lat, self.source, shared=self.shared)
        return self


# The collectives a link may carry a fit of its own for (LinkSpec.collectives): the ZeRO pair, and the
# all-reduce, which a probe times directly (a gloo link's joint fit of send/recv and all-reduce chose
# between "shared" and not on a few noisy timings, and priced mlp's 30 MiB gradient all-reduce at 9 ms
# once where the same probe's all-reduces, and the step's, took 23-27 ms: benchmarks/prediction).
# "param_gather": ZeRO-3's all-gather of a stage's parameters as it runs in a step (before a microbatch's forward
# and backward, after compute), which a probe times apart from the all-gather in a loop where the two differ
# (between CPU processes: hpml_compile.profile.links); absent, the all-gather's fit prices it.
# "tp_gather": gloo's own all-gather after compute, as a tensor-parallel layer calls it on its group
# (hpml_compile.codegen.tpops); absent, the link's own fit prices it. "tp_reduce": gloo's own all-reduce in a
# chain of compute, as a tensor-parallel layer calls it; absent, the link's own fit prices it.
COLLECTIVE_OPS = ("reduce_scatter", "all_gather", "all_reduce", "param_gather", "tp_gather", "tp_reduce")


# What one op of an eager PyTorch program costs on a GPU when its kernel is small: the host's work to issue
# it (Python, the dispatcher, the caching allocator, then the ~5 us kernel launch of the CUDA C++ Best
# Practices Guide), which sets the pace while the GPU waits. Measured in this project (
# benchmarks/prediction/gpu.py) on H100 80GB HBM3 machines behind 16-core Intel Xeon VM hosts, torch 2.11,
# fp32, generated fx stages run by hpml_compile.runtime.Pipeline, one step of one microbatch: forward 58-83
# us per op (gpt-mini: 139 fx nodes, 63 of them views at a tenth; mlp: 17 ops), backward 92-203 us per node
# with a backward (the gradients of the input and of the weight: about two kernels); the same step took
# 13.3-22.8 ms on five such machines. 70 us is the middle of the forward range. With the bare 5 us launch
# the catalog predicted those steps 9-10x too fast. An op predicted on a GPU takes max(its roofline, the
# host's work): cost_models.roofline.op_time_ms.
EAGER_GPU_OP_MS = 0.070
BACKWARD_OPS_PER_NODE = 2.0


def _gpu(kind: str, mem_gib: float, bw_gbs: float, tflops: Mapping[str, float],
         host_link: str, peer_link: str | None, source: str) -> DeviceSpec:
    return DeviceSpec(kind, DeviceCategory.GPU, int(mem_gib * _GiB), bw_gbs * _G,
                      {k: v * _T for k, v in tflops.items()}, EAGER_GPU_OP_MS, host_link,
                      peer_link, source=source)



# float64 on V100/A100/H100 is the DGEMM rate (tensor-core FP64 on A100/H100);
# Ada and Turing list no FP64 on the datasheet: 1/64 (Ada) and 1/32 (Turing) of
# FP32 per the architecture whitepapers.
_CATALOG: tuple[DeviceSpec, ...] = (
    _gpu("V100-32GB", 32, 900, {"float64": 7.8, "float32": 15.7, "float16": 125},
         "pcie3", "nvlink2", "NVIDIA Tesla V100 datasheet (SXM2 32GB), 2020"),
    _gpu("A100-40GB", 40, 1555, {"float64": 19.5, "float32": 19.5, "tf32": 156,
                                 "float16": 312, "bfloat16": 312},
         "pcie4", "nvlink3", "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB), 2021"),
    _gpu("A100-80GB", 80, 2039, {"float64": 19.5, "float32": 19.5, "tf32": 156,
                                 "float16": 312, "bfloat16": 312},
         "pcie4", "nvlink3", "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB), 2021"),
    _gpu("H100-80GB", 80, 3350, {"float64": 67, "float32": 67, "tf32": 494.7,
                                 "float16": 989.4, "bfloat16": 989.4, "float8": 1978.9},
         "pcie5", "nvlink4", "NVIDIA H100 Tensor Core GPU datasheet (SXM5), dense = "
         "sparse/2, 2023"),
    _gpu("H200-141GB", 141, 4800, {"float64": 67, "float32": 67, "tf32": 494.7,
                                   "float16": 989.4, "bfloat16": 989.4, "float8": 1978.9},
         "pcie5", "nvlink4", "NVIDIA H200 Tensor Core GPU datasheet (SXM), dense = "
         "sparse/2, 2024"),
    _gpu("L4", 24, 300, {"float64": 0.473, "float32": 30.3, "tf32": 60, "float16": 121,
                         "bfloat16": 121, "float8": 242.5},
         "pcie4", None, "NVIDIA L4 Tensor Core GPU datasheet, dense = sparse/2, 2023"),
    _gpu("T4", 16, 320, {"float64": 0.253, "float32": 8.1, "float16": 65},
         "pcie3", None, "NVIDIA T4 Tensor Core GPU datasheet, 2019"),
    _gpu("RTX-4090", 24, 1008, {"float64": 1.29, "float32": 82.6, "tf32": 82.6,
                                "float16": 165.2, "bfloat16": 165.2, "float8": 330.3},
         "pcie4", None, "NVIDIA Ada Lovelace GPU Architecture whitepaper v2.1, "
         "Appendix A (GeForce RTX 4090; FP16/BF16 with FP32 accumulate, dense)"),
)

# Alpha is the end-to-end small-message latency a collective library sees
# (nccl-tests / gloo), not the wire latency, which is lower.
_LINKS: tuple[LinkSpec, ...] = (
    LinkSpec("nvlink2", 150, 3.0, "NVIDIA V100 datasheet: 300 GB/s NVLink total, 6 links "
             "x 25 GB/s per direction (DGX-1 hybrid cube mesh: fewer links per pair)"),
    LinkSpec("nvlink3", 300, 3.0, "NVIDIA A100 datasheet: 600 GB/s NVLink total, "
             "12 links x 25 GB/s per direction"),
    LinkSpec("nvlink4", 450, 3.0, "NVIDIA H100 datasheet: 900 GB/s NVLink total, "
             "18 links x 25 GB/s per direction"),
    LinkSpec("pcie3", 15.75, 5.0, "PCI Express 3.0 x16: 8 GT/s x 16 lanes, 128b/130b"),
    LinkSpec("pcie4", 31.5, 5.0, "PCI Express 4.0 x16: 16 GT/s x 16 lanes, 128b/130b"),
    LinkSpec("pcie5", 63.0, 5.0, "PCI Express 5.0 x16: 32 GT/s x 16 lanes, 128b/130b"),
    LinkSpec("eth10", 1.25, 25.0, "10 Gb/s Ethernet (IEEE 802.3); TCP socket latency as eth100"),
    LinkSpec("eth100", 12.5, 25.0, "100 Gb/s Ethernet (IEEE 802.3); TCP socket latency"),
    LinkSpec("ib-hdr", 25.0, 5.0, "InfiniBand HDR 200 Gb/s (NVIDIA ConnectX-6 datasheet)"),
    LinkSpec("ib-ndr", 50.0, 5.0, "InfiniBand NDR 400 Gb/s (NVIDIA ConnectX-7 datasheet)"),
    # Fitted to the measurements in `source` (+ ~0.1 ms for a 4-byte all_reduce, two
    # ring steps: alpha = 50 us). Both ranks' copies share the cores and memory, so
    # the link is `shared` and the all_reduce, moving 2x the bytes of the send, takes
    # ~2x as long; 3.1 GB/s puts both predictions (21.6, 43 ms) in the measured ranges.
    LinkSpec("gloo-loopback", 3.1, 50.0, "measured: torch.distributed gloo, 2 CPU ranks "
             "on one 2-core host over TCP loopback (64 MiB send 17-22 ms, all_reduce "
             "40-57 ms)", shared=True),
)


def known_kinds() -> tuple[str, ...]:
    """Returns the names :func:`get_device` accepts: the catalog GPUs, then ``"cpu"``."""
    return tuple(spec.kind for spec in _CATALOG) + ("cpu",)


def known_links() -> tuple[str, ...]:
    """Returns the names :func:`get_link` accepts, in catalog order."""
    return tuple(link.name for link in _LINKS)


def get_device(kind: str) -> DeviceSpec:
    """Look a device kind up (case-insensitive); ``"cpu"`` is measured once.

    Args:
        kind: a name from :func:`known_kinds`.

    Returns:
        The device's spec.

    Raises:
        UnknownDeviceKind: if ``kind`` is not known; the message lists the known kinds.
    """
    if kind.lower() == "cpu":
        return host_cpu()
    for spec in _CATALOG:
        if spec.kind.lower() == kind.lower():
            return spec
    raise UnknownDeviceKind(kind)


def get_link(name: str) -> LinkSpec:
    """Look a link up by name.

    Args:
        name: a name from :func:`known_links`.

    Returns:
        The link's spec.

    Raises:
        UnknownLink: if ``name`` is not known; the message lists the known links.
    """
    for link in _LINKS:
        if link.name == name:
            return link
    raise UnknownLink(name)


def default_link(kind_a: str, kind_b: str, same_host: bool) -> LinkSpec:
    """The link two devices would talk over, absent a cluster description saying otherwise.

    Args:
        kind_a: device kind of one end.
        kind_b: device kind of the other end.
        same_host: whether both devices are in one machine.

    Returns:
        eth100 across hosts; on one host, NVLink for two GPUs of one
        NVLink-capable kind, else the slower of the GPUs' host links (traffic
        crosses both); a GPU's host link to the CPU; gloo-loopback CPU to CPU.

    Raises:
        UnknownDeviceKind: if either kind is unknown.
    """
    # Resolve without measuring the host CPU: only the GPU specs matter here.
    gpus = [get_device(k) for k in (kind_a, kind_b) if k.lower() != "cpu"]
    if not same_host:
        return get_link("eth100")
    if not gpus:
        return get_link("gloo-loopback")
    if len(gpus) == 1:
        return get_link(gpus[0].host_link)
    a, b = gpus
    if a.kind == b.kind and a.peer_link is not None:
        return get_link(a.peer_link)
    return min((get_link(a.host_link), get_link(b.host_link)), key=lambda link: link.gbps)


def kind_from_cuda_name(name: str, total_memory_bytes: int) -> str | None:
    """Map ``torch.cuda.get_device_name()`` and total memory to a catalog kind.

    PCIe/NVL variants of the SXM parts (other clocks, no NVLink) and memory
    sizes the catalog lacks map to None rather than to a wrong entry.

    Args:
        name: e.g. ``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA A100-SXM4-40GB"``.
        total_memory_bytes: ``torch.cuda.get_device_properties(i).total_memory``.

    Returns:
        The catalog kind, or None if the device is not in the catalog.
    """
    words = name.upper().replace("-", " ").split()
    gib = total_memory_bytes / _GiB
    if "PCIE" in words or "NVL" in words or "LAPTOP" in words:
        return None
    if "V100" in words:
        return "V100-32GB" if gib > 24 else None
    if "A100" in words:
        return "A100-80GB" if gib > 60 else "A100-40GB"
    if "H100" in words:
        return "H100-80GB" if 70 < gib < 88 else None
    if "H200" in words:
        return "H200-141GB"
    if "L4" in words:
        return "L4"
    if "T4" in words:
        return "T4"
    if words[-1:] == ["4090"]:  # not "RTX 4090 D", a cut-down part
        return "RTX-4090"
    return None


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Best of ``repeats`` timings: the least disturbed by other processes."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def _ram_bytes() -> int:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # a container's cgroup limit is what this process can actually use
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
    except OSError:
        return ram
    return min(ram, int(limit)) if limit.isdigit() else ram


@functools.lru_cache(maxsize=1)
def host_cpu() -> DeviceSpec:
    """Measure the host CPU once per process (~0.2 s on 2 idle cores, torch imported).

    Peak float32 FLOP/s is the best of 3 timed 1024^3 float32 matmuls (what
    torch's BLAS reaches, not the vendor peak); float64 is taken as half that
    (half the SIMD lanes); other dtypes are absent, so the roofline uses the
    float32 rate. Bandwidth is the best of 3 copies of a 64 MiB tensor (read +
    write counted: 128 MiB of traffic, more than a typical last-level cache).
    The per-op overhead is the best average of 200 one-element adds (dispatch).

    Returns:
        A ``measured=True`` spec with kind ``"cpu"``; the same object every call.
    """
    import torch  # imported here so that `import cost_models` stays light

    a = torch.randn(1024, 1024)
    b = torch.randn(1024, 1024)
    torch.mm(a, b)  # warm-up: BLAS thread pool and page faults
    mm_ms = _best_ms(lambda: torch.mm(a, b), 3)
    src = torch.ones(16 * 2**20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_ms = _best_ms(lambda: dst.copy_(src), 3)
    x = torch.zeros(1)
    per_op_ms = _best_ms(lambda: [torch.add(x, x) for _ in range(200)], 3) / 200
    flops = 2 * 1024**3 / (mm_ms / 1e3)
    return DeviceSpec(
        kind="cpu", category=DeviceCategory.CPU, memory_bytes=_ram_bytes(),
        mem_bw=2 * src.numel() * 4 / (copy_ms / 1e3),
        peak_flops={"float32": flops, "float64": flops / 2},
        launch_overhead_ms=per_op_ms, host_link="gloo-loopback", peer_link=None,
        measured=True,
        source=f"measured at start-up with {torch.get_num_threads()} torch threads: "
               "1024^3 float32 matmul, 64 MiB copy, 1-element add")
