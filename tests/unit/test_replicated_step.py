"""What a replicated step pays beyond compute and transfers: the loss agreement and the wait for the latest replica,
measured between two ranks by the host's runtime probe and added to the predicted step."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpml_compile.assumptions import assumptions
from hpml_compile.costgraph import build
from hpml_compile.errors import HpmlError
from hpml_compile.plan import Plan, Schedule, Stage
from hpml_compile.profile import load_profile, save_profile
from hpml_compile.profile.process import replicated_step_figures, with_process
from hpml_compile.simulate import simulate
from hpml_compile.stagecost import measured_agree_ms, skew_wait_ms
from hpml_compile.testing import chain_profile, uniform_cluster


def _plans(n: int, param_bytes: int = 0) -> tuple[object, Plan, Plan]:
    """A two-node CPU profile (``param_bytes`` in each node); the data-parallel plan over ``n`` devices and the
    two-stage pipeline on two."""
    prof = chain_profile([{"cpu": (2.0, 4.0)}, {"cpu": (2.0, 4.0)}], param_bytes=[param_bytes, param_bytes])
    names = tuple(x.name for x in prof.nodes)
    c = uniform_cluster(n)  # links so fast that the link-priced agreement costs nothing
    dp = Plan("dp", c, Schedule.GPIPE, 1, (Stage(0, tuple(f"d{i}" for i in range(n)), names),))
    pipe = Plan("pp", uniform_cluster(2), Schedule.GPIPE, 1,
                (Stage(0, ("d0",), names[:1]), Stage(1, ("d1",), names[1:])))
    return prof, dp, pipe


def test_the_probe_figures_are_fitted_on_compute_from_the_halves_means() -> None:
    # per step: [agreement ms, wait at the sync's meeting ms, compute ms]; the short compute's steps first
    a = [[1.0, 0.1, 1.0], [3.0, 2.1, 1.0], [1.0, 0.1, 11.0], [0.8, 2.1, 11.0]]
    b = [[1.4, 1.1, 1.0], [1.0, 0.1, 1.0], [1.2, 1.7, 11.0], [0.8, 0.1, 11.0]]
    got = replicated_step_figures([a, b])
    # the per-step means 1.2, 2.0 (1 ms of compute), 1.1, 0.8 (11 ms): less with more compute, so one figure
    assert got["agree_ms"] == pytest.approx(1.275) and got["agree_per_ms"] == 0.0
    # half the differences: 0.5 and 1.0 at 1 ms of compute (mean 0.75), 0.8 and 1.0 at 11 ms (mean 0.9)
    assert got["skew_per_ms"] == pytest.approx(0.015) and got["skew_ms"] == pytest.approx(0.735)
    assert got["meet_ms"] == pytest.approx(0.1) and got["meet_per_ms"] == 0.0  # the earlier rank's wait: 0.1 each
    flat = replicated_step_figures([[[1.0, 1.0, 1.0], [1.0, 0.0, 11.0]], [[1.0, 0.0, 1.0], [1.0, 0.4, 11.0]]])
    assert flat["skew_per_ms"] == 0.0 and flat["skew_ms"] == pytest.approx(0.35)  # less with more compute: no slope
    with pytest.raises(HpmlError, match="two probe ranks"):
        replicated_step_figures([a])


def test_heavy_tailed_parts_are_priced_by_their_mean_which_grows_with_the_compute_before_them() -> None:
    # 20 steps of 1 ms of compute: the agreement 0.5 ms; 20 of 11 ms: 0.5 ms in 14, 4.5 ms in 6 (the tail), and
    # the meeting both ranks pay 0.2 ms, then 0.2 or 2.2 ms alike; one stall of 50 ms among the long steps
    short = [[0.5, 0.2, 1.0]] * 20
    long = [[0.5, 0.2, 11.0]] * 13 + [[4.5, 2.2, 11.0]] * 6 + [[50.0, 0.2, 11.0]]
    got = replicated_step_figures([short + long, short + long])
    # the long half's mean without its largest twentieth (the stall): (13 x 0.5 + 6 x 4.5) / 19; a median says 0.5
    tail = (13 * 0.5 + 6 * 4.5) / 19
    assert got["agree_per_ms"] == pytest.approx(round((tail - 0.5) / 10, 4), abs=1e-4)
    assert got["agree_ms"] + 11 * got["agree_per_ms"] == pytest.approx(tail, abs=2e-3)
    meet = (14 * 0.2 + 6 * 2.2 - 2.2) / 19  # the largest twentieth left out: one 2.2
    assert got["meet_ms"] + 11 * got["meet_per_ms"] == pytest.approx(meet, abs=2e-3) and got["meet_per_ms"] > 0
    assert got["skew_ms"] == 0.0 and got["skew_per_ms"] == 0.0  # the ranks arrived together
    assert got["fit_compute_ms"] == 11.0  # the longest compute the line saw


def test_the_bookkeeping_is_priced_by_its_mean_with_the_hosts_sampling_per_ms_of_compute() -> None:
    # per step a fourth figure, Pipeline.step beyond the executor: 0.15 ms, and 0.45 where the host was sampled,
    # which a step of 1 ms of compute meets once in twenty and one of 21 ms in eight of twenty (a median: 0.15)
    short = [[0.5, 0.2, 1.0, 0.15]] * 19 + [[0.5, 0.2, 1.0, 0.45]]
    long = [[0.5, 0.2, 21.0, 0.15]] * 12 + [[0.5, 0.2, 21.0, 0.45]] * 8
    got = replicated_step_figures([short + long, short + long])
    assert got["step_per_ms"] > 0
    # each half's mean without its largest twentieth: 0.15 at 1 ms; (12 x 0.15 + 7 x 0.45) / 19 at 21 ms
    assert got["step_ms"] + 1 * got["step_per_ms"] == pytest.approx(0.15, abs=1e-3)
    assert got["step_ms"] + 21 * got["step_per_ms"] == pytest.approx((12 * 0.15 + 7 * 0.45) / 19, abs=1e-3)
    assert "step_ms" not in replicated_step_figures([[r[:3] for r in short]] * 2)  # rows without it
    # the simulator adds it on the step's compute (6 ms a replica here), not held at the probe's longest compute
    prof, dp, _ = _plans(2)
    plain = simulate(dp, build(with_process(prof, {"bytes": 0, "step_ms": 0.2, "source": "a test"})))
    per_ms = simulate(dp, build(with_process(prof, {"bytes": 0, "step_ms": 0.2, "step_per_ms": 0.01,
                                                    "fit_compute_ms": 1.0, "source": "a test"})))
    assert per_ms.step_ms == pytest.approx(plain.step_ms + 0.01 * 6.0)


def test_a_measured_agreement_prices_the_loss_all_reduce_of_cpu_ranks() -> None:
    prof, dp, _ = _plans(2)
    plain = simulate(dp, build(prof))
    probed = with_process(prof, {"bytes": 0, "agree_ms": 1.5, "skew_ms": 0.0, "source": "a test"})
    got = simulate(dp, build(probed))
    assert plain.agree_ms == pytest.approx(0.0, abs=1e-9) and got.agree_ms == pytest.approx(1.5)  # the free link: 0
    assert got.step_ms == pytest.approx(plain.step_ms + 1.5)
    four = simulate(_plans(4)[1], build(probed))
    assert four.agree_ms == pytest.approx(measured_agree_ms(1.5, 4)) == pytest.approx(3.0)  # two tree rounds


def test_a_replicated_stage_waits_for_its_latest_replica_and_a_pipeline_stage_for_none() -> None:
    prof, dp, pipe = _plans(2)
    probed = with_process(prof, {"bytes": 0, "agree_ms": 0.0, "skew_ms": 0.7, "skew_per_ms": 0.1, "source": "a test"})
    plain, got = simulate(dp, build(prof)), simulate(dp, build(probed))
    compute = 6.0  # a replica's forward and backward: half the rows of (2 + 4) ms x 2 nodes
    assert got.skew_ms == (pytest.approx(0.7 + 0.1 * compute),)
    assert got.step_ms == pytest.approx(plain.step_ms + 0.7 + 0.1 * compute)
    assert simulate(pipe, build(probed)).step_ms == pytest.approx(simulate(pipe, build(prof)).step_ms)
    four = simulate(_plans(4)[1], build(probed))  # a quarter of the rows each: 3 ms of compute
    assert four.skew_ms[0] == pytest.approx(skew_wait_ms(0.7 + 0.1 * 3.0, 4)) and four.skew_ms[0] > 1.0


def test_a_measured_meeting_replaces_the_links_price_of_the_meeting_before_the_sync() -> None:
    from hpml_compile.cluster import link_spec
    from hpml_compile.stagecost import meet_ms

    prof, dp, pipe = _plans(2, param_bytes=4096)  # parameters to sync
    probed = with_process(prof, {"bytes": 0, "agree_ms": 0.0, "skew_ms": 0.0, "meet_ms": 0.4, "meet_per_ms": 0.05,
                                 "source": "a test"})
    plain, got = simulate(dp, build(prof)), simulate(dp, build(probed))
    compute = 6.0  # a replica's forward and backward: half the rows of (2 + 4) ms x 2 nodes
    link = meet_ms(2, link_spec(dp.cluster, "d0", "d1"))  # what the sync already prices for it
    assert got.skew_ms == (pytest.approx(0.4 + 0.05 * compute - link),)
    assert got.step_ms == pytest.approx(plain.step_ms + 0.4 + 0.05 * compute - link)
    assert simulate(pipe, build(probed)).step_ms == pytest.approx(simulate(pipe, build(prof)).step_ms)  # no sync
    assert simulate(_plans(2)[1], build(with_process(_plans(2)[0], {"bytes": 0, "meet_ms": 0.4, "source": "a test"}))
                    ).skew_ms == (0.0,)  # no parameters: no collective, no meeting
    dp4 = _plans(4, param_bytes=4096)[1]
    four = simulate(dp4, build(probed))  # a quarter of the rows each: 3 ms; two rounds of the pair's figure
    link4 = meet_ms(4, link_spec(dp4.cluster, "d0", "d1"))
    assert four.skew_ms[0] == pytest.approx(measured_agree_ms(0.4 + 0.05 * 3.0, 4) - link4)


def test_a_zero3_stage_pays_the_wait_and_the_meeting_before_each_parameter_gather_too() -> None:
    """ZeRO-3's replicas meet before each microbatch's forward and backward gather as well as before the sync, and
    ZeRO-1's before the gather after the optimizer step (the communicator's blocking collectives): the probe's
    fixed parts are paid at each meeting, its parts per millisecond once over the step's compute."""
    from dataclasses import replace

    from hpml_compile.cluster import link_spec
    from hpml_compile.memory import ZeroStage
    from hpml_compile.stagecost import meet_ms

    prof, dp, _ = _plans(2, param_bytes=4096)
    probed = with_process(prof, {"bytes": 0, "agree_ms": 0.0, "skew_ms": 0.3, "skew_per_ms": 0.02, "meet_ms": 0.4,
                                 "meet_per_ms": 0.05, "source": "a test"})
    graph = build(probed)
    z0, z1, z3 = (replace(dp, stages=(replace(dp.stages[0], zero=z),))
                  for z in (ZeroStage.NONE, ZeroStage.OS, ZeroStage.OS_G_P))
    compute = 6.0  # a replica's forward and backward (one microbatch)
    price = meet_ms(2, link_spec(z3.cluster, "d0", "d1"))  # what the sync prices each meeting at on the link
    assert simulate(z0, graph).skew_ms[0] == pytest.approx(0.3 + 0.4 - price + (0.02 + 0.05) * compute)
    # ZeRO-1 on CPU ranks: the sync's meeting and the one before the gather after the optimizer step
    assert simulate(z1, graph).stages[0].gather_ms > 0
    assert simulate(z1, graph).skew_ms[0] == pytest.approx(2 * (0.3 + 0.4 - price) + (0.02 + 0.05) * compute)
    # three meetings (the sync's, the forward gather's, the backward gather's): the fixed parts three times
    assert simulate(z3, graph).skew_ms[0] == pytest.approx(3 * (0.3 + 0.4 - price) + (0.02 + 0.05) * compute)
    two = replace(z3, microbatches=2)  # five meetings
    assert simulate(two, graph).skew_ms[0] == pytest.approx(5 * (0.3 + 0.4 - price) + (0.02 + 0.05) * compute)


