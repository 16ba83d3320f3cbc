"""Your own training loop, run by ``hpml-compile launch`` on every rank, resumed after a failure.

    hpml-compile launch --adapt --nproc 2 --run-dir out/own examples/own_loop.py --steps 40

Every rank runs this file. ``compile`` plans for the cluster ``launch`` names
(``HPML_CLUSTER``: under ``--adapt``, after a rank died, the devices left), the pipeline loads the
latest checkpoint if there is one (and with it the lr schedule and the data
position of the TrainSpec's trainer), and the loop saves every few steps. The
model and data come from a TrainSpec (here the digits CNN); any ``nn.Module`` with
your own batches works the same way with ``pipe.step(inputs, targets, loss_fn)``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import hpml_compile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits_cnn import spec  # noqa: E402  (the example next to this one)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--die-at", type=int, default=None, help="(a drill) rank 1 of the first start dies here")
    a = p.parse_args()
    torch.manual_seed(0)  # the same model on every rank
    pipe = hpml_compile.compile(spec(), cluster=os.environ.get("HPML_CLUSTER"), microbatches=2, solver="dp",
                                run_dir=os.environ.get("HPML_RUN_DIR"))
    ck = os.environ.get("HPML_CHECKPOINT_DIR", "out/own/checkpoints")
    resumed = pipe.load(ck, missing_ok=True)
    if pipe.rank == 0:
        print(f"segment {os.environ.get('HPML_SEGMENT', 0)}: {pipe.world_size} rank(s); "
              + (f"resumed at step {resumed['step']}" if resumed else "from the start"), flush=True)
    while pipe.steps_done < a.steps:
        if a.die_at == pipe.steps_done + 1 and pipe.rank == 1 and os.environ.get("HPML_SEGMENT") == "0":
            os.kill(os.getpid(), 9)
        loss = pipe.trainer.step()
        if pipe.steps_done % a.save_every == 0 or pipe.steps_done == a.steps:
            pipe.save(ck)
            if pipe.rank == 0:
                print(f"step {pipe.steps_done}: loss {loss.item():.4f}, saved", flush=True)
    if pipe.rank == 0:
        print(f"done: validation loss {pipe.trainer.validation_loss():.4f}", flush=True)
    pipe.close()


if __name__ == "__main__":
    main()
