"""``hpml-compile profile`` times this host's gloo link by default (two real processes) and records it; plans made
from that profile use it; ``--no-measure-links`` leaves it out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpml_compile import driver
from hpml_compile.cluster import load_cluster
from hpml_compile.profile import load_profile

pytestmark = [pytest.mark.dist, pytest.mark.slow]
CLI = [sys.executable, "-m", "hpml_compile"]


def _profile(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # a host cache of its own without a link (the suite's fixed link would stand in for the measurement); it keeps
    # the suite's other fixed figures, so that the link is all the profile measures (a rank's baseline memory and
    # bookkeeping, two more fresh interpreters, are tested in tests/unit/test_process_memory.py)
    cache = out.parent / "host.json"
    if not cache.exists():
        suite = json.loads(Path(os.environ["HPML_HOST_CACHE"]).read_text())
        cache.write_text(json.dumps({key: {what: v for what, v in entry.items() if what != "link"}
                                     for key, entry in suite.items()}))
    env = {**os.environ, "HPML_HOST_CACHE": str(cache)}
    r = subprocess.run([*CLI, "profile", "mlp-tiny", "--repeats", "1", "--warmup", "1", "--threads", "1", "-q", "-o",
                        str(out), *extra],
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, env=env)
    assert r.returncode == 0, r.stderr
    return r


def test_profile_measures_the_link_and_plans_use_it(tmp_path: Path) -> None:
    _profile(tmp_path / "p.json")
    prof = load_profile(tmp_path / "p.json")
    link = prof.devices["cpu"]["link"]
    assert link["gbps"] > 0 and link["latency_us"] >= 0 and link["source"].startswith("measured by profile")
    placed = driver.plan(prof, load_cluster("local-cpu-2"), driver.Options(solver="uniform", microbatches=1))
    assert [(x.a, x.b, x.gbps) for x in placed.cluster.links] == [("cpu0", "cpu1", link["gbps"])]
    _profile(tmp_path / "q.json", "--no-measure-links")
    assert "link" not in load_profile(tmp_path / "q.json").devices.get("cpu", {})
