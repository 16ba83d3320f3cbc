"""Files and functions stay small: none over the limits but today's exceptions, named here so the list can only shrink.

In the spirit of tinygrad's line-count check: a file of ``hpml_compile/`` over :data:`FILE_LINES` lines or a
function over :data:`FUNCTION_LINES` lines fails, unless it is listed below; a listed one that has come under
its limit fails too, so that its entry is removed and it cannot grow back unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hpml_compile"
FILE_LINES = 600
FUNCTION_LINES = 120

# Today's files over FILE_LINES (path under hpml_compile/). Split one, then remove it here.
LONG_FILES = {
    "driver.py", "ir.py", "plan.py", "simulate.py", "stagecost.py", "profile/__init__.py", "profile/timing.py",
    "runtime/execute/checkpoint.py", "runtime/execute/pipeline.py", "runtime/job/adapt.py",
    "runtime/observe/summary.py", "runtime/sync/comm.py", "runtime/sync/zero.py",
}
# Today's functions over FUNCTION_LINES ("path:qualified name").
LONG_FUNCTIONS = {
    "solve/lagrange.py:_lagrangian", "solve/__init__.py:solve",
    "solve/restricted.py:ordered_chain", "solve/table.py:build_table",
}


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _functions(path: Path) -> dict[str, int]:
    """Every function and method of ``path`` (nested ones too), by qualified name, with its length in lines."""
    out: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + child.name] = (child.end_lineno or child.lineno) - child.lineno + 1
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")

    walk(ast.parse(path.read_text()), "")
    return out


def _files() -> dict[str, Path]:
    return {p.relative_to(PACKAGE).as_posix(): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_new_long_file() -> None:
    long = {name for name, p in _files().items() if _lines(p) > FILE_LINES}
    new = sorted(long - LONG_FILES)
    assert not new, f"over {FILE_LINES} lines: {new}; split each along its seams (one concept per module)"
    shrunk = sorted(LONG_FILES - long)
    assert not shrunk, f"{shrunk} are now within {FILE_LINES} lines: remove them from LONG_FILES in {__file__}"


def test_no_new_long_function() -> None:
    long = {f"{name}:{fn}" for name, p in _files().items() for fn, n in _functions(p).items() if n > FUNCTION_LINES}
    new = sorted(long - LONG_FUNCTIONS)
    assert not new, f"over {FUNCTION_LINES} lines: {new}; give their parts names"
    shrunk = sorted(LONG_FUNCTIONS - long)
    assert not shrunk, f"{shrunk} are now within {FUNCTION_LINES} lines: remove them from LONG_FUNCTIONS"


def test_the_measure_counts_nested_functions() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.py"
        path.write_text("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n")
        assert _functions(path) == {"A.f": 4, "A.f.g": 2}
