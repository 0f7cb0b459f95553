"""The k-pool DSA indexer (GLM-5.3): its facts, and the rewrite that pages its pooled keys.

What the source computes, with its lines, is described in ``analyzer/pooled_indexer.py``. The
rewrite keeps the indexer's own projections (the per-head query, the per-token key and gate
score) and its per-head weights as written, and replaces the rest of its forward (the packed
cache append, the pooling of every pool on every step, the dense scoring, the tail) by
``pooled_selection`` (``templates/mla_pooled_indexer_methods.py.j2``): the step's [key | gate]
rows go to per-request state rows, each token that closes a pool writes the pooled key to a
compressed entry (``compress_ratio`` = the pool size), ``npu_lightning_indexer`` scores the
closed pools, and the query's open pool is added for the sparse attention, which reads the
latent in blocks of one pool (``sparse_block_size``).

The facts check that the source computes exactly that before anything is rewritten: one
``torch.cat([key, gate, ...])`` appended with ``update_indexer``, pooling by
``softmax(gate + self.<ape>)`` in ``get_pooled_states``, ``relu(matmul(q, pool_keys) *
self.<scale>)`` weighted by one ``self.*weights*`` projection, and ``self.<topk> //
self.<pool>`` pools kept; any other shape is refused with the line that differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import assigned_value, method
from kvskill.analyzer.pooled_indexer import POOL_KEY_CACHE, POOL_STATE
from kvskill.implementer._command import ClassRewriteCommand, replace_method, with_body
from kvskill.implementer.facts import code
from kvskill.implementer.mla.indexer import (
    CACHE_KEYWORDS,
    UPDATE_INDEXER,
    is_indexer_class,
    read_names,
)
from kvskill.implementer.snippets import methods, statements

#: the source's pooling of the cached rows into one key per pool
POOLED_STATES = "get_pooled_states"
#: the indexer module's attributes holding its paged caches (set by the attention's setters)
POOL_KEY_ATTR, POOL_STATE_ATTR = "pool_key_cache", "pool_state"
_UPDATE_CALL = m.Call(func=m.Attribute(attr=m.Name(UPDATE_INDEXER)))
_POOLED_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(POOLED_STATES)))
_CAT = m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("cat")) | m.Name("cat"))
_MATMUL = m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("matmul")))
_RELU = m.Call(func=m.Attribute(attr=m.Name("relu")) | m.Name("relu"))
_SELF_ATTR = m.Attribute(value=m.Name("self"))


@dataclass(kw_only=True)
class PooledIndexerFacts:
    """One k-pool indexer class."""

    name: str
    converted: bool = False
    #: the forward statements kept as written (the projections before the cache append)
    kept: list[cst.BaseStatement] = field(default_factory=list)
    #: the names of the per-token key, gate score and per-head query
    key: str = ""
    gate: str = ""
    query: str = ""
    #: the statement computing the per-head weights, kept as written, and its name
    weights_stmt: cst.BaseStatement | None = None
    weights: str = ""
    #: ``self.<attr>`` of the scores' scale, the top-k, the pool size and the pool's ape
    scale: str = ""
    topk_attr: str = ""
    pool_attr: str = ""
    ape_attr: str = ""
    problems: list[str] = field(default_factory=list)


def is_pooled_indexer_class(cls: cst.ClassDef) -> bool:
    """An indexer class (it appends indexer keys) that pools them (``get_pooled_states``)."""
    return method(cls, POOLED_STATES) is not None and (is_indexer_class(cls) or _is_paged(cls))


def _is_paged(cls: cst.ClassDef) -> bool:
    return method(cls, "pooled_selection") is not None


def _self_attrs(node: cst.CSTNode) -> list[str]:
    return [cst.ensure_type(a, cst.Attribute).attr.value for a in m.findall(node, _SELF_ATTR)]


def pooled_indexer_facts(cls: cst.ClassDef) -> PooledIndexerFacts:
    """What the paged rewrite needs from CLS, or the reasons it cannot be rewritten."""
    facts = PooledIndexerFacts(name=cls.name.value, converted=_is_paged(cls))
    forward = method(cls, "forward")
    if facts.converted or forward is None:
        return facts
    where = f"{facts.name}.forward"
    body = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    updates = [i for i, s in enumerate(body) if m.findall(s, _UPDATE_CALL)]
    if len(updates) != 1:
        facts.problems.append(
            f"{where}: {len(updates)} statements append indexer rows "
            f"(`.{UPDATE_INDEXER}(...)`); the paged rewrite needs exactly one"
        )
        return facts
    call = cst.ensure_type(m.findall(body[updates[0]], _UPDATE_CALL)[0], cst.Call)
    packed = code(call.args[0].value) if call.args else ""
    packs = [
        i
        for i, s in enumerate(body[: updates[0]])
        if (found := assigned_value(s)) and found[0] == packed and m.matches(found[1], _CAT)
    ]
    if not packs:
        facts.problems.append(
            f"{where}: the appended rows `{packed}` are not one `torch.cat([key, gate, ...])`"
        )
        return facts
    cat = cst.ensure_type(cst.ensure_type(assigned_value(body[packs[-1]]), tuple)[1], cst.Call)
    parts = cat.args[0].value if cat.args else None
    elements = (
        [code(e.value) for e in parts.elements] if isinstance(parts, cst.List | cst.Tuple) else []
    )
    if len(elements) < 2:
        facts.problems.append(f"{where}: `{code(cat)}` does not pack [key, gate, ...]")
        return facts
    facts.key, facts.gate = elements[0], elements[1]
    masks = {p.name.value for p in forward.params.params if "mask" in p.name.value}
    # the paged call passes no mask (the runtime's requests are unpadded): statements that
    # read it (the valid-token channel of the packed rows) are dropped with the packing
    facts.kept = [s for s in body[: packs[-1]] if not masks & read_names(s)]
    rest = body[updates[0] + 1 :]
    _pooling_facts(facts, cls)
    _scoring_facts(facts, rest, where)
    _budget_facts(facts, rest, where)
    bound = {t for s in facts.kept for t in _targets(s)}
    unbound = [n for n in (facts.key, facts.gate, facts.query) if n and n not in bound]
    if unbound:
        # the rewrite keeps only the statements before the packing
        facts.problems.append(
            f"{where}: {unbound} are not computed before the rows are packed "
            f"(`{packed} = torch.cat(...)`)"
        )
    dropped = {t for s in body[: packs[-1]] if masks & read_names(s) for t in _targets(s)}
    kept_reads = set().union(*(read_names(s) for s in facts.kept)) if facts.kept else set()
    if dropped & (kept_reads | {facts.key, facts.gate, facts.query}):
        facts.problems.append(
            f"{where}: the mask-derived {sorted(dropped)} feed the key, gate or query"
        )
    return facts


def _targets(stmt: cst.BaseStatement) -> list[str]:
    found = assigned_value(stmt)
    return [found[0]] if found else []


def _pooling_facts(facts: PooledIndexerFacts, cls: cst.ClassDef) -> None:
    """``get_pooled_states``: ``(gate... + self.<ape>...).softmax(...)`` weighting the keys."""
    pooled = method(cls, POOLED_STATES)
    where = f"{facts.name}.{POOLED_STATES}"
    assert pooled is not None
    additions = [
        a
        for a in m.findall(pooled, m.BinaryOperation(operator=m.Add()))
        if m.findall(cst.ensure_type(a, cst.BinaryOperation).right, _SELF_ATTR)
    ]
    softmax = m.findall(pooled, m.Call(func=m.Attribute(attr=m.Name("softmax"))))
    ape = [
        attr
        for a in additions
        for attr in _self_attrs(cst.ensure_type(a, cst.BinaryOperation).right)
        if "ape" in attr or "bias" in attr
    ]
    if len(set(ape)) != 1 or not softmax:
        facts.problems.append(
            f"{where}: the pool is not weighted by one `softmax(gate + self.<ape>)` (found "
            f"{sorted(set(ape)) or 'no position bias'}, {len(softmax)} softmax calls)"
        )
        return
    facts.ape_attr = ape[0]


def _scoring_facts(facts: PooledIndexerFacts, rest: list[cst.BaseStatement], where: str) -> None:
    """``pool_keys, ... = self.get_pooled_states(...)``; ``s = torch.matmul(q..., pool_keys...)``;
    ``s = relu(s * self.<scale>)``; one ``w = self.<*weights*>(...)...`` weighting s by a matmul."""
    pools = [s for s in rest if m.findall(s, _POOLED_CALL)]
    line = pools[0] if len(pools) == 1 else None
    targets = m.findall(line, m.AssignTarget(target=m.Tuple())) if line is not None else []
    names = (
        [
            code(e.value)
            for e in cst.ensure_type(
                cst.ensure_type(targets[0], cst.AssignTarget).target, cst.Tuple
            ).elements
        ]
        if targets
        else []
    )
    if not names:
        facts.problems.append(
            f"{where}: no single `pool_keys, ... = self.{POOLED_STATES}(...)` after the append"
        )
        return
    pool_keys = names[0]
    scores = ""
    for stmt in rest:
        found = assigned_value(stmt)
        if found and m.matches(found[1], _MATMUL) and pool_keys in read_names(found[1]):
            queries = read_names(cst.ensure_type(found[1], cst.Call).args[0]) - {"self"}
            facts.query = next(iter(queries)) if len(queries) == 1 else ""
            scores = found[0]
            break
    relu = [
        s
        for s in rest
        if scores
        and m.findall(
            s,
            m.Call(
                func=m.Attribute(attr=m.Name("relu")) | m.Name("relu"),
                args=[
                    m.Arg(
                        value=m.BinaryOperation(
                            left=m.Name(scores), operator=m.Multiply(), right=_SELF_ATTR
                        )
                    )
                ],
            ),
        )
    ]
    if not facts.query or len(relu) != 1:
        facts.problems.append(
            f"{where}: the scores are not `relu(torch.matmul(q, {pool_keys}) * self.<scale>)` "
            "of the pooled keys (what npu_lightning_indexer computes, with the scale in the "
            "weights)"
        )
        return
    relu_call = cst.ensure_type(m.findall(relu[0], _RELU)[0], cst.Call)
    facts.scale = code(cst.ensure_type(relu_call.args[0].value, cst.BinaryOperation).right)
    weights = [s for s in rest if _targets(s) and any("weights" in a for a in _self_attrs(s))]
    if len(weights) != 1:
        facts.problems.append(
            f"{where}: {len(weights)} statements compute the per-head weights from a "
            "`self.*weights*` projection; the paged rewrite needs exactly one"
        )
        return
    facts.weights_stmt, facts.weights = weights[0], _targets(weights[0])[0]
    if not any(facts.weights in read_names(s) and m.findall(s, _MATMUL) for s in rest):
        facts.problems.append(
            f"{where}: the weights `{facts.weights}` do not weight the scores by a matmul"
        )


def _budget_facts(facts: PooledIndexerFacts, rest: list[cst.BaseStatement], where: str) -> None:
    """The pools kept: ``self.<topk> // self.<pool>`` (in a ``min(...)``), then ``.topk``."""
    budget = m.BinaryOperation(left=_SELF_ATTR, operator=m.FloorDivide(), right=_SELF_ATTR)
    found = [b for s in rest for b in m.findall(s, budget)]
    topk = [s for s in rest if m.findall(s, m.Call(func=m.Attribute(attr=m.Name("topk"))))]
    if len(found) != 1 or not topk:
        facts.problems.append(
            f"{where}: the pools kept are not one `self.<index_topk> // self.<index_kpool>` "
            "fed to `.topk(...)`"
        )
        return
    division = cst.ensure_type(found[0], cst.BinaryOperation)
    facts.topk_attr = cst.ensure_type(division.left, cst.Attribute).attr.value
    facts.pool_attr = cst.ensure_type(division.right, cst.Attribute).attr.value


