"""Every command's ``--help`` teaches: it ends with an example that the parser accepts, and ``--version`` works."""

from __future__ import annotations

import re
import shlex
from importlib.metadata import version
from pathlib import Path

import pytest

from hpml_compile.cli import EXAMPLES, build_parser, main


def _commands() -> dict[str, object]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return dict(sub.choices)


def test_every_command_has_an_example() -> None:
    assert set(_commands()) == set(EXAMPLES), "a command without an example in cli.EXAMPLES, or an example of none"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_help_ends_with_an_example_the_parser_accepts(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    tail = help_text.rstrip().split("\n\nexample:\n", 1)
    assert len(tail) == 2 and tail[1].strip().startswith(f"hpml-compile {name}"), help_text[-400:]
    for line in EXAMPLES[name].splitlines():
        argv = shlex.split(line, comments=True)
        assert argv[0] == "hpml-compile" and argv[1] == name, line
        args = build_parser().parse_args(argv[1:])
        assert args.command == name


def test_run_help_says_where_the_data_comes_from_and_groups_the_drills(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "on the TrainSpec's dataset" in out
    drills = out.split("drills (", 1)[1]
    for flag in ("--kill-at", "--hang-at", "--slow", "--inject-fault"):
        assert flag in drills, flag


@pytest.mark.parametrize("name", ["launch", "run", "report"])
def test_every_argument_says_what_it_does(name: str) -> None:
    parser = _commands()[name]
    bare = [a.option_strings[0] if a.option_strings else a.metavar or a.dest
            for a in parser._actions if not (a.help or "").strip()]
    assert not bare, f"`hpml-compile {name} --help` says nothing about {bare}"


def test_report_help_explains_every_column_of_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    from hpml_compile.runtime.observe.summary import COLUMNS

    with pytest.raises(SystemExit):
        main(["report", "--help"])
    columns = capsys.readouterr().out.split("columns of the table:\n", 1)[1].split("\n\nexample:", 1)[0]
    told = " ".join(columns.split())
    for name, what in COLUMNS:
        assert f"{name} {' '.join(what.split())}" in told, name


def test_version_is_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"hpml-compile {version('hpml-compile')}"


def test_the_changelog_has_an_entry_for_the_version_in_pyproject() -> None:
    root = Path(__file__).resolve().parents[2]
    declared = re.search(r'^version = "([^"]+)"', (root / "pyproject.toml").read_text(), re.M)
    assert declared, "pyproject.toml declares no version"
    versions = re.findall(r"^## \[([^\]]+)\]", (root / "CHANGELOG.md").read_text(), re.M)
    assert versions and versions[0] == declared[1], (versions, declared[1])


def test_compile_takes_the_max_tp_the_adapt_refusal_names() -> None:
    """`run --adapt` refuses tensor-parallel stages and tells the user to compile with --max-tp 1: compile takes it."""
    from hpml_compile.cli import build_parser
    from hpml_compile.cli.plan import comm_options

    p = build_parser()
    base = ["compile", "gpt-tiny", "--cluster", "local-cpu-2", "-o", "out"]
    assert comm_options(p.parse_args([*base, "--max-tp", "1"]))["max_tp"] == 1
    assert "max_tp" not in comm_options(p.parse_args(base))  # the driver's default
    with pytest.raises(SystemExit):
        p.parse_args([*base, "--max-tp", "3"])
