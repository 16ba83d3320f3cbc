"""mypy over hpml_compile/, at the strictness pyproject.toml sets ([tool.mypy]), finds nothing.

Every function is annotated; the per-module allowances in pyproject.toml say, by group, which error codes are
still allowed and why, so that a new module is checked in full and the list can only shrink.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# About 30 s on two cores without a cache (.mypy_cache, ignored by git), a few with one. Two mypy worker
# processes check the modules in parallel: the same checks, in about half the time on two cores.
@pytest.mark.dist
@pytest.mark.slow
def test_mypy_finds_nothing() -> None:
    api = pytest.importorskip("mypy.api", reason="mypy is in the test extra: pip install -e '.[test]'")
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
                                str(ROOT / ".mypy_cache"), "--num-workers", "2", str(ROOT / "hpml_compile")])
    assert status == 0, out + err


def test_the_allowances_name_modules_that_exist() -> None:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    for override in config.get("overrides", []):
        for module in override["module"]:
            path = ROOT / module.replace(".", "/")
            assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), (
                f"pyproject.toml's [tool.mypy] allowances name {module}, which does not exist: remove it")