def test_the_measured_agreement_grows_with_the_compute_before_it_up_to_the_longest_the_probe_ran() -> None:
    prof, dp, _ = _plans(2)
    figures = {"bytes": 0, "agree_ms": 0.5, "agree_per_ms": 0.1, "skew_ms": 0.0, "source": "a test"}
    assert simulate(dp, build(with_process(prof, figures))).agree_ms == pytest.approx(0.5 + 0.1 * 6.0)  # 6 ms
    short = with_process(prof, {**figures, "skew_per_ms": 0.2, "fit_compute_ms": 4.0})  # fitted on 4 ms at most
    got = simulate(dp, build(short))
    assert got.agree_ms == pytest.approx(0.5 + 0.1 * 4.0) and got.skew_ms == (pytest.approx(0.2 * 4.0),)


def _named(plan: Plan, prof: object) -> list[str]:
    """The assumptions of the replicated step's figures (the toy profile also assumes its speeds and overlap)."""
    return [a.name for a in assumptions(plan, prof) if "replica" in a.name or "agreement" in a.name]


def test_the_plan_names_what_it_stretched_from_two_ranks_and_what_it_did_not_price() -> None:
    prof, dp2, _ = _plans(2)
    _, dp4, _ = _plans(4)
    assert _named(dp2, prof) == ["replicas' wait at the gradient sync"]  # no probe figures: not priced
    probed = with_process(prof, {"bytes": 0, "agree_ms": 1.0, "skew_ms": 0.5, "source": "a test"})
    assert _named(dp2, probed) == []  # two ranks: what was measured
    assert _named(dp4, probed) == ["loss agreement over more than two CPU ranks",
                                   "wait for the latest of 4 CPU replicas"]


