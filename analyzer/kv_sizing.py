"""The KV heads and head dim a cache is sized with, read from the attention's own ``__init__``.

A config key list cannot know that a file sizes its keys from a vendor's key: a Megatron-style
file sets ``self.num_key_value_heads = config.num_query_groups`` and builds
``self.k_proj = nn.Linear(hidden, self.num_key_value_heads * self.head_dim)``; its config has
no ``num_key_value_heads`` at all. What the cache must hold is what the key projection
produces, so this module follows the ``__init__`` that builds the ``k`` / ``v`` (or fused
``qkv``) projection, through ``super().__init__`` into same-file bases, and evaluates the
projection's width against the config as transformers reads it (the JSON value, the config
class's ``attribute_map``, the config class's ``__init__`` defaults).

Worked example (the fixture ``query_groups_bhsd``, config ``hidden_size=128``,
``num_attention_heads=8``, ``num_query_groups=2``)::

    self.head_dim = self.hidden_size // self.num_heads           -> 128 // 8 = 16
    self.num_key_value_heads = config.num_query_groups           -> 2
    self.k_proj = nn.Linear(self.hidden_size,
                            self.num_key_value_heads * self.head_dim)   -> width 32
    kv heads = 32 / 16 = 2, written as ``self.num_key_value_heads`` (the factor that is not
    the head dim), read from config key ``num_query_groups``

Nothing is executed: expressions are evaluated over literals, ``self`` attributes, ``__init__``
locals and config attributes with ``+ - * // /``, ``getattr(config, "key", default)``,
``int(...)`` and ``a or b``; anything else leaves the value unknown (None).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import class_chain, dotted_name, method, method_chain
from kvskill.core.errors import BadInputError
from kvskill.core.inputs import read_source

#: attribute names of a key / value projection (transformers, Llama-style, GPT-NeoX-style)
KEY_PROJECTIONS = ("k_proj", "key", "wk", "key_proj", "k_linear")
VALUE_PROJECTIONS = ("v_proj", "value", "wv", "value_proj", "v_linear")
#: attribute names of one projection producing query, key and value together
FUSED_PROJECTIONS = ("wqkv", "W_pack", "c_attn", "query_key_value", "qkv_proj", "qkv", "Wqkv")
#: ``self`` attributes naming a head width, to tell the head dim factor of ``heads * dim``
_HEAD_DIM_WORDS = ("head_dim", "head_size", "kv_channels", "hidden_size_per_attention_head")


@dataclass(frozen=True, kw_only=True)
class KvSizing:
    """How an attention ``__init__`` sizes its key / value projection."""

    #: the class whose ``__init__`` chain was read
    class_name: str
    #: the projection attribute(s): {"k": ..., "v": ...} or {"fused": ...}
    projections: dict[str, str]
    #: the class of the chain whose ``__init__`` assigns the key (or fused) projection
    owner: str
    #: KV heads and head dim the projection holds (None: not computable from the code)
    kv_heads: int | None
    head_dim: int | None
    #: the expression, valid at the end of ``__init__``, that holds the KV heads ("" if none)
    kv_heads_expr: str = ""
    #: config attributes read to compute the KV heads (``num_query_groups``)
    kv_heads_keys: tuple[str, ...] = ()
    #: the source text of the key projection's width, for the evidence
    width_text: str = ""


class ConfigView:
    """A config dict read as transformers' config object is: ``attribute_map`` first, then
    the key itself, then the config class's ``__init__`` default; each read is recorded."""

    def __init__(
        self,
        config: Mapping[str, Any],
        attribute_map: Mapping[str, str] | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.attribute_map = dict(attribute_map or {})
        self.defaults = dict(defaults or {})
        self.reads: list[str] = []

    def get(self, name: str) -> Any:
        key = self.attribute_map.get(name, name)
        self.reads.append(key)
        if key in self.config:
            return self.config[key]
        return self.defaults.get(key)

    def has(self, name: str) -> bool:
        key = self.attribute_map.get(name, name)
        return key in self.config or key in self.defaults


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


@dataclass
class _Scope:
    """Assignments of an ``__init__`` chain: ``self`` attributes and each init's locals."""

    config_names: set[str] = field(default_factory=set)
    attrs: dict[str, cst.BaseExpression] = field(default_factory=dict)
    #: the class whose ``__init__`` assigned each ``self`` attribute (last)
    attr_owners: dict[str, str] = field(default_factory=dict)
    locals: dict[str, cst.BaseExpression] = field(default_factory=dict)


class _Evaluator:
    """Integer arithmetic over a scope and a config (see the module docstring)."""

    def __init__(self, scope: _Scope, config: ConfigView) -> None:
        self.scope = scope
        self.config = config
        self._depth = 0

    def value(self, node: cst.BaseExpression) -> Any:
        self._depth += 1
        try:
            return None if self._depth > 50 else self._value(node)
        finally:
            self._depth -= 1

    def _value(self, node: cst.BaseExpression) -> Any:
        if isinstance(node, cst.Integer):
            return node.evaluated_value
        if isinstance(node, cst.Float):
            return node.evaluated_value
        if isinstance(node, cst.Name):
            found = self.scope.locals.get(node.value)
            return self.value(found) if found is not None else None
        if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name):
            owner, attr = node.value.value, node.attr.value
            if owner == "self":
                found = self.scope.attrs.get(attr)
                if found is not None:
                    return self.value(found)
                return self.config.get(attr) if attr == "config" else None
            if owner in self.scope.config_names:
                return self.config.get(attr)
            return None
        if isinstance(node, cst.Attribute) and m.matches(
            node.value, m.Attribute(value=m.Name("self"), attr=m.Name("config"))
        ):
            return self.config.get(node.attr.value)
        if isinstance(node, cst.BinaryOperation):
            return _arith(node.operator, self.value(node.left), self.value(node.right))
        if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
            inner = self.value(node.expression)
            return -inner if _is_number(inner) else None
        if isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.Or):
            left = self.value(node.left)
            return left if left else self.value(node.right)
        if isinstance(node, cst.Call):
            return self._call(node)
        return None

    def _call(self, node: cst.Call) -> Any:
        name = dotted_name(node.func)
        args = [a.value for a in node.args]
        if name == "int" and len(args) == 1:
            inner = self.value(args[0])
            return int(inner) if _is_number(inner) else None
        if name == "getattr" and len(args) in (2, 3) and isinstance(args[1], cst.SimpleString):
            holder, key = args[0], args[1].evaluated_value
            is_config = (
                isinstance(holder, cst.Name) and holder.value in self.scope.config_names
            ) or m.matches(holder, m.Attribute(value=m.Name("self"), attr=m.Name("config")))
            if not is_config or not isinstance(key, str):
                return None
            if self.config.has(key):
                return self.config.get(key)
            return self.value(args[2]) if len(args) == 3 else None
        return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _arith(operator: cst.BaseBinaryOp, left: Any, right: Any) -> Any:
    if not _is_number(left) or not _is_number(right):
        return None
    if isinstance(operator, cst.Add):
        return left + right
    if isinstance(operator, cst.Subtract):
        return left - right
    if isinstance(operator, cst.Multiply):
        return left * right
    if isinstance(operator, cst.FloorDivide) and right:
        return left // right
    if isinstance(operator, cst.Divide) and right:
        quotient = left / right
        return int(quotient) if float(quotient).is_integer() else quotient
    return None


