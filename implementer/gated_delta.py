"""Gated delta net layers (Qwen3-Next, Qwen3.5, Kimi delta attention): paged recurrent states.

A gated delta net is recognised by what its ``forward`` does, never by its name: it runs a
causal conv (``causal_conv1d_fn`` / ``causal_conv1d_update``) and a gated delta rule
(``*chunk_gated_delta_rule`` / ``*recurrent_gated_delta_rule``, or Kimi's
``*_kimi_delta_attention`` with a decay per key channel), both in ``if`` statements
that choose between transformers' cached decode path and its prefill path. The rewrite keeps
the projections, the splits, the gates and the output norm as written, and replaces four
top-level statements of the forward:

    read     ``if cache is not None: conv_state = cache.get_conv_state(...) ...``
             -> the step's metadata, each request's state index and start offsets
    conv     ``if conv_state is not None and seq_len == 1: x = causal_conv1d_update(...)``
             -> the varlen conv over the packed requests, on the paged conv states
    rule     ``if recurrent_state is not None and seq_len == 1: o, s = ...delta_rule(...)``
             -> the chunked (prefill) or recurrent (decode) rule on the paged ssm states
    write    ``if cache is not None: cache.update_recurrent_state(...)`` -> removed

``__init__`` declares two ``MambaCacheEntry`` (conv and ssm state) under attn_type "Mamba".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import once_per_node
from kvskill.implementer._command import (
    StateMixerCommand,
    append_statements,
    replace_method,
    with_body,
)
from kvskill.implementer.facts import (
    CACHE_ENTRIES_ASSIGN,
    _assigned_names,
    _method,
    _top_index,
    _used_names,
    class_assigns,
    code,
)
from kvskill.implementer.snippets import methods, statements


def _name_ending(suffix: str) -> m.BaseMatcherNode:
    ends = m.MatchIfTrue(lambda value: value.endswith(suffix))
    return m.Name(value=ends) | m.Attribute(attr=m.Name(value=ends))


def _call_of(*suffixes: str) -> m.Call:
    func = _name_ending(suffixes[0])
    for suffix in suffixes[1:]:
        func = func | _name_ending(suffix)
    return m.Call(func=func)


#: the gated delta rule in any spelling (torch_chunk_..., chunk_..., fused_recurrent_...)
GDN_RULE_CALL = _call_of("chunk_gated_delta_rule", "recurrent_gated_delta_rule")
#: Kimi delta attention: the same rule with a decay per key channel
KDA_RULE_CALL = _call_of("kimi_delta_attention", "_kda")
RULE_CALL = GDN_RULE_CALL | KDA_RULE_CALL
#: the runtime operators each rule runs on: (prefill, decode)
RULE_OPS = {
    "gated_delta": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "kda": ("chunk_kda", "fused_recurrent_kda"),
}
#: the prefill conv (the one whose arguments the rewrite reuses)
CONV_FN_CALL = _call_of("causal_conv1d_fn")
CONV_CALL = _call_of("causal_conv1d_fn", "causal_conv1d_update")
STATE_READ_CALL = m.Call(
    func=m.Attribute(attr=m.Name("get_conv_state") | m.Name("get_recurrent_state"))
)
STATE_WRITE_CALL = m.Call(func=m.Attribute(attr=m.Name("update_recurrent_state")))
#: the state shapes read ``self.<attr>`` set in ``__init__``: per role, the first name found
SHAPE_ATTRS = {
    "kernel_expr": ("conv_kernel_size",),
    "conv_dim_expr": ("conv_dim",),
    "v_heads_expr": ("num_v_heads", "num_heads"),
    "k_dim_expr": ("head_k_dim", "head_dim"),
    "v_dim_expr": ("head_v_dim", "head_dim"),
}


def _self_assign(attr: str) -> m.Assign:
    return m.Assign(
        targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name(attr)))]
    )


@dataclass(kw_only=True)
class ConvMixerFacts:
    """What the rewrite of every conv-based state mixer reads (gated delta nets, Mamba-1
    mixers, short convs): its state shapes, where its forward reads the states, runs the conv
    and writes the states, and the conv's operands."""

    name: str
    converted: bool
    #: template values of the state shapes, e.g. {"v_heads_expr": "self.num_v_heads"}
    shapes: dict[str, str] = field(default_factory=dict)
    read_index: int | None = None
    conv_index: int | None = None
    write_index: int | None = None
    #: the conv's input and the name its result is bound to (``mixed_qkv``), [1, C, T]
    conv_source: str = ""
    conv_target: str = ""
    conv_weight: str = ""
    conv_bias: str = "None"
    activation: str = "self.activation"
    #: the forward's first argument after self (the hidden states)
    hidden: str = "hidden_states"
    problems: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class GatedDeltaFacts(ConvMixerFacts):
    """One gated delta net class and the statements its forward rewrite replaces."""

    #: "gated_delta" (decay per head) or "kda" (decay per key channel)
    rule: str = "gated_delta"
    rule_index: int | None = None
    query: str = ""
    key: str = ""
    value: str = ""
    g: str = ""
    beta: str = ""
    scale: str | None = None
    l2norm: str = "False"
    #: the rule's assignment targets: output and final state
    rule_targets: list[str] = field(default_factory=list)


