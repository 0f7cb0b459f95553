"""Structural facts of an MLA attention class, gathered before any rewrite.

On top of the generic seam (``implementer.facts``: the cache write of the latent and the rope
key, then the attention kernel) the absorbed rewrite needs the modules and names that carry
the latent:

* ``kv_b_proj``: the Linear whose input is the latent (its in-features read
  ``kv_lora_rank``); its weight holds the key and value up-projections, per head
  ``[qk_nope_head_dim + v_head_dim, kv_lora_rank]``.
* the query parts: ``query = torch.cat((q_nope, q_rope), dim=-1)`` gives the two names; any
  other query expression is split by the rope head dim.
* what the paged caches take: the source's own cache write when it caches the latent and the
  rope key (transformers 5), else - when the source decompresses the latent with ``kv_b_proj``
  *before* its cache write and caches per-head keys and values (DeepSeek-V2/V3's hub files,
  transformers 4.3x) - the normalised latent it feeds ``kv_b_proj`` and the rope part of the
  down-projection's split, as rotated where the cache is written.
* for the fused write only: the down-projection (out-features ``kv_lora_rank +
  qk_rope_head_dim``) and the name of its raw output, the latent RMSNorm module and its
  epsilon attribute, and the ``cos, sin`` tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import self_module_calls
from kvskill.analyzer.query_rescale import QueryRescale, query_rescale
from kvskill.implementer.facts import (
    SeamFacts,
    SeamStore,
    attention_facts,
    code,
    init_owner,
    seam_forward,
    seam_leak_limit,
    seam_store_limit,
)
from kvskill.implementer.mla.indexer import IndexerCallFacts, indexer_call

LATENT_RANK = "kv_lora_rank"
ROPE_DIM_KEY = "qk_rope_head_dim"
#: ``torch.cat((a, b), dim=-1)`` / ``torch.cat([a, b], -1)``
_CAT = m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("cat")) | m.Name("cat"))
_SELF_ASSIGN = m.Assign(targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))])


@dataclass(frozen=True, kw_only=True)
class FusedWriteFacts:
    """What ``npu_kv_rmsnorm_rope_cache`` needs from the source."""

    #: name of the raw down-projection output ``[B, S, rank + rope]``
    raw_latent: str
    #: attribute of the latent RMSNorm module, its gain parameter and its epsilon attribute
    norm: str
    norm_weight: str
    norm_eps: str
    cos: str
    sin: str


@dataclass(frozen=True, kw_only=True)
class DecompressedFacts:
    """A source that caches per-head keys and values decompressed from the latent."""

    #: the normalised latent, as the source passes it to kv_b_proj (an expression)
    latent: str
    #: the rope part of the down-projection's split, rotated by the time the cache is written
    rope_key: str


@dataclass(kw_only=True)
class MlaAttentionFacts:
    """One MLA attention class."""

    name: str
    config_param: str | None = None
    seam: SeamFacts | None = None
    kv_b_proj: str | None = None
    #: (q_nope, q_rope) names when the query is a concatenation of the two, else None
    query_parts: tuple[str, str] | None = None
    #: whether the seam itself builds the query (it is unbound at the cache write): the
    #: statements that build it are kept ahead of the paged seam
    query_in_seam: bool = False
    #: what the latent cache takes when the source caches decompressed keys and values: the
    #: expression ``kv_b_proj`` reads (``self.kv_a_layernorm(compressed_kv)``) and the name of
    #: the rotated rope key; None when the source's cache write takes the latent itself
    decompressed: DecompressedFacts | None = None
    fused: FusedWriteFacts | None = None
    #: the DSA indexer's call in the seam (indexed sparse attention), None without one
    indexer: IndexerCallFacts | None = None
    #: per-position rescales of the query between the cache write and the kernel (Mistral
    #: Large 4's softmax scaling), in source order: the converted seam applies them too
    query_rescales: list[QueryRescale] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
            return stmt
    return None


def _is_linear(call: cst.Call) -> bool:
    return code(call.func).split(".")[-1] == "Linear"


def _positional(call: cst.Call, index: int) -> str:
    args = [a for a in call.args if a.keyword is None]
    return code(args[index].value) if len(args) > index else ""


def mla_attention_facts(
    cls: cst.ClassDef,
    classes: dict[str, cst.ClassDef],
    fused: bool,
    indexed: bool = False,
    *,
    shared_layers: bool = False,
    own_latent_only: bool = False,
) -> MlaAttentionFacts:
    """Gather what the MLA codemods need; ``problems`` lists what blocks a rewrite.

    A variant of an attention family (``XFlashAttention2(XAttention)`` with no ``__init__``
    of its own, or one that only calls ``super().__init__``) reads its modules from the
    ``__init__`` of the base that owns them (:func:`init_owner`); its seam is its own.
    """
    generic = attention_facts(cls, classes)
    facts = MlaAttentionFacts(
        name=generic.name,
        config_param=generic.config_param,
        seam=generic.seam,
        # the MLA rewrite reads its query itself (its parts, or the statements kept when the
        # query is first bound in the seam) and checks its rebinding below
        problems=[*generic.problems, *generic.fused_limits],
    )
    owner = init_owner(cls, classes)
    forward = _method(cls, "forward")
    if owner is None or forward is None or facts.seam is None:
        return facts
    if own_latent_only:
        _drop_unread_handoffs(facts, forward, generic.seam_stores)
    init = _method(owner, "__init__")
    assert init is not None, "init_owner returns a class with an __init__"
    forward, _ = seam_forward(cls, forward)
    modules = self_module_calls(init)
    up = [a for a, c in modules.items() if _is_linear(c) and LATENT_RANK in _positional(c, 0)]
    if len(up) != 1:
        facts.problems.append(
            f"{owner.name.value}.__init__ has {len(up)} Linear layers reading the latent "
            f"(in-features from {LATENT_RANK}); the absorbed rewrite needs exactly one kv_b_proj"
        )
    else:
        facts.kv_b_proj = up[0]
    facts.query_parts = _query_parts(forward, facts.seam)
    rebinds = _Rebinds(forward, facts.seam, modules, classes)
    if facts.query_parts is None:
        facts.query_in_seam = _query_in_seam(facts, rebinds)
    else:
        _check_query_rebinds(facts, rebinds, facts.query_parts)
    if facts.kv_b_proj is not None:
        facts.decompressed = _decompressed_facts(facts, forward, facts.kv_b_proj)
    if fused:
        facts.fused = _fused_facts(facts, forward, modules, classes)
    _indexer_facts(facts, forward, modules, classes, indexed, generic.seam_leaks)
    if shared_layers and facts.indexer is not None and facts.indexer.shared_from is None:
        facts.problems.append(
            f"{facts.name}.forward: the Plan has layers that reuse another layer's top-k "
            "('shared' indexer_types) but the forward runs its indexer on every layer "
            f"(`{code(facts.indexer.statement).strip()}`)"
        )
    return facts


def _drop_unread_handoffs(
    facts: MlaAttentionFacts, forward: cst.FunctionDef, stores: list[SeamStore]
) -> None:
    """Accept the seam's stores into a forward parameter under a layer flag (Mistral Large 4's
    ``if self.store_full_length_kv: shared_kv_states[...] = (k_pass, k_rot)``) when the
    config proves no layer reads another's latent: the store then has no reader. Any other
    store (into ``self``, unguarded, or with reuse in the config) stays a problem."""
    params = {p.name.value for p in forward.params.params[1:]}
    flag = m.If(test=m.Attribute(value=m.Name("self")), orelse=None)
    for store in stores:
        if store.base in params and m.matches(store.statement, flag):
            facts.problems.remove(seam_store_limit(facts.name, store))


def _indexer_facts(
    facts: MlaAttentionFacts,
    forward: cst.FunctionDef,
    modules: dict[str, cst.Call],
    classes: dict[str, cst.ClassDef],
    indexed: bool,
    generic_leaks: list[str],
) -> None:
    """The indexer call the DSA seam keeps; a dense rewrite must not drop one."""
    seam = facts.seam
    assert seam is not None
    body = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    found = indexer_call(body[seam.update_index : seam.kernel_index], modules, classes, forward)
    where = f"{facts.name}.forward"
    if isinstance(found, str):
        facts.problems.append(f"{where}: {found}")
    elif found is None and indexed:
        facts.problems.append(
            f"{where}: the Plan has a DSA indexer but the attention calls none between its "
            "cache write and its kernel"
        )
    elif found is not None and not indexed:
        facts.problems.append(
            f"{where}: `self.{found.attr}(...)` selects the attended keys (a top-k indexer) "
            "but the Plan has no indexer; a dense rewrite would attend to every key"
        )
    else:
        facts.indexer = found
    if found is not None and not isinstance(found, str) and found.target in generic_leaks:
        # the paged seam keeps the indexer statement, so its top-k is bound after it (GLM-5's
        # attention returns it for the next layer): only the other names leak
        facts.problems.remove(seam_leak_limit(facts.name, generic_leaks))
        rest = [n for n in generic_leaks if n != found.target]
        if rest:
            facts.problems.append(seam_leak_limit(facts.name, rest))


def _decompressed_facts(
    facts: MlaAttentionFacts, forward: cst.FunctionDef, kv_b_proj: str
) -> DecompressedFacts | None:
    """The latent and rope key to cache when ``self.<kv_b_proj>(x)`` runs before the cache write
    (the source caches its output); None when it does not (the source caches the latent)."""
    assert facts.seam is not None
    body = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    before = body[: facts.seam.update_index]
    call = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(kv_b_proj)), args=[m.Arg()])
    found = [
        (index, cst.ensure_type(node, cst.Call))
        for index, stmt in enumerate(before)
        for node in m.findall(stmt, call)
    ]
    if not found:
        return None
    if len(found) != 1:
        facts.problems.append(
            f"{facts.name}.forward calls self.{kv_b_proj} {len(found)} times before its cache "
            "write; the latent to cache must be the one input it decompresses"
        )
        return None
    index, node = found[0]
    latent = node.args[0].value
    read = {cst.ensure_type(n, cst.Name).value for n in m.findall(latent, m.Name())}
    rebound = _assigned_in(before[index + 1 :]) & read
    if rebound:
        facts.problems.append(
            f"{facts.name}.forward rebinds {sorted(rebound)} between self.{kv_b_proj}(...) and "
            "the cache write; the latent it decompressed is no longer at hand to cache"
        )
        return None
    rope_key = _rope_split_target(before)
    if rope_key is None or not _rotated(before, rope_key):
        facts.problems.append(
            f"{facts.name}.forward caches keys decompressed by self.{kv_b_proj}, but no "
            f"`latent, rope_key = torch.split(x, [...{LATENT_RANK}, ...{ROPE_DIM_KEY}], ...)` "
            "whose rope key is then rotated under the same name: the shared rope key to cache "
            "is unknown"
        )
        return None
    return DecompressedFacts(latent=code(latent), rope_key=rope_key)


def _assigned_in(stmts: list[cst.BaseStatement]) -> set[str]:
    """Names (re)bound by assignments in STMTS (``x[...] = ...`` writes into x, binds none)."""
    names: set[str] = set()
    for stmt in stmts:
        for target in m.findall(stmt, m.AssignTarget()):
            node = cst.ensure_type(target, cst.AssignTarget).target
            bound = node.elements if isinstance(node, (cst.Tuple, cst.List)) else [node]
            for element in bound:
                value = element.value if isinstance(element, cst.BaseElement) else element
                if isinstance(value, cst.Name):
                    names.add(value.value)
    return names


#: ``a, b = torch.split(x, [sizes], ...)`` / ``x.split([sizes], ...)``
_SPLIT_ASSIGN = m.Assign(
    targets=[m.AssignTarget(target=m.Tuple(elements=[m.Element(m.Name()), m.Element(m.Name())]))],
    value=m.Call(func=m.Attribute(attr=m.Name("split"))),
)


def _rope_split_target(stmts: list[cst.BaseStatement]) -> str | None:
    """The name the down-projection's split gives its rope part: of ``a, b = split(x,
    [<kv_lora_rank>, <qk_rope_head_dim>])`` the target sized by the rope head dim."""
    for stmt in stmts:
        for node in m.findall(stmt, _SPLIT_ASSIGN):
            assign = cst.ensure_type(node, cst.Assign)
            sizes = next(
                (a.value for a in cst.ensure_type(assign.value, cst.Call).args if _is_list(a)),
                None,
            )
            if not isinstance(sizes, (cst.List, cst.Tuple)) or len(sizes.elements) != 2:
                continue
            texts = [code(e.value) for e in sizes.elements]
            if LATENT_RANK in texts[0] and ROPE_DIM_KEY in texts[1]:
                target = cst.ensure_type(assign.targets[0].target, cst.Tuple)
                return cst.ensure_type(target.elements[1].value, cst.Name).value
    return None


def _is_list(arg: cst.Arg) -> bool:
    return isinstance(arg.value, (cst.List, cst.Tuple))


def _rotated(stmts: list[cst.BaseStatement], name: str) -> bool:
    """Whether NAME is reassigned from a call that reads the rotary tables (``cos``/``sin``)."""
    for stmt in stmts:
        for node in m.findall(stmt, m.Assign(value=m.Call())):
            assign = cst.ensure_type(node, cst.Assign)
            if name not in _assigned_in([cst.SimpleStatementLine(body=[assign])]):
                continue
            args = " ".join(code(a.value) for a in cst.ensure_type(assign.value, cst.Call).args)
            if "cos" in args and "sin" in args:
                return True
    return False


#: methods that change a tensor's layout or dtype, never its values
_RELAYOUT_METHODS = frozenset(
    {"transpose", "permute", "contiguous", "to", "type", "float", "half", "bfloat16"}
)


def _relayout_of(value: cst.BaseExpression, name: str) -> bool:
    """Whether VALUE is NAME through layout and dtype changes only (``q.transpose(1, 2)``,
    ``q.to(dtype)``)."""
    while isinstance(value, cst.Call):
        func = value.func
        if not isinstance(func, cst.Attribute) or func.attr.value not in _RELAYOUT_METHODS:
            return False
        value = func.value
    return m.matches(value, m.Name(name))


@dataclass(frozen=True)
class _Rebinds:
    """What the query's rebinding inside the seam is checked against."""

    forward: cst.FunctionDef
    seam: SeamFacts
    modules: dict[str, cst.Call]
    classes: dict[str, cst.ClassDef]


