"""The framework's standalone Legacy models to standalone mode 2, in place (KVR024, KVR025).

Input: a model in the shape of cann-recipes-infer's standalone dense models (``models/pangu_7b``
at ``fbc225d``; ``standalone_legacy_facts.py`` reads it): mode 1, BSH rows from the model's
``init_cache`` written with ``scatter_update_`` at ``kv_len``. Output: the same file in mode 2
(seed 003, standalone flow): paged caches, a static block table, slots and lengths built for
every step, ``npu_scatter_nd_update_`` writes and a TND fused attention over the block table.
The runner is not touched: it still calls ``init_cache``, ``prepare_inputs_for_generation``,
``prefill`` / ``decode`` and keeps ``kv_len``; what each returns changed, not how it is driven.

The MLA form of the attention (latent and rope caches) is KVR026's
(``standalone_legacy_mla_codemods.py``).

* KVR024, the attention's write method: each ``scatter_update_(rows, kv_len, states, -2)``
  becomes ``npu_scatter_nd_update_`` of the same states at the step's
  ``slot_mapping["FullAttention"]``; the BSH prefill / decode fused attention becomes one TND
  call over ``block_table["FullAttention"]`` with the step's lengths, viewed back to the BSH
  shape the code after it reads; assignments only the removed calls read go with them.
* KVR025, the model class: ``init_cache`` allocates ``[total_blocks, block_size, width]``
  caches and a static block table instead of ``[batch, max_len, width]`` rows (when it
  allocates blocks already, GLM-5.2's MLA form, the table is added before its return);
  ``prepare_inputs_for_generation`` sets each step's paged metadata
  (``set_paged_step_metadata``) before returning the runner's inputs; ``self.block_size``
  comes from the Plan (``--block-size``).
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import (
    LEGACY_ROW_WRITE,
    is_standalone_legacy_attention,
    is_standalone_legacy_mla_attention,
    method,
)
from kvskill.implementer._command import (
    ClassRewriteCommand,
    ModelClassRewrite,
    append_statements,
    with_body,
)
from kvskill.implementer.fa_call import (
    FA_OPS,
    tnd_paged_kwargs,
)
from kvskill.implementer.framework_legacy_codemods import (
    METADATA_MODULE,
    drop_dead_assignments,
    led_by,
    names_read,
)
from kvskill.implementer.framework_legacy_facts import code
from kvskill.implementer.snippets import methods, render, statements
from kvskill.implementer.standalone_legacy_facts import (
    StandaloneAttentionFacts,
    StandaloneModelFacts,
    StandaloneSeam,
    gather_standalone_attention,
    gather_standalone_model,
    standalone_attention_classes,
)
from libcst.codemod.visitors import AddImportsVisitor

#: the one attn_type of a dense standalone model; the step metadata keys its tables by it
ATTN_TYPE = "FullAttention"
_CACHE_SHAPE = m.SimpleStatementLine(
    body=[m.Assign(targets=[m.AssignTarget(m.Name("cache_shape"))])]
)


def is_standalone_paged(module: cst.Module) -> bool:
    """MODULE is already mode 2: a class sets the paged step metadata (KVR025's method)."""
    return bool(m.findall(module, m.FunctionDef(name=m.Name("set_paged_step_metadata"))))


def standalone_legacy_problems(module: cst.Module) -> list[str]:
    """Why the standalone-Legacy attention rewrite cannot convert MODULE (all reasons)."""
    found = gather_standalone_attention(module)
    if not found and not standalone_attention_classes(module) and not is_standalone_paged(module):
        return [
            "no standalone Legacy attention found (a class one of whose methods writes rows "
            "with scatter_update_ and calls the fused attention, without cache_unit)"
        ]
    return [problem for facts in found for problem in facts.problems]


class StandaloneLegacyAttentionCommand(ClassRewriteCommand):
    """Every standalone Legacy attention class to mode 2: paged writes, one TND kernel."""

    DESCRIPTION = (
        "Replace the standalone Legacy attention's scatter_update_ at kv_len with "
        "npu_scatter_nd_update_ at the step's slot_mapping and its BSH prefill / decode fused "
        "attention with one TND fused attention over the static block table (mode 2)."
    )

    @classmethod
    def problems(cls, module: cst.Module, spec) -> list[str]:
        return standalone_legacy_problems(module)

    def visit_Module(self, node: cst.Module) -> bool:
        self.facts: dict[str, StandaloneAttentionFacts] = {
            f.name: f for f in gather_standalone_attention(node)
        }
        return True

    def selects(self, cls: cst.ClassDef) -> bool:
        # the MLA classes (latent and rope caches) are KVR026's
        return is_standalone_legacy_attention(cls) and not is_standalone_legacy_mla_attention(cls)

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        seam = self.facts[original.name.value].seam
        assert seam is not None, "checked before any rewrite"
        AddImportsVisitor.add_needed_import(self.context, METADATA_MODULE, "get_forward_metadata")
        body = []
        for stmt in updated.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == seam.method:
                stmt = self._convert(stmt, seam)
            body.append(stmt)
        return with_body(updated, body)

    def _fa_kwargs(self, seam: StandaloneSeam) -> list[tuple[str, str]]:
        return tnd_paged_kwargs(
            self.spec.fa_version,
            self.spec.sparse_mode[ATTN_TYPE],
            num_heads=seam.num_heads,
            num_kv_heads=seam.num_kv_heads,
            scale=seam.scale or f"({seam.query}.shape[-1] // {seam.num_heads}) ** -0.5",
            block_table=f'md.block_table["{ATTN_TYPE}"]',
            block_size=f"{seam.caches[0]}.shape[1]",
        )

    def _convert(self, func: cst.FunctionDef, seam: StandaloneSeam) -> cst.FunctionDef:
        config = self.parser_config()
        old = list(cst.ensure_type(func.body, cst.IndentedBlock).body)
        kernel = statements(
            "standalone_legacy_paged_seam.py.j2",
            config,
            output=seam.output,
            npu=seam.npu,
            op=FA_OPS[self.spec.fa_version],
            query=seam.query,
            num_heads=seam.num_heads,
            key_cache=seam.caches[0],
            value_cache=seam.caches[1],
            kwargs=self._fa_kwargs(seam),
        )
        removed = old[seam.kernel_index]
        new: list[cst.BaseStatement] = []
        for index, stmt in enumerate(old):
            if index == seam.kernel_index:
                new.extend(led_by(stmt, kernel))
            else:
                new.append(
                    cst.ensure_type(stmt.visit(PagedRowWrites(seam.npu, config)), cst.BaseStatement)
                )
        new = drop_dead_assignments(new, names_read([removed]))
        block = cst.ensure_type(func.body, cst.IndentedBlock)
        return func.with_changes(body=block.with_changes(body=new))


class PagedRowWrites(cst.CSTTransformer):
    """``scatter_update_(rows, kv_len, states, -2)`` -> the slot-mapped paged write.

    ROWS may be a row view of the cache (``nope_cache.view(batch, -1, dim)``, GLM-5.2's
    form): the paged write flattens the cache itself to one row per slot.
    """

    def __init__(self, npu: str, config: cst.PartialParserConfig) -> None:
        super().__init__()
        self.npu, self.config = npu, config

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        if not m.matches(original, LEGACY_ROW_WRITE):
            return updated
        rows, _, updates, _ = (a.value for a in original.args)
        if m.matches(rows, m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("view")))):
            rows = cst.ensure_type(cst.ensure_type(rows, cst.Call).func, cst.Attribute).value
        cache, states = code(rows), code(updates)
        text = render(
            "standalone_legacy_paged_write.py.j2", npu=self.npu, cache=cache, states=states
        )
        return cst.parse_expression(text.strip(), self.config)


