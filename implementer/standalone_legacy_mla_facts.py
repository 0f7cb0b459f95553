"""Facts of the framework's standalone Legacy MLA attention, read by structure, for KVR026.

Such a class (``gather.is_standalone_legacy_mla_attention``; the shape of cann-recipes-infer's
``models/glm_5_2`` at ``fbc225d``, without its indexer) keeps per layer a latent (nope) and a
rope cache, ``[batch * blocks_per_row, block_size, 1, dim]`` from the model's ``init_cache``,
and reads them through its own "pseudo-paged" table ``arange(batch * blocks_per_row)`` in
which row b owns blocks ``b * blocks_per_row ...``. Its write method:

    method body (top-level statements)                  what KVR026 does with it
    -----------------------------------------------    ----------------------------------
    ... projections, absorb, rotary ...                 kept
    scatter_update_(nope.view(B, -1, r), kv_len, k_nope, 1)    npu_scatter_nd_update_ of the
    scatter_update_(rope.view(B, -1, 64), kv_len, k_pe, 1)     same states at the step's slots
    out, _ = FA(q_nope, <nope>, <nope>,                 the same call, its paging and lengths
                query_rope=q_pe, key_rope=<rope>,       from the step's metadata: block_table,
                input_layout="TND", block_table=...,    block_size (the cache's own), lengths,
                actual_seq_lengths=..., ...)            mask and sparse mode per the Plan

and ``__init__``'s ``self.block_table = ...`` statements (the pseudo-paged table) go. Anything
else is a problem naming the class, the line and the construct; the pipeline refuses the file
with all of them before any rewrite runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import (
    FA_CALL,
    FA_V1,
    LEGACY_ROW_WRITE,
    dotted_name,
    is_standalone_legacy_mla_attention,
)
from kvskill.implementer.framework_legacy_facts import CAUSAL_SPARSE_MODES, code
from kvskill.implementer.standalone_legacy_facts import line_reader

#: keywords of the Legacy call kept as written (heads, scale, the rope parts)
KEPT_KEYWORDS = ("num_heads", "num_key_value_heads", "scale", "query_rope", "key_rope")
#: keywords the paged call sets from the step's metadata and the Plan
REPLACED_KEYWORDS = (
    "atten_mask",
    "sparse_mode",
    "next_tokens",
    "pre_tokens",
    "block_table",
    "block_size",
    "actual_seq_lengths",
    "actual_seq_lengths_kv",
)
#: keywords that may stay only at their default value (no quantized caches)
DEFAULT_ONLY = {"antiquant_mode": ("0",), "antiquant_scale": ("None",)}
#: the one layout whose lengths the step metadata gives as the call reads them
LAYOUT = ('"TND"', "'TND'")
_BLOCK_TABLE_ATTR = m.Attribute(value=m.Name("self"), attr=m.Name("block_table"))


@dataclass(frozen=True, kw_only=True)
class RowWrite:
    """One ``scatter_update_`` of the Legacy method: the cache it lands in and its states."""

    #: the cache tensor under the row view (``nope_cache`` of ``nope_cache.view(B, -1, r)``)
    cache: str
    states: str


@dataclass(frozen=True, kw_only=True)
class MlaSeam:
    """Where the Legacy writes and the one fused call of an MLA attention method sit."""

    method: str
    #: (nope write, rope write), whatever their order in the file
    writes: tuple[RowWrite, RowWrite]
    #: ``torch_npu`` as the file calls it (the writes' receiver)
    npu: str
    kernel_index: int


@dataclass(kw_only=True)
class MlaAttentionFacts:
    """One standalone Legacy MLA attention class and why it cannot be rewritten (if so)."""

    name: str
    line: int
    seam: MlaSeam | None = None
    problems: list[str] = field(default_factory=list)


def mla_attention_classes(module: cst.Module) -> list[cst.ClassDef]:
    return [
        c
        for c in m.findall(module, m.ClassDef())
        if isinstance(c, cst.ClassDef) and is_standalone_legacy_mla_attention(c)
    ]


def gather_mla_attention(module: cst.Module) -> list[MlaAttentionFacts]:
    """Facts of every standalone Legacy MLA attention class of MODULE, in file order."""
    line = line_reader(module)
    found = []
    for cls in mla_attention_classes(module):
        facts = MlaAttentionFacts(name=cls.name.value, line=line(cls))
        writers = [
            f
            for f in cls.body.body
            if isinstance(f, cst.FunctionDef) and m.findall(f, LEGACY_ROW_WRITE)
        ]
        if len(writers) != 1:
            names = ", ".join(f.name.value for f in writers)
            facts.problems.append(
                f"{facts.name} (line {facts.line}) writes its caches in {len(writers)} methods "
                f"({names}); the rewrite converts one method holding both writes and the kernel"
            )
        else:
            facts.seam = _read_seam(writers[0], facts, line)
            if facts.seam is not None:
                _check_table_readers(cls, writers[0], facts.seam, facts)
        found.append(facts)
    return found


def _read_seam(func: cst.FunctionDef, facts: MlaAttentionFacts, line) -> MlaSeam | None:
    where = f"{facts.name}.{func.name.value}"
    body = list(cst.ensure_type(func.body, cst.IndentedBlock).body)
    calls = [cst.ensure_type(c, cst.Call) for c in m.findall(func, LEGACY_ROW_WRITE)]
    kernels = [i for i, s in enumerate(body) if m.findall(s, FA_CALL)]
    writes_at = [i for i, s in enumerate(body) if m.findall(s, LEGACY_ROW_WRITE)]
    if len(calls) != 2:
        facts.problems.append(
            f"{where} (line {line(func)}) calls scatter_update_ {len(calls)} times; the rewrite "
            "converts one latent (nope) and one rope write"
        )
        return None
    if len(kernels) != 1 or max(writes_at) >= kernels[0]:
        facts.problems.append(
            f"{where} (line {line(func)}) does not write its caches before one top-level "
            "statement holding its one fused attention call"
        )
        return None
    writes = [_row_write(call, func, where, line, facts.problems) for call in calls]
    if None in writes:
        return None
    indices = {code(_arg(c, 1, "indices")) for c in calls}
    if len(indices) != 1:
        facts.problems.append(
            f"{where} line {line(calls[1])}: the two writes index different positions "
            f"({', '.join(sorted(indices))}); the rewrite writes both at one slot mapping"
        )
        return None
    if indices != {"kv_len"}:
        facts.problems.append(
            f"{where} line {line(calls[0])}: the writes start at {indices.pop()}, not at the "
            "runner's kv_len the step's slots are built from"
        )
        return None
    kernel = _read_kernel(body[kernels[0]], where, line, facts.problems)
    if kernel is None:
        return None
    nope, rope = kernel
    by_cache = {w.cache: w for w in writes if w is not None}
    if set(by_cache) != {nope, rope} or nope == rope:
        facts.problems.append(
            f"{where} line {line(body[kernels[0]])}: the fused attention reads {nope} (key / "
            f"value) and {rope} (key_rope), not the two caches the writes update "
            f"({', '.join(sorted(by_cache))})"
        )
        return None
    receiver = cst.ensure_type(calls[0].func, cst.Attribute).value
    return MlaSeam(
        method=func.name.value,
        writes=(by_cache[nope], by_cache[rope]),
        npu=dotted_name(receiver),
        kernel_index=kernels[0],
    )


def _arg(call: cst.Call, index: int | None, keyword: str) -> cst.BaseExpression:
    """The argument of CALL at positional INDEX (None: keyword only) or given as KEYWORD."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == keyword:
            return arg.value
    positional = [a for a in call.args if a.keyword is None]
    if index is None or index >= len(positional):
        return cst.Name("None")
    return positional[index].value


