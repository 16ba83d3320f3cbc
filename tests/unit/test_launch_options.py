"""``launch``'s options across hosts: a bad combination is refused with one line naming it, before anything starts
(a good one is run for real by ``tests/dist/test_multihost_adapt.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpml_compile.cli import main
from hpml_compile.runtime.job import scriptlaunch

BAD = [
    (["--nnodes", "2"], "--nnodes 2 runs under --adapt"),
    (["--adapt", "--nnodes", "2", "--node-rank", "0", "--run-dir", "R"], "needs --node-rank R"),
    (["--adapt", "--nnodes", "2", "--rdzv-endpoint", "localhost:29400", "--run-dir", "R"], "needs --node-rank R"),
    (["--adapt", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "localhost:29400"], "--run-dir DIR"),
    (["--adapt", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "localhost:29400", "--run-dir", "R"],
     "--node-rank 2: expected this host's rank"),
    (["--adapt", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "localhost", "--run-dir", "R"],
     "expected HOST:PORT"),
    (["--node-rank", "0"], "--node-rank is for a job across hosts"),
    (["--adapt", "--rdzv-endpoint", "localhost:29400"], "--rdzv-endpoint is for a job across hosts"),
    (["--host-timeout", "3"], "--host-timeout is for a job across hosts"),
    (["--adapt", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "localhost:29400", "--run-dir", "R",
      "--host-timeout", "0"], "--host-timeout 0.0: expected seconds above 0"),
    (["--nnodes", "0"], "--nnodes 0: expected a whole number, 1 or more"),
    (["--nproc", "0"], "--nproc 0: expected a whole number, 1 or more"),
]


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What a good command line started (both launches replaced by stand-ins that record their arguments)."""
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(scriptlaunch, "launch_script", lambda *a, **k: seen.append({"one host": True, **k}) or 1)
    monkeypatch.setattr(scriptlaunch, "launch_hosts", lambda *a, **k: seen.append(k) or [{"event": "done"}])
    return seen


@pytest.mark.parametrize("args,said", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_combination_is_refused_before_anything_starts(args: list[str], said: str, tmp_path: Path,
                                                            started: list[dict[str, Any]],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    args = [str(tmp_path / "R") if a == "R" else a for a in args]
    assert main(["launch", *args, str(tmp_path / "train.py")]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1, err
    assert started == [] and not (tmp_path / "R").exists()

