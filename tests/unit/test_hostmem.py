"""keep_freed_memory: a loop that frees and re-allocates the same tensors stops faulting fresh pages in."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                 reason="glibc's malloc thresholds only exist on Linux with glibc"),
              pytest.mark.dist]  # each test measures a fresh Python process

# Ten 4 MiB tensors per "step", freed at its end: what a training step does with its activations.
_LOOP = """
import json, resource, sys, torch
from hpml_compile.hostmem import keep_freed_memory
applied = keep_freed_memory()
def step():
    ts = [torch.ones(1 << 20) for _ in range(10)]
    del ts
step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(json.dumps({"applied": applied, "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20}))
"""


def _run(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "HPML_KEEP"))}
    out = subprocess.run([sys.executable, "-c", _LOOP], env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_memory_is_reused_instead_of_faulted_in_again() -> None:
    tuned, default = _run(), _run(HPML_KEEP_FREED_MEMORY="0")
    assert tuned["applied"] and not default["applied"]
    pages = 10 * (4 << 20) // 4096
    # glibc's defaults fault a good part of the 40 MiB in again every step; kept memory faults far less.
    assert tuned["faults"] < 0.6 * default["faults"], (tuned, default)
    assert tuned["faults"] < 0.2 * pages, (tuned, default)


def test_the_users_own_malloc_settings_win() -> None:
    assert not _run(MALLOC_TRIM_THRESHOLD_="131072")["applied"]
    assert not _run(GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")["applied"]
