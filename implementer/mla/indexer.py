"""The DSA indexer (DeepSeek-V3.2): its facts, and the rewrite that pages its key cache.

The source indexer (transformers 5's ``DeepseekV32Indexer``) computes, per query token,

    k      = its one-head key, appended to the cache:  k = cache.update_indexer(k, layer_idx)
    scores = relu(q . k * softmax_scale)                       [B, S, H, T]
    index  = sum_h weights[h] * scores[h]                      (weights from weights_proj)
    return   index (+ causal mask).topk(index_topk).indices

``npu_lightning_indexer`` computes ``sum_h weights[h] * relu(q . k)`` over a paged key cache,
causal through ``sparse_mode`` 3, and returns the top ``sparse_count`` logical positions with
-1 after the candidates. The scale moves into the weights (``relu(c x) = c relu(x)`` for the
positive ``head_dim ** -0.5``), so the rewrite keeps everything above the cache write, writes
the keys at ``slot_mapping`` and hands ``q``, the paged keys and the scaled weights to the
operator. The facts below check that the source computes exactly that before anything is
rewritten; any other scoring is refused with the line that differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import assigned_value, method
from kvskill.implementer._command import ClassRewriteCommand, replace_method, with_body
from kvskill.implementer.facts import code
from kvskill.implementer.snippets import statements

#: the source's append of the indexer keys (transformers 5's ``DynamicIndexedLayer``)
UPDATE_INDEXER = "update_indexer"
_UPDATE_CALL = m.Call(func=m.Attribute(attr=m.Name(UPDATE_INDEXER)))
_RELU = m.Call(func=m.Attribute(attr=m.Name("relu")) | m.Name("relu"))
_TOPK = m.Call(func=m.Attribute(attr=m.Name("topk")))
_MATMUL = m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("matmul")))
#: ``self.key_cache`` is the paged indexer key cache the attention's tensor_setter hands over
KEY_CACHE_ATTR = "key_cache"


@dataclass(kw_only=True)
class IndexerFacts:
    """One indexer class."""

    name: str
    converted: bool = False
    #: index of the forward statement that appends the keys to the source's cache
    update_index: int = -1
    #: the query [B, S, H, D] and the key [B, S, D] names at the cache write
    query: str = ""
    key: str = ""
    #: the statement that computes the per-head weights, kept as written
    weights_stmt: cst.BaseStatement | None = None
    weights: str = ""
    #: the scores' scale (``self.softmax_scale``) and the attribute holding the top-k
    scale: str = ""
    topk_attr: str = ""
    problems: list[str] = field(default_factory=list)


def is_indexer_class(cls: cst.ClassDef) -> bool:
    """A class whose forward appends indexer keys to a cache, or one already paged."""
    forward = method(cls, "forward")
    if forward is None:
        return False
    return bool(m.findall(forward, _UPDATE_CALL)) or _is_paged(cls)


def _is_paged(cls: cst.ClassDef) -> bool:
    forward = method(cls, "forward")
    return forward is not None and bool(
        m.findall(forward, m.Call(func=m.Attribute(attr=m.Name("npu_lightning_indexer"))))
    )


class _ReadNames(cst.CSTVisitor):
    """Variable names an expression reads (not attribute names: ``q.float`` reads ``q``)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)
        return False

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)


def read_names(node: cst.CSTNode) -> set[str]:
    """The variable names NODE reads (``q.float()`` reads ``q``)."""
    reader = _ReadNames()
    node.visit(reader)
    return reader.names


def _assigned(stmt: cst.BaseStatement) -> str | None:
    found = assigned_value(stmt)
    return found[0] if found else None


