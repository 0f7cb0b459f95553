"""Facts of the framework's own Legacy attention, read by structure, for its Paged rewrite.

The attention (``gather.is_framework_legacy_attention``) of a cann-recipes-infer Legacy model
gets the packed step as TND tokens and runs its cache and kernel in BSH:

    forward body (top-level statements)            what the Paged rewrite does with it
    ------------------------------------------    ------------------------------------------
    if is_prefill:  <pack TND -> BSH rows>          the step stays one row of T tokens:
    else:           q_len = T // bsz                  bsz, q_len = 1, T ; X = X.view(bsz, q_len, -1)
                    X = X.view(bsz, q_len, -1)
    ... projections, norms, rotary ...             kept
    scatter_update_(k rows, kv_len, key, -2)        \\  TND write at slot_mapping[attn_type],
    scatter_update_(v rows, kv_len, value, -2)       >  TND fused attention over
    <the fused attention call(s), BSH>              /   block_table[attn_type]
    if is_prefill:  out = out...[<packing index>]   its else arm (the BSH -> TND unpacking
    else:           out = out.view(T, -1)             is not needed for one row)

Anything else is a problem naming the class, the line and the reason; the pipeline refuses
the file with all of them before any rewrite runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import (
    CACHE_UNIT_ASSIGN,
    FA_CALL,
    LEGACY_ROW_WRITE,
    dotted_name,
    is_framework_legacy_attention,
    method,
)
from libcst.metadata import MetadataWrapper, PositionProvider

_EMPTY = cst.Module(body=[])
#: the call that scatters packed tokens into BSH rows
INDEX_COPY = m.Call(func=m.Attribute(attr=m.Name("index_copy_")))
#: keywords of the Legacy FA calls the rewrite takes over (their values become the paged
#: call's), keywords it drops because the paged call sets them, and keywords whose default
#: value only may be dropped
CARRIED_KEYWORDS = ("num_heads", "num_key_value_heads", "scale")
REPLACED_KEYWORDS = (
    "input_layout",
    "atten_mask",
    "sparse_mode",
    "next_tokens",
    "actual_seq_lengths",
    "actual_seq_lengths_kv",
)
DEFAULT_ONLY_KEYWORDS = {"antiquant_mode": ("0",), "antiquant_scale": ("None",), "pre_tokens": ()}
#: sparse modes of a causal full-attention Legacy call (2: top-left causal, 3: bottom-right)
CAUSAL_SPARSE_MODES = ("0", "2", "3")


def code(node: cst.CSTNode) -> str:
    return _EMPTY.code_for_node(node).strip()


@dataclass(frozen=True, kw_only=True)
class LegacyForward:
    """Where the pieces of a Legacy forward sit (indexes of its top-level statements)."""

    pack_index: int
    #: the BSH rows and columns names (``bsz``, ``q_len``) and the step's token count
    rows: str
    q_len: str
    total: str
    #: names the decode arm views as [rows, q_len, -1]
    repacked: tuple[str, ...]
    write_indexes: tuple[int, ...]
    kernel_index: int
    unpack_index: int | None
    query: str
    key: str
    value: str
    output: str
    num_heads: str
    num_kv_heads: str
    scale: str | None


@dataclass(kw_only=True)
class LegacyAttentionFacts:
    """One framework Legacy attention class and why it cannot be rewritten (if it cannot)."""

    name: str
    line: int
    #: the expression ``self.cache_unit`` is set to
    cache_unit: str | None = None
    forward: LegacyForward | None = None
    problems: list[str] = field(default_factory=list)


def legacy_attention_classes(module: cst.Module) -> list[cst.ClassDef]:
    return [
        c
        for c in m.findall(module, m.ClassDef())
        if isinstance(c, cst.ClassDef) and is_framework_legacy_attention(c)
    ]


def gather_legacy_attention(module: cst.Module) -> list[LegacyAttentionFacts]:
    """Facts of every framework Legacy attention class of MODULE, in file order."""
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    positions = wrapper.resolve(PositionProvider)

    def line(node: cst.CSTNode) -> int:
        return positions[node].start.line

    found = []
    for cls in legacy_attention_classes(module):
        facts = LegacyAttentionFacts(name=cls.name.value, line=line(cls))
        _read_init(cls, facts, line)
        forward = method(cls, "forward")
        assert forward is not None, "is_framework_legacy_attention needs a forward"
        facts.forward = _read_forward(forward, facts, line)
        found.append(facts)
    return found


def _read_init(cls: cst.ClassDef, facts: LegacyAttentionFacts, line) -> None:
    init = method(cls, "__init__")
    assert init is not None, "is_framework_legacy_attention needs an __init__"
    body = cst.ensure_type(init.body, cst.IndentedBlock).body
    for stmt in body:
        if m.matches(stmt, m.SimpleStatementLine(body=[CACHE_UNIT_ASSIGN])):
            facts.cache_unit = code(cst.ensure_type(stmt.body[0], cst.Assign).value)
    if facts.cache_unit is None:
        facts.problems.append(
            f"{facts.name}.__init__ (line {line(init)}) sets self.cache_unit inside a branch; "
            "the rewrite replaces it only as a statement of the __init__ body"
        )
    assigned = {code(t.target) for a in m.findall(init, m.Assign()) for t in a.targets}
    for name in ("self.k_cache", "self.v_cache"):
        if name not in assigned:
            facts.problems.append(
                f"{facts.name}.__init__ (line {line(init)}) never sets {name}; the Paged "
                "entries are named k_cache / v_cache after the Legacy placeholders"
            )


def _read_forward(
    forward: cst.FunctionDef, facts: LegacyAttentionFacts, line
) -> LegacyForward | None:
    body = list(cst.ensure_type(forward.body, cst.IndentedBlock).body)
    where = f"{facts.name}.forward"
    problems = facts.problems
    writes = [i for i, s in enumerate(body) if m.findall(s, LEGACY_ROW_WRITE)]
    kernels = [i for i, s in enumerate(body) if m.findall(s, FA_CALL)]
    packs = [i for i, s in enumerate(body) if isinstance(s, cst.If) and m.findall(s, INDEX_COPY)]
    if len(kernels) != 1:
        lines = ", ".join(str(line(body[i])) for i in kernels)
        problems.append(
            f"{where} calls the fused attention in {len(kernels)} top-level statements (lines "
            f"{lines}); the rewrite replaces one statement (a call, or an if/else of the "
            "prefill and decode calls)"
        )
        return None
    kernel = kernels[0]
    if len(packs) != 1 or not writes or not packs[0] < writes[0]:
        problems.append(
            f"{where} (line {line(forward)}) has no TND -> BSH packing (`if <prefill>: ... "
            "index_copy_ ... else: ...`) before its scatter_update_ writes; the rewrite "
            "converts the framework's packed-TND Legacy attention only"
        )
        return None
    if len(writes) != 2 or writes[-1] > kernel:
        problems.append(
            f"{where} (line {line(body[writes[0]])}) writes its rows in {len(writes)} "
            "top-level statements; the rewrite converts one K and one V scatter_update_ "
            "before the fused attention"
        )
        return None
    states = [_write_states(body[i], where, line, problems) for i in writes]
    shape = _pack_shape(body[packs[0]], where, line, problems)
    call = kernel_call(body[kernel], states, where, line, problems)
    if None in states or shape is None or call is None:
        return None
    unpack = _unpack_index(body, packs[0], kernel, where, line, problems)
    rows, q_len, total, repacked = shape
    output, query, carried = call
    return LegacyForward(
        pack_index=packs[0],
        rows=rows,
        q_len=q_len,
        total=total,
        repacked=repacked,
        write_indexes=tuple(writes),
        kernel_index=kernel,
        unpack_index=unpack,
        query=query,
        key=states[0],
        value=states[1],
        output=output,
        num_heads=carried["num_heads"],
        num_kv_heads=carried["num_key_value_heads"],
        scale=carried.get("scale"),
    )


def _write_states(stmt: cst.BaseStatement, where: str, line, problems) -> str | None:
    """The states a ``scatter_update_(rows, kv_len, states, -2)`` statement writes."""
    call = m.findall(stmt, LEGACY_ROW_WRITE)[0]
    call = cst.ensure_type(call, cst.Call)
    bare = m.matches(stmt, m.SimpleStatementLine(body=[m.Expr(value=m.Call())]))
    if not bare or len(call.args) != 4 or code(call.args[3].value) not in ("-2", "1"):
        problems.append(
            f"{where} line {line(stmt)}: `{code(call)}` is not a bare scatter_update_(rows, "
            "kv_len, states, -2) statement along the sequence axis"
        )
        return None
    return code(call.args[2].value)


def _pack_shape(stmt: cst.BaseStatement, where: str, line, problems):
    """(rows, q_len, total, repacked names) from the decode arm of the packing ``if``."""
    pack = cst.ensure_type(stmt, cst.If)
    arm = pack.orelse
    if not isinstance(arm, cst.Else):
        problems.append(
            f"{where} line {line(pack)}: the TND -> BSH packing has no else arm (the decode "
            "steps' BSH view), which the rewrite keeps as the one-row view"
        )
        return None
    rows = q_len = total = None
    repacked = []
    for inner in cst.ensure_type(arm.body, cst.IndentedBlock).body:
        target, value = _single_assign(inner)
        if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.FloorDivide):
            q_len, total, rows = target, code(value.left), code(value.right)
            continue
        if (
            isinstance(value, cst.Call)
            and dotted_name(value.func).rsplit(".", 1)[-1] in ("view", "reshape")
            and len(value.args) == 3
            and code(value.args[2].value) == "-1"
        ):
            repacked.append((target, code(value.args[0].value), code(value.args[1].value)))
            continue
        problems.append(
            f"{where} line {line(inner)}: `{code(inner)}` in the decode arm of the packing is "
            "neither `q_len = T // bsz` nor `x = x.view(bsz, q_len, -1)`"
        )
        return None
    if q_len is None or not repacked or any((r, c) != (rows, q_len) for _, r, c in repacked):
        problems.append(
            f"{where} line {line(pack)}: the decode arm of the packing does not view its "
            "tensors as [bsz, q_len, -1] with q_len = T // bsz"
        )
        return None
    return rows, q_len, total, tuple(name for name, _, _ in repacked)


def _single_assign(stmt: cst.BaseStatement) -> tuple[str | None, cst.BaseExpression | None]:
    """(name, value) of a ``name = value`` statement, else (None, None)."""
    one = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())])])
    if not m.matches(stmt, one):
        return None, None
    assign = cst.ensure_type(cst.ensure_type(stmt, cst.SimpleStatementLine).body[0], cst.Assign)
    return cst.ensure_type(assign.targets[0].target, cst.Name).value, assign.value


def kernel_call(stmt, states, where: str, line, problems):
    """(output name, query, carried keywords) of the kernel statement's fused calls.

    Every call must be ``out, _ = <fa>(query, k, v, ..., input_layout="BSH", ...)`` with the
    same query, output and head/scale keywords; one of them reads the states just written
    (the prefill call), the others the cache rows (decode).
    """
    calls = [cst.ensure_type(c, cst.Call) for c in m.findall(stmt, FA_CALL)]
    outputs = {
        code(a.targets[0].target)
        for a in m.findall(stmt, m.Assign(value=FA_CALL))
        if isinstance(a, cst.Assign)
    }
    if len(outputs) != 1 or len(m.findall(stmt, m.Assign(value=FA_CALL))) != len(calls):
        problems.append(
            f"{where} line {line(stmt)}: the fused attention calls do not all assign one "
            "target (`attn_output, _ = ...`)"
        )
        return None
    target = cst.parse_expression(outputs.pop())
    output = code(target.elements[0].value) if isinstance(target, cst.Tuple) else code(target)
    carried: dict[str, str] = {}
    queries, reads_written = set(), False
    for call in calls:
        positional = [code(a.value) for a in call.args if a.keyword is None]
        keywords = {a.keyword.value: code(a.value) for a in call.args if a.keyword is not None}
        if len(positional) != 3 or keywords.get("input_layout") not in ('"BSH"', "'BSH'"):
            problems.append(
                f"{where} line {line(stmt)}: `{dotted_name(call.func)}` is not a BSH call "
                "over (query, key, value); the rewrite converts the Legacy BSH attention"
            )
            return None
        queries.add(positional[0])
        reads_written = reads_written or positional[1:] == list(states)
        for name, value in keywords.items():
            bad = _keyword_problem(name, value)
            if bad:
                problems.append(f"{where} line {line(stmt)}: {bad}")
                return None
            if name in CARRIED_KEYWORDS and carried.setdefault(name, value) != value:
                problems.append(
                    f"{where} line {line(stmt)}: the prefill and decode calls pass different "
                    f"{name}= ({carried[name]} and {value})"
                )
                return None
    missing = [k for k in ("num_heads", "num_key_value_heads") if k not in carried]
    if len(queries) != 1 or not reads_written or missing:
        problems.append(
            f"{where} line {line(stmt)}: the fused attention calls do not read one query and "
            "the keys / values the scatter_update_ writes"
            + (f", or pass no {' / '.join(missing)}=" if missing else "")
        )
        return None
    return output, queries.pop(), carried


def _keyword_problem(name: str, value: str) -> str | None:
    if name in CARRIED_KEYWORDS or name in REPLACED_KEYWORDS:
        if name == "sparse_mode" and value not in CAUSAL_SPARSE_MODES:
            return (
                f"sparse_mode={value} is not causal full attention (0, 2 or 3); windowed "
                "Legacy attention is not converted"
            )
        return None
    if name in DEFAULT_ONLY_KEYWORDS and value in DEFAULT_ONLY_KEYWORDS[name]:
        return None
    return (
        f"the fused attention is passed {name}={value}, which the Paged rewrite does not "
        "carry over (quantized KV, position bias and windows are not converted)"
    )


def _unpack_index(body, pack: int, kernel: int, where: str, line, problems) -> int | None:
    """The ``if`` after the kernel that unpacks BSH rows with a name only the packing arm
    defines (its else arm is kept); None when nothing after the kernel uses such a name."""
    packing = cst.ensure_type(body[pack], cst.If)
    defined = _assigned_names(packing.body)
    if isinstance(packing.orelse, cst.Else):
        defined -= _assigned_names(packing.orelse.body)
    users = [
        i for i, stmt in enumerate(body) if i != pack and i != kernel and _reads(stmt) & defined
    ]
    unpack = [i for i in users if i > kernel and isinstance(body[i], cst.If)]
    if (
        len(unpack) > 1
        or set(users) - set(unpack)
        or (unpack and not isinstance(cst.ensure_type(body[unpack[0]], cst.If).orelse, cst.Else))
    ):
        lines = ", ".join(str(line(body[i])) for i in users)
        problems.append(
            f"{where} reads names only the TND -> BSH packing defines "
            f"({', '.join(sorted(defined))}) at lines {lines}; the rewrite removes them with "
            "the packing only from one `if <prefill>: ... else: ...` unpacking after the kernel"
        )
        return None
    return unpack[0] if unpack else None


def _assigned_names(node: cst.CSTNode) -> set[str]:
    names = {
        n.value
        for t in m.findall(node, m.AssignTarget())
        for n in m.findall(cst.ensure_type(t, cst.AssignTarget).target, m.Name())
    }
    names |= {
        cst.ensure_type(f, cst.FunctionDef).name.value for f in m.findall(node, m.FunctionDef())
    }
    return names


def _reads(node: cst.CSTNode) -> set[str]:
    return {cst.ensure_type(n, cst.Name).value for n in m.findall(node, m.Name())}
