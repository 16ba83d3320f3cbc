"""Measured links: the alpha-beta fit, the cluster file that records it, and `devices --measure` on real gloo ranks."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import cost_models
from hpml_compile.cluster import link_spec, load_cluster
from hpml_compile.errors import HpmlError
from hpml_compile.ir import Cluster, Device, Link
from hpml_compile.profile.links import (SHM_ALLREDUCE, SHM_HOW, SHM_ROWS, TP_BURST, TP_BURST_SHORT, TP_REDUCE,
                                       TP_REDUCE_SHORT, _summary, fit_link, probe_ranks, tail_mean, tp_reduce_rows)

ROOT = Path(__file__).resolve().parents[2]


def _rows(gbps: float, latency_us: float, shared: bool) -> list[tuple[str, int, float]]:
    link = cost_models.LinkSpec("truth", gbps, latency_us, "test", shared=shared)
    sizes = (4096, 1 << 18, 1 << 22, 1 << 25)
    return ([("p2p", b, cost_models.p2p_ms(b, link)) for b in sizes]
            + [("allreduce", b, cost_models.allreduce_ms(b, 2, link)) for b in sizes])


@pytest.mark.parametrize("shared", [False, True])
def test_the_fit_recovers_the_link_that_made_the_timings(shared: bool) -> None:
    fit = fit_link(_rows(3.1, 50.0, shared))
    assert fit.shared is shared
    assert fit.gbps == pytest.approx(3.1, rel=1e-6) and fit.latency_us == pytest.approx(50.0, rel=1e-6)
    assert fit.worst < 1e-9


@pytest.mark.parametrize("shared", [False, True])
def test_the_reduce_scatter_and_all_gather_get_fits_of_their_own(shared: bool) -> None:
    # gloo runs them slower than its all-reduce: a ring priced with the link's own figures says half of it
    link = cost_models.LinkSpec("truth", 3.1, 50.0, "test", shared=shared)
    slow = {"reduce_scatter": cost_models.LinkSpec("rs", 0.9, 400.0, "test", shared=shared),
            "all_gather": cost_models.LinkSpec("ag", 0.5, 200.0, "test", shared=shared)}
    sizes = (1 << 16, 1 << 22, 1 << 25)
    rows = (_rows(3.1, 50.0, shared) + [("reduce_scatter", b, cost_models.reduce_scatter_ms(b, 2, slow["reduce_scatter"]))
                                       for b in sizes]
            + [("all_gather", b, cost_models.all_gather_ms(b, 2, slow["all_gather"])) for b in sizes])
    fit = fit_link(rows)
    assert (fit.shared, fit.worst < 1e-9) == (shared, True) and fit.gbps == pytest.approx(3.1, rel=1e-6)
    got = {op: (g, lat) for op, g, lat in fit.collectives}
    assert got["reduce_scatter"] == pytest.approx((0.9, 400.0), rel=1e-3)
    assert got["all_gather"] == pytest.approx((0.5, 200.0), rel=1e-3)
    spec = cost_models.LinkSpec("m", fit.gbps, fit.latency_us, "test", shared=shared, collectives=fit.collectives)
    for b in sizes:  # priced as timed, and the all-reduce as before
        want = cost_models.reduce_scatter_ms(b, 2, slow["reduce_scatter"])
        assert cost_models.reduce_scatter_ms(b, 2, spec) == pytest.approx(want, rel=1e-3)
        assert cost_models.allreduce_ms(b, 2, spec) == pytest.approx(cost_models.allreduce_ms(b, 2, link), rel=1e-6)
    alone = fit_link(_rows(3.1, 50.0, shared)).collectives  # the ZeRO pair not timed: the all-reduce's only
    assert [op for op, _, _ in alone] == ["all_reduce"] and alone[0][1:] == pytest.approx((3.1, 50.0), rel=1e-3)


def test_the_all_reduce_is_priced_by_its_own_timings_not_the_joint_fit() -> None:
    # seen in benchmarks/prediction: the joint fit of send/recv and all-reduce took the link as not shared
    # (3.7 GB/s) and priced a 30 MiB all-reduce at half what the probe's own all-reduces took
    sends = cost_models.LinkSpec("p2p", 6.0, 150.0, "test")
    reduces = cost_models.LinkSpec("ar", 2.7, 200.0, "test", shared=True)
    sizes = (1 << 16, 1 << 22, 1 << 25)
    rows = ([("p2p", b, cost_models.p2p_ms(b, sends)) for b in sizes]
            + [("allreduce", b, cost_models.allreduce_ms(b, 2, reduces)) for b in sizes])
    fit = fit_link(rows)
    spec = cost_models.LinkSpec("m", fit.gbps, fit.latency_us, "test", shared=fit.shared, collectives=fit.collectives)
    bare = cost_models.LinkSpec("m", fit.gbps, fit.latency_us, "test", shared=fit.shared)
    b = 30 << 20
    want = cost_models.allreduce_ms(b, 2, reduces)
    assert abs(cost_models.allreduce_ms(b, 2, bare) / want - 1) > 0.2  # the joint fit alone misses it ...
    assert cost_models.allreduce_ms(b, 2, spec) == pytest.approx(want, rel=0.02)  # ... its own fit does not
    for b in sizes:  # and the sends keep the joint fit
        assert cost_models.p2p_ms(b, spec) == cost_models.p2p_ms(b, bare)


def test_the_all_reduce_through_shared_memory_prices_the_all_reduce() -> None:
    # the runtime sums a stage's gradients between CPU ranks of one host through shared memory (runtime.sync.shm), so
    # the probe's rows of that all-reduce price it; gloo's all-reduce rows stay in the joint fit with send/recv
    sends = cost_models.LinkSpec("p2p", 2.0, 150.0, "test")
    gloo = cost_models.LinkSpec("ar", 1.1, 230.0, "test", shared=True)
    shm = cost_models.LinkSpec("shm", 4.5, 700.0, "test", shared=True)
    sizes = (1 << 16, 1 << 22, 1 << 25)
    rows = ([("p2p", b, cost_models.p2p_ms(b, sends)) for b in sizes]
            + [("allreduce", b, cost_models.allreduce_ms(b, 2, gloo)) for b in sizes])
    both = fit_link(rows + [(SHM_ALLREDUCE, b, cost_models.allreduce_ms(b, 2, shm)) for b in sizes])
    alone = fit_link(rows)
    assert (both.gbps, both.latency_us, both.shared) == (alone.gbps, alone.latency_us, alone.shared)
    priced = cost_models.LinkSpec("m", both.gbps, both.latency_us, "test", shared=both.shared,
                                  collectives=both.collectives)
    b = 25 << 20
    assert cost_models.allreduce_ms(b, 2, priced) == pytest.approx(cost_models.allreduce_ms(b, 2, shm), rel=0.02)
    assert cost_models.allreduce_ms(b, 2, priced) < 0.5 * cost_models.allreduce_ms(b, 2, gloo)
    # the ZeRO pair likewise: gloo's rows alone, then beside the shared-memory ones, which win
    pair = [("reduce_scatter", x, 4.0 * cost_models.p2p_ms(x, sends)) for x in sizes]
    fast = [(SHM_ROWS["reduce_scatter"], x, 0.5 * cost_models.p2p_ms(x, sends)) for x in sizes]
    slow_fit = dict((op, g) for op, g, _ in fit_link(rows + pair).collectives)
    fast_fit = dict((op, g) for op, g, _ in fit_link(rows + pair + fast).collectives)
    assert fast_fit["reduce_scatter"] == pytest.approx(8 * slow_fit["reduce_scatter"], rel=0.05)


def test_the_fit_refuses_one_size_and_non_positive_times() -> None:
    with pytest.raises(HpmlError, match="two sizes"):
        fit_link([("p2p", 100, 1.0), ("p2p", 100, 1.1)])
    with pytest.raises(HpmlError, match="positive"):
        fit_link([("p2p", 100, 0.0), ("p2p", 1000, 1.0)])


def test_a_measured_link_round_trips_and_prices_as_measured(tmp_path: Path) -> None:
    c = Cluster(devices=(Device("cpu0", "cpu", 4), Device("cpu1", "cpu", 4)),
                links=(Link("cpu0", "cpu1", 0.8, 120.0, shared=True, source="measured: test"),), name="m")
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(c.to_dict()))
    back = load_cluster(str(path))
    assert back.links == c.links
    spec = link_spec(back, "cpu1", "cpu0")
    assert (spec.gbps, spec.latency_us, spec.shared, spec.source) == (0.8, 120.0, True, "measured: test")
    # the reduce-scatter's and the all-gather's own fits travel with the link and price those collectives
    own = Cluster(devices=c.devices, links=(Link("cpu0", "cpu1", 0.8, 120.0, shared=True,
                                                 collectives=(("reduce_scatter", 0.3, 500.0),)),), name="m")
    path.write_text(json.dumps(own.to_dict()))
    spec = link_spec(load_cluster(str(path)), "cpu0", "cpu1")
    assert spec.for_collective("reduce_scatter").gbps == 0.3 and spec.for_collective("all_gather").gbps == 0.8
    assert cost_models.reduce_scatter_ms(1e6, 2, spec) > 2 * cost_models.all_gather_ms(1e6, 2, spec)
    bad = own.to_dict()
    bad["links"][0]["collectives"]["broadcast"] = {"gbps": 1.0, "latency_us": 1.0}
    path.write_text(json.dumps(bad))
    with pytest.raises(HpmlError, match="broadcast"):
        load_cluster(str(path))
    # an older file (no shared, no source) reads as before
    plain = Cluster(devices=c.devices, links=(Link("cpu0", "cpu1", 1.0, 5.0),)).to_dict()
    assert set(plain["links"][0]) == {"a", "b", "gbps", "latency_us"}


@pytest.mark.dist  # starts the CLI, which spawns two gloo ranks (~15 s quiet, 70 s on a busy host)
@pytest.mark.slow
def test_devices_measure_writes_this_machines_gloo_link(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    run = subprocess.run([sys.executable, "-m", "hpml_compile", "devices", "--measure", "--cpu-ranks", "3",
                          "-o", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    c = load_cluster(str(out))
    cpus = [d.name for d in c.devices if d.is_cpu]
    assert cpus == ["cpu0", "cpu1", "cpu2"]
    pairs = {frozenset((x.a, x.b)) for x in c.links if x.a in cpus and x.b in cpus}
    assert pairs == {frozenset(p) for p in (("cpu0", "cpu1"), ("cpu0", "cpu2"), ("cpu1", "cpu2"))}
    link = next(x for x in c.links if {x.a, x.b} == {"cpu0", "cpu1"})
    assert link.source.startswith("measured: gloo") and 0 < link.gbps < 1e3, link
    assert {op for op, _, _ in link.collectives} == set(cost_models.COLLECTIVE_OPS), link  # the ZeRO pair timed
    assert "link cpu0-cpu1" in run.stdout


def test_a_tensor_parallel_layers_all_reduce_after_compute_gets_a_fit_of_its_own() -> None:
    # the probe times gloo's all-reduce after a burst of compute, from the ranks' mean start (TP_REDUCE): slower
    # than the same all-reduce in a loop, which the link's own fit and its all_reduce fit keep
    layer = cost_models.LinkSpec("tp", 1.2, 700.0, "test", shared=True)
    sizes = (1 << 16, 1 << 22, 1 << 25)
    rows = _rows(3.1, 50.0, True) + [(TP_REDUCE, b, cost_models.allreduce_ms(b, 2, layer)) for b in sizes]
    fit = fit_link(rows)
    got = {op: (g, lat) for op, g, lat in fit.collectives}
    assert got[TP_REDUCE] == pytest.approx((1.2, 700.0), rel=1e-3)
    assert got["all_reduce"] == pytest.approx((3.1, 50.0), rel=1e-3)  # the loop's all-reduce: its own rows
    assert (fit.gbps, fit.latency_us) == pytest.approx((3.1, 50.0), rel=1e-6)  # and the link's fit


def _chains(layer: cost_models.LinkSpec, per_ms: float, sizes: tuple[int, ...]) -> list[tuple[str, int, float]]:
    """The probe's rows of a layer's all-reduce after bursts of 5 and 1.25 ms (a little longer at larger sizes),
    each costing ``layer``'s ring plus ``per_ms`` of the burst before it."""
    rows = []
    for i, b in enumerate(sizes):
        long_, short = 5.0 + 0.1 * i, 1.25 + 0.05 * i
        fixed = cost_models.allreduce_ms(b, 2, layer)
        rows += [(TP_REDUCE, b, fixed + per_ms * long_), (TP_BURST, b, long_),
                 (TP_REDUCE_SHORT, b, fixed + per_ms * short), (TP_BURST_SHORT, b, short)]
    return rows


