"""A tensor-parallel stage's collectives priced as the host probe timed them: gloo's all-reduce in a chain of compute,
as a sharded layer runs it, each of the stage's all-reduces at that cost; the plan says where it was not timed."""

from __future__ import annotations

from pathlib import Path

import pytest
import cost_models
from hpml_compile import models
from hpml_compile.assumptions import assumptions
from hpml_compile.cluster import load_cluster
from hpml_compile.costgraph import build
from hpml_compile.ir import Cluster, Device, Link
from hpml_compile.plan import Plan, Schedule, SolverInfo, Stage
from hpml_compile.profile import profile
from hpml_compile.profile.links import SHM_HOW, TP_REDUCE_HOW
from hpml_compile.profile.process import older_link
from hpml_compile.simulate import stage_costs
from hpml_compile.solve.candidates import Chain, Setting, to_plan
from hpml_compile.solve.table import build_table
from hpml_compile.tp import analyze

MiB = 1 << 20
LAYER = ("tp_reduce", 1.2, 700.0)  # a probe's fit of gloo's all-reduce in a chain of compute (GB/s, us per ring step)


@pytest.fixture(scope="module")
def gpt():
    """The zoo's gpt-tiny on meta: its attention and MLP units shard at tp 2."""
    m = models.load("gpt-tiny", batch_size=8, device="meta")
    return profile(m.module, m.example_inputs, name="m", device_kinds=["H100-80GB"], batch_size=8,
                   seq_len=m.seq_len, progress=False)


def _stage(prof, fit: tuple[str, float, float] | None, microbatches: int = 1):
    base = load_cluster("dgx-h100-8")
    link = Link("gpu0", "gpu1", 50.0, 5.0, collectives=(fit,) if fit else ())
    c = Cluster(base.devices, (link,), name="two")
    nodes = tuple(n.name for n in prof.nodes)
    plan = Plan("m", c, Schedule.GPIPE, microbatches, (Stage(0, ("gpu0", "gpu1"), nodes, tp=2),))
    return stage_costs(plan, build(prof).coarsen(), prof.dtype)[0]


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_tp_stage_pays_each_of_its_all_reduces_at_the_probes_after_compute_cost(gpt, microbatches: int) -> None:
    # the all-reduces the graph's units add (tp.analyze), each of a microbatch's share of its tensor
    units = analyze(gpt).units
    reduces = {phase: [c.nbytes / microbatches for u in units for c in u.collectives
                       if c.phase == phase and c.op == "all_reduce"] for phase in ("forward", "backward")}
    assert len(reduces["forward"]) >= 4 and len(reduces["backward"]) >= 4  # two units a layer, two layers
    layer = cost_models.LinkSpec("layer", LAYER[1], LAYER[2], "probe")
    free = _stage(gpt, ("tp_reduce", 1e9, 0.0), microbatches)  # the same stage, its all-reduces next to free
    timed = _stage(gpt, LAYER, microbatches)
    want = {ph: sum(cost_models.allreduce_ms(b, 2, layer) for b in bs) for ph, bs in reduces.items()}
    assert timed.fwd_ms - free.fwd_ms == pytest.approx(want["forward"], rel=1e-6)
    assert timed.bwd_ms - free.bwd_ms == pytest.approx(want["backward"], rel=1e-6)
    # without the probe's fit, the link's own prices them: here a faster link, so less
    assert _stage(gpt, None, microbatches).fwd_ms < timed.fwd_ms


def test_the_plan_says_where_a_cpu_tp_stages_all_reduce_was_not_timed(gpt) -> None:
    cpus = tuple(Device(f"cpu{i}", "cpu", 16, "h0") for i in range(2))
    nodes = tuple(n.name for n in gpt.nodes)

    def listed(collectives: tuple[tuple[str, float, float], ...], tp: int = 2) -> list[str]:
        c = Cluster(cpus, (Link("cpu0", "cpu1", 3.0, 60.0, shared=True, collectives=collectives),))
        plan = Plan("m", c, Schedule.GPIPE, 1, (Stage(0, ("cpu0", "cpu1"), nodes, tp=tp),))
        return [a.name for a in assumptions(plan, gpt)]

    name = "tensor-parallel all-reduce on CPU ranks"
    assert name in listed(())
    assert name in listed((("all_reduce", 10.0, 200.0),))  # the sync's all-reduce is not a layer's
    assert name not in listed((LAYER,))
    assert name not in listed((), tp=1)  # two replicas: no layer all-reduces


