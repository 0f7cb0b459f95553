"""One parsed file plus the facts every rule asks about: scopes, bindings, branches.

Rules never walk parents or chase names themselves; they ask a ``FileContext``. The
bindings index is deliberately simple (no control-flow analysis): a name's possible values
are the union of every value assigned to it in its function (or module, or class for
``self.<attr>``), and anything the index cannot see makes the answer "unknown". Rules only
report on answers that are known, because a lint that cries wolf gets disabled.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import libcst as cst
from libcst.metadata import (
    MetadataWrapper,
    PositionProvider,
    QualifiedNameProvider,
)

#: stands for a binding whose value the index cannot see (tuple unpacking, ``+=``, ``for``)
OPAQUE = cst.Name("__opaque__")

_MAX_DEPTH = 6  # alias chains longer than this are treated as unknown


class _Indexer(cst.CSTVisitor):
    """Collects assignments per scope, calls, classes and functions in one pass."""

    def __init__(self) -> None:
        self.parents: dict[cst.CSTNode, cst.CSTNode] = {}
        self._stack: list[cst.CSTNode] = []
        self.scopes: list[cst.CSTNode] = []
        self.classes: list[cst.ClassDef] = []
        self.class_stack: list[cst.ClassDef] = []
        self.functions: list[cst.FunctionDef] = []
        self.calls: list[cst.Call] = []
        self.aug_assigns: list[cst.AugAssign] = []
        self.names: dict[cst.CSTNode | None, dict[str, list[cst.BaseExpression]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self.attrs: dict[cst.ClassDef, dict[str, list[cst.BaseExpression]]] = defaultdict(
            lambda: defaultdict(list)
        )

    # parents (cheaper than libcst's ParentNodeProvider, which needs a second pass) ------
    def on_visit(self, node: cst.CSTNode) -> bool:
        if self._stack:
            self.parents[node] = self._stack[-1]
        self._stack.append(node)
        return super().on_visit(node)

    def on_leave(self, original_node: cst.CSTNode) -> None:
        super().on_leave(original_node)
        self._stack.pop()

    # scopes ---------------------------------------------------------------------------
    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.append(node)
        self.class_stack.append(node)

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.class_stack.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.append(node)
        self.scopes.append(node)
        for param in _all_params(node.params):
            self.names[node][param.name.value].append(OPAQUE)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.scopes.pop()

    # bindings -------------------------------------------------------------------------
    def _bind(self, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        scope = self.scopes[-1] if self.scopes else None
        if isinstance(target, cst.Name):
            self.names[scope][target.value].append(value)
        elif (
            isinstance(target, cst.Attribute)
            and isinstance(target.value, cst.Name)
            and target.value.value == "self"
            and self.class_stack
        ):
            self.attrs[self.class_stack[-1]][target.attr.value].append(value)
        elif isinstance(target, cst.Tuple | cst.List):
            for element in target.elements:
                self._bind(element.value, OPAQUE)

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            self._bind(target.target, node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self._bind(node.target, node.value)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self.aug_assigns.append(node)
        self._bind(node.target, OPAQUE)

    def visit_For(self, node: cst.For) -> None:
        self._bind(node.target, OPAQUE)

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self._bind(node.asname.name, OPAQUE)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._bind(node.target, node.value)

    def visit_Call(self, node: cst.Call) -> None:
        self.calls.append(node)
        # self.register_buffer("mask", value) binds self.mask like an assignment
        func = node.func
        if (
            isinstance(func, cst.Attribute)
            and func.attr.value == "register_buffer"
            and len(node.args) >= 2
            and isinstance(node.args[0].value, cst.SimpleString)
            and self.class_stack
        ):
            name = node.args[0].value.evaluated_value
            if isinstance(name, str):
                self.attrs[self.class_stack[-1]][name].append(node.args[1].value)


def _early_exits(body, child) -> list[tuple[cst.BaseExpression, bool]]:
    """Tests of earlier ``if X: ... return`` statements (no else) in the same block: code
    after them only runs when X was false. Nearest first."""
    out = []
    for statement in body:
        if statement is child:
            break
        if (
            isinstance(statement, cst.If)
            and statement.orelse is None
            and isinstance(statement.body, cst.IndentedBlock)
            and statement.body.body
            and _exits(statement.body.body[-1])
        ):
            out.append((statement.test, False))
    return out[::-1]


def _exits(statement: cst.BaseStatement) -> bool:
    if isinstance(statement, cst.SimpleStatementLine):
        return any(isinstance(s, cst.Return | cst.Raise) for s in statement.body)
    return False


def _all_params(params: cst.Parameters) -> list[cst.Param]:
    out = [*params.posonly_params, *params.params, *params.kwonly_params]
    for star in (params.star_arg, params.star_kwarg):
        if isinstance(star, cst.Param):
            out.append(star)
    return out


class FileContext:
    """A parsed source file and the lookups rules need.

    Args:
        source: the file's text.
        path: shown in findings.
        config: the model config beside the file (``sibling_config``), None when there is
            none; some rules read its values before they report.
    """

    def __init__(self, source: str, path: str = "<string>", config: dict | None = None) -> None:
        self.path = path
        self.config = config or {}
        #: a config was found beside the file: a key it lacks is unset, not unknown
        self.has_config = config is not None
        # NOTE: positions and qualified names are resolved lazily: they cost more than the
        # parse and the rules need them only for files with a fused-attention call or a
        # finding, a small minority of the files a folder holds.
        self.wrapper = MetadataWrapper(cst.parse_module(source), unsafe_skip_copy=True)
        self.module = self.wrapper.module
        self._positions = None
        self._qualified_names = None
        index = _Indexer()
        self.module.visit(index)
        self.parents = index.parents
        self.classes = index.classes
        self.functions = index.functions
        self.calls = index.calls
        self.aug_assigns = index.aug_assigns
        self._names = index.names
        self._attrs = index.attrs
        self.source = source
        #: the operator's name appears in the file (else no call can reach it)
        self.mentions_fa = "npu_fused_infer_attention_score" in source
        #: per-file memo shared by the rules (e.g. the list of FA calls)
        self.cache: dict[str, object] = {}

    @classmethod
    def from_path(cls, path: Path) -> FileContext:
        """Read a file (and a ``config.json`` beside it) into a context."""
        from kvskill.core.inputs import read_source

        source = read_source(path, what="file")
        return cls(source, str(path), sibling_config(path))

    # text and position ---------------------------------------------------------------
    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def position(self, node: cst.CSTNode) -> tuple[int, int]:
        if self._positions is None:
            self._positions = self.wrapper.resolve(PositionProvider)
        start = self._positions[node].start
        return start.line, start.column + 1

    # tree navigation ------------------------------------------------------------------
    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.parents.get(node)

    def ancestors(self, node: cst.CSTNode):
        current = self.parents.get(node)
        while current is not None:
            yield current
            current = self.parents.get(current)

    def enclosing_function(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        return next((a for a in self.ancestors(node) if isinstance(a, cst.FunctionDef)), None)

    def enclosing_class(self, node: cst.CSTNode) -> cst.ClassDef | None:
        return next((a for a in self.ancestors(node) if isinstance(a, cst.ClassDef)), None)

    def branches(self, node: cst.CSTNode) -> list[tuple[cst.BaseExpression, bool]]:
        """The ``if`` tests that guard ``node``, innermost first, with True when ``node`` is
        in the body (the test held) and False when it is in the else/elif part."""
        out: list[tuple[cst.BaseExpression, bool]] = []
        child = node
        for parent in self.ancestors(node):
            if isinstance(parent, cst.If | cst.IfExp):
                if child is parent.body:
                    out.append((parent.test, True))
                elif child is parent.orelse:
                    out.append((parent.test, False))
            if isinstance(parent, cst.IndentedBlock | cst.Module):
                out.extend(_early_exits(parent.body, child))
            if isinstance(parent, cst.FunctionDef | cst.ClassDef):
                break
            child = parent
        return out

    # bindings -------------------------------------------------------------------------
    def assigned_values(self, expr: cst.BaseExpression) -> list[cst.BaseExpression] | None:
        """Every value bound to a name or ``self.<attr>`` in its scope; None when unknown."""
        if isinstance(expr, cst.Name):
            scope: cst.CSTNode | None = self.enclosing_function(expr)
            while scope is not None:
                values = self._names.get(scope, {}).get(expr.value)
                if values:
                    return None if any(v is OPAQUE for v in values) else list(values)
                scope = self.enclosing_function(scope)
            values = self._names.get(None, {}).get(expr.value)
            if values and not any(v is OPAQUE for v in values):
                return list(values)
            return None
        if (
            isinstance(expr, cst.Attribute)
            and isinstance(expr.value, cst.Name)
            and expr.value.value == "self"
        ):
            cls = self.enclosing_class(expr)
            values = self._attrs.get(cls, {}).get(expr.attr.value) if cls else None
            if values and not any(v is OPAQUE for v in values):
                return list(values)
        return None

    def class_attr_values(self, cls: cst.ClassDef, attr: str) -> list[cst.BaseExpression]:
        """Values assigned to ``self.<attr>`` anywhere in ``cls`` (OPAQUE included)."""
        return list(self._attrs.get(cls, {}).get(attr, []))

    def possible_values(self, expr: cst.BaseExpression | None, depth: int = 0) -> frozenset | None:
        """The literal values (int, float, bool, None, str) ``expr`` can take, or None when
        any of them cannot be known statically."""
        if expr is None or depth > _MAX_DEPTH:
            return None
        if isinstance(expr, cst.Integer | cst.Float):
            return frozenset({expr.evaluated_value})
        if isinstance(expr, cst.SimpleString):
            return frozenset({expr.evaluated_value})
        if isinstance(expr, cst.Name) and expr.value in ("None", "True", "False"):
            return frozenset({{"None": None, "True": True, "False": False}[expr.value]})
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
            inner = self.possible_values(expr.expression, depth + 1)
            if inner is None or not all(isinstance(v, int | float) for v in inner):
                return None
            return frozenset(-v for v in inner)
        if isinstance(expr, cst.IfExp):
            body = self.possible_values(expr.body, depth + 1)
            orelse = self.possible_values(expr.orelse, depth + 1)
            return None if body is None or orelse is None else body | orelse
        values = self.assigned_values(expr)
        if values is None:
            return None
        out: frozenset = frozenset()
        for value in values:
            part = self.possible_values(value, depth + 1)
            if part is None:
                return None
            out |= part
        return out

    def resolve(self, expr: cst.BaseExpression, depth: int = 0) -> list[cst.BaseExpression]:
        """Follow names and ``self.<attr>`` to the expressions they were built from.

        Returns the expression itself when it is not a plain alias, so callers can match
        constructors (``torch.ones(...)``) whether written inline or bound to a name first.
        """
        if depth > _MAX_DEPTH:
            return [expr]
        values = self.assigned_values(expr)
        if values is None:
            return [expr]
        out: list[cst.BaseExpression] = []
        for value in values:
            out.extend(self.resolve(value, depth + 1))
        return out

    def qualified(self, node: cst.CSTNode) -> set[str]:
        if self._qualified_names is None:
            self._qualified_names = self.wrapper.resolve(QualifiedNameProvider)
        value = self._qualified_names.get(node, set())
        if callable(value):  # libcst resolves this provider lazily
            value = value()
        return {q.name for q in value}

    def mentions(self, pattern: str) -> bool:
        """Whether the file's text matches ``pattern`` (a regular expression)."""
        return re.search(pattern, self.source) is not None


