"""What a modeling file is made of, by structure: the one vocabulary analyze, apply and lint share.

Three readers look at modeling code: the analyzer's scan (facts with line numbers for the
Plan), the implementer (the classes its rewrites serve) and lint (mistakes in hand-written
code). They must agree on what a cache write, a fused-attention call or an attention class
is, so each of those is decided here, once:

* :func:`classify_call` names the kind of a call (a KV-cache update, the fused attention, a
  cache-write operator, an attention kernel, a recurrent-state kernel);
* the matchers (``FA_CALL``, ``CACHE_UPDATE_CALL``, ...) are built from the same names;
* :func:`matmul_attention` finds hand-written attention (``matmul`` of query and transposed
  keys, a softmax, ``matmul`` with the values), as transformers 4 eager classes write it;
* :func:`is_attention_class`, :func:`is_converted_attention` and :func:`is_causal_lm_class`
  are the class rules; every rewrite's skip rule is :func:`is_converted_attention`.

A class is recognised by what its methods do, never by its name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from enum import Enum
from functools import lru_cache

import libcst as cst
import libcst.matchers as m
from kvskill.core.fa_keywords import FA_V1, FA_V2

#: the fused-attention operators (v1 and v2) the converted code calls
FA_OPS = (FA_V1, FA_V2)
#: operators that write a cache in place (Legacy BSH rows, paged slots, MLA's fused write;
#: the executor's MLA models write through the ``_v2`` norm-rope-cache and the MLA prolog)
CACHE_WRITE_OPS = (
    "scatter_update_",
    "npu_scatter_nd_update_",
    "npu_kv_rmsnorm_rope_cache",
    "npu_kv_rmsnorm_rope_cache_v2",
    "npu_mla_prolog_v2",
    "npu_mla_prolog_v3",
)
#: callees that run attention in the source model
ATTENTION_KERNELS = (
    "attention_interface",
    "scaled_dot_product_attention",
    "eager_attention_forward",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "_flash_attention_forward",
)
#: callees of recurrent-state layers (gated delta nets, Mamba mixers, causal convolutions)
STATE_KERNELS = (
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "mamba_chunk_scan_combined",
    "selective_scan_fn",
    "selective_state_update",
    "mamba_inner_fn",
)
#: receiver names whose ``.update(key, value, layer_idx, ...)`` is a KV-cache write
CACHE_RECEIVERS = ("cache", "past_key_value", "past_key_values", "layer_past", "kv_cache")


class CallKind(str, Enum):
    """What a call does, as far as the KV cache is concerned."""

    CACHE_UPDATE = "cache_update"
    FA_CALL = "fa_call"
    #: the fused attention over an indexer's top-k (npu_sparse_flash_attention): the read of
    #: a converted DSA attention, or of a Legacy row writer when no cache entries are declared
    SPARSE_FA_CALL = "sparse_fa_call"
    CACHE_WRITE = "scatter_update"
    ATTENTION_CALL = "attention_call"
    STATE_CALL = "linear_attention_call"


def dotted_name(node: cst.BaseExpression) -> str:
    """``a.b.c`` for a name or attribute chain; an attribute of something else (a call, a
    subscript) keeps only its own name (``f().update`` -> ``update``); else ``""``."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted_name(node.value)
        return f"{base}.{node.attr.value}" if base else node.attr.value
    return ""


def is_cache_receiver(receiver: str) -> bool:
    """Whether ``<receiver>.update(...)`` writes a KV cache (``dict.update`` does not)."""
    name = receiver.lower()
    if name in CACHE_RECEIVERS:
        return True
    return ("cache" in name or "past" in name) and not name.endswith(("kwargs", "dict", "config"))


