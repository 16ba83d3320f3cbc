"""Clusters: built-in descriptions by name, cluster.json by path, and the links between devices.

A cluster names its devices and, optionally, the links between pairs of them;
a pair without an explicit link talks over the cost_models catalog default
for its two device kinds (NVLink for two GPUs of one NVLink kind on one host,
PCIe through the host otherwise, 100 GbE across hosts). :func:`discover`
describes this machine as a cluster (NVML for GPUs; no NVML means CPU only).

The memory of a CPU device is what this process may use
(:func:`usable_memory_gib`): physical RAM, or the container's cgroup limit
where that is lower, since a process is killed at the limit, not at the
RAM it sees in ``/proc/meminfo``.

Example:
    >>> c = load_cluster("hetero-4")
    >>> [d.kind for d in c.devices]
    ['A100-80GB', 'A100-80GB', 'V100-32GB', 'V100-32GB']
    >>> link_between(c, "gpu0", "gpu1")
    (300, 3.0)
    >>> link_between(load_cluster("2node-a100-16"), "gpu0", "gpu8")
    (12.5, 25.0)
    >>> h = hierarchy(load_cluster("2node-a100-16"), [f"gpu{i}" for i in range(16)])
    >>> (len(h.hosts), h.per_host, h.intra.gbps, h.inter.gbps)
    (2, 8, 300, 12.5)

A group of devices spread over hosts (:func:`hierarchy`) is what a
hierarchical all-reduce works on: its devices by host, the slowest link
inside a host and the slowest between hosts.

How much of a gradient collective the backward can hide
(:func:`overlap_efficiency`) depends on where the two run, not on the link:
the fraction of the last backward during which a bucketed collective makes
progress. On CPU ranks gloo's transfer threads run on the very cores the
backward computes on (measured, ``benchmarks/ddp_compare``: gpt-mini on 2 gloo
ranks ran 4.7% *faster* without the overlap), so a group with a CPU in it gets
0: its replicas sync after the backward. A GPU group gets 1.0, the usual
assumption for NCCL, whose kernels run on their own stream beside the
backward's (Li et al., "PyTorch Distributed", VLDB 2020, Fig. 7: the overlapped
all-reduce hides behind the backward on NVLink and on 100 GbE); not yet
measured here. The cost model (:func:`hpml_compile.stagecost.sync_ms`) and
the runtime (:func:`hpml_compile.plan.sync_overlap`) read the same number.

    >>> overlap_efficiency(load_cluster("hetero-4"), ["gpu0", "gpu1"])
    1.0
    >>> overlap_efficiency(load_cluster("local-cpu-2"), ["cpu0", "cpu1"])
    0.0
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import cost_models
from cost_models import LinkSpec

from .errors import HpmlError, SchemaError, UnknownDeviceError
from .ir import Cluster, Device, Host, Link, base_kind
from .schema import read_json

__all__ = [
    "BUILTIN_CLUSTERS",
    "load_cluster",
    "builtin_cluster",
    "dgx_pod",
    "check_hosts",
    "link_between",
    "link_spec",
    "host_link_spec",
    "check_devices_costed",
    "overlap_efficiency",
    "CPU_OVERLAP",
    "GPU_OVERLAP",
    "Hierarchy",
    "hierarchy",
    "hosts_of",
    "discover",
    "usable_memory_gib",
]

BUILTIN_CLUSTERS: tuple[str, ...] = (
    "local-cpu-N", "dgx-a100-8", "dgx-h100-8", "hetero-4", "hetero-cpu", "2node-a100-16", "dgx-h100-8x8",
    "dgx-a100-8x4",
)
_LOCAL_CPU = re.compile(r"^local-cpu-(\d+)$")


_CGROUP_ROOT = Path("/sys/fs/cgroup")
_FALLBACK_GIB = 8.0  # neither sysconf nor /proc/meminfo (not POSIX): assume a small laptop


def _physical_bytes() -> int | None:
    """Physical RAM from sysconf, else /proc/meminfo's MemTotal; None when neither answers."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limit_bytes(root: Path) -> int | None:
    """The memory limit of the cgroup mounted at ``root`` (v2 ``memory.max``, else v1's
    ``memory/memory.limit_in_bytes``); None when there is none ("max", no file, unreadable)."""
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # v1 writes "unlimited" as a huge number: the min with physical RAM drops it
            return int(text)
    return None


