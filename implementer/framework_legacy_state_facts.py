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
    index: int
    kind: UseKind
    #: the alias the statement uses (the state's local name)
    alias: str


@dataclass(kw_only=True)
class StateMethodFacts:
    name: str
    #: top-level statements that use a state, in order
    uses: list[StateUse] = field(default_factory=list)

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


def _alias(stmt: cst.BaseStatement, states: set[str]) -> tuple[str, str] | None:
    """(alias, state) of a ``alias = self.<state>`` statement."""
    pattern = m.SimpleStatementLine(
        body=[
            m.Assign(
                targets=[m.AssignTarget(target=m.Name())],
                value=m.Attribute(value=m.Name("self")),
            )
        ]
    )
    if not m.matches(stmt, pattern):
        return None
    assign = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign)
    state = cst.ensure_type(assign.value, cst.Attribute).attr.value
    if state not in states:
        return None
    return cst.ensure_type(assign.targets[0].target, cst.Name).value, state


def _read_method(function, states, where, line, problems) -> StateMethodFacts | None:
    body = list(cst.ensure_type(function.body, cst.IndentedBlock).body)
    facts = StateMethodFacts(name=function.name.value)
    aliases: dict[str, str] = {}
    bound = {cst.ensure_type(n, cst.Name).value for n in m.findall(function, m.Name())}
    clash = sorted(bound & set(EMITTED_NAMES))
    if clash:
        problems.append(
            f"{where} (line {line(function)}) already uses {', '.join(clash)}, names the "
            "rewrite binds for the step's metadata and state blocks"
        )
        return None
    ok = True
    for index, stmt in enumerate(body):
        alias = _alias(stmt, states)
        if alias is not None:
            aliases[alias[0]] = alias[1]
            facts.uses.append(StateUse(index=index, kind=UseKind.ALIAS, alias=alias[0]))
            continue
        used = [a for a in aliases if m.findall(stmt, m.Name(a))]
        direct = [
            a
            for a in m.findall(stmt, m.Attribute(value=m.Name("self")))
            if cst.ensure_type(a, cst.Attribute).attr.value in states
        ]
        if direct:
            problems.append(
                f"{where} line {line(stmt)}: `{code(stmt).splitlines()[0]}` uses the state "
                "self.<state> directly; the rewrite converts states read through a local "
                "alias (`conv_state = self.conv_state`) at the top level of the method"
            )
            ok = False
            continue
        if not used:
            continue
        if len(used) > 1:
            problems.append(
                f"{where} line {line(stmt)}: `{code(stmt).splitlines()[0]}` uses the states "
                f"{', '.join(used)} together; the rewrite converts one state per statement"
            )
            ok = False
            continue
        kind = _use_kind(stmt, used[0])
        if kind is None:
            problems.append(
                f"{where} line {line(stmt)}: `{code(stmt).splitlines()[0]}` uses the Legacy "
                f"rows {used[0]} in a way the rewrite does not convert (it converts "
                f"`{used[0]}.copy_(x)`, the state argument of npu_recurrent_gated_delta_rule "
                "with ssm_state_indices=, and a plain argument of a call, each as a top-level "
                "statement)"
            )
            ok = False
            continue
        if kind is UseKind.PASSED and f"{used[0]}_step" in bound:
            problems.append(
                f"{where} line {line(stmt)}: the rewrite would bind {used[0]}_step for this "
                "step's rows, a name the method already uses"
            )
            ok = False
            continue
        facts.uses.append(StateUse(index=index, kind=kind, alias=used[0]))
    return facts if ok else None


def _use_kind(stmt: cst.BaseStatement, alias: str) -> UseKind | None:
    """How one top-level statement uses ALIAS, or None for a use the rewrite leaves alone."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    copy = m.Expr(
        value=m.Call(func=m.Attribute(value=m.Name(alias), attr=m.Name("copy_")), args=[m.Arg()])
    )
    if m.matches(small, copy):
        return UseKind.WRITE
    value = small.value if isinstance(small, (cst.Expr, cst.Assign)) else None
    if not isinstance(value, cst.Call):
        return None
    # the alias must be one whole argument of the statement's call, used nowhere else
    as_argument = [a for a in value.args if m.matches(a.value, m.Name(alias))]
    if len(as_argument) != 1 or len(m.findall(stmt, m.Name(alias))) != 1:
        return None
    if m.matches(value, INDEXED_KERNEL):
        keywords = {a.keyword.value for a in value.args if a.keyword is not None}
        positional = [a for a in value.args if a.keyword is None]
        is_state = len(positional) >= 4 and positional[3] is as_argument[0]
        if is_state and INDEX_KEYWORD in keywords:
            return UseKind.INDEXED
        return None
    if m.findall(value.func, m.Name(alias)):
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
