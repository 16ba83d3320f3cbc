"""The package's face: importing it stays light (no runtime), every public name resolves, errors live in errors.py."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hpml_compile
from hpml_compile import errors

ROOT = Path(__file__).resolve().parents[2]
# Exception classes allowed outside errors.py, and why.
NOT_ERRORS = {
    "InjectedFault": "a fault injected on purpose, a ConnectionError so that it is retried like a real one",
    "_OutOfTime": "solve/uneven's search stops on it at its time limit and catches it itself: never a user's error",
}


@pytest.mark.dist  # a fresh interpreter: the only way to see what a first import loads
def test_import_does_not_import_the_runtime() -> None:
    code = "import hpml_compile, sys; print('hpml_compile.runtime' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


# What a rank's start must not import (a rank runs a build: it neither solves nor, unless it resumes, reads a
# checkpoint), each with where it is imported on first use instead. With them, importing the worker took ~1.2 s
# more CPU on the 2-core VM, paid by every `run` launcher and rank start (benchmarks/runtime_overhead/README.md).
LAZY_FOR_RANKS = {
    "torch.distributed.checkpoint": "runtime/execute/checkpoint.py, where a checkpoint is written or read",
    "hpml_compile.driver": "runtime/job/adapt.py's Adapter (rank 0 of run --adapt) and runtime.compile",
    "hpml_compile.solve": "the driver",
    "pulp": "solve/ilp.py, through the driver",
    "highspy": "solve/ilp.py, through the driver",
    "matplotlib": "viz.py, for a picture",
    "plotly": "runtime/observe/page.py, for the report page",
    "torch.distributed.pipelining": "backsplit.py, where a ZB-H1 backward is split (it imports torch._dynamo)",
    "torch._dynamo": "by torch itself where a rank builds its model on the meta device, or traces",
}


@pytest.mark.dist  # a fresh interpreter: the only way to see what a first import loads
def test_a_rank_start_imports_no_solver_and_no_checkpoint_library() -> None:
    code = ("import sys, hpml_compile.runtime.job.worker; "
            f"print(' '.join(m for m in {sorted(LAZY_FOR_RANKS)!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    loaded = out.stdout.split()
    assert not loaded, "importing hpml_compile.runtime.job.worker imported " + "; ".join(
        f"{m} (import it where it is used: {LAZY_FOR_RANKS[m]})" for m in loaded) + "\n" + out.stderr


@pytest.mark.dist  # a fresh interpreter: the only way to see what a first import loads
def test_validating_a_file_does_not_build_jsonschemas_iri_grammars() -> None:
    """Where rfc3987-syntax is installed, importing jsonschema builds its 39 Earley grammars (about 1 s of CPU in
    every process that loads a plan, each rank of a job included) for an IRI format no schema here names: the
    validator imports jsonschema without them, and the package stays importable after."""
    import importlib.util

    if importlib.util.find_spec("rfc3987_syntax") is None:
        pytest.skip("rfc3987-syntax is not installed here: importing jsonschema builds no grammars to avoid")
    code = ("import importlib.util, sys\n"
            "from hpml_compile.errors import SchemaError\n"
            "from hpml_compile.schema import CLUSTER_SCHEMA, validate\n"
            "try:\n"
            "    validate({'schema_version': 1}, CLUSTER_SCHEMA, 'cluster.json')\n"
            "except SchemaError as e:\n"
            "    print('refused:', e)\n"
            "print('jsonschema' in sys.modules, 'rfc3987_syntax' in sys.modules,\n"
            "      importlib.util.find_spec('rfc3987_syntax') is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused: cluster.json: devices"), out.stdout + out.stderr  # validated all the same
    assert lines[-1] == "True False True", out.stdout + out.stderr  # jsonschema in; no grammars; still importable


def test_every_public_name_resolves_and_compile_is_the_runtimes() -> None:
    from hpml_compile.runtime import compile as runtime_compile

    assert all(getattr(hpml_compile, name, None) is not None for name in hpml_compile.__all__)
    assert hpml_compile.compile is runtime_compile
    assert "compile" in dir(hpml_compile)


def test_error_classes_are_defined_in_errors_only() -> None:
    names = set(errors.__all__)
    outside = []
    for path in sorted((ROOT / "hpml_compile").rglob("*.py")):
        if path.name == "errors.py" and path.parent.name == "hpml_compile":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in NOT_ERRORS:
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & (names | {"Exception"}) or any(b.endswith("Error") for b in bases):
                    outside.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not outside, f"error classes outside hpml_compile/errors.py: {outside}"
    assert all(issubclass(getattr(errors, n), errors.HpmlError) for n in names)


def test_no_two_test_files_share_a_name() -> None:
    """pytest imports test files by basename (no __init__.py): a file in tests/unit and one in tests/dist of the
    same name stop the whole collection, as a fresh clone's CI found twice."""
    seen: dict[str, str] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name]} and {path.relative_to(ROOT)}")
        seen[path.name] = str(path.relative_to(ROOT))
    assert not clashes, f"test files sharing a name (rename one, e.g. *_dist.py): {clashes}"
