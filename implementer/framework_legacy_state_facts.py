"""Facts of the framework's Legacy per-request states (gated delta), read for their Paged rewrite.

On the Legacy path the model's ``init_cache`` gives every state layer one row per batch slot,
and the layer's methods use the whole ``[batch, ...]`` tensor, row b being request b of the
static batch::

    init_cache:  layer.linear_attn.conv_state = torch.zeros((batch_size, C, K), ...)
    __init__:    self.conv_state = None
    a method:    conv_state = self.conv_state                  (an alias of the rows)
                 conv_state.copy_(x)                           write:  x [B, ...] -> rows 0..B-1
                 y = f(h, conv_state, ...)                     f reads / shifts the rows in place
                 o = npu_recurrent_gated_delta_rule(q, k, v, recurrent_state, ...,
                         ssm_state_indices=<arange(batch)>)    the kernel picks row b itself

Paged, each state is a ``MambaCacheEntry`` of shape ``[C, K]`` (the row shape), allocated as
``[num_blocks, C, K]``; request b of the step owns block ``block_table["Mamba"][b, 0]``. So
each use becomes the same use at those blocks (``framework_legacy_state_codemods.py``). A use
of another form, a state used inside a branch, or an allocation whose shape is not read from
the layer is a problem naming the class, the line and the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import (
    WORKER_ALLOCATION,
    is_framework_legacy_state_layer,
    method,
)
from libcst.metadata import MetadataWrapper, PositionProvider

_EMPTY = cst.Module(body=[])
#: the Legacy attention's rows, converted by KVR020 / KVR021, not states
KV_ROW_ATTRS = frozenset({"k_cache", "v_cache"})
#: the torch_npu kernel that picks each request's state row by index
INDEXED_KERNEL = m.Call(func=m.Attribute(attr=m.Name("npu_recurrent_gated_delta_rule")))
#: its keywords that name batch rows / per-row lengths of the static batch
INDEX_KEYWORD = "ssm_state_indices"
LENGTHS_KEYWORD = "actual_seq_lengths"
#: names the rewrite binds in a converted method
EMITTED_NAMES = ("md", "state_index")


def code(node: cst.CSTNode) -> str:
    return _EMPTY.code_for_node(node).strip()


def first_line(stmt: cst.BaseStatement) -> str:
    """The statement's first line of code, without the comments leading into it."""
    if hasattr(stmt, "leading_lines"):
        stmt = stmt.with_changes(leading_lines=())
    return code(stmt).splitlines()[0]


@dataclass(frozen=True, kw_only=True)
class StateAllocation:
    """One ``<owner>.<attr> = torch.<alloc>((batch, *row), ...)`` of ``init_cache``."""

    owner: str
    attr: str
    #: the row shape, as expressions over the layer (``self.conv_dim``)
    row_shape: tuple[str, ...]
    line: int


class UseKind(str, Enum):
    """How a top-level statement of a state method uses a state alias."""

    #: ``alias = self.<state>``: kept (the alias is now the paged tensor)
    ALIAS = "alias"
    #: ``alias.copy_(x)``: x's rows go to the step's blocks
    WRITE = "write"
    #: the state argument of ``npu_recurrent_gated_delta_rule``: its row index becomes the blocks
    INDEXED = "indexed"
    #: another call takes the rows as an argument (and may change them in place)
    PASSED = "passed"


@dataclass(frozen=True, kw_only=True)
class StateUse:
    #: the statement (a node of the scanned tree: the rewrite finds it by identity)
    node: cst.BaseStatement
    kind: UseKind
    #: the alias the statement uses (the state's local name)
    alias: str


@dataclass(kw_only=True)
class StateMethodFacts:
    name: str
    #: statements that use a state, in order (inside ``with`` / ``if`` blocks too)
    uses: list[StateUse] = field(default_factory=list)
    #: the first top-level statement using a state: the step's blocks are bound before it
    first_index: int | None = None

    @property
    def overwrites_only(self) -> bool:
        """Every use writes whole rows: the method starts each request from a fresh state
        (the Legacy prefill), so a request with cached tokens would lose them."""
        return all(u.kind in (UseKind.ALIAS, UseKind.WRITE) for u in self.uses)


@dataclass(kw_only=True)
class StateLayerFacts:
    """One Legacy state layer class: its states (in ``init_cache`` order) and its methods."""

    name: str
    line: int
    states: list[StateAllocation]
    methods: dict[str, StateMethodFacts] = field(default_factory=dict)