def _params(func: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in func.params.params]


def _scope(
    cls: cst.ClassDef, classes: Mapping[str, cst.ClassDef]
) -> tuple[_Scope, cst.FunctionDef | None]:
    """The assignments of the ``__init__`` chain CLS runs, base first (a subclass's
    assignment after ``super().__init__`` wins), and the ``__init__`` the chain starts at."""
    chain = method_chain(cls, "__init__", classes)
    owners = {id(method(c, "__init__")): c.name.value for c in class_chain(cls, classes)}
    scope = _Scope()
    for init in reversed(chain):
        params = _params(init)[1:]
        scope.config_names.add("config" if "config" in params else (params[0] if params else ""))
        scope.locals = {}  # NOTE: only the last (CLS's own) init's locals stay in scope
        for stmt in init.body.body:
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for small in stmt.body:
                _record(small, scope, owners.get(id(init), cls.name.value))
    scope.config_names.discard("")
    return scope, (chain[0] if chain else None)


def _record(small: cst.BaseSmallStatement, scope: _Scope, owner: str) -> None:
    if isinstance(small, cst.Assign):
        targets, value = [t.target for t in small.targets], small.value
    elif isinstance(small, cst.AnnAssign) and small.value is not None:
        targets, value = [small.target], small.value
    else:
        return
    for target in targets:
        if m.matches(target, m.Attribute(value=m.Name("self"))):
            attr = cst.ensure_type(target, cst.Attribute).attr.value
            scope.attrs[attr] = value
            scope.attr_owners[attr] = owner
        elif isinstance(target, cst.Name):
            scope.locals[target.value] = value