def _query_in_seam(facts: MlaAttentionFacts, rebinds: _Rebinds) -> bool:
    """Whether the query is first bound inside the seam (then its statements are kept).

    A query bound before the cache write is read there, in the write's layout. A flash
    variant then re-lays it out for its kernel inside the seam (``query_states =
    query_states.transpose(1, 2)``, a cast under autocast); the paged seam replaces those
    with its own flattening. Any other rebinding there changes the values the kernel sees,
    which the seam would miss: a problem.
    """
    forward, seam = rebinds.forward, rebinds.seam
    if seam.query not in _bound_before(forward, seam):
        return True
    _check_query_rebinds(facts, rebinds, None)
    return False


def _bound_before(forward: cst.FunctionDef, seam: SeamFacts) -> set[str]:
    """Names bound before the cache write: forward parameters and earlier assignments."""
    body = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    params = {p.name.value for p in forward.params.params}
    return _assigned_in(body[: seam.update_index]) | params


def _check_query_rebinds(
    facts: MlaAttentionFacts, rebinds: _Rebinds, parts: tuple[str, str] | None
) -> None:
    """Inside the seam, the query (and its PARTS, when the rewrite builds the query from them)
    may only be re-laid out or cast, built once as ``torch.cat(PARTS, -1)``, and rescaled per
    position by a verified module (``query_rescale``), which the converted seam applies
    again: the paged seam replaces these statements, so any other rebinding (a scale of
    another kind, a bias) would be dropped."""
    forward, seam = rebinds.forward, rebinds.seam
    body = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    bound_before = _bound_before(forward, seam)
    guarded = {seam.query, *(parts or ())}
    for stmt in body[seam.update_index : seam.kernel_index]:
        for node in m.findall(stmt, m.Assign()):
            assign = cst.ensure_type(node, cst.Assign)
            names = _assigned_in([cst.SimpleStatementLine(body=[assign])]) & guarded
            if not names:
                continue
            target = assign.targets[0].target
            alone = len(assign.targets) == 1 and isinstance(target, cst.Name)
            name = cst.ensure_type(target, cst.Name).value if alone else ""
            if alone and (
                _relayout_of(assign.value, name)
                or (
                    name == seam.query
                    and parts is not None
                    and _concat_parts(assign.value) == parts
                )
            ):
                continue
            rescale = query_rescale(
                assign, seam.query, rebinds.modules, rebinds.classes, bound_before
            )
            if isinstance(rescale, QueryRescale):
                facts.query_rescales.append(rescale)
                continue
            why = f": not a per-position rescale, {rescale}" if rescale else ""
            facts.problems.append(
                f"{facts.name}.forward rebinds {', '.join(sorted(names))} between its cache "
                f"write and its attention call ({code(assign)}), beyond a layout or dtype "
                f"change{why}; the paged seam reads the query as it stands at the cache write"
            )