@dataclass(kw_only=True)
class LegacyStateFacts:
    """What ``init_cache`` allocates besides K / V rows, the layers holding it, the problems."""

    layers: list[StateLayerFacts] = field(default_factory=list)
    #: attributes allocated that no layer class converts
    unconverted: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def converted_attrs(self) -> frozenset[str]:
        return frozenset(s.attr for layer in self.layers for s in layer.states)


def gather_legacy_states(module: cst.Module) -> LegacyStateFacts:
    """The Legacy states of MODULE: every ``init_cache`` allocation other than K / V rows."""
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)

    def line(node: cst.CSTNode) -> int:
        return positions[node].start.line

    facts = LegacyStateFacts()
    classes = [c for c in m.findall(module, m.ClassDef()) if isinstance(c, cst.ClassDef)]
    allocations: list[StateAllocation] = []
    for head in classes:
        init_cache = method(head, "init_cache")
        if init_cache is not None:
            where = f"{head.name.value}.init_cache"
            allocations += _allocations(init_cache, where, line, facts)
    by_owner: dict[str, list[StateAllocation]] = {}
    for allocation in allocations:
        by_owner.setdefault(allocation.owner, []).append(allocation)
    for owner, states in by_owner.items():
        attrs = frozenset(s.attr for s in states)
        layers = [c for c in classes if is_framework_legacy_state_layer(c, attrs)]
        if len(layers) != 1:
            found = ", ".join(c.name.value for c in layers) or "none"
            facts.problems.append(
                f"init_cache (line {states[0].line}) allocates {', '.join(sorted(attrs))} on "
                f"{owner}, but not exactly one class sets them all to None in its __init__ "
                f"(found: {found}); the rewrite declares the states on that layer class"
            )
            facts.unconverted.update({s.attr: s.line for s in states})
            continue
        layer = StateLayerFacts(name=layers[0].name.value, line=line(layers[0]), states=states)
        _read_methods(layers[0], layer, line, facts.problems)
        facts.layers.append(layer)
    return facts


def _allocations(
    function: cst.FunctionDef, where: str, line, facts: LegacyStateFacts
) -> list[StateAllocation]:
    """The state allocations of FUNCTION; one it cannot read is a problem of FACTS (and
    recorded as unconverted, so the model rewrite does not report it twice)."""
    found = []
    for node in m.findall(function, WORKER_ALLOCATION):
        assign = cst.ensure_type(node, cst.Assign)
        target = cst.ensure_type(assign.targets[0].target, cst.Attribute)
        if target.attr.value in KV_ROW_ATTRS or m.matches(target.value, m.Name("self")):
            continue
        owner, attr = code(target.value), target.attr.value
        call = cst.ensure_type(assign.value, cst.Call)
        shape = call.args[0].value if call.args and call.args[0].keyword is None else None
        if not isinstance(shape, cst.Tuple) or len(shape.elements) < 2:
            facts.unconverted[attr] = line(assign)
            facts.problems.append(
                f"{where} line {line(assign)}: `{code(assign)[:80]}` does not allocate "
                f"{attr} as a (batch, ...) shape tuple; the rewrite reads its row shape there"
            )
            continue
        row = [_on_layer(e.value, owner) for e in shape.elements[1:]]
        if None in row:
            facts.unconverted[attr] = line(assign)
            facts.problems.append(
                f"{where} line {line(assign)}: {attr}'s shape `{code(shape)}` has a dimension "
                f"not read from {owner} (a length, a config value): not a per-request state the "
                "rewrite can declare as a MambaCacheEntry"
            )
            continue
        found.append(
            StateAllocation(
                owner=owner, attr=attr, row_shape=tuple(r for r in row if r), line=line(assign)
            )
        )
    return found


def _on_layer(expr: cst.BaseExpression, owner: str) -> str | None:
    """EXPR with ``<owner>.x`` read as ``self.x``; None when it reads any other name."""

    class _ToSelf(cst.CSTTransformer):
        def leave_Attribute(self, original, updated):
            if code(original.value) == owner:
                return updated.with_changes(value=cst.Name("self"))
            return updated

    rewritten = cst.ensure_type(expr.visit(_ToSelf()), cst.BaseExpression)
    # what is left must be self.<attr> reads, numbers and operators
    leftovers = {cst.ensure_type(n, cst.Name).value for n in m.findall(rewritten, m.Name())} - {
        "self"
    }
    attrs_of_self = {
        cst.ensure_type(a, cst.Attribute).attr.value
        for a in m.findall(rewritten, m.Attribute(value=m.Name("self")))
    }
    if leftovers - attrs_of_self:
        return None
    return code(rewritten)


