"""spawn_ranks: a deadlock between gloo ranks fails with the ranks named instead of hanging the test run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpml_compile.runtime.testing import RanksTimeout, spawn_ranks

pytestmark = pytest.mark.dist


def _each_waits_for_the_other(rank: int, world: int) -> None:
    dist.recv(torch.empty(1), src=1 - rank)  # both receive first: a cyclic wait


def test_a_deadlock_times_out_and_names_the_ranks_still_alive(tmp_path: Path) -> None:
    with pytest.raises(RanksTimeout, match=r"ranks \[0, 1\] of 2 were still running _each_waits_for_the_other "
                                           r"after 20 s"):
        spawn_ranks(_each_waits_for_the_other, 2, tmp_path, timeout_s=20)
