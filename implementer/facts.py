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
    BIAS_SCORES_CALL,
    CACHE_CAT_ASSIGN,
    CACHE_ENTRIES_ASSIGN,
    CACHE_UPDATE_CALL,
    FA_CALL,
    FLASH_CALL,
    INTERFACE_CALL,
    LM_HEAD_ASSIGN,
    SDPA_CALL,
    SOFTMAX_CALL,
    STATE_ENTRIES_ASSIGN,
    attention_method_call,
    cache_cat_growths,
    causal_lm_classes,
    class_assigns,
    declares_token_caches,
    einsum_attention,
    einsum_scores,
    is_attention_class,
    is_causal_lm_class,
    is_converted_attention,
    matmul_attention,
    scores_matmul,
)
from kvskill.analyzer.gather import method as _method
from kvskill.implementer.npu_branch import inline_npu_branches, npu_note
from kvskill.implementer.tail_rotary import tail_rotary_problem

_EMPTY = cst.Module(body=[])


class KernelStyle(str, Enum):
    """How the source calls attention; decides the layout the seam hands back."""

    #: ``fn(self, q, k, v, mask, ...)`` returning ``[B, S, N, D]``
    INTERFACE = "interface"
    #: ``scaled_dot_product_attention(q, k, v, ...)`` returning ``[B, N, S, D]``
    SDPA = "sdpa"
    #: hand-written ``matmul(q, k^T) * scale`` -> softmax -> ``matmul(w, v)``, ``[B, N, S, D]``
    MATMUL = "matmul"
    #: transformers 4's ``_flash_attention_forward(q, k, v, ...)`` returning ``[B, S, N, D]``
    FLASH = "flash"
    #: hand-written ``bias.baddbmm(q, k)`` -> softmax -> ``bmm(w, v)`` over ``[B * N, S, D]``,
    #: the batch folded into the heads (bloom's ALiBi); only Legacy keeps it
    BIAS_BMM = "bias_bmm"
    #: ``self._attn(q, k, v, mask)``: a method of the class running MATMUL attention
    #: (``implementer/callee.py``); its output ``[B, N, S, D]``, then the method's own tail
    METHOD = "method"
    #: ``self.core_attention(q, k, v, mask)``: a module of the file running SDPA or MATMUL
    #: attention (``implementer/callee.py``); its output ``[B, N, S, D]``, then the module's
    #: own tail (ChatGLM: back to ``[s, b, h * d]``)
    SUBMODULE = "submodule"
    #: hand-written ``torch.einsum`` scores -> softmax -> ``einsum``/``bmm`` output
    #: (``implementer/einsum_attention.py``); the fused output ``[B, S, N, D]`` is then
    #: permuted to the order the source's subscripts and reshapes give (SeamFacts.after)
    EINSUM = "einsum"


#: the styles whose kernel returns ``[B, N, S, D]`` (the others return ``[B, S, N, D]``)
BNSD_STYLES = frozenset(
    {KernelStyle.SDPA, KernelStyle.MATMUL, KernelStyle.METHOD, KernelStyle.SUBMODULE}
)


class CacheLayout(str, Enum):
    """Axis order of the keys and values where the source writes its cache; decides how the
    seam flattens query, key and value to TND ([T, N, D]) with the batch of one."""

    #: ``[b, h, s, d]``: transformers' cache and the tuple caches grown along dim 2
    BHSD = "bhsd"
    #: ``[b, s, h, d]``: tuple caches grown along dim 1 (Qwen-7B style)
    BSHD = "bshd"
    #: ``[s, b, h, d]``: tuple caches grown along dim 0 (ChatGLM style)
    SBHD = "sbhd"


#: the sequence axis of a 4-d tensor -> its layout
_LAYOUT_OF_SEQ_DIM = {2: CacheLayout.BHSD, 1: CacheLayout.BSHD, 0: CacheLayout.SBHD}


@dataclass(frozen=True, kw_only=True)
class CacheWriteFacts:
    """Where the forward writes its KV cache: the top-level statement, this step's key and
    value (the names the write consumes) and the layout they have there."""

    index: int
    key: str
    value: str
    layout: CacheLayout
    #: "update" (``<cache>.update(k, v, idx)``) or "cat" (a tuple grown with ``torch.cat``)
    kind: str
    #: the forward parameter the write indexes the cache by (``cache.update(k, v,
    #: layer_idx)``), when the layer is told its index at each call rather than holding it:
    #: zamba's attention block, shared by several decoder layers
    site: str | None = None


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
    #: axis order of query/key/value where the seam starts
    layout: CacheLayout = CacheLayout.BHSD
    #: names the seam defines that later code reads but that only carry the source's own
    #: cache (``present = (k, v) if use_cache else None``): None in the converted forward
    nulled: list[str] = field(default_factory=list)
    #: the bias tensor ``bias.baddbmm(q, k)`` scores start from (KernelStyle.BIAS_BMM)
    bias: str | None = None
    #: the forward parameter naming the calling layer (CacheWriteFacts.site): the caches are
    #: one pair per call site, chosen by it
    site: str | None = None
    #: what a callee kernel (METHOD, SUBMODULE) does to its output before returning it, in
    #: the forward's names: run right after the seam (``implementer/callee.py``)
    after: tuple[cst.BaseStatement, ...] = ()