class StandaloneLegacyModelCommand(ModelClassRewrite):
    """The model class: paged ``init_cache`` with a static block table, step metadata set in
    ``prepare_inputs_for_generation``, ``self.block_size``."""

    DESCRIPTION = (
        "Allocate the standalone model's caches as paged blocks with a static block table in "
        "init_cache and set each step's slots and lengths in prepare_inputs_for_generation."
    )

    @classmethod
    def problems(cls, module: cst.Module, spec) -> list[str]:
        found = gather_standalone_model(module, getattr(spec, "causal_lm_class", None))
        if not found:
            return ["no causal-LM class found (a class whose __init__ assigns self.lm_head)"]
        return [problem for facts in found if not facts.paged for problem in facts.problems]

    def visit_Module(self, node: cst.Module) -> bool:
        self.model_facts: dict[str, StandaloneModelFacts] = {
            f.name: f for f in gather_standalone_model(node, self.spec.causal_lm_class)
        }
        return super().visit_Module(node)

    def selects(self, cls: cst.ClassDef) -> bool:
        return super().selects(cls) and method(cls, "set_paged_step_metadata") is None

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        facts = self.model_facts[original.name.value]
        config = self.parser_config()
        AddImportsVisitor.add_needed_import(self.context, METADATA_MODULE, "set_forward_metadata")
        paged_init_cache = _paged_init_cache(facts, config)
        block_size = cst.parse_statement(
            "# tokens per block of the paged caches (standalone mode 2)\n"
            f"self.block_size = {self.spec.block_size}\n",
            config,
        )
        step = cst.parse_statement(
            "self.set_paged_step_metadata(input_ids, kv_len, is_prefill)\n", config
        )
        body = []
        for stmt in updated.body.body:
            if isinstance(stmt, cst.FunctionDef):
                name = stmt.name.value
                if name == "__init__":
                    stmt = append_statements(stmt, [block_size])
                elif name == "init_cache":
                    stmt = paged_init_cache(stmt)
                elif name == "prepare_inputs_for_generation":
                    stmt = _before_return(stmt, step)
            body.append(stmt)
        helper = methods("standalone_legacy_step_metadata.py.j2", config)
        return with_body(updated, [*body, *helper])


