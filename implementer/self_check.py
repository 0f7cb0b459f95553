"""The structural self-check of a converted module: no silent half-conversion, ever.

Run after the rewrites of every path (paged, MLA, contiguous), on what they emitted:

* every class that declares per-token ``cache_entries`` has a forward whose every path writes
  each entry with a cache-write operator (directly, or through a helper method such as the
  generated ``update_cache``) and afterwards reads it with the fused attention;
* every attention class of the source is such a class in the converted module.

Otherwise the conversion is refused (``UnsupportedModelError``, exit 3) naming the class,
the file and the path, and nothing is written. The check reads the emitted calls
(``analyzer/cache_access.py``), not how a rewrite chose to emit them, so a new source shape
or a new rewrite is held to the same rule.

"Every path" is a must-analysis over the forward's statements: a ``return`` (or the end of
the function) reached before the write, or before the read that follows it, fails; a branch
counts only what both of its arms do; a loop body counts only when it surely runs (a loop
over a literal, non-empty tuple or list); calls inside ``x if c else y``, the right operand
of ``and``/``or``, comprehensions, lambdas and nested functions do not count, since they may
not run. A ``raise`` ends a path without a result, so it needs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.cache_access import (
    EntryRefs,
    cache_entry_names,
    call_access,
    entry_refs,
    reader_methods,
)
from kvskill.analyzer.delegated_caches import delegated_entries
from kvskill.analyzer.gather import (
    class_methods,
    declares_token_caches,
    is_attention_class,
    is_converted_attention,
    method_chain,
    resolve_method,
    self_method_name,
    super_call,
)
from kvskill.core.errors import UnsupportedModelError
from libcst.metadata import MetadataWrapper, PositionProvider


@dataclass(frozen=True)
class PathState:
    """What every path reaching a point has done to the declared entries."""

    written: frozenset[str] = frozenset()
    #: entries read by the fused attention after they were written on that path
    read: frozenset[str] = frozenset()


def _meet(states: Sequence[PathState | None]) -> PathState | None:
    """What holds on every path still running (None: no path reaches here)."""
    live = [s for s in states if s is not None]
    if not live:
        return None
    written = frozenset.intersection(*(s.written for s in live))
    read = frozenset.intersection(*(s.read for s in live))
    return PathState(written=written, read=read)


class _Calls(cst.CSTVisitor):
    """The calls of an expression that surely run, in the order they complete."""

    def __init__(self) -> None:
        self.calls: list[cst.Call] = []

    def leave_Call(self, original_node: cst.Call) -> None:
        self.calls.append(original_node)

    def visit_IfExp(self, node: cst.IfExp) -> bool:
        node.test.visit(self)
        return False

    def visit_BooleanOperation(self, node: cst.BooleanOperation) -> bool:
        node.left.visit(self)
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_ListComp(self, node: cst.ListComp) -> bool:
        return False

    def visit_SetComp(self, node: cst.SetComp) -> bool:
        return False

    def visit_DictComp(self, node: cst.DictComp) -> bool:
        return False

    def visit_GeneratorExp(self, node: cst.GeneratorExp) -> bool:
        return False


@dataclass
class _Paths:
    """A must-analysis of one function's statements (see the module docstring)."""

    refs: EntryRefs
    helper_writes: Mapping[str, frozenset[str]]
    #: what a ``super().forward(...)`` call surely does: the base forward's state at every
    #: exit (transformers 4's ``XSdpaAttention`` falls back to the eager base that way)
    super_forward: PathState | None = None
    #: {submodule attribute: entries a ``self.<sub>(...)`` call writes and reads}
    delegates: Mapping[str, frozenset[str]] = field(default_factory=dict)
    #: (the return statement, or None for the end of the function; the state there)
    exits: list[tuple[cst.CSTNode | None, PathState]] = field(default_factory=list)
    #: per enclosing loop, the states at its ``break`` / ``continue`` statements
    jumps: list[list[PathState]] = field(default_factory=list)

    def run(self, func: cst.FunctionDef) -> None:
        end = self.block(_statements(func.body), PathState())
        if end is not None:
            self.exits.append((None, end))

    def expr(self, node: cst.CSTNode | None, state: PathState) -> PathState:
        if node is None:
            return state
        calls = _Calls()
        node.visit(calls)
        for call in calls.calls:
            if self.super_forward is not None and m.matches(call, super_call("forward")):
                done = self.super_forward
                state = PathState(written=state.written | done.written, read=state.read | done.read)
                continue
            delegated = self.delegates.get(self_method_name(call) or "", frozenset())
            if delegated:
                # the submodule writes and then reads these entries (delegated_caches.py)
                state = PathState(written=state.written | delegated, read=state.read | delegated)
                continue
            access = call_access(call, self.refs, self.helper_writes)
            written = state.written | access.writes
            state = PathState(written=written, read=state.read | (access.reads & written))
        return state

    def block(
        self, stmts: Sequence[cst.BaseStatement], state: PathState | None
    ) -> PathState | None:
        for stmt in stmts:
            if state is None:
                return None
            state = self.statement(stmt, state)
        return state

    def statement(self, stmt: cst.BaseStatement, state: PathState) -> PathState | None:
        if isinstance(stmt, cst.SimpleStatementLine):
            return self.small(stmt.body, state)
        if isinstance(stmt, cst.If):
            return self.branch(stmt, state)
        if isinstance(stmt, (cst.For, cst.While)):
            return self.loop(stmt, state)
        if isinstance(stmt, cst.Try):
            return self.try_(stmt, state)
        if isinstance(stmt, cst.With):
            for item in stmt.items:
                state = self.expr(item.item, state)
            return self.block(_statements(stmt.body), state)
        if isinstance(stmt, cst.Match):
            state = self.expr(stmt.subject, state)
            cases = [self.block(_statements(c.body), state) for c in stmt.cases]
            return _meet([state, *cases])
        # nested functions and classes run nothing here
        return state

    def small(self, stmts: Sequence[cst.BaseSmallStatement], state: PathState) -> PathState | None:
        for small in stmts:
            if isinstance(small, cst.Return):
                self.exits.append((small, self.expr(small.value, state)))
                return None
            if isinstance(small, cst.Raise):
                return None
            if isinstance(small, (cst.Break, cst.Continue)):
                if self.jumps:
                    self.jumps[-1].append(state)
                return None
            state = self.expr(small, state)
            adopted = _caches_adopted_from_producer(small)
            if adopted:
                state = PathState(written=state.written | adopted, read=state.read)
        return state

    def branch(self, stmt: cst.If, state: PathState) -> PathState | None:
        state = self.expr(stmt.test, state)
        body = self.block(_statements(stmt.body), state)
        if isinstance(stmt.orelse, cst.If):
            orelse = self.branch(stmt.orelse, state)
        elif isinstance(stmt.orelse, cst.Else):
            orelse = self.block(_statements(stmt.orelse.body), state)
        else:
            orelse = state
        return _meet([body, orelse])

    def loop(self, stmt: cst.For | cst.While, state: PathState) -> PathState | None:
        state = self.expr(stmt.iter if isinstance(stmt, cst.For) else stmt.test, state)
        self.jumps.append([])
        end = self.block(_statements(stmt.body), state)
        jumps = self.jumps.pop()
        surely_runs = isinstance(stmt, cst.For) and _non_empty_literal(stmt.iter)
        after = _meet([end, *jumps]) if surely_runs else state
        if after is not None and stmt.orelse is not None:
            after = self.block(_statements(stmt.orelse.body), after)
        return after

    def try_(self, stmt: cst.Try, state: PathState) -> PathState | None:
        body = self.block(_statements(stmt.body), state)
        if body is not None and stmt.orelse is not None:
            body = self.block(_statements(stmt.orelse.body), body)
        # NOTE: a handler may start before anything in the body ran
        handlers = [self.block(_statements(h.body), state) for h in stmt.handlers]
        after = _meet([body, *handlers])
        if stmt.finalbody is not None:
            final = self.block(_statements(stmt.finalbody.body), after or state)
            return None if after is None else final
        return after


