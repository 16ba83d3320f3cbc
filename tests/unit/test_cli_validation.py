"""Every option of ``run`` and ``plan`` is checked before any rank starts or any solver runs.

Each bad option must give exit status 2 and one line naming the option and its value, leave no run folder,
and never reach :func:`~hpml_compile.runtime.job.launcher.launch` or the supervisor: both are replaced here by
stand-ins that fail the test (and record what a good command line would have started).
"""

from __future__ import annotations

import dataclasses
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from hpml_compile import driver, models
from hpml_compile.cli import main
from hpml_compile.cluster import load_cluster
from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.errors import HpmlError, LaunchError, OptionError
from hpml_compile.ir import Profile
from hpml_compile.profile import profile, save_profile
from hpml_compile.recipe import ModelRecipe
from hpml_compile.runtime.job import launcher, supervisor
from hpml_compile.runtime.job.options import read_options
from hpml_compile.runtime.observe.runfolder import RunFolder
from hpml_compile.runtime.sync.comm import CommFault, CommOp
from hpml_compile.runtime.job.launcher import LaunchSpec, check_port, owns_run_dir, preflight, prepare_run_dir
from hpml_compile.trace import trace

STEPS = 20


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank build of gpt-tiny (ranks 0 and 1)."""
    out = tmp_path_factory.mktemp("opts") / "build"
    loaded = models.load("gpt-tiny", batch_size=4, seq_len=16)
    gm = trace(loaded.module, loaded.example_inputs)
    generate(gm, split_plan(gm, "gpt-tiny", 2, microbatches=2), out, recipe=ModelRecipe("gpt-tiny", 4, 16))
    return out


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What ``run`` would have started: launch specs and supervise calls, recorded instead of run."""
    seen: list[Any] = []
    monkeypatch.setattr(launcher, "launch", lambda spec: seen.append(spec))

    def fake_supervise(build_dir: Path, run_dir: Path, **kw: Any) -> list[dict[str, Any]]:
        seen.append(kw)
        return [{"event": "segment", "segment": 0}]

    monkeypatch.setattr(supervisor, "supervise", fake_supervise)
    monkeypatch.setattr(supervisor, "timings", lambda run_dir: [])
    return seen


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], started: list[Any], *needles: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert not started, f"ranks were started for {argv}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


