"""What CPU ranks sharing a host pay in the step beyond their compute, each priced at the profile's measurement
of it: the optimizer step beside the other ranks' steps, and the messages that wait for their receive."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpml_compile.costgraph import build
from hpml_compile.ir import Cluster, Device, Link
from hpml_compile.plan import Plan, Schedule, Stage
from hpml_compile.simulate import EventKind, simulate
from hpml_compile.testing import chain_profile


def _host(ranks: int) -> Cluster:
    devs = tuple(Device(f"d{i}", "cpu", 8) for i in range(ranks))
    return Cluster(devices=devs, links=tuple(Link("d0", f"d{i}", 1e6, 0.0) for i in range(1, ranks)))


def _graph(cpus: int, optimizer_corun: dict | None):
    """Two equal blocks of 2 MB of weights; the whole model's AdamW step alone takes 10 ms; one thread streams
    44.1 GB/s and the host's two 44.7 (mlp's figures on the 2-core VM: as if the host's bandwidth were one
    thread's)."""
    prof = chain_profile([(2.0, 4.0), (2.0, 4.0)], param_bytes=2 * 10**6)
    facts = {"measured": True, "cpus": cpus, "stream_gbps": 44.1, "host_stream_gbps": 44.7,
             **({"optimizer_corun": optimizer_corun} if optimizer_corun else {})}
    return build(replace(prof, optimizer="adamw", optimizer_ms={"cpu": 10.0}, devices={"cpu": facts}))


def _optimizer_bars(plan: Plan, graph) -> list[float]:
    r = simulate(plan, graph)
    return [b.end_ms - b.start_ms for b in r.intervals if b.kind is EventKind.OPTIMIZER]


def test_the_optimizer_step_beside_other_ranks_is_priced_as_measured() -> None:
    """mlp's pipeline stages (half the model each) stepped in 7.0-7.3 ms side by side on the 2-core VM, the whole
    model alone in 11.7: the stream rates priced the pair 2x (11.9 ms), the step measured beside a neighbour's
    stepping about 1.2x. Where the profile measured that, it prices the step; elsewhere the bandwidth does."""
    measured = {"ratio": 1.2, "ranks": 2, "rounds": [1.2], "clock": "cpu"}
    g, plain = _graph(2, measured), _graph(2, None)
    assert g.optimizer_corun("cpu") == (1.2, 2) and plain.optimizer_corun("cpu") is None
    pipe = Plan("toy", _host(2), Schedule.ONE_F_ONE_B, 2,
                (Stage(0, ("d0",), ("n0",)), Stage(1, ("d1",), ("n1",))))
    # the two stages' steps overlap (stage 1 ends its backward first, then waits on nothing but its own step)
    bars = _optimizer_bars(pipe, g)
    assert len(bars) == 2 and all(5.0 < b <= 5.0 * 1.2 + 1e-9 for b in bars)
    assert max(bars) > 5.0 * 1.1  # while both step, 1.2x the half alone
    assert max(_optimizer_bars(pipe, plain)) > 5.0 * 1.9  # the bandwidth's stretch: 2 x 44.1 / 44.7
    # data parallelism: both replicas step the whole model at once
    dp = Plan("toy", _host(2), Schedule.GPIPE, 1, (Stage(0, ("d0", "d1"), ("n0", "n1")),))
    assert _optimizer_bars(dp, g) == pytest.approx([10.0 * 1.2] * 2)
    # four ranks on two cores: a core's turns (2x), and the two ranks running at once share the memory (1.2x)
    g2 = _graph(2, measured)
    dp4 = Plan("toy", _host(4), Schedule.GPIPE, 1, (Stage(0, tuple(f"d{i}" for i in range(4)), ("n0", "n1")),))
    assert _optimizer_bars(dp4, g2) == pytest.approx([10.0 * 2 * 1.2] * 4)
    # measured with four processes: two stepping at once stretch a third of the way to it
    g4 = _graph(4, {"ratio": 1.6, "ranks": 4, "rounds": [1.6], "clock": "cpu"})
    assert _optimizer_bars(dp, g4) == pytest.approx([10.0 * (1 + 0.6 / 3)] * 2)
    # a rank alone on its host: as measured alone
    one = Plan("toy", _host(1), Schedule.GPIPE, 1, (Stage(0, ("d0",), ("n0", "n1")),))
    assert _optimizer_bars(one, g) == pytest.approx([10.0])


