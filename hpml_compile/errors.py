"""The errors hpml-compile raises on bad input.

Every message states the rule that was broken, the values involved and what
would fix it, so that the CLI can print it as-is (no traceback) and exit 2.

>>> raise SchemaError("profile.json", "nodes[3].cost.A100-80GB.fwd_ms", "a number", "'fast'")
Traceback (most recent call last):
...
hpml_compile.errors.SchemaError: profile.json: nodes[3].cost.A100-80GB.fwd_ms: expected a number, got 'fast'
"""

from __future__ import annotations

__all__ = [
    "HpmlError",
    "SchemaError",
    "TraceError",
    "ModelError",
    "UnknownDeviceError",
    "InfeasibleError",
    "BuildMismatchError",
]


class HpmlError(Exception):
    """Base class: a user-facing error whose message says what to do."""


class SchemaError(HpmlError):
    """A JSON file (profile, cluster, plan) does not match its schema.

    Args:
        source: the file or object being read, e.g. ``"profile.json"``.
        field: the path of the bad field, e.g. ``"nodes[3].cost.cpu.fwd_ms"``.
        expected: what the field should hold.
        got: what it holds (already formatted).
        fix: what would mend it, appended after a semicolon (optional).
    """

    def __init__(self, source: str, field: str, expected: str, got: str, fix: str = "") -> None:
        self.source, self.field, self.expected, self.got, self.fix = source, field, expected, got, fix
        super().__init__(f"{source}: {field}: expected {expected}, got {got}" + (f"; {fix}" if fix else ""))


class TraceError(HpmlError):
    """A model could not be traced into a graph (names the module and line)."""


class ModelError(HpmlError):
    """A model name, factory or its example inputs are not usable."""


class UnknownDeviceError(HpmlError):
    """A device kind is in neither the profile nor the cost_models catalog."""


class InfeasibleError(HpmlError):
    """No plan fits the devices' memory (names each device and its shortfall)."""


class BuildMismatchError(HpmlError):
    """A build folder no longer matches its model or its own manifest."""