#: ``self.k_cache, ... = self.kv_source.k_cache, ...``: a layer sharing another's cache
_ADOPT_PRODUCER_CACHE = m.Assign(
    targets=[m.AssignTarget(target=m.Tuple() | m.Attribute(value=m.Name("self")))],
    value=m.Tuple()
    | m.Attribute(value=m.Attribute(value=m.Name("self"), attr=m.Name("kv_source"))),
)


def _caches_adopted_from_producer(small: cst.BaseSmallStatement) -> frozenset[str]:
    """Entries a cross-layer KV sharing layer takes from its producer (``self.k_cache =
    self.kv_source.k_cache``): written, by the producer, earlier in the same step."""
    if not m.matches(small, _ADOPT_PRODUCER_CACHE):
        return frozenset()
    assign = cst.ensure_type(small, cst.Assign)
    sources = m.findall(
        assign.value, m.Attribute(value=m.Attribute(value=m.Name("self"), attr=m.Name("kv_source")))
    )
    named = {cst.ensure_type(a, cst.Attribute).attr.value for a in sources}
    targets = m.findall(assign.targets[0].target, m.Attribute(value=m.Name("self")))
    return frozenset(cst.ensure_type(t, cst.Attribute).attr.value for t in targets) & named


def _statements(suite: cst.BaseSuite) -> Sequence[cst.BaseStatement]:
    if isinstance(suite, cst.IndentedBlock):
        return suite.body
    return [cst.SimpleStatementLine(body=cst.ensure_type(suite, cst.SimpleStatementSuite).body)]


