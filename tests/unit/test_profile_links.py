"""A link measured when profiling is kept in the profile and used by the plans made from it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hpml_compile import driver
from hpml_compile.cluster import load_cluster
from hpml_compile.errors import SchemaError
from hpml_compile.ir import Link
from hpml_compile.profile import load_profile, save_profile
from hpml_compile.testing import chain_profile

LINK = {"gbps": 0.42, "latency_us": 321.0, "shared": True, "source": "measured by profile: test"}


def test_the_link_is_recorded_in_the_profile_and_survives_the_file(tmp_path: Path) -> None:
    prof = driver.with_link(chain_profile([(1.0, 2.0)] * 3), LINK)
    back = load_profile(save_profile(prof, tmp_path / "p.json"))
    assert back.devices["cpu"]["link"] == LINK


def test_a_bad_link_in_a_profile_file_is_named(tmp_path: Path) -> None:
    prof = driver.with_link(chain_profile([(1.0, 2.0)] * 3), {**LINK, "gbps": "fast"})
    with pytest.raises(SchemaError, match="link"):
        load_profile(save_profile(prof, tmp_path / "p.json"))


def test_plans_for_cpus_of_one_host_use_the_profiles_link() -> None:
    cluster = load_cluster("local-cpu-2")
    assert not cluster.links  # the catalog's gloo-loopback default otherwise
    prof = driver.with_link(chain_profile([(1.0, 2.0)] * 3), LINK)
    now = driver.profile_links(cluster, prof)
    assert [(x.a, x.b, x.gbps, x.latency_us, x.shared) for x in now.links] == [("cpu0", "cpu1", 0.42, 321.0, True)]
    assert driver.profile_links(cluster, chain_profile([(1.0, 2.0)] * 3)) is cluster  # nothing measured
    named = replace(cluster, links=(Link("cpu0", "cpu1", 9.0, 1.0, source="hand"),))
    assert driver.profile_links(named, prof).links == named.links  # a link the cluster names is kept


def test_the_measured_link_changes_what_the_plan_predicts() -> None:
    # two pipeline stages send 8 MiB activations over the link: a slower one costs more
    prof = chain_profile([(1.0, 2.0)] * 4, output_bytes=8 << 20, batch_size=8)
    cluster = load_cluster("local-cpu-2")
    opts = driver.Options(solver="uniform", microbatches=1)
    fast = driver.plan(driver.with_link(prof, {**LINK, "gbps": 50.0, "latency_us": 1.0}), cluster, opts)
    slow = driver.plan(driver.with_link(prof, {**LINK, "gbps": 0.05}), cluster, opts)
    assert slow.cluster.links[0].gbps == 0.05 and fast.cluster.links[0].gbps == 50.0
    assert slow.predicted.step_ms > fast.predicted.step_ms


def test_the_zero_pairs_own_fits_price_a_sharded_stage_and_leave_the_all_reduce_alone(tmp_path: Path) -> None:
    # gloo's reduce-scatter and all-gather are slower than its all-reduce (measured, profile/links.py): a ZeRO-1
    # stage on a link that records their fits is priced with them; a ZeRO-0 stage's all-reduce is not
    from hpml_compile.memory import ZeroStage
    from hpml_compile.plan import Plan, Schedule, Stage
    from hpml_compile.simulate import simulate
    from hpml_compile.costgraph import build

    slow = {**LINK, "collectives": {"reduce_scatter": {"gbps": 0.1, "latency_us": 900.0},
                                    "all_gather": {"gbps": 0.05, "latency_us": 900.0}}}
    prof = chain_profile([(1.0, 2.0)] * 4, param_bytes=4 << 20, batch_size=8)
    assert load_profile(save_profile(driver.with_link(prof, slow), tmp_path / "p.json")).devices["cpu"]["link"] == slow
    g = build(prof)
    nodes = tuple(n for name in g.order for n in g.node(name).members)
    cluster = load_cluster("local-cpu-2")

    def step(link: dict, zero: ZeroStage) -> float:
        c = driver.profile_links(cluster, driver.with_link(prof, link))
        return simulate(Plan("toy", c, Schedule.GPIPE, 1, (Stage(0, ("cpu0", "cpu1"), nodes, zero=zero),)), g).step_ms

    assert step(slow, ZeroStage.NONE) == step(LINK, ZeroStage.NONE)
    # 16 MiB of gradients: each collective moves them once over the shared link (0.1 and 0.05 GB/s)
    extra = (16 << 20) / 0.1e6 + (16 << 20) / 0.05e6 - 2 * (16 << 20) / 0.42e6 + 2 * (0.9 - 0.321)
    assert step(slow, ZeroStage.OS) - step(LINK, ZeroStage.OS) == pytest.approx(extra, rel=0.02)
