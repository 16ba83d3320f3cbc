"""README.md keeps its word: its results table is what the result files render, and its quick starts work.

The results table is generated (``benchmarks/results_table.py``) from ``benchmarks/results/*.json``; a figure
typed into the README by hand, or a result file changed without regenerating, fails here. The quick-start
snippets are taken from the README itself, so that an edit to either the README or the API that breaks them
fails too.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hpml_compile.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


@pytest.fixture(scope="module")
def results() -> ModuleType:
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "benchmarks" / "results_table.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _blocks(after_heading: str, lang: str) -> list[str]:
    """The ``lang`` code blocks of the README section whose heading starts with ``after_heading``."""
    text = README.read_text()
    section = text.split(f"\n## {after_heading}", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def test_the_results_table_is_what_the_result_files_render(results: ModuleType) -> None:
    rendered = results.render(results.rows())
    assert results.readme_table(README.read_text()) == rendered, \
        "README.md's results table is stale: run python benchmarks/results_table.py --write"
    assert results.main(["--check"]) == 0


def test_a_row_without_a_result_file_is_caught(results: ModuleType, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    text = README.read_text()
    forged = text.replace(results.END, "| a figure nobody measured | 1.0x | - | - | `true` |\n" + results.END)
    readme = tmp_path / "README.md"
    readme.write_text(forged)
    monkeypatch.setattr(results, "README", readme)
    assert results.main(["--check"]) == 1
    assert results.main(["--write"]) == 0 and readme.read_text() == text


def test_a_result_file_must_say_when_where_and_how(results: ModuleType, tmp_path: Path) -> None:
    good = json.loads(next(results.RESULTS.glob("*.json")).read_text())
    for field, bad in (("commit", "last week"), ("date", "28/11/2026"), ("figure", "{nothing[3]:.1%}"),
                       ("details", "benchmarks/none/README.md")):
        path = tmp_path / "r.json"
        path.write_text(json.dumps({**good, field: bad}))
        with pytest.raises(results.ResultError, match=field):
            results.load(path)
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "command"}))
    with pytest.raises(results.ResultError, match="command"):
        results.load(path)


def test_the_cli_quick_start_parses() -> None:
    (train_py,) = _blocks("Quick start: your model, from the command line", "python")
    (shell,) = _blocks("Quick start: your model, from the command line", "bash")
    namespace: dict[str, object] = {}
    exec(compile(train_py, "train.py", "exec"), namespace)  # noqa: S102  the README's own example
    spec = namespace["spec"]()  # type: ignore[operator]
    assert spec.batch_size == 64 and len(spec.dataset) == 4096
    lines = [shlex.split(line, comments=True) for line in shell.splitlines() if line.strip()]
    assert len(lines) >= 4
    for argv in lines:
        assert argv[0] == "hpml-compile"
        assert build_parser().parse_args(argv[1:]).command == argv[1]


@pytest.mark.dist
def test_the_python_quick_start_trains(tmp_path: Path) -> None:
    (snippet,) = _blocks("Quick start: your model, from Python", "python")
    script = tmp_path / "quick_start.py"
    script.write_text(snippet)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    found = re.search(r"loss after (\d+) steps: ([0-9.]+)", out.stdout)
    assert found, out.stdout[-1000:]
    assert int(found[1]) == 100 and float(found[2]) < 1.0  # from ln(10) = 2.3 at the start


def test_every_relative_link_of_the_readme_exists() -> None:
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing
