"""Compression and local SGD options: parsing, the plan's record of them, their price, and the solver's choice.

The ranks' side (convergence, bytes sent, ``--sync-every 1`` equal to plain
data parallelism) is tests/dist/test_compress_dist.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from dataclasses import replace

import pytest
import torch

import cost_models
from hpml_compile.compression import CompressKind, Compression, check_sync, parse_compress, powersgd_fraction
from hpml_compile.driver import Options
from hpml_compile.errors import OptionError, PlanError, SchemaError
from hpml_compile.ir import Cluster, Device, Link
from hpml_compile.plan import Plan, Schedule, Stage, ZeroStage, check_comm, with_comm
from hpml_compile.runtime.execute.checkpoint import latest, load_checkpoint, save_checkpoint
from hpml_compile.runtime.sync.compress import TopK
from hpml_compile.runtime.sync.feedback import Feedback, Replica, merge_replicas, replica_key, replica_reads
from hpml_compile.simulate import annotate, simulate
from hpml_compile.solve import solve
from hpml_compile.testing import chain_graph
from hpml_compile.stagecost import compressed_sync_ms, local_sgd_sync_ms, sync_ms


@pytest.mark.parametrize("text, kind, rank, ratio", [("powersgd:4", "powersgd", 4, 0.0), ("topk:0.01", "topk", 0, 0.01),
                                                     ("TopK:0.5", "topk", 0, 0.5)])
def test_parse(text: str, kind: str, rank: int, ratio: float) -> None:
    c = Compression.parse(text)
    assert (c.kind.value, c.rank, c.ratio) == (kind, rank, ratio)
    assert Compression.parse(str(c)) == c
    assert parse_compress("none") is None and parse_compress(None) is None


@pytest.mark.parametrize("text, says", [("gzip:3", "unknown compression 'gzip'"), ("topk", "needs its ratio"),
                                        ("powersgd:", "needs its rank"), ("topk:1.5", "between 0 and 1"),
                                        ("topk:0", "between 0 and 1"), ("powersgd:0", "rank >= 1"),
                                        ("powersgd:two", "'two' is not a number"), ("powersgd:1.5", "not a number")])
def test_bad_compress_value_gets_a_clear_error(text: str, says: str) -> None:
    with pytest.raises(OptionError) as e:
        Options(compress=text)
    msg = str(e.value)
    assert says in msg and "--compress" in msg and "powersgd:RANK" in msg and "topk:RATIO" in msg


def test_bad_sync_values_and_combinations() -> None:
    for every, warm in ((0, 0), (2, -1), (1.5, 0)):
        with pytest.raises(OptionError, match="--sync-(every|warmup)"):
            check_sync(every, warm)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="give one"):
        Options(compress="topk:0.1", allow_compress="topk:0.1")
    with pytest.raises(OptionError, match="nothing to compress"):
        Options(compress="topk:0.1", sync_every=4)


def _plan(replicas: int = 2, zero: int = 0, **kw: object) -> Plan:
    c = Cluster(devices=tuple(Device(f"cpu{i}", "cpu", 4.0) for i in range(replicas + 1)), name="c")
    stages = (Stage(0, tuple(f"cpu{i}" for i in range(replicas)), ("x", "fc"), zero=zero),
              Stage(1, (f"cpu{replicas}",), ("out",)))
    return Plan("toy", c, Schedule.ONE_F_ONE_B, 2, stages, **kw)  # type: ignore[arg-type]


def test_plan_records_them_only_when_set_and_round_trips() -> None:
    plain = _plan()
    d = plain.to_dict()
    assert "sync_every" not in d and all("compress" not in s for s in d["stages"])
    p = with_comm(plain, compress="topk:0.05")
    assert [s.compress for s in p.stages] == ["topk:0.05", ""]  # the replicated stage only
    assert Plan.from_dict(p.to_dict()) == p and p.to_dict()["stages"][0]["compress"] == "topk:0.05"
    q = with_comm(plain, sync_every=8, sync_warmup=3)
    assert (q.to_dict()["sync_every"], q.to_dict()["sync_warmup"]) == (8, 3) and Plan.from_dict(q.to_dict()) == q
    bad = p.to_dict()
    bad["stages"][0]["compress"] = "topk:2"
    with pytest.raises(SchemaError, match=r"stages\[0\]\.compress"):
        Plan.from_dict(bad)


def test_what_the_runtime_does_not_perform_is_refused() -> None:
    with pytest.raises(PlanError, match="runs on one device"):
        check_comm(replace(_plan(), stages=(_plan().stages[0], replace(_plan().stages[1], compress="topk:0.1"))))
    with pytest.raises(PlanError, match="ZeRO-1"):
        check_comm(replace(_plan(zero=1), stages=(replace(_plan(zero=1).stages[0], compress="topk:0.1"),
                                                  _plan().stages[1])))
    with pytest.raises(PlanError, match="local SGD"):
        with_comm(_plan(zero=1), sync_every=4)
    with pytest.raises(OptionError, match="no replicated stage"):
        with_comm(_plan(replicas=1), compress="powersgd:2")


def test_topk_error_feedback_sends_everything_eventually() -> None:
    """What one step leaves out is added to the next: over steps, the sum sent equals the sum of gradients."""
    torch.manual_seed(0)
    t = TopK(ratio=0.1, replicas=1)
    grads = [torch.randn(1000) for _ in range(30)]
    sent = sum(t.compress_local(g.clone()) for g in grads)
    assert t.error is not None
    torch.testing.assert_close(sent + t.error, sum(grads), rtol=0, atol=1e-4)  # nothing lost, only delayed
    assert int((t.compress_local(torch.zeros(1000)) != 0).sum()) == 100  # k = ratio x N entries a step


def _feedback(model: torch.nn.Module, replica: int, replicas: int, names: list[str] | None = None,
              error: torch.Tensor | None = None) -> Feedback:
    named = dict(model.named_parameters())
    names = names or list(named)
    t = TopK(ratio=0.1, replicas=replicas)
    t.error = error
    return Feedback(t, names, [named[n].numel() for n in names], replica)


def test_error_feedback_survives_a_checkpoint_by_name_and_across_replica_counts(tmp_path: Path) -> None:
    """Each replica's error comes back bit for bit; under another plan by parameter name (a stage of its own),
    under another replica count as the sum on replica 0; a plan that does not compress drops it, and says so."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    n = sum(p.numel() for p in model.parameters())
    errors = [torch.randn(n), torch.randn(n)]
    saved = [_feedback(model, r, 2, error=errors[r]) for r in range(2)]  # both replicas' keys, as two ranks write
    save_checkpoint(tmp_path, 5, model, feedback=saved, rng=False)
    path = latest(tmp_path)
    notes: list[str] = []
    for r in range(2):  # the same plan: each replica its own error, bit for bit
        back = _feedback(model, r, 2)
        load_checkpoint(path, model, feedback=[back], rng=False, log=notes.append)
        assert back.reducer.residual() is not None and torch.equal(back.reducer.residual(), errors[r])
    assert notes == []
    second = ["1.weight", "1.bias"]  # another plan: the second layer is a stage of its own, 2 replicas
    back = _feedback(model, 1, 2, names=second)
    load_checkpoint(path, model, feedback=[back], rng=False, log=notes.append)
    assert torch.equal(back.reducer.residual(), errors[1][3 * 4 + 4:])
    assert len(notes) == 1 and "of 2 parameter(s) of this rank (e.g. 0.bias) is dropped" in notes[0]  # uncompressed
    notes.clear()
    three = [_feedback(model, r, 3) for r in range(3)]  # another replica count: the sum is what is still owed
    for fb in three:
        load_checkpoint(path, model, feedback=[fb], rng=False, log=notes.append)
    torch.testing.assert_close(three[0].reducer.residual(), errors[0] + errors[1], rtol=0, atol=0)
    assert three[1].reducer.residual() is None and three[2].reducer.residual() is None
    assert len(notes) == 1 and "saved by 2 replicas, this stage has 3: replica 0 takes their sum" in notes[0]
    notes.clear()
    load_checkpoint(path, model, rng=False, log=notes.append)  # a plan that does not compress
    assert len(notes) == 1 and "error feedback of 4 parameter(s)" in notes[0] and "dropped" in notes[0]


