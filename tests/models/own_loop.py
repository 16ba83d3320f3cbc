"""A user's own loop over a real architecture, run on every rank by ``hpml-compile launch``.

``python -m hpml_compile launch --nproc 2 --run-dir RUN tests/models/own_loop.py ARCH STEPS``: compiles the
architecture's TrainSpec (no wrapper, no loss_fn, a dict dataset) for the launched ranks and prints each
step's loss on rank 0.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hpml_compile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from archs import spec  # noqa: E402  (the architectures next to this file)


def main() -> None:
    arch, steps = sys.argv[1], int(sys.argv[2])
    pipe = hpml_compile.compile(spec(arch), cluster=os.environ.get("HPML_CLUSTER"), microbatches=2,
                                solver="uniform", run_dir=os.environ.get("HPML_RUN_DIR"), corun=False)
    for _ in range(steps):
        loss = pipe.trainer.step()
        if pipe.rank == 0:
            print(f"loss {loss.item():.6f}", flush=True)
    pipe.close()


if __name__ == "__main__":
    main()