def _concat_parts(value: cst.BaseExpression) -> tuple[str, str] | None:
    """``(a, b)`` when VALUE is ``torch.cat((a, b), ...)`` of two names, else None."""
    if not m.matches(value, _CAT):
        return None
    first = cst.ensure_type(value, cst.Call).args[0].value
    if not isinstance(first, (cst.Tuple, cst.List)) or len(first.elements) != 2:
        return None
    names = [e.value for e in first.elements]
    if not all(isinstance(n, cst.Name) for n in names):
        return None
    return (cst.ensure_type(names[0], cst.Name).value, cst.ensure_type(names[1], cst.Name).value)


def _query_parts(forward: cst.FunctionDef, seam: SeamFacts) -> tuple[str, str] | None:
    body = cst.ensure_type(forward.body, cst.IndentedBlock).body
    for stmt in body[: seam.kernel_index]:
        for node in m.findall(stmt, m.Assign(targets=[m.AssignTarget(target=m.Name(seam.query))])):
            parts = _concat_parts(cst.ensure_type(node, cst.Assign).value)
            if parts is not None:
                return parts
    return None


def _fused_facts(
    facts: MlaAttentionFacts,
    forward: cst.FunctionDef,
    modules: dict[str, cst.Call],
    classes: dict[str, cst.ClassDef],
) -> FusedWriteFacts | None:
    down = [
        a
        for a, c in modules.items()
        if _is_linear(c) and LATENT_RANK in _positional(c, 1) and ROPE_DIM_KEY in _positional(c, 1)
    ]
    norms = [
        a for a, c in modules.items() if not _is_linear(c) and LATENT_RANK in _positional(c, 0)
    ]
    raw = _assigned_from(forward, down[0]) if len(down) == 1 else None
    tables = _cos_sin(forward)
    norm_cls = classes.get(code(modules[norms[0]].func).split(".")[-1]) if len(norms) == 1 else None
    eps, gain = _norm_attrs(norm_cls)
    missing = [
        what
        for what, ok in (
            (f"the down-projection Linear to {LATENT_RANK} + {ROPE_DIM_KEY}", raw is not None),
            (
                f"one latent norm module over {LATENT_RANK} with a gain parameter and an epsilon",
                eps is not None and gain is not None,
            ),
            ("`cos, sin = ...` rope tables in forward", tables is not None),
        )
        if not ok
    ]
    if missing:
        facts.problems.append(
            f"{facts.name}: the Plan asks for the fused latent write but the source lacks "
            + ", ".join(missing)
        )
        return None
    assert raw is not None and tables is not None and eps is not None and gain is not None
    return FusedWriteFacts(
        raw_latent=raw, norm=norms[0], norm_weight=gain, norm_eps=eps, cos=tables[0], sin=tables[1]
    )