@once_per_node
def is_gated_delta_class(cls: cst.ClassDef) -> bool:
    """A class whose forward runs a causal conv and a gated delta rule, or one converted by
    this rewrite (it declares ``cache_entries`` and calls the paged rule)."""
    forward = _method(cls, "forward")
    if forward is None:
        return False
    return bool(m.findall(forward, RULE_CALL)) and bool(m.findall(forward, CONV_CALL))


def _call_assigns(stmt: cst.CSTNode, call: m.Call) -> list[tuple[list[str], cst.Call]]:
    """Targets and call of every ``names = call(...)`` inside STMT, in order."""
    found = []
    for node in m.findall(stmt, m.Assign(value=call)):
        assign = cst.ensure_type(node, cst.Assign)
        target = assign.targets[0].target
        elements = target.elements if isinstance(target, cst.Tuple) else [target]
        names = [e.value if isinstance(e, cst.Element) else e for e in elements]
        targets = [n.value if isinstance(n, cst.Name) else "" for n in names]
        found.append((targets, cst.ensure_type(assign.value, cst.Call)))
    return found


def _arguments(
    call: cst.Call, names: list[str], keywords_allowed: set[str]
) -> tuple[dict[str, str], list[str]]:
    """CALL's arguments by parameter name (positional ones in NAMES order), and the reasons
    they cannot be read (an extra positional, an unknown keyword, a ``*args``)."""
    values: dict[str, str] = {}
    problems: list[str] = []
    positional = [a for a in call.args if a.keyword is None and not a.star]
    if len(positional) > len(names):
        problems.append(f"{len(positional)} positional arguments")
    for name, arg in zip(names, positional, strict=False):
        values[name] = code(arg.value)
    for arg in call.args:
        if arg.star == "*":
            problems.append("*args")
        elif arg.keyword is not None:
            keyword = arg.keyword.value
            if keyword not in keywords_allowed:
                problems.append(f"keyword {keyword}=")
            values[keyword] = code(arg.value)
    return values, problems


#: transformers' causal conv signatures, and the keywords the rewrite knows the meaning of
CONV_FN_PARAMS = ["hidden_states", "weight", "bias", "activation"]
CONV_UPDATE_PARAMS = ["hidden_states", "conv_state", "weight", "bias", "activation"]
#: (``seq_idx`` marks the sequences of a packed batch for the source's kernel; the paged conv
#: separates the step's requests by query_start_loc instead)
CONV_KEYWORDS = {"hidden_states", "conv_state", "weight", "bias", "activation", "seq_idx"}
#: transformers' delta rule signature (both forms)
RULE_PARAMS = [
    "query",
    "key",
    "value",
    "g",
    "beta",
    "initial_state",
    "output_final_state",
    "use_qk_l2norm_in_kernel",
]
RULE_KEYWORDS = {*RULE_PARAMS, "scale", "cu_seqlens"}
#: what the rewrite passes on from the source's rule call; both calls must agree on them
RULE_OPERANDS = ("query", "key", "value", "g", "beta", "scale", "use_qk_l2norm_in_kernel")
#: locals the emitted statements bind in the forward
EMITTED_LOCALS = frozenset(
    {"md", "state_index", "has_initial_state", "query_start_loc", "initial_state"}
)


def state_shape_attrs(
    cls: cst.ClassDef, class_name: str, shape_attrs: dict[str, tuple[str, ...]]
) -> tuple[dict[str, str], list[str]]:
    """For each role of ``shape_attrs``, the first ``self.<name>`` the class assigns (the
    expression the emitted state shapes use), and a problem for each role it assigns none of."""
    shapes: dict[str, str] = {}
    problems: list[str] = []
    for role, names in shape_attrs.items():
        found = next((n for n in names if class_assigns(cls, _self_assign(n))), None)
        if found is None:
            problems.append(
                f"{class_name}.__init__ sets none of {', '.join('self.' + n for n in names)}, "
                "from which the conv and ssm state shapes are written"
            )
        else:
            shapes[role] = f"self.{found}"
    return shapes, problems


