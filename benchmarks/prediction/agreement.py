"""Agreement: profiles of gpt-mini taken one after the other, and the data-parallel step each predicts.

Why: the same plan (gpt-mini, one stage on 2 data-parallel CPU ranks) was predicted 317 ms by one
profile and 246.6 ms by another on the same machine. This profiles gpt-mini ``--profiles`` times at one
torch thread (batch only, with the loss and AdamW), predicts that plan from each
(:func:`hpml_compile.simulate.annotate`), and prints each prediction, each profile's transformer-layer
costs (fwd + bwd per layer), the load average, and the spread (max - min) / min. The unit test
``tests/unit/test_profile.py::test_two_profiles_of_gpt_mini_predict_the_same_data_parallel_step`` asks
for 5%.

Run:  PYTHONPATH=$PWD .venv/bin/python benchmarks/prediction/agreement.py [--profiles 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

from hpml_compile import models, profile
from hpml_compile.cluster import load_cluster
from hpml_compile.costgraph import build
from hpml_compile.plan import Plan, Schedule, Stage
from hpml_compile.simulate import annotate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profiles", type=int, default=2, help="profiles to take, one after the other")
    args = p.parse_args(argv)
    m = models.load("gpt-mini", seed=0)
    steps = []
    for i in range(args.profiles):
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof = profile(m.module, m.example_inputs, name="gpt-mini", repeats=3, warmup=1, progress=False,
                           loss_fn=m.loss_fn, targets=m.example_targets, micro_batch=0, threads=1)
        graph = build(prof)
        coarse = graph.coarsen()
        every = tuple(n for v in coarse.order for n in coarse.node(v).members)
        plan = Plan("gpt-mini", load_cluster("local-cpu-2"), Schedule.GPIPE, 1, (Stage(0, ("cpu0", "cpu1"), every),))
        steps.append(annotate(plan, graph)[0].predicted.step_ms)
        layers: dict[str, float] = {}
        for n in prof.nodes:
            parts = n.scope.split(".")
            if len(parts) > 1 and parts[1].isdigit():
                layers[parts[1]] = layers.get(parts[1], 0.0) + n.cost["cpu"].fwd_ms + n.cost["cpu"].bwd_ms
        print(f"profile {i}: data-parallel step predicted {steps[-1]:.1f} ms; layers fwd+bwd "
              f"{[round(v, 1) for v in layers.values()]} ms; took {time.perf_counter() - t0:.0f} s; "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"spread (max - min) / min: {(max(steps) - min(steps)) / min(steps):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
