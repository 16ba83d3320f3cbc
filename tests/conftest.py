"""The whole suite plans with fixed host figures, so that its plans do not depend on the machine's minute.

``compile``, ``profile`` and ``demo`` read this host's measured gloo link and a CPU
rank's baseline memory from the host cache (:mod:`hpml_compile.profile.process`)
and measure them where the cache lacks them, which costs a fresh interpreter and
is not cached on a busy host. Under the suite they would be measured again and
again on CI's two busy cores, and each test's plan would follow that minute's
figures. So the suite points ``HPML_HOST_CACHE`` (inherited by every rank and CLI
subprocess) at a file of its own holding the catalog's loopback link and no
baseline: what the code used before any measurement. The tests of the
measurement itself (``tests/unit/test_process_memory.py``) set their own cache.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_DIR: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    from cost_models.catalog import get_link
    from hpml_compile.profile.process import host_key
    from hpml_compile.profile.timing import host_facts

    link = get_link("gloo-loopback")
    fixed = "the test suite's fixed figure"
    entry = {"link": {"gbps": link.gbps, "latency_us": link.latency_us, "shared": link.shared,
                      "source": f"{fixed} (the catalog's {link.name})"},
             "runtime_baseline": {"bytes": 0, "source": f"{fixed} (none)"}}
    where = tempfile.mkdtemp(prefix="hpml-tests-host-")
    _DIR.append(where)
    path = Path(where) / "host.json"
    path.write_text(json.dumps({host_key(host_facts()): entry}))
    os.environ["HPML_HOST_CACHE"] = str(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    for where in _DIR:
        shutil.rmtree(where, ignore_errors=True)