@dataclass(kw_only=True)
class AttentionFacts:
    """One attention class."""

    name: str
    converted: bool
    config_param: str | None = None
    layer_idx_param: str | None = None
    seam: SeamFacts | None = None
    problems: list[str] = field(default_factory=list)
    #: what the forward does to its attention scores that the fused operator has no input
    #: for (soft-capping, a rescale, a position bias such as ALiBi): problems for the paths
    #: that replace the kernel with the fused operator, not for Legacy, which keeps the
    #: model's own math
    fused_limits: list[str] = field(default_factory=list)
    #: the first lines of the seam's statements that rebind the query beyond a relayout or
    #: cast: a limit of the paged seam, which reads the query as it stands at the cache write
    #: (:meth:`seam_limits`); the MLA rewrite builds its query itself and checks its own
    query_changes: list[str] = field(default_factory=list)
    #: names the seam defines and the code after the kernel reads (a limit in
    #: ``fused_limits``, unless a rewrite keeps the statement that defines them)
    seam_leaks: list[str] = field(default_factory=list)
    #: stores into objects that outlive the seam (``seam_store_limit`` each)
    seam_stores: list[SeamStore] = field(default_factory=list)

    def seam_limits(self) -> list[str]:
        """What the paged seam replacing the kernel cannot keep: ``fused_limits``, and the
        query changed between the cache write and the kernel."""
        if not self.query_changes:
            return list(self.fused_limits)
        return [*self.fused_limits, query_change_limit(self.name, self.query_changes)]


def _params(func: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in func.params.params]


#: ``super().__init__(...)`` (also ``super(Cls, self).__init__(...)``)
SUPER_INIT = m.Call(func=m.Attribute(value=m.Call(func=m.Name("super")), attr=m.Name("__init__")))


def module_classes(module: cst.Module) -> dict[str, cst.ClassDef]:
    """The top-level classes of MODULE by name (what a class's in-file bases are looked up in)."""
    return {c.name.value: c for c in module.body if isinstance(c, cst.ClassDef)}


def _file_base(cls: cst.ClassDef, classes: dict[str, cst.ClassDef]) -> cst.ClassDef | None:
    """CLS's first base when it is a class of the same file, else None."""
    for base in cls.bases:
        if isinstance(base.value, cst.Name) and base.value.value in classes:
            return classes[base.value.value]
    return None


def init_owner(cls: cst.ClassDef, classes: dict[str, cst.ClassDef]) -> cst.ClassDef | None:
    """The class whose ``__init__`` declares CLS's caches; None when CLS has no ``__init__`` of
    its own or from an attention class of the file.

    transformers 4 attention families share one ``__init__``: ``XSdpaAttention(XAttention)``
    overrides only ``forward``, ``XFlashAttention2(XAttention)`` has an ``__init__`` that calls
    ``super().__init__``. Their caches are declared once, in ``XAttention.__init__``; every
    variant's forward still gets its own seam.
    """
    seen: set[str] = set()
    while cls.name.value not in seen:
        seen.add(cls.name.value)
        init = _method(cls, "__init__")
        base = _file_base(cls, classes)
        if base is None or not is_attention_class(base):
            return cls if init is not None else None
        if init is not None and not m.findall(init, SUPER_INIT):
            return cls
        cls = base
    return None


def attention_facts(
    cls: cst.ClassDef, classes: dict[str, cst.ClassDef] | None = None
) -> AttentionFacts:
    """Gather what the attention codemods need; ``problems`` lists what blocks a rewrite.

    CLASSES (the file's classes, :func:`module_classes`) lets a variant of an attention family
    take its ``__init__`` facts from the base that owns them (:func:`init_owner`).
    """
    owner = init_owner(cls, classes or {})
    # converted only when the entries are declared AND every forward path writes and reads
    # them (gather.is_converted_attention); declared alone is a half conversion
    facts = AttentionFacts(name=cls.name.value, converted=is_converted_attention(cls, classes))
    if owner is None:
        outside = [
            code(b.value)
            for b in cls.bases
            if code(b.value) not in (*(classes or {}), "nn.Module", "torch.nn.Module", "Module")
        ]
        facts.problems.append(
            f"{facts.name} has no __init__"
            + (
                f" (it inherits {outside[0]}'s, defined outside the file: give it one that "
                "calls super().__init__(...) so the rewrite can declare its caches there)"
                if outside
                else ""
            )
        )
        return facts
    init = _method(owner, "__init__")
    assert init is not None, "init_owner returns a class with an __init__"
    params = _params(init)[1:]
    facts.config_param = "config" if "config" in params else (params[0] if params else None)
    facts.layer_idx_param = next((p for p in params if "layer_idx" in p), None)
    if facts.config_param is None:
        facts.problems.append(f"{owner.name.value}.__init__ takes no config")
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
            # NOTE: imported here: callee.py reads a callee's kernel with this module's readers
            from kvskill.implementer.callee import class_callees

            facts.seam = _seam_facts(facts, inlined.forward, class_callees(cls, classes or {}))
        if facts.seam is not None:
            tail = tail_rotary_problem(facts.name, inlined.forward, facts.seam.update_index)
            if tail is not None:
                facts.problems.append(tail)
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


