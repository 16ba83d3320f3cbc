"""Checkpoints: saved by name, loaded under another split, whole after a crash mid-write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from hpml_compile.runtime.checkpoint import CheckpointError, latest, list_checkpoints, load_checkpoint, save_checkpoint


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
    import hpml_compile.runtime.checkpoint as ck

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ck.dcp, "save", broken)
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
        import hpml_compile.runtime.checkpoint as ck
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