BAD = [
    (["--slow", "1:x:10"], "--slow 1:x:10", "RANK:FACTOR:FROM_STEP"),
    (["--slow", "1:0:1"], "--slow 1:0:1", "FACTOR must be a number >= 1"),
    (["--slow", "1:nan:1"], "--slow 1:nan:1", "FACTOR"),
    (["--slow", "5:3:1"], "--slow 5:3:1", "0..1"),
    (["--slow", "1:3:21"], "--slow 1:3:21", "1..20"),
    (["--kill-at", "2:9"], "--kill-at 2:9", "got rank 9"),
    (["--kill-at", "21:1"], "--kill-at 21:1", "got step 21"),
    (["--kill-at", "0:1"], "--kill-at 0:1", "STEP must be 1 or more"),
    (["--hang-at", "3:2"], "--hang-at 3:2", "0..1"),
    (["--hang-at", "3"], "--hang-at 3", "STEP:RANK"),
    (["--inject-fault", "3:4:recv"], "--inject-fault 3:4:recv", "got rank 4"),
    (["--inject-fault", "3:1:nothing"], "--inject-fault 3:1:nothing", "STEP:RANK:"),
    (["--checkpoint-dir", "CK", "--checkpoint-every", "-2"], "--checkpoint-every -2",
     "(0: only at the end): a whole number, 0 or more"),
    (["--checkpoint-every", "5"], "--checkpoint-every 5", "--checkpoint-dir"),
    (["--checkpoint-dir", "CK", "--keep-checkpoints", "-1"], "--keep-checkpoints -1", "0: every one"),
    (["--steps", "0"], "--steps 0", "1 or more"),
    (["--steps", "-3"], "--steps -3", "1 or more"),
    (["--lr", "0"], "--lr 0.0", "finite number above 0"),
    (["--lr", "-0.1"], "--lr -0.1", "finite number above 0"),
    (["--lr", "nan"], "--lr nan", "finite number above 0"),
    (["--timeout", "0"], "--timeout 0.0", "above 0"),
    (["--timeout", "inf"], "--timeout inf", "finite"),
    (["--retries", "-1"], "--retries -1", "0 or more"),
    (["--nproc", "0"], "--nproc 0", "1 or more"),
    (["--nnodes", "0"], "--nnodes 0", "1 or more"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2", "0..1"),
    (["--max-restarts", "-1"], "--max-restarts -1", "0 or more"),
    (["--log-every", "0"], "--log-every 0", "1 or more"),
    (["--adapt", "--adapt-threshold", "0.5"], "--adapt-threshold 0.5", "above 1"),
    (["--adapt", "--adapt-patience", "0"], "--adapt-patience 0", "1 or more"),
    (["--adapt", "--adapt-cooldown", "-1"], "--adapt-cooldown -1", "0 or more"),
    (["--adapt", "--max-failures", "0"], "--max-failures 0", "1 or more"),
    (["--adapt", "--kill-at", "3:5"], "--kill-at 3:5", "0..1"),
    (["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", "localhost"], "localhost", "HOST:PORT"),
    (["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", "localhost:70000"], "localhost:70000", "1..65535"),
    (["--host-timeout", "3"], "--host-timeout 3.0", "a multi-host --adapt job"),
    (["--adapt", "--nnodes", "2", "--nproc", "1", "--host-timeout", "0"], "--host-timeout 0.0", "above 0"),
    (["--adapt", "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", "localhost:29400"], "--adapt --nnodes 2",
     "needs --node-rank R"),
    (["--compress", "gzip:1"], "--compress 'gzip:1'", "powersgd:RANK"),
    (["--compress", "topk:0.1"], "--compress topk:0.1", "no replicated stage"),
    (["--sync-every", "0"], "--sync-every must be an integer >= 1", "got 0"),
]


@pytest.mark.parametrize("extra,names,says", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_a_bad_option_is_refused_before_any_rank(build: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 started: list[Any], extra: list[str], names: str, says: str) -> None:
    extra = [str(tmp_path / "ck") if x == "CK" else x for x in extra]
    run = tmp_path / "run"
    _refused(["run", str(build), "--steps", str(STEPS), "--run-dir", str(run), *extra], capsys, started, names, says)
    assert not run.exists()


def test_good_options_reach_the_ranks_as_given(build: Path, tmp_path: Path, started: list[Any],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    ck = tmp_path / "ck"
    assert main(["run", str(build), "--steps", str(STEPS), "--run-dir", str(tmp_path / "run"), "--no-report",
                 "--checkpoint-dir", str(ck), "--checkpoint-every", "0", "--kill-at", f"{STEPS}:1",
                 "--slow", "0:1.5:1", "--inject-fault", "1:1:recv", "--retries", "0"]) == 0
    (spec,) = started
    opts = read_options(RunFolder(spec.run_dir))  # what every rank reads: run.json, written before the launch
    assert opts.checkpoint_every == 0 and opts.checkpoint_dir == ck and opts.retries == 0
    assert opts.faults.kills == ((STEPS, 1),) and opts.faults.slows == ((0, 1.5, 1),)
    assert opts.faults.comm == (CommFault(0, 1, CommOp.RECV),) and opts.steps == STEPS


def test_checkpoint_every_zero_means_only_at_the_end(build: Path, tmp_path: Path, started: list[Any],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "0: only at the end" in " ".join(capsys.readouterr().out.split())
    assert main(["run", str(build), "--adapt", "--checkpoint-every", "0", "--run-dir", str(tmp_path / "run"),
                 "--no-report"]) == 0
    assert started[0]["options"].checkpoint_every == 0  # not the default 5: 0 was asked for
    assert "checkpoints only at the end" in capsys.readouterr().out


@pytest.mark.parametrize("what", ["mistyped", "empty", "other"])
def test_resume_without_a_checkpoint_is_refused_before_any_rank(build: Path, tmp_path: Path, what: str,
                                                                capsys: pytest.CaptureFixture[str],
                                                                started: list[Any]) -> None:
    ck = tmp_path / "ck"
    if what != "mistyped":
        ck.mkdir()
    if what == "other":
        (ck / "notes.txt").write_text("not a checkpoint")
    says = {"mistyped": "does not exist", "empty": "is empty", "other": "notes.txt"}[what]
    _refused(["run", str(build), "--run-dir", str(tmp_path / "run"), "--checkpoint-dir", str(ck), "--resume"],
             capsys, started, "--resume", str(ck), says)
    assert not (tmp_path / "run").exists()


def _held_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_a_port_in_use_is_refused_wherever_this_host_listens(build: Path, tmp_path: Path, started: list[Any],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    s, port = _held_port()
    with s:
        t0 = time.monotonic()
        for node_rank in ("0", None):  # static rendezvous: node 0 listens; c10d: the endpoint's own host listens
            argv = ["run", str(build), "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", f"localhost:{port}",
                    "--run-dir", str(tmp_path / "run")] + (["--node-rank", node_rank] if node_rank else [])
            _refused(argv, capsys, started, f"port {port}", "already in use", "--rdzv-endpoint localhost:")
        assert time.monotonic() - t0 < 10 and not (tmp_path / "run").exists()
        with pytest.raises(LaunchError, match="several nodes on one host"):
            preflight(LaunchSpec(build, tmp_path, 1, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}"))
        with pytest.raises(LaunchError, match="already in use"):  # on any address of this host: the store takes all
            check_port(f"{socket.gethostname()}:{port}")
        preflight(LaunchSpec(build, tmp_path, 1, nnodes=2, node_rank=1, rdzv_endpoint=f"127.0.0.1:{port}"),
                  wait_s=1)  # node 1 joins: the port answers, so it goes on


def test_an_endpoint_that_does_not_answer_is_an_error_after_a_bounded_wait(tmp_path: Path) -> None:
    s, port = _held_port()
    s.close()  # nothing listens there now
    said: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=rf"nothing answers at --rdzv-endpoint 127.0.0.1:{port} after 1 s"):
        preflight(LaunchSpec(Path("b"), tmp_path, 1, nnodes=2, node_rank=1, rdzv_endpoint=f"127.0.0.1:{port}"),
                  wait_s=1, log=said.append)
    assert time.monotonic() - t0 < 5 and len(said) == 1 and "waiting up to 1 s" in said[0]
    with pytest.raises(LaunchError, match="cannot be found"):
        preflight(LaunchSpec(Path("b"), tmp_path, 1, nnodes=2, node_rank=1, rdzv_endpoint="no-such-host.invalid:29400"),
                  wait_s=1)


def test_a_reused_run_folder_keeps_the_earlier_runs(build: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    said: list[str] = []
    for k in range(3):
        prepare_run_dir(build, run, {"k": k}, log=said.append)
        (run / "metrics").mkdir()
        (run / "metrics" / "rank0.jsonl").write_text(f"run {k}\n")
        (run / "errors").mkdir()
    (run / "ck").mkdir()
    (run / "ck" / "step_1").mkdir()  # not the run's own: a checkpoint folder the user put there stays put
    prepare_run_dir(build, run, {"k": 3}, log=said.append)
    assert [(run / "earlier" / str(n) / "metrics" / "rank0.jsonl").read_text() for n in (1, 2, 3)] == \
        ["run 0\n", "run 1\n", "run 2\n"]
    assert '"k": 1' in (run / "earlier" / "2" / "run.json").read_text()
    assert not (run / "metrics").exists() and not (run / "errors").exists()  # the current run starts clean
    assert '"k": 3' in (run / "run.json").read_text() and (run / "ck" / "step_1").is_dir()
    assert len(said) == 3 and said[-1].endswith(str(run / "earlier" / "3"))
    fresh = tmp_path / "fresh"
    prepare_run_dir(build, fresh, {}, log=said.append)
    assert len(said) == 3 and not (fresh / "earlier").exists()
    # hosts of one job sharing the folder: only the rendezvous host moves an earlier run, before it listens
    prepare_run_dir(build, fresh, {}, log=said.append, keep_earlier=False)
    assert len(said) == 3 and not (fresh / "earlier").exists()
    spec = lambda **kw: LaunchSpec(build, fresh, 1, **kw)  # noqa: E731
    assert owns_run_dir(spec()) and owns_run_dir(spec(nnodes=2, node_rank=0, rdzv_endpoint="h:29400"))
    assert not owns_run_dir(spec(nnodes=2, node_rank=1, rdzv_endpoint="localhost:29400"))
    assert owns_run_dir(spec(nnodes=2, rdzv_endpoint="localhost:29400"))  # c10d: the endpoint's host
    assert not owns_run_dir(spec(nnodes=2, rdzv_endpoint="192.0.2.1:29400"))


def test_run_says_where_the_earlier_run_went(build: Path, tmp_path: Path, started: list[Any],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    for _ in range(2):
        assert main(["run", str(build), "--run-dir", str(run), "--no-report"]) == 0
    assert f"its files are now in {run / 'earlier' / '1'}" in capsys.readouterr().out
    assert (run / "earlier" / "1" / "run.json").is_file() and (run / "run.json").is_file()
    assert main(["run", str(build), "--adapt", "--run-dir", str(run), "--no-report"]) == 0  # segments from here on
    assert f"its files are now in {run / 'earlier' / '2'}" in capsys.readouterr().out
    assert not (run / "run.json").exists() and (run / "earlier" / "2" / "run.json").is_file()


# plan: microbatches and threads, before any solving


@pytest.fixture(scope="module")
def prof8() -> Profile:
    """A measured CPU profile of batch 8, at the thread count of local-cpu-2's ranks."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a shared machine: scaling warnings are not what is tested
        return profile(m, (torch.randn(8, 8),), repeats=1, warmup=0, progress=False,
                       threads=driver.local_threads(load_cluster("local-cpu-2")))


def _no_solving(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("the solver ran")
    monkeypatch.setattr(driver, "solve", refuse)


@pytest.mark.parametrize("m,best", [(16, 8), (3, 2), (5, 4)])
def test_plan_refuses_microbatches_that_split_rows_before_solving(prof8: Profile, tmp_path: Path, m: int, best: int,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _no_solving(monkeypatch)
    path = save_profile(prof8, tmp_path / "profile.json")
    for extra in ([], ["--compare"]):
        code = main(["plan", str(path), "--cluster", "local-cpu-2", "--microbatches", str(m), "-o",
                     str(tmp_path / "plan.json"), *extra])
        err = capsys.readouterr().err
        assert code == 2 and f"--microbatches) {m}" in err and "batch of 8 rows" in err, err
        assert f"largest valid count {'is' if m > 8 else 'below it is'} {best}" in err
        assert f"--microbatches {best}" in err and not (tmp_path / "plan.json").exists()
    with pytest.raises(OptionError, match="batch of 8 rows"):
        driver.plan(prof8, load_cluster("local-cpu-2"), driver.Options(solver="dp", microbatches=m))


def test_profile_records_its_threads_and_round_trips(prof8: Profile, tmp_path: Path) -> None:
    assert prof8.threads == driver.local_threads(load_cluster("local-cpu-2"))
    again = Profile.from_dict(prof8.to_dict())
    assert again.threads == prof8.threads and again == prof8
    meta = profile(torch.nn.Linear(4, 4, device="meta"), (torch.randn(2, 4, device="meta"),), progress=False)
    assert meta.threads is None  # nothing measured: no thread count in its times


def test_plan_refuses_a_profile_of_other_threads_for_local_cpu_ranks(prof8: Profile, tmp_path: Path) -> None:
    local = load_cluster("local-cpu-2")
    want = driver.local_threads(local)
    assert want is not None
    other = dataclasses.replace(prof8, threads=want + 3)
    with pytest.raises(HpmlError, match=rf"measured with {want + 3} torch thread.*with {want} thread\(s\) each.*"
                                        rf"--threads {want}"):
        driver.plan(other, local, driver.Options(solver="dp", microbatches=2))
    assert driver.plan(prof8, local, driver.Options(solver="dp", microbatches=2)).microbatches == 2
    driver.plan(other, load_cluster("hetero-4"), driver.Options(solver="uniform", microbatches=2))  # not local CPUs
    old = dataclasses.replace(prof8, threads=None)  # a file from before the field: warned about, then planned
    with pytest.warns(UserWarning, match="does not say how many torch threads"):
        assert driver.plan(old, local, driver.Options(solver="dp", microbatches=2)).microbatches == 2
    d = prof8.to_dict()
    del d["threads"]
    assert Profile.from_dict(d).threads is None
    with pytest.raises(HpmlError, match="threads"):
        Profile.from_dict({**prof8.to_dict(), "threads": 0})