def usable_memory_gib(cgroup_root: Path = _CGROUP_ROOT) -> float:
    """The memory this process may use, in GiB: physical RAM, or the cgroup's memory limit where lower.

    Args:
        cgroup_root: where the cgroup file system is mounted (a folder holding a fake ``memory.max`` in
            tests).

    Returns:
        ``min(physical RAM, cgroup limit)``; 8 GiB where physical RAM cannot be read (not POSIX).
    """
    physical = _physical_bytes()
    limit = _cgroup_limit_bytes(cgroup_root)
    if physical is None:
        return limit / 2**30 if limit is not None else _FALLBACK_GIB
    return min(physical, limit if limit is not None else physical) / 2**30


def _gpus(kind: str, gib: float, names: Iterable[int], host: str = "node0") -> list[Device]:
    return [Device(name=f"gpu{i}", kind=kind, memory_gib=gib, host=host) for i in names]


def builtin_cluster(name: str) -> Cluster | None:
    """The built-in cluster called ``name``, or None if there is none.

    Args:
        name: one of :data:`BUILTIN_CLUSTERS` (``local-cpu-N`` with N >= 1).

    Returns:
        The cluster, links left to the catalog defaults.
    """
    m = _LOCAL_CPU.match(name)
    if m:
        n = int(m.group(1))
        if n < 1:
            return None
        # N ranks share this machine's RAM, so each gets an equal slice of it.
        gib = round(usable_memory_gib() / n, 3)
        devs = tuple(Device(name=f"cpu{i}", kind="cpu", memory_gib=gib, host="localhost") for i in range(n))
        return Cluster(devices=devs, name=name)
    if name == "dgx-a100-8":
        return Cluster(devices=tuple(_gpus("A100-80GB", 80, range(8))), name=name)
    if name == "dgx-h100-8":
        return Cluster(devices=tuple(_gpus("H100-80GB", 80, range(8))), name=name)
    if name == "hetero-4":
        return Cluster(devices=(*_gpus("A100-80GB", 80, range(2)), *_gpus("V100-32GB", 32, range(2, 4))), name=name)
    if name == "hetero-cpu":
        devs = (Device("gpu0", "A100-40GB", 40), Device("gpu1", "T4", 16),
                Device("cpu0", "cpu", round(usable_memory_gib(), 3)))
        return Cluster(devices=devs, name=name)
    if name == "2node-a100-16":
        devs = (*_gpus("A100-80GB", 80, range(8), "node0"), *_gpus("A100-80GB", 80, range(8, 16), "node1"))
        return Cluster(devices=tuple(devs), name=name)
    if name == "dgx-h100-8x8":  # 8 DGX H100: NVLink 4 inside, one ConnectX-7 (InfiniBand NDR) per GPU
        return dgx_pod("H100-80GB", 80, 8, "nvlink4", "ib-ndr", name)
    if name == "dgx-a100-8x4":  # 4 DGX A100: NVLink 3 inside, one ConnectX-6 (InfiniBand HDR) per GPU
        return dgx_pod("A100-80GB", 80, 4, "nvlink3", "ib-hdr", name)
    return None