def classify_call(call: cst.Call) -> tuple[CallKind, str, str] | None:
    """(kind, callee, receiver) of a call that matters to the KV cache, else None."""
    dotted = dotted_name(call.func)
    if not dotted:
        return None
    parts = dotted.split(".")
    callee = parts[-1]
    receiver = parts[-2] if len(parts) > 1 else ""
    if callee == "update" and is_cache_receiver(receiver) and len(call.args) >= 3:
        # Cache.update(key_states, value_states, layer_idx, ...): dict.update takes one arg
        return CallKind.CACHE_UPDATE, callee, receiver
    if callee in FA_OPS:
        return CallKind.FA_CALL, callee, receiver
    if callee == SPARSE_FA_OP:
        return CallKind.SPARSE_FA_CALL, callee, receiver
    if callee in CACHE_WRITE_OPS:
        return CallKind.CACHE_WRITE, callee, receiver
    if callee in ATTENTION_KERNELS:
        return CallKind.ATTENTION_CALL, callee, receiver
    if callee in STATE_KERNELS:
        return CallKind.STATE_CALL, callee, receiver
    return None


def _names(*names: str) -> m.BaseMatcherNode:
    matcher: m.BaseMatcherNode = m.Name(names[0])
    for name in names[1:]:
        matcher = matcher | m.Name(name)
    return matcher


def _self_attr_assign(attr: str) -> m.Assign:
    return m.Assign(
        targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name(attr)))]
    )


#: ``<cache>.update(key, value, layer_idx, ...)`` on a cache receiver (``classify_call``'s rule)
CACHE_UPDATE_CALL = m.Call(
    func=m.Attribute(attr=m.Name("update")),
    args=[m.Arg(), m.Arg(), m.Arg(), m.ZeroOrMore()],
) & m.MatchIfTrue(
    lambda call: (found := classify_call(call)) is not None and found[0] is CallKind.CACHE_UPDATE
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
#: ``_flash_attention_forward(q, k, v, mask, q_len, ...)``: transformers 4's flash helper, which
#: takes and returns ``[B, S, N, D]``
FLASH_CALL = m.Call(
    func=m.Name("_flash_attention_forward") | m.Attribute(attr=m.Name("_flash_attention_forward"))
)
#: ``torch.matmul(a, b)`` under any import spelling
MATMUL_CALL = m.Call(func=m.Name("matmul") | m.Attribute(attr=m.Name("matmul")))
#: ``<bias>.baddbmm(q, k)``: scores that start from a bias, over ``[batch * heads, s, d]``
#: (bloom's ALiBi), and their output product ``bmm(w, v)``
BIAS_SCORES_CALL = m.Call(
    func=m.Attribute(value=m.Name(value=m.DoesNotMatch("torch")), attr=m.Name("baddbmm"))
)
BMM_CALL = m.Call(func=m.Name("bmm") | m.Attribute(attr=m.Name("bmm")))
#: ``torch.einsum("<subscripts>", a, b)`` under any import spelling
EINSUM_CALL = m.Call(func=m.Name("einsum") | m.Attribute(attr=m.Name("einsum")))
#: ``softmax(...)`` as a function (``F.softmax``, ``torch.softmax``) or a tensor method
SOFTMAX_CALL = m.Call(func=m.Name("softmax") | m.Attribute(attr=m.Name("softmax")))
#: a call of either fused-attention operator, through any module or alias attribute
FA_CALL = m.Call(func=m.Attribute(attr=_names(*FA_OPS)))
#: the DSA operators read paged caches too: the indexer its keys, the sparse attention the
#: latent and rope caches at the indexer's top-k
#: the fused attention over an indexer's selection (DeepSeek-V3.2's DSA)
SPARSE_FA_OP = "npu_sparse_flash_attention"
#: (and compressed attention's: the window, the compressed entries and the sinks in one softmax)
SPARSE_READ_OPS = (SPARSE_FA_OP, "npu_lightning_indexer", "npu_sparse_attn_sharedkv")
SPARSE_READ_CALL = m.Call(func=m.Attribute(attr=_names(*SPARSE_READ_OPS)))
#: the Legacy read: a request's static rows handed to the model's own attention function
LEGACY_READ_CALL = m.Call(func=m.Name("legacy_attention_inputs"))
#: ``self.cache_entries = ...``: the class declares its paged caches
CACHE_ENTRIES_ASSIGN = _self_attr_assign("cache_entries")
#: ``self.cache_entries = [MambaCacheEntry(...), ...]``: a converted recurrent-state layer
STATE_ENTRIES_ASSIGN = m.Assign(
    targets=[
        m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("cache_entries")))
    ],
    value=m.List(
        elements=[m.Element(value=m.Call(func=m.Name("MambaCacheEntry"))), m.ZeroOrMore()]
    ),
)
#: a call of a cache-write operator, through a module attribute or imported by name
CACHE_WRITE_CALL = m.Call(
    func=m.Attribute(attr=_names(*CACHE_WRITE_OPS)) | _names(*CACHE_WRITE_OPS)
)
#: ``self.<method>(...)``: a call of one of the class's own methods
SELF_METHOD_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name()))
#: ``self.lm_head = ...``: the language-model head, held by the *ForCausalLM class
LM_HEAD_ASSIGN = _self_attr_assign("lm_head")
#: ``self.<head> = nn.Linear(<hidden>, <...vocab...>, ...)``: a head by structure, whatever its
#: name (``output`` in InternLM2, ``output_layer`` in ChatGLM); the vocabulary is named in the
#: out-features argument (``config.vocab_size``, ``config.padded_vocab_size``)
VOCAB_HEAD_ASSIGN = m.Assign(
    targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))],
    value=m.Call(
        func=m.Name("Linear") | m.Attribute(attr=m.Name("Linear")),
        args=[
            m.Arg(),
            m.Arg(value=m.MatchIfTrue(lambda v: "vocab" in dotted_name(v))),
            m.ZeroOrMore(),
        ],
    ),
)


