"""Real architectures through the CLI on 2 gloo ranks: ``compile`` a TrainSpec file, ``run --steps 5``.

The model is the user's (no wrapper, no loss_fn, a dict dataset); the losses each run records equal a
plain loop over the same batches in this process, with the same optimizer.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from hpml_compile.cli import main
from hpml_compile.runtime.data import global_batch
from hpml_compile.runtime.monitor import read_metrics

from .archs import ITEMS, make, spec

pytestmark = [pytest.mark.dist, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:.*the model's blocks timed in sequence took:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*the whole-model pass took:UserWarning")]
CLI = [sys.executable, "-m", "hpml_compile"]
ARCHS_FILE = Path(__file__).with_name("archs.py")
STEPS = 5


def _reference(name: str) -> list[float]:
    s = spec(name)
    opt = s.optimizer(s.module.parameters())
    losses = []
    for step in range(STEPS):
        batch = default_collate([s.dataset[i] for i in global_batch(ITEMS, s.batch_size, s.seed, step)])
        opt.zero_grad()
        loss = s.module(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name,layout", [("gpt2", ["--solver", "uniform", "--microbatches", "2"]),
                                         ("bert_cls", ["--solver", "uniform", "--microbatches", "2"]),
                                         ("t5", ["--solver", "uniform", "--microbatches", "2"]),
                                         ("vit", ["--microbatches", "1"])])
def test_compile_then_run_on_two_ranks(name: str, layout: list[str], tmp_path: Path) -> None:
    build, run = tmp_path / "build", tmp_path / "run"
    assert main(["compile", f"{ARCHS_FILE}:{name}_spec", "--cluster", "local-cpu-2", *layout, "--repeats", "1",
                 "-o", str(build)]) == 0
    r = subprocess.run([*CLI, "run", str(build), "--steps", str(STEPS), "--run-dir", str(run)],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(run)
    losses = [m.loss for m in rows[max(rows)]]
    assert len(losses) == STEPS
    assert losses == pytest.approx(_reference(name), abs=2e-4)
    assert torch.tensor(losses).isfinite().all()


def test_launch_runs_the_users_own_loop(tmp_path: Path) -> None:
    script = Path(__file__).with_name("own_loop.py")
    r = subprocess.run([*CLI, "launch", "--nproc", "2", "--run-dir", str(tmp_path / "run"), str(script), "llama",
                        str(STEPS)], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    losses = [float(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("loss ")]
    assert losses == pytest.approx(_reference("llama"), abs=2e-4)


SAVED_SPEC = '''
import sys, dataclasses
sys.path.insert(0, {here!r})
from archs import spec


def saved():
    return dataclasses.replace(spec("gpt2"), weights={weights!r})
'''


def test_each_rank_loads_its_stage_from_saved_weights(tmp_path: Path) -> None:
    trained, _ = make("gpt2", seed=1)  # other weights than spec("gpt2")'s own (seed 0)
    trained.save_pretrained(tmp_path / "weights")
    (tmp_path / "saved.py").write_text(SAVED_SPEC.format(here=str(Path(__file__).parent),
                                                         weights=str(tmp_path / "weights")))
    build, run = tmp_path / "build", tmp_path / "run"
    assert main(["compile", f"{tmp_path / 'saved.py'}:saved", "--cluster", "local-cpu-2", "--solver", "uniform",
                 "--microbatches", "2", "--repeats", "1", "-o", str(build)]) == 0
    r = subprocess.run([*CLI, "run", str(build), "--steps", "1", "--run-dir", str(run)],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(run)
    s = spec("gpt2")
    batch = default_collate([s.dataset[i] for i in global_batch(ITEMS, s.batch_size, s.seed, 0)])
    assert rows[max(rows)][0].loss == pytest.approx(trained(**batch).loss.item(), abs=2e-5)
