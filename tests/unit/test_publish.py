"""Output folders: a user's files are never destroyed, and an output is published whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpml_compile.errors import OutputError
from hpml_compile.publish import check_output_dir, fresh_path, publish_dir


def _made(p: Path) -> set[str] | None:
    return {"manifest.json", "stage_0.py"} if (p / "manifest.json").is_file() else None


def _fill(text: str):  # type: ignore[no-untyped-def]
    def fill(d: Path) -> str:
        (d / "manifest.json").write_text("{}")
        (d / "stage_0.py").write_text(text)
        return text
    return fill


def test_a_folder_with_a_users_files_is_refused_and_left_whole(tmp_path: Path) -> None:
    v = tmp_path / "v"
    (v / "sub").mkdir(parents=True)
    (v / "important.txt").write_text("keep me")
    (v / "sub" / "thesis.tex").write_text("\\begin{document}")
    with pytest.raises(OutputError, match="not a build folder that hpml-compile wrote"):
        publish_dir(v, _fill("x"), made_by=_made, what="build folder")
    assert (v / "important.txt").read_text() == "keep me" and (v / "sub" / "thesis.tex").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]  # no temporary folder left behind


def test_an_earlier_output_is_replaced_but_not_when_a_user_added_a_file(tmp_path: Path) -> None:
    out = tmp_path / "build"
    publish_dir(out, _fill("one"), made_by=_made, what="build folder")
    publish_dir(out, _fill("two"), made_by=_made, what="build folder")
    assert (out / "stage_0.py").read_text() == "two"
    (out / "notes.md").write_text("mine")
    with pytest.raises(OutputError, match="notes.md"):
        publish_dir(out, _fill("three"), made_by=_made, what="build folder")
    assert (out / "stage_0.py").read_text() == "two" and (out / "notes.md").is_file()


def test_a_failed_write_leaves_the_previous_output_whole(tmp_path: Path) -> None:
    out = tmp_path / "build"
    publish_dir(out, _fill("one"), made_by=_made, what="build folder")

    def broken(d: Path) -> None:
        (d / "manifest.json").write_text("{half")
        raise RuntimeError("codegen failed half-way")

    with pytest.raises(RuntimeError):
        publish_dir(out, broken, made_by=_made, what="build folder")
    assert (out / "stage_0.py").read_text() == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build"]


def test_a_file_or_an_unwritable_place_is_a_named_error(tmp_path: Path) -> None:
    f = tmp_path / "plan"
    f.write_text("x")
    with pytest.raises(OutputError, match="is a file"):
        check_output_dir(f, made_by=_made, what="build folder")
    with pytest.raises(OutputError, match="cannot write"):
        publish_dir(Path("/proc/forbidden/build"), _fill("x"), made_by=_made, what="build folder")


def test_fresh_path_names_a_path_that_does_not_exist(tmp_path: Path) -> None:
    (tmp_path / "build2").mkdir()
    (tmp_path / "build3").mkdir()
    assert fresh_path(tmp_path / "build") == tmp_path / "build4"
    assert fresh_path(tmp_path / "build3") == tmp_path / "build4"
    assert not fresh_path(tmp_path / "run").exists()
