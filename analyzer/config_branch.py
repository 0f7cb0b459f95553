"""Branches of an attention forward that the model's config decides.

transformers' Falcon runs its attention inside ``if alibi is None:`` (SDPA) / ``else:``
(scores plus an ALiBi bias). ``alibi`` is a forward parameter, and the file itself shows
where it comes from: the model initialises ``alibi = None`` and builds it only under ``if
self.use_alibi:``, with ``self.use_alibi = config.alibi`` in its ``__init__``; every call
hands it on as ``alibi=alibi``. So ``alibi is None`` exactly when ``config.alibi`` is false,
and the branch that runs is known before anything runs.

:func:`config_branches` proves that from the file, for a parameter tested ``is None`` /
``is not None`` at the top of an attention forward. The proof is strict: every assignment
of a variable of that name in the file must be ``name = None``, under ``if self.<flag>:``
(``self.<flag> = config.<key>``, one key for all), or derived from the name itself under a
test that it is not None; every call must hand it on unchanged (``name=name``). Anything
else and the branch is not read as decided (the seam then refuses it as before).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import is_attention_class, method


@dataclass(frozen=True, kw_only=True)
class ConfigBranch:
    """An ``if <param> is [not] None:`` of an attention forward that the config decides."""

    #: the attention class and the forward parameter its test reads
    cls: str
    param: str
    #: the test as the file spells it, and its line
    test: str
    line: int
    #: whether the test is true when the parameter is None (``is None``)
    true_when_none: bool
    #: the config key whose falsy value makes the parameter None
    key: str
    #: ``Owner.__init__`` sets ``self.<flag> = config.<key>`` at this line
    owner: str
    flag: str
    switch_line: int

    def taken(self, config_value: object) -> bool:
        """Whether the ``if`` body runs for CONFIG_VALUE of :attr:`key`."""
        return bool(config_value) != self.true_when_none

    def reason(self, config_value: object) -> str:
        """Which branch runs and why, in one sentence naming the lines."""
        none = not config_value
        runs = "runs its body" if self.taken(config_value) else "skips its body"
        return (
            f"{self.cls}.forward's `if {self.test}:` (line {self.line}) {runs}: "
            f"config.{self.key} is {config_value!r}, so {self.param} is "
            f"{'None' if none else 'built'} ({self.owner}.__init__ sets self.{self.flag} = "
            f"config.{self.key} at line {self.switch_line}, and {self.param} is built only "
            f"under it)"
        )


#: ``x is None`` / ``x is not None`` of a name
_NONE_TEST = m.Comparison(
    left=m.Name(),
    comparisons=[
        m.ComparisonTarget(operator=m.Is() | m.IsNot(), comparator=m.Name("None")),
    ],
)


def config_branches(module: cst.Module, source: str | None = None) -> list[ConfigBranch]:
    """Every top-level ``if <param> is [not] None:`` of an attention forward whose outcome
    the config decides (see the module docstring), in file order. SOURCE: MODULE's text,
    for line numbers (by default rendered from MODULE)."""
    lines = _Lines(module.code if source is None else source)
    switches: dict[str, tuple[str, str, str, cst.Assign] | None] = {}
    found = []
    for cls in module.body:
        if not isinstance(cls, cst.ClassDef) or not is_attention_class(cls):
            continue
        forward = method(cls, "forward")
        if forward is None:
            continue
        params = {p.name.value for p in forward.params.params}
        start = lines.after(lines.after(1, rf"class\s+{cls.name.value}\b"), r"def\s+forward\b")
        tests_seen: list[str] = []
        for stmt in cst.ensure_type(forward.body, cst.IndentedBlock).body:
            if not isinstance(stmt, cst.If) or not m.matches(stmt.test, _NONE_TEST):
                continue
            test = cst.ensure_type(stmt.test, cst.Comparison)
            text = _EMPTY.code_for_node(test)
            tests_seen.append(text)
            param = cst.ensure_type(test.left, cst.Name).value
            if param not in params:
                continue
            if param not in switches:
                switches[param] = _switch_of(module, param)
            switch = switches[param]
            if switch is None:
                continue
            key, owner, flag, assign = switch
            found.append(
                ConfigBranch(
                    cls=cls.name.value,
                    param=param,
                    test=text,
                    line=lines.nth(start, f"if {text}:", tests_seen.count(text) - 1),
                    true_when_none=isinstance(test.comparisons[0].operator, cst.Is),
                    key=key,
                    owner=owner,
                    flag=flag,
                    switch_line=lines.nth(
                        lines.after(1, rf"class\s+{owner}\b"), _EMPTY.code_for_node(assign), 0
                    ),
                )
            )
    return found


_EMPTY = cst.Module(body=[])


class _Lines:
    """Line numbers from the text (libcst's position metadata costs several parses on a
    large file): a definition by its pattern, a statement as the n-th occurrence of its
    text after a line."""

    def __init__(self, source: str) -> None:
        self.lines = source.splitlines()

    def after(self, start: int, pattern: str) -> int:
        compiled = re.compile(rf"^\s*{pattern}")
        for number in range(start, len(self.lines) + 1):
            if compiled.match(self.lines[number - 1]):
                return number
        return start

    def nth(self, start: int, text: str, nth: int) -> int:
        seen = 0
        for number in range(start, len(self.lines) + 1):
            if text in self.lines[number - 1]:
                if seen == nth:
                    return number
                seen += 1
        return start


def _switch_of(module: cst.Module, param: str) -> tuple[str, str, str, cst.Assign] | None:
    """(config key, class, flag, the assignment ``self.<flag> = config.<key>``) that alone
    decides whether PARAM is None, or None when the file does not prove it."""
    handing = _Handing(param)
    module.visit(handing)
    if not handing.found:
        return None
    visitor = _Assignments(param, handing.found)
    module.visit(visitor)
    if visitor.unproved or not visitor.guarded:
        return None
    flags = {(owner, flag) for owner, flag, _ in visitor.guarded}
    if len(flags) != 1 or not all(visitor.initialised):
        return None
    ((owner, flag),) = flags
    cls = next(c for c in module.body if isinstance(c, cst.ClassDef) and c.name.value == owner)
    init = method(cls, "__init__")
    if init is None:
        return None
    config_params = {p.name.value for p in init.params.params[1:]}
    switch = m.Assign(
        targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name(flag)))],
        value=m.Attribute(value=m.Name()),
    )
    found = [cst.ensure_type(a, cst.Assign) for a in m.findall(init, switch)]
    assigns = [
        a
        for a in m.findall(
            module,
            m.Assign(
                targets=[
                    m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name(flag)))
                ]
            ),
        )
    ]
    if len(found) != 1 or len(assigns) != 1:
        return None
    value = cst.ensure_type(found[0].value, cst.Attribute)
    if cst.ensure_type(value.value, cst.Name).value not in config_params:
        return None
    return value.attr.value, owner, flag, found[0]


class _Handing(cst.CSTVisitor):
    """The functions that hand PARAM on by keyword (``layer(..., alibi=alibi)``), by id."""

    def __init__(self, param: str) -> None:
        super().__init__()
        self.param = param
        self.functions: list[cst.FunctionDef] = []
        self.found: set[int] = set()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.append(node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.functions.pop()

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None and node.keyword.value == self.param and self.functions:
            self.found.add(id(self.functions[-1]))


class _Assignments(cst.CSTVisitor):
    """How every assignment and hand-over of PARAM in a file is guarded."""

    def __init__(self, param: str, handing: set[int]) -> None:
        super().__init__()
        self.param = param
        #: ids of the functions that hand PARAM on by keyword (:class:`_Handing`)
        self.handing = handing
        self.classes: list[str] = []
        #: the tests of the ifs around the node being visited (body side only)
        self.tests: list[cst.BaseExpression] = []
        self.functions: list[cst.FunctionDef] = []
        self.relevant: list[bool] = []
        #: (class, flag, function) of assignments under ``if self.<flag>:``
        self.guarded: list[tuple[str, str, cst.FunctionDef]] = []
        #: per guarded function: whether it sets PARAM = None at its top level first
        self.initialised: list[bool] = []
        self.unproved = False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.append(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.classes.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.append(node)
        # NOTE: only the functions that hand PARAM on by keyword carry it to the attention;
        # a local of the same name elsewhere (a builder's result) is another variable
        self.relevant.append(id(node) in self.handing)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.functions.pop()
        self.relevant.pop()

    def visit_If(self, node: cst.If) -> bool:
        # the body is visited under the test; the else side under no claim
        self.tests.append(node.test)
        node.body.visit(self)
        self.tests.pop()
        if node.orelse is not None:
            self.tests.append(cst.Name("False"))
            node.orelse.visit(self)
            self.tests.pop()
        node.test.visit(self)
        return False

    def visit_Arg(self, node: cst.Arg) -> None:
        handed = m.matches(node.value, m.Name(self.param))
        if node.keyword is not None and node.keyword.value == self.param:
            self.unproved = self.unproved or not handed
        elif handed and node.keyword is None and self.relevant and self.relevant[-1]:
            # handed on by position: to what parameter is not read here
            self.unproved = True

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        if m.matches(node.target, m.Name(self.param)):
            self.unproved = True

    def visit_Assign(self, node: cst.Assign) -> None:
        names = [n for t in node.targets for n in m.findall(t.target, m.Name(self.param))]
        if not names or not self.relevant or not self.relevant[-1]:
            return
        if len(node.targets) != 1 or not m.matches(node.targets[0].target, m.Name(self.param)):
            self.unproved = True
        elif (
            m.matches(node.value, m.Name("None"))
            and not self.tests
            or any(self._not_none(t) for t in self.tests)
            and m.findall(node.value, m.Name(self.param))
        ):
            return
        else:
            flag = next((f for t in self.tests if (f := _self_flag(t)) is not None), None)
            if flag is None or not self.classes or not self.functions:
                self.unproved = True
                return
            function = self.functions[-1]
            self.guarded.append((self.classes[-1], flag, function))
            self.initialised.append(_initialised_first(function, self.param))

    def _not_none(self, test: cst.BaseExpression) -> bool:
        """TEST holds only when PARAM is not None (``p is not None and ...``)."""
        terms, pending = [], [test]
        while pending:
            term = pending.pop()
            if isinstance(term, cst.BooleanOperation):
                if not isinstance(term.operator, cst.And):
                    return False
                pending += [term.left, term.right]
            else:
                terms.append(term)
        not_none = m.Comparison(
            left=m.Name(self.param),
            comparisons=[m.ComparisonTarget(operator=m.IsNot(), comparator=m.Name("None"))],
        )
        return any(m.matches(t, not_none) for t in terms)


def _self_flag(test: cst.BaseExpression) -> str | None:
    """``flag`` of a test ``self.flag``."""
    if m.matches(test, m.Attribute(value=m.Name("self"), attr=m.Name())):
        return cst.ensure_type(test, cst.Attribute).attr.value
    return None


def _initialised_first(function: cst.FunctionDef, param: str) -> bool:
    """FUNCTION sets ``PARAM = None`` at its top level before any other statement reads or
    sets PARAM."""
    for stmt in cst.ensure_type(function.body, cst.IndentedBlock).body:
        if m.matches(
            stmt,
            m.SimpleStatementLine(
                body=[m.Assign(targets=[m.AssignTarget(m.Name(param))], value=m.Name("None"))]
            ),
        ):
            return True
        if m.findall(stmt, m.Name(param)):
            return False
    return False


__all__ = ["ConfigBranch", "config_branches"]