def _assigned_from(forward: cst.FunctionDef, attr: str) -> str | None:
    """``name = self.<attr>(...)`` in forward -> name."""
    call = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(attr)))
    for node in m.findall(forward, m.Assign(targets=[m.AssignTarget(target=m.Name())], value=call)):
        return cst.ensure_type(cst.ensure_type(node, cst.Assign).targets[0].target, cst.Name).value
    return None


def _cos_sin(forward: cst.FunctionDef) -> tuple[str, str] | None:
    """``cos, sin = <expr>`` in forward, else forward parameters named like cos / sin."""
    pattern = m.Assign(
        targets=[
            m.AssignTarget(target=m.Tuple(elements=[m.Element(m.Name()), m.Element(m.Name())]))
        ]
    )
    for node in m.findall(forward, pattern):
        elements = cst.ensure_type(
            cst.ensure_type(node, cst.Assign).targets[0].target, cst.Tuple
        ).elements
        names = [cst.ensure_type(e.value, cst.Name).value for e in elements]
        if "cos" in names[0] and "sin" in names[1]:
            return names[0], names[1]
    params = [p.name.value for p in forward.params.params]
    cos = [p for p in params if "cos" in p]
    sin = [p for p in params if "sin" in p]
    return (cos[0], sin[0]) if len(cos) == 1 and len(sin) == 1 else None


def _norm_attrs(norm_cls: cst.ClassDef | None) -> tuple[str | None, str | None]:
    """(epsilon attribute, gain parameter attribute) of a norm class, e.g. (variance_epsilon,
    weight)."""
    init = _method(norm_cls, "__init__") if norm_cls is not None else None
    if init is None:
        return None, None
    eps = next((a for a in _self_attrs(init) if "eps" in a), None)
    gain = None
    for node in m.findall(init, _SELF_ASSIGN):
        assign = cst.ensure_type(node, cst.Assign)
        if (
            isinstance(assign.value, cst.Call)
            and code(assign.value.func).split(".")[-1] == "Parameter"
        ):
            gain = cst.ensure_type(assign.targets[0].target, cst.Attribute).attr.value
    return eps, gain


def _self_attrs(init: cst.FunctionDef) -> list[str]:
    return [
        cst.ensure_type(cst.ensure_type(n, cst.Assign).targets[0].target, cst.Attribute).attr.value
        for n in m.findall(init, _SELF_ASSIGN)
    ]