def _call_site_argument(update: cst.Call, forward_params: list[str]) -> str | None:
    """The cache index of ``<cache>.update(key, value, <index>, ...)`` when it is one of the
    forward's own parameters (the caller says which layer it is), else None."""
    index = update.args[2].value if len(update.args) > 2 and not update.args[2].keyword else None
    if index is None:
        index = next(
            (
                a.value
                for a in update.args
                if a.keyword is not None and a.keyword.value == "layer_idx"
            ),
            None,
        )
    if isinstance(index, cst.Name) and index.value in forward_params:
        return index.value
    return None


def cache_write_facts(
    facts: AttentionFacts, body: cst.IndentedBlock, forward_params: list[str]
) -> CacheWriteFacts | None:
    """The forward's cache write: ``<cache>.update(key, value, layer_idx, ...)`` (``[b, h, s,
    d]``), else a tuple cache grown in one statement by ``key = torch.cat([<past>, key],
    dim=d)`` and the same for value, whose ``d`` is the sequence axis and so the layout.
    None when there is none; a problem when the concatenation cannot be read as a KV write."""
    update_index = _top_index(body, CACHE_UPDATE_CALL)
    cat_index = _top_index(body, CACHE_CAT_ASSIGN)
    if update_index is not None and (cat_index is None or update_index <= cat_index):
        update = cst.ensure_type(m.findall(body.body[update_index], CACHE_UPDATE_CALL)[0], cst.Call)
        return CacheWriteFacts(
            index=update_index,
            key=code(update.args[0].value),
            value=code(update.args[1].value),
            layout=CacheLayout.BHSD,
            kind="update",
            site=_call_site_argument(update, forward_params),
        )
    if cat_index is None:
        return None
    growths = cache_cat_growths(body.body[cat_index])
    names = [name for name, _ in growths]
    dims = {dim + 4 if dim < 0 else dim for _, dim in growths}
    if len(growths) != 2 or len(set(names)) != 2 or len(dims) != 1:
        facts.problems.append(
            f"{facts.name}.forward grows its cache with torch.cat, but not as one key and one "
            f"value along the same axis ({', '.join(names)})"
        )
        return None
    layout = _LAYOUT_OF_SEQ_DIM.get(dims.pop())
    if layout is None:
        facts.problems.append(
            f"{facts.name}.forward concatenates its cache along dim {growths[0][1]}, which is "
            "not the sequence axis of a [b, h, s, d], [b, s, h, d] or [s, b, h, d] layout"
        )
        return None
    return CacheWriteFacts(index=cat_index, key=names[0], value=names[1], layout=layout, kind="cat")


def _seam_facts(facts: AttentionFacts, forward: cst.FunctionDef, methods: dict) -> SeamFacts | None:
    """METHODS: the class's callees that may run its attention (``callee.class_callees``: its
    matmul-attention methods, the modules it hands its grown cache to), by attribute."""
    body = cst.ensure_type(forward.body, cst.IndentedBlock)
    write = cache_write_facts(facts, body, _params(forward)[1:])
    position = _kernel_position(body, methods)
    if write is None or position is None or position[0] < write.index:
        if write is not None or not facts.problems:
            facts.problems.append(
                f"{facts.name}.forward does not write the cache before calling attention"
            )
        return None
    kernel = _kernel_facts(facts, body, *position, methods, write)
    if kernel is None:
        return None
    if kernel.inputs is not None and kernel.inputs != (write.key, write.value):
        # the fused operator reads the paged cache: the method must attend over what the
        # cache write holds, not something derived from it
        facts.problems.append(
            f"{facts.name}.forward hands its attention method {', '.join(kernel.inputs)}, not "
            f"the keys and values its cache write holds ({write.key}, {write.value})"
        )
        return None
    query = kernel.query
    if write.kind == "cat":
        # the seam is replaced wholesale, so the query it reads is the name as it stood
        # before the seam (vendors permute it to the kernel's layout inside the seam)
        inside = list(body.body[write.index : kernel.index])
        query = _name_before(cst.parse_expression(kernel.query), inside)
    seam = SeamFacts(
        update_index=write.index,
        kernel_index=kernel.index,
        style=kernel.style,
        query=query,
        key=write.key,
        value=write.value,
        scale=kernel.scale,
        sinks=kernel.sinks,
        targets=kernel.targets,
        bias=kernel.bias,
        site=write.site,
        layout=write.layout,
        after=kernel.after,
        nulled=(
            _cache_only_names(body, write.index, kernel.index, {write.key, write.value})
            if write.kind == "cat"
            else []
        ),
    )
    _check_seam_names(facts, body, seam)
    _check_tail_names(facts, forward, seam)
    return seam


def _query_changes(seam: SeamFacts, inside: list[cst.BaseStatement]) -> list[str]:
    """The first lines of the statements inside the seam that rebind the query other than by
    a relayout or cast (Qwen-7B's ``query = query * logn_tensor``). The seam replaces these
    statements and takes the query as it stood before them, so each one would be dropped."""
    from kvskill.implementer.callee import RESHAPES, first_line, rebinds_by_relayout

    names = {seam.query}
    changes = []
    for stmt in inside:
        # every assignment to the query, also inside an if (an autocast cast before a kernel)
        for node in m.findall(stmt, m.Assign()):
            assign = cst.ensure_type(node, cst.Assign)
            assigned = _assigned_names([cst.SimpleStatementLine([assign])])
            if not assigned & names:
                continue
            moves = rebinds_by_relayout(cst.SimpleStatementLine([assign]), RESHAPES) or {}
            if any(moves.get(target) not in names for target in assigned & names):
                changes.append(first_line(stmt))
                break
            names |= {target for target, source in moves.items() if source in names}
    return changes


