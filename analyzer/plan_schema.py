"""The Plan's JSON Schema, derived from the Plan's own dataclasses, and a checker for it.

``kvskill analyze --format json`` and a converted directory's ``kvskill_plan.json`` hold a
Plan; agents and tools that read or write one by hand need its shape without reading this
package. The schema is built from the type hints of ``Plan`` and its records, so it cannot
drift from the code: a field added to ``Plan`` is in the schema the next time it is printed.
Keys may be added freely (the design's contract: never renamed), so objects accept keys the
schema does not name.

The checker covers the part of JSON Schema (draft 2020-12) the generated schema uses:
``type``, ``enum``, ``properties``, ``required``, ``additionalProperties``, ``items``,
``anyOf`` and local ``$ref``. It exists so tests and ``verify`` can check a plan without a
JSON Schema library.
"""

from __future__ import annotations

import copy
import functools
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from enum import Enum
from typing import Any

from kvskill.analyzer.plan import Plan

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def plan_schema() -> dict[str, Any]:
    """The JSON Schema of a Plan as ``Plan.to_dict()`` writes it (a new dict each call)."""
    return copy.deepcopy(_plan_schema())


@functools.cache
def _plan_schema() -> dict[str, Any]:
    defs: dict[str, Any] = {}
    root = _record_schema(Plan, defs)
    return {
        "$schema": SCHEMA_DIALECT,
        "title": "kvskill Plan",
        **root,
        "description": (
            "The analyzer's decisions about a model's KV cache, with evidence "
            "(kvskill analyze --format json; kvskill_plan.json). Keys are added, never renamed."
        ),
        "$defs": dict(sorted(defs.items())),
    }


def _record_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    doc = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    properties = {f.name: _type_schema(hints[f.name], defs) for f in fields(cls)}
    required = [
        f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    ]
    return {
        "type": "object",
        "description": doc,
        "properties": properties,
        "required": required,
        "additionalProperties": True,
    }


def _type_schema(hint: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return {}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_type_schema(arg, defs) for arg in args]}
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0], defs)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(args[1], defs)}
    if isinstance(hint, type) and issubclass(hint, Enum):
        return {"type": "string", "enum": [member.value for member in hint]}
    if isinstance(hint, type) and is_dataclass(hint):
        if hint.__name__ not in defs:
            defs[hint.__name__] = {}  # a placeholder first: records may nest
            defs[hint.__name__] = _record_schema(hint, defs)
        return {"$ref": f"#/$defs/{hint.__name__}"}
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    raise TypeError(f"no JSON Schema for the Plan field type {hint!r}")


def schema_errors(instance: Any, schema: dict[str, Any] | None = None) -> list[str]:
    """Why INSTANCE does not match SCHEMA (the Plan's by default): one line per problem,
    each naming the JSON path (``$.layers[2].attn_type``); empty when it matches."""
    root = _plan_schema() if schema is None else schema
    errors: list[str] = []
    _check(instance, root, root, "$", errors)
    return errors


def _check(value: Any, schema: dict[str, Any], root: dict[str, Any], where: str, errors) -> None:
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        _check(value, root["$defs"][name], root, where, errors)
        return
    if "anyOf" in schema:
        if not any(not _sub_errors(value, option, root, where) for option in schema["anyOf"]):
            errors.append(f"{where}: {_short(value)} matches none of the allowed forms")
        return
    kind = schema.get("type")
    if kind is not None and not _is_type(value, kind):
        errors.append(f"{where}: expected {kind}, got {_json_type(value)}")
        return
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(map(str, schema["enum"]))
        errors.append(f"{where}: {_short(value)} is not one of {allowed}")
    if kind == "array":
        for index, item in enumerate(value):
            _check(item, schema.get("items", {}), root, f"{where}[{index}]", errors)
    if kind == "object":
        _check_object(value, schema, root, where, errors)


def _check_object(value: dict, schema: dict[str, Any], root: dict[str, Any], where: str, errors):
    for name in schema.get("required", []):
        if name not in value:
            errors.append(f"{where}: missing key {name!r}")
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in properties:
            _check(item, properties[key], root, f"{where}.{key}", errors)
        elif extra is False:
            errors.append(f"{where}: unexpected key {key!r}")
        elif isinstance(extra, dict):
            _check(item, extra, root, f"{where}.{key}", errors)


def _sub_errors(value: Any, schema: dict[str, Any], root: dict[str, Any], where: str) -> list:
    found: list[str] = []
    _check(value, schema, root, where, found)
    return found


def _is_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python = {"string": str, "boolean": bool, "null": type(None), "array": list, "object": dict}
    return isinstance(value, python[kind])


def _json_type(value: Any) -> str:
    for kind in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _is_type(value, kind):
            return kind
    return type(value).__name__


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["plan_schema", "schema_errors"]
