"""A model with dropout trains the same way twice from the same seed, and a resumed run goes on like an uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpml_compile.cli import main
from hpml_compile.runtime.observe.monitor import read_metrics

# The build is compiled in this process, where profiling's notes on a busy machine's timing (which a CLI
# subprocess kept to its own stderr) would fill the summary: they are about the host, not what is tested here.
QUIET_PROFILE = [pytest.mark.filterwarnings("ignore:.*the model's blocks timed in sequence took:UserWarning"),
                 pytest.mark.filterwarnings("ignore:.*the whole-model pass took:UserWarning")]
pytestmark = [pytest.mark.dist, *QUIET_PROFILE]

MODEL = '''
import torch

def factory():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.3), torch.nn.ReLU(),
                            torch.nn.Linear(64, 64), torch.nn.Dropout(0.3), torch.nn.Linear(64, 4))
    return m, (torch.randn(8, 16),)
'''


def _run(build: Path, run: Path, *extra: str) -> list[float]:
    # in this process, as compile: a CLI subprocess would import torch and the package once more before it starts
    # the ranks (which are processes of their own either way, each seeded from the build)
    assert main(["run", str(build), "--run-dir", str(run), "--no-report", "--no-tensorboard", *extra]) == 0
    return [m.loss for m in read_metrics(run)[0]]


def test_dropout_reproduces_and_resumes(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(MODEL)
    build = tmp_path / "build"
    # compiled in this process (a CLI subprocess would import torch once more); the runs are the ranks' business,
    # and their losses, not the plan's predicted times, are checked: the blocks' co-run slow-down is not timed
    assert main(["compile", f"{tmp_path / 'm.py'}:factory", "--cluster", "local-cpu-2", "--solver", "uniform",
                 "--microbatches", "2", "--repeats", "1", "--no-corun", "-o", str(build)]) == 0
    first = _run(build, tmp_path / "a", "--steps", "6")
    ck = tmp_path / "ck"  # a second run of the first 3 steps, checkpointed, then resumed to the end
    head = _run(build, tmp_path / "c", "--steps", "3", "--checkpoint-dir", str(ck), "--checkpoint-every", "3")
    tail = _run(build, tmp_path / "d", "--steps", "6", "--checkpoint-dir", str(ck), "--resume")
    assert len(first) == 6 and head == first[:3]  # bitwise: same seed, same masks
    assert tail == first[3:]  # the RNG states came back with the checkpoint