def test_local_sgd_replicas_read_their_own_copy_or_start_from_the_average() -> None:
    """A checkpoint's per-replica copies (as two ranks of a local SGD stage write them): under the same replica
    count each replica reads its own; under another, or without local SGD, the average where they differ (said
    once), the copy where they agree; an entry kept only by name is read by name."""
    w = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])]  # the replicas' parameter: they differ
    step = torch.tensor(7.0)  # Adam's step: the same on both
    saved = {**Replica(0, 2).state({"model.w": w[0], "optim.w.step": step}),
             **Replica(1, 2).state({"model.w": w[1], "optim.w.step": step})}
    stored = {k: (tuple(v.shape), v.dtype) for k, v in saved.items()}
    held = ["model.w", "optim.w.step", "model.b"]
    for r in range(2):
        mine = Replica(r, 2)
        reads = replica_reads(stored, held, mine)
        assert set(reads) == {"model.w", "optim.w.step"}  # model.b: by name only
        assert list(reads["model.w"]) == [replica_key(r, 2, "model.w")]  # its own copy, nothing else
        got, notes = merge_replicas({e: {k: saved[k] for k in ks} for e, ks in reads.items()}, mine)
        assert torch.equal(got["model.w"], w[r]) and notes == []
    for mine in (Replica(0, 3), None):  # another replica count; a plan without local SGD
        reads = replica_reads(stored, held, mine)
        assert len(reads["model.w"]) == 2  # every saved replica's copy
        got, notes = merge_replicas({e: {k: saved[k] for k in ks} for e, ks in reads.items()}, mine)
        assert torch.equal(got["model.w"], torch.tensor([2.0, 3.5])) and torch.equal(got["optim.w.step"], step)
        assert len(notes) == 1 and "by 2 replicas" in notes[0] and "1 parameter, buffer and optimizer" in notes[0]
        assert ("replica 0 of 3" if mine else "does not run local SGD") in notes[0]