def query_change_limit(name: str, changes: list[str]) -> str:
    """The fused limit of a query rebuilt between the cache write and attention."""
    return (
        f"{name}.forward changes its query between the cache write and attention "
        f"(`{changes[0]}`), beyond a relayout or cast; the seam reads the query before it, "
        "so converting would drop that change"
    )


def _check_tail_names(facts: AttentionFacts, forward: cst.FunctionDef, seam: SeamFacts) -> None:
    """A callee's tail runs in the forward after the seam: the locals it assigns besides the
    output must be names the forward does not use, or the inlined code would change them."""
    own = _assigned_names(list(seam.after)) - set(seam.targets)
    clash = sorted(own & _used_names([forward]))
    if clash:
        facts.problems.append(
            f"{facts.name}.forward already uses {clash}, which the attention it calls assigns "
            "after its kernel; the seam runs those statements in the forward"
        )


@dataclass(frozen=True, kw_only=True)
class _Kernel:
    """How the forward runs attention (the end of the seam)."""

    #: the statement that computes the attention output (the seam's last statement)
    index: int
    style: KernelStyle
    query: str
    scale: str | None
    sinks: str | None
    targets: list[str]
    bias: str | None = None
    #: the key and value a callee kernel is handed (METHOD, SUBMODULE), as the call spells them
    inputs: tuple[str, str] | None = None
    #: a callee kernel's tail (SeamFacts.after)
    after: tuple[cst.BaseStatement, ...] = ()


def _kernel_position(body: cst.IndentedBlock, methods: dict) -> tuple[int, int] | None:
    """(first, last) top-level statement of the attention kernel: one call (an attention
    interface, SDPA, transformers 4's flash helper), or the scores through the output of
    hand-written matmul attention, or one call of a method in METHODS that runs it; None when
    the forward has none of them."""
    kernel_index = _top_index(body, INTERFACE_CALL | SDPA_CALL | FLASH_CALL)
    if kernel_index is not None:
        return kernel_index, kernel_index
    inline = matmul_attention(body) or einsum_attention(body)
    if inline is not None or not methods:
        return inline
    kernel_index = _top_index(body, attention_method_call(methods))
    return None if kernel_index is None else (kernel_index, kernel_index)


def _kernel_facts(
    facts: AttentionFacts,
    body: cst.IndentedBlock,
    first_index: int,
    kernel_index: int,
    methods: dict[str, cst.FunctionDef],
    write: CacheWriteFacts | None = None,
) -> _Kernel | None:
    """The kernel's style, query, scale, sinks and outputs; a problem when it cannot say.
    WRITE: the forward's cache write, which einsum attention is read from (a callee's
    kernel has none and is never einsum attention, ``callee.kernel_position``)."""
    if first_index != kernel_index:
        scores = cst.ensure_type(body.body[first_index], cst.SimpleStatementLine).body[0]
        if einsum_scores(cst.ensure_type(scores, cst.Assign).value) is not None:
            assert write is not None, "einsum attention is read in a forward that writes"
            return _einsum_kernel(facts, body, first_index, kernel_index, write)
        return _matmul_kernel(facts, body, first_index, kernel_index)
    stmt = body.body[kernel_index]
    assign = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) else None
    if isinstance(stmt, cst.If):
        assign = _branch_kernel_assign(stmt)
        if assign is None:
            facts.problems.append(_branch_problem(facts.name, stmt))
            return None
    if not isinstance(assign, (cst.Assign, cst.AnnAssign)) or not isinstance(
        assign.value, cst.Call
    ):
        facts.problems.append(
            f"{facts.name}.forward calls attention in a statement that is not a plain "
            "assignment of its result"
            + (
                " (an if/else whose branches return or differ beyond how they mask)"
                if isinstance(stmt, cst.If)
                else ""
            )
        )
        return None
    call = assign.value
    if m.matches(call, attention_method_call(methods)):
        from kvskill.implementer.callee import callee_kernel

        name = cst.ensure_type(call.func, cst.Attribute).attr.value
        return callee_kernel(facts, kernel_index, assign, call, methods[name])
    if m.matches(call, SDPA_CALL):
        style = KernelStyle.SDPA
    elif m.matches(call, FLASH_CALL):
        style = KernelStyle.FLASH
    else:
        style = KernelStyle.INTERFACE
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
    scale = keywords.get("scaling") or keywords.get("scale")
    if style is KernelStyle.FLASH:
        # the helper's own keyword; its default (None) is head_dim ** -0.5, as the seam's
        scale = keywords.get("softmax_scale")
    return _Kernel(
        index=kernel_index,
        style=style,
        query=code(positional[offset]),
        scale=scale,
        sinks=keywords.get("s_aux") or keywords.get("sinks"),
        targets=targets,
    )


#: on the scores, a soft cap (``tanh``) the fused operator has no input for
_SOFT_CAP = m.Call(func=m.Name("tanh") | m.Attribute(attr=m.Name("tanh")))