def _linear_width(value: cst.BaseExpression) -> cst.BaseExpression | None:
    """The ``out_features`` expression of ``nn.Linear(in, out, ...)`` (any ``*Linear``)."""
    if not isinstance(value, cst.Call) or not dotted_name(value.func).endswith("Linear"):
        return None
    for arg in value.args:
        if arg.keyword is not None and arg.keyword.value == "out_features":
            return arg.value
    positional = [a for a in value.args if a.keyword is None and not a.star]
    return positional[1].value if len(positional) >= 2 else None


def _is_head_dim(node: cst.BaseExpression) -> bool:
    text = _code(node)
    return any(word in text for word in _HEAD_DIM_WORDS)


def _split_heads(width: cst.BaseExpression) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    """(heads factor, head dim factor) of ``heads * dim`` (either order), else None."""
    if not isinstance(width, cst.BinaryOperation) or not isinstance(width.operator, cst.Multiply):
        return None
    left, right = width.left, width.right
    if _is_head_dim(right) and not _is_head_dim(left):
        return left, right
    if _is_head_dim(left) and not _is_head_dim(right):
        return right, left
    return None


def _fused_kv_term(width: cst.BaseExpression) -> cst.BaseExpression | None:
    """X of a fused width ``(q + 2 * X) * dim`` or ``q + 2 * X * dim`` (X the KV heads, or
    the KV width when it is itself ``heads * dim``)."""
    split = _split_heads(width)
    inner = split[0] if split is not None else width
    for node in m.findall(inner, m.BinaryOperation(operator=m.Multiply())):
        node = cst.ensure_type(node, cst.BinaryOperation)
        twice = m.BinaryOperation(left=m.Integer("2"), operator=m.Multiply())
        if m.matches(node.left, twice):
            # ``2 * X * dim`` parses as ``(2 * X) * dim``: the KV width is ``X * dim``
            inner = cst.ensure_type(node.left, cst.BinaryOperation).right
            return node.with_changes(left=inner, lpar=[], rpar=[])
        if m.matches(node.left, m.Integer("2")):
            return node.right
        if m.matches(node.right, m.Integer("2")):
            return node.left
    return None


def _usable_at_init_end(node: cst.BaseExpression, scope: _Scope, config_name: str) -> bool:
    """Whether NODE reads only ``self`` attributes, the init's own locals, its config
    parameter and literals, so it can be evaluated again at the end of that ``__init__``."""
    for name in m.findall(node, m.Name()):
        value = cst.ensure_type(name, cst.Name).value
        if value in ("self", config_name, "getattr", "int") or value in scope.locals:
            continue
        # attribute names (``self.X``'s X) are Names too: accept those under an Attribute
        if any(
            m.matches(a, m.Attribute(attr=m.Name(value))) for a in m.findall(node, m.Attribute())
        ):
            continue
        return False
    return True


def kv_sizing(
    cls: cst.ClassDef,
    classes: Mapping[str, cst.ClassDef],
    config: ConfigView,
) -> KvSizing | None:
    """How CLS's ``__init__`` chain sizes its key projection, or None when it builds no
    recognised key or fused projection (``nn.Linear`` named as in ``KEY_PROJECTIONS`` /
    ``FUSED_PROJECTIONS``)."""
    scope, init = _scope(cls, classes)
    if init is None:
        return None
    evaluator = _Evaluator(scope, config)
    params = _params(init)[1:]
    config_name = "config" if "config" in params else (params[0] if params else "config")
    key, value, fused = (
        next((a for a in names if _linear_width(scope.attrs.get(a)) is not None), None)
        for names in (KEY_PROJECTIONS, VALUE_PROJECTIONS, FUSED_PROJECTIONS)
    )
    if key is not None and value is not None:
        projections, attr = {"k": key, "v": value}, key
        kv_width_node = _linear_width(scope.attrs[key])
    elif fused is not None:
        projections, attr = {"fused": fused}, fused
        kv_width_node = _fused_kv_term(_linear_width(scope.attrs[fused]))
    else:
        return None
    width = cst.ensure_type(_linear_width(scope.attrs[attr]), cst.BaseExpression)
    if kv_width_node is not None:
        kv_width_node = _resolved(kv_width_node, scope)
    heads_node, dim_node = _heads_and_dim(width, kv_width_node, scope)
    head_dim = evaluator.value(dim_node) if dim_node is not None else None
    before = len(config.reads)
    kv_heads = evaluator.value(heads_node) if heads_node is not None else None
    keys = tuple(dict.fromkeys(config.reads[before:]))
    usable = heads_node is not None and _usable_at_init_end(heads_node, scope, config_name)
    return KvSizing(
        class_name=cls.name.value,
        projections=projections,
        owner=scope.attr_owners.get(attr, cls.name.value),
        kv_heads=kv_heads if _is_count(kv_heads) else None,
        head_dim=head_dim if _is_count(head_dim) else None,
        kv_heads_expr=_code(heads_node) if usable else "",
        kv_heads_keys=keys,
        width_text=_code(width),
    )


