"""Arrows run one way, checked by parsing every module's imports (lazy ones inside functions included).

Every module of ``hpml_compile`` belongs to one layer (``_kind``) and an
unclassified module fails, so a new module is placed on purpose:

- a *pass* (``PASSES``, in pipeline order) imports shared modules and earlier
  passes only: never a later pass, the runtime, a CLI, the driver or a view;
- *shared* modules (``SHARED``: types, errors, schemas) import only each other;
- *views* (``VIEWS``: pictures and tables) read the passes' outputs, never the
  runtime, the CLIs or the driver; *models* import only shared modules;
- ``driver`` is the flat list of pass calls, the only module that assembles the
  compile chain (``CHAIN``), and never imports the runtime or the CLIs;
- ``runtime/`` reaches solving (``SOLVING``) only through the driver, and never
  imports a CLI; inside it, each room (``ROOMS``, bottom first: ``sync``, ``observe``,
  ``execute``, ``job``) imports only its own room and the rooms below it, never the package
  face ``hpml_compile.runtime``; the link probe (``profile.links``, which starts ranks) and
  ``infer`` are held to the runtime's rules;
- ``api`` (the Python ``compile``) sits beside the driver: it assembles driver and runtime and
  never imports a CLI;
- the package root does not import the runtime (``import hpml_compile`` stays light);
- ``testing`` (test support: small models, hand-made plans, profiles, clusters, ranks) may import
  anything but a CLI, and no module of the package imports it (only tests and docstring examples);
- the CLIs sit on top and may import anything.

And ``cost_models`` imports nothing from ``hpml_compile``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PASSES = ["trace", "profile", "tp", "costgraph", "cluster", "stagecost", "plan", "schedule", "schedule_check", "simulate", "solve", "replan",
          "codegen"]
SHARED = {"ir", "errors", "schema", "memory", "hostmem", "publish", "recipe", "trainspec", "precision", "backsplit",
          "compression", "saved", "interleave"}
VIEWS = {"viz", "report", "explain", "certify", "assumptions"}
CLI = {"cli", "demo", "__main__"}  # and every ``*_cli`` module
# What the runtime may reach only through hpml_compile.driver ...
SOLVING = {"solve", "simulate", "costgraph", "profile", "trace", "replan"}
# ... except reading and writing the files those passes own (data, not solving).
DATA_IO = {"hpml_compile.profile.load_profile", "hpml_compile.profile.save_profile"}
# The compile chain: a module importing all of these assembles it by hand, which is the driver's job.
CHAIN = {"profile", "costgraph", "solve", "codegen"}
# The runtime's rooms, bottom first: a room imports its own and the ones before it.
ROOMS = ["sync", "observe", "execute", "job"]
# Modules whose layer is not their top component's.
MODULE_KIND = {"hpml_compile.profile.links": "runtime", "hpml_compile.profile.messages": "runtime"}  # they start ranks


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute; ``from a import b`` gives both ``a`` and ``a.b``."""
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


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top(module: str) -> str | None:
    """The first component under ``hpml_compile`` (``hpml_compile.solve.dp`` -> ``solve``); ``""`` for the
    package root; None outside the package."""
    parts = module.split(".")
    if parts[0] != "hpml_compile":
        return None
    return parts[1] if len(parts) > 1 else ""


def _kind(module: str) -> str | None:
    """The layer of an ``hpml_compile`` module, None when it is not classified."""
    top = _top(module)
    if top is None:
        return None
    if module in MODULE_KIND:
        return MODULE_KIND[module]
    if top == "":
        return "root"
    if top in PASSES:
        return "pass"
    if top in SHARED:
        return "shared"
    if top in VIEWS:
        return "view"
    if top in CLI or top.endswith("_cli"):
        return "cli"
    # ``infer`` plans and runs generation: held to the runtime's rules (no solving but through the driver).
    return {"models": "models", "driver": "driver", "api": "api", "runtime": "runtime", "infer": "runtime",
            "testing": "testing"}.get(top)


def _internal(path: Path) -> dict[str, str]:
    """The ``hpml_compile`` modules ``path`` imports, each with its top component (itself excluded)."""
    me = _top(_module(path))
    out: dict[str, str] = {}
    for m in _imports(path):
        top = _top(m)
        if top is not None and top != me:
            out[m] = top
    return out


def _files(top: str) -> list[Path]:
    return sorted((ROOT / top).rglob("*.py"))


