"""Checkpoints: saved by name, loaded under another split, whole after a crash mid-write, never running code,
named when damaged (the previous one used instead), and restoring RNG states so that dropout continues."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn

from hpml_compile.runtime.execute.checkpoint import (
    CheckpointError,
    latest,
    list_checkpoints,
    load_checkpoint,
    resume_from,
    save_checkpoint,
)


def _full() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 8, generator=g)).pow(2).mean().backward()
        opt.step()


def _stage(full: nn.Sequential, names: list[str]) -> nn.Module:
    """A 'stage': a module holding some of the full model's children under their original names."""
    torch.manual_seed(123)  # different initial values: loading must overwrite them
    return nn.ModuleDict({n: type(full[int(n)])(*( (full[int(n)].in_features, full[int(n)].out_features)
                                                     if isinstance(full[int(n)], nn.Linear) else ()))
                          for n in names})


def test_adam_state_regroups_by_name_under_another_split(tmp_path: Path) -> None:
    full = _full()
    opt = torch.optim.Adam(full.parameters(), lr=0.01)
    _train(full, opt, 3)
    save_checkpoint(tmp_path, 3, full, opt)
    stages = [_stage(full, ["0"]), _stage(full, ["2"])]
    opts = [torch.optim.Adam(s.parameters(), lr=0.01) for s in stages]
    for s, o in zip(stages, opts):
        assert load_checkpoint(latest(tmp_path), s, o)["step"] == 3
    # one more identical step: the split optimizers must update exactly like the full one
    x = torch.randn(16, 8)
    opt.zero_grad()
    full(x).pow(2).mean().backward()
    opt.step()
    for o in opts:
        o.zero_grad()
    stages[1]["2"](torch.tanh(stages[0]["0"](x))).pow(2).mean().backward()
    for o in opts:
        o.step()
    torch.testing.assert_close(stages[0]["0"].weight, full[0].weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(stages[1]["2"].bias, full[2].bias, rtol=0, atol=1e-6)


def test_keeps_the_last_n(tmp_path: Path) -> None:
    m = _full()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, m, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]


def test_missing_parameter_is_named(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, nn.Linear(2, 2))
    other = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"no 0.bias \(and 1 more\)"):
        load_checkpoint(latest(tmp_path), other)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "nothing", other)