def _non_empty_literal(node: cst.BaseExpression) -> bool:
    return (
        isinstance(node, (cst.Tuple, cst.List))
        and bool(node.elements)
        and not any(isinstance(e, cst.StarredElement) for e in node.elements)
    )


def _analyse(
    func: cst.FunctionDef,
    entries: frozenset[str],
    helper_writes: Mapping[str, frozenset[str]],
    super_forward: PathState | None = None,
    readers: Mapping[str, frozenset[str]] | None = None,
    delegates: Mapping[str, frozenset[str]] | None = None,
) -> list[tuple[cst.CSTNode | None, PathState]]:
    paths = _Paths(
        refs=entry_refs(func, entries, readers),
        helper_writes=helper_writes,
        super_forward=super_forward,
        delegates=delegates or {},
    )
    paths.run(func)
    return paths.exits


def _base_forward_state(
    bases: Sequence[cst.FunctionDef],
    entries: frozenset[str],
    helper_writes: Mapping[str, frozenset[str]],
    readers: Mapping[str, frozenset[str]],
) -> PathState | None:
    """What the base forwards reached by ``super().forward(...)`` surely do (BASES from the
    nearest base up; each may delegate to the next), or None when there is none."""
    state = None
    for func in reversed(bases):
        state = _meet([s for _, s in _analyse(func, entries, helper_writes, state, readers)])
    return state


def helper_must_writes(
    methods: Mapping[str, cst.FunctionDef], entries: frozenset[str]
) -> dict[str, frozenset[str]]:
    """Method name -> the entries it writes on every path that returns (a fixpoint, so a
    helper that calls a helper counts)."""
    writes: dict[str, frozenset[str]] = {}
    while True:
        found: dict[str, frozenset[str]] = {}
        for name, func in methods.items():
            exits = _analyse(func, entries, writes)
            must = frozenset.intersection(*(s.written for _, s in exits)) if exits else frozenset()
            if must:
                found[name] = must
        if found == writes:
            return writes
        writes = found


@dataclass(frozen=True)
class Gap:
    """One path of a forward that misses the cache."""

    owner: str
    #: the return statement, or the function itself for its end
    node: cst.CSTNode
    missing_writes: frozenset[str]
    missing_reads: frozenset[str]


def _writes_and_reads(func: cst.FunctionDef, attr: str) -> bool:
    """Whether every exit of FUNC has written ``self.<attr>`` and read it after the write."""
    exits = _analyse(func, frozenset({attr}), {})
    return bool(exits) and all(attr in s.written and attr in s.read for _, s in exits)


