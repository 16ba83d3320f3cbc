"""Every notebook in notebooks/ runs top to bottom (so the walk-throughs never rot)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


# Each notebook runs in a kernel process, and 02/03 start torchrun jobs: the dist tier. Each cell may take up
# to the client's 600 s, so the whole notebook gets longer than the suite's default per-test limit.
@pytest.mark.dist
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    assert any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "the notebook printed nothing"


def test_there_is_a_notebook() -> None:
    assert NOTEBOOKS, "notebooks/ holds the walk-throughs the README promises"
