"""`hpml-compile replan`: from a build and a measured profile to a new build that loads, with the diff printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpml_compile import load_build, models
from hpml_compile.cli import main


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("replan") / "b1"
    assert main(["compile", "gpt-tiny", "--cluster", "local-cpu-2", "--solver", "uniform", "--microbatches", "2",
                 "--no-measure-links", "-o", str(out)]) == 0
    return out


def _slowed(build: Path, tmp: Path, factor: float) -> Path:
    """A 'measured' profile: the build's profile with every node of the last stage `factor` times slower."""
    plan = json.loads((build / "plan.json").read_text())
    last = set(plan["stages"][-1]["nodes"])
    prof = json.loads((build / "profile.json").read_text())
    for node in prof["nodes"]:
        if node["name"] in last:
            for cost in node["cost"].values():
                cost["fwd_ms"] *= factor
                cost["bwd_ms"] *= factor
    path = tmp / "measured.json"
    path.write_text(json.dumps(prof))
    return path


def test_replan_moves_work_off_the_slowed_stage(build: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    measured = _slowed(build, tmp_path, 4.0)
    out = tmp_path / "b2"
    assert main(["replan", str(build / "plan.json"), "--profile", str(measured), "--solver", "dp",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "switch: yes" in text and "stage 1 -> stage 0" in text
    old = json.loads((build / "plan.json").read_text())
    new = json.loads((out / "plan.json").read_text())
    old_split = [(st["devices"], len(st["nodes"])) for st in old["stages"]]
    new_split = [(st["devices"], len(st["nodes"])) for st in new["stages"]]
    assert new_split != old_split and new["predicted"]["step_ms"] > 0
    loaded = models.load("gpt-tiny")
    b = load_build(out, loaded.module)  # hashes and model graph check out
    assert len(b.stages) == len(new["stages"])


def test_replan_keeps_the_plan_when_nothing_is_gained(build: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    measured = _slowed(build, tmp_path, 1.0)
    assert main(["replan", str(build / "plan.json"), "--profile", str(measured), "--solver", "uniform",
                 "-o", str(tmp_path / "b3")]) == 0
    assert "switch: no" in capsys.readouterr().out


def test_replan_rejects_a_profile_of_another_model(build: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    prof = json.loads((build / "profile.json").read_text())
    prof["model"] = "resnet50"
    path = tmp_path / "other.json"
    path.write_text(json.dumps(prof))
    assert main(["replan", str(build / "plan.json"), "--profile", str(path), "-o", str(tmp_path / "x")]) == 2
    assert "profiles 'resnet50'" in capsys.readouterr().err
