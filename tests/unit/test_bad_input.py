"""Bad input: every corrupted profile.json, cluster.json, plan.json and manifest.json is a SchemaError naming the file and field.

The files are the tool's own (a profiled zoo model, a built-in cluster with a
link, a solved plan); hypothesis corrupts them the ways a hand edit or a
hostile user would (a field dropped, a value of the wrong type, NaN or an
infinity in a number, an unknown field, the text cut short) and each load
must end in :class:`~hpml_compile.errors.SchemaError` (an HpmlError, which the
CLI prints without a traceback), never in another exception. Then one test for
each concrete failure found by hand.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpml_compile import driver, models, profile, save_profile
from hpml_compile.cli import main as cli_main
from hpml_compile.cluster import builtin_cluster, load_cluster
from hpml_compile.codegen import generate
from hpml_compile.codegen.manifest import Manifest
from hpml_compile.testing import split_plan
from hpml_compile.errors import SchemaError
from hpml_compile.ir import Cluster, Link, Profile
from hpml_compile.plan import Plan, load_plan, save_plan
from hpml_compile.profile import load_profile
from hpml_compile.schema import read_json, write_json_atomic
from hpml_compile.trace import trace

Path_ = tuple[Any, ...]  # keys and list indices from the top of a JSON document
FAST = settings(max_examples=80, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """profile.json, cluster.json and plan.json as the tool writes them.

    The profile is predicted (a model on the meta device: nothing to time, so
    the fixture takes about a second); test_profile.py round-trips a measured one.
    """
    out = tmp_path_factory.mktemp("good")
    m = models.load("mlp-tiny", device="meta")
    prof = profile(m.module, m.example_inputs, name="mlp-tiny", device_kinds=("A100-80GB", "V100-32GB"),
                   progress=False)
    base = builtin_cluster("hetero-4")
    assert base is not None
    cluster = replace(base, links=(Link("gpu0", "gpu1", 300.0, 3.0),))
    # uneven=False: the solver's own 2-stage plan (the uneven search finds one stage on both A100s faster)
    plan = driver.plan(prof, cluster, driver.Options(solver="dp", uneven=False))
    assert len(plan.stages) >= 2, "the corruptions below need a plan of several stages"
    # a build's manifest: two stages, the first on two replicas (collectives and per-rank action lists)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    gm = trace(net, (torch.randn(4, 8),))
    build = generate(gm, split_plan(gm, "seq", 2, microbatches=2, replicas=[2, 1]), out / "build")
    return {"profile": save_profile(prof, out / "profile.json"),
            "cluster": write_json_atomic(cluster.to_dict(), out / "cluster.json"),
            "plan": save_plan(plan, out / "plan.json"),
            "manifest": build.out_dir / "manifest.json"}


LOADERS: dict[str, Callable[[Path], object]] = {
    "profile": load_profile,
    "cluster": lambda p: load_cluster(str(p)),
    "plan": load_plan,
    "manifest": lambda p: Manifest.from_dict(read_json(p), source=str(p)),
}


def _field(path: Path_) -> str:
    """A path as SchemaError spells a field: ``nodes[3].cost.cpu.fwd_ms``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _paths(doc: Any, at: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    """Every (path, value) below the top of ``doc``."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        yield (*at, k), v
        yield from _paths(v, (*at, k))


def _get(doc: Any, path: Path_) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _wrong_type(value: Any) -> Any:
    """A value of another JSON type that no field holding ``value`` accepts."""
    if isinstance(value, bool):
        return "yes"
    if isinstance(value, (int, float)):
        return "fast"
    if isinstance(value, str):
        return 7
    if isinstance(value, list):
        return "x"
    if isinstance(value, dict):
        return []
    return {"x": 1}  # null, where a field may be null


def _load(kind: str, data: Any, where: Path, *, text: str | None = None) -> SchemaError | None:
    """Write ``data`` (or ``text``) to a file and load it: None if it loads, else the SchemaError.

    Any other exception fails the test, which is the point of this file.
    """
    where.write_text(json.dumps(data, indent=1) if text is None else text)
    try:
        LOADERS[kind](where)
    except SchemaError as e:
        assert e.source == str(where) and str(where) in str(e), f"the message does not name the file: {e}"
        return e
    return None


@st.composite
def corruptions(draw: st.DrawFn, doc: dict[str, Any]) -> tuple[str, Path_, Any]:
    """(what, path, new value) for one corruption of ``doc``."""
    paths = list(_paths(doc))
    what = draw(st.sampled_from(["drop", "type", "nan", "extra", "truncate"]))
    if what == "nan":
        numbers = [p for p, v in paths if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return what, draw(st.sampled_from(numbers)), draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    if what == "extra":
        objects = [()] + [p for p, v in paths if isinstance(v, dict)]
        return what, draw(st.sampled_from(objects)), draw(st.sampled_from(["colour", "fwd_msec", "Name"]))
    if what == "truncate":
        return what, (), draw(st.integers(0, len(json.dumps(doc, indent=1)) - 1))
    path, value = draw(st.sampled_from(paths))
    return what, path, _wrong_type(value) if what == "type" else None


def _check_corruption(kind: str, good: Path, tmp: Path, what: str, path: Path_, new: Any) -> None:
    doc = json.loads(good.read_text())
    bad = tmp / f"bad-{kind}.json"
    if what == "truncate":
        err = _load(kind, None, bad, text=json.dumps(doc, indent=1)[:new])
        assert err is not None and "valid JSON" in str(err) and "line " in err.field, err
        return
    parent = _get(doc, path[:-1]) if path else doc
    if what == "drop":
        del parent[path[-1]]
    elif what == "extra":
        _get(doc, path)[new] = "surplus"
        path = (*path, new)
    else:
        parent[path[-1]] = new
    err = _load(kind, doc, bad)
    if what == "drop":  # an optional field or a list item may go; a required one is named
        if err is not None and err.expected == "a required field":
            assert err.field == _field(path), err
        return
    assert err is not None, f"{what} at {_field(path)} was accepted"
    assert err.field == _field(path), f"{what} at {_field(path)}: {err}"
    if what == "nan":
        assert err.got in ("NaN", "Infinity", "-Infinity") and "finite" in err.expected


@pytest.mark.parametrize("kind", ["profile", "cluster", "plan", "manifest"])
def test_corrupted_file_is_a_schema_error_naming_file_and_field(kind: str, files: dict[str, Path],
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    good = files[kind]
    tmp = tmp_path_factory.mktemp(f"bad-{kind}")
    assert _load(kind, json.loads(good.read_text()), tmp / "same.json") is None, "the tool's own file must load"

    @FAST
    @given(corruptions(json.loads(good.read_text())))
    def check(c: tuple[str, Path_, Any]) -> None:
        _check_corruption(kind, good, tmp, *c)

    check()


@pytest.mark.parametrize("kind", ["profile", "cluster", "plan"])  # manifest.json holds no floats
def test_python_dicts_with_nan_are_refused_too(kind: str, files: dict[str, Path]) -> None:
    """from_dict checks finiteness itself: a dict built in Python never passes through read_json."""
    doc = json.loads(files[kind].read_text())
    make: dict[str, Callable[[Any], object]] = {"profile": lambda d: Profile.from_dict(d, "p"),
                                                "cluster": lambda d: Cluster.from_dict(d, "c"),
                                                "plan": lambda d: Plan.from_dict(d, "pl")}
    numbers = [p for p, v in _paths(doc) if isinstance(v, float)]
    assert numbers
    for path in numbers[:: max(1, len(numbers) // 20)]:
        d = copy.deepcopy(doc)
        _get(d, path[:-1])[path[-1]] = float("nan")
        with pytest.raises(SchemaError, match="finite") as err:
            make[kind](d)
        assert err.value.field == _field(path)


# The concrete failures found by hand, one test each.

def test_unknown_field_in_cluster_json(tmp_path: Path) -> None:
    c = builtin_cluster("hetero-4")
    assert c is not None
    d = c.to_dict()
    d["devices"][2]["nvlink"] = True  # was: TypeError: Device.__init__() got an unexpected keyword argument
    path = write_json_atomic(d, tmp_path / "cluster.json")
    with pytest.raises(SchemaError) as err:
        load_cluster(str(path))
    assert str(err.value).startswith(f"{path}: devices[2].nvlink: expected one of the fields name, kind")
    assert "unknown field" in str(err.value)


def test_nan_cost_in_profile_json(files: dict[str, Path], tmp_path: Path) -> None:
    text = files["profile"].read_text()
    doc = json.loads(text)
    doc["nodes"][2]["cost"]["A100-80GB"]["fwd_ms"] = float("nan")  # was accepted, then "no plan fits"
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    assert '"fwd_ms": NaN' in path.read_text()
    with pytest.raises(SchemaError, match=r"nodes\[2\]\.cost\.A100-80GB\.fwd_ms: expected a finite number.*got NaN"):
        load_profile(path)


def test_infinity_in_a_json_file_or_a_number_too_large(files: dict[str, Path], tmp_path: Path) -> None:
    text = files["cluster"].read_text()
    path = tmp_path / "cluster.json"
    path.write_text(text.replace('"memory_gib": 80', '"memory_gib": Infinity', 1))
    with pytest.raises(SchemaError, match=r"devices\[0\]\.memory_gib: expected a finite number.*got Infinity"):
        load_cluster(str(path))
    path.write_text(text.replace('"memory_gib": 80', '"memory_gib": 1e999', 1))  # json reads this as inf
    with pytest.raises(SchemaError, match=r"devices\[0\]\.memory_gib: expected a finite number"):
        load_cluster(str(path))


def _plan_file(files: dict[str, Path], tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    doc = json.loads(files["plan"].read_text())
    edit(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def test_node_in_two_stages(files: dict[str, Path], tmp_path: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["stages"][1]["nodes"].append(d["stages"][0]["nodes"][-1])
    path = _plan_file(files, tmp_path, edit)  # was: drawn by show (exit 0), ValueError in replan
    with pytest.raises(SchemaError, match=r"stages\[1\]\.nodes\[\d+\]: expected a node that no other stage holds, "
                                          r"got '.+', which stage 0 holds too; keep .+ in one stage"):
        load_plan(path)


def test_stage_on_a_device_not_in_the_cluster(files: dict[str, Path], tmp_path: Path) -> None:
    path = _plan_file(files, tmp_path, lambda d: d["stages"][1]["devices"].__setitem__(0, "gpu9"))  # was: KeyError
    with pytest.raises(SchemaError, match=r"stages\[1\]\.devices\[0\]: expected a device of the plan's cluster "
                                          r"\(gpu0, gpu1, gpu2, gpu3\), got 'gpu9'; place stage 1 on one of them"):
        load_plan(path)


def test_same_device_in_two_stages(files: dict[str, Path], tmp_path: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["stages"][1]["devices"] = [d["stages"][0]["devices"][0]]
    path = _plan_file(files, tmp_path, edit)  # was: ValueError: max() arg is an empty sequence
    with pytest.raises(SchemaError, match=r"stages\[1\]\.devices\[0\]: expected a device that no other stage uses, "
                                          r"got '.+', which stage 0 uses too; give stage 1 a device of its own"):
        load_plan(path)


def test_stage_without_nodes_and_stages_out_of_order(files: dict[str, Path], tmp_path: Path) -> None:
    path = _plan_file(files, tmp_path, lambda d: d["stages"][1].__setitem__("nodes", []))
    with pytest.raises(SchemaError, match=r"stages\[1\]\.nodes: expected at least one fx node, got none; move nodes"):
        load_plan(path)
    path = _plan_file(files, tmp_path, lambda d: d["stages"][1].__setitem__("index", 0))
    with pytest.raises(SchemaError, match=r"stages\[1\]\.index: expected 1 \(stages are listed in pipeline order\)"):
        load_plan(path)


def test_show_refuses_a_bad_plan_without_a_traceback(files: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["stages"][1]["nodes"].append(d["stages"][0]["nodes"][-1])
    path = _plan_file(files, tmp_path, edit)
    (tmp_path / "profile.json").write_text(files["profile"].read_text())  # what show looks for next to the plan
    assert cli_main(["show", str(path), "-o", str(tmp_path / "pictures")]) == 2  # was: drawn, exit 0
    err = capsys.readouterr().err
    assert f"hpml-compile show: error: {path}: stages[1].nodes" in err and "Traceback" not in err