def mixer_forward(cls: cst.ClassDef) -> tuple[list[str], cst.IndentedBlock]:
    """The parameter names and the body of a mixer's forward (its predicate found it)."""
    forward = _method(cls, "forward")
    assert forward is not None, "the mixer's predicate checked the forward"
    return [p.name.value for p in forward.params.params], cst.ensure_type(
        forward.body, cst.IndentedBlock
    )


def statement_order(
    body: cst.IndentedBlock, *steps: m.BaseMatcherNode
) -> tuple[list[int | None], bool]:
    """The top-level statement of BODY holding each of STEPS, and whether each step has a
    statement of its own, in the order given (the rewrite replaces them one by one)."""
    indices = [_top_index(body, step) for step in steps]
    ordered = None not in indices and indices == sorted(indices) and len(set(indices)) == len(steps)
    return indices, ordered


@dataclass(frozen=True)
class MixerStatements:
    """A conv + kernel state mixer's forward: its parameters, its body, the statements that
    read the states, run the conv and run the kernel, and the one that writes the states."""

    params: list[str]
    body: cst.IndentedBlock
    #: (read, conv, kernel) statement indices, in that order
    order: tuple[int, int, int]
    write_index: int | None


def ordered_mixer_statements(
    cls: cst.ClassDef,
    facts: Any,
    shape_attrs: dict[str, tuple[str, ...]],
    kernel_call: m.BaseMatcherNode,
    kernel: str,
    *,
    early_write: str,
    write_with_kernel: bool = False,
) -> MixerStatements | None:
    """The facts every conv + kernel mixer gathers first (state shapes, the hidden states'
    name, the statement order), or None with the reason in FACTS' problems.

    EARLY_WRITE names what a write before the kernel writes (the refusal's words);
    WRITE_WITH_KERNEL allows the write in the kernel's own statement (a scan that returns
    the state it writes)."""
    shapes, problems = state_shape_attrs(cls, facts.name, shape_attrs)
    facts.shapes.update(shapes)
    facts.problems.extend(problems)
    params, body = mixer_forward(cls)
    if len(params) >= 2:
        facts.hidden = params[1]
    order, ordered = statement_order(body, STATE_READ_CALL, CONV_CALL, kernel_call)
    write = _top_index(body, STATE_WRITE_CALL)
    if not ordered:
        facts.problems.append(conv_then_kernel_problem(facts.name, kernel))
        return None
    read, conv, kernel_index = (int(i) for i in order if i is not None)
    if write is not None and (
        write < kernel_index or (write == kernel_index and not write_with_kernel)
    ):
        facts.problems.append(f"{facts.name}.forward writes its {early_write}")
        return None
    return MixerStatements(params, body, (read, conv, kernel_index), write)


def conv_then_kernel_problem(name: str, kernel: str) -> str:
    """The refusal of a forward whose read, conv and KERNEL are not three ordered statements."""
    return (
        f"{name}.forward does not read its cached states, run the causal conv and then the "
        f"{kernel} in three separate statements"
    )


def gated_delta_facts(cls: cst.ClassDef) -> GatedDeltaFacts:
    """Gather what the rewrite needs; ``problems`` lists what blocks it."""
    facts = GatedDeltaFacts(name=cls.name.value, converted=class_assigns(cls, CACHE_ENTRIES_ASSIGN))
    if facts.converted:
        return facts
    found = ordered_mixer_statements(
        cls,
        facts,
        SHAPE_ATTRS,
        RULE_CALL,
        "gated delta rule",
        early_write="state before the delta rule",
    )
    if found is None:
        return facts
    params, body = found.params, found.body
    facts.read_index, facts.conv_index, facts.rule_index = found.order
    facts.write_index = found.write_index
    before = set(params) | _assigned_names(list(body.body[: facts.conv_index]))
    _conv_facts(facts, body.body[facts.conv_index], before)
    _rule_facts(facts, body.body[facts.rule_index])
    if not facts.problems:
        _check_names(facts, body)
    return facts