def indexer_facts(cls: cst.ClassDef) -> IndexerFacts:
    """What the paged rewrite needs from CLS, or the reasons it cannot be rewritten."""
    facts = IndexerFacts(name=cls.name.value, converted=_is_paged(cls))
    forward = method(cls, "forward")
    if facts.converted or forward is None:
        return facts
    body = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    where = f"{facts.name}.forward"
    updates = [i for i, s in enumerate(body) if m.findall(s, _UPDATE_CALL)]
    if len(updates) != 1:
        facts.problems.append(
            f"{where}: {len(updates)} statements append indexer keys "
            f"(`.{UPDATE_INDEXER}(...)`); the paged rewrite needs exactly one"
        )
        return facts
    facts.update_index = updates[0]
    call = cst.ensure_type(m.findall(body[updates[0]], _UPDATE_CALL)[0], cst.Call)
    facts.key = code(call.args[0].value) if call.args else ""
    rest = body[updates[0] + 1 :]
    _scores_facts(facts, rest, where)
    _weights_facts(facts, rest, where)
    returns = [s for s in rest if m.findall(s, m.Return())]
    if len(returns) != 1 or not m.findall(returns[0], _TOPK):
        facts.problems.append(f"{where}: no single `return ....topk(...)` after the key cache")
    else:
        topk = cst.ensure_type(m.findall(returns[0], _TOPK)[0], cst.Call)
        # the count, or the statement that binds it (``topk = min(self.index_topk, ...)``)
        count: cst.CSTNode = topk.args[0].value if topk.args else topk
        if isinstance(count, cst.Name):
            bound = [s for s in rest if _assigned(s) == cst.ensure_type(count, cst.Name).value]
            count = bound[-1] if bound else count
        attrs = [
            cst.ensure_type(a, cst.Attribute).attr.value
            for a in m.findall(count, m.Attribute(value=m.Name("self")))
        ]
        if not attrs:
            facts.problems.append(
                f"{where}: the top-k count is not a `self.` attribute: {code(topk)}"
            )
        else:
            facts.topk_attr = attrs[0]
    return facts


def _scores_facts(facts: IndexerFacts, rest: list[cst.BaseStatement], where: str) -> None:
    """``scores = torch.matmul(q..., k...) * self.<scale>`` then ``relu(scores)``."""
    for stmt in rest:
        found = assigned_value(stmt)
        if found is None or facts.key not in read_names(stmt):
            continue
        target, value = found
        product = m.BinaryOperation(
            left=_MATMUL, operator=m.Multiply(), right=m.Attribute(value=m.Name("self"))
        )
        if not m.matches(value, product):
            break
        value = cst.ensure_type(value, cst.BinaryOperation)
        queries = read_names(cst.ensure_type(value.left, cst.Call).args[0]) - {"self"}
        facts.query = next(iter(queries)) if len(queries) == 1 else ""
        facts.scale = code(value.right)
        relu = [s for s in rest if m.findall(s, _RELU) and target in read_names(s)]
        if facts.query and relu:
            return
        break
    facts.problems.append(
        f"{where}: the scores are not `relu(torch.matmul(q, k) * self.<scale>)` of the cached "
        "keys (what npu_lightning_indexer computes, with the scale in the weights)"
    )


def _weights_facts(facts: IndexerFacts, rest: list[cst.BaseStatement], where: str) -> None:
    """One ``weights = self.weights_proj(...)...`` statement, summed over heads with scores."""
    found = [
        s
        for s in rest
        if _assigned(s)
        and any(
            "weights" in cst.ensure_type(a, cst.Attribute).attr.value
            for a in m.findall(s, m.Attribute(value=m.Name("self")))
        )
    ]
    if len(found) != 1:
        facts.problems.append(
            f"{where}: {len(found)} statements compute the per-head weights from a "
            "`self.*weights*` projection; the paged rewrite needs exactly one"
        )
        return
    facts.weights_stmt = found[0]
    facts.weights = _assigned(found[0]) or ""
    if facts.query and not any(
        facts.weights in read_names(s) and m.findall(s, _MATMUL) for s in rest
    ):
        facts.problems.append(
            f"{where}: the weights `{facts.weights}` do not weight the scores by a matmul"
        )


