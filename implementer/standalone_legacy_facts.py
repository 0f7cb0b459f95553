"""Facts of the framework's standalone Legacy models, read by structure, for the mode 2 rewrite.

Such a model (``gather.is_standalone_legacy_attention``) keeps its caches where its own runner
asks for them: the model class allocates them (``init_cache(input_ids)`` returns one
``[batch, max_len, kv_heads * head_dim]`` BSH tensor per key / value and layer) and builds each
step's inputs (``prepare_inputs_for_generation``: ``kv_len`` 0 in prefill, the row's length in
decode); the runner keeps both between steps. The attention:

    method body (top-level statements)                what the mode 2 rewrite does with it
    ---------------------------------------------    --------------------------------------
    ... projections, rotary ...                       kept
    [if <cache>:] scatter_update_(k rows, kv_len, key, -2)   npu_scatter_nd_update_ of the
                  scatter_update_(v rows, kv_len, value, -2)  same states at the step's slots
    if q_len == 1: out = FA(q, k rows, v rows, BSH)   one TND fused attention over the
    else:          out = FA(q, key, value, BSH)        static block table, [T, N, D] viewed
                                                       back to the query's BSH shape

and the model class:

    init_cache:  cache_shape = (batch, max_len, width)   (total_blocks, block_size, width) and
                                                         a static block table
             or blocks (num_blocks, self.block_size,     kept; the step's block table added
             1, dim) already (the MLA form, GLM-5.2)     before its return
    prepare_inputs_for_generation: ... return ...        the step's slots and lengths set as
                                                         the forward metadata before it returns

Anything else is a problem naming the class, the line and the reason; the pipeline refuses
the file with all of them before any rewrite runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import (
    FA_CALL,
    LEGACY_ROW_WRITE,
    causal_lm_classes,
    dotted_name,
    is_standalone_legacy_attention,
    is_standalone_legacy_mla_attention,
    method,
)
from kvskill.implementer.framework_legacy_facts import code, kernel_call
from libcst.metadata import MetadataWrapper, PositionProvider

#: the calls that allocate a cache tensor in ``init_cache``
ALLOCATION = m.Call(func=m.Attribute(attr=m.Name("zeros") | m.Name("empty") | m.Name("ones")))
#: parameters the step-metadata call reads from ``prepare_inputs_for_generation``
STEP_PARAMS = ("input_ids", "kv_len", "is_prefill")


@dataclass(frozen=True, kw_only=True)
class StandaloneSeam:
    """Where the Legacy write and kernel of one attention method sit, and what they read."""

    method: str
    #: (key rows, value rows): the cache tensors the two writes update
    caches: tuple[str, str]
    #: (key, value): the states the writes take
    states: tuple[str, str]
    #: ``torch_npu`` as the file calls it (the writes' receiver)
    npu: str
    kernel_index: int
    query: str
    output: str
    num_heads: str
    num_kv_heads: str
    scale: str | None


@dataclass(kw_only=True)
class StandaloneAttentionFacts:
    """One standalone Legacy attention class and why it cannot be rewritten (if it cannot)."""

    name: str
    line: int
    seam: StandaloneSeam | None = None
    problems: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class StandaloneModelFacts:
    """The model class that allocates the Legacy rows and builds each step's inputs."""

    name: str
    line: int
    #: (batch, max_len, width) of the ``cache_shape = (...)`` tuple in ``init_cache``
    row_shape: tuple[str, str, str] | None = None
    #: or the block count of caches ``init_cache`` allocates already as blocks
    #: ``(num_blocks, self.block_size, 1, dim)`` (the MLA form), read as rows of input_ids
    num_blocks: str | None = None
    #: ``device=`` of the allocations (None: the default device)
    device: str | None = None
    #: already mode 2 (it has ``set_paged_step_metadata``): left as it is
    paged: bool = False
    problems: list[str] = field(default_factory=list)


def line_reader(module: cst.Module):
    """A function giving the first line of any node of MODULE (for the problems' messages)."""
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    return lambda node: positions[node].start.line


def standalone_attention_classes(module: cst.Module) -> list[cst.ClassDef]:
    return [
        c
        for c in m.findall(module, m.ClassDef())
        if isinstance(c, cst.ClassDef) and is_standalone_legacy_attention(c)
    ]


def writer_method(cls: cst.ClassDef) -> cst.FunctionDef | None:
    """The method that writes the rows and attends (``exec_qkv`` or ``forward``)."""
    for func in cls.body.body:
        if isinstance(func, cst.FunctionDef) and m.findall(func, LEGACY_ROW_WRITE):
            return func
    return None


