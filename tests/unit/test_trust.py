"""The trust boundary of a build, and build folders that never replace a user's files.

A build runs only code that codegen regenerates at load time from plan.json
and the user's model: a stage file on disk, even with its hash recomputed in
the manifest (anyone can), is compared and never imported. ``model.json``
names the model file that ``run`` imports, so it is hashed in the manifest and
a changed or unrecorded one is refused before anything imports it. And a build
is published only into a new folder or over an earlier build: ``replan -o``
or ``compile -o`` over a folder with a user's files refuses and leaves them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from hpml_compile import driver, models
from hpml_compile.cli import main
from hpml_compile.codegen import generate, load_build
from hpml_compile.codegen.build import sha256
from hpml_compile.testing import split_plan
from hpml_compile.errors import BuildMismatchError, OutputError
from hpml_compile.plan import load_plan
from hpml_compile.profile import load_profile
from hpml_compile.recipe import read_recipe
from hpml_compile.trace import trace

COMPILE = ["--cluster", "local-cpu-2", "--solver", "uniform", "--microbatches", "2", "--repeats", "1", "--warmup", "0", "--no-measure-links"]


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build made by the compile CLI (so with model.json); tests work on copies of it."""
    out = tmp_path_factory.mktemp("trust") / "build"
    assert main(["compile", "mlp-tiny", *COMPILE, "-o", str(out)]) == 0
    return out


def _copy(build: Path, tmp: Path, name: str = "b") -> Path:
    return Path(shutil.copytree(build, tmp / name))


def _reseal(folder: Path, name: str) -> None:
    """What anyone can do after editing a file: write its new sha256 into the manifest."""
    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    data["files"][name] = sha256((folder / name).read_bytes())
    path.write_text(json.dumps(data))


def _evil(tmp: Path) -> tuple[Path, Path]:
    """A model file that leaves a marker when it is imported."""
    marker = tmp / "imported"
    evil = tmp / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').close()\n\n\ndef make():\n    raise SystemExit('ran')\n")
    return evil, marker


def test_a_stage_file_is_never_imported_even_with_its_hash_recomputed(build: Path, tmp_path: Path) -> None:
    b = _copy(build, tmp_path)
    marker = tmp_path / "imported"
    stage = b / "stage_1.py"
    stage.write_text(f"open({str(marker)!r}, 'w').close()\n" + stage.read_text())
    _reseal(b, "stage_1.py")
    loaded = models.load("mlp-tiny")
    with pytest.raises(BuildMismatchError, match=re.escape(f"{stage} was edited by hand: it is for reading; the "
                                                           "build runs the code regenerated from plan.json")):
        load_build(b, loaded.module)
    assert not marker.exists()


def test_the_build_runs_the_regenerated_source(build: Path, tmp_path: Path) -> None:
    b = _copy(build, tmp_path)
    loaded = models.load("mlp-tiny")
    built = load_build(b, loaded.module)
    for k, stage in enumerate(built.stages):
        path = b / f"stage_{k}.py"
        assert built.source(k) == path.read_text()  # what runs is what a person reads there
        assert type(stage).forward.__code__.co_filename == str(path)  # tracebacks point at that file
    assert not (b / "__pycache__").exists()  # nothing was imported from the folder


def test_model_json_is_in_the_manifest(build: Path) -> None:
    files = json.loads((build / "manifest.json").read_text())["files"]
    assert files["model.json"] == sha256((build / "model.json").read_bytes())
    assert read_recipe(build).model == "mlp-tiny"