def test_a_profile_carries_the_probe_figures_through_its_schema(tmp_path: Path) -> None:
    prof, dp, _ = _plans(2)
    probed = with_process(prof, {"bytes": 5, "agree_ms": 1.25, "skew_ms": 0.25, "skew_per_ms": 0.02,
                                 "executor_ms": 0.125, "source": "a test"})
    again = load_profile(save_profile(probed, tmp_path / "profile.json"))
    assert {k: again.devices["cpu"]["process"][k] for k in ("agree_ms", "skew_ms", "skew_per_ms", "executor_ms")} \
        == {"agree_ms": 1.25, "skew_ms": 0.25, "skew_per_ms": 0.02, "executor_ms": 0.125}
    assert simulate(dp, build(again)).step_ms == pytest.approx(simulate(dp, build(probed)).step_ms)


@pytest.mark.dist
@pytest.mark.slow
def test_the_probe_runs_two_ranks_of_the_runtime_where_the_cache_has_the_one_rank_probes_figures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpml_compile.profile.process import host_key, remember, this_host
    from hpml_compile.profile.timing import host_facts

    monkeypatch.setenv("HPML_HOST_CACHE", str(tmp_path / "host.json"))
    key = host_key(host_facts())
    remember(key, "link", {"gbps": 3.0, "latency_us": 60.0, "shared": True, "source": "a test"})
    remember(key, "runtime_baseline", {"bytes": 123, "step_ms": 0.5, "source": "the one-rank probe"})
    got = this_host(log=lambda _l: None)["process"]  # measured again: two fresh ranks
    assert 100 * 2**20 < got["bytes"] < 4096 * 2**20  # torch and the runtime, a model of 10 parameters
    assert 0.0 < got["agree_ms"] < 1000.0 and 0.0 <= got["skew_ms"] < 1000.0 and 0.0 < got["step_ms"] < 1000.0
    assert 0.0 <= got["skew_per_ms"] < 10.0
    assert "two fresh interpreters" in got["source"]
    assert with_process(chain_profile([{"cpu": (1.0, 1.0)}]), got).devices["cpu"]["process"]["agree_ms"] \
        == got["agree_ms"]