def gather_standalone_attention(module: cst.Module) -> list[StandaloneAttentionFacts]:
    """Facts of every standalone Legacy (MHA / GQA) attention class of MODULE, in file
    order; the MLA ones are not read here."""
    line = line_reader(module)
    found = []
    for cls in standalone_attention_classes(module):
        if is_standalone_legacy_mla_attention(cls):
            continue  # latent and rope caches: standalone_legacy_mla_facts.py reads them
        facts = StandaloneAttentionFacts(name=cls.name.value, line=line(cls))
        writers = [
            f
            for f in cls.body.body
            if isinstance(f, cst.FunctionDef) and m.findall(f, LEGACY_ROW_WRITE)
        ]
        if len(writers) != 1:
            names = ", ".join(f.name.value for f in writers)
            facts.problems.append(
                f"{facts.name} (line {facts.line}) writes its rows in {len(writers)} methods "
                f"({names}); the rewrite converts one method holding both writes and the kernel"
            )
        else:
            facts.seam = _read_seam(writers[0], facts, line)
        found.append(facts)
    return found


def _read_seam(func: cst.FunctionDef, facts: StandaloneAttentionFacts, line):
    where = f"{facts.name}.{func.name.value}"
    problems = facts.problems
    body = list(cst.ensure_type(func.body, cst.IndentedBlock).body)
    calls = [cst.ensure_type(c, cst.Call) for c in m.findall(func, LEGACY_ROW_WRITE)]
    kernels = [i for i, s in enumerate(body) if m.findall(s, FA_CALL)]
    write_stmts = [i for i, s in enumerate(body) if m.findall(s, LEGACY_ROW_WRITE)]
    if len(calls) != 2:
        problems.append(
            f"{where} (line {line(func)}) calls scatter_update_ {len(calls)} times; the rewrite "
            "converts one key and one value write"
        )
        return None
    if len(kernels) != 1 or not write_stmts or max(write_stmts) >= kernels[0]:
        problems.append(
            f"{where} (line {line(func)}) does not write its rows before one top-level "
            "statement holding its fused attention calls (an if/else of the decode and "
            "prefill calls, or one call)"
        )
        return None
    writes = []
    for call in calls:
        args = [code(a.value) for a in call.args]
        bare = m.findall(func, m.Expr(value=m.MatchIfTrue(lambda node, c=call: node is c)))
        if len(args) != 4 or args[3] not in ("-2", "1") or not bare:
            problems.append(
                f"{where} line {line(call)}: `{code(call)}` is not a bare scatter_update_(rows, "
                "kv_len, states, -2) statement along the sequence axis"
            )
            return None
        writes.append(args)
    if writes[0][1] != writes[1][1]:
        problems.append(
            f"{where} line {line(calls[1])}: the key and value writes index different positions "
            f"({writes[0][1]} and {writes[1][1]}); the rewrite writes both at one slot mapping"
        )
        return None
    states = (writes[0][2], writes[1][2])
    kernel = kernel_call(body[kernels[0]], states, where, line, problems)
    if kernel is None:
        return None
    output, query, carried = kernel
    receiver = cst.ensure_type(calls[0].func, cst.Attribute).value
    return StandaloneSeam(
        method=func.name.value,
        caches=(writes[0][0], writes[1][0]),
        states=states,
        npu=dotted_name(receiver),
        kernel_index=kernels[0],
        query=query,
        output=output,
        num_heads=carried["num_heads"],
        num_kv_heads=carried["num_key_value_heads"],
        scale=carried.get("scale"),
    )


def gather_standalone_model(
    module: cst.Module, architecture: str | None
) -> list[StandaloneModelFacts]:
    """Facts of the causal-LM classes of MODULE (the model class the runner drives)."""
    line = line_reader(module)
    heads = set(causal_lm_classes(module, architecture))
    found = []
    for cls in m.findall(module, m.ClassDef()):
        cls = cst.ensure_type(cls, cst.ClassDef)
        if cls.name.value not in heads:
            continue
        facts = StandaloneModelFacts(name=cls.name.value, line=line(cls))
        facts.paged = method(cls, "set_paged_step_metadata") is not None
        _read_init_cache(cls, facts, line)
        _read_step_inputs(cls, facts, line)
        found.append(facts)
    return found


def _read_init_cache(cls: cst.ClassDef, facts: StandaloneModelFacts, line) -> None:
    init_cache = method(cls, "init_cache")
    if init_cache is None:
        facts.problems.append(
            f"{facts.name} (line {facts.line}) has no init_cache; the standalone Legacy rows "
            "are converted where the model allocates them"
        )
        return
    where = f"{facts.name}.init_cache (line {line(init_cache)})"
    shapes = {
        code(cst.ensure_type(s, cst.Assign).targets[0].target): cst.ensure_type(s, cst.Assign)
        for s in m.findall(init_cache, m.Assign(targets=[m.AssignTarget(m.Name())]))
        if isinstance(cst.ensure_type(s, cst.Assign).value, cst.Tuple)
    }
    allocations = [cst.ensure_type(c, cst.Call) for c in m.findall(init_cache, ALLOCATION)]
    if "cache_shape" in shapes:
        _read_rows(init_cache, shapes, allocations, facts, where, line)
    else:
        _read_blocks(init_cache, shapes, allocations, facts, where, line)
    devices = {
        code(a.value)
        for c in allocations
        for a in c.args
        if a.keyword and a.keyword.value == "device"
    }
    facts.device = devices.pop() if len(devices) == 1 else None