def cache_cat_growth(assign: cst.Assign) -> tuple[str, int] | None:
    """(name, dim) of ``name = torch.cat([<past>, name], dim=<int>)``, else None.

    The tuple-cache write of transformers-4-era vendor files: this step's keys (or values)
    are appended after the past ones along the sequence axis. Concatenating along the last
    axis is a feature split (partial rotary), never a cache.
    """
    if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name):
        return None
    name = assign.targets[0].target.value
    call = assign.value
    if not isinstance(call, cst.Call) or dotted_name(call.func) not in ("torch.cat", "cat"):
        return None
    positional = [a for a in call.args if a.keyword is None]
    if not positional or not isinstance(positional[0].value, (cst.List, cst.Tuple)):
        return None
    elements = positional[0].value.elements
    if len(elements) != 2 or not m.matches(elements[1].value, m.Name(name)):
        return None
    if m.findall(elements[0].value, m.Name(name)):
        return None
    dim_arg = next((a for a in call.args if a.keyword and a.keyword.value == "dim"), None)
    if dim_arg is None and len(positional) > 1:
        dim_arg = positional[1]
    dim = _int_literal(dim_arg.value) if dim_arg is not None else 0
    if dim is None or dim in (-1, 3):
        return None
    return name, dim


def _int_literal(node: cst.BaseExpression) -> int | None:
    if isinstance(node, cst.Integer):
        return int(node.value)
    if (
        isinstance(node, cst.UnaryOperation)
        and isinstance(node.operator, cst.Minus)
        and isinstance(node.expression, cst.Integer)
    ):
        return -int(node.expression.value)
    return None


def cache_cat_growths(node: cst.CSTNode) -> list[tuple[str, int]]:
    """Every ``name = torch.cat([<past>, name], dim=...)`` under NODE: (name, dim), in order."""
    found = []
    for assign in m.findall(node, m.Assign(value=m.Call())):
        growth = cache_cat_growth(cst.ensure_type(assign, cst.Assign))
        if growth is not None:
            found.append(growth)
    return found


#: an assignment growing a tuple cache by concatenation (``_cat_growth``'s rule)
CACHE_CAT_ASSIGN = m.Assign(value=m.Call()) & m.MatchIfTrue(
    lambda node: cache_cat_growth(node) is not None
)
#: a KV-cache write of either shape: ``<cache>.update(k, v, idx)`` or a tuple grown by cat
CACHE_WRITE = m.MatchIfTrue(
    lambda node: m.matches(node, CACHE_UPDATE_CALL) or m.matches(node, CACHE_CAT_ASSIGN)
)


def method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    """The method NAME defined in CLS's own body, or None."""
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
            return stmt
    return None


def class_assigns(cls: cst.ClassDef, matcher: m.BaseMatcherNode) -> bool:
    """True when ``__init__`` of ``cls`` contains an assignment matching ``matcher``."""
    init = method(cls, "__init__")
    return init is not None and bool(m.findall(init, matcher))


