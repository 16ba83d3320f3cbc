"""Per-rank step events on two gloo ranks: every forward, backward, message and collective, on one clock, kept compactly.

One spawn trains gpt-tiny for 12 steps on a 2-stage 1F1B build (4
microbatches; the tied embedding adds a gradient all-reduce over both ranks)
with a run folder; the tests read what the ranks wrote there.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from hpml_compile import models
from hpml_compile.cli import main
from hpml_compile.codegen import generate
from hpml_compile.codegen.testing import split_plan
from hpml_compile.plan import Schedule
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.runtime.events import read_events
from hpml_compile.runtime.monitor import read_metrics
from hpml_compile.trace import trace

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, MICRO = 12, 4


def _model() -> models.LoadedModel:
    return models.load("gpt-tiny", batch_size=8, seq_len=16, seed=0)


def _worker(rank: int, world: int, build_dir: str, run_dir: str) -> None:
    torch.set_num_threads(1)
    loaded = _model()
    pipe = Pipeline.from_build(build_dir, loaded.module, run_dir=run_dir, tensorboard=False,
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    for _ in range(STEPS):
        pipe.step(loaded.example_inputs, loaded.example_targets, loaded.loss_fn)
    assert pipe.events is not None
    Path(run_dir, f"offset{rank}.json").write_text(json.dumps(pipe.events.offset))
    pipe.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("events")
    loaded = _model()
    gm = trace(loaded.module, loaded.example_inputs)
    generate(gm, split_plan(gm, "gpt-tiny", 2, microbatches=MICRO, schedule=Schedule.ONE_F_ONE_B), tmp / "build")
    spawn_ranks(_worker, 2, tmp, str(tmp / "build"), str(tmp / "run"))
    shutil.copy(tmp / "build" / "plan.json", tmp / "run" / "plan.json")  # as `hpml-compile run` does
    return tmp / "run"


def test_every_step_kept_has_each_microbatch_message_and_collective(run: Path) -> None:
    ev = read_events(run)
    assert sorted(ev) == [0, 1]
    for rank, steps in ev.items():
        # compact: the first 3 steps, every 10th, and the last 8 (steps 4..11); step 3 is not kept
        assert sorted(steps) == [0, 1, 2, *range(4, STEPS)], (rank, sorted(steps))
        for s in steps.values():
            kinds = [e[0] for e in s.events]
            assert sorted(e[4] for e in s.events if e[0] == "F") == list(range(MICRO)), (rank, s.step, kinds)
            assert sorted(e[4] for e in s.events if e[0] == "B") == list(range(MICRO)), (rank, s.step, kinds)
            want = "SEND" if rank == 0 else "RECV"  # activations forward; their gradients come back
            assert kinds.count(want) >= MICRO and kinds.count("SEND") and kinds.count("RECV"), kinds
            assert kinds.count("ALLREDUCE") == 1 and kinds.count("OPT") == 1, kinds  # the tied embedding's sync
            assert all(e[2] >= 0 for e in s.events)


def test_each_send_has_its_receive_after_it_on_the_common_clock(run: Path) -> None:
    ev = read_events(run)
    offsets = [json.loads((run / f"offset{r}.json").read_text()) for r in (0, 1)]
    assert offsets[0] == 0.0 and abs(offsets[1]) < 0.05, offsets  # one host: one monotonic clock
    matched = 0
    for step in ev[0]:
        for src, dst in ((0, 1), (1, 0)):
            sends = {(e["tag"]): e for e in ev[src][step].spans() if e["kind"] == "SEND"}
            recvs = {(e["tag"]): e for e in ev[dst][step].spans() if e["kind"] == "RECV"}
            assert sends.keys() == recvs.keys(), (step, src, sorted(sends), sorted(recvs))
            for tag, s in sends.items():
                r = recvs[tag]
                assert s["peer"] == dst and r["peer"] == src and s["bytes"] == r["bytes"] > 0
                assert r["end"] >= s["start"] - 0.005, (step, tag, s, r)  # a message arrives after it was sent
                matched += 1
    assert matched >= len(ev[0]) * 2 * MICRO


def test_rows_record_the_host_load(run: Path) -> None:
    rows = read_metrics(run)
    for rs in rows.values():
        assert len(rs) == STEPS
        for m in rs:
            assert m.host and 0.0 <= m.steal <= 1.0 and 0.0 <= m.others_load <= 1.0
            assert 0.0 < m.cpu_util < 4.0, m  # one torch thread per rank: about one core at most, plus gloo


def _trace_processor_shell() -> str | None:
    """A trace_processor_shell that is already here (the perfetto package downloads one on first use)."""
    found = os.environ.get("PERFETTO_TRACE_PROCESSOR") or shutil.which("trace_processor_shell")
    cached = sorted((Path.home() / ".local/share/perfetto/prebuilts").glob("trace_processor_shell*"))
    cached = [p for p in cached if not p.name.endswith(".tmp") and os.access(p, os.X_OK)]
    return found or (str(cached[-1]) if cached else None)


def _nested(slices: list[dict]) -> bool:
    """Whether the slices of one track nest properly (each inside the one open, or after it)."""
    stack: list[float] = []
    for e in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
        while stack and e["ts"] >= stack[-1] - 1e-6:
            stack.pop()
        if stack and e["ts"] + e["dur"] > stack[-1] + 1e-6:
            return False
        stack.append(e["ts"] + e["dur"])
    return True


def test_report_trace_has_a_track_per_rank_and_a_flow_per_message(run: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trace.json"
    assert main(["report", str(run), "--trace", str(out), "--no-export"]) == 0
    trace = json.loads(out.read_text())
    ev = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0: stage 0 on cpu0", 1: "rank 1: stage 1 on cpu1"}, names
    slices = [e for e in ev if e["ph"] == "X"]
    for rank in (0, 1):
        mine = [e for e in slices if e["pid"] == rank]
        assert mine and all(e["tid"] == rank and e["dur"] >= 0 and e["ts"] >= 0 for e in mine)
        assert _nested(mine), f"rank {rank}: slices overlap without nesting"
    sends = [e for e in slices if e["cat"] == "SEND"]
    starts = {e["id"]: e for e in ev if e["ph"] == "s"}
    ends = {e["id"]: e for e in ev if e["ph"] == "f"}
    assert len(sends) == len(starts) == len(ends) == trace["otherData"]["messages"] > 0
    assert trace["otherData"]["unmatched"] == 0
    for i, s in starts.items():
        f = ends[i]
        assert f["bp"] == "e" and s["pid"] != f["pid"]
        # each end of the arrow lies inside a SEND on the sender's track and a RECV on the receiver's
        assert any(x["cat"] == "SEND" and x["pid"] == s["pid"] and x["ts"] <= s["ts"] <= x["ts"] + x["dur"]
                   for x in slices)
        assert any(x["cat"] == "RECV" and x["pid"] == f["pid"] and x["ts"] <= f["ts"] <= x["ts"] + x["dur"]
                   for x in slices)
    other = tmp_path / "mine.json"
    other.write_text("{}")
    capsys.readouterr()
    assert main(["report", str(run), "--trace", str(other), "--no-export"]) == 2
    assert "mine.json exists and is not a trace hpml-compile wrote" in capsys.readouterr().err
    assert other.read_text() == "{}"


def test_trace_loads_in_perfetto_trace_processor(run: Path, tmp_path: Path) -> None:
    pytest.importorskip("perfetto.trace_processor", reason="the perfetto package is not installed")
    shell = _trace_processor_shell()
    if shell is None:
        pytest.skip("perfetto's trace processor downloads its trace_processor_shell binary on first use, and this "
                    "machine cannot reach its host; set PERFETTO_TRACE_PROCESSOR to a trace_processor_shell to run "
                    "this (the trace's structure is checked by the test above)")
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    out = tmp_path / "trace.json"
    assert main(["report", str(run), "--trace", str(out), "--no-export"]) == 0
    sends = sum(1 for e in json.loads(out.read_text())["traceEvents"] if e.get("cat") == "SEND")
    tp = TraceProcessor(trace=str(out), config=TraceProcessorConfig(bin_path=shell))
    try:
        ranks = {r.pid for r in tp.query("select distinct process.pid as pid from thread_track "
                                         "join thread using(utid) join process using(upid)")}
        flows = tp.query("select count(*) as n from flow join slice s on s.id = flow.slice_out "
                         "join slice r on r.id = flow.slice_in where s.category = 'SEND' and r.category = 'RECV'")
        assert ranks == {0, 1}
        assert next(iter(flows)).n == sends
    finally:
        tp.close()


def test_per_rank_traces_load_in_holistic_trace_analysis(run: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from hta.trace_analysis import TraceAnalysis

    folder = tmp_path / "traces"
    assert main(["report", str(run), "--trace-dir", str(folder), "--no-export"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.json", "rank1.json"]
    analysis = TraceAnalysis(trace_dir=str(folder))
    assert sorted(analysis.t.traces) == [0, 1], "HTA tells the ranks apart by their distributedInfo"
    kept = read_events(run)
    for rank, df in analysis.t.traces.items():
        names = analysis.t.symbol_table.get_sym_table()
        got = [names[i] for i in df["name"]]
        # a ProfilerStep per kept step is an HTA iteration (HTA leaves out the last, as a profiler's last step is
        # often cut short), with every recorded forward of those steps
        steps = sorted(kept[rank])[:-1]
        assert [int(i) for i in sorted(analysis.t.get_iterations(rank))] == steps
        want_f = sum(1 for s in steps for e in kept[rank][s].events if e[0] == "F")
        assert sum(1 for n in got if n.startswith("F") and n[1:].isdigit()) == want_f
    # a folder holding someone else's file is refused and left as it was
    other = tmp_path / "theirs"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    capsys.readouterr()
    assert main(["report", str(run), "--trace-dir", str(other), "--no-export"]) == 2
    assert "did not write" in capsys.readouterr().err and (other / "notes.txt").read_text() == "keep"
