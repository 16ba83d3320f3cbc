"""spawn_ranks: a deadlock between gloo ranks fails with the ranks named instead of hanging the test run; ranks
forked from its fork server see the caller's environment and working directory of each call, as spawned ones did."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpml_compile.runtime.job.spawn import RanksTimeout, spawn_ranks

pytestmark = pytest.mark.dist


def _each_waits_for_the_other(rank: int, world: int) -> None:
    dist.recv(torch.empty(1), src=1 - rank)  # both receive first: a cyclic wait


def test_a_deadlock_times_out_and_names_the_ranks_still_alive(tmp_path: Path) -> None:
    with pytest.raises(RanksTimeout, match=r"ranks \[0, 1\] of 2 were still running _each_waits_for_the_other "
                                           r"after 10 s"):
        spawn_ranks(_each_waits_for_the_other, 2, tmp_path, timeout_s=10)


def _report_where(rank: int, world: int, out: str) -> None:
    Path(out, f"rank{rank}.txt").write_text(f"{os.environ.get('HPML_TEST_SPAWN_MARK')}\n{os.getcwd()}\n{os.getppid()}")


def test_each_call_passes_the_callers_environment_and_folder_to_the_forked_ranks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPML_TEST_SPAWN_MARK", raising=False)
    spawn_ranks(_report_where, 1, tmp_path, str(tmp_path))  # the fork server runs from here on, if not before
    assert Path(tmp_path, "rank0.txt").read_text().split("\n")[0] == "None"
    # changed after the server started: a rank forked from it must still see the values of this call
    monkeypatch.setenv("HPML_TEST_SPAWN_MARK", "second call")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    spawn_ranks(_report_where, 2, tmp_path, str(tmp_path))
    for rank in range(2):
        mark, cwd, parent = Path(tmp_path, f"rank{rank}.txt").read_text().split("\n")
        assert (mark, cwd) == ("second call", str(tmp_path / "here")), rank
        assert int(parent) != os.getpid(), "forked by the fork server, not by the test process"