def _read_methods(cls: cst.ClassDef, layer: StateLayerFacts, line, problems) -> None:
    states = {s.attr for s in layer.states}
    for stmt in cls.body.body:
        if not isinstance(stmt, cst.FunctionDef) or stmt.name.value == "__init__":
            continue
        where = f"{layer.name}.{stmt.name.value}"
        reads = [
            a
            for a in m.findall(stmt, m.Attribute(value=m.Name("self")))
            if cst.ensure_type(a, cst.Attribute).attr.value in states
        ]
        if not reads:
            continue
        facts = _read_method(stmt, states, where, line, problems)
        if facts is not None:
            layer.methods[stmt.name.value] = facts


def _alias(stmt: cst.BaseStatement, states: set[str], aliases: dict[str, str]):
    """(alias, state) of ``alias = self.<state>``, or of ``x = (<other> if a is None else a)``
    over an alias ``a`` (a paged state is never None, so x is a); else None."""
    one = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())])])
    if not m.matches(stmt, one):
        return None
    assign = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign)
    name = cst.ensure_type(assign.targets[0].target, cst.Name).value
    value = assign.value
    if m.matches(value, m.Attribute(value=m.Name("self"))):
        state = cst.ensure_type(value, cst.Attribute).attr.value
        return (name, state) if state in states else None
    for alias, state in aliases.items():
        fallback = m.IfExp(
            test=m.Comparison(
                left=m.Name(alias),
                comparisons=[m.ComparisonTarget(operator=m.Is(), comparator=m.Name("None"))],
            ),
            orelse=m.Name(alias),
        )
        if m.matches(value, fallback) and len(m.findall(value, m.Name(alias))) == 2:
            return name, state
    return None


#: ``if <alias> is not None:`` with no else: always true for a paged state, kept as written
def _none_guard(alias: str) -> m.If:
    return m.If(
        test=m.Comparison(
            left=m.Name(alias),
            comparisons=[m.ComparisonTarget(operator=m.IsNot(), comparator=m.Name("None"))],
        ),
        orelse=None,
    )


@dataclass
class _Scan:
    """One method's scan: where it is, the names it binds, what it found."""

    where: str
    states: set[str]
    bound: set[str]
    line: object
    problems: list[str]
    facts: StateMethodFacts
    aliases: dict[str, str] = field(default_factory=dict)
    ok: bool = True

    def refuse(self, stmt: cst.CSTNode, reason: str) -> None:
        head = first_line(stmt) if isinstance(stmt, cst.BaseStatement) else code(stmt)
        self.problems.append(f"{self.where} line {self.line(stmt)}: `{head}` {reason}")
        self.ok = False


def _read_method(function, states, where, line, problems) -> StateMethodFacts | None:
    facts = StateMethodFacts(name=function.name.value)
    bound = {cst.ensure_type(n, cst.Name).value for n in m.findall(function, m.Name())}
    clash = sorted(bound & set(EMITTED_NAMES))
    if clash:
        problems.append(
            f"{where} (line {line(function)}) already uses {', '.join(clash)}, names the "
            "rewrite binds for the step's metadata and state blocks"
        )
        return None
    scan = _Scan(where, states, bound, line, problems, facts)
    body = list(cst.ensure_type(function.body, cst.IndentedBlock).body)
    for index, stmt in enumerate(body):
        before = len(facts.uses)
        _scan_statement(stmt, scan, top_level=True)
        if len(facts.uses) > before and facts.first_index is None:
            facts.first_index = index
    return facts if scan.ok else None