def self_module_calls(init: cst.FunctionDef) -> dict[str, cst.Call]:
    """``self.<attr> = <call>(...)`` in ``__init__``, by attribute (the last one wins; both arms
    of ``a if c else b`` count, ``None`` arms do not)."""
    found: dict[str, cst.Call] = {}
    for node in m.findall(
        init, m.Assign(targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))])
    ):
        assign = cst.ensure_type(node, cst.Assign)
        target = cst.ensure_type(assign.targets[0].target, cst.Attribute)
        value = assign.value
        options = (value.body, value.orelse) if isinstance(value, cst.IfExp) else (value,)
        for call in options:
            if isinstance(call, cst.Call):
                found[target.attr.value] = call
    return found


def assigned_value(stmt: cst.BaseStatement) -> tuple[str, cst.BaseExpression] | None:
    """(target name, value) of a one-statement line ``name = <expr>``, else None."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    assign = stmt.body[0]
    if not isinstance(assign, cst.Assign) or len(assign.targets) != 1:
        return None
    target = assign.targets[0].target
    return (target.value, assign.value) if isinstance(target, cst.Name) else None


def scores_matmul(value: cst.BaseExpression) -> cst.Call | None:
    """The ``matmul(query, key.transpose(...))`` a score assignment computes, optionally
    multiplied or divided by a scale, or its ``<bias>.baddbmm(query, key)``; else None."""
    if m.matches(value, BIAS_SCORES_CALL):
        return cst.ensure_type(value, cst.Call)
    if isinstance(value, cst.BinaryOperation) and isinstance(
        value.operator, (cst.Multiply, cst.Divide)
    ):
        value = value.left
    if not m.matches(value, MATMUL_CALL):
        return None
    call = cst.ensure_type(value, cst.Call)
    if len(call.args) != 2:
        return None
    key = call.args[1].value
    transposed = m.Call(func=m.Attribute(attr=m.Name("transpose"))) | m.Attribute(attr=m.Name("mT"))
    return call if m.matches(key, transposed) else None


def matmul_attention(body: cst.BaseSuite) -> tuple[int, int] | None:
    """(scores index, output index) of hand-written attention among the top-level statements
    of BODY: ``w = matmul(q, k.transpose(...)) [* or / scale]``, then a statement with a
    softmax, then ``o = matmul(w, v)`` (or ``w = bias.baddbmm(q, k)`` ... ``o = bmm(w, v)``);
    else None."""
    stmts = list(body.body) if isinstance(body, cst.IndentedBlock) else []
    for first, stmt in enumerate(stmts):
        assigned = assigned_value(stmt)
        if assigned is None or scores_matmul(assigned[1]) is None:
            continue
        output = BMM_CALL if m.matches(assigned[1], BIAS_SCORES_CALL) else MATMUL_CALL
        softmax = False
        for index in range(first + 1, len(stmts)):
            softmax = softmax or bool(m.findall(stmts[index], SOFTMAX_CALL))
            found = assigned_value(stmts[index])
            if softmax and found is not None and m.matches(found[1], output):
                return first, index
    return None


def einsum_scores(value: cst.BaseExpression) -> cst.Call | None:
    """The ``einsum("<q>,<k>-><w>", query, key)`` a score assignment computes, optionally
    multiplied or divided by a scale; else None. Its subscripts are read where it is
    converted (``implementer/einsum_attention.py``), which refuses what it cannot prove."""
    if isinstance(value, cst.BinaryOperation) and isinstance(
        value.operator, (cst.Multiply, cst.Divide)
    ):
        value = value.left
    if not m.matches(value, EINSUM_CALL):
        return None
    call = cst.ensure_type(value, cst.Call)
    return call if len(call.args) == 3 else None


def chain_start(value: cst.BaseExpression) -> cst.BaseExpression:
    """The innermost receiver of a method chain: ``torch.bmm(p, v)`` of ``torch.bmm(p,
    v).view(b, h, s, -1).contiguous()``."""
    while (
        isinstance(value, cst.Call)
        and isinstance(value.func, cst.Attribute)
        and isinstance(value.func.value, cst.Call)
    ):
        value = value.func.value
    return value


def einsum_attention(body: cst.BaseSuite) -> tuple[int, int] | None:
    """(scores index, output index) of attention computed by hand with ``torch.einsum``
    among the top-level statements of BODY: ``w = einsum("...", q, k) [* or / scale]``, then
    a statement with a softmax, then ``o = einsum("...", w, v)`` or ``o = bmm(w', v')``, maybe
    re-laid out in the same statement (``.view(b, h, s, -1)``); else None (ChatGLM-style
    files, ``[s, b, h, d]`` operands)."""
    stmts = list(body.body) if isinstance(body, cst.IndentedBlock) else []
    for first, stmt in enumerate(stmts):
        assigned = assigned_value(stmt)
        if assigned is None or einsum_scores(assigned[1]) is None:
            continue
        softmax = False
        for index in range(first + 1, len(stmts)):
            softmax = softmax or bool(m.findall(stmts[index], SOFTMAX_CALL))
            found = assigned_value(stmts[index])
            if (
                softmax
                and found is not None
                and m.matches(chain_start(found[1]), EINSUM_CALL | BMM_CALL)
            ):
                return first, index
    return None


def attention_methods(cls: cst.ClassDef) -> dict[str, cst.FunctionDef]:
    """CLS's own methods (not ``forward``) that compute attention by hand,
    :func:`matmul_attention` (GPT-2's and Qwen-7B's ``self._attn(query, key, value, mask)``)."""
    return {
        stmt.name.value: stmt
        for stmt in cls.body.body
        if isinstance(stmt, cst.FunctionDef)
        and stmt.name.value not in ("forward", "__init__")
        and matmul_attention(stmt.body) is not None
    }


def attention_method_call(names: Collection[str]) -> m.BaseMatcherNode:
    """``self.<name>(query, key, value, ...)`` of one of NAMES (:func:`attention_methods`)."""
    return m.Call(
        func=m.Attribute(
            value=m.Name("self"), attr=m.Name() & m.MatchIfTrue(lambda n: n.value in names)
        ),
        args=[m.Arg(), m.Arg(), m.Arg(), m.ZeroOrMore()],
    )


def attention_submodules(cls: cst.ClassDef) -> dict[str, str]:
    """``{attr: class name}`` of the modules CLS's ``__init__`` builds (``self.<attr> =
    <Class>(...)``) that its forward hands three or more positional arguments after its first
    cache write: where ChatGLM2/3 run attention (``self.core_attention(query_layer, key_layer,
    value_layer, attention_mask)``). Whether the module's class runs a kernel the seam reads
    is the implementer's to judge (``implementer/callee.py``); a module called before the
    write (a rotary table taking query and key) is never one."""
    init, forward = method(cls, "__init__"), method(cls, "forward")
    if init is None or forward is None:
        return {}
    built = {}
    for node in m.findall(init, m.Assign(value=m.Call(func=m.Name()))):
        assign = cst.ensure_type(node, cst.Assign)
        target = assign.targets[0].target
        if len(assign.targets) == 1 and m.matches(target, m.Attribute(value=m.Name("self"))):
            attr = cst.ensure_type(target, cst.Attribute).attr.value
            built[attr] = cst.ensure_type(
                cst.ensure_type(assign.value, cst.Call).func, cst.Name
            ).value
    body = forward.body.body if isinstance(forward.body, cst.IndentedBlock) else []
    first = next((i for i, stmt in enumerate(body) if m.findall(stmt, CACHE_WRITE)), None)
    if first is None:
        return {}
    called = {}
    for stmt in body[first + 1 :]:
        for node in m.findall(stmt, SELF_METHOD_CALL):
            call = cst.ensure_type(node, cst.Call)
            attr = cst.ensure_type(call.func, cst.Attribute).attr.value
            positional = [a for a in call.args if a.keyword is None and not a.star]
            if attr in built and len(positional) >= 3:
                called[attr] = built[attr]
    return called


@lru_cache(maxsize=8)
def parsed_module(source: str) -> cst.Module:
    """SOURCE parsed by libcst, once per text: the analysis and the conversion of one file
    then read the same (immutable) nodes, so what :func:`once_per_node` learnt of a class
    while analysing holds while converting. Raises ``cst.ParserSyntaxError``."""
    return cst.parse_module(source)


def once_per_node(func: Callable[[cst.ClassDef], bool]) -> Callable[[cst.ClassDef], bool]:
    """FUNC, computed once per class node. libcst nodes are immutable and hash by identity,
    and the rewrites of one conversion hand each other the classes they leave untouched, so
    the many questions a conversion asks of one class (is it an attention, a state mixer,
    already converted?) each walk it once."""
    return lru_cache(maxsize=256)(func)


@once_per_node
def is_attention_class(cls: cst.ClassDef) -> bool:
    """A class whose forward writes a KV cache and calls an attention kernel (or computes
    attention by hand, :func:`matmul_attention`, or calls the fused attention), or one already
    converted (it declares ``cache_entries`` of per-token caches, not recurrent states)."""
    if class_assigns(cls, CACHE_ENTRIES_ASSIGN):
        return not class_assigns(cls, STATE_ENTRIES_ASSIGN)
    forward = method(cls, "forward")
    if forward is None:
        return False
    has_update = bool(m.findall(forward, CACHE_WRITE))
    # NOTE: the fused attention counts as a kernel too, so a forward that writes a cache and
    # attends only through an NPU branch is an attention class, converted or refused by name
    has_kernel = bool(m.findall(forward, INTERFACE_CALL | SDPA_CALL | FLASH_CALL | FA_CALL))
    if not has_kernel and has_update:
        has_kernel = bool(m.findall(forward, attention_method_call(attention_methods(cls))))
    # NOTE: a forward that hands its grown cache to a module of its own (ChatGLM's
    # core_attention) is an attention class too: converted or refused naming that module
    has_kernel = has_kernel or (has_update and bool(attention_submodules(cls)))
    return has_update and (
        has_kernel
        or matmul_attention(forward.body) is not None
        or einsum_attention(forward.body) is not None
    )


#: module classes by name, to resolve methods a class inherits from a class of the same file
ClassTable = Mapping[str, cst.ClassDef]


def class_chain(cls: cst.ClassDef, classes: ClassTable | None = None) -> list[cst.ClassDef]:
    """CLS, then the base classes defined in the same file (depth first, as far as CLASSES
    holds them); without CLASSES, CLS alone."""
    chain = [cls]
    for entry in chain:  # NOTE: grows while iterated: a breadth of bases, each once
        for base in entry.bases:
            name = dotted_name(base.value).split(".")[-1]
            found = classes.get(name) if classes else None
            if found is not None and all(found is not seen for seen in chain):
                chain.append(found)
    return chain


def resolve_method(
    cls: cst.ClassDef, name: str, classes: ClassTable | None = None
) -> cst.FunctionDef | None:
    """The method NAME of CLS, or the one it inherits from a class of the same file."""
    for entry in class_chain(cls, classes):
        found = method(entry, name)
        if found is not None:
            return found
    return None


def super_call(name: str) -> m.Call:
    """``super().<name>(...)`` (also ``super(Cls, self).<name>(...)``)."""
    return m.Call(func=m.Attribute(value=m.Call(func=m.Name("super")), attr=m.Name(name)))


def method_chain(
    cls: cst.ClassDef, name: str, classes: ClassTable | None = None
) -> list[cst.FunctionDef]:
    """The NAME methods a call on CLS may run: the one it resolves to, then, while each calls
    ``super().NAME(...)``, the next one up the chain of same-file bases (transformers 4's
    ``XFlashAttention2.__init__`` calls ``super().__init__``; ``XSdpaAttention.forward`` falls
    back to ``super().forward``)."""
    found: list[cst.FunctionDef] = []
    for entry in class_chain(cls, classes):
        func = method(entry, name)
        if func is None:
            continue
        found.append(func)
        if not m.findall(func, super_call(name)):
            break
    return found


def declares_token_caches(cls: cst.ClassDef, classes: ClassTable | None = None) -> bool:
    """The ``__init__`` CLS runs (with those it reaches through ``super().__init__``)
    declares ``cache_entries`` of per-token caches (K/V, latent), not of the recurrent states
    a gated delta net or Mamba mixer keeps."""
    inits = method_chain(cls, "__init__", classes)
    if not any(m.findall(init, CACHE_ENTRIES_ASSIGN) for init in inits):
        return False
    return not any(m.findall(init, STATE_ENTRIES_ASSIGN) for init in inits)


def self_method_name(call: cst.Call) -> str | None:
    """``name`` of a ``self.name(...)`` call, else None."""
    if m.matches(call, SELF_METHOD_CALL):
        return cst.ensure_type(call.func, cst.Attribute).attr.value
    return None


def class_methods(
    cls: cst.ClassDef, classes: ClassTable | None = None
) -> dict[str, cst.FunctionDef]:
    """Every method CLS has, its own or inherited from a class of the same file."""
    found: dict[str, cst.FunctionDef] = {}
    for entry in class_chain(cls, classes):
        for stmt in entry.body.body:
            if isinstance(stmt, cst.FunctionDef):
                found.setdefault(stmt.name.value, stmt)
    return found


def cache_writer_methods(cls: cst.ClassDef, classes: ClassTable | None = None) -> frozenset[str]:
    """Methods of CLS that call a cache-write operator, directly or through another such
    method (the generated ``update_cache`` and ``update_latent_cache`` helpers)."""
    methods = class_methods(cls, classes)
    called = {
        name: {self_method_name(c) for c in m.findall(func, SELF_METHOD_CALL)}
        for name, func in methods.items()
    }
    writers = {name for name, func in methods.items() if m.findall(func, CACHE_WRITE_CALL)}
    grown = True
    while grown:  # NOTE: a fixpoint, so helpers that call helpers count too
        more = {name for name in methods if called[name] & writers} - writers
        writers |= more
        grown = bool(more)
    return frozenset(writers)


def calls_cache_write(func: cst.CSTNode, writers: frozenset[str]) -> bool:
    """FUNC calls a cache-write operator, or one of the class's WRITERS methods."""
    if m.findall(func, CACHE_WRITE_CALL):
        return True
    return any(self_method_name(c) in writers for c in m.findall(func, SELF_METHOD_CALL))