def _cache_optional(params: cst.Parameters) -> cst.Parameters:
    """PARAMS with the source's cache parameter defaulting to None: the paged attention calls
    the indexer without it (``indexer.indexer_call``), as the paged forward reads none."""
    trailing = params.params
    if not trailing or trailing[-1].name.value not in CACHE_KEYWORDS or trailing[-1].default:
        return params
    last = trailing[-1].with_changes(
        default=cst.Name("None"),
        equal=cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(" "),
            whitespace_after=cst.SimpleWhitespace(" "),
        ),
    )
    return params.with_changes(params=[*trailing[:-1], last])


class PooledIndexerCommand(ClassRewriteCommand):
    """Page the k-pool indexer: pooled keys written when a pool closes, selected with
    npu_lightning_indexer, the open pool added."""

    DESCRIPTION = (
        "k-pool DSA indexer: the open pool's [key | gate] rows in indexer_pool_state, one "
        "pooled key per closed pool in indexer_pool_key_cache (compress_ratio = pool); "
        "npu_lightning_indexer picks the pools, the open pool is added."
    )

    @classmethod
    def problems(cls, module: cst.Module, spec) -> list[str]:
        if spec.indexer is None or spec.indexer.pool_size == 1:
            return []
        found = [c for c in m.findall(module, m.ClassDef()) if is_pooled_indexer_class(c)]
        if not found:
            return [
                f"the Plan has a k-pool indexer (pools of {spec.indexer.pool_size}) but no class "
                f"appends indexer rows (`.{UPDATE_INDEXER}(...)`) and pools them "
                f"(`{POOLED_STATES}`)"
            ]
        return [
            p
            for c in found
            for p in pooled_indexer_facts(cst.ensure_type(c, cst.ClassDef)).problems
        ]

    def selects(self, cls: cst.ClassDef) -> bool:
        indexer = self.spec.indexer
        return (
            indexer is not None
            and indexer.pool_size > 1
            and is_pooled_indexer_class(cls)
            and not _is_paged(cls)
        )

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        facts = pooled_indexer_facts(original)
        assert not facts.problems, "the pipeline validates indexer facts first"
        assert facts.weights_stmt is not None
        config = self.parser_config()
        values = {
            "pool_key_cache": POOL_KEY_ATTR,
            "pool_state": POOL_STATE_ATTR,
            # the runtime's group keys of the two entries (their manager_key)
            "pool_key_group": POOL_KEY_CACHE,
            "pool_state_group": POOL_STATE,
            "pool_attr": facts.pool_attr,
            "ape_attr": facts.ape_attr,
            "sparse_count": f"self.{facts.topk_attr} // self.{facts.pool_attr}",
        }
        init_stmts = statements("mla_pooled_indexer_init.py.j2", config, **values)

        def init(function: cst.FunctionDef) -> cst.FunctionDef:
            block = cst.ensure_type(function.body, cst.IndentedBlock)
            return function.with_changes(body=block.with_changes(body=[*block.body, *init_stmts]))

        def forward(function: cst.FunctionDef) -> cst.FunctionDef:
            block = cst.ensure_type(function.body, cst.IndentedBlock)
            new = statements(
                "mla_pooled_indexer_seam.py.j2",
                config,
                key=facts.key,
                gate=facts.gate,
                query=facts.query,
                weights=facts.weights,
                scale=facts.scale,
            )
            weights = facts.weights_stmt.with_changes(leading_lines=[])
            return function.with_changes(
                params=_cache_optional(function.params),
                body=block.with_changes(body=[*facts.kept, weights, *new]),
            )

        body = replace_method(updated, "__init__", init)
        body = replace_method(with_body(updated, body), "forward", forward)
        return with_body(
            updated, [*body, *methods("mla_pooled_indexer_methods.py.j2", config, **values)]
        )
