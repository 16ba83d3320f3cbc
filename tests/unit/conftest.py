"""Unit tier: a test that starts a process must say so with ``@pytest.mark.dist``.

Processes (torchrun and mp.spawn ranks, CLI subprocesses, notebook kernels) are
what make a run slow and what can hang it; ``-m "not dist"`` is the fast,
single-process tier only if every such test carries the mark. This hook
watches ``subprocess.Popen`` and ``multiprocessing`` starts during each test's
setup and call, and fails a test that started one without the mark, naming
what it started. Tools that libraries run for a moment (``ctypes.util.find_library``
runs ``ldconfig -p``, graphviz renders with ``dot``) are not the test's own
jobs and are let through.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Generator
from typing import Any

import pytest

_started: list[str] = []
# Programs that libraries run for a moment (tensorboard's import finds libraries with ldconfig, graphviz renders
# with dot, matplotlib lists fonts; the repository checks list tracked files with git): helpers, not jobs a test
# starts, so they need no mark.
_TOOLS = frozenset({"git", "ldconfig", "uname", "gcc", "cc", "ld", "objdump", "lscpu", "nvidia-smi", "dot", "fc-list"})


def _recording_popen_init(original: Any) -> Any:
    def init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
        if argv and os.path.basename(argv[0]) not in _TOOLS:
            _started.append(" ".join(argv))
        original(self, args, *rest, **kw)
    return init


def _recording_process_start(original: Any) -> Any:
    def start(self: multiprocessing.process.BaseProcess) -> None:
        _started.append(f"multiprocessing {self.name} ({getattr(self, '_target', None)})")
        original(self)
    return start


@pytest.fixture(scope="session", autouse=True)
def _watch_process_starts() -> Generator[None, None, None]:
    """Record every process started during the session (restored at its end)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(subprocess.Popen, "__init__", _recording_popen_init(subprocess.Popen.__init__))
    mp.setattr(multiprocessing.process.BaseProcess, "start",
               _recording_process_start(multiprocessing.process.BaseProcess.start))
    yield
    mp.undo()


def _check(item: pytest.Item, phase: str) -> None:
    if _started and item.get_closest_marker("dist") is None:
        what = "; ".join(dict.fromkeys(s[:120] for s in _started))
        _started.clear()
        pytest.fail(f"{item.nodeid} started a process during {phase} ({what}) but is not marked "
                    "@pytest.mark.dist: mark it (or move it to tests/dist/) so that -m 'not dist' stays "
                    "single-process", pytrace=False)
    _started.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    _started.clear()
    result = yield
    _check(item, "setup")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    _started.clear()
    result = yield
    _check(item, "the test")
    return result