class IndexerCommand(ClassRewriteCommand):
    """Page the DSA indexer's keys and select with npu_lightning_indexer."""

    DESCRIPTION = (
        "DSA indexer: write its keys at slot_mapping into the paged indexer_key_cache; select "
        "the top-k with npu_lightning_indexer (PA_BSND, sparse_mode 3)."
    )

    @classmethod
    def problems(cls, module: cst.Module, spec) -> list[str]:
        if spec.indexer is None or spec.indexer.pool_size > 1:
            return []  # a k-pool indexer is PooledIndexerCommand's
        found = [c for c in m.findall(module, m.ClassDef()) if is_indexer_class(c)]
        if not found:
            return [
                f"the Plan has a DSA indexer but no class appends indexer keys "
                f"(`.{UPDATE_INDEXER}(...)`)"
            ]
        return [p for c in found for p in indexer_facts(cst.ensure_type(c, cst.ClassDef)).problems]

    def selects(self, cls: cst.ClassDef) -> bool:
        return (
            self.spec.indexer is not None
            and self.spec.indexer.pool_size == 1
            and is_indexer_class(cls)
            and not _is_paged(cls)
        )

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        facts = indexer_facts(original)
        assert not facts.problems, "the pipeline validates indexer facts first"
        config = self.parser_config()
        init_stmts = statements("mla_indexer_init.py.j2", config, key_cache=KEY_CACHE_ATTR)

        def init(function: cst.FunctionDef) -> cst.FunctionDef:
            block = cst.ensure_type(function.body, cst.IndentedBlock)
            return function.with_changes(body=block.with_changes(body=[*block.body, *init_stmts]))

        def forward(function: cst.FunctionDef) -> cst.FunctionDef:
            block = cst.ensure_type(function.body, cst.IndentedBlock)
            old = list(block.body)
            assert facts.weights_stmt is not None
            new = statements(
                "mla_indexer_seam.py.j2",
                config,
                attn_type=self.spec.attn_type,
                key_cache=KEY_CACHE_ATTR,
                query=facts.query,
                key=facts.key,
                weights=facts.weights,
                scale=facts.scale,
                topk_attr=facts.topk_attr,
            )
            new.insert(1, facts.weights_stmt)
            new[0] = new[0].with_changes(
                leading_lines=[*old[facts.update_index].leading_lines, *new[0].leading_lines]
            )
            body = [*old[: facts.update_index], *new]
            return function.with_changes(body=block.with_changes(body=body))

        body = replace_method(updated, "__init__", init)
        return with_body(updated, replace_method(with_body(updated, body), "forward", forward))


@dataclass(frozen=True, kw_only=True)
class IndexerCallFacts:
    """The attention's call of its indexer, in the seam."""

    #: the call statement as the paged forward makes it (mask -> None, no cache argument);
    #: for a layer that may share, the whole ``if self.<indexer> is not None: ... else: ...``
    #: with only the call paged
    statement: cst.BaseStatement
    #: the name bound to the top-k positions
    target: str
    #: the attention's attribute holding the indexer module
    attr: str
    #: the parameter a layer without an indexer takes its top-k from (GLM-5's "shared" layers
    #: reuse the previous indexed layer's), None when every layer runs its indexer
    shared_from: str | None = None


#: keyword arguments that carry the source's own cache object
CACHE_KEYWORDS = frozenset({"cache", "past_key_values", "past_key_value"})


def indexer_call(
    seam: list[cst.BaseStatement],
    modules: dict[str, cst.Call],
    classes: dict[str, cst.ClassDef],
    forward: cst.FunctionDef,
) -> IndexerCallFacts | str | None:
    """The seam's ``x = self.<indexer>(...)``, a reason it cannot be paged, or None.

    A layer that may have no indexer (``self.<indexer> = None if ... else Indexer(...)``)
    calls it as ``if self.<indexer> is not None: x = self.<indexer>(...)``, and its ``else``
    reuses a selection passed in: ``x = <parameter>``, after guards that only raise. That
    ``if`` is kept whole, the call paged; the selection passed in is already in the paged
    layout (the previous layer's converted indexer returned it).
    """
    owners = {attr: code(call.func).split(".")[-1] for attr, call in modules.items()}
    indexers = {
        a for a, name in owners.items() if name in classes and is_indexer_class(classes[name])
    }
    calls = [
        s
        for s in seam
        for attr in indexers
        if m.findall(s, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(attr))))
    ]
    if not calls:
        return None
    if len(calls) == 1 and isinstance(calls[0], cst.If):
        return _optional_indexer_call(calls[0], forward)
    return _paged_call(calls[0], forward) if len(calls) == 1 else _not_one_call(len(calls))


