"""The framework's standalone Legacy MLA attention to paged (KVR026).

Input: an attention in the shape of cann-recipes-infer's ``models/glm_5_2`` without its
indexer (``standalone_legacy_mla_facts.py`` reads it): latent (nope) and rope caches the
model's ``init_cache`` allocates as ``[batch * blocks_per_row, block_size, 1, dim]``, written
as rows with ``scatter_update_`` at ``kv_len`` and read by one TND fused attention with
``query_rope`` / ``key_rope`` over the attention's own ``arange`` block table. Output: each
write becomes ``npu_scatter_nd_update_`` of the same states at the step's
``slot_mapping["FullAttention"]``; the fused attention keeps its query, caches, heads, scale
and rope parts and takes its block table, block size (the cache's own), lengths, mask and
sparse mode from the step's metadata and the Plan (absorbed MLA: causal prefill, decode
without a mask); ``__init__``'s pseudo-paged ``self.block_table`` goes. The model class
(``init_cache``'s block table, each step's metadata) is KVR025's.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from kvskill.analyzer.gather import FA_CALL, is_standalone_legacy_mla_attention
from kvskill.implementer._command import ClassRewriteCommand, with_body
from kvskill.implementer.fa_call import host_lengths, sparse_mode_expr
from kvskill.implementer.framework_legacy_codemods import METADATA_MODULE, led_by
from kvskill.implementer.framework_legacy_facts import code
from kvskill.implementer.snippets import statements
from kvskill.implementer.standalone_legacy_codemods import ATTN_TYPE, PagedRowWrites
from kvskill.implementer.standalone_legacy_mla_facts import (
    REPLACED_KEYWORDS,
    MlaAttentionFacts,
    MlaSeam,
    gather_mla_attention,
)
from libcst.codemod.visitors import AddImportsVisitor

_TABLE_ASSIGN = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(m.Attribute(value=m.Name("self"), attr=m.Name("block_table")))]
        )
    ]
)


class StandaloneLegacyMlaAttentionCommand(ClassRewriteCommand):
    """Every standalone Legacy MLA attention class to paged: slot-mapped latent and rope
    writes, the fused attention over the step's block table."""

    DESCRIPTION = (
        "Replace the standalone Legacy MLA attention's scatter_update_ of its latent and rope "
        "rows at kv_len with npu_scatter_nd_update_ at the step's slot_mapping, and read both "
        "caches through the step's block table instead of the model's arange table."
    )

    @classmethod
    def problems(cls, module: cst.Module, spec) -> list[str]:
        return [p for facts in gather_mla_attention(module) for p in facts.problems]

    def visit_Module(self, node: cst.Module) -> bool:
        self.facts: dict[str, MlaAttentionFacts] = {f.name: f for f in gather_mla_attention(node)}
        return True

    def selects(self, cls: cst.ClassDef) -> bool:
        return is_standalone_legacy_mla_attention(cls)

    def rewrite(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        seam = self.facts[original.name.value].seam
        assert seam is not None, "checked before any rewrite"
        AddImportsVisitor.add_needed_import(self.context, METADATA_MODULE, "get_forward_metadata")
        body = []
        for stmt in updated.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == seam.method:
                stmt = self._convert(stmt, seam)
            elif isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                stmt = _without_table(stmt)
            body.append(stmt)
        return with_body(updated, body)

    def _paged_keywords(self, seam: MlaSeam) -> list[str]:
        modes = self.spec.sparse_mode[ATTN_TYPE]
        sparse, mask = sparse_mode_expr(modes), "md.attention_mask"
        if modes["prefill"] != modes["decode"]:
            # absorbed MLA decodes without a mask (sparse_mode 0): the 2048 tile is for prefill
            mask = "md.attention_mask if md.is_prefill else None"
        return [
            f"atten_mask={mask}",
            f"sparse_mode={sparse}",
            f'block_table=md.block_table["{ATTN_TYPE}"]',
            f"block_size={seam.writes[0].cache}.shape[1]",
            f"actual_seq_lengths={host_lengths('actual_seq_lengths_cu_q')}",
            f"actual_seq_lengths_kv={host_lengths('actual_seq_lengths_kv')}",
        ]

    def _convert(self, func: cst.FunctionDef, seam: MlaSeam) -> cst.FunctionDef:
        config = self.parser_config()
        old = list(cst.ensure_type(func.body, cst.IndentedBlock).body)
        kernel_stmt = old[seam.kernel_index]
        assign = cst.ensure_type(m.findall(kernel_stmt, m.Assign(value=FA_CALL))[0], cst.Assign)
        call = cst.ensure_type(assign.value, cst.Call)
        kept = [
            code(a)
            for a in call.args
            if a.keyword is None or a.keyword.value not in REPLACED_KEYWORDS
        ]
        kernel = statements(
            "standalone_legacy_mla_seam.py.j2",
            config,
            output=code(assign.targets[0].target),
            call=code(call.func),
            args=[a.rstrip(",").strip() for a in kept] + self._paged_keywords(seam),
        )
        writes = PagedRowWrites(seam.npu, config)
        new: list[cst.BaseStatement] = []
        for index, stmt in enumerate(old):
            if index == seam.kernel_index:
                new.extend(led_by(stmt, kernel))
            else:
                new.append(cst.ensure_type(stmt.visit(writes), cst.BaseStatement))
        block = cst.ensure_type(func.body, cst.IndentedBlock)
        return func.with_changes(body=block.with_changes(body=new))


def _without_table(init: cst.FunctionDef) -> cst.FunctionDef:
    """``__init__`` without its ``self.block_table = ...`` statements (the pseudo-paged
    table; the step's block table replaces it)."""
    block = cst.ensure_type(init.body, cst.IndentedBlock)
    kept = [s for s in block.body if not m.matches(s, _TABLE_ASSIGN)]
    return init.with_changes(body=block.with_changes(body=kept))


__all__ = ["StandaloneLegacyMlaAttentionCommand"]
