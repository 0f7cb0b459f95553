"""How an attention's code cuts its fused query/key/value projection apart, read from the cuts.

The rows of one fused Linear are ordered in one of three ways, and only the code that splits
its output says which (the Linear's shape is the same for all three)::

    contiguous    [q0 q1 q2 q3 | k0 k1 | v0 v1]         GPT-2 c_attn, ChatGLM2 query_key_value
    per_head      [q0 k0 v0 | q1 k1 v1 | ...]           GPT-NeoX, Bloom (one KV head per query)
    per_kv_group  [q0 q1 k0 v0 | q2 q3 k1 v1]           InternLM2 wqkv, Falcon-40B (G=2 here)

The first cut of the projection's output decides: a ``split`` / ``chunk`` of the flat rows
is ``contiguous``; a reshape whose extents hold ``G + 2`` (or a KV-group count then ``-1``)
is ``per_kv_group``; a reshape with a ``3`` after the heads is ``per_head``, before them
``contiguous``. Cuts are followed into helper methods the forward hands the output to
(Falcon's ``_split_heads``) and through local shape tuples (GPT-NeoX's ``new_qkv_shape``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, PositionProvider


class QkvLayout(str, Enum):
    CONTIGUOUS = "contiguous"
    PER_HEAD = "per_head"
    PER_KV_GROUP = "per_kv_group"
    UNKNOWN = "unknown"


#: what each layout means for the rows, in the Plan's evidence
LAYOUT_WORDS = {
    QkvLayout.CONTIGUOUS: "all query heads, then all key heads, then all value heads",
    QkvLayout.PER_HEAD: "per head its query, key and value rows side by side",
    QkvLayout.PER_KV_GROUP: "per KV group its query heads, then one key and one value head",
    QkvLayout.UNKNOWN: "an order the code's cuts do not show",
}


@dataclass(frozen=True, kw_only=True)
class QkvSplit:
    """The layout and the line of the cut it was read from (None when unknown)."""

    layout: QkvLayout
    line: int | None
    #: the cut as written, on one line (``qkv.view(b, s, -1, G + 2, d)``)
    cut: str = ""


_RESHAPES = {"view", "reshape", "unflatten"}
_SPLITS = {"split", "chunk", "tensor_split", "unbind", "split_with_sizes"}
#: a KV-head / group count as vendors name it (not the query heads)
_KV_COUNT = re.compile(
    r"kv_heads|key_value_heads|num_kv|query_groups|kv_groups|group_num|num_groups"
)
#: every query head (or the hidden width they make up), not one head's width
_ALL_HEADS = re.compile(
    r"num_heads|num_attention_heads|n_head\b|n_heads|heads_per_partition|hidden_size|"
    r"split_size|embed_dim|projection_size"
)


def classify_qkv_split(source: str, class_name: str, attr: str) -> QkvSplit:
    """The layout of ``self.<attr>``'s output as CLASS_NAME (or a base class in the same
    file that holds the forward) cuts it."""
    wrapper = MetadataWrapper(cst.parse_module(source))
    positions = wrapper.resolve(PositionProvider)
    module = wrapper.module
    classes = {c.name.value: c for c in module.body if isinstance(c, cst.ClassDef)}
    for cls in _with_bases(classes, class_name):
        methods = {f.name.value: f for f in cls.body.body if isinstance(f, cst.FunctionDef)}
        if "forward" not in methods:
            continue
        finder = _CutFinder(module, methods, attr)
        found = finder.first_cut(methods["forward"], seeds=set())
        if found is not None:
            layout, node = found
            line = positions[node].start.line
            if isinstance(node, cst.If):  # branches that cut differently
                text = f"if {_one_line(module.code_for_node(node.test))}: ... else: ..."
            else:
                text = _one_line(module.code_for_node(node))
            return QkvSplit(layout=layout, line=line, cut=text)
        break
    return QkvSplit(layout=QkvLayout.UNKNOWN, line=None)


def _with_bases(classes: dict[str, cst.ClassDef], name: str) -> list[cst.ClassDef]:
    """NAME and its bases defined in the file, nearest first (a family's forward may live in
    the base)."""
    chain: list[cst.ClassDef] = []
    while name in classes and classes[name] not in chain:
        cls = classes[name]
        chain.append(cls)
        bases = [b.value for b in cls.bases if isinstance(b.value, cst.Name)]
        name = next((b.value for b in bases if b.value in classes), "")
    return chain


class _CutFinder:
    """Walks a method in source order, tracking the names that hold the projection's output."""

    def __init__(self, module: cst.Module, methods: dict[str, cst.FunctionDef], attr: str):
        self.module = module
        self.methods = methods
        self.projection = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(attr)))
        self.visited: set[str] = set()

    def first_cut(self, method: cst.FunctionDef, seeds: set[str]):
        self.visited.add(method.name.value)
        return self._walk(method.body, set(seeds), {})

    def _walk(self, suite: cst.BaseSuite, derived: set[str], shapes: dict):
        for statement in getattr(suite, "body", ()):
            if isinstance(statement, cst.If):
                found = self._branches(statement, derived, shapes)
            elif isinstance(statement, (cst.With, cst.For, cst.While, cst.Try)):
                found = self._walk(statement.body, derived, shapes)
            elif isinstance(statement, cst.SimpleStatementLine):
                found = self._line(statement, derived, shapes)
            else:
                found = None
            if found is not None:
                return found
        return None

    def _branches(self, node: cst.If, derived: set[str], shapes: dict):
        """Each branch walked on its own. Branches that cut differently (Falcon's layout
        switched by the config) leave the layout unknown: no single cut is the fact."""
        suites: list[cst.BaseSuite] = []
        branch: cst.If | cst.Else | None = node
        while branch is not None:
            suites.append(branch.body)
            branch = getattr(branch, "orelse", None)
        found, seen = [], set(derived)
        for suite in suites:
            mine = set(derived)
            cut = self._walk(suite, mine, dict(shapes))
            if cut is not None:
                found.append(cut)
            seen |= mine
        derived |= seen
        if not found:
            return None
        if len({layout for layout, _ in found}) == 1:
            return found[0]
        return QkvLayout.UNKNOWN, node

    def _line(self, statement: cst.SimpleStatementLine, derived: set[str], shapes: dict):
        for call in _calls_in_order(statement):
            found = self._decide(call, derived, shapes)
            if found is not None:
                return found
        for small in statement.body:
            if isinstance(small, (cst.Assign, cst.AnnAssign)):
                self._track(small, derived, shapes)
        return None

    def _track(self, assign: cst.Assign | cst.AnnAssign, derived: set[str], shapes: dict) -> None:
        targets = assign.targets if isinstance(assign, cst.Assign) else [assign]
        names = [n.value for t in targets for n in m.findall(t.target, m.Name())]
        if assign.value is None:
            return
        if self._carries(assign.value, derived):
            derived.update(names)
        elif len(names) == 1:
            shapes[names[0]] = assign.value  # a shape tuple a later view may read

    def _carries(self, node: cst.CSTNode, derived: set[str]) -> bool:
        """NODE holds the projection's values (not only its ``.shape`` / ``.size()``)."""
        if m.findall(node, self.projection):
            return True
        text = self.module.code_for_node(node)
        return any(
            re.search(rf"\b{re.escape(name)}\b(?!\s*\.\s*(shape|size\(|dim\())", text)
            for name in derived
        )

    def _decide(self, call: cst.Call | cst.Subscript, derived: set[str], shapes: dict):
        if isinstance(call, cst.Subscript):
            # Phi-3's qkv[..., :q_rows]: a slice of the rows before any reshape showed heads
            sliced = any(isinstance(e.slice, cst.Slice) for e in call.slice)
            if sliced and self._carries(call.value, derived):
                return QkvLayout.CONTIGUOUS, call
            return None
        func = call.func
        name = func.attr.value if isinstance(func, cst.Attribute) else ""
        if isinstance(func, cst.Name):
            name = func.value
        if name == "rearrange" and call.args and self._carries(call.args[0].value, derived):
            layout = _rearranged(call)
            return (layout, call) if layout is not None else None
        receiver = _receiver(call)
        if receiver is None or not self._carries(receiver, derived):
            return self._into_helper(call, derived)
        if name in _SPLITS:
            # the flat rows cut straight into pieces: whole blocks of q, k, v
            return QkvLayout.CONTIGUOUS, call
        if name in _RESHAPES:
            layout = _reshaped(self._extents(call, shapes))
            return (layout, call) if layout is not None else None
        return None

    def _into_helper(self, call: cst.Call, derived: set[str]):
        """``self._split_heads(fused_qkv)``: follow the output into the helper's parameter."""
        func = call.func
        if not (isinstance(func, cst.Attribute) and m.matches(func.value, m.Name("self"))):
            return None
        helper = self.methods.get(func.attr.value)
        if helper is None or helper.name.value in self.visited:
            return None
        params = [p.name.value for p in helper.params.params if p.name.value != "self"]
        seeds = {
            params[i]
            for i, arg in enumerate(call.args)
            if i < len(params) and arg.keyword is None and self._carries(arg.value, derived)
        }
        return self.first_cut(helper, seeds) if seeds else None

    def _extents(self, call: cst.Call, shapes: dict) -> list[cst.BaseExpression]:
        """The extents a reshape names, with local shape tuples and ``size()[:-1] + (...)``
        opened up."""
        args = [a for a in call.args if a.keyword is None]
        if m.matches(call.func, m.Attribute(attr=m.Name("unflatten"))):
            args = args[1:]  # unflatten(dim, sizes)
        out: list[cst.BaseExpression] = []
        for arg in args:
            out += _flatten(arg.value, shapes)
        return out


