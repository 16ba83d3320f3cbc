"""The documentation site builds with ``mkdocs build --strict``: a broken link, a missing page, an API object
that cannot be found or an error class without a documented fix fails the build (and this test)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
def test_the_docs_build_strict_without_a_warning(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra: pip install -e '.[test]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "WARNING" not in log, log[-4000:]
    site = tmp_path / "site"
    cli = (site / "cli" / "index.html").read_text()
    assert cli.count("example:") >= 11  # every command's help, generated from the parser
    errors_page = (site / "troubleshooting" / "index.html").read_text()
    assert "UpdateApplied" in errors_page and "What to do" in errors_page
    assert (site / "benchmarks" / "prediction" / "index.html").is_file()


def test_every_error_class_has_a_documented_fix() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import docs_hooks
    finally:
        sys.path.remove(str(ROOT / "tools"))
    from hpml_compile import errors

    assert set(errors.__all__) <= set(docs_hooks.FIXES), set(errors.__all__) - set(docs_hooks.FIXES)
    text = docs_hooks.error_reference()
    assert all(f"### `{name}`" in text for name in errors.__all__)