def test_a_layers_all_reduce_timed_at_two_lengths_of_compute_is_a_fixed_cost_and_a_part_of_the_compute() -> None:
    layer = cost_models.LinkSpec("tp", 1.2, 700.0, "test", shared=True)
    sizes = (1 << 16, 1 << 22, 1 << 25)
    fit = fit_link(_rows(3.1, 50.0, True) + _chains(layer, 0.3, sizes))
    got = {op: (g, lat) for op, g, lat in fit.collectives}
    assert fit.tp_reduce_per_ms == pytest.approx(0.3, abs=1e-4)
    assert got[TP_REDUCE] == pytest.approx((1.2, 700.0), rel=1e-3)  # the fixed part: the ring at no compute
    assert got["all_reduce"] == pytest.approx((3.1, 50.0), rel=1e-3)  # the loop's all-reduce untouched
    # the long chains alone (a probe at one length) fit the compute into the fixed part: dearer at every size
    one = fit_link(_rows(3.1, 50.0, True) + [r for r in _chains(layer, 0.3, sizes) if r[0] == TP_REDUCE])
    assert one.tp_reduce_per_ms == 0.0
    alone = cost_models.LinkSpec("one", 1, 1, "t", shared=True, collectives=one.collectives).for_collective(TP_REDUCE)
    assert cost_models.allreduce_ms(1 << 16, 2, alone) > cost_models.allreduce_ms(1 << 16, 2, layer) + 1.0