def forward_gaps(cls: cst.ClassDef, classes: Mapping[str, cst.ClassDef]) -> list[Gap]:
    """The exits of CLS's forward at which a declared entry is not written, or not read
    with the fused attention after its write."""
    forward, *bases = method_chain(cls, "forward", classes)
    entries = cache_entry_names(cls, classes)
    writes = helper_must_writes(class_methods(cls, classes), entries)
    readers = reader_methods(cls, entries, classes)
    base_state = _base_forward_state(bases, entries, writes, readers)
    delegates = delegated_entries(cls, classes, _writes_and_reads)
    gaps = []
    for node, state in _analyse(forward, entries, writes, base_state, readers, delegates):
        missing_writes = entries - state.written
        # an entry never written is reported as such, not also as unread
        missing_reads = entries - state.read - missing_writes
        if missing_writes or missing_reads:
            gaps.append(
                Gap(
                    owner=f"{cls.name.value}.forward",
                    node=node if node is not None else forward,
                    missing_writes=missing_writes,
                    missing_reads=missing_reads,
                )
            )
    return gaps


def _classes(module: cst.Module) -> dict[str, cst.ClassDef]:
    found = {}
    for node in m.findall(module, m.ClassDef()):
        cls = cst.ensure_type(node, cst.ClassDef)
        found.setdefault(cls.name.value, cls)
    return found


def _describe(gap: Gap, lines: Mapping[cst.CSTNode, int]) -> str:
    line = lines.get(gap.node)
    where = "at its end" if isinstance(gap.node, cst.FunctionDef) else "at a return"
    where += f" (line {line})" if line is not None else ""
    missing = []
    if gap.missing_writes:
        missing.append(
            f"without writing {', '.join(sorted(gap.missing_writes))} with a cache-write operator"
        )
    if gap.missing_reads:
        missing.append(
            f"without reading {', '.join(sorted(gap.missing_reads))} with the fused attention "
            "after the write"
        )
    return f"{gap.owner} leaves {where} " + " and ".join(missing)


def self_check_problems(original: cst.Module, converted: cst.Module) -> list[str]:
    """Every way CONVERTED misses its caches (empty when it passes)."""
    before, after = _classes(original), _classes(converted)
    problems: list[str] = []
    gaps: list[Gap] = []
    for name, cls in before.items():
        if not is_attention_class(cls):
            continue
        converted_cls = after.get(name)
        if converted_cls is None:
            problems.append(f"{name}, an attention class of the source, is gone")
        elif not is_converted_attention(converted_cls, after):
            problems.append(
                f"{name} is an attention class of the source but is not converted (its "
                "forward does not write declared cache_entries with a cache-write operator "
                "and read them with the fused attention)"
            )
    for name, cls in after.items():
        if not declares_token_caches(cls, after):
            continue
        if resolve_method(cls, "forward", after) is None:
            problems.append(f"{name} declares cache_entries but has no forward")
            continue
        gaps.extend(forward_gaps(cls, after))
    if gaps:
        # NOTE: positions only on failure: computing them costs a pass over the whole file
        positions = MetadataWrapper(converted, unsafe_skip_copy=True).resolve(PositionProvider)
        lines = {node: positions[node].start.line for node in (g.node for g in gaps)}
        problems.extend(_describe(gap, lines) for gap in gaps)
    return problems


def self_check(original: cst.Module, converted: cst.Module, filename: str, path: str) -> None:
    """Refuse a conversion that leaves a path of an attention forward off the cache.

    Args:
        original: the source module as parsed.
        converted: the module the rewrites produced.
        filename: for the message.
        path: the conversion path taken (``paged``, ``mla``, ``contiguous``).

    Raises:
        UnsupportedModelError: naming every class and path that misses its caches.
    """
    problems = self_check_problems(original, converted)
    if problems:
        raise UnsupportedModelError(
            f"{filename}: cannot convert ({path} path): the converted code failed its "
            "self-check, so nothing is written: " + "; ".join(problems)
        )


__all__ = ["Gap", "PathState", "forward_gaps", "self_check", "self_check_problems"]
