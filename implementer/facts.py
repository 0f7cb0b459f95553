"""Structural facts about a modeling file, gathered before any rewrite.

An attention class is recognised by what its ``forward`` does, never by its name: it writes
new keys and values into a cache (``<cache>.update(key, value, self.layer_idx, ...)``, the
transformers-5 ``cache`` and the transformers-4 ``past_key_value`` alike) and then calls an
attention kernel, either through an attention interface (``fn(self, q, k, v, mask, ...)``)
or ``scaled_dot_product_attention(q, k, v, ...)``. The statements from the cache write to the
kernel call are the *seam* the forward codemod replaces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import libcst as cst
import libcst.matchers as m

_EMPTY = cst.Module(body=[])

#: ``self.<anything>.update(...)`` or ``<name>.update(...)`` with key and value first
CACHE_UPDATE_CALL = m.Call(
    func=m.Attribute(attr=m.Name("update")), args=[m.Arg(), m.Arg(), m.Arg(), m.ZeroOrMore()]
)
#: ``fn(self, query, key, value, mask, ...)``: the transformers attention-interface convention
INTERFACE_CALL = m.Call(
    func=m.Name(),
    args=[m.Arg(value=m.Name("self"), keyword=None), m.Arg(), m.Arg(), m.Arg(), m.ZeroOrMore()],
)
#: ``torch.nn.functional.scaled_dot_product_attention`` under any import spelling
SDPA_CALL = m.Call(
    func=m.Name("scaled_dot_product_attention")
    | m.Attribute(attr=m.Name("scaled_dot_product_attention"))
)
#: ``self.cache_entries = ...``: the class already declares its paged caches
CACHE_ENTRIES_ASSIGN = m.Assign(
    targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("cache_entries")))]
)
#: ``self.cache_entries = [MambaCacheEntry(...), ...]``: a converted recurrent-state layer
STATE_ENTRIES_ASSIGN = m.Assign(
    targets=[
        m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("cache_entries")))
    ],
    value=m.List(
        elements=[m.Element(value=m.Call(func=m.Name("MambaCacheEntry"))), m.ZeroOrMore()]
    ),
)
#: a call of either fused-attention operator: the forward is already converted
FA_CALL = m.Call(
    func=m.Attribute(
        attr=m.Name("npu_fused_infer_attention_score")
        | m.Name("npu_fused_infer_attention_score_v2")
    )
)
#: ``self.lm_head = ...``: the language-model head, held by the *ForCausalLM class
LM_HEAD_ASSIGN = m.Assign(
    targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("lm_head")))]
)


class KernelStyle(str, Enum):
    """How the source calls attention; decides the layout the seam hands back."""

    #: ``fn(self, q, k, v, mask, ...)`` returning ``[B, S, N, D]``
    INTERFACE = "interface"
    #: ``scaled_dot_product_attention(q, k, v, ...)`` returning ``[B, N, S, D]``
    SDPA = "sdpa"


def code(node: cst.CSTNode) -> str:
    """Source text of a node (without its surrounding whitespace owners)."""
    return _EMPTY.code_for_node(node).strip()


@dataclass(frozen=True, kw_only=True)
class SeamFacts:
    """The attention forward's cache write and kernel call (indices into the forward body)."""

    update_index: int
    kernel_index: int
    style: KernelStyle
    query: str
    key: str
    value: str
    #: the softmax scale expression the source passes to the kernel, if any
    scale: str | None
    #: learnable sinks passed to the kernel (``s_aux=`` / ``sinks=``), if any
    sinks: str | None
    #: assignment targets of the kernel call, e.g. ["attn_output", "attn_weights"]
    targets: list[str]


@dataclass(kw_only=True)
class AttentionFacts:
    """One attention class."""

    name: str
    converted: bool
    config_param: str | None = None
    layer_idx_param: str | None = None
    seam: SeamFacts | None = None
    problems: list[str] = field(default_factory=list)


def _params(func: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in func.params.params]


def _method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
            return stmt
    return None


def class_assigns(cls: cst.ClassDef, matcher: m.BaseMatcherNode) -> bool:
    """True when ``__init__`` of ``cls`` contains an assignment matching ``matcher``."""
    init = _method(cls, "__init__")
    return init is not None and bool(m.findall(init, matcher))


def is_attention_class(cls: cst.ClassDef) -> bool:
    """A class whose forward writes a KV cache and calls an attention kernel, or one already
    converted (it declares ``cache_entries`` of per-token caches, not recurrent states)."""
    if class_assigns(cls, CACHE_ENTRIES_ASSIGN):
        return not class_assigns(cls, STATE_ENTRIES_ASSIGN)
    forward = _method(cls, "forward")
    if forward is None:
        return False
    has_update = bool(m.findall(forward, CACHE_UPDATE_CALL))
    has_kernel = bool(m.findall(forward, INTERFACE_CALL | SDPA_CALL))
    return has_update and has_kernel


def is_causal_lm_class(cls: cst.ClassDef) -> bool:
    """The class holding the language-model head (the ``*ForCausalLM``)."""
    return class_assigns(cls, LM_HEAD_ASSIGN)