def test_noise_that_makes_longer_compute_cheaper_prices_no_part_of_it() -> None:
    layer = cost_models.LinkSpec("tp", 1.2, 700.0, "test", shared=True)
    rows = _chains(layer, -0.2, (1 << 16, 1 << 22, 1 << 25))
    fit = fit_link(_rows(3.1, 50.0, True) + rows)
    assert fit.tp_reduce_per_ms == 0.0
    fixed, _ = tp_reduce_rows(rows)
    assert all(ms > 0 for _, _, ms in fixed)


@pytest.mark.dist  # forks two gloo ranks (a few seconds)
def test_the_probe_times_a_layers_all_reduce_after_short_and_long_compute() -> None:
    rows = probe_ranks((1 << 16, 1 << 20), repeats=3, start_method="fork", timeout_s=120)["gloo"]
    of = {(op, b): ms for op, b, ms in rows}
    for b in (1 << 16, 1 << 20):
        assert of[(TP_REDUCE, b)] > 0 and of[(TP_REDUCE_SHORT, b)] > 0
        assert 0 < of[(TP_BURST_SHORT, b)] < of[(TP_BURST, b)]  # a quarter of the matrix products
    fit = fit_link(rows)
    assert fit.tp_reduce_per_ms >= 0 and TP_REDUCE in {op for op, _, _ in fit.collectives}


