"""The choice of compiled stages, and its default on a CPU (uncompiled: no compiler runs in these tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpml_compile.codegen import generate
from hpml_compile.errors import OptionError
from hpml_compile.runtime import Pipeline
from hpml_compile.runtime.execute.compiled import CompiledForward, CompileStages
from hpml_compile.testing import split_plan
from hpml_compile.trace import trace


def test_the_choice_parses_and_a_bad_one_is_refused() -> None:
    assert CompileStages.parse(None) is CompileStages.AUTO
    assert CompileStages.parse(False) is CompileStages.OFF and CompileStages.parse("ON") is CompileStages.ON
    assert CompileStages.AUTO.wants(torch.device("cuda")) and not CompileStages.AUTO.wants(torch.device("cpu"))
    with pytest.raises(OptionError, match="auto, on or off"):
        CompileStages.parse("fast")


def test_stages_stay_uncompiled_on_a_cpu_by_default(tmp_path: Path) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(4, 4)
    gm = trace(net, (x,))
    generate(gm, split_plan(gm, "default", 2, microbatches=2), tmp_path / "b")
    pipe = Pipeline.from_build(tmp_path / "b", net, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert pipe.compiled == [] and not any(isinstance(st.forward, CompiledForward) for st in pipe.stages.values())
    first = float(pipe.step((x,), torch.zeros(4, 1), torch.nn.functional.mse_loss))
    assert first > float(pipe.step((x,), torch.zeros(4, 1), torch.nn.functional.mse_loss)), "it trains"
