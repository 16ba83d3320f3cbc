"""JSON schemas of the files a user keeps, and loading them safely.

Files are plain JSON with a ``schema_version``; loading never runs code (no
pickle). Structural checks use ``jsonschema`` (a well-kept validator; we only
format its verdict so that the message names the field, e.g.
``profile.json: nodes[3].cost.cpu.fwd_ms: expected a number, got 'fast'``).
The schemas are closed (``additionalProperties: false`` at every level): a
misspelt or foreign field is named rather than ignored or passed on to a
constructor. Numbers must be finite: Python's json reads ``NaN`` and
``Infinity``, which would pass every ``minimum`` (:func:`check_finite`).

Example:
    >>> validate({"schema_version": 1}, CLUSTER_SCHEMA, "cluster.json")
    Traceback (most recent call last):
    ...
    hpml_compile.errors.SchemaError: cluster.json: devices: expected a required field, got nothing
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from .errors import SchemaError

if TYPE_CHECKING:  # imported by validate(), its one user: a process that writes JSON or only asks --help needs none
    import jsonschema

__all__ = [
    "PROFILE_SCHEMA",
    "CLUSTER_SCHEMA",
    "validate",
    "check_finite",
    "read_json",
    "write_json_atomic",
    "check_version",
]

_NUM = {"type": "number", "minimum": 0}
_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}
_FWD_BWD = {  # a pair of forward/backward ratios
    "type": "object",
    "required": ["fwd", "bwd"],
    "properties": {"fwd": _NUM, "bwd": _NUM},
    "additionalProperties": False,
}

_NODE_COST = {
    "type": "object",
    "required": ["fwd_ms", "bwd_ms", "measured"],
    "properties": {
        "fwd_ms": _NUM,
        "bwd_ms": _NUM,
        "measured": {"type": "boolean"},
        "fwd_spread_ms": _NUM,
        "bwd_spread_ms": _NUM,
        "fwd_fixed_ms": _NUM,
        "bwd_fixed_ms": _NUM,
    },
    "additionalProperties": False,
}

# cost_models.Calibration.to_dict, kept in profile.devices[kind] by predict_kinds.
_FIT = {"type": "object", "required": ["gbps", "latency_us"],
        "properties": {"gbps": {"type": "number", "exclusiveMinimum": 0}, "latency_us": _NUM},
        "additionalProperties": False}
# a link's own fits for the collectives its backend runs slower than the ring (cost_models LinkSpec.collectives)
COLLECTIVE_FITS = {"type": "object", "properties": {"reduce_scatter": _FIT, "all_gather": _FIT, "all_reduce": _FIT,
                                                    "param_gather": _FIT, "tp_gather": _FIT,
                                                    "tp_reduce": _FIT},
                   "additionalProperties": False}
_CALIBRATION = {
    "type": "object",
    "required": ["version", "device_kind", "dtype", "overhead_ms", "multipliers"],
    "properties": {
        "version": {"type": "integer"},
        "device_kind": _STR,
        "dtype": _STR,
        "overhead_ms": _NUM,
        "multipliers": {"type": "object", "additionalProperties": _NUM},
    },
    "additionalProperties": False,
}

# What profile.devices[kind] says about a device kind: written by profile (measured: the device,
# memory stream rates, scaling to the blocks timed in sequence, the segments, identical blocks and
# re-measurements, a believed out-of-range scale; for the CPU, the host: model name, caches, CPUs, the co-run
# slow-down), predict_kinds (predicted_from, calibrations)
# and the runtime's measured profiles (measured_from, and for a slow device's variant kind its
# device, base_kind and slowdown).
_DEVICE_INFO = {
    "type": "object",
    "properties": {
        "measured": {"type": "boolean"},
        "device": _STR,
        "stream_gbps": _NUM,
        # a CPU rank's baseline resident set before the model, and what a replicated step pays besides it
        # (profile/process.py)
        "process": {"type": "object", "required": ["bytes"],
                    "properties": {"bytes": _INT, "step_ms": _NUM, "executor_ms": _NUM, "agree_ms": _NUM, "agree_per_ms": _NUM,
                                   "meet_ms": _NUM, "meet_per_ms": _NUM, "skew_ms": _NUM, "fit_compute_ms": _NUM,
                                   "skew_per_ms": _NUM, "step_per_ms": _NUM, "source": _STR, "recv_cpu_ms": _NUM,
                                   "stage_only": {"type": "boolean"}}, "additionalProperties": False},
        "host_stream_gbps": _NUM,
        "stream_threads": _INT,
        "scaled_to_whole": _FWD_BWD,
        "scaled_to_whole_micro": _FWD_BWD,
        "segments": _INT,
        "identical_blocks": _INT,
        "remeasured": _INT,
        "scale_note": _STR,
        "scale_note_micro": _STR,
        "cpu_model": _STR,
        "cache_bytes": {"type": "object", "additionalProperties": _INT},
        "cpus": _INT,
        "optimizer_flat_ms": _NUM,  # one optimizer step over the parameters' bytes as one tensor (a ZeRO shard)
        # the blocks' slow-down while other processes run them on the host's other cores (profile.corun.time_corun)
        "corun": {"type": "object",
                  "properties": {"fwd": _NUM, "bwd": _NUM, "ranks": {"type": "integer", "minimum": 2},
                                 "rounds": {"type": "array", "items": {"type": "array", "items": _NUM}},
                                 "clock": _STR, "wall": {"type": "array", "items": _NUM},
                                 "cpu": {"type": "array", "items": _NUM}, "others": _NUM, "skipped": _STR},
                  "additionalProperties": False},
        # the optimizer step's slow-down while other processes step theirs (profile.optcorun.time_optimizer_corun)
        "optimizer_corun": {"type": "object",
                            "properties": {"ratio": _NUM, "ranks": {"type": "integer", "minimum": 2},
                                           "rounds": {"type": "array", "items": _NUM}, "clock": _STR,
                                           "others": _NUM, "skipped": _STR},
                            "additionalProperties": False},
        # the blocks timed compiled by torch.compile (profile/compiled.py): how, and which fell back to eager
        "compiled": {"type": "object",
                     "properties": {"blocks": _INT, "distinct": _INT, "compile_s": _NUM, "call_fwd_ms": _NUM,
                                    "call_bwd_ms": _NUM, "rows": {"type": "array", "items": _INT},
                                    "ratios": {"type": "object", "additionalProperties": {
                                        "type": "array", "items": _NUM}},
                                    "fallbacks": {"type": "object", "additionalProperties": _STR}},
                     "additionalProperties": False},
        # each block's ZB-H1 split: [first node, weight-gradient share, extra ms per microbatch] (profile/split.py)
        "split": {"type": "object",
                  "properties": {"rows": _INT, "skipped": _STR,
                                 "blocks": {"type": "array", "items": {
                                     "type": "array", "minItems": 3, "maxItems": 3,
                                     "items": [_STR, {"type": "number", "minimum": 0, "maximum": 1},
                                                     {"type": "number", "minimum": 0}]}}},
                  "additionalProperties": False},
        "predicted_from": _STR,
        "op_ms": _NUM,  # the per-op host cost the GPU predictions were given (profile.predict_kinds)
        "calibration_fwd": _CALIBRATION,
        "calibration_bwd": _CALIBRATION,
        "measured_from": _STR,
        "base_kind": _STR,
        "slowdown": _NUM,
        # the link between two processes of this host, measured when profiling (profile/links.py): what plans
        # for CPU devices of one host use where their cluster names no link
        "link": {"type": "object", "required": ["gbps", "latency_us"],
                 "properties": {"gbps": _NUM, "latency_us": _NUM, "shared": {"type": "boolean"}, "source": _STR,
                                "collectives": COLLECTIVE_FITS, "tp_reduce_per_ms": _NUM},
                 "additionalProperties": False},
    },
    "additionalProperties": False,
}

_PROFILE_NODE = {
    "type": "object",
    "required": [
        "name", "op", "target", "inputs", "flops", "param_bytes",
        "output_bytes", "activation_bytes", "cost",
    ],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "op": {"enum": [
            "placeholder", "get_attr", "call_function",
            "call_method", "call_module", "output",
        ]},
        "target": _STR,
        "inputs": {"type": "array", "items": _STR},
        "scope": _STR,
        "op_kind": _STR,
        "flops": _INT,
        "bwd_flops": _INT,
        "param_bytes": _INT,
        "params": {"type": "array", "items": _STR},
        "output_bytes": _INT,
        "activation_bytes": _INT,
        "mem_bytes": _INT,
        "output_shape": {"type": ["array", "null"], "items": _INT},
        "output_dtype": {"type": ["string", "null"]},
        "tensor_output": {"type": "boolean"},
        "cost": {"type": "object", "additionalProperties": _NODE_COST},
        "compiled": {"type": "object", "additionalProperties": _NODE_COST},  # its cost in a compiled stage
    },
    "additionalProperties": False,
}

PROFILE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema_version", "model", "batch_size", "dtype", "nodes"],
    "properties": {
        "schema_version": {"type": "integer"},
        "model": _STR,
        "batch_size": {"type": "integer", "minimum": 1},
        "seq_len": {"type": ["integer", "null"], "minimum": 1},
        "dtype": {"enum": ["float32", "float16", "bfloat16", "float64"]},
        "front_end": {"enum": ["fx", "export"]},
        "backward_timing": {"enum": ["per_node", "apportioned", "predicted"]},
        "repeats": _INT,
        "warmup": _INT,
        "devices": {"type": "object", "additionalProperties": _DEVICE_INFO},
        "totals": {"type": "object", "additionalProperties": _NODE_COST},
        "micro_batch": {"type": ["integer", "null"], "minimum": 1},
        "loss": {"type": ["string", "null"]},
        "optimizer": {"type": ["string", "null"]},
        "optimizer_ms": {"type": "object", "additionalProperties": _NUM},
        "parameters": {"type": "object", "additionalProperties": _INT},
        "threads": {"type": ["integer", "null"], "minimum": 1},
        "precision": {"enum": ["fp32", "bf16", "fp16"]},  # optional: files before it are fp32
        "nodes": {"type": "array", "items": _PROFILE_NODE},
    },
    "additionalProperties": False,
}

CLUSTER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema_version", "devices"],
    "properties": {
        "schema_version": {"type": "integer"},
        "name": _STR,
        "devices": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "kind", "memory_gib"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "kind": {"type": "string", "minLength": 1},
                    "memory_gib": {"type": "number", "exclusiveMinimum": 0},
                    "host": _STR,
                },
                "additionalProperties": False,
            },
        },
        "links": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["a", "b", "gbps"],
                "properties": {
                    "a": _STR,
                    "b": _STR,
                    "gbps": {"type": "number", "exclusiveMinimum": 0},
                    "latency_us": _NUM,
                    "shared": {"type": "boolean"},
                    "source": {"type": "string"},
                    "collectives": COLLECTIVE_FITS,
                    "tp_reduce_per_ms": _NUM,
                },
                "additionalProperties": False,
            },
        },
        "hosts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "fabric": _STR,
                    "nic": _STR,
                    "nics": {"type": "integer", "minimum": 1},
                    "nic_gbps": {"type": "number", "exclusiveMinimum": 0},
                },
                "additionalProperties": False,
            },
        },
    },
    "additionalProperties": False,
}

_TYPE_WORDS = {
    "number": "a number", "integer": "an integer", "string": "a string",
    "boolean": "true or false", "object": "an object", "array": "a list",
    "null": "null",
}


def _field_path(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _expected(err: jsonschema.ValidationError) -> str:
    kind, value = err.validator, err.validator_value
    if kind == "type":
        kinds = value if isinstance(value, list) else [value]
        return " or ".join(_TYPE_WORDS.get(k, k) for k in kinds)
    if kind == "enum":
        return "one of " + ", ".join(repr(v) for v in value)
    if kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        op = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[kind]
        return f"a value {op} {value}"
    if kind in ("minItems", "minLength"):
        return f"at least {value} item(s)"
    return f"{kind} {value!r}"


def _json_number(x: float) -> str:
    """How JSON (as Python's json module writes it) spells a non-finite float."""
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def check_finite(data: Any, source: str) -> None:
    """Reject NaN and infinities anywhere in ``data`` (JSON numbers must be finite).

    Python's json reads and writes ``NaN``, ``Infinity`` and ``-Infinity``, and a
    number too large for a float (``1e999``) reads as infinity; none of them is a
    cost, a size or a time, and a schema's ``minimum`` lets them all through.

    Args:
        data: parsed JSON, or a dict built in Python.
        source: the file or object, for the message.

    Raises:
        SchemaError: naming the field of the first non-finite number.
    """
    todo: list[tuple[Any, tuple[Any, ...]]] = [(data, ())]
    while todo:  # iterative: a hostile file may nest deeper than Python's recursion limit
        x, path = todo.pop()
        if isinstance(x, float) and not math.isfinite(x):
            raise SchemaError(source, _field_path(path), "a finite number (JSON has no NaN or infinity)",
                              _json_number(x))
        if isinstance(x, Mapping):
            todo.extend((v, (*path, k)) for k, v in reversed(list(x.items())))
        elif isinstance(x, (list, tuple)):
            todo.extend((v, (*path, i)) for i, v in reversed(list(enumerate(x))))


def _jsonschema() -> Any:
    """The ``jsonschema`` module, imported without its optional ``rfc3987_syntax`` IRI checks.

    Where ``rfc3987-syntax`` is installed (``jsonschema[format-nongpl]``, which Jupyter brings), importing
    ``jsonschema`` builds that package's 39 Earley grammars: about 1 s of CPU in every process that loads a
    plan, profile or cluster, each rank of a job included, more than importing torch takes on a busy host.
    The schemas here name no ``format`` and the validator checks none, so the import hides that package
    for its duration (an entry of None in ``sys.modules`` reads as not installed) and puts it back after:
    a later ``import rfc3987_syntax`` works as usual; only ``jsonschema``'s optional ``iri`` format checks
    are then absent in this process.
    """
    if "jsonschema" in sys.modules:
        return sys.modules["jsonschema"]
    hide = "rfc3987_syntax" not in sys.modules
    if hide:
        sys.modules["rfc3987_syntax"] = None  # type: ignore[assignment]
    try:
        import jsonschema
    finally:
        if hide and sys.modules.get("rfc3987_syntax", 0) is None:
            del sys.modules["rfc3987_syntax"]
    return jsonschema


def validate(data: Any, schema: Mapping[str, Any], source: str) -> None:
    """Check ``data`` against ``schema``; raise SchemaError naming the first bad field.

    Numbers must also be finite (:func:`check_finite`), whether ``data`` came
    from a file or was built in Python; a field the schema does not name is an
    error (a misspelt field would otherwise be ignored, or crash a constructor).

    Args:
        data: parsed JSON.
        schema: a JSON schema (draft 7).
        source: the file or object, for the message.

    Raises:
        SchemaError: with the dotted field path, what was expected and what was found.
    """
    jsonschema = _jsonschema()
    check_finite(data, source)
    validator = jsonschema.Draft7Validator(schema)
    err = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if err is None:
        return
    if err.validator == "required":
        missing = next((k for k in err.validator_value if k not in err.instance), "?")
        path = _field_path([*err.absolute_path, missing])
        raise SchemaError(source, path, "a required field", "nothing")
    if err.validator == "additionalProperties" and err.validator_value is False:
        known = list(err.schema.get("properties", {}))
        extra = next(k for k in err.instance if k not in known)
        raise SchemaError(source, _field_path([*err.absolute_path, extra]),
                          f"one of the fields {', '.join(known)}", "an unknown field",
                          fix="remove it or correct its spelling")
    raise SchemaError(source, _field_path(err.absolute_path), _expected(err), repr(err.instance)[:80])


def check_version(data: Any, supported: int | tuple[int, ...], source: str) -> None:
    """Reject files written by an unknown schema version, by name.

    Called before :func:`validate`, so that a file from a newer hpml-compile
    is refused for its version rather than for the fields that version added.

    Args:
        data: parsed JSON.
        supported: one version or several.
        source: the file or object, for the message.

    Raises:
        SchemaError: if ``data`` is not an object or its ``schema_version`` is not supported.
    """
    if not isinstance(data, Mapping):
        raise SchemaError(source, "(top level)", "a JSON object", type(data).__name__)
    versions = (supported,) if isinstance(supported, int) else tuple(supported)
    version = data.get("schema_version")
    if version not in versions or isinstance(version, bool):
        text = " or ".join(map(str, versions))
        got = "nothing" if "schema_version" not in data else repr(version)[:80]
        raise SchemaError(source, "schema_version", f"{text} (this hpml-compile reads version {text})", got)


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file that holds only finite numbers.

    Args:
        path: the file.

    Returns:
        The parsed JSON.

    Raises:
        SchemaError: naming the file, for a missing or unreadable file, text that
            is not JSON (with its line and column), or a NaN or infinity (with its field).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SchemaError(str(p), "(file)", "an existing JSON file", "no such file") from None
    except UnicodeDecodeError as e:
        raise SchemaError(str(p), f"byte {e.start}", "UTF-8 text", "bytes that are not UTF-8") from None
    except OSError as e:
        raise SchemaError(str(p), "(file)", "a readable JSON file", e.strerror or type(e).__name__) from None
    try:
        data = json.loads(text, parse_constant=_constant)
    except json.JSONDecodeError as e:
        raise SchemaError(str(p), f"line {e.lineno} column {e.colno}", "valid JSON", e.msg) from None
    except RecursionError:
        raise SchemaError(str(p), "(top level)", "JSON nested less than a few hundred levels deep",
                          "deeper nesting") from None
    check_finite(data, str(p))
    return data


def _constant(name: str) -> float:
    # json calls this for the non-standard literals NaN, Infinity and -Infinity; they become floats here
    # and check_finite then names the field that holds one (json itself does not say where it was).
    return float(name)


def write_json_atomic(data: Any, path: str | os.PathLike[str]) -> Path:
    """Write JSON so that a crash mid-write leaves any previous file whole.

    The text goes to a temporary file in the same folder, is fsynced, then
    renamed over the target (rename is atomic on POSIX).
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