def test_error_mid_write_leaves_previous_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _full()
    save_checkpoint(tmp_path, 1, m)
    import torch.distributed.checkpoint as dcp  # save_checkpoint imports it on first use and calls dcp.save

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", broken)
    with torch.no_grad():
        m[0].weight.add_(1.0)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, m)
    monkeypatch.undo()
    assert latest(tmp_path).name == "step_00000001"
    fresh = _full()
    load_checkpoint(latest(tmp_path), fresh)
    torch.testing.assert_close(fresh[0].weight, m[0].weight - 1.0)
    save_checkpoint(tmp_path, 3, m)  # the next save clears the remains of the failed one
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.dist
def test_process_killed_mid_write_leaves_previous_whole(tmp_path: Path) -> None:
    """A real crash: the writer is SIGKILLed after its shards are written, before the checkpoint is published."""
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(f"""
        import time, torch
        import hpml_compile.runtime.execute.checkpoint as ck
        m = torch.nn.Linear(512, 512)
        ck.save_checkpoint({str(tmp_path / 'ck')!r}, 1, m)
        torch.save(m.state_dict(), {str(tmp_path / 'ref.pt')!r})
        real = ck.write_json_atomic
        def slow(*a, **k):
            print("WRITING", flush=True)
            time.sleep(60)
            return real(*a, **k)
        ck.write_json_atomic = slow
        with torch.no_grad():
            m.weight.mul_(2)
        ck.save_checkpoint({str(tmp_path / 'ck')!r}, 2, m)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.time() + 120
    while "WRITING" not in (proc.stdout.readline() or "") and time.time() < deadline:
        pass
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    root = tmp_path / "ck"
    assert (root / "step_00000002.tmp").is_dir(), "the second save had started"
    assert latest(root).name == "step_00000001"
    m = nn.Linear(512, 512)
    load_checkpoint(latest(root), m)
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    torch.testing.assert_close(m.weight, ref["weight"])


# --- trust: loading never unpickles anything from the folder -------------------------------------------------


class _Planted:
    """Unpickling this touches ``marker``: what a crafted ``.metadata`` could do instead (run any code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return Path.touch, (self.marker,)


def _redigest(path: Path) -> None:
    """What an attacker does after editing a checkpoint: recompute the digests in meta.json."""
    import hashlib
    import json

    meta = json.loads((path / "meta.json").read_text())
    meta["files"] = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                     for p in sorted(path.iterdir()) if p.is_file() and p.name != "meta.json"}
    (path / "meta.json").write_text(json.dumps(meta))


def test_a_crafted_metadata_pickle_is_never_unpickled(tmp_path: Path) -> None:
    import pickle

    m = _full()
    path = save_checkpoint(tmp_path / "ck", 1, m)
    marker = tmp_path / "code_ran"
    (path / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    _redigest(path)  # the digests are no defence against whoever writes the folder: the JSON index is
    fresh = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    assert load_checkpoint(latest(tmp_path / "ck"), fresh)["step"] == 1
    assert not marker.exists(), "loading the checkpoint ran the code planted in .metadata"
    torch.testing.assert_close(fresh[0].weight, m[0].weight, rtol=0, atol=0)


def test_an_old_pickled_checkpoint_is_refused_not_unpickled(tmp_path: Path) -> None:
    """A checkpoint as the previous version wrote it: DCP's pickled .metadata, meta.json without a format."""
    import json
    import pickle

    import torch.distributed.checkpoint as dcp

    old = tmp_path / "ck" / "step_00000001"
    dcp.save({"model.weight": torch.ones(2, 2)}, checkpoint_id=str(old))
    (old / "meta.json").write_text(json.dumps({"step": 1, "world_size": 1}))
    marker = tmp_path / "code_ran"
    (old / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(CheckpointError, match="older version of hpml-compile.*cannot be loaded safely"):
        load_checkpoint(old, nn.Linear(2, 2, bias=False))
    assert not marker.exists()


def test_a_non_tensor_item_is_refused_by_name(tmp_path: Path) -> None:
    class Tagged(nn.Linear):
        def get_extra_state(self) -> dict[str, str]:
            return {"tag": "not a tensor"}

        def set_extra_state(self, state: object) -> None:
            pass

    with pytest.raises(CheckpointError, match=r"'model._extra_state' is a dict, not a tensor"):
        save_checkpoint(tmp_path, 1, Tagged(2, 2))


@pytest.mark.parametrize("edit, message", [
    (lambda ix: ix.update(version=9), r"version 9 is not known"),
    (lambda ix: ix.update(extra=1), r"expected the fields \['tensors', 'version'\]"),
    (lambda ix: ix["tensors"]["model.0.bias"]["chunks"][0].update(file="../../outside.distcp"),
     r"tensors.model.0.bias.chunks\[0\].file: '../../outside.distcp' is not one of the checkpoint's files"),
    (lambda ix: ix["tensors"]["model.0.bias"].update(dtype="Tensor"), r"dtype: 'Tensor' is not a torch dtype"),
    (lambda ix: ix["tensors"]["model.0.bias"]["chunks"][0].update(sizes=[9]), r"lie outside the tensor's size"),
])
def test_a_bad_index_is_named(tmp_path: Path, edit: Callable[[dict], None], message: str) -> None:
    import json

    path = save_checkpoint(tmp_path, 1, _full())
    index = json.loads((path / "index.json").read_text())
    edit(index)
    (path / "index.json").write_text(json.dumps(index))
    _redigest(path)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, _full())


# --- damage: digests, and falling back to the newest intact checkpoint ----------------------------------------


def _distcp(path: Path) -> Path:
    return sorted(path.glob("*.distcp"))[0]


@pytest.mark.parametrize("damage_it, why", [
    (lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]), r"\.distcp is truncated \(\d+ of \d+ bytes\)"),
    (lambda f: f.unlink(), r"\.distcp is missing"),
    (lambda f: f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:]), r"does not match its sha256"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, damage_it: Callable[[Path], None],
                                                                 why: str) -> None:
    m = _full()
    save_checkpoint(tmp_path, 1, m)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        m[0].weight.add_(1.0)
    newest = save_checkpoint(tmp_path, 2, m)
    damage_it(_distcp(newest))
    said: list[str] = []
    found = latest(tmp_path, log=said.append)
    assert found is not None and found.name == "step_00000001"
    assert len(said) == 1 and "step_00000002 is damaged" in said[0] and re.search(why, said[0]), said
    with pytest.warns(UserWarning, match="step_00000002 is damaged"):  # without a log: a warning
        latest(tmp_path)
    with pytest.raises(CheckpointError, match=f"step_00000002 is damaged: .*{why}"):
        load_checkpoint(newest, _full())
    fresh = _full()
    assert load_checkpoint(found, fresh)["step"] == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())