class _PostOrder(cst.CSTVisitor):
    def __init__(self) -> None:
        self.calls: list[cst.Call | cst.Subscript] = []

    def leave_Call(self, original_node: cst.Call) -> None:
        self.calls.append(original_node)

    def leave_Subscript(self, original_node: cst.Subscript) -> None:
        self.calls.append(original_node)


def _calls_in_order(node: cst.CSTNode) -> list[cst.Call | cst.Subscript]:
    """Calls and subscripts in evaluation order: a receiver's before the call on it."""
    visitor = _PostOrder()
    node.visit(visitor)
    return visitor.calls


def _receiver(call: cst.Call) -> cst.BaseExpression | None:
    func = call.func
    if isinstance(func, cst.Attribute):
        if m.matches(func.value, m.Name("torch")) and call.args:
            return call.args[0].value  # torch.split(x, ...)
        return func.value
    return None


def _flatten(node: cst.BaseExpression, shapes: dict) -> list[cst.BaseExpression]:
    if isinstance(node, cst.Name) and node.value in shapes:
        return _flatten(shapes[node.value], shapes)
    if isinstance(node, (cst.Tuple, cst.List)):
        out: list[cst.BaseExpression] = []
        for element in node.elements:
            out += _flatten(element.value, shapes)
        return out
    joins_tuples = isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Add)
    if joins_tuples and (
        isinstance(node.right, (cst.Tuple, cst.List)) or isinstance(node.left, cst.Tuple)
    ):
        return _flatten(node.left, shapes) + _flatten(node.right, shapes)
    return [node]


