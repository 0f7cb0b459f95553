"""Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba): paged conv and SSM states.

A Mamba-1 mixer is recognised by what its ``forward`` does: a causal conv
(``causal_conv1d_fn`` / ``causal_conv1d_update``) and a selective scan
(``*selective_scan`` / ``selective_scan_fn``, decode by ``*selective_state_update``), each
in an ``if`` statement that chooses between transformers' cached decode path and its
prefill path. The projections, the selection (``x_proj``, ``dt_proj``, Jamba's and
Falcon-Mamba's norms on dt, B and C) and ``out_proj`` stay as written; three top-level
statements of the forward are replaced:

    read   ``if cache is not None: conv_state = cache.get_conv_state(...) ...``
           -> the step's metadata: each request's state row and whether it has a state
    conv   ``if conv_state is not None and seq_len == 1: x = causal_conv1d_update(...)``
           -> the varlen conv over the packed requests on the paged conv states (as the
              gated delta rewrite emits it)
    scan   ``if recurrent_state is not None and seq_len == 1: y = ...state_update(...)
           else: ... = ..._selective_scan(...); cache.update_recurrent_state(...)``
           -> ``selective_scan_fn`` over the packed requests (prefill) or
              ``selective_state_update`` (decode, one token per request), as vLLM's Mamba-1
              layer does, reading and writing the paged SSM states

A scan statement that runs the scan once per head in ``for h in range(heads)`` (zamba's
multi-head mixer, each head with its own x/dt projections) keeps that loop: head h scans on
the h-th equal slice of the paged state's channels, which is where the source's reshape
``[batch, heads, head_dim, L]`` puts that head's channels; verify checks the layout holds.

``__init__`` declares two ``MambaCacheEntry`` (conv and SSM state) under attn_type "Mamba".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import once_per_node
from kvskill.implementer._command import StateMixerCommand
from kvskill.implementer.facts import (
    CACHE_ENTRIES_ASSIGN,
    _assigned_names,
    _method,
    _used_names,
    class_assigns,
)
from kvskill.implementer.gated_delta import (
    CONV_CALL,
    EMITTED_LOCALS,
    RULE_CALL,
    ConvMixerFacts,
    _arguments,
    _call_of,
    _conv_facts,
    ordered_mixer_statements,
    splice_forward,
)
from kvskill.implementer.snippets import statements
from kvskill.implementer.state_entries import (
    StateEntry,
    declare_states,
    with_pinned_dtypes,
)

#: the Mamba-1 selective scan in any spelling (transformers' mamba_selective_scan,
#: mamba_ssm's / vLLM's selective_scan_fn)
SCAN_CALL = _call_of("selective_scan", "selective_scan_fn")
#: the state shapes read ``self.<attr>`` set in ``__init__``: per role, the first name found
SHAPE_ATTRS = {
    "kernel_expr": ("conv_kernel_size",),
    "dim_expr": ("intermediate_size",),
    "dstate_expr": ("ssm_state_size",),
}
#: transformers' selective scan signature (batch form: u [batch, dim, L], B [batch, N, L])
SCAN_PARAMS = [
    "hidden_states",
    "dt",
    "A",
    "B",
    "C",
    "D",
    "z",
    "delta_bias",
    "delta_softplus",
    "return_last_state",
]
#: keywords whose meaning the rewrite knows: the operands, and two choices of a PyTorch
#: algorithm that do not change the result
SCAN_KEYWORDS = {*SCAN_PARAMS, "u", "delta", "use_mambapy", "use_associative_scan"}


@dataclass(kw_only=True)
class Mamba1Facts(ConvMixerFacts):
    """One Mamba-1 mixer class and the statements its forward rewrite replaces."""

    scan_index: int | None = None
    #: the scan's operands as the source passes them (batch form, batch 1)
    operands: dict[str, str] = field(default_factory=dict)
    #: the name the scan statement's result is bound to and read by the rest of the forward
    output: str = ""
    #: a scan run once per head (zamba's multi-head mixer): the loop's variable and its
    #: ``range(...)`` count; head h owns the h-th equal slice of the state's channels
    loop_var: str | None = None
    heads: str | None = None


@once_per_node
def is_mamba1_class(cls: cst.ClassDef) -> bool:
    """A class whose forward runs a causal conv and a Mamba-1 selective scan."""
    forward = _method(cls, "forward")
    if forward is None or m.findall(forward, RULE_CALL):
        return False
    return bool(m.findall(forward, SCAN_CALL)) and bool(m.findall(forward, CONV_CALL))


def mamba1_facts(cls: cst.ClassDef) -> Mamba1Facts:
    """Gather what the rewrite needs; ``problems`` lists what blocks it."""
    facts = Mamba1Facts(name=cls.name.value, converted=class_assigns(cls, CACHE_ENTRIES_ASSIGN))
    if facts.converted:
        return facts
    found = ordered_mixer_statements(
        cls,
        facts,
        SHAPE_ATTRS,
        SCAN_CALL,
        "selective scan",
        early_write="SSM state before the scan",
        write_with_kernel=True,
    )
    if found is None:
        return facts
    params, body = found.params, found.body
    facts.read_index, facts.conv_index, facts.scan_index = found.order
    facts.write_index = found.write_index
    _loop_facts(facts, body.body[facts.scan_index])
    if facts.problems:
        return facts
    before = set(params) | _assigned_names(list(body.body[: facts.conv_index]))
    _conv_facts(facts, body.body[facts.conv_index], before)
    if not facts.problems:
        _scan_facts(facts, body)
    return facts


#: the names the per-head scan binds (framework_mamba1_scan.py.j2)
HEAD_LOCALS = frozenset(
    {"paged_head_outputs", "paged_head_channels", "paged_head_state", "paged_head_output"}
)
#: ``for <name> in range(<count>):``
HEAD_LOOP = m.For(
    target=m.Name(),
    iter=m.Call(func=m.Name("range"), args=[m.Arg(keyword=None)]),
)


def _loop_facts(facts: Mamba1Facts, stmt: cst.CSTNode) -> None:
    """A scan statement that runs the scan in a loop: one ``for h in range(n)`` around the
    one scan call (the source's per-head scans, each on its own slice of the channels)."""
    if m.findall(stmt, m.While()):
        facts.problems.append(f"{facts.name}.forward runs its selective scan in a while loop")
        return
    loops = [
        cst.ensure_type(loop, cst.For)
        for loop in m.findall(stmt, m.For())
        if m.findall(loop, SCAN_CALL)
    ]
    if not loops:
        return
    if len(loops) != 1 or not m.matches(loops[0], HEAD_LOOP):
        facts.problems.append(
            f"{facts.name}.forward runs its selective scan in loops other than one "
            "'for head in range(heads)' (the per-head form the rewrite keeps)"
        )
        return
    loop = loops[0]
    facts.loop_var = cst.ensure_type(loop.target, cst.Name).value
    count = cst.ensure_type(loop.iter, cst.Call).args[0].value
    facts.heads = cst.Module(body=[]).code_for_node(count)


def _scan_facts(facts: Mamba1Facts, body: cst.IndentedBlock) -> None:
    """The scan statement: one scan call whose operands are readable, and one
    name it binds that the rest of the forward reads (the scan's output)."""
    stmt = body.body[facts.scan_index]
    calls = [cst.ensure_type(c, cst.Call) for c in m.findall(stmt, SCAN_CALL)]
    if len(calls) != 1:
        facts.problems.append(f"{facts.name}.forward calls the selective scan {len(calls)} times")
        return
    values, problems = _arguments(calls[0], SCAN_PARAMS, SCAN_KEYWORDS)
    values.setdefault("hidden_states", values.get("u", ""))
    values.setdefault("dt", values.get("delta", ""))
    missing = [n for n in ("hidden_states", "dt", "A", "B", "C") if not values.get(n)]
    if problems or missing:
        facts.problems.append(
            f"{facts.name}.forward calls the selective scan with arguments the rewrite cannot "
            f"read ({', '.join(problems) or 'no ' + '/'.join(missing)})"
        )
        return
    facts.operands = values
    kept = [s for i, s in enumerate(body.body) if i > facts.scan_index and i != facts.write_index]
    outputs = sorted(_assigned_names([stmt]) & _used_names(kept))
    if len(outputs) != 1:
        facts.problems.append(
            f"{facts.name}.forward's scan statement binds {outputs or 'no name'} for the rest "
            "of the forward; the rewrite needs exactly one (the scan's output)"
        )
        return
    facts.output = outputs[0]
    replaced_at = {facts.read_index, facts.conv_index, facts.scan_index, facts.write_index}
    replaced = [s for i, s in enumerate(body.body) if i in replaced_at]
    others = [s for i, s in enumerate(body.body) if i not in replaced_at]
    emitted = EMITTED_LOCALS | (HEAD_LOCALS if facts.loop_var else frozenset())
    clash = emitted & (_used_names(others) | _assigned_names(others))
    if clash:
        facts.problems.append(
            f"{facts.name}.forward uses {sorted(clash)}, names the rewrite binds for the "
            "paged state"
        )
    leaked = (_assigned_names(replaced) - {facts.conv_target, facts.output}) & _used_names(others)
    if leaked:
        facts.problems.append(
            f"{facts.name}.forward uses {sorted(leaked)} outside the cache statements the "
            "rewrite replaces"
        )


def _operand(values: dict[str, str], name: str) -> str:
    value = values.get(name)
    return "None" if value is None else value


def _scan_values(facts: Mamba1Facts) -> dict:
    values = facts.operands
    z = values.get("z")
    return {
        "output": facts.output,
        "u": values["hidden_states"],
        "delta": values["dt"],
        "A": values["A"],
        "B": values["B"],
        "C": values["C"],
        "D": _operand(values, "D"),
        "z": None if z in (None, "None") else z,
        "delta_bias": _operand(values, "delta_bias"),
        "softplus": values.get("delta_softplus", "False"),
        "loop_var": facts.loop_var,
        "heads": facts.heads,
    }


def _state_entries(facts: Mamba1Facts) -> list[StateEntry]:
    shapes = facts.shapes
    return [
        StateEntry(
            name="conv_state",
            shape=(f"{shapes['kernel_expr']} - 1", shapes["dim_expr"]),
            comment="token-major, as the analyzer reports it; the conv operators read its "
            "transpose",
        ),
        StateEntry(
            name="ssm_state",
            shape=(shapes["dim_expr"], shapes["dstate_expr"]),
            comment="[channels, state size]: selective_scan_fn's state row",
        ),
    ]


class Mamba1MixerCommand(StateMixerCommand):
    """Declare the conv and SSM state entries and run the conv and the scan on paged states."""

    DESCRIPTION = "Keep Mamba-1 mixer states in the paged runtime's Mamba group."
    KIND = "Mamba-1 mixer"
    is_kind = staticmethod(is_mamba1_class)
    gather = staticmethod(mamba1_facts)

    def convert(
        self, updated: cst.ClassDef, facts: Mamba1Facts, config: cst.PartialParserConfig
    ) -> cst.ClassDef:
        # the SSM state in the dtype the Plan reports for it (mamba_ssm_cache_dtype)
        pinned = getattr(self.spec, "pinned_state_dtypes", {})
        return declare_states(
            updated,
            self.KIND,
            with_pinned_dtypes(_state_entries(facts), pinned),
            config,
            lambda forward: self._convert_forward(forward, facts, config),
        )

    def _convert_forward(
        self, forward: cst.FunctionDef, facts: Mamba1Facts, config: cst.PartialParserConfig
    ) -> cst.FunctionDef:
        conv = {
            "hidden": facts.hidden,
            "target": facts.conv_target,
            "source": facts.conv_source,
            "weight": facts.conv_weight,
            "bias": facts.conv_bias,
            "activation": facts.activation,
        }
        replacements = {
            facts.read_index: statements("framework_gdn_state.py.j2", config, **conv),
            facts.conv_index: statements("framework_gdn_conv.py.j2", config, **conv),
            facts.scan_index: statements(
                "framework_mamba1_scan.py.j2", config, **_scan_values(facts)
            ),
        }
        return splice_forward(forward, replacements, drop=facts.write_index)


__all__ = [
    "Mamba1Facts",
    "Mamba1MixerCommand",
    "is_mamba1_class",
    "mamba1_facts",
]
