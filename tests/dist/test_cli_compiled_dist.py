"""``hpml-compile compile --compile-stages on``: the CPU stages profiled and planned compiled, the mode recorded in the
build, ``run`` following it by default and saying in one line when told a mode the plan was not priced for.

One build of mlp-tiny on one CPU rank (inductor compiles its two kinds of block: seconds), run for one step twice
(torchrun ranks: marked ``dist``). Which mode a run used is read from its ``run.json``, not from its timing.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hpml_compile import models
from hpml_compile.cli import main
from hpml_compile.cluster import load_cluster
from hpml_compile.plan import load_plan
from hpml_compile.runtime import Pipeline
from hpml_compile.runtime.execute.compiled import CompileStages, mode_mismatch

# notes on a busy machine's timing, about the host rather than what is tested here
pytestmark = [pytest.mark.dist, pytest.mark.slow,  # a cold inductor cache: ~25 s to compile the build
              pytest.mark.filterwarnings("ignore:.*timed in sequence took:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*the whole-model pass took:UserWarning")]


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compiled") / "build"
    assert main(["compile", "mlp-tiny", "--cluster", "local-cpu-1", "--compile-stages", "on", "--repeats", "1",
                 "--no-measure-links", "-o", str(out)]) == 0
    return out


def _run(build: Path, run_dir: Path, *extra: str) -> str:
    """``run`` for one step; the mode its ranks were given (``run.json``)."""
    assert main(["run", str(build), "--steps", "1", "--run-dir", str(run_dir), "--no-report", "--no-tensorboard",
                 *extra]) == 0
    return json.loads((run_dir / "run.json").read_text())["options"]["compile_stages"]


def test_compile_records_the_mode_and_prices_compiled_blocks(build: Path) -> None:
    plan = load_plan(build / "plan.json")
    assert plan.compile_stages == "on"
    said = {a.name: a.value for a in plan.assumptions}
    assert "timed compiled" in said["compiled stages on cpu"], said  # not "priced at their eager times"
    facts = json.loads((build / "profile.json").read_text())["devices"]["cpu"]["compiled"]
    assert facts["distinct"] >= 1, "the profile timed blocks compiled"
    # a plan for uncompiled stages records nothing (plans written before the field read as auto)
    assert "compile_stages" not in replace(plan, compile_stages="auto").to_dict()


def test_run_follows_the_build_and_says_when_told_otherwise(build: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(build, tmp_path / "default") == "on"
    assert "planned for" not in capsys.readouterr().out
    assert _run(build, tmp_path / "off", "--compile-stages", "off") == "off"
    said = [line for line in capsys.readouterr().out.splitlines() if "planned for" in line]
    assert len(said) == 1 and "priced compiled" in said[0], said


def test_mismatch_is_said_only_where_cpu_stages_change(build: Path) -> None:
    plan = load_plan(build / "plan.json")
    eager = replace(plan, compile_stages="auto")
    assert mode_mismatch(plan, CompileStages.ON, "b") is None
    assert mode_mismatch(eager, CompileStages.OFF, "b") is None  # auto is uncompiled on CPUs too
    assert "priced uncompiled" in (mode_mismatch(eager, CompileStages.ON, "b") or "")
    gpus = replace(eager, cluster=load_cluster("dgx-a100-8"))  # no CPU device: GPU kinds are predicted alike
    assert mode_mismatch(gpus, CompileStages.ON, "b") is None


def test_a_pipeline_of_the_build_follows_its_mode_by_default(build: Path) -> None:
    for given, compiled in ((None, 1), ("off", 0)):
        pipe = Pipeline.from_build(build, models.load("mlp-tiny", seed=0).module, compile_stages=given)
        assert len(pipe.compiled) == compiled, given
        pipe.close()
