"""JSON schemas of the files a user keeps, and loading them safely.

Files are plain JSON with a ``schema_version``; loading never runs code (no
pickle). Structural checks use ``jsonschema`` (a well-kept validator; we only
format its verdict so that the message names the field, e.g.
``profile.json: nodes[3].cost.cpu.fwd_ms: expected a number, got 'fast'``).

Example:
    >>> validate({"schema_version": 1}, CLUSTER_SCHEMA, "cluster.json")
    Traceback (most recent call last):
    ...
    hpml_compile.errors.SchemaError: cluster.json: devices: expected a required field, got nothing
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

import jsonschema

from .errors import SchemaError

__all__ = [
    "PROFILE_SCHEMA",
    "CLUSTER_SCHEMA",
    "validate",
    "read_json",
    "write_json_atomic",
    "check_version",
]

_NUM = {"type": "number", "minimum": 0}
_INT = {"type": "integer", "minimum": 0}

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

PROFILE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema_version", "model", "batch_size", "dtype", "nodes"],
    "properties": {
        "schema_version": {"type": "integer"},
        "model": {"type": "string"},
        "batch_size": {"type": "integer", "minimum": 1},
        "seq_len": {"type": ["integer", "null"], "minimum": 1},
        "dtype": {"enum": ["float32", "float16", "bfloat16", "float64"]},
        "front_end": {"enum": ["fx", "export"]},
        "backward_timing": {"enum": ["per_node", "apportioned", "predicted"]},
        "repeats": _INT,
        "warmup": _INT,
        "devices": {"type": "object", "additionalProperties": {"type": "object"}},
        "totals": {"type": "object", "additionalProperties": _NODE_COST},
        "micro_batch": {"type": ["integer", "null"], "minimum": 1},
        "loss": {"type": ["string", "null"]},
        "optimizer": {"type": ["string", "null"]},
        "optimizer_ms": {"type": "object", "additionalProperties": _NUM},
        "parameters": {"type": "object", "additionalProperties": _INT},
        "nodes": {
            "type": "array",
            "items": {
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
                    "target": {"type": "string"},
                    "inputs": {"type": "array", "items": {"type": "string"}},
                    "scope": {"type": "string"},
                    "op_kind": {"type": "string"},
                    "flops": _INT,
                    "bwd_flops": _INT,
                    "param_bytes": _INT,
                    "params": {"type": "array", "items": {"type": "string"}},
                    "output_bytes": _INT,
                    "activation_bytes": _INT,
                    "mem_bytes": _INT,
                    "output_shape": {"type": ["array", "null"]},
                    "output_dtype": {"type": ["string", "null"]},
                    "tensor_output": {"type": "boolean"},
                    "cost": {"type": "object", "additionalProperties": _NODE_COST},
                },
            },
        },
    },
}

CLUSTER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema_version", "devices"],
    "properties": {
        "schema_version": {"type": "integer"},
        "name": {"type": "string"},
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
                    "host": {"type": "string"},
                },
            },
        },
        "links": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["a", "b", "gbps"],
                "properties": {
                    "a": {"type": "string"},
                    "b": {"type": "string"},
                    "gbps": {"type": "number", "exclusiveMinimum": 0},
                    "latency_us": _NUM,
                },
            },
        },
    },
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
    if kind in ("minimum", "exclusiveMinimum"):
        return f"a value {'>=' if kind == 'minimum' else '>'} {value}"
    if kind in ("minItems", "minLength"):
        return f"at least {value} item(s)"
    return f"{kind} {value!r}"


def validate(data: Any, schema: Mapping[str, Any], source: str) -> None:
    """Check ``data`` against ``schema``; raise SchemaError naming the first bad field.

    Raises:
        SchemaError: with the dotted field path, what was expected and what was found.
    """
    validator = jsonschema.Draft7Validator(schema)
    err = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if err is None:
        return
    if err.validator == "required":
        missing = next((k for k in err.validator_value if k not in err.instance), "?")
        path = _field_path([*err.absolute_path, missing])
        raise SchemaError(source, path, "a required field", "nothing")
    raise SchemaError(source, _field_path(err.absolute_path), _expected(err), repr(err.instance)[:80])


def check_version(data: Mapping[str, Any], supported: int | tuple[int, ...], source: str) -> None:
    """Reject files written by an unknown schema version, by name (``supported``: one version or several)."""
    versions = (supported,) if isinstance(supported, int) else tuple(supported)
    version = data.get("schema_version")
    if version not in versions:
        text = " or ".join(map(str, versions))
        raise SchemaError(source, "schema_version", f"{text} (this hpml-compile reads version {text})",
                          repr(version))


def read_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file; a missing file or bad JSON becomes a SchemaError naming the file."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SchemaError(str(p), "(file)", "an existing JSON file", "no such file") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SchemaError(str(p), f"line {e.lineno} column {e.colno}", "valid JSON", e.msg) from None


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
