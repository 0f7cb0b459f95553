"""Parse ATen ``func:`` schema lines (as torch_npu's codegen yaml writes them) into parameters.

Only what the conformance tests need: each argument's name, type, kind (positional or
keyword-only, from the ``*`` separator) and its default converted to a Python value. ATen's
``self`` is bound as ``input`` by the Python argument parser, so it is renamed here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "npu_schemas.json"

#: marks "this argument has no default" (None is a real default)
REQUIRED = object()

_HEAD = re.compile(
    r"^(?P<name>[A-Za-z0-9_]+)(?:\.(?P<overload>[A-Za-z0-9_]+))?\((?P<args>.*)\)\s*->"
)


@dataclass(frozen=True, slots=True)
class Param:
    """One schema argument, in Python terms."""

    name: str
    #: the ATen type as written, e.g. ``Tensor?``, ``SymInt[]?``, ``Tensor(a!)``
    type: str
    keyword_only: bool
    #: the Python default, or ``REQUIRED``
    default: Any

    @property
    def optional(self) -> bool:
        return self.type.endswith("?")

    @property
    def base_type(self) -> str:
        """The type without alias annotation or ``?``: ``Tensor``, ``int``, ``SymInt[]``."""
        return re.sub(r"\(.*?\)", "", self.type).rstrip("?")


@dataclass(frozen=True, slots=True)
class Schema:
    name: str
    params: tuple[Param, ...]

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"{self.name} has no parameter {name!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


def parse_schema(func: str) -> Schema:
    """A ``Schema`` from one ``func:`` value, e.g. ``scatter_update_(Tensor(a!) self, ...)``."""
    head = _HEAD.match(func.strip())
    if head is None:
        raise ValueError(f"not an ATen schema: {func!r}")
    params = []
    keyword_only = False
    for raw in _split_top_level(head["args"]):
        raw = raw.strip()
        if not raw:
            continue
        if raw == "*":
            keyword_only = True
            continue
        decl, _, default = raw.partition("=")
        type_, _, name = decl.strip().rpartition(" ")
        name = "input" if name == "self" else name
        value = parse_default(default.strip()) if default else REQUIRED
        params.append(Param(name, type_.strip(), keyword_only, value))
    return Schema(head["name"], tuple(params))


def parse_default(text: str) -> Any:
    """ATen default literal -> Python value: None, True, 1.0, 1e-5, 2147483647, "BSH", []."""
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text[:1] in ("'", '"') and text[-1:] == text[:1]:
        return text[1:-1]
    if text.startswith("["):
        inner = text[1:-1].strip()
        return [parse_default(x.strip()) for x in inner.split(",")] if inner else []
    try:
        return int(text)
    except ValueError:
        return float(text)


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside (), [] (types such as ``Tensor(a!)`` or ``int[2]``)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def load_fixture(path: Path = FIXTURE) -> dict:
    return json.loads(path.read_text())


def load_schemas(path: Path = FIXTURE) -> dict[str, Schema]:
    """Operator name -> parsed schema, from the checked-in fixture."""
    return {name: parse_schema(op["func"]) for name, op in load_fixture(path)["operators"].items()}