def _resolved(node: cst.BaseExpression, scope: _Scope) -> cst.BaseExpression:
    """NODE, or the expression a ``self.X`` it names was assigned (``self.kv_dim`` ->
    ``self.num_key_value_heads * self.head_dim``), followed a few steps."""
    for _ in range(4):
        if not m.matches(node, m.Attribute(value=m.Name("self"))):
            return node
        attr = cst.ensure_type(node, cst.Attribute).attr.value
        if attr in _HEAD_DIM_WORDS or attr not in scope.attrs:
            return node
        found = scope.attrs[attr]
        if not isinstance(found, cst.BinaryOperation):
            return node
        node = found
    return node


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _heads_and_dim(
    width: cst.BaseExpression, kv_width: cst.BaseExpression | None, scope: _Scope
) -> tuple[cst.BaseExpression | None, cst.BaseExpression | None]:
    """(KV heads node, head dim node) of a key width ``heads * dim``, or of the KV term X of
    a fused width: ``(q + 2 * X) * dim`` (X counts heads) or ``q + 2 * X * dim``."""
    if kv_width is None:
        return None, scope.attrs.get("head_dim")
    split = _split_heads(kv_width)
    if split is not None:
        return split
    outer = _split_heads(width)
    if outer is not None and kv_width is not width:
        return kv_width, outer[1]  # fused ``(q + 2 * X) * dim``
    return None, scope.attrs.get("head_dim")


def _divide(width: Any, head_dim: Any) -> int | None:
    if isinstance(width, int) and isinstance(head_dim, int) and head_dim > 0:
        return width // head_dim if width % head_dim == 0 else None
    return None


# -- the analyzer's use ------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _module_classes(path: str, mtime_ns: int) -> dict[str, cst.ClassDef]:
    module = cst.parse_module(read_source(Path(path)))
    return {c.name.value: c for c in module.body if isinstance(c, cst.ClassDef)}


def sizing_of_source(modeling_file: str, class_name: str, config: ConfigView) -> KvSizing | None:
    """:func:`kv_sizing` of CLASS_NAME in MODELING_FILE (parsed once per file version)."""
    path = Path(modeling_file)
    classes = _module_classes(str(path), path.stat().st_mtime_ns)
    cls = classes.get(class_name)
    return kv_sizing(cls, classes, config) if cls is not None else None


def apply_code_sizing(spec, sizing: KvSizing | None, where: str, book):
    """SPEC with the KV heads (and head dim) the attention's key projection is sized with,
    cited at WHERE (``file:line``); SPEC unchanged when the code does not say.

    Raises:
        BadInputError: the code's KV heads do not divide the query heads.
    """
    if sizing is None or sizing.kv_heads is None:
        return spec
    projection = "/".join(sizing.projections.values())
    read = f" (config.{', config.'.join(sizing.kv_heads_keys)})" if sizing.kv_heads_keys else ""
    book.cite(
        "num_key_value_heads",
        f"{sizing.kv_heads} KV heads x head dim {sizing.head_dim}: {sizing.owner}.__init__ "
        f"sizes {projection} with `{sizing.width_text}`{read}",
        where,
    )
    changes: dict[str, Any] = {}
    if sizing.kv_heads != spec.num_kv_heads:
        if spec.num_heads % sizing.kv_heads:
            raise BadInputError(
                f"{where}: {sizing.owner} sizes {sizing.kv_heads} KV heads, which does not "
                f"divide the {spec.num_heads} query heads"
            )
        book.cite(
            "num_key_value_heads",
            f"the config keys name {spec.num_kv_heads} KV heads, the code builds "
            f"{sizing.kv_heads}: the cache is sized as the code builds it",
            where,
        )
        changes["num_kv_heads"] = sizing.kv_heads
        sources = dict(spec.sources)
        if sizing.kv_heads_keys:
            sources["num_kv_heads"] = sizing.kv_heads_keys[0]
        changes["sources"] = sources
    if sizing.head_dim is not None and sizing.head_dim != spec.head_dim and spec.mla is None:
        changes["head_dim"] = sizing.head_dim
        if spec.v_head_dim == spec.head_dim:
            changes["v_head_dim"] = sizing.head_dim
    return dataclasses.replace(spec, **changes) if changes else spec