def _conv_facts(facts: GatedDeltaFacts, stmt: cst.BaseStatement, before: set[str]) -> None:
    """The conv statement: every assignment in it binds the conv's result to one name, from
    a causal conv call, the cache's ``update_conv_state`` or a slice of that name; the two
    conv calls agree on weight, bias and activation; the input is a name set before it."""
    calls = _call_assigns(stmt, CONV_CALL)
    fn_calls = [(t, c) for t, c in calls if m.matches(c, CONV_FN_CALL)]
    if not fn_calls or any(len(t) != 1 or not t[0] for t, _ in calls):
        facts.problems.append(
            f"{facts.name}.forward does not assign causal_conv1d_fn(...) to one name"
        )
        return
    facts.conv_target = fn_calls[0][0][0]
    readings = []
    for _, call in calls:
        fn = m.matches(call, CONV_FN_CALL)
        values, problems = _arguments(
            call, CONV_FN_PARAMS if fn else CONV_UPDATE_PARAMS, CONV_KEYWORDS
        )
        if problems or "hidden_states" not in values or "weight" not in values:
            facts.problems.append(
                f"{facts.name}.forward calls the causal conv with arguments the rewrite cannot "
                f"read ({', '.join(problems) or 'no input or weight'})"
            )
            return
        readings.append(
            (values["weight"], values.get("bias", "None"), values.get("activation", "None"))
        )
        if fn:
            facts.conv_source = values["hidden_states"]
    if len(set(readings)) != 1:
        facts.problems.append(
            f"{facts.name}.forward's prefill and decode convs differ in weight, bias or activation"
        )
        return
    facts.conv_weight, facts.conv_bias, facts.activation = readings[0]
    if facts.conv_source not in before:
        facts.problems.append(
            f"{facts.name}.forward's conv input {facts.conv_source!r} is not a name set "
            "before the conv statement"
        )
        return
    target = facts.conv_target
    allowed = (
        m.Assign(targets=[m.AssignTarget(target=m.Name(target))], value=CONV_CALL)
        | m.Assign(
            targets=[m.AssignTarget(target=m.Name(target))],
            value=m.Call(func=m.Attribute(attr=m.Name("update_conv_state"))),
        )
        | m.Assign(
            targets=[m.AssignTarget(target=m.Name(target))],
            value=m.Subscript(value=m.Name(target)),
        )
    )
    _only(facts, stmt, allowed, "conv")


def _only(facts: GatedDeltaFacts, stmt: cst.BaseStatement, allowed, what: str) -> None:
    """Every simple statement inside STMT matches ALLOWED (``if`` tests are free)."""
    for line in m.findall(stmt, m.SimpleStatementLine()):
        for small in cst.ensure_type(line, cst.SimpleStatementLine).body:
            if not m.matches(small, allowed | m.Pass()):
                facts.problems.append(
                    f"{facts.name}.forward's {what} statement also does `{code(small)}`, which "
                    "the rewrite would drop"
                )
                return


def _rule_facts(facts: GatedDeltaFacts, stmt: cst.BaseStatement) -> None:
    """The rule statement: each branch assigns one rule call to (output, state), and the
    calls agree on every operand the rewrite passes on."""
    calls = _call_assigns(stmt, RULE_CALL)
    if not calls or any(len(t) != 2 or not all(t) for t, _ in calls):
        facts.problems.append(
            f"{facts.name}.forward does not assign the gated delta rule to (output, state)"
        )
        return
    if len({tuple(t) for t, _ in calls}) != 1:
        facts.problems.append(f"{facts.name}.forward's rule calls assign different names")
        return
    facts.rule_targets = calls[0][0]
    kinds = {"kda" if m.matches(c, KDA_RULE_CALL) else "gated_delta" for _, c in calls}
    readings = []
    for _, call in calls:
        values, problems = _arguments(call, RULE_PARAMS, RULE_KEYWORDS)
        missing = [n for n in RULE_PARAMS[:5] if n not in values]
        if problems or missing:
            facts.problems.append(
                f"{facts.name}.forward calls the delta rule with arguments the rewrite cannot "
                f"read ({', '.join(problems) or 'no ' + '/'.join(missing)})"
            )
            return
        readings.append(tuple(values.get(n) for n in RULE_OPERANDS))
    if len(kinds) != 1 or len(set(readings)) != 1:
        facts.problems.append(
            f"{facts.name}.forward's prefill and decode rule calls differ in their operands"
        )
        return
    (facts.rule,) = kinds
    query, key, value, g, beta, scale, l2norm = readings[0]
    facts.query, facts.key, facts.value, facts.g, facts.beta = query, key, value, g, beta
    facts.scale = scale
    facts.l2norm = l2norm or "False"
    targets = [m.Name(n) for n in facts.rule_targets]
    allowed = m.Assign(
        targets=[m.AssignTarget(target=m.Tuple(elements=[m.Element(t) for t in targets]))],
        value=RULE_CALL,
    )
    _only(facts, stmt, allowed, "delta rule")