def test_prices() -> None:
    eth = cost_models.get_link("eth10")
    p = 400e6  # 100M fp32 gradients
    dense = sync_ms(p, 2, 0, False, eth, eth)
    top = compressed_sync_ms(p, 2, Compression.parse("topk:0.01"), eth, dtype_bytes=4, bytes_per_ms=1.5e9)
    psgd = compressed_sync_ms(p, 2, Compression.parse("powersgd:4"), eth, dtype_bytes=4, bytes_per_ms=1.5e9,
                              fraction=powersgd_fraction([10_000_000] * 10, 4))
    assert top < dense / 20 and psgd < dense / 20
    # the compute is there: a fast link pays less for the collective than for compressing
    nv = cost_models.get_link("nvlink3")
    assert compressed_sync_ms(p, 2, Compression.parse("topk:0.01"), nv, dtype_bytes=4, bytes_per_ms=1.5e9) > \
        sync_ms(p, 2, 0, False, nv, nv)
    assert math.isclose(local_sgd_sync_ms(p, 2, 16, eth) * 16, dense)
    assert powersgd_fraction([64 * 64, 64], 1) == pytest.approx((128 + 16) / (64 * 64 + 64))


def _two_hosts(gbps: float) -> Cluster:
    devs = (Device("g0", "A100-80GB", 80, host="a"), Device("g1", "A100-80GB", 80, host="b"))
    return Cluster(devices=devs, links=(Link("g0", "g1", gbps, 25.0),), name="two-hosts")


def test_the_solver_compresses_only_when_allowed_and_it_pays() -> None:
    # 8 layers of 50 MB of parameters and 20 MB outputs, 3 ms of compute each, two hosts over 10 GbE: a dense
    # all-reduce of 400 MB costs ~320 ms, so without compression the solver pipelines (sending activations);
    # with Top-K allowed, data parallelism syncs in a few ms and wins: the placement changes
    g = chain_graph([{"A100-80GB": (1.0, 2.0)}] * 8, param_bytes=50_000_000, activation_bytes=1_000_000,
                    output_bytes=20_000_000, batch_size=64)
    slow = _two_hosts(1.25)
    plain = solve(g, slow, solver="dp", microbatches=4)
    assert not any(st.compress for st in plain.stages) and len(plain.stages) == 2
    lines: list[str] = []
    allowed = solve(g, slow, solver="dp", microbatches=4, compress="topk:0.01", progress=lines.append)
    assert [(st.devices, st.compress) for st in allowed.stages] == [(("g0", "g1"), "topk:0.01")]
    assert allowed.predicted.step_ms < plain.predicted.step_ms
    assert any("compression topk:0.01 allowed: stage" in line for line in lines)
    assert simulate(allowed, g).step_ms == pytest.approx(allowed.predicted.step_ms)
    # over a link much faster than memory the dense all-reduce is cheaper than compressing: allowed, not taken
    # (at NVLink's 300 GB/s the model has Top-K's 6 passes over HBM, ~1.2 ms, just beat the ~1.3 ms all-reduce)
    fast = solve(g, _two_hosts(1e5), solver="dp", microbatches=4, compress="topk:0.01")
    assert not any(st.compress for st in fast.stages)
    assert CompressKind("topk") is CompressKind.TOPK