def _paged_init_cache(facts: StandaloneModelFacts, config):
    """How KVR025 rewrites FACTS' ``init_cache``: its BSH row shape replaced by blocks and a
    static table, or, when it allocates blocks already (the MLA form), the table added before
    its return."""
    device = f", device={facts.device}" if facts.device else ""
    if facts.row_shape is not None:
        batch, max_len, width = facts.row_shape
        blocks = statements(
            "standalone_legacy_paged_blocks.py.j2",
            config,
            batch=batch,
            max_len=max_len,
            width=width,
            device=device,
        )
        return lambda func: _replace_statement(func, _CACHE_SHAPE, blocks)
    assert facts.num_blocks is not None, "checked before any rewrite"
    table = statements(
        "standalone_legacy_paged_table.py.j2",
        config,
        num_blocks=facts.num_blocks,
        rows="input_ids.shape[0]",
        device=device,
    )
    return lambda func: _before_return(func, *table)


def _replace_statement(func: cst.FunctionDef, matcher, new: list[cst.BaseStatement]):
    """FUNC with the top-level statement matching MATCHER replaced by NEW (comments kept)."""
    block = cst.ensure_type(func.body, cst.IndentedBlock)
    body: list[cst.BaseStatement] = []
    for stmt in block.body:
        body.extend(led_by(stmt, new) if m.matches(stmt, matcher) else [stmt])
    return func.with_changes(body=block.with_changes(body=body))


def _before_return(func: cst.FunctionDef, *stmts: cst.BaseStatement) -> cst.FunctionDef:
    block = cst.ensure_type(func.body, cst.IndentedBlock)
    *rest, last = block.body
    return func.with_changes(body=block.with_changes(body=[*rest, *stmts, last]))


__all__ = [
    "StandaloneLegacyAttentionCommand",
    "StandaloneLegacyModelCommand",
    "PagedRowWrites",
    "standalone_legacy_problems",
]