def test_resume_without_a_checkpoint_names_the_folder_and_what_it_holds(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"nothing to resume from in .*mistyped: the folder does not exist"):
        resume_from(tmp_path / "mistyped")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="the folder is empty"):
        resume_from(tmp_path / "empty")
    (tmp_path / "other" / "step_00000003.tmp").mkdir(parents=True)
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"no step_<N> checkpoint, only notes.txt, step_00000003.tmp "
                                              r"\(a .tmp folder is an unfinished save\)"):
        resume_from(tmp_path / "other")
    path = save_checkpoint(tmp_path / "bad", 1, _full())
    _distcp(path).write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"every checkpoint in it is damaged: step_00000001: .*truncated"):
        resume_from(tmp_path / "bad", log=lambda _line: None)


def test_the_worker_refuses_resume_without_a_checkpoint_and_negative_intervals(tmp_path: Path) -> None:
    from hpml_compile.runtime.job import worker

    from hpml_compile.errors import HpmlError
    from hpml_compile.runtime.job.options import ResumeMode, RunOptions

    strict = RunOptions(checkpoint_dir=tmp_path / "typo", resume=ResumeMode.REQUIRED)
    with pytest.raises(CheckpointError, match="typo: the folder does not exist"):
        worker.resume_point(strict, 0)
    lenient = RunOptions(checkpoint_dir=tmp_path / "typo", resume=ResumeMode.IF_ANY)
    assert worker.resume_point(lenient, 0) is None  # the supervisor's first segment: nothing written yet
    with pytest.raises(CheckpointError, match="--resume needs --checkpoint-dir"):
        worker.resume_point(RunOptions(resume=ResumeMode.REQUIRED), 0)
    assert RunOptions(checkpoint_every=0).checkpoint_every == 0
    with pytest.raises(HpmlError, match="checkpoint_every"):
        RunOptions(checkpoint_every=-2)


# --- RNG: a dropout model continues after a resume as an uninterrupted run ------------------------------------


def _dropout_run(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """Draws from every generator the checkpoint keeps: torch (batch, dropout), Python and NumPy (scales)."""
    import random

    import numpy as np

    losses = []
    for _ in range(steps):
        x = torch.randn(16, 8) * random.uniform(0.5, 1.5) * float(np.random.uniform(0.5, 1.5))
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _dropout_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))


def _seed_all(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_rng_states_make_a_resumed_dropout_run_equal_an_uninterrupted_one(tmp_path: Path) -> None:
    _seed_all(7)
    model = _dropout_model()
    straight = _dropout_run(model, torch.optim.Adam(model.parameters(), lr=0.01), 6)

    _seed_all(7)
    model = _dropout_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    first = _dropout_run(model, opt, 3)
    save_checkpoint(tmp_path, 3, model, opt)
    _seed_all(12345)  # a fresh process's generators, seeded otherwise
    model = _dropout_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    load_checkpoint(latest(tmp_path), model, opt)
    second = _dropout_run(model, opt, 3)
    assert first + second == straight


class _Tied(nn.Module):
    """An embedding and an output layer sharing one weight (as GPT's wte and lm_head do)."""

    def __init__(self, parts: tuple[str, ...] = ("emb", "mid", "head")) -> None:
        super().__init__()
        torch.manual_seed(0)
        emb, mid, head = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False)
        head.weight = emb.weight
        for name, m in (("emb", emb), ("mid", mid), ("head", head)):
            if name in parts:
                setattr(self, name, m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


def test_a_tied_parameters_optimizer_state_follows_it_to_a_stage_of_its_own(tmp_path: Path) -> None:
    """Saved by a plan holding both uses in one stage, loaded by a plan whose last stage holds only the output
    layer: that stage's copy gets the shared Adam state (it restarted from zero, and a resumed run diverged)."""
    full = _Tied()
    opt = torch.optim.Adam(full.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        full(torch.randint(0, 10, (8,))).pow(2).mean().backward()
        opt.step()
    save_checkpoint(tmp_path, 3, full, opt)
    last = _Tied(("head",))
    last_opt = torch.optim.Adam(last.parameters(), lr=0.01)
    load_checkpoint(latest(tmp_path), last, last_opt)
    want = opt.state[full.emb.weight]
    got = last_opt.state[last.head.weight]
    assert set(got) == set(want)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    torch.testing.assert_close(last.head.weight, full.emb.weight, rtol=0, atol=0)