def is_converted_attention(cls: cst.ClassDef, classes: ClassTable | None = None) -> bool:
    """Already converted: the class declares per-token ``cache_entries`` AND its forward
    writes a cache with a cache-write operator (directly or through a helper method) AND
    calls the fused attention (or, Legacy, hands its rows to the model's own attention). One of these alone (entries declared but never written, or
    a fused-attention call on a dense cache) is not a conversion.

    CLASSES (the file's classes by name) resolves what CLS inherits from a class of the
    same file; without it only CLS's own methods count.
    """
    if classes is None:
        return _is_converted_on_its_own(cls)
    return _is_converted(cls, classes)


@once_per_node
def _is_converted_on_its_own(cls: cst.ClassDef) -> bool:
    return _is_converted(cls, None)


def _is_converted(cls: cst.ClassDef, classes: ClassTable | None) -> bool:
    forward = resolve_method(cls, "forward", classes)
    if forward is None or not declares_token_caches(cls, classes):
        return False
    writers = cache_writer_methods(cls, classes)
    reads = m.findall(forward, FA_CALL | SPARSE_READ_CALL | LEGACY_READ_CALL)
    return calls_cache_write(forward, writers) and bool(reads)


#: ``self.cache_unit = ...``: the framework's Legacy attention sizes its cache rows by it
CACHE_UNIT_ASSIGN = _self_attr_assign("cache_unit")
#: the Legacy row write, ``torch_npu.scatter_update_(cache, kv_len, states, -2)``
LEGACY_ROW_WRITE = m.Call(func=m.Attribute(attr=m.Name("scatter_update_")))