def test_show_and_report_name_them() -> None:
    from hpml_compile.explain import summary
    from hpml_compile.runtime.observe.monitor import StepMetrics
    from hpml_compile.runtime.observe.summary import format_summary, summarise

    g = chain_graph([{"cpu": (1.0, 2.0)}] * 4, param_bytes=4_000_000, batch_size=8)
    names = tuple(g.order)
    c = Cluster(devices=(Device("cpu0", "cpu", 4.0), Device("cpu1", "cpu", 4.0)), name="two")
    plan = Plan("toy", c, Schedule.ONE_F_ONE_B, 1, (Stage(0, ("cpu0", "cpu1"), names),))
    topk, plan, local = with_comm(plan, compress="topk:0.05"), plan, with_comm(plan, sync_every=4, sync_warmup=1)
    assert "gradients topk:0.05" in summary(topk, g, simulate(topk, g))
    assert "local SGD every 4 steps after 1" in summary(local, g, simulate(local, g))
    # what the runtime runs through shared memory (runtime.sync.shm): CPU replicas of one host, not a compressed stage
    assert "all-reduce through the host's shared memory" in summary(plan, g, simulate(plan, g))
    assert "shared memory" not in summary(topk, g, simulate(topk, g))
    zero1 = replace(plan, stages=(replace(plan.stages[0], zero=ZeroStage.OS),))
    assert "reduce-scatter and all-gather through the host's shared memory" in summary(zero1, g, simulate(zero1, g))
    apart = replace(plan, cluster=Cluster(devices=(Device("cpu0", "cpu", 4.0, host="a"),
                                                   Device("cpu1", "cpu", 4.0, host="b")), name="apart"))
    assert "shared memory" not in summary(apart, g, simulate(apart, g))

    def rows(sent: list[int]) -> dict[int, list[StepMetrics]]:  # 16 MiB dense
        return {r: [StepMetrics(step=i, rank=r, stage=0, replica=r, device="cpu", microbatches=1, samples=8,
                                step_ms=10.0, pipeline_ms=8.0, fwd_ms=3.0, bwd_ms=5.0, sync_bytes=s,
                                sync_dense_bytes=16 << 20) for i, s in enumerate(sent)] for r in range(2)}

    text = format_summary(summarise(topk, rows([(16 << 20) // 10] * 6), skip=2))
    assert "gradient sync, stage 0 (topk:0.05): 1.6 MiB per step per rank against 16.0 MiB uncompressed (10.0%)" \
        in text, text
    text = format_summary(summarise(local, rows([0, 0, 0, 16 << 20] * 2), skip=0))
    assert "(local SGD every 4): 4.0 MiB per step per rank against 16.0 MiB uncompressed (25.0%)" in text, text
    text = format_summary(summarise(zero1, rows([16 << 20] * 4), skip=1))  # a ZeRO stage's sync is no all-reduce
    assert "gradient sync, stage 0 (reduce-scatter, ZeRO-1): 16.0 MiB" in text and "all-reduce" not in text, text
    hier = {r: [replace(m, sync_intra_bytes=16 << 20, sync_inter_bytes=8 << 20, sync_flat_bytes=24 << 20)
                for m in ms] for r, ms in rows([16 << 20] * 4).items()}  # 2 hosts x 2 ranks, as the runtime counts
    text = format_summary(summarise(plan, hier, skip=1))
    assert ("hierarchical all-reduce, stage 0: 8.0 MiB between hosts + 16.0 MiB inside the host per step per rank; "
            "a flat ring: 24.0 MiB") in text and "(33.3% of it crosses the hosts now)" in text, text


def test_local_sgd_and_compression_unshard_what_the_solver_sharded() -> None:
    """The solver may pick ZeRO-1 for a replicated stage; --sync-every / --compress need ZeRO-0 there, and say
    so when it does not fit (found: ``compile gpt-mini --cluster local-cpu-2 --sync-every 4`` refused itself)."""
    from hpml_compile.driver import _unsharded
    from hpml_compile.testing import cluster_of

    g = chain_graph([{"cpu": (1.0, 2.0)}] * 4, param_bytes=50_000_000, activation_bytes=1_000_000,
                    output_bytes=1_000_000, batch_size=8)
    devices = ("d0", "d1")
    for memory_gib, fits in ((64.0, True), (0.7, False)):
        cluster = cluster_of(["cpu", "cpu"], memory_gib=memory_gib)
        sharded = Plan("toy", cluster, Schedule.ONE_F_ONE_B, 1,
                       (Stage(0, devices, tuple(g.order), zero=1),))
        sharded = annotate(sharded, g)[0]
        assert sharded.stages[0].predicted.memory_bytes < 0.7 * 2**30  # ZeRO-1 fits either device
        if fits:
            plan = with_comm(_unsharded(sharded, g, "float32", Options(sync_every=4)), sync_every=4)
            assert plan.stages[0].zero == 0 and plan.sync_every == 4
            assert plan.stages[0].predicted.memory_bytes > sharded.stages[0].predicted.memory_bytes
        else:
            with pytest.raises(OptionError, match=r"--sync-every 4 needs every replica of stage 0 .*ZeRO-0"):
                _unsharded(sharded, g, "float32", Options(sync_every=4))