def dgx_pod(kind: str, gib: float, hosts: int, fabric: str, nic: str, name: str, per_host: int = 8) -> Cluster:
    """``hosts`` hosts of ``per_host`` GPUs of ``kind``, ``fabric`` inside each and one ``nic`` card per GPU.

    >>> c = dgx_pod("H100-80GB", 80, 2, "nvlink4", "ib-ndr", "two")
    >>> len(c.devices), link_between(c, "gpu0", "gpu1"), link_between(c, "gpu0", "gpu8")
    (16, (450, 3.0), (50.0, 5.0))
    """
    devs = [d for h in range(hosts) for d in _gpus(kind, gib, range(h * per_host, (h + 1) * per_host), f"node{h}")]
    return Cluster(devices=tuple(devs), name=name,
                   hosts=tuple(Host(f"node{h}", fabric, nic, per_host) for h in range(hosts)))


def check_hosts(cluster: Cluster, source: str = "cluster") -> None:
    """Every host's ``fabric`` and ``nic`` is a link of the cost_models catalog.

    Raises:
        SchemaError: naming the host's field and the catalog's links.
    """
    names = cost_models.known_links()
    for i, h in enumerate(cluster.hosts):
        for what in ("fabric", "nic"):
            value = getattr(h, what)
            if value and value not in names:
                raise SchemaError(source, f"hosts[{i}].{what}", f"a link of the catalog ({', '.join(names)})",
                                  repr(value), fix="name a catalog link, or describe the pair with links[]")