def is_framework_legacy_attention(cls: cst.ClassDef) -> bool:
    """The Ascend framework's own Legacy attention (cann-recipes-infer, ``fbc225d``): its
    ``__init__`` sizes the cache rows with ``self.cache_unit``, its ``forward`` writes them
    with ``scatter_update_`` and attends with the fused operator. It declares no
    ``cache_entries``: the worker allocates its rows (``init_cache`` or ``cache_unit``)."""
    forward = method(cls, "forward")
    return (
        forward is not None
        and class_assigns(cls, CACHE_UNIT_ASSIGN)
        and not class_assigns(cls, CACHE_ENTRIES_ASSIGN)
        and bool(m.findall(forward, LEGACY_ROW_WRITE))
        and bool(m.findall(forward, FA_CALL))
    )


#: what a framework Legacy ``init_cache`` assigns onto a layer it walks:
#: ``layer.linear_attn.conv_state = torch.zeros((batch_size, ...), ...)``
WORKER_ALLOCATION = m.Assign(
    targets=[m.AssignTarget(target=m.Attribute(value=m.Attribute() | m.Name()))],
    value=m.Call(func=m.Attribute(value=m.Name("torch"))),
)


def is_framework_legacy_state_layer(cls: cst.ClassDef, state_attrs: frozenset[str]) -> bool:
    """A layer of the framework's Legacy path holding per-request states (Qwen3.5's gated
    delta net): its ``__init__`` sets every one of STATE_ATTRS to ``None`` for the worker's
    ``init_cache`` to fill with ``[batch, ...]`` rows, and it declares no ``cache_entries``."""
    if not state_attrs or class_assigns(cls, CACHE_ENTRIES_ASSIGN):
        return False
    init = method(cls, "__init__")
    if init is None:
        return False
    unset = {
        attr
        for attr in state_attrs
        if m.findall(
            init,
            m.Assign(
                targets=[
                    m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name(attr)))
                ],
                value=m.Name("None"),
            ),
        )
    }
    return unset == set(state_attrs)