def _matmul_kernel(
    facts: AttentionFacts,
    body: cst.IndentedBlock,
    scores_index: int,
    output_index: int,
    where: str | None = None,
) -> _Kernel | None:
    """Hand-written attention: ``w = matmul(q, k^T) [* s | / s]``, an additive mask, a softmax
    (maybe upcast), dropout, ``o = matmul(w, v)``. The mask and dropout are the runtime's and
    inference's business; anything else done to the scores cannot be expressed by the fused
    operator and goes to ``fused_limits`` with the reason. WHERE names the function BODY is
    (``X.forward`` unless told)."""
    scores_stmt = cst.ensure_type(body.body[scores_index], cst.SimpleStatementLine)
    assign = cst.ensure_type(scores_stmt.body[0], cst.Assign)
    weights = cst.ensure_type(assign.targets[0].target, cst.Name).value
    product = scores_matmul(assign.value)
    assert product is not None, "matmul_attention found these scores"
    between = list(body.body[scores_index + 1 : output_index])
    where = where or f"{facts.name}.forward"
    scale = _read_scale(facts, weights, assign.value, between, where)
    output = _assigned_name(body.body[output_index])
    # the softmaxed weights may have their own name (mpt: attention_scores -> attn_weights)
    probs = _matmul_operand(body.body[output_index])
    targets = [output, weights] + ([probs] if probs not in (None, weights, output) else [])
    if m.matches(product, BIAS_SCORES_CALL):
        return _bias_kernel(facts, product, output_index, targets)
    return _Kernel(
        index=output_index,
        style=KernelStyle.MATMUL,
        query=code(product.args[0].value),
        scale=scale,
        sinks=None,
        targets=targets,
    )


def _read_scale(
    facts: AttentionFacts,
    weights: str,
    value: cst.BaseExpression,
    between: list[cst.BaseStatement],
    where: str,
) -> str:
    """The softmax scale of hand-written scores ``weights = VALUE`` (the product, maybe
    times or divided by a scale), or of the one later ``w = w / s`` in BETWEEN; what else
    BETWEEN does to the scores goes to ``fused_limits`` (:func:`_score_changes`)."""
    folded = None if isinstance(value, cst.BinaryOperation) else _later_scale(weights, between)
    if folded is not None:
        # GPT-J / CodeGen: the product, the causal mask, then ``w = w / self.scale_attn``:
        # one scale all the same (a masked score stays far below every other one)
        value = cst.ensure_type(
            cst.ensure_type(between[folded], cst.SimpleStatementLine).body[0], cst.Assign
        ).value
        between = between[:folded] + between[folded + 1 :]
    facts.fused_limits.extend(_score_changes(where, weights, between))
    if not isinstance(value, cst.BinaryOperation):
        return "1.0"  # the source applies no scale to q.k
    factor = code(value.right)
    # a divisor that is one term (a name, a call, a literal, parenthesised) needs no parens
    atom = value.right.lpar or isinstance(
        value.right, (cst.Name, cst.Attribute, cst.Call, cst.Integer, cst.Float)
    )
    divisor = factor if atom else f"({factor})"
    return factor if isinstance(value.operator, cst.Multiply) else f"1 / {divisor}"


def _einsum_kernel(
    facts: AttentionFacts,
    body: cst.IndentedBlock,
    scores_index: int,
    output_index: int,
    write: CacheWriteFacts,
) -> _Kernel | None:
    """Hand-written einsum attention (``implementer/einsum_attention.py`` proves it is
    scaled dot-product attention and reads the order of its output); the scale and what
    else is done to the scores are read as for matmul attention."""
    from kvskill.implementer.einsum_attention import hand_back, read_einsum_attention

    assign = cst.ensure_type(
        cst.ensure_type(body.body[scores_index], cst.SimpleStatementLine).body[0], cst.Assign
    )
    weights = cst.ensure_type(assign.targets[0].target, cst.Name).value
    product = einsum_scores(assign.value)
    assert product is not None, "einsum_attention found these scores"
    inside = list(body.body[write.index : scores_index])
    query = _name_before(product.args[1].value, inside)
    reading = read_einsum_attention(
        facts,
        body,
        scores_index,
        output_index,
        write_index=write.index,
        layout=write.layout.value,
        qkv=(query, write.key, write.value),
    )
    if reading is None:
        return None
    between = list(body.body[scores_index + 1 : output_index])
    scale = _read_scale(facts, weights, assign.value, between, f"{facts.name}.forward")
    output = _assigned_name(body.body[output_index])
    return _Kernel(
        index=output_index,
        style=KernelStyle.EINSUM,
        query=reading.query,
        scale=scale,
        sinks=None,
        targets=[output, *dict.fromkeys(n for n in (weights, reading.probs) if n != output)],
        after=tuple(hand_back(output, reading.output_roles)),
    )


def _bias_kernel(
    facts: AttentionFacts, product: cst.Call, output_index: int, targets: list[str]
) -> _Kernel | None:
    """``w = bias.baddbmm(q, k, beta=..., alpha=scale)``: the scores start from BIAS."""
    bias = code(cst.ensure_type(product.func, cst.Attribute).value)
    args = {a.keyword.value if a.keyword else str(i): a.value for i, a in enumerate(product.args)}
    query = args.get("batch1", args.get("0"))
    if query is None:
        facts.problems.append(f"{facts.name}.forward passes {bias}.baddbmm no query")
        return None
    facts.fused_limits.append(
        f"{facts.name}.forward starts its attention scores from {bias} ({bias}.baddbmm, a "
        "position bias such as ALiBi, over [batch * heads, s, d]); the fused operator takes no "
        "ALiBi slopes"
    )
    alpha = args.get("alpha")
    return _Kernel(
        index=output_index,
        style=KernelStyle.BIAS_BMM,
        query=code(query),
        scale=code(alpha) if alpha is not None else "1.0",
        sinks=None,
        targets=targets,
        bias=bias,
    )


