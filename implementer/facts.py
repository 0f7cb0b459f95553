"""Structural facts about a modeling file, gathered before any rewrite.

Which classes are attention classes, and what a cache write or a kernel call looks like, is
decided in ``kvskill.analyzer.gather`` (the vocabulary the analyzer and lint use too): a class
whose ``forward`` writes new keys and values into a cache (``<cache>.update(key, value,
self.layer_idx, ...)``) and then calls an attention kernel, through an attention interface
(``fn(self, q, k, v, mask, ...)``) or ``scaled_dot_product_attention(q, k, v, ...)``. The
statements from the cache write to the kernel call are the *seam* the forward codemod
replaces; this module gathers its facts. A forward that already carries an NPU branch
(``if <flag>: <fused attention> else: <cache write + kernel>``) is read with that ``if``
replaced by its kernel branch (``npu_branch.py``), so the seam covers every path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import (
    CACHE_ENTRIES_ASSIGN,
    CACHE_UPDATE_CALL,
    FA_CALL,
    INTERFACE_CALL,
    LM_HEAD_ASSIGN,
    SDPA_CALL,
    STATE_ENTRIES_ASSIGN,
    class_assigns,
    declares_token_caches,
    is_attention_class,
    is_causal_lm_class,
    is_converted_attention,
)
from kvskill.analyzer.gather import method as _method
from kvskill.implementer.npu_branch import inline_npu_branches, npu_note

_EMPTY = cst.Module(body=[])


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


def attention_facts(cls: cst.ClassDef) -> AttentionFacts:
    """Gather what the attention codemods need; ``problems`` lists what blocks a rewrite."""
    facts = AttentionFacts(name=cls.name.value, converted=is_converted_attention(cls))
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
    elif not facts.converted:
        # NOTE: a class whose __init__ is already rewritten (the forward rewrite runs next)
        # declares caches its forward does not write yet; the checks refuse that in a source
        # (partial_conversion), the seam is gathered all the same.
        inlined = inline_npu_branches(f"{facts.name}.forward", forward)
        facts.problems.extend(inlined.problems)
        if not inlined.problems:
            facts.seam = _seam_facts(facts, inlined.forward)
    return facts


def partial_conversion(cls: cst.ClassDef) -> str | None:
    """Why CLS is half converted (caches declared, forward not writing and reading them),
    else None. A source in that state is refused: rewriting its forward would pair it with
    caches declared by someone else's code."""
    if declares_token_caches(cls) and not is_converted_attention(cls):
        return (
            f"{cls.name.value} declares cache_entries but its forward does not both write them "
            "with a cache-write operator and read them with the fused attention (a partial "
            "conversion); convert the original modeling file instead"
        )
    return None


def seam_forward(
    cls: cst.ClassDef, forward: cst.FunctionDef
) -> tuple[cst.FunctionDef, list[cst.EmptyLine]]:
    """FORWARD as the seam's indices address it: with its NPU branches (if any) replaced by
    their kernel branches; and the comment lines that tell the reader so, to lead the seam.
    The forward rewrites splice the seam into this forward."""
    inlined = inline_npu_branches(f"{cls.name.value}.forward", forward)
    return inlined.forward, npu_note(inlined.conditions)


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


__all__ = [
    "CACHE_ENTRIES_ASSIGN",
    "CACHE_UPDATE_CALL",
    "FA_CALL",
    "INTERFACE_CALL",
    "LM_HEAD_ASSIGN",
    "SDPA_CALL",
    "STATE_ENTRIES_ASSIGN",
    "AttentionFacts",
    "KernelStyle",
    "SeamFacts",
    "attention_facts",
    "class_assigns",
    "code",
    "is_attention_class",
    "is_causal_lm_class",
    "is_converted_attention",
    "partial_conversion",
    "seam_forward",
]
