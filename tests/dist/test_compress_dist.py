"""Gradient compression and local SGD on real gloo ranks: what they send, and what they cost in loss.

One spawned job (2 ranks) trains gpt-tiny, one stage replicated over both
ranks, from the same seed on the same batches (a learnable sequence: each
token is the previous one plus one), AdamW, under each option:

- plain data parallelism (the reference);
- ``--sync-every 1``: equal to plain data parallelism exactly (losses and
  parameters, bit for bit);
- local SGD with ``H = 4`` after 2 warm-up steps: the replicas' parameters
  differ between averages and agree right after each, the warm-up steps equal
  plain data parallelism exactly, and it converges;
- Top-K (ratio 0.1) with error feedback: converges, its loss after ``STEPS``
  steps no worse than the reference's after ``(1 - LAG) x STEPS`` steps
  (measured: about 4 steps behind of 24), sending ~20% of the dense bytes;
- PowerSGD (rank 4): its first two steps are torch's plain all-reduce (equal to
  the reference), then it converges within the same lag, sending less;
- a checkpoint halfway through the Top-K and PowerSGD runs, resumed in a new
  pipeline: the resumed half equals the uninterrupted run bit for bit (the
  error feedback, and PowerSGD's step count and factors, are in the
  checkpoint); resumed without the error feedback, Top-K's half differs (the
  control: the test can fail);
- a checkpoint of the local SGD run after step 12, between two averages (after
  steps 10 and 14) where the replicas differ, resumed in a new pipeline: each
  rank's losses and parameters of every later step equal the uninterrupted
  run's bit for bit (each replica reads its own copy); resumed without its
  replica's place (the control), both ranks start from the replicas' average,
  say so, and differ; loaded into one process (another replica count) the
  parameters are the two replicas' average.

The margin is a lag in steps, not in loss: error feedback delays what a
compressed step leaves out, so a compressed run follows the reference's curve
some steps behind early in training (the measured curves are in
benchmarks/comm_options/README.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hpml_compile import models
from hpml_compile.codegen import generate
from hpml_compile.testing import split_plan
from hpml_compile.runtime import Pipeline, spawn_ranks
from hpml_compile.runtime.execute.checkpoint import latest, load_checkpoint, save_checkpoint
from hpml_compile.trace import trace

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # five runs of 24 steps, five resumed halves: ~60 s on 2 cores

STEPS = 24
HALF = 12  # where the Top-K, PowerSGD and local SGD runs are checkpointed and resumed
CHECKPOINTED = ("topk", "powersgd", "local4")
RESUMED = {"topk-resumed": ("topk", True), "topk-no-feedback": ("topk", False), "powersgd-resumed": ("powersgd", True),
           "local4-resumed": ("local4", True), "local4-no-replica": ("local4", False)}
ROWS = 8  # per step, both replicas together
VOCAB = 32  # of gpt-tiny's 256 tokens: a few steps learn the sequence
LAG = 0.35  # a compressed run may trail the reference's loss curve by this share of the steps
OPTIONS: dict[str, dict[str, Any] | None] = {
    "dp": None,
    "sync1": {"sync_every": 1},
    "local4": {"sync_every": 4, "sync_warmup": 2},
    "topk": {"compress": "topk:0.1"},
    "powersgd": {"compress": "powersgd:4"},
}


def _model() -> models.LoadedModel:
    return models.load("gpt-tiny", batch_size=ROWS, seq_len=16, seed=0)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        start = torch.randint(0, VOCAB, (ROWS, 1), generator=g)
        x = (start + torch.arange(16)) % VOCAB  # learnable: the next token is this one plus one
        out.append((x, (x + 1) % VOCAB))
    return out


def _run(name: str, build: str, out: str, rank: int, report: dict[str, Any], opts: dict[str, Any] | None,
         resume: str | None = None, feedback: bool = True) -> None:
    loaded = _model()
    pipe = Pipeline.from_build(build, loaded.module, comm_options=opts,
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    first = 0
    notes: list[str] = []
    if resume is not None:  # a new pipeline, as a restarted job builds it, from the halfway checkpoint
        load_checkpoint(latest(resume), pipe.local_module(), pipe.optimizer,
                        feedback=pipe.feedback() if feedback else (), log=notes.append)
        pipe.steps_done = first = HALF
    losses, flats = [], []
    for step, (x, y) in enumerate(_batches()[first:], start=first):
        losses.append(pipe.step((x,), y, loaded.loss_fn).item())
        flats.append(torch.cat([p.detach().reshape(-1) for p in pipe.parameters()]).clone())
        if step + 1 == HALF and resume is None and name in CHECKPOINTED:
            save_checkpoint(Path(out) / f"ck-{name}", HALF, pipe.local_module(), pipe.optimizer,
                            feedback=pipe.feedback())
    torch.save(torch.stack(flats), Path(out) / f"{name}-rank{rank}.pt")
    report[name] = {"losses": losses, "sync_bytes": [m.sync_bytes for m in pipe.metrics],
                    "dense_bytes": [m.sync_dense_bytes for m in pipe.metrics], "notes": notes}


def _train(rank: int, world: int, build: str, out: str) -> None:
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    for name, opts in OPTIONS.items():
        _run(name, build, out, rank, report, opts)
    for name, (of, feedback) in RESUMED.items():
        _run(name, build, out, rank, report, OPTIONS[of], resume=str(Path(out) / f"ck-{of}"), feedback=feedback)
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("compress")
    loaded = _model()
    gm = trace(loaded.module, loaded.example_inputs)
    generate(gm, split_plan(gm, "gpt-tiny", 1, microbatches=1, replicas=[2]), tmp / "build")
    spawn_ranks(_train, 2, tmp, str(tmp / "build"), str(tmp))
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)], tmp


def _params(tmp: Path, name: str, rank: int) -> torch.Tensor:
    return torch.load(tmp / f"{name}-rank{rank}.pt", weights_only=True)


def _lag(ref: list[float], got: list[float]) -> int:
    """How many steps before its end the reference first reached the loss ``got`` ends with."""
    first = next((i for i, x in enumerate(ref) if x <= got[-1]), len(ref) - 1)
    return max(0, len(ref) - 1 - first)


def test_sync_every_1_is_plain_data_parallelism(runs: tuple[list[dict[str, Any]], Path]) -> None:
    reports, tmp = runs
    for r, rep in enumerate(reports):
        assert rep["sync1"]["losses"] == rep["dp"]["losses"]
        assert torch.equal(_params(tmp, "sync1", r), _params(tmp, "dp", r))
    dp = reports[0]["dp"]["losses"]
    assert dp[-1] < 0.5 * dp[0], f"the reference must learn the sequence for the margins to mean anything: {dp}"


def test_local_sgd_averages_every_h_steps(runs: tuple[list[dict[str, Any]], Path]) -> None:
    reports, tmp = runs
    a, b = _params(tmp, "local4", 0), _params(tmp, "local4", 1)
    dp = _params(tmp, "dp", 0)
    assert torch.equal(a[:2], dp[:2]), "the warm-up steps are plain data parallelism"
    for step in range(2, STEPS):  # local from step 2; averaged after steps 5, 9, 13, ... (every 4th local step)
        averaged = (step - 2 + 1) % 4 == 0
        if averaged:
            torch.testing.assert_close(a[step], b[step], rtol=0, atol=1e-6)
        else:
            assert not torch.allclose(a[step], b[step]), f"step {step}: the replicas step on their own gradients"
    local = reports[0]["local4"]
    assert _lag(reports[0]["dp"]["losses"], local["losses"]) <= LAG * STEPS
    assert local["sync_bytes"][5] == local["dense_bytes"][5]  # an average: the parameters, as many bytes
    assert local["sync_bytes"][3] == 0 and local["sync_bytes"][0] == local["dense_bytes"][0]


@pytest.mark.parametrize("name, most", [("topk", 0.21), ("powersgd", 0.5)])
def test_compression_converges_within_the_margin(runs: tuple[list[dict[str, Any]], Path], name: str,
                                                 most: float) -> None:
    reports, tmp = runs
    ref, got = reports[0]["dp"]["losses"], reports[0][name]["losses"]
    assert got == reports[1][name]["losses"]  # every replica steps the same sum
    torch.testing.assert_close(_params(tmp, name, 0), _params(tmp, name, 1), rtol=0, atol=0)
    assert got[-1] < 0.5 * got[0], f"{name} does not converge: {got}"
    lag = _lag(ref, got)
    assert lag <= LAG * STEPS, f"{name}: final loss {got[-1]:.4f}, {lag} steps behind the uncompressed {ref}"
    sent, dense = reports[0][name]["sync_bytes"][-1], reports[0][name]["dense_bytes"][-1]
    assert 0 < sent <= most * dense, f"{name} sent {sent} of {dense} bytes"
    if name == "powersgd":  # torch's hook runs plain all-reduce for its first two steps
        assert got[:2] == ref[:2]


def test_a_resumed_run_equals_the_uninterrupted_one_with_its_error_feedback(
        runs: tuple[list[dict[str, Any]], Path]) -> None:
    reports, tmp = runs
    for r, rep in enumerate(reports):
        for of in ("topk", "powersgd"):
            assert rep[f"{of}-resumed"]["losses"] == rep[of]["losses"][HALF:], (r, of)
            assert torch.equal(_params(tmp, f"{of}-resumed", r), _params(tmp, of, r)[HALF:]), (r, of)
        # the control: without its error the resumed Top-K run leaves the uninterrupted one
        assert rep["topk-no-feedback"]["losses"][0] == rep["topk"]["losses"][HALF]  # the same parameters to start
        assert rep["topk-no-feedback"]["losses"] != rep["topk"]["losses"][HALF:]
        assert not torch.equal(_params(tmp, "topk-no-feedback", r), _params(tmp, "topk", r)[HALF:])


def test_local_sgd_resumed_between_averages_equals_the_uninterrupted_run(
        runs: tuple[list[dict[str, Any]], Path]) -> None:
    reports, tmp = runs
    assert not torch.allclose(_params(tmp, "local4", 0)[HALF - 1], _params(tmp, "local4", 1)[HALF - 1]), \
        "the checkpoint must be taken where the replicas differ"
    for r, rep in enumerate(reports):
        assert rep["local4-resumed"]["losses"] == rep["local4"]["losses"][HALF:], r
        assert torch.equal(_params(tmp, "local4-resumed", r), _params(tmp, "local4", r)[HALF:]), r
        assert rep["local4-resumed"]["notes"] == []
        # the control: without its replica's place, a rank starts from the replicas' average, and says so
        assert len(rep["local4-no-replica"]["notes"]) == 1 and "their average" in rep["local4-no-replica"]["notes"][0]
        assert rep["local4-no-replica"]["losses"] != rep["local4"]["losses"][HALF:], r
    # ... the same average on both ranks: after the next average (step 14) they agree as the uninterrupted ones do
    a, b = _params(tmp, "local4-no-replica", 0), _params(tmp, "local4-no-replica", 1)
    assert not torch.equal(a[0], b[0])
    torch.testing.assert_close(a[13 - HALF], b[13 - HALF], rtol=0, atol=1e-6)


def test_local_sgd_checkpoint_under_another_replica_count_averages(runs: tuple[list[dict[str, Any]], Path]) -> None:
    """One process (one replica, no local SGD): the replicas' average of every parameter, said once."""
    _, tmp = runs
    loaded = _model()
    notes: list[str] = []
    meta = load_checkpoint(latest(tmp / "ck-local4"), loaded.module, rng=False, log=notes.append)
    assert meta["step"] == HALF
    got = torch.cat([p.detach().reshape(-1) for p in loaded.module.parameters()])
    a, b = _params(tmp, "local4", 0)[HALF - 1], _params(tmp, "local4", 1)[HALF - 1]
    assert got.shape == a.shape
    torch.testing.assert_close(got, (a.double() + b.double()).div(2).float(), rtol=0, atol=0)
    assert not torch.equal(got, a) and not torch.equal(got, b)
    assert len(notes) == 1 and "by 2 replicas" in notes[0] and "does not run local SGD" in notes[0], notes
