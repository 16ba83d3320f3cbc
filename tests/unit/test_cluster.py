"""Clusters: built-ins, cluster.json, links, unknown kinds, this machine (discover, its cgroup memory limit)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpml_compile.cluster import (BUILTIN_CLUSTERS, check_devices_costed, discover, link_between, load_cluster,
                                  usable_memory_gib)
from hpml_compile.errors import HpmlError, SchemaError, UnknownDeviceError


@pytest.mark.parametrize("name,count,kinds", [
    ("local-cpu-3", 3, {"cpu"}),
    ("dgx-a100-8", 8, {"A100-80GB"}),
    ("dgx-h100-8", 8, {"H100-80GB"}),
    ("hetero-4", 4, {"A100-80GB", "V100-32GB"}),
    ("hetero-cpu", 3, {"A100-40GB", "T4", "cpu"}),
    ("2node-a100-16", 16, {"A100-80GB"}),
])
def test_builtins(name: str, count: int, kinds: set[str]) -> None:
    c = load_cluster(name)
    assert len(c.devices) == count and {d.kind for d in c.devices} == kinds
    check_devices_costed(c, ())  # every built-in kind is in the catalog


def test_builtin_names_listed() -> None:
    assert "hetero-4" in BUILTIN_CLUSTERS and "local-cpu-N" in BUILTIN_CLUSTERS


def test_local_cpu_splits_ram() -> None:
    one, four = load_cluster("local-cpu-1"), load_cluster("local-cpu-4")
    assert four.devices[0].memory_gib == pytest.approx(one.devices[0].memory_gib / 4, rel=1e-2)
    assert len({d.host for d in four.devices}) == 1


def test_hetero4_memory() -> None:
    c = load_cluster("hetero-4")
    assert [d.memory_gib for d in c.devices] == [80, 80, 32, 32]


def test_default_links() -> None:
    c = load_cluster("2node-a100-16")
    assert link_between(c, "gpu0", "gpu1") == (300, 3.0)  # NVLink 3 on one host
    assert link_between(c, "gpu7", "gpu8") == (12.5, 25.0)  # 100 GbE across hosts
    h = load_cluster("hetero-4")
    assert link_between(h, "gpu0", "gpu2")[0] == 15.75  # A100 <-> V100 through PCIe 3 (the slower host link)


def test_cluster_json_explicit_link_wins(tmp_path) -> None:
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"schema_version": 1, "devices": [
        {"name": "a", "kind": "A100-80GB", "memory_gib": 80},
        {"name": "b", "kind": "A100-80GB", "memory_gib": 80}],
        "links": [{"a": "b", "b": "a", "gbps": 42, "latency_us": 7}]}))
    c = load_cluster(str(p))
    assert link_between(c, "a", "b") == (42, 7)


def test_cluster_json_schema_error_names_field(tmp_path) -> None:
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"schema_version": 1, "devices": [{"name": "a", "kind": "T4", "memory_gib": "lots"}]}))
    with pytest.raises(SchemaError, match=r"devices\[0\]\.memory_gib"):
        load_cluster(str(p))


def test_unknown_spec() -> None:
    with pytest.raises(HpmlError, match="not a built-in cluster"):
        load_cluster("no-such-cluster")


def test_unknown_kind_named() -> None:
    from hpml_compile.ir import Cluster, Device
    c = Cluster(devices=(Device("x0", "TPU-v9", 16),))
    with pytest.raises(UnknownDeviceError, match="TPU-v9") as e:
        check_devices_costed(c, ("cpu",))
    assert "A100-80GB" in str(e.value)  # lists the known kinds
    check_devices_costed(c, ("TPU-v9",))  # a kind the profile has is fine


def _physical_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def test_cgroup_v2_limit_below_ram_wins(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text(f"{3 * 2**30}\n")  # 3 GiB: below any machine the tests run on
    assert usable_memory_gib(tmp_path) == pytest.approx(min(3.0, _physical_gib()))


def test_cgroup_v1_limit_below_ram_wins(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{2**30}\n")
    assert usable_memory_gib(tmp_path) == pytest.approx(min(1.0, _physical_gib()))


@pytest.mark.parametrize("v2,v1", [("max\n", None), (None, "9223372036854771712\n"), (None, None)])
def test_no_cgroup_limit_is_physical_ram(tmp_path: Path, v2: str | None, v1: str | None) -> None:
    if v2 is not None:
        (tmp_path / "memory.max").write_text(v2)
    if v1 is not None:  # cgroup v1 writes "no limit" as a huge number
        (tmp_path / "memory").mkdir()
        (tmp_path / "memory" / "memory.limit_in_bytes").write_text(v1)
    assert usable_memory_gib(tmp_path) == pytest.approx(_physical_gib())


def test_local_cpu_and_discover_use_usable_memory() -> None:
    gib = usable_memory_gib()
    assert load_cluster("local-cpu-2").devices[0].memory_gib == pytest.approx(gib / 2, abs=1e-3)
    cpu = next(d for d in discover().devices if d.kind == "cpu")
    assert cpu.memory_gib == pytest.approx(gib, abs=0.01)