def _host_link(cluster: Cluster, da: Device, db: Device) -> LinkSpec | None:
    """The link two devices' hosts imply (None: the hosts say nothing about it).

    On one host: its ``fabric``. Between hosts: each end's network card, shared by ``devices / nics`` of its
    host's devices (a ring over every device of the hosts runs all of them at once): the slower end's
    bandwidth per device, the larger latency.
    """
    ha, hb = cluster.host(da.host), cluster.host(db.host)
    if da.host == db.host:
        return cost_models.get_link(ha.fabric) if ha is not None and ha.fabric else None
    if ha is None or hb is None or not ha.nic or not hb.nic:
        return None
    ends = []
    for h in (ha, hb):
        card = cost_models.get_link(h.nic)
        sharing = max(1, -(-sum(1 for d in cluster.devices if d.host == h.name) // h.nics))
        ends.append(((h.nic_gbps or card.gbps) / sharing, card.latency_us))
    gbps, lat = min(e[0] for e in ends), max(e[1] for e in ends)
    return LinkSpec(f"{ha.name}-{hb.name}", gbps, lat, f"hosts {ha.name} and {hb.name}: {ha.nic} / {hb.nic} "
                    "network cards (cluster.json hosts)")


def load_cluster(spec: str) -> Cluster:
    """A cluster from a built-in name or a path to cluster.json.

    Args:
        spec: e.g. ``"dgx-a100-8"``, ``"local-cpu-2"`` or ``"my/cluster.json"``.

    Returns:
        The cluster.

    Raises:
        HpmlError: if ``spec`` is neither a built-in name nor an existing file.
        SchemaError: if the file does not match the cluster schema (names the field).
    """
    c = builtin_cluster(spec)
    if c is not None:
        return c
    p = Path(spec)
    if p.is_file():
        c = Cluster.from_dict(read_json(p), source=str(p))
        check_hosts(c, str(p))
        return c
    raise HpmlError(f"cluster {spec!r}: not a built-in cluster ({', '.join(BUILTIN_CLUSTERS)}) "
                    "and no such file; pass a built-in name or the path to a cluster.json")


def _fallback_link(same_host: bool) -> LinkSpec:
    # A kind only the profile knows (no catalog entry): assume it hangs off PCIe 4.
    return cost_models.get_link("pcie4" if same_host else "eth100")


def link_spec(cluster: Cluster, a: str, b: str) -> LinkSpec:
    """The link between devices ``a`` and ``b`` as a cost_models LinkSpec.

    An explicit cluster link (either direction) wins; otherwise the catalog
    default for the two kinds and whether they share a host.

    Args:
        cluster: the cluster.
        a: a device name.
        b: another device name.

    Returns:
        The link spec (infinitely fast for a == b: no transfer happens).

    Raises:
        KeyError: if a device is not in the cluster.
    """
    da, db = cluster.device(a), cluster.device(b)
    if a == b:
        return LinkSpec("local", float("inf"), 0.0, "same device: no transfer")
    for x in cluster.links:
        if {x.a, x.b} == {a, b}:
            return LinkSpec(f"{a}-{b}", x.gbps, x.latency_us, x.source or "cluster.json", shared=x.shared,
                            collectives=x.collectives, tp_reduce_per_ms=x.tp_reduce_per_ms)
    if cluster.hosts:
        described = _host_link(cluster, da, db)
        if described is not None:
            return described
    same = da.host == db.host
    try:
        return cost_models.default_link(base_kind(da.kind), base_kind(db.kind), same)
    except cost_models.UnknownDeviceKind:
        return _fallback_link(same)


def link_between(cluster: Cluster, a: str, b: str) -> tuple[float, float]:
    """Bandwidth (GB/s) and latency (us) between two devices of ``cluster``.

    Args:
        cluster: the cluster.
        a: a device name.
        b: another device name.

    Returns:
        ``(gbps, latency_us)``.
    """
    s = link_spec(cluster, a, b)
    return s.gbps, s.latency_us


class Hierarchy(NamedTuple):
    """A group of devices by host, for a hierarchical all-reduce.

    Attributes:
        hosts: the group's devices on each host, hosts in order of first appearance, devices in group order.
        intra: the slowest link between two devices of one host (None: one device per host).
        inter: the slowest link between devices of the same position on two hosts (the pairs that
            all-reduce a shard together).
    """

    hosts: tuple[tuple[str, ...], ...]
    intra: LinkSpec | None
    inter: LinkSpec

    @property
    def per_host(self) -> int:
        """Devices on each host (the hosts hold the same number: :func:`hierarchy` returns None otherwise)."""
        return len(self.hosts[0])


def hosts_of(cluster: Cluster, devices: Sequence[str]) -> dict[str, list[str]]:
    """``devices`` grouped by their host, hosts in order of first appearance."""
    out: dict[str, list[str]] = {}
    for name in devices:
        out.setdefault(cluster.device(name).host, []).append(name)
    return out


def hierarchy(cluster: Cluster, devices: Sequence[str]) -> Hierarchy | None:
    """``devices`` as a two-level group, or None where a hierarchical all-reduce does not apply.

    It applies when the devices span at least two hosts, each host holding the same number of them
    (each device of a host owns one shard of the reduce-scatter inside it and all-reduces that shard
    with the devices of the same position on the other hosts).

    Args:
        cluster: the cluster (each device names its host).
        devices: the group, e.g. a stage's devices.

    Returns:
        The hierarchy, or None (one host, or hosts holding different numbers of the devices).
    """
    by_host = hosts_of(cluster, devices)
    groups = tuple(tuple(v) for v in by_host.values())
    if len(groups) < 2 or len({len(g) for g in groups}) != 1:
        return None
    intra = [link_spec(cluster, g[0], x) for g in groups for x in g[1:]]
    inter = [link_spec(cluster, groups[0][i], g[i]) for g in groups[1:] for i in range(len(g))]
    return Hierarchy(groups, min(intra, key=lambda s: s.gbps) if intra else None,
                     min(inter, key=lambda s: s.gbps))


def host_link_spec(device: Device) -> LinkSpec:
    """The link between a device and its host's memory (for swap and offload traffic).

    Args:
        device: the device.

    Returns:
        Its catalog host link; PCIe 4 for a kind the catalog lacks. For a CPU
        the "host link" is a memory copy: effectively free.
    """
    if device.is_cpu:
        return LinkSpec("host-memory", float("inf"), 0.0, "CPU memory is host memory")
    try:
        return cost_models.get_link(cost_models.get_device(base_kind(device.kind)).host_link)
    except cost_models.UnknownDeviceKind:
        return _fallback_link(True)


# The fraction of the last backward that hides an overlapped gradient collective (see the module docstring).
CPU_OVERLAP = 0.0  # gloo threads share the cores the backward runs on: measured slower with overlap than without
GPU_OVERLAP = 1.0  # NCCL on its own stream (documented default, Li et al. VLDB 2020); not measured here


def overlap_efficiency(cluster: Cluster, devices: Sequence[str]) -> float:
    """The fraction of a replicated stage's last backward that hides its bucketed gradient collective.

    Args:
        cluster: the cluster.
        devices: the stage's devices (its data-parallel group).

    Returns:
        :data:`CPU_OVERLAP` when any device of the group is a CPU (its collective is a gloo one on the
        cores the backward needs), else :data:`GPU_OVERLAP`.

    Raises:
        KeyError: a device is not in the cluster.
    """
    return CPU_OVERLAP if any(cluster.device(n).is_cpu for n in devices) else GPU_OVERLAP


def check_devices_costed(cluster: Cluster, profile_kinds: Iterable[str]) -> None:
    """Check that every device of ``cluster`` has costs: its kind is in the profile or the cost_models catalog.

    Args:
        cluster: the cluster.
        profile_kinds: the kinds the profile has costs for.

    Raises:
        UnknownDeviceError: naming the device and its kind, the profile's kinds
            and the catalog's kinds, for a kind in neither.
    """
    have = {k.lower() for k in profile_kinds}
    known = cost_models.known_kinds()
    known_lower = {k.lower() for k in known}
    for d in cluster.devices:
        if d.kind.lower() not in have and d.kind.lower() not in known_lower:
            raise UnknownDeviceError(
                f"device {d.name} of cluster {cluster.name} has kind {d.kind!r}, which is neither in the "
                f"profile (kinds: {', '.join(sorted(profile_kinds)) or 'none'}) nor in the cost_models catalog "
                f"(known kinds: {', '.join(known)}); use a known kind or profile the model on that device")


def _nvml_devices(host: str) -> tuple[list[Device], list[Link]]:
    """GPUs and NVLink/PCIe links from NVML; empty when there is no NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound/DriverNotLoaded: no GPU here, CPU only
        return [], []
    try:
        devices: list[Device] = []
        handles = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total
            kind = cost_models.kind_from_cuda_name(name, mem) or name
            devices.append(Device(name=f"gpu{i}", kind=kind, memory_gib=mem / 2**30, host=host))
            handles.append(h)
        links: list[Link] = []
        for i in range(len(handles)):
            for j in range(i + 1, len(handles)):
                try:
                    nv = pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                    has_nvlink = nv == pynvml.NVML_P2P_STATUS_OK
                except pynvml.NVMLError:
                    has_nvlink = False
                spec = (cost_models.default_link(devices[i].kind, devices[j].kind, True) if has_nvlink
                        else cost_models.get_link("pcie4"))
                links.append(Link(devices[i].name, devices[j].name, spec.gbps, spec.latency_us))
        return devices, links
    finally:
        pynvml.nvmlShutdown()


def discover() -> Cluster:
    """Describe this machine: its GPUs (via NVML) and its CPU, as a Cluster.

    No NVIDIA driver means a CPU-only cluster, not an error.

    Returns:
        The cluster ``discovered:<host name>``: ``gpu<i>`` per GPU, with NVLink or PCIe links between
        them, and ``cpu0`` with the memory this process may use.
    """
    host = socket.gethostname() or "localhost"
    gpus, links = _nvml_devices(host)
    cpu = Device(name="cpu0", kind="cpu", memory_gib=round(usable_memory_gib(), 2), host=host)
    return Cluster(devices=(*gpus, cpu), links=tuple(links), name=f"discovered:{host}")