def test_a_hand_written_cache_entry_is_taken_as_it_is_and_the_one_rank_probes_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpml_compile.profile.process import host_key, remember, this_host
    from hpml_compile.profile.timing import host_facts

    monkeypatch.setenv("HPML_HOST_CACHE", str(tmp_path / "host.json"))
    key = host_key(host_facts())
    remember(key, "link", {"gbps": 3.0, "latency_us": 60.0, "shared": True, "source": "a test"})
    remember(key, "runtime_baseline", {"bytes": 123, "source": "a test"})  # no figures of any probe: as it is
    assert this_host(log=lambda _l: None)["process"]["bytes"] == 123  # measured nothing (a probe reads ~300 MiB)
    remember(key, "runtime_baseline", {"bytes": 123, "step_ms": 0.5, "source": "the one-rank probe"})
    assert this_host(log=lambda _l: None, measure=False)["process"]["bytes"] == 123  # the API measures nothing


def test_explain_says_what_was_measured_between_two_ranks() -> None:
    from hpml_compile.explain import summary

    prof, dp, _ = _plans(2)
    probed = with_process(prof, {"bytes": 0, "agree_ms": 1.5, "skew_ms": 0.7, "source": "a test"})
    g = build(probed)
    text = summary(dp, g, simulate(dp, g))
    assert "loss agreement: one 32-byte all-reduce over the 2 ranks before the optimizer steps, 1.5 ms (as two " \
           "ranks of this host measured it)" in text
    assert "stage 0 waits 0.7 ms a step for its latest replica" in text
    assert "latest replica" not in summary(dp, build(prof), simulate(dp, build(prof)))  # not measured: not said


@pytest.mark.dist
def test_a_probe_rank_that_fails_names_its_error_and_leaves_no_peer_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import time

    process = importlib.import_module("hpml_compile.profile.process")
    broken = process.BASELINE_CODE.replace("world = int(", 'os.environ["HPML_PROBE_RANK"] == "1" and 1 / 0\nworld = int(')
    monkeypatch.setattr(process, "BASELINE_CODE", broken)
    t0 = time.monotonic()
    with pytest.raises(HpmlError, match="ZeroDivisionError"):  # rank 1's error, not rank 0's time-out
        process.runtime_baseline(timeout_s=120)
    assert time.monotonic() - t0 < 60  # rank 0, waiting for its peer at the rendezvous, was stopped