@pytest.mark.dist  # the link probe forks two gloo ranks (a few seconds)
def test_a_cached_link_without_the_layers_all_reduce_is_timed_again(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from hpml_compile.profile.process import host_key, remember, this_host
    from hpml_compile.profile.timing import host_facts

    monkeypatch.setenv("HPML_HOST_CACHE", str(tmp_path / "host.json"))
    key = host_key(host_facts())
    older = {"gbps": 3.0, "latency_us": 60.0, "shared": True, "source": "an older probe",
             "collectives": {"all_reduce": {"gbps": 10.0, "latency_us": 200.0}}}
    remember(key, "link", older)
    remember(key, "runtime_baseline", {"bytes": 123, "source": "a test"})  # taken as it is: no probe starts
    assert this_host(log=lambda _l: None, measure=False)["link"] == older  # the API measures nothing
    got = this_host(log=lambda _l: None)["link"]
    assert got["source"].startswith("measured by profile") and "tp_reduce" in got["collectives"], got
    fit = got["collectives"]["tp_reduce"]
    assert fit["gbps"] > 0 and fit["latency_us"] >= 0
    assert TP_REDUCE_HOW in got["source"] and not older_link(got)  # timed as a layer runs it: kept from now on


def test_a_cached_layers_all_reduce_timed_another_way_is_timed_again() -> None:
    fits = {"all_reduce": {"gbps": 10.0, "latency_us": 200.0}, "tp_reduce": {"gbps": 3.0, "latency_us": 175.0}}
    link = {"gbps": 3.0, "latency_us": 60.0, "shared": True, "collectives": fits}
    assert older_link({**link, "source": "measured by profile: ... (tp-reduce 3 GB/s, 175.0 us)"})  # after compute
    assert not older_link({**link, "source": f"measured by profile: ...; {TP_REDUCE_HOW}"})
    assert older_link({**link, "collectives": {"all_reduce": fits["all_reduce"]}, "source": TP_REDUCE_HOW})
    assert not older_link({"gbps": 3.0, "latency_us": 60.0, "source": "written by hand"})
    # collectives through shared memory timed in a loop (medians) price a step's sync below its mean: timed again
    assert older_link({**link, "source": f"...; the collectives through shared memory; {TP_REDUCE_HOW}"})
    assert not older_link({**link, "source": f"...; {SHM_HOW}; {TP_REDUCE_HOW}"})


def test_a_unit_reading_the_models_input_all_reduces_no_gradient() -> None:
    # autograd computes no gradient for the model's input, so the first MLP unit's backward all-reduce never runs
    # (a tp 2 step of the zoo's mlp on gloo ranks runs 4 all-reduces forward and 3 backward)
    m = models.load("mlp", device="meta")
    prof = profile(m.module, m.example_inputs, name="mlp", device_kinds=["H100-80GB"], batch_size=m.batch_size,
                   progress=False)
    units = analyze(prof).units
    phases = [[c.phase for c in u.collectives] for u in units]
    assert phases == [["forward"]] + [["forward", "backward"]] * (len(units) - 1) and len(units) == 4
    g = build(prof)
    parts = [g.node(n).shard[2] for n in g.order if 2 in g.node(n).shard]
    assert (sum(p.fwd_count for p in parts), sum(p.bwd_count for p in parts)) == (4, 3)


def test_a_layers_all_reduce_adds_the_probes_part_of_the_compute_before_it(gpt) -> None:
    # a link timed at two lengths of compute: each pass's all-reduces add that part of the rank's compute of it
    base = load_cluster("dgx-h100-8")
    nodes = tuple(n.name for n in gpt.nodes)
    g = build(gpt).coarsen()

    def cost(per_ms: float, fits: tuple[tuple[str, float, float], ...] = (LAYER,)):
        c = Cluster(base.devices, (Link("gpu0", "gpu1", 50.0, 5.0, collectives=fits, tp_reduce_per_ms=per_ms),))
        plan = Plan("m", c, Schedule.GPIPE, 2, (Stage(0, ("gpu0", "gpu1"), nodes, tp=2),))
        return stage_costs(plan, g, gpt.dtype)[0]

    compute = cost(0.0, (("tp_reduce", 1e9, 0.0), ("tp_gather", 1e9, 0.0)))  # free collectives: the compute alone
    flat, waits = cost(0.0), cost(0.25)
    assert waits.fwd_ms - flat.fwd_ms == pytest.approx(0.25 * compute.fwd_ms, rel=1e-3)
    assert waits.bwd_ms - flat.bwd_ms == pytest.approx(0.25 * compute.bwd_ms, rel=1e-3)


def test_simulator_and_table_price_a_layers_wait_for_its_compute_alike(gpt) -> None:
    base = load_cluster("dgx-h100-8")
    c = Cluster(base.devices, (Link("gpu0", "gpu1", 50.0, 5.0, collectives=(LAYER,), tp_reduce_per_ms=0.25),))
    g = build(gpt).coarsen()
    chain, setting = Chain.of(g), Setting(2, Schedule.ONE_F_ONE_B, gpt.batch_size, gpt.dtype)
    tab = [x for x in build_table(chain, c, setting).candidates() if x.a == 0 and x.b == chain.n and x.config.tp > 1]
    assert tab
    for cand in tab:
        plan = to_plan(chain, c, setting, [cand], SolverInfo("test"))
        assert stage_costs(plan, g, gpt.dtype)[0].compute_ms == pytest.approx(cand.t, rel=1e-9)