def _row_write(call: cst.Call, func, where: str, line, problems: list[str]) -> RowWrite | None:
    """A bare ``scatter_update_(<cache>[.view(...)], kv_len, states, axis 1)`` statement."""
    rows = _arg(call, 0, "input")
    # GLM-5.2 writes a row view of the block-shaped cache: the cache is under the view
    is_view = m.matches(rows, m.Call(func=m.Attribute(attr=m.Name("view"))))
    cache = (
        cst.ensure_type(cst.ensure_type(rows, cst.Call).func, cst.Attribute).value
        if is_view
        else rows
    )
    bare = m.findall(func, m.Expr(value=m.MatchIfTrue(lambda node: node is call)))
    axis = code(_arg(call, 3, "axis"))
    # -2 is the sequence axis of 3-D rows only; of a 4-D view it would be the head axis
    view_rank = len(cst.ensure_type(rows, cst.Call).args) if is_view else 3
    along = axis == "1" or (axis == "-2" and view_rank == 3)
    if not bare or len(call.args) != 4 or not along or not isinstance(cache, cst.Name):
        problems.append(
            f"{where} line {line(call)}: `{code(call)}` is not a bare scatter_update_(<cache> "
            "or <cache>.view(batch, -1, dim), kv_len, states, 1) statement along the sequence"
        )
        return None
    return RowWrite(cache=cache.value, states=code(_arg(call, 2, "updates")))