def _pipe(early_ms: float, cores: int):
    """Two stages of a 2-rank GPipe at M=2 over a free link: stage 0 forward 1 ms, backward 2; stage 1 forward 3,
    backward 6; ``early_ms``: what the profile's probe measured a message waiting for its receive takes."""
    m = 2
    prof = chain_profile([(1.0 * m, 2.0 * m), (3.0 * m, 6.0 * m)])
    g = build(replace(prof, devices={"cpu": {"measured": True, "cpus": cores, "process": {
        "bytes": 1, "recv_cpu_ms": early_ms}}}))
    plan = Plan("toy", _host(2), Schedule.GPIPE, m, (Stage(0, ("d0",), ("n0",)), Stage(1, ("d1",), ("n1",))))
    return plan, g


def test_a_message_that_waits_for_its_receive_costs_its_rank_cpu_where_no_core_is_spare() -> None:
    """gpt-mini's interleaved 1F1B, twice 1F1B's messages, most arriving while their receiver still computed,
    ran 30 ms a step of gloo's threads' CPU on the 2-core VM and 10% slower than its 1F1B. A message that waits
    ``w`` ms for its receive costs its rank ``min(w, recv_cpu_ms)``; here microbatch 1's activations reach
    stage 1 at 2 ms, while it computes microbatch 0 until 4: charged there, and only there (stage 0 waits at
    its receives for the gradients)."""
    plan, g = _pipe(0.0, 2)
    assert g.early_receive_ms("cpu") == 0.0
    base = simulate(plan, g).step_ms
    plan, g = _pipe(0.5, 2)
    assert g.early_receive_ms("cpu") == 0.5
    assert simulate(plan, g).step_ms == pytest.approx(base + 0.5)  # one early message, 0.5 ms of its 2 ms wait
    plan, g = _pipe(5.0, 2)
    assert simulate(plan, g).step_ms == pytest.approx(base + 2.0)  # at most the wait
    plan, g = _pipe(5.0, 4)  # a core to spare runs gloo's threads: nothing charged
    assert simulate(plan, g).step_ms == pytest.approx(base)


@pytest.mark.dist
def test_the_probe_times_an_early_message_against_one_whose_receive_was_posted() -> None:
    from hpml_compile.profile.messages import probe_early_receive

    r = probe_early_receive(count=2, wait_ms=5.0, nbytes=64 * 2**10)
    assert set(r) == {"early_ms", "posted_ms", "recv_cpu_ms", "wait_ms"} and r["wait_ms"] == 5.0
    assert r["early_ms"] >= 0 and r["posted_ms"] >= 0
    assert r["recv_cpu_ms"] == pytest.approx(max(0.0, r["early_ms"] - r["posted_ms"]), abs=1e-3)


def test_the_host_cache_carries_the_early_receive_figure_to_the_cost_graph(tmp_path, monkeypatch) -> None:
    from hpml_compile.profile.process import host_key, remember, this_host, with_process
    from hpml_compile.profile.timing import host_facts

    monkeypatch.setenv("HPML_HOST_CACHE", str(tmp_path / "host.json"))
    key = host_key(host_facts())
    remember(key, "runtime_baseline", {"bytes": 123, "step_ms": 0.5, "source": "a probe"})
    assert "recv_cpu_ms" not in this_host(log=lambda _l: None, measure=False)["process"]  # the API probes nothing
    remember(key, "early_receive", {"early_ms": 1.7, "posted_ms": 0.2, "recv_cpu_ms": 1.5, "wait_ms": 20.0})
    got = this_host(log=lambda _l: None, measure=False)["process"]
    assert got["recv_cpu_ms"] == 1.5 and got["bytes"] == 123
    assert build(with_process(chain_profile([{"cpu": (1.0, 1.0)}]), got)).early_receive_ms("cpu") == 1.5
