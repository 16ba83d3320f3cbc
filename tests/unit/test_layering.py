"""Arrows run one way: a pass imports earlier passes, never a later one; cost_models imports no hpml_compile."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each pass, and the modules it may never import (the passes after it).
ORDER = ["trace", "profile", "costgraph", "cluster", "plan", "simulate", "solve", "codegen", "runtime"]
SHARED = {"ir", "errors", "schema", "models", "report"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:  # relative: resolve against the package of ``path``
                pkg = path.relative_to(ROOT).with_suffix("").parts[: -node.level]
                mod = ".".join([*pkg, mod] if mod else pkg)
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def _pass_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "hpml_compile" and parts[1] in ORDER else None


def _files(top: str) -> list[Path]:
    return sorted((ROOT / top).rglob("*.py"))


@pytest.mark.parametrize("path", _files("cost_models"), ids=lambda p: str(p.relative_to(ROOT)))
def test_cost_models_import_nothing_from_hpml_compile(path: Path) -> None:
    bad = [m for m in _imports(path) if m.split(".")[0] == "hpml_compile"]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", _files("hpml_compile"), ids=lambda p: str(p.relative_to(ROOT)))
def test_passes_never_import_later_passes(path: Path) -> None:
    me = _pass_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
    if me is None:
        return
    later = set(ORDER[ORDER.index(me) + 1:])
    bad = sorted({m for m in _imports(path) if _pass_of(m) in later})
    assert not bad, f"{path.relative_to(ROOT)} ({me}) imports later passes: {bad}"