def test_a_tail_mean_counts_the_tail_a_median_leaves_out_but_not_one_stall() -> None:
    # a sync after compute: 1 ms in most steps, 3 ms in a fifth of them, and one stall of 40 ms among 20
    times = [1.0] * 15 + [3.0] * 4 + [40.0]
    assert statistics.median(times) == 1.0
    assert tail_mean(times) == pytest.approx((15 + 12) / 19)  # the tail counted, the stall (1/20) left out
    assert tail_mean([2.0, 4.0]) == 3.0  # under twenty values nothing is left out


@pytest.mark.dist  # forks two gloo ranks (a few seconds)
def test_the_collectives_through_shared_memory_are_timed_once_each_after_compute() -> None:
    rows = probe_ranks((1 << 16, 1 << 18), repeats=2, start_method="fork", timeout_s=120)["gloo"]
    shm = [op for op, _, _ in rows if op in SHM_ROWS.values()]
    if not shm:
        pytest.skip("no shared memory could be mapped on this host (the collectives go through gloo)")
    assert sorted(shm) == sorted(list(SHM_ROWS.values()) * 2)  # one row each a size: after compute, not in a loop too
    assert all(ms > 0 for op, _, ms in rows if op in SHM_ROWS.values())
    assert SHM_HOW in _summary(fit_link(rows))  # what the cache's freshness check reads