class _BindParams(cst.CSTTransformer):
    """An expression of a method's parameters rewritten in the caller's arguments."""

    def __init__(self, bound: dict[str, cst.BaseExpression]) -> None:
        super().__init__()
        self.bound = bound

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        # only the value holds names to bind (leave_Attribute); ``.attr`` is never a parameter
        return False

    def leave_Attribute(
        self, original_node: cst.Attribute, updated_node: cst.Attribute
    ) -> cst.BaseExpression:
        return updated_node.with_changes(value=original_node.value.visit(self))

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.BaseExpression:
        arg = self.bound.get(original_node.value)
        if arg is None:
            return updated_node
        if isinstance(arg, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)):
            return arg
        return arg.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def _updated(
    name: str, operator: m.BaseMatcherNode, augmented: m.BaseMatcherNode
) -> m.BaseMatcherNode:
    """``name = name <operator> ...`` or ``name <augmented>= ...``."""
    return m.Assign(
        targets=[m.AssignTarget(target=m.Name(name))],
        value=m.BinaryOperation(left=m.Name(name), operator=operator),
    ) | m.AugAssign(target=m.Name(name), operator=augmented)


def _later_scale(weights: str, between: list[cst.BaseStatement]) -> int | None:
    """The index in BETWEEN of the one top-level ``w = w / s`` (or ``* s``) before the softmax
    that scales scores the product left unscaled, when S reads neither the scores nor a mask;
    else None."""
    scaled = m.SimpleStatementLine(
        body=[
            m.Assign(
                targets=[m.AssignTarget(target=m.Name(weights))],
                value=m.BinaryOperation(left=m.Name(weights), operator=m.Multiply() | m.Divide()),
            )
        ]
    )
    found = []
    for index, stmt in enumerate(between):
        if m.findall(stmt, SOFTMAX_CALL):
            break
        if m.matches(stmt, scaled):
            factor = cst.ensure_type(
                cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign
            )
            names = _used_names(
                [
                    cst.SimpleStatementLine(
                        [cst.Expr(cst.ensure_type(factor.value, cst.BinaryOperation).right)]
                    )
                ]
            )
            if weights not in names and not any("mask" in n.lower() for n in names):
                found.append(index)
    return found[0] if len(found) == 1 else None


def _is_head_mask(stmt: cst.BaseStatement, weights: str) -> bool:
    """``w = w * head_mask`` (under ``if head_mask is not None``), after the softmax: GPT-2's
    per-head mask, which generation never passes (the runtime calls the model without one)."""
    product = _updated(weights, m.Multiply(), m.MultiplyAssign())
    for node in m.findall(stmt, product):
        if isinstance(node, cst.Assign):
            factor = cst.ensure_type(node.value, cst.BinaryOperation).right
        else:
            factor = cst.ensure_type(node, cst.AugAssign).value
        if not (isinstance(factor, cst.Name) and "head_mask" in factor.value):
            return False
    return bool(m.findall(stmt, product))


def _score_changes(where: str, weights: str, between: list[cst.BaseStatement]) -> list[str]:
    """What the statements of WHERE (``X.forward``) between the scores and the output do to
    the scores WEIGHTS beyond an additive mask and a softmax: a soft cap (tanh), a rescale
    after the product, an added term that is not a mask (a position bias such as ALiBi). A
    head mask applied to the softmaxed weights (:func:`_is_head_mask`) is not a change."""
    if any(m.findall(stmt, _SOFT_CAP) for stmt in between):
        return [
            f"{where} soft-caps its attention scores (tanh); the fused operator has no "
            "soft-capping input"
        ]
    softmax = next((i for i, s in enumerate(between) if m.findall(s, SOFTMAX_CALL)), len(between))
    rescaled = _updated(weights, m.Multiply() | m.Divide(), m.MultiplyAssign() | m.DivideAssign())
    if any(
        m.findall(stmt, rescaled) and not (i > softmax and _is_head_mask(stmt, weights))
        for i, stmt in enumerate(between)
    ):
        return [
            f"{where} rescales its attention scores after the product; the fused "
            "operator takes one softmax scale"
        ]
    added = m.Assign(
        targets=[m.AssignTarget(target=m.Name(weights))], value=m.BinaryOperation(operator=m.Add())
    ) | m.AugAssign(target=m.Name(weights), operator=m.AddAssign())
    for stmt in between:
        for node in m.findall(stmt, added):
            if isinstance(node, cst.AugAssign):
                terms = [node.value]
            else:
                # w = w + mask + bias parses as ((w + mask) + bias): every term but w
                terms = _sum_terms(cst.ensure_type(node, cst.Assign).value)
                if not m.matches(terms[0], m.Name(weights)):
                    continue
                terms = terms[1:]
            for term in terms:
                names = {cst.ensure_type(n, cst.Name).value for n in m.findall(term, m.Name())}
                if not any("mask" in n.lower() for n in names):
                    return [
                        f"{where} adds {code(term)} to its attention scores (a position "
                        "bias such as ALiBi); the paged seam adds only the causal mask"
                    ]
    return []