def is_standalone_legacy_attention(cls: cst.ClassDef) -> bool:
    """The Legacy attention of the framework's standalone models (cann-recipes-infer's
    ``models/pangu_7b`` at ``fbc225d``): one of its methods writes rows with
    ``scatter_update_`` and attends with the fused operator, over caches the model's
    ``init_cache`` allocated and the runner hands back as ``past_key_value``. It sizes no
    ``cache_unit`` (that is the executor's kind, :func:`is_framework_legacy_attention`) and
    declares no ``cache_entries``."""
    if class_assigns(cls, CACHE_UNIT_ASSIGN) or class_assigns(cls, CACHE_ENTRIES_ASSIGN):
        return False
    return any(
        m.findall(func, LEGACY_ROW_WRITE) and m.findall(func, FA_CALL)
        for func in cls.body.body
        if isinstance(func, cst.FunctionDef)
    )


#: a fused attention call given the MLA rope parts (``query_rope=`` / ``key_rope=``)
MLA_FA_CALL = m.Call(
    func=m.Attribute(attr=_names(*FA_OPS)),
    args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("query_rope")), m.ZeroOrMore()],
)


def is_standalone_legacy_mla_attention(cls: cst.ClassDef) -> bool:
    """A standalone Legacy attention (:func:`is_standalone_legacy_attention`) over MLA
    caches: the method that writes its rows with ``scatter_update_`` passes the fused
    attention the rope parts apart (``query_rope`` / ``key_rope``), as GLM-5.2's latent
    (nope) and rope caches are read."""
    return is_standalone_legacy_attention(cls) and any(
        m.findall(func, LEGACY_ROW_WRITE) and m.findall(func, MLA_FA_CALL)
        for func in cls.body.body
        if isinstance(func, cst.FunctionDef)
    )


def is_causal_lm_class(cls: cst.ClassDef) -> bool:
    """The class holding the language-model head as ``self.lm_head`` (the ``*ForCausalLM``)."""
    return class_assigns(cls, LM_HEAD_ASSIGN)


def causal_lm_classes(module: cst.Module, architecture: str | None = None) -> list[str]:
    """Names of the classes that hold the language-model head, by structure.

    The classes assigning ``self.lm_head``; failing that, the class the config names
    (``auto_map``'s ``AutoModelForCausalLM``, then ``architectures``) when it is in the file,
    since vendors may keep the head in an inner module (ChatGLM's ``transformer.output_layer``);
    failing that, the classes assigning a Linear to the vocabulary under another name
    (InternLM2's ``self.output``).
    """
    classes = [c for c in module.body if isinstance(c, cst.ClassDef)]
    named = [c.name.value for c in classes if is_causal_lm_class(c)]
    if named:
        return named
    if architecture is not None and any(c.name.value == architecture for c in classes):
        return [architecture]
    return [c.name.value for c in classes if class_assigns(c, VOCAB_HEAD_ASSIGN)]