def sibling_config(path: Path) -> dict | None:
    """The config the model in the file's folder ships: the literal ``__init__`` defaults
    of the config class in a ``configuration_*.py`` there, overlaid with a readable
    ``config.json`` there (the values a checkpoint sets win, as in transformers). None when
    the folder holds neither."""
    defaults = _config_class_defaults(path.parent)
    shipped = _config_json(path.parent)
    if defaults is None and shipped is None:
        return None
    return {**(defaults or {}), **(shipped or {})}


def _config_json(folder: Path) -> dict | None:
    from kvskill.core.errors import BadInputError
    from kvskill.core.inputs import read_json

    candidate = folder / "config.json"
    if not candidate.is_file():
        return None
    try:
        data = read_json(candidate, what="config", root=folder)
    except BadInputError:
        return None
    return data if isinstance(data, dict) else None


def _config_class_defaults(folder: Path) -> dict | None:
    """``{parameter: default}`` of the first config class (a class whose base's name ends
    in ``Config``) in the folder's ``configuration_*.py`` files, literal defaults only: a
    parameter whose default is an expression is left out, so it reads as unknown."""
    from kvskill.core.errors import BadInputError
    from kvskill.core.inputs import read_source

    for candidate in sorted(folder.glob("configuration_*.py")):
        try:
            tree = ast.parse(read_source(candidate, what="file"))
        except (BadInputError, SyntaxError, ValueError, RecursionError):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(base).endswith("Config") for base in node.bases
            ):
                init = next(
                    (
                        f
                        for f in node.body
                        if isinstance(f, ast.FunctionDef) and f.name == "__init__"
                    ),
                    None,
                )
                if init is not None:
                    return _literal_defaults(init.args)
    return None


def _literal_defaults(args: ast.arguments) -> dict:
    out: dict = {}
    positional = [*args.posonlyargs, *args.args]
    pairs = list(
        zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True)
    )
    pairs += [
        (a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None
    ]
    for arg, default in pairs:
        try:
            out[arg.arg] = ast.literal_eval(default)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            continue
    return out