def _sum_terms(value: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The terms of ``a + b + c`` (unparenthesised), left to right."""
    if (
        isinstance(value, cst.BinaryOperation)
        and isinstance(value.operator, cst.Add)
        and not value.lpar
    ):
        return [*_sum_terms(value.left), value.right]
    return [value]


def _matmul_operand(stmt: cst.BaseStatement) -> str | None:
    """The first operand of ``o = matmul(w, v)`` when it is a name."""
    line = cst.ensure_type(stmt, cst.SimpleStatementLine)
    call = cst.ensure_type(cst.ensure_type(line.body[0], cst.Assign).value, cst.Call)
    first = call.args[0].value if call.args else None
    return first.value if isinstance(first, cst.Name) else None


def _assigned_name(stmt: cst.BaseStatement) -> str:
    line = cst.ensure_type(stmt, cst.SimpleStatementLine)
    assign = cst.ensure_type(line.body[0], cst.Assign)
    return cst.ensure_type(assign.targets[0].target, cst.Name).value


def _branch_kernel_assign(stmt: cst.If) -> cst.Assign | None:
    """The kernel assignment of an ``if``/``else`` whose every branch assigns the same targets
    from the same attention call on the same query, key and value, differing only in how it
    masks (ChatGLM: ``is_causal=True`` without a mask, else the mask): the fused operator
    masks by itself, so the branches are one kernel call. None for any other ``if``."""
    if m.findall(stmt, m.Return()):
        # branches that return (falcon: one per position-bias kind, each with its own
        # output projection) are more than a kernel call: the seam cannot replace them
        return None
    assigns = [
        cst.ensure_type(a, cst.Assign)
        for a in m.findall(stmt, m.Assign(value=INTERFACE_CALL | SDPA_CALL))
    ]
    branches, node = 0, stmt
    while isinstance(node, cst.If):
        branches += 1
        node = node.orelse.body if isinstance(node.orelse, cst.Else) else node.orelse
    if node is None or not assigns or len(assigns) != branches + 1:
        return None
    first = assigns[0]

    def signature(assign: cst.Assign) -> tuple[str, list[str], str | None]:
        call = cst.ensure_type(assign.value, cst.Call)
        positional = [code(a.value) for a in call.args if a.keyword is None][:3]
        keywords = {a.keyword.value: code(a.value) for a in call.args if a.keyword is not None}
        return code(assign.targets[0].target), positional, keywords.get("scale")

    if any(signature(a) != signature(first) for a in assigns[1:]):
        return None
    return first


def _branch_problem(name: str, stmt: cst.If) -> str:
    """Why the ``if`` holding a forward's attention is not one kernel call: its test, whether
    its branches return, and the ALiBi bias one of them adds (Falcon: ``if alibi is None:``
    SDPA, else matmul scores plus ``alibi``, each branch with its own output projection)."""
    branches: list[cst.CSTNode] = []
    node: cst.If | cst.Else | None = stmt
    while isinstance(node, cst.If):
        branches.append(node.body)
        node = node.orelse
    if isinstance(node, cst.Else):
        branches.append(node.body)
    biased = sorted(
        {
            cst.ensure_type(n, cst.Name).value
            for body in branches
            for n in m.findall(body, m.Name())
            if "alibi" in cst.ensure_type(n, cst.Name).value.lower()
        }
    )
    what = []
    if m.findall(stmt, m.Return()):
        what.append("each branch returns its own output")
    if biased:
        what.append(f"a branch reads {', '.join(biased)}, an ALiBi bias")
    return (
        f"{name}.forward runs attention inside `if {code(stmt.test)}:`"
        + (f" ({'; '.join(what)})" if what else "")
        + ", not in one kernel call; the seam (paged or Legacy) replaces or wraps one kernel "
        "call, and branches that differ beyond how they mask are more than one"
    )


def _root_name(node: cst.BaseExpression) -> str | None:
    """``q`` of ``q``, ``q.permute(...)``, ``q[...]``, ``q.transpose(1, 2).contiguous()``."""
    while True:
        if isinstance(node, cst.Name):
            return node.value
        if isinstance(node, cst.Attribute):
            node = node.value
        elif isinstance(node, cst.Call):
            node = node.func
        elif isinstance(node, cst.Subscript):
            node = node.value
        else:
            return None


def _name_before(expr: cst.BaseExpression, inside: list[cst.BaseStatement]) -> str:
    """The name EXPR's tensor had before the seam, following ``q2 = q.transpose(...)``
    renames inside it backwards; the expression's own text when it has no root name."""
    name = _root_name(expr)
    if name is None:
        return code(expr)
    for stmt in reversed(inside):
        for assign in m.findall(stmt, m.Assign(targets=[m.AssignTarget(target=m.Name(name))])):
            source = _root_name(cst.ensure_type(assign, cst.Assign).value)
            if source is not None and source != name:
                name = source
    return name


def _packs_cache(value: cst.BaseExpression, cache_names: set[str]) -> bool:
    """``None``, ``(k, v)`` of cache names, or a conditional of those."""
    if m.matches(value, m.Name("None")):
        return True
    if isinstance(value, cst.Tuple):
        return bool(value.elements) and all(
            isinstance(e.value, cst.Name) and e.value.value in cache_names for e in value.elements
        )
    if isinstance(value, cst.IfExp):
        return _packs_cache(value.body, cache_names) and _packs_cache(value.orelse, cache_names)
    return False


def _cache_only_names(
    body: cst.IndentedBlock, start: int, end: int, cache_names: set[str]
) -> list[str]:
    """Names the seam assigns only the source's own cache to (``present = (k, v) if use_cache
    else None``) and later code reads: the paged cache replaces them, so they become None."""
    inside = list(body.body[start:end])
    after = list(body.body[end + 1 :])
    nulled = []
    for name in sorted(_assigned_names(inside) & _used_names(after)):
        assigns = [
            cst.ensure_type(a, cst.Assign)
            for stmt in inside
            for a in m.findall(stmt, m.Assign(targets=[m.AssignTarget(target=m.Name(name))]))
        ]
        if assigns and all(_packs_cache(a.value, cache_names) for a in assigns):
            nulled.append(name)
    return nulled


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
    """The seam is replaced wholesale by the fused operator: nothing it defines may be read
    after it, except the kernel's outputs (which the replacement defines again), and the KV
    heads must pair as the operator pairs them. Legacy keeps these statements, so these are
    ``fused_limits``."""
    inside = list(body.body[seam.update_index : seam.kernel_index])
    after = list(body.body[seam.kernel_index + 1 :])
    leaked = (_bound_names(inside) - set(seam.targets)) & _used_names(after)
    leaked -= {seam.key, seam.value, seam.query, *seam.nulled}
    tiled = m.Call(
        func=m.Attribute(value=m.Name(seam.key) | m.Name(seam.value), attr=m.Name("repeat"))
    )
    if any(m.findall(stmt, tiled) for stmt in inside):
        facts.fused_limits.append(
            f"{facts.name}.forward tiles its KV heads with .repeat before attention (query head "
            "h reads KV head h % KVN); the fused operator pairs query head h with KV head h // G"
        )
    from kvskill.implementer.einsum_attention import misgrouped_kv_heads

    misgrouped = misgrouped_kv_heads(inside[1:], seam.layout.value, seam.key, seam.value)
    if misgrouped:
        facts.fused_limits.append(
            f"{facts.name}.forward copies its KV heads before the head axis (`{misgrouped[0]}`): "
            "merged, query head h reads KV head h % KVN; the fused operator pairs query head h "
            "with KV head h // G"
        )
    facts.query_changes = _query_changes(seam, inside)
    facts.seam_stores = _escaping_stores(inside)
    for store in facts.seam_stores:
        facts.fused_limits.append(seam_store_limit(facts.name, store))
    if leaked:
        facts.seam_leaks = sorted(leaked)
        facts.fused_limits.append(seam_leak_limit(facts.name, facts.seam_leaks))


def _bound_names(stmts: list[cst.BaseStatement]) -> set[str]:
    """Names STMTS bind (``x = ...``, ``a, b = ...``, ``for x in``): not the bases of the
    subscripts and attributes they store into (``d[k] = v`` binds no name)."""
    names: set[str] = set()
    for stmt in stmts:
        for target in m.findall(stmt, m.AssignTarget() | m.AnnAssign() | m.For()):
            node = target.target
            elements = node.elements if isinstance(node, (cst.Tuple, cst.List)) else [node]
            for element in elements:
                value = element.value if isinstance(element, cst.BaseElement) else element
                if isinstance(value, cst.Name):
                    names.add(value.value)
    return names


@dataclass(frozen=True, kw_only=True)
class SeamStore:
    """A store into an object the seam did not create (``shared[k] = v``, ``self.x = v``)."""

    #: the object stored into
    base: str
    #: the top-level seam statement holding the store, and the store's own line
    statement: cst.BaseStatement
    line: str


def _escaping_stores(inside: list[cst.BaseStatement]) -> list[SeamStore]:
    """Stores into subscripts or attributes of names the seam does not bind: the object
    outlives the seam (a forward parameter, ``self``), so dropping the store changes what
    others see."""
    local = _bound_names(inside)
    stores = []
    for stmt in inside:
        for node in m.findall(stmt, m.AssignTarget(target=m.Subscript() | m.Attribute())):
            target = cst.ensure_type(node, cst.AssignTarget).target
            base = target.value if isinstance(target, (cst.Subscript, cst.Attribute)) else None
            while isinstance(base, (cst.Subscript, cst.Attribute)):
                base = base.value
            if isinstance(base, cst.Name) and base.value not in local:
                stores.append(SeamStore(base=base.value, statement=stmt, line=code(target)))
    return stores


def seam_store_limit(name: str, store: SeamStore) -> str:
    """The limit of a seam that stores into an object living beyond it."""
    return (
        f"{name}.forward stores into {store.base} (`{store.line} = ...`) between the cache "
        "write and the attention call, which the rewrite replaces: the store would be dropped"
    )


def seam_leak_limit(name: str, leaked: list[str]) -> str:
    """The limit of a seam whose names LEAKED are read after the kernel."""
    return (
        f"{name}.forward uses {leaked} after attention, but they are defined "
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
    "BNSD_STYLES",
    "AttentionFacts",
    "CacheLayout",
    "CacheWriteFacts",
    "KernelStyle",
    "SeamFacts",
    "SeamStore",
    "attention_facts",
    "cache_write_facts",
    "causal_lm_classes",
    "init_owner",
    "module_classes",
    "class_assigns",
    "code",
    "is_attention_class",
    "is_causal_lm_class",
    "is_converted_attention",
    "partial_conversion",
    "query_change_limit",
    "seam_forward",
    "seam_leak_limit",
    "seam_store_limit",
]