def _read_kernel(stmt, where: str, line, problems: list[str]) -> tuple[str, str] | None:
    """(nope cache, rope cache) the one ``out, _ = FA(q, k, v, query_rope=, key_rope=, ...)``
    call reads, after checking every keyword it passes."""
    calls = [cst.ensure_type(c, cst.Call) for c in m.findall(stmt, FA_CALL)]
    assigns = m.findall(stmt, m.Assign(value=FA_CALL))
    call = calls[0]
    op = dotted_name(call.func).rsplit(".", 1)[-1]
    positional = [a.value for a in call.args if a.keyword is None]
    keywords = {a.keyword.value: code(a.value) for a in call.args if a.keyword is not None}
    if len(calls) != 1 or len(assigns) != 1 or op != FA_V1 or len(positional) != 3:
        problems.append(
            f"{where} line {line(stmt)}: the fused attention is not one `out, _ = "
            f"{FA_V1}(query, key, value, ...)` assignment"
        )
        return None
    if keywords.get("input_layout") not in LAYOUT or "block_table" not in keywords:
        problems.append(
            f"{where} line {line(stmt)}: the MLA fused attention passes input_layout="
            f"{keywords.get('input_layout')} and "
            + ("a block_table" if "block_table" in keywords else "no block_table")
            + '; the rewrite converts the pseudo-paged TND read (input_layout="TND" over '
            "the model's own block table)"
        )
        return None
    for name, value in keywords.items():
        bad = _keyword_problem(name, value)
        if bad:
            problems.append(f"{where} line {line(stmt)}: {bad}")
            return None
    keys = {_cache_name(positional[1]), _cache_name(positional[2])}
    rope = _cache_name(_arg(call, None, "key_rope"))
    if len(keys) != 1 or None in keys or rope is None:
        problems.append(
            f"{where} line {line(stmt)}: the fused attention's key and value are not one cache "
            "(the latent read as key and value) beside a key_rope cache"
        )
        return None
    return keys.pop(), rope


def _keyword_problem(name: str, value: str) -> str | None:
    if name in KEPT_KEYWORDS or name in REPLACED_KEYWORDS or name == "input_layout":
        if name == "sparse_mode" and value not in CAUSAL_SPARSE_MODES:
            return (
                f"sparse_mode={value} is not causal full attention (0, 2 or 3); windowed "
                "Legacy attention is not converted"
            )
        return None
    if value in DEFAULT_ONLY.get(name, ()):
        return None
    return (
        f"the fused attention is passed {name}={value}, which the paged MLA rewrite does not "
        "carry over (quantized caches, position bias and windows are not converted)"
    )


def _cache_name(node: cst.BaseExpression) -> str | None:
    """The cache a key-side argument reads: ``c``, ``c.flatten(2)``, ``c.view(...)``."""
    while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        node = node.func.value
    return node.value if isinstance(node, cst.Name) else None


def _check_table_readers(cls: cst.ClassDef, writer, seam: MlaSeam, facts) -> None:
    """The pseudo-paged table goes with the rewrite: only ``__init__`` (which builds it) and
    the fused attention call may name ``self.block_table``."""
    body = cst.ensure_type(writer.body, cst.IndentedBlock).body
    readers = [
        f.name.value
        for f in cls.body.body
        if isinstance(f, cst.FunctionDef)
        and f.name.value not in ("__init__", writer.name.value)
        and m.findall(f, _BLOCK_TABLE_ATTR)
    ]
    if any(m.findall(s, _BLOCK_TABLE_ATTR) for i, s in enumerate(body) if i != seam.kernel_index):
        readers.append(writer.name.value)
    if readers:
        facts.problems.append(
            f"{facts.name} (line {facts.line}) reads self.block_table in "
            f"{', '.join(readers)} besides its fused attention; the rewrite replaces that "
            "pseudo-paged table by the step's block table"
        )


__all__ = [
    "MlaAttentionFacts",
    "MlaSeam",
    "RowWrite",
    "gather_mla_attention",
    "mla_attention_classes",
]
