"""The co-run probe: the blocks timed beside neighbours that run as ranks do (an all-reduce before each pass),
on the wall clock where the host is quiet, each round the mean pass with them over the median pass alone."""

from __future__ import annotations

import time

import psutil
import pytest
import torch

from hpml_compile.profile.corun import _Clocks, _group, _pass_totals, _ratio, _start_neighbours, _stop
from hpml_compile.trace import trace


def test_a_round_is_the_mean_pass_beside_the_neighbours_over_the_median_pass_alone() -> None:
    # forward, backward ms per pass: one of three passes beside the neighbours lost 6 ms of forward (a tail the
    # step pays); one pass alone was disturbed (20 ms), which the median alone leaves out
    together = [(10.0, 20.0), (10.0, 20.0), (16.0, 23.0)]
    before = [(10.0, 20.0)] * 3
    after = [(10.0, 20.0), (20.0, 20.0), (10.0, 20.0)]
    fwd, bwd = _ratio(together, before, after)
    assert fwd == pytest.approx(12.0 / 10.0) and bwd == pytest.approx(21.0 / 20.0)  # a median over passes: 1.0
    assert _ratio([(1.0, 0.0)], [(0.0, 0.0)], [(0.0, 0.0)]) == [1.0, 1.0]  # nothing timed alone: no slow-down


def test_the_cpu_times_are_split_by_pass_and_into_forwards_then_backwards() -> None:
    # two blocks; each pass times both forwards, then the one backward that runs (the second block has none)
    samples = [([1.0, 2.0], [5.0, 6.0]), ([3.0, 4.0], [0.0, 0.0])]
    cpu = [9.0, 9.0, 9.0] + [0.5, 1.5, 4.0] + [1.0, 2.0, 5.0]  # a warm-up pass, then the two timed ones
    wall, own = _pass_totals(samples, cpu, passes=2, warmup=1)
    assert wall == [(4.0, 5.0), (6.0, 6.0)]
    assert own == [(2.0, 4.0), (3.0, 5.0)]


def test_both_clocks_are_read_and_the_wall_clock_returned() -> None:
    clocks = _Clocks()
    ms = clocks.once(lambda: time.sleep(0.03))  # wall-clock time in which this process used no CPU
    assert ms >= 29.0 and clocks.cpu[-1] < 10.0


@pytest.mark.dist  # forks a neighbour and joins a gloo group with it (a few seconds)
def test_the_neighbours_meet_this_process_in_an_all_reduce_before_each_pass(tmp_path) -> None:
    gm = trace(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()), (torch.randn(4, 16),))
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    store = str(tmp_path / "store")
    pids = _start_neighbours(gm, (torch.randn(4, 16),), [["_0"], ["_1"]], 1, 60.0, store, 8)
    assert pids is not None and len(pids) == 1
    try:
        group = _group(store, 0, 2, 60.0)
        for k in range(3):  # each returns only once the neighbour took part: it runs a pass between them
            t = torch.ones(8)
            group.allreduce([t]).wait()
            assert torch.equal(t, torch.full((8,), k + 1.0))  # the neighbour's buffer holds the sums before
    finally:
        _stop(pids)
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= before  # none left behind