def _not_one_call(count: int) -> str:
    return f"the indexer is called {count} times, or not as `x = self.<indexer>(...)`"


def _paged_call(stmt: cst.BaseStatement, forward: cst.FunctionDef) -> IndexerCallFacts | str:
    """``x = self.<indexer>(...)`` with the mask argument None and no cache argument."""
    found = assigned_value(stmt)
    if found is None:
        return _not_one_call(1)
    target, call = found
    line = cst.ensure_type(stmt, cst.SimpleStatementLine)
    assign = cst.ensure_type(line.body[0], cst.Assign)
    if not isinstance(call, cst.Call):
        return f"the indexer's result is not bound directly: {code(line)}"
    masks = {
        p.name.value for p in forward.params.params if "mask" in p.name.value
    }  # the causal mask: the paged indexer is causal through sparse_mode 3
    args = []
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value in CACHE_KEYWORDS:
            continue
        if masks & read_names(arg.value):
            arg = arg.with_changes(value=cst.Name("None"))
        args.append(arg)
    if args and args[-1] is not call.args[-1]:
        # the dropped last argument's comma (and the layout around it) closes the call
        args[-1] = args[-1].with_changes(comma=call.args[-1].comma)
    paged = line.with_changes(body=[assign.with_changes(value=call.with_changes(args=args))])
    attr = cst.ensure_type(call.func, cst.Attribute).attr.value
    return IndexerCallFacts(statement=paged, target=target, attr=attr)


def _optional_indexer_call(stmt: cst.If, forward: cst.FunctionDef) -> IndexerCallFacts | str:
    """``if self.<indexer> is not None: x = self.<indexer>(...) else: <guards>; x = <param>``."""
    shown = code(stmt.test)
    test = m.Comparison(
        left=m.Attribute(value=m.Name("self")),
        comparisons=[m.ComparisonTarget(operator=m.IsNot(), comparator=m.Name("None"))],
    )
    if not m.matches(stmt.test, test):
        return (
            f"the indexer runs under `if {shown}:`; only `if self.<indexer> is not None:` is read"
        )
    body = list(cst.ensure_type(stmt.body, cst.IndentedBlock).body)
    found = _paged_call(body[0], forward) if len(body) == 1 else _not_one_call(len(body))
    if isinstance(found, str):
        return found
    where = f"`if {shown}:`"
    if (
        cst.ensure_type(cst.ensure_type(stmt.test, cst.Comparison).left, cst.Attribute).attr.value
        != found.attr
    ):
        return f"{where} tests another attribute than the indexer `self.{found.attr}` it calls"
    if not isinstance(stmt.orelse, cst.Else):
        return f"{where} has no else: a layer without the indexer leaves `{found.target}` unbound"
    other = list(cst.ensure_type(stmt.orelse.body, cst.IndentedBlock).body)
    reused = assigned_value(other[-1]) if other else None
    params = {p.name.value for p in forward.params.params}
    if (
        reused is None
        or reused[0] != found.target
        or not isinstance(reused[1], cst.Name)
        or reused[1].value not in params
    ):
        return (
            f"the else of {where} does not end with `{found.target} = <parameter>` (a selection "
            "passed in from the previous layer)"
        )
    guards = other[:-1]
    if any(not (isinstance(g, cst.If) and _only_raises(g)) for g in guards):
        return f"the else of {where} does more than check and reuse the selection passed in"
    paged = stmt.with_changes(body=stmt.body.with_changes(body=[found.statement]))
    return IndexerCallFacts(
        statement=paged,
        target=found.target,
        attr=found.attr,
        shared_from=cst.ensure_type(reused[1], cst.Name).value,
    )


def _only_raises(guard: cst.If) -> bool:
    body = list(cst.ensure_type(guard.body, cst.IndentedBlock).body)
    return (
        guard.orelse is None
        and len(body) == 1
        and m.matches(body[0], m.SimpleStatementLine(body=[m.Raise()]))
    )
