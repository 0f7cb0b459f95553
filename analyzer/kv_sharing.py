"""Cross-layer KV sharing: which layers project keys and values and which reuse another's.

The shape (Hunyuan-Large's ``use_cla``): the attention forward takes the keys and values of
an earlier layer through a parameter and uses them instead of its own projections::

    if self.attention_type == "cross" and kv_states is not None:   # line cited
        key_states, value_states = kv_states
    else:
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

with ``self.attention_type = "cross" if config.use_cla and layer_idx % config.cla_share_factor
!= 0 else "self"`` in ``__init__``. The conjuncts of the test that read only ``self`` (here
``self.attention_type == "cross"``) say, per layer and before any call, whether the layer
reuses; evaluated for each ``layer_idx`` over the config they give the consumers, and each
consumer reads the last producing layer before it (the order the model's layer loop hands
them down in).

One cache can serve a producer and its consumers only when the consumer caches what the
producer cached. A layer module applied to the reused keys or values before the cache write
(Hunyuan-Large's per-layer ``key_layernorm`` under ``use_qk_norm``) makes each layer's keys
its own: the layers then keep their own caches, and ``reason`` says why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.evidence import Notebook
from kvskill.analyzer.gather import dotted_name, resolve_method
from kvskill.analyzer.kv_sizing import ConfigView, _Evaluator, _scope
from kvskill.analyzer.plan import LayerPlan
from libcst.metadata import MetadataWrapper, PositionProvider

#: a module the reused keys may pass through and still be cached the same in every layer:
#: the rotary embedding is built from the config alone
_SAME_IN_EVERY_LAYER = ("rotary", "rope")


@dataclass(frozen=True, kw_only=True)
class KvSharing:
    """How the attention class OWNER shares keys and values across layers."""

    owner: str
    #: the forward parameter that carries another layer's keys and values
    param: str
    #: a test valid at the end of ``__init__`` that is true in a layer that reuses
    reads_shared_when: str
    #: line of the ``if`` that picks the reused keys and values
    line: int
    #: consumer layer -> the producing layer whose cache it reads
    layer_sources: dict[int, int] = field(default_factory=dict)
    #: why the layers keep one cache each after all (None: the cache is shared)
    reason: str | None = None
    #: line the reason points at (the per-layer module call), else the ``if``'s
    reason_line: int | None = None

    @property
    def is_shared(self) -> bool:
        return self.reason is None and bool(self.layer_sources)


class _ConditionEvaluator(_Evaluator):
    """kv_sizing's evaluator plus the tests a layer-kind choice is written with: ``%``,
    comparisons, ``and`` / ``not``, string and bool literals and ``a if c else b``."""

    def _value(self, node: cst.BaseExpression) -> Any:
        if isinstance(node, cst.SimpleString):
            return node.evaluated_value
        if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
            return {"True": True, "False": False, "None": None}[node.value]
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Modulo):
            left, right = self.value(node.left), self.value(node.right)
            ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))
            return left % right if ints and right else None
        if isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.And):
            left = self.value(node.left)
            return left if not left else self.value(node.right)
        if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not):
            inner = self.value(node.expression)
            return None if inner is None else not inner
        if isinstance(node, cst.IfExp):
            test = self.value(node.test)
            if test is None:
                return None
            return self.value(node.body if test else node.orelse)
        if isinstance(node, cst.Comparison) and len(node.comparisons) == 1:
            return _compare(node, self.value(node.left), self.value(node.comparisons[0].comparator))
        return super()._value(node)


def _compare(node: cst.Comparison, left: Any, right: Any) -> Any:
    if left is None or right is None:
        return None
    operator = node.comparisons[0].operator
    if isinstance(operator, cst.Equal):
        return left == right
    if isinstance(operator, cst.NotEqual):
        return left != right
    return None


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def _conjuncts(test: cst.BaseExpression) -> list[cst.BaseExpression]:
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _conjuncts(test.left) + _conjuncts(test.right)
    return [test]


def _names_read(node: cst.CSTNode) -> set[str]:
    """Plain names NODE reads (``self`` of ``self.x``, not the attribute name ``x``)."""
    attrs = {id(a.attr) for a in m.findall(node, m.Attribute()) if isinstance(a, cst.Attribute)}
    return {
        n.value for n in m.findall(node, m.Name()) if isinstance(n, cst.Name) and id(n) not in attrs
    }


def _reuse_branch(forward: cst.FunctionDef) -> tuple[cst.If, str, str, str] | None:
    """The top-level ``if`` of FORWARD whose body unpacks a forward parameter into the keys
    and values (``key, value = <param>``): (the if, param, key name, value name)."""
    params = {p.name.value for p in forward.params.params[1:]}
    for stmt in cst.ensure_type(forward.body, cst.IndentedBlock).body:
        if not isinstance(stmt, cst.If) or stmt.orelse is None:
            continue
        for line in stmt.body.body:
            unpack = m.SimpleStatementLine(
                body=[
                    m.Assign(
                        targets=[
                            m.AssignTarget(
                                target=m.Tuple(elements=[m.Element(m.Name()), m.Element(m.Name())])
                            )
                        ],
                        value=m.Name(),
                    )
                ]
            )
            if not m.matches(line, unpack):
                continue
            assign = cst.ensure_type(line.body[0], cst.Assign)
            param = cst.ensure_type(assign.value, cst.Name).value
            if param not in params:
                continue
            names = cst.ensure_type(assign.targets[0].target, cst.Tuple).elements
            key, value = (cst.ensure_type(e.value, cst.Name).value for e in names)
            return stmt, param, key, value
    return None


def _layer_module_call(
    forward: cst.FunctionDef, after: cst.If, names: set[str], evaluator: _Evaluator
) -> cst.Call | None:
    """The first call of a layer module (``self.<attr>(...)``, not the rotary embedding)
    that reassigns one of NAMES after the branch AFTER, skipping ``if`` blocks whose test the
    config makes false; None when there is none."""
    body = cst.ensure_type(forward.body, cst.IndentedBlock).body
    for stmt in body[body.index(after) + 1 :]:
        if isinstance(stmt, cst.If) and evaluator.value(stmt.test) is False:
            continue
        for assign in m.findall(stmt, m.Assign()):
            assign = cst.ensure_type(assign, cst.Assign)
            targets = set().union(*(_names_read(t.target) for t in assign.targets))
            if not targets & names:
                continue
            for call in m.findall(assign.value, m.Call(func=m.Attribute(value=m.Name("self")))):
                attr = dotted_name(cst.ensure_type(call, cst.Call).func).split(".")[-1]
                if not any(word in attr.lower() for word in _SAME_IN_EVERY_LAYER):
                    return cst.ensure_type(call, cst.Call)
    return None


def kv_sharing(
    module: cst.Module,
    attention: str,
    config: Mapping[str, Any],
    num_layers: int,
    view: ConfigView | None = None,
) -> KvSharing | None:
    """The cross-layer KV sharing of the attention class ATTENTION in MODULE over NUM_LAYERS
    layers of CONFIG (read through VIEW when given), None when the forward reuses no other
    layer's keys and values."""
    wrapper = MetadataWrapper(module)
    positions = wrapper.resolve(PositionProvider)
    classes = {c.name.value: c for c in wrapper.module.body if isinstance(c, cst.ClassDef)}
    cls = classes.get(attention)
    forward = resolve_method(cls, "forward", classes) if cls is not None else None
    if forward is None:
        return None
    found = _reuse_branch(forward)
    if found is None:
        return None
    branch, param, key, value = found
    line = positions[branch].start.line
    layer_tests = [c for c in _conjuncts(branch.test) if _names_read(c) <= {"self"}]
    base = {"owner": attention, "param": param, "line": line}
    if not layer_tests:
        return KvSharing(
            **base,
            reads_shared_when="",
            reason=f"`{_code(branch.test)}` does not say which layers reuse before the call",
        )
    test = cst.parse_expression(" and ".join(f"({_code(t)})" for t in layer_tests))
    when = " and ".join(_code(t) for t in layer_tests)
    scope, init = _scope(cls, classes)
    index_param = next(
        (p.name.value for p in (init.params.params[1:] if init else []) if "layer" in p.name.value),
        None,
    )
    view = view or ConfigView(config)
    sources: dict[int, int] = {}
    producer: int | None = None
    for index in range(num_layers):
        if index_param:
            scope.locals[index_param] = cst.Integer(str(index))
        reuses = _ConditionEvaluator(scope, view).value(test)
        if reuses is None:
            return KvSharing(
                **base,
                reads_shared_when=when,
                reason=f"`{when}` cannot be evaluated from the config for layer {index}",
            )
        if not reuses:
            producer = index
        elif producer is None:
            return KvSharing(
                **base,
                reads_shared_when=when,
                reason=f"layer {index} reuses keys and values before any layer projects them",
            )
        else:
            sources[index] = producer
    call = _layer_module_call(forward, branch, {key, value}, _ConditionEvaluator(scope, view))
    if call is not None and sources:
        return KvSharing(
            **base,
            reads_shared_when=when,
            layer_sources=sources,
            reason=(
                f"each layer passes the reused keys or values through its own "
                f"`{dotted_name(call.func)}` before caching them, so a consumer's cache is "
                "not its producer's"
            ),
            reason_line=positions[call].start.line,
        )
    return KvSharing(**base, reads_shared_when=when, layer_sources=sources)


