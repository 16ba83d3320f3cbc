"""Real architectures through the CLI on 2 gloo ranks: ``compile`` a TrainSpec file, ``run --steps 5``.

The model is the user's (no wrapper, no loss_fn, a dict dataset); the losses each run records equal a
plain loop over the same batches in this process, with the same optimizer (gpt2's from weights saved with
``save_pretrained``, which each rank loads for its own stage).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from hpml_compile.cli import main
from hpml_compile.runtime.execute.data import global_batch
from hpml_compile.runtime.observe.monitor import read_metrics

from .archs import ITEMS, make, spec

pytestmark = [pytest.mark.dist, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:.*the model's blocks timed in sequence took:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*the whole-model pass took:UserWarning")]
CLI = [sys.executable, "-m", "hpml_compile"]
ARCHS_FILE = Path(__file__).with_name("archs.py")
STEPS = 5


def _reference(name: str, start: torch.nn.Module | None = None) -> list[float]:
    """A plain loop over the spec's batches, from the spec's own model or from ``start`` (the saved weights')."""
    s = spec(name)
    module = s.module if start is None else start
    opt = s.optimizer(module.parameters())
    losses = []
    for step in range(STEPS):
        batch = default_collate([s.dataset[i] for i in global_batch(ITEMS, s.batch_size, s.seed, step)])
        opt.zero_grad()
        loss = module(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


SAVED_SPEC = '''
import sys, dataclasses
sys.path.insert(0, {here!r})
from archs import spec


def saved():
    return dataclasses.replace(spec("gpt2"), weights={weights!r})
'''


# gpt2 starts from weights saved with save_pretrained, other than its spec's own (seed 1, not 0): each rank loads
# its stage from them, and its first loss equals the saved model's to 2e-5. One compile and launch checks both.
@pytest.mark.parametrize("name,layout,saved", [("gpt2", ["--solver", "uniform", "--microbatches", "2"], True),
                                               ("bert_cls", ["--solver", "uniform", "--microbatches", "2"], False),
                                               ("t5", ["--solver", "uniform", "--microbatches", "2"], False),
                                               ("vit", ["--microbatches", "1"], False)])
def test_compile_then_run_on_two_ranks(name: str, layout: list[str], saved: bool, tmp_path: Path) -> None:
    build, run = tmp_path / "build", tmp_path / "run"
    model, start = f"{ARCHS_FILE}:{name}_spec", None
    if saved:
        start, _ = make(name, seed=1)
        start.save_pretrained(tmp_path / "weights")
        (tmp_path / "saved.py").write_text(SAVED_SPEC.format(here=str(Path(__file__).parent),
                                                             weights=str(tmp_path / "weights")))
        model = f"{tmp_path / 'saved.py'}:saved"
    # the losses are checked, not the plan's predicted times: the blocks' co-run slow-down is not timed
    assert main(["compile", model, "--cluster", "local-cpu-2", *layout, "--repeats", "1", "--no-corun",
                 "-o", str(build)]) == 0
    # run in this process too, as compile: a CLI subprocess would import torch and the package once more before
    # it starts the ranks (the ranks are processes of their own either way)
    assert main(["run", str(build), "--steps", str(STEPS), "--run-dir", str(run)]) == 0
    rows = read_metrics(run)
    losses = [m.loss for m in rows[max(rows)]]
    assert len(losses) == STEPS
    want = _reference(name, start)
    assert losses == pytest.approx(want, abs=2e-4)
    if saved:
        assert losses[0] == pytest.approx(want[0], abs=2e-5)
    assert torch.tensor(losses).isfinite().all()


def test_launch_runs_the_users_own_loop(tmp_path: Path) -> None:
    script = Path(__file__).with_name("own_loop.py")
    r = subprocess.run([*CLI, "launch", "--nproc", "2", "--run-dir", str(tmp_path / "run"), str(script), "llama",
                        str(STEPS)], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    losses = [float(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("loss ")]
    assert losses == pytest.approx(_reference("llama"), abs=2e-4)