def _id(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("path", _files("cost_models"), ids=_id)
def test_cost_models_import_nothing_from_hpml_compile(path: Path) -> None:
    bad = [m for m in _imports(path) if m.split(".")[0] == "hpml_compile"]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", _files("hpml_compile"), ids=_id)
def test_every_module_is_classified(path: Path) -> None:
    module = _module(path)
    assert _kind(module) is not None, (
        f"{module} belongs to no layer: add its name to PASSES (in pipeline order), SHARED, VIEWS or CLI in "
        f"{Path(__file__).name}, so that its imports are checked")


def _only_data_io(module: str, imported: dict[str, str]) -> bool:
    """True when every name imported from ``module`` is one of the file readers and writers in ``DATA_IO``."""
    names = {m for m in imported if m.startswith(module + ".")}
    return module in DATA_IO or (bool(names) and names <= DATA_IO)


def _forbidden(path: Path) -> list[str]:
    """The imports of ``path`` its layer does not allow, each with the rule it breaks."""
    module = _module(path)
    kind = _kind(module)
    me = _top(module)
    bad: list[str] = []
    imported = _internal(path)
    for m, top in sorted(imported.items()):
        parent = m.rpartition(".")[0]
        if parent != "hpml_compile" and parent in imported:  # ``from x import name``: x is judged, named once
            continue
        if m == "hpml_compile" and any(k.startswith("hpml_compile.") for k in imported):
            continue  # ``from .. import stagecost``: the submodule is judged, not the package
        other = _kind(m)
        if kind == "pass":
            if other == "pass" and PASSES.index(top) > PASSES.index(me):  # type: ignore[arg-type]
                bad.append(f"{m} (a later pass)")
            elif other not in ("pass", "shared"):
                bad.append(f"{m} (a pass imports only shared modules and earlier passes)")
        elif kind == "shared" and other != "shared":
            bad.append(f"{m} (a shared module imports only shared modules)")
        elif kind == "models" and other not in ("shared", "models"):
            bad.append(f"{m} (the model zoo imports only shared modules)")
        elif kind in ("view", "driver") and other in ("runtime", "cli", "driver"):
            bad.append(f"{m} (a {kind} never imports the runtime, the CLIs or the driver)")
        elif kind == "runtime" and top in SOLVING and not _only_data_io(m, imported):
            bad.append(f"{m} (the runtime reaches solving only through hpml_compile.driver)")
        elif other == "testing":
            bad.append(f"{m} (test support: only tests and docstring examples import it)")
        elif kind in ("runtime", "api", "testing") and other == "cli":
            bad.append(f"{m} (the {kind} never imports a CLI)")
        elif kind == "root" and other == "runtime":
            bad.append(f"{m} (importing hpml_compile must not import the runtime)")
    return bad


@pytest.mark.parametrize("path", _files("hpml_compile"), ids=_id)
def test_imports_follow_the_layers(path: Path) -> None:
    module = _module(path)
    bad = _forbidden(path)
    assert not bad, f"{module} ({_kind(module)}) imports " + "; ".join(bad)


def _room(module: str) -> str | None:
    """The runtime room of ``module`` (``hpml_compile.runtime.sync.zero`` -> ``sync``); ``""`` for the
    package face ``hpml_compile.runtime``; None outside the runtime."""
    parts = module.split(".")
    if parts[:2] != ["hpml_compile", "runtime"]:
        return None
    return parts[2] if len(parts) > 2 else ""


def _across(path: Path) -> list[str]:
    """The imports of a runtime room's module that reach up into a later room or back into the face."""
    room = _room(_module(path))
    if not room:
        return []
    bad = []
    for m in sorted(_imports(path)):
        other = _room(m)
        if other is None or other == room:
            continue
        if other == "":
            bad.append(f"{m} (the package face: import the room's module itself)")
        elif other not in ROOMS:
            continue  # ``from hpml_compile.runtime import sync``-style names are judged as the modules they name
        elif ROOMS.index(other) > ROOMS.index(room):
            bad.append(f"{m} (room {other!r} sits above {room!r})")
    return bad


@pytest.mark.parametrize("path", _files("hpml_compile/runtime"), ids=_id)
def test_runtime_rooms_import_down(path: Path) -> None:
    assert _room(_module(path)) in ["", *ROOMS], f"{_module(path)} is in no room of {ROOMS}"
    bad = _across(path)
    assert not bad, f"{_module(path)} imports " + "; ".join(bad)


@pytest.mark.parametrize("path", _files("hpml_compile"), ids=_id)
def test_only_the_driver_assembles_the_compile_chain(path: Path) -> None:
    module = _module(path)
    chain = CHAIN & set(_internal(path).values())
    assert module == "hpml_compile.driver" or chain != CHAIN, (
        f"{module} imports every pass of the compile chain ({', '.join(sorted(CHAIN))}): call "
        "hpml_compile.driver instead of assembling the passes by hand")


def test_the_rules_catch_what_they_should() -> None:
    """The classifier and the rules on made-up imports, so that a rule cannot silently stop applying."""
    assert _kind("hpml_compile.solve.dp") == "pass" and _kind("hpml_compile.replan_cli") == "cli"
    assert _kind("hpml_compile.cli.compile") == "cli" and _kind("hpml_compile.api") == "api"
    assert _kind("hpml_compile") == "root" and _kind("hpml_compile.newthing") is None and _kind("torch") is None
    assert _kind("hpml_compile.runtime.observe.held") == "runtime"  # measures what a rank holds: runtime, not a pass
    assert _kind("hpml_compile.profile.links") == "runtime" and _kind("hpml_compile.profile.static") == "pass"
    assert _kind("hpml_compile.testing") == "testing"
    assert _room("hpml_compile.runtime.sync.zero") == "sync" and _room("hpml_compile.runtime") == ""
    assert ROOMS.index("sync") < ROOMS.index("observe") < ROOMS.index("execute") < ROOMS.index("job")
    assert PASSES.index("costgraph") < PASSES.index("solve") < PASSES.index("replan") < PASSES.index("codegen")
    assert _only_data_io("hpml_compile.profile", {"hpml_compile.profile": "profile",
                                                  "hpml_compile.profile.load_profile": "profile"})
    assert not _only_data_io("hpml_compile.profile", {"hpml_compile.profile": "profile",
                                                      "hpml_compile.profile.load_profile": "profile",
                                                      "hpml_compile.profile.predict_kinds": "profile"})