def test_a_changed_model_json_is_refused_before_its_model_is_imported(build: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    b = _copy(build, tmp_path)
    evil, marker = _evil(tmp_path)
    recipe = json.loads((b / "model.json").read_text())
    recipe["model"] = f"{evil}:make"
    (b / "model.json").write_text(json.dumps(recipe))
    said = re.escape(f"{b / 'model.json'} was changed after the build was generated")
    with pytest.raises(BuildMismatchError, match=said):  # the closed loop and replan rebuild from it
        driver.rebuild(b, load_plan(b / "plan.json"), load_profile(b / "profile.json"), tmp_path / "next")
    assert not marker.exists() and not (tmp_path / "next").exists()
    assert main(["run", str(b), "--steps", "1", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert re.search(said, err) and "Traceback" not in err
    assert not marker.exists()


def test_a_model_json_the_manifest_does_not_record_is_refused(tmp_path: Path) -> None:
    loaded = models.load("mlp-tiny")
    gm = trace(loaded.module, loaded.example_inputs)
    generate(gm, split_plan(gm, "mlp-tiny", 2), tmp_path / "b")  # a build of one's own model: no recipe
    (tmp_path / "b" / "model.json").write_text(json.dumps({"schema_version": 1, "model": "mlp-tiny",
                                                           "batch_size": loaded.batch_size, "seed": 0}))
    with pytest.raises(BuildMismatchError, match=r"model\.json: not recorded in manifest\.json"):
        read_recipe(tmp_path / "b")


def test_replan_into_a_users_folder_refuses_and_leaves_it(build: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    v = tmp_path / "v"
    (v / "sub").mkdir(parents=True)
    (v / "important.txt").write_text("keep me")
    (v / "sub" / "thesis.tex").write_text("\\begin{document}")
    assert main(["replan", str(build / "plan.json"), "--profile", str(build / "profile.json"), "--solver",
                 "uniform", "-o", str(v)]) == 2
    err = capsys.readouterr().err
    assert str(v) in err and "not a build folder that hpml-compile wrote" in err and "Traceback" not in err
    assert (v / "important.txt").read_text() == "keep me"
    assert (v / "sub" / "thesis.tex").read_text() == "\\begin{document}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]  # no half-written sibling either


def test_a_build_next_to_a_users_file_is_not_replaced(build: Path, tmp_path: Path) -> None:
    b = _copy(build, tmp_path)
    (b / "notes.md").write_text("mine")
    with pytest.raises(OutputError, match=re.escape(f"{b} holds notes.md, which hpml-compile did not write")):
        driver.rebuild(build, load_plan(build / "plan.json"), load_profile(build / "profile.json"), b)
    assert (b / "notes.md").read_text() == "mine" and (b / "manifest.json").is_file()


def test_a_second_compile_replaces_the_first(tmp_path: Path) -> None:
    out = tmp_path / "build"
    assert main(["compile", "mlp-tiny", *COMPILE, "--cluster", "local-cpu-3", "-o", str(out)]) == 0
    assert (out / "stage_2.py").is_file()
    assert main(["compile", "mlp-tiny", *COMPILE, "-o", str(out)]) == 0  # two stages now
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == sorted([*manifest["files"], "manifest.json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build"]  # published by rename, nothing left aside
    assert len(load_build(out, models.load("mlp-tiny").module).stages) == 2


def test_compile_into_a_folder_that_cannot_be_written_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "mlp-tiny", *COMPILE, "-o", "/proc/forbidden"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpml-compile compile: error: cannot write the build folder /proc/forbidden")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_closed_loop_rebuilds_into_the_same_folder_again(build: Path, tmp_path: Path) -> None:
    b = _copy(build, tmp_path)
    plan, prof = load_plan(b / "plan.json"), load_profile(b / "profile.json")
    nxt = tmp_path / "run" / "next_build"
    driver.rebuild(b, plan, prof, nxt)
    driver.rebuild(b, plan, prof, nxt)  # an earlier next_build is replaced
    driver.rebuild(nxt, plan, prof, nxt)  # and a build rebuilt from itself, as a second switch does
    assert read_recipe(nxt) == read_recipe(b)
    assert sorted(p.name for p in nxt.parent.iterdir()) == ["next_build"]
    assert len(load_build(nxt, models.load("mlp-tiny").module).stages) == 2
