"""Clusters: built-ins, cluster.json, links, unknown kinds."""

from __future__ import annotations

import json

import pytest

from hpml_compile.cluster import BUILTIN_CLUSTERS, check_kinds, link_between, load_cluster
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
    check_kinds(c, ())  # every built-in kind is in the catalog


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
        check_kinds(c, ("cpu",))
    assert "A100-80GB" in str(e.value)  # lists the known kinds
    check_kinds(c, ("TPU-v9",))  # a kind the profile has is fine