def _read_rows(init_cache, shapes, allocations, facts, where: str, line) -> None:
    """The dense form: one ``cache_shape = (batch, max_len, width)`` every allocation takes."""
    assigned = m.findall(init_cache, m.Assign(targets=[m.AssignTarget(m.Name("cache_shape"))]))
    elements = cst.ensure_type(shapes["cache_shape"].value, cst.Tuple).elements
    if len(assigned) != 1 or len(elements) != 3:
        facts.problems.append(
            f"{where} does not set one `cache_shape = (batch, max_len, width)`; the rewrite "
            "turns that BSH row shape into paged blocks"
        )
        return
    others = [c for c in allocations if not c.args or code(c.args[0].value) != "cache_shape"]
    if not allocations or others:
        bad = ", ".join(f"line {line(c)}" for c in others) or "none found"
        facts.problems.append(
            f"{where} allocates tensors other than cache_shape rows ({bad}): states of another "
            "kind are not converted to paged caches"
        )
        return
    facts.row_shape = tuple(code(e.value) for e in elements)  # type: ignore[assignment]


def _read_blocks(init_cache, shapes, allocations, facts, where: str, line) -> None:
    """The MLA form (GLM-5.2's ``create_cache``): every allocation takes a shape
    ``(num_blocks, self.block_size, 1, dim)`` with one ``num_blocks``, and the rows are
    ``input_ids``'s batch."""
    params = {p.name.value for p in init_cache.params.params}
    counts = set()
    for call in allocations:
        shape = shapes.get(code(call.args[0].value)) if call.args else None
        elements = (
            [code(e.value) for e in cst.ensure_type(shape.value, cst.Tuple).elements]
            if shape is not None
            else []
        )
        if len(elements) != 4 or elements[1:3] != ["self.block_size", "1"]:
            facts.problems.append(
                f"{where} line {line(call)}: `{code(call)}` allocates neither the rows of one "
                "`cache_shape = (batch, max_len, width)` nor blocks of a shape "
                "`(num_blocks, self.block_size, 1, dim)`; other states are not converted"
            )
            return
        counts.add(elements[0])
    last = cst.ensure_type(init_cache.body, cst.IndentedBlock).body[-1]
    if not m.matches(last, m.SimpleStatementLine(body=[m.Return()])):
        facts.problems.append(
            f"{where} does not end with its return; the rewrite adds the block table before it"
        )
        return
    if not allocations or len(counts) != 1 or "input_ids" not in params:
        facts.problems.append(
            f"{where} allocates its block-shaped caches with "
            f"{len(counts) or 'no'} block count(s) ({', '.join(sorted(counts))})"
            + ("" if "input_ids" in params else " and takes no input_ids")
            + "; the rewrite builds one block table over one block count, a row per request"
        )
        return
    facts.num_blocks = counts.pop()


def _read_step_inputs(cls: cst.ClassDef, facts: StandaloneModelFacts, line) -> None:
    prepare = method(cls, "prepare_inputs_for_generation")
    if prepare is None:
        facts.problems.append(
            f"{facts.name} (line {facts.line}) has no prepare_inputs_for_generation; the "
            "rewrite sets each step's paged metadata where the runner asks for its inputs"
        )
        return
    params = {p.name.value for p in (*prepare.params.params, *prepare.params.kwonly_params)}
    missing = [p for p in STEP_PARAMS if p not in params]
    body = cst.ensure_type(prepare.body, cst.IndentedBlock).body
    last = body[-1] if body else None
    returns = m.matches(last, m.SimpleStatementLine(body=[m.Return()]))
    if missing or not returns:
        facts.problems.append(
            f"{facts.name}.prepare_inputs_for_generation (line {line(prepare)}) "
            + (f"takes no {' / '.join(missing)}" if missing else "does not end with its return")
            + "; the rewrite builds the step's slots from input_ids, kv_len and is_prefill "
            "before that return"
        )


__all__ = [
    "StandaloneAttentionFacts",
    "StandaloneModelFacts",
    "StandaloneSeam",
    "gather_standalone_attention",
    "gather_standalone_model",
    "line_reader",
    "writer_method",
]