_PLUS_TWO = m.BinaryOperation(operator=m.Add()) & m.MatchIfTrue(
    lambda op: m.matches(op.left, m.Integer("2")) or m.matches(op.right, m.Integer("2"))
)
_THREE = (
    m.Integer("3")
    | m.BinaryOperation(operator=m.Multiply(), left=m.Integer("3"))
    | m.BinaryOperation(operator=m.Multiply(), right=m.Integer("3"))
)
_MINUS_ONE = m.UnaryOperation(operator=m.Minus(), expression=m.Integer("1"))


def _reshaped(extents: list[cst.BaseExpression]) -> QkvLayout | None:
    """The layout a reshape of the projection's output shows, or None when it shows none
    (a ``view(b, s, -1, d)`` that a later cut decides)."""
    code = [cst.Module([]).code_for_node(e) for e in extents]
    if any(m.findall(e, _PLUS_TWO) for e in extents):
        return QkvLayout.PER_KV_GROUP  # G query heads + 1 key + 1 value per group
    heads = next((i for i, c in enumerate(code) if _ALL_HEADS.search(c)), None)
    kv = next((i for i, c in enumerate(code) if _KV_COUNT.search(c)), None)
    unsized = next((i for i, e in enumerate(extents) if m.matches(e, _MINUS_ONE)), None)
    three = next((i for i, e in enumerate(extents) if m.matches(e, _THREE)), None)
    if kv is not None and unsized is not None and unsized > kv:
        return QkvLayout.PER_KV_GROUP  # per group, the rest (G + 2 heads) left to -1
    head_axis = heads if heads is not None else unsized
    if three is not None and head_axis is not None:
        return QkvLayout.PER_HEAD if three > head_axis else QkvLayout.CONTIGUOUS
    return None


def _rearranged(call: cst.Call) -> QkvLayout | None:
    """einops: ``"b q (h gs d) -> b q h gs d", gs=2 + groups`` is per KV group; a ``three``
    axis before the heads in the grouping is contiguous, after them per head."""
    pattern = call.args[1].value if len(call.args) > 1 else None
    if not isinstance(pattern, cst.SimpleString):
        return None
    sizes = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    if any(m.findall(v, _PLUS_TWO) for v in sizes.values()):
        return QkvLayout.PER_KV_GROUP
    group = re.search(r"\(([^)]*)\)", pattern.evaluated_value or "")
    if group is None:
        return None
    axes = group.group(1).split()
    threes = [
        i
        for i, a in enumerate(axes)
        if a in ("three", "qkv", "3") or sizes.get(a) and m.matches(sizes[a], m.Integer("3"))
    ]
    heads = [i for i, a in enumerate(axes) if a in ("h", "heads", "nh", "n")]
    if threes and heads:
        return QkvLayout.PER_HEAD if threes[0] > heads[0] else QkvLayout.CONTIGUOUS
    return None


def fused_qkv_note(fused: dict) -> str:
    """The Plan's evidence line for a fused projection (the ``fused_qkv`` code fact)."""
    layout = QkvLayout(fused["layout"])
    where = f"{fused['class']}.{fused['attr']}"
    if layout is QkvLayout.UNKNOWN:
        return (
            f"{where} projects query, key and value in one Linear; its rows' order is not "
            "shown by one cut of its output (branches cut it differently, or no split was "
            "found), so a tensor-parallel head split is refused"
        )
    return (
        f"{where} projects query, key and value in one Linear, cut by `{fused['split']}` "
        f"({layout.value}: {LAYOUT_WORDS[layout]}); a tensor-parallel head split must cut "
        "its rows the same way"
    )


def _one_line(code: str, limit: int = 120) -> str:
    """A cut as one line for the evidence: ``x.view(b, s, -1, G + 2, d)``."""
    text = re.sub(r"\s+", " ", code.strip())
    text = re.sub(r"([(\[]) ", r"\1", text)
    text = re.sub(r",? ([)\]])", r"\1", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