def _check_names(facts: GatedDeltaFacts, body: cst.IndentedBlock) -> None:
    """Names the replaced statements defined must not be read by the statements kept."""
    replaced_at = {facts.read_index, facts.conv_index, facts.rule_index, facts.write_index}
    replaced = [s for i, s in enumerate(body.body) if i in replaced_at]
    kept = [s for i, s in enumerate(body.body) if i not in replaced_at]
    defined_again = {facts.conv_target, *facts.rule_targets}
    clash = EMITTED_LOCALS & (_used_names(kept) | _assigned_names(kept))
    if clash:
        facts.problems.append(
            f"{facts.name}.forward uses {sorted(clash)}, names the rewrite binds for the "
            "paged state"
        )
    leaked = (_assigned_names(replaced) - defined_again) & _used_names(kept)
    if leaked:
        facts.problems.append(
            f"{facts.name}.forward uses {sorted(leaked)} outside the cache statements the "
            "rewrite replaces"
        )


def _forward_values(facts: GatedDeltaFacts) -> dict:
    prefill_op, decode_op = RULE_OPS[facts.rule]
    return {
        "prefill_op": prefill_op,
        "decode_op": decode_op,
        "hidden": facts.hidden,
        "target": facts.conv_target,
        "source": facts.conv_source,
        "weight": facts.conv_weight,
        "bias": facts.conv_bias,
        "activation": facts.activation,
        "output": facts.rule_targets[0],
        "state": facts.rule_targets[1],
        "query": facts.query,
        "key": facts.key,
        "value": facts.value,
        "g": facts.g,
        "beta": facts.beta,
        "scale": facts.scale,
        "l2norm": facts.l2norm,
    }


def _with_leading(new: list[cst.BaseStatement], old: cst.BaseStatement) -> list[cst.BaseStatement]:
    """NEW, keeping the blank lines and comments that led into OLD."""
    first = new[0]
    return [
        first.with_changes(leading_lines=[*old.leading_lines, *first.leading_lines]),
        *new[1:],
    ]


def splice_forward(
    forward: cst.FunctionDef,
    replacements: dict[int | None, list[cst.BaseStatement]],
    drop: int | None = None,
) -> cst.FunctionDef:
    """FORWARD with each top-level statement i replaced by ``replacements[i]`` (keeping the
    comments that led into it) and statement DROP, a state write the replacements take over,
    left out unless it is itself replaced."""
    block = cst.ensure_type(forward.body, cst.IndentedBlock)
    body: list[cst.BaseStatement] = []
    for index, stmt in enumerate(block.body):
        if index in replacements:
            body.extend(_with_leading(replacements[index], stmt))
        elif index != drop:
            body.append(stmt)
    return forward.with_changes(body=block.with_changes(body=body))


class GatedDeltaCommand(StateMixerCommand):
    """Declare the conv and ssm state entries and run both operators on the paged states."""

    DESCRIPTION = "Keep gated delta net states in the paged runtime's Mamba group."
    KIND = "gated delta net"
    is_kind = staticmethod(is_gated_delta_class)
    gather = staticmethod(gated_delta_facts)

    def convert(
        self, updated: cst.ClassDef, facts: GatedDeltaFacts, config: cst.PartialParserConfig
    ) -> cst.ClassDef:
        init_stmts = statements("framework_gdn_init.py.j2", config, **facts.shapes)
        updated = with_body(
            updated,
            replace_method(updated, "__init__", lambda init: append_statements(init, init_stmts)),
        )
        body = replace_method(updated, "forward", lambda f: self._convert_forward(f, facts, config))
        return with_body(updated, [*body, *methods("framework_gdn_methods.py.j2", config)])

    def _convert_forward(
        self, forward: cst.FunctionDef, facts: GatedDeltaFacts, config: cst.PartialParserConfig
    ) -> cst.FunctionDef:
        values = _forward_values(facts)
        replacements = {
            facts.read_index: statements("framework_gdn_state.py.j2", config, **values),
            facts.conv_index: statements("framework_gdn_conv.py.j2", config, **values),
            facts.rule_index: statements("framework_gdn_rule.py.j2", config, **values),
        }
        # NOTE: the write comes after the rule (facts), so it is never a replaced statement
        return splice_forward(forward, replacements, drop=facts.write_index)


__all__ = [
    "GatedDeltaCommand",
    "GatedDeltaFacts",
    "gated_delta_facts",
    "is_gated_delta_class",
]