def attention_facts(cls: cst.ClassDef) -> AttentionFacts:
    """Gather what the attention codemods need; ``problems`` lists what blocks a rewrite."""
    facts = AttentionFacts(name=cls.name.value, converted=class_assigns(cls, CACHE_ENTRIES_ASSIGN))
    init = _method(cls, "__init__")
    if init is None:
        facts.problems.append(f"{facts.name} has no __init__")
        return facts
    params = _params(init)[1:]
    facts.config_param = "config" if "config" in params else (params[0] if params else None)
    facts.layer_idx_param = next((p for p in params if "layer_idx" in p), None)
    if facts.config_param is None:
        facts.problems.append(f"{facts.name}.__init__ takes no config")
    forward = _method(cls, "forward")
    if forward is None:
        facts.problems.append(f"{facts.name} has no forward")
    elif not m.findall(forward, FA_CALL):
        facts.seam = _seam_facts(facts, forward)
    return facts


def _top_index(body: cst.IndentedBlock, matcher: m.BaseMatcherNode) -> int | None:
    for index, stmt in enumerate(body.body):
        if m.findall(stmt, matcher):
            return index
    return None


def _seam_facts(facts: AttentionFacts, forward: cst.FunctionDef) -> SeamFacts | None:
    body = cst.ensure_type(forward.body, cst.IndentedBlock)
    update_index = _top_index(body, CACHE_UPDATE_CALL)
    kernel_index = _top_index(body, INTERFACE_CALL | SDPA_CALL)
    if update_index is None or kernel_index is None or kernel_index < update_index:
        facts.problems.append(
            f"{facts.name}.forward does not write the cache before calling attention"
        )
        return None
    update = m.findall(body.body[update_index], CACHE_UPDATE_CALL)[0]
    assert isinstance(update, cst.Call)
    stmt = body.body[kernel_index]
    assign = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) else None
    if not isinstance(assign, (cst.Assign, cst.AnnAssign)) or not isinstance(
        assign.value, cst.Call
    ):
        facts.problems.append(
            f"{facts.name}.forward calls attention in a statement that is not a plain "
            "assignment of its result"
        )
        return None
    call = assign.value
    style = KernelStyle.SDPA if m.matches(call, SDPA_CALL) else KernelStyle.INTERFACE
    positional = [a.value for a in call.args if a.keyword is None and a.star == ""]
    offset = 1 if style is KernelStyle.INTERFACE else 0
    keywords = {a.keyword.value: code(a.value) for a in call.args if a.keyword is not None}
    if len(positional) < offset + 3:
        facts.problems.append(f"{facts.name}.forward passes query/key/value by keyword")
        return None
    targets = _targets(assign)
    if not targets:
        facts.problems.append(f"{facts.name}.forward assigns attention output to a non-name")
        return None
    seam = SeamFacts(
        update_index=update_index,
        kernel_index=kernel_index,
        style=style,
        query=code(positional[offset]),
        key=code(update.args[0].value),
        value=code(update.args[1].value),
        scale=keywords.get("scaling") or keywords.get("scale"),
        sinks=keywords.get("s_aux") or keywords.get("sinks"),
        targets=targets,
    )
    _check_seam_names(facts, body, seam)
    return seam


def _targets(assign: cst.Assign | cst.AnnAssign) -> list[str]:
    target = assign.target if isinstance(assign, cst.AnnAssign) else assign.targets[0].target
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, cst.Tuple) and all(
        isinstance(e.value, cst.Name) for e in target.elements
    ):
        return [cst.ensure_type(e.value, cst.Name).value for e in target.elements]
    return []


def _assigned_names(stmts: list[cst.BaseStatement]) -> set[str]:
    names: set[str] = set()
    for stmt in stmts:
        for target in m.findall(stmt, m.AssignTarget() | m.AnnAssign()):
            node = target.target
            for name in m.findall(node, m.Name()):
                names.add(cst.ensure_type(name, cst.Name).value)
    return names


def _used_names(stmts: list[cst.BaseStatement]) -> set[str]:
    return {cst.ensure_type(n, cst.Name).value for s in stmts for n in m.findall(s, m.Name())}


def _check_seam_names(facts: AttentionFacts, body: cst.IndentedBlock, seam: SeamFacts) -> None:
    """The seam is replaced wholesale: nothing it defines may be read after it, except the
    kernel's outputs (which the replacement defines again)."""
    inside = list(body.body[seam.update_index : seam.kernel_index])
    after = list(body.body[seam.kernel_index + 1 :])
    leaked = (_assigned_names(inside) - set(seam.targets)) & _used_names(after)
    leaked -= {seam.key, seam.value, seam.query}
    tiled = m.Call(
        func=m.Attribute(value=m.Name(seam.key) | m.Name(seam.value), attr=m.Name("repeat"))
    )
    if any(m.findall(stmt, tiled) for stmt in inside):
        facts.problems.append(
            f"{facts.name}.forward tiles its KV heads with .repeat before attention (query head "
            "h reads KV head h % KVN); the fused operator pairs query head h with KV head h // G"
        )
    if leaked:
        facts.problems.append(
            f"{facts.name}.forward uses {sorted(leaked)} after attention, but they are defined "
            "between the cache write and the attention call, which the rewrite replaces"
        )