def sharing_of_source(
    modeling_file: str, attention: str, view: ConfigView, num_layers: int
) -> KvSharing | None:
    """:func:`kv_sharing` of the class ATTENTION in MODELING_FILE."""
    module = cst.parse_module(Path(modeling_file).read_text(encoding="utf-8"))
    return kv_sharing(module, attention, view.config, num_layers, view)


def share_layers(
    layers: list[LayerPlan], sharing: KvSharing | None, where: Callable[[int], str], book: Notebook
) -> list[LayerPlan]:
    """LAYERS with each consumer's ``kv_source`` set when SHARING shares the cache, and the
    evidence either way (WHERE turns a line into a citation)."""
    if sharing is None or not sharing.layer_sources:
        return layers
    pairs = ", ".join(f"{c}<-{p}" for c, p in sharing.layer_sources.items())
    if not sharing.is_shared:
        book.cite(
            "kv_sharing",
            f"layers {pairs} reuse keys and values across layers, but {sharing.reason}: "
            "every layer keeps its own cache",
            where(sharing.reason_line or sharing.line),
        )
        return layers
    book.cite(
        "kv_sharing",
        f"{sharing.owner}.forward takes another layer's keys and values (`{sharing.param}`) "
        f"where `{sharing.reads_shared_when}`: layers {pairs} (consumer<-producer) read their "
        "producer's cache; the cache and its bytes are counted once per producer",
        where(sharing.line),
    )
    return [replace(layer, kv_source=sharing.layer_sources.get(layer.index)) for layer in layers]


def sharing_record(sharing: KvSharing | None) -> dict[str, Any] | None:
    """The Plan's ``code.kv_sharing``: what the implementer needs to declare the shared
    caches (None when no layer reuses another's keys and values)."""
    if sharing is None or not sharing.layer_sources:
        return None
    return {
        "class": sharing.owner,
        "line": sharing.line,
        "param": sharing.param,
        "reads_shared_when": sharing.reads_shared_when,
        "layer_sources": {str(c): p for c, p in sharing.layer_sources.items()},
        "shared": sharing.is_shared,
        "reason": sharing.reason,
    }