def _scan_statement(stmt: cst.BaseStatement, scan: _Scan, *, top_level: bool) -> None:
    alias = _alias(stmt, scan.states, scan.aliases)
    if alias is not None:
        if not top_level:
            scan.refuse(
                stmt,
                "binds a state alias inside a block; the rewrite reads the "
                "states' blocks once, at the top level of the method",
            )
            return
        scan.aliases[alias[0]] = alias[1]
        scan.facts.uses.append(StateUse(node=stmt, kind=UseKind.ALIAS, alias=alias[0]))
        return
    direct = [
        a
        for a in m.findall(stmt, m.Attribute(value=m.Name("self")))
        if cst.ensure_type(a, cst.Attribute).attr.value in scan.states
    ]
    if direct:
        scan.refuse(
            stmt,
            "uses the state self.<state> directly; the rewrite converts states "
            "read through a local alias (`conv_state = self.conv_state`) at the top "
            "level of the method",
        )
        return
    used = [a for a in scan.aliases if m.findall(stmt, m.Name(a))]
    if not used:
        return
    if isinstance(stmt, (cst.If, cst.With)):
        _scan_block(stmt, used, scan)
        return
    if len(used) > 1:
        scan.refuse(
            stmt,
            f"uses the states {', '.join(used)} together; the rewrite "
            "converts one state per statement",
        )
        return
    kind = _use_kind(stmt, used[0])
    if kind is None:
        scan.refuse(
            stmt,
            f"uses the Legacy rows {used[0]} in a way the rewrite does not "
            f"convert (it converts `{used[0]}.copy_(x)`, the state argument of "
            "npu_recurrent_gated_delta_rule with ssm_state_indices=, and a plain "
            "argument of a call, as statements of the method or of a `with` / "
            f"`if {used[0]} is not None:` block)",
        )
        return
    if kind is UseKind.PASSED and f"{used[0]}_step" in scan.bound:
        scan.refuse(
            stmt, f"would need {used[0]}_step for this step's rows, a name the method already uses"
        )
        return
    scan.facts.uses.append(StateUse(node=stmt, kind=kind, alias=used[0]))


def _scan_block(stmt: cst.If | cst.With, used: list[str], scan: _Scan) -> None:
    """A ``with`` whose header reads no state, or an ``if <alias> is not None:`` without
    else: the statements inside are scanned as the method's own."""
    if isinstance(stmt, cst.With):
        if any(m.findall(item, m.Name(a)) for item in stmt.items for a in used):
            scan.refuse(stmt, f"reads the Legacy rows {', '.join(used)} in its header")
            return
    elif not any(m.matches(stmt, _none_guard(a)) for a in used):
        scan.refuse(
            stmt,
            f"uses the Legacy rows {', '.join(used)} under a condition; the rewrite enters "
            "only `if <state> is not None:` guards without else (always true for a paged "
            "state), since a state is read and written for every request of the step",
        )
        return
    for inner in cst.ensure_type(stmt.body, cst.IndentedBlock).body:
        _scan_statement(inner, scan, top_level=False)


def _is_state_argument(expr: cst.BaseExpression, alias: str) -> bool:
    """``alias`` or ``alias.to(...)``: the kernel updates what it is given in place."""
    cast = m.Call(func=m.Attribute(value=m.Name(alias), attr=m.Name("to")))
    return m.matches(expr, m.Name(alias) | cast)


def _use_kind(stmt: cst.BaseStatement, alias: str) -> UseKind | None:
    """How one simple statement uses ALIAS, or None for a use the rewrite leaves alone."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    copy = m.Expr(
        value=m.Call(func=m.Attribute(value=m.Name(alias), attr=m.Name("copy_")), args=[m.Arg()])
    )
    if m.matches(small, copy):
        return UseKind.WRITE
    value = small.value if isinstance(small, (cst.Expr, cst.Assign)) else None
    if not isinstance(value, cst.Call) or len(m.findall(stmt, m.Name(alias))) != 1:
        return None
    if m.matches(value, INDEXED_KERNEL):
        keywords = {a.keyword.value for a in value.args if a.keyword is not None}
        positional = [a for a in value.args if a.keyword is None]
        is_state = len(positional) >= 4 and _is_state_argument(positional[3].value, alias)
        return UseKind.INDEXED if is_state and INDEX_KEYWORD in keywords else None
    # the alias must be one whole argument of the statement's call, used nowhere else
    if not any(m.matches(a.value, m.Name(alias)) for a in value.args):
        return None
    return UseKind.PASSED


__all__ = [
    "LegacyStateFacts",
    "StateAllocation",
    "StateLayerFacts",
    "StateMethodFacts",
    "StateUse",
    "UseKind",
    "gather_legacy_states",
]
