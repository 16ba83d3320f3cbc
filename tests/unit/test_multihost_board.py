"""The job's store across hosts (``runtime/job/hosts.py``), on a real TCPStore on localhost, two hosts in threads.

- a host whose run folder is not host 0's is refused before anything starts, naming both folders;
- host 0's decisions reach the other host, and a host that stops beating is lost after the silence allowed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from hpml_compile.errors import SupervisorError
from hpml_compile.runtime.job.hosts import JobBoard, check_shared
from hpml_compile.runtime.job.launcher import free_port
from hpml_compile.runtime.job.multihost import _still_lead, claim_lead
from hpml_compile.runtime.observe.runfolder import RunFolder


def test_a_run_folder_that_is_not_shared_is_refused(tmp_path: Path) -> None:
    endpoint = f"localhost:{free_port()}"
    lead = JobBoard(endpoint, host=0, nnodes=2, beat_s=0.05)
    other = JobBoard(endpoint, host=1, nnodes=2, beat_s=0.05)
    try:
        check_shared(lead, tmp_path / "shared")
        check_shared(other, tmp_path / "shared", wait_s=5)  # the same folder: accepted
        with pytest.raises(SupervisorError, match=r"--run-dir .*elsewhere on host 1 is not the folder host 0 writes"):
            check_shared(other, tmp_path / "elsewhere", wait_s=5)
    finally:
        other.close()
        lead.close()


def test_decisions_reach_the_other_host_and_a_silent_host_is_lost(tmp_path: Path) -> None:
    endpoint = f"localhost:{free_port()}"
    lead = JobBoard(endpoint, host=0, nnodes=2, beat_s=0.05, lost_after_s=0.5)
    other = JobBoard(endpoint, host=1, nnodes=2, beat_s=0.05, lost_after_s=0.5)
    try:
        got: list[dict] = []
        t = threading.Thread(target=lambda: got.append(other.wait(lambda: other.read_go(3), [0], 10, what="go")))
        t.start()
        lead.publish_go(3, {"hosts": [0, 1], "nproc": [1, 1]})
        t.join(10)
        assert got == [{"hosts": [0, 1], "nproc": [1, 1]}]
        other.post_end(3, {"ok": True})
        assert lead.read_end(3, 1) == {"ok": True} and lead.read_end(3, 0) is None
        live = lead.watcher()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # host 1 beats: never lost
            assert not live.lost(1)
            time.sleep(0.05)
        other.close()  # host 1 stops beating
        time.sleep(0.2)
        assert not live.lost(1)  # not yet: silent for less than 0.5 s since it was last seen beating
        deadline = time.monotonic() + 5
        while not live.lost(1):
            assert time.monotonic() < deadline, "a silent host was never found lost"
            time.sleep(0.05)
        with pytest.raises(SupervisorError, match="host 1 was lost"):
            lead.wait(lambda: lead.read_end(4, 1), [1], 5, what="host 1's end")
    finally:
        other.close()
        lead.close()


def test_an_old_lead_stops_once_another_host_has_taken_the_decisions_over(tmp_path: Path) -> None:
    run = RunFolder(tmp_path)
    claim_lead(run, "host0:29400")
    _still_lead(run, "host0:29400")  # the lead named: goes on
    claim_lead(run, "host1:41000")  # a host that took over after host 0 fell silent
    with pytest.raises(SupervisorError, match="another host took this job's decisions over \\(its store at "
                                              "host1:41000\\)"):
        _still_lead(run, "host0:29400")
    _still_lead(run, "host1:41000")
